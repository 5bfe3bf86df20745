//! Allocator configuration: a [`Config`] struct, and the `TIDEPOOL_ALLOC_CONF` string in the style
//! of `PYTORCH_CUDA_ALLOC_CONF` (`key:value,key:value`).
//!
//! Every key is listed in [`KEYS`] (`tidepool::CONFIG_KEYS`); an unknown key or a bad value is an error naming it (and, for
//! an unknown key, listing the valid ones). Parsing never panics.

use crate::pool::{DEFAULT_MAX_NON_SPLIT_ROUNDING, MIB, RoundupDivisions, Sizing};
use std::fmt;

/// The environment variable read by [`Config::from_env`].
pub const ENV_VAR: &str = "TIDEPOOL_ALLOC_CONF";

/// Set to `1`, turns caching off ([`Config::caching`]) in [`Config::from_env`], like PyTorch's
/// `PYTORCH_NO_CUDA_MEMORY_CACHING=1`.
pub const NO_CACHING_ENV_VAR: &str = "TIDEPOOL_NO_MEMORY_CACHING";

/// How a block freed on one stream may be reused by another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CrossStream {
    /// Another stream takes a whole cached segment once the owner's work on it has completed
    /// (an event query, no host sync). PyTorch's caching allocator has no such reuse
    /// ([`CrossStream::Never`]); its `record_stream` events hold a block the same way.
    #[default]
    Strict,
    /// RMM: another stream may take a cached block at once by waiting on the owner's event on the
    /// device (`cuStreamWaitEvent`), with no host sync.
    WaitEvent,
    /// PyTorch's caching allocator exactly: a stream never takes memory another stream cached
    /// (whole segments under `Strict`, pages of expandable ranges under both); that memory
    /// goes back to the device only when an allocation runs out of memory, and a stream that
    /// needs more reserves it (`cross_stream:never`).
    Never,
}

/// Everything the allocator can be told: from a `TIDEPOOL_ALLOC_CONF` string ([`Config::parse`],
/// [`Config::from_env`]) or built with the `with_*` setters over [`Config::default`]. Fields are
/// public to read; new ones may be added (`#[non_exhaustive]`).
///
/// ```
/// use tidepool::{Config, CrossStream};
/// let c = Config::parse("max_split_size_mb:256,roundup_power2_divisions:4").unwrap();
/// assert_eq!(c.sizing.max_split_size, 256 << 20);
/// assert_eq!(c.sizing.roundup_power2_divisions.for_size(300 << 20), 4);
/// // PyTorch's own strings work as they are:
/// let p = Config::parse("expandable_segments:True,roundup_power2_divisions:[32:256,64:128,>:32]");
/// assert!(p.unwrap().expandable_segments);
/// let err = Config::parse("max_split_size:256").unwrap_err();
/// assert!(err.to_string().contains("unknown key `max_split_size`"));
///
/// let built = Config::default()
///     .with_max_split_size_mb(256)
///     .with_roundup_power2_divisions(tidepool::RoundupDivisions::uniform(4).unwrap())
///     .with_cross_stream(CrossStream::WaitEvent);
/// assert_eq!(built.sizing, c.sizing);
/// assert!(built.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Config {
    /// Rounding, pool and split rules.
    pub sizing: Sizing,
    /// Never reserve more than this many bytes in all (`memory_limit_mb`).
    pub memory_limit: Option<u64>,
    /// Never reserve more than this share of the device's total memory
    /// (`per_process_memory_fraction`, in [0, 1] as PyTorch's: at 0 nothing new is reserved
    /// and only cached memory serves).
    pub memory_fraction: Option<f64>,
    /// Cross-stream reuse policy (`cross_stream:strict|wait_event`).
    pub cross_stream: CrossStream,
    /// Per-stream caches that serve a free and re-allocation of the same size on the same
    /// stream without the global lock (`fast_cache:true|false`, on by default).
    pub fast_cache: bool,
    /// Blocks a stream may cache per size class (`fast_cache_entries`).
    pub fast_cache_entries: usize,
    /// Bytes of small blocks each of a stream's cache lanes may hold, and the most a large
    /// block it holds may have besides (`fast_cache_bytes_mb`).
    pub fast_cache_bytes: u64,
    /// Route every operation through one mutex, with no fast cache and statistics read under
    /// it (`global_lock:true`): PyTorch's design, kept as a comparison point.
    pub global_lock: bool,
    /// Per-stream caches whose locks are *biased* towards the thread that uses them
    /// (`biased_lanes:true|false`, on by default): that thread takes its cache with no atomic
    /// read-modify-write, and another thread's take (a buffer dropped on another thread, a
    /// flush) first revokes the bias with one `membarrier(2)` system call, which makes every
    /// running thread of the process pass a memory barrier. Off: every take is a
    /// compare-and-swap (for processes that want no such interrupts), and `membarrier` is
    /// never called, not even to ask whether it exists (for sandboxes that kill a process on
    /// a system call they do not allow). Linux only: elsewhere, or where the system call is
    /// refused, the caches behave as with `false`.
    pub biased_lanes: bool,
    /// Expandable segments (`expandable_segments:true`, PyTorch's key): one virtual address range
    /// per (stream, pool kind, residency), grown at its end by mapping physical pages and shrunk
    /// page by page, so free memory is never stranded in a half-used segment. Needs a device with
    /// virtual memory; elsewhere the allocator uses ordinary segments (and says so in
    /// `memory_summary`).
    pub expandable_segments: bool,
    /// With expandable segments: a large request that no free block holds may be served by a
    /// *stitched* block, a virtual range of its own onto the free chunks its stream's range
    /// holds in pieces (GMLake's stitching; `expandable_stitching:true|false`, off by default:
    /// its bookkeeping doubles the replayed cost per op where it is used).
    /// Cached and served again with no device call once its chunks are free again.
    pub stitching: bool,
    /// With expandable segments: the free mapped bytes a transient range may keep; above it its
    /// free pages are unmapped and released, once its stream's work on them is done
    /// (`release_threshold_mb`, after `cudaMemPoolAttrReleaseThreshold`; `none` = never, the
    /// default: every finite threshold measured costs map/unmap calls in every training step).
    pub release_threshold: u64,
    /// The virtual addresses each expandable range reserves (`expandable_segments_reserve`,
    /// PyTorch's key): a share of the device's memory, or GiB with a `G` suffix. `None` (the
    /// default): twice the device's memory. Either is capped at
    /// [`MAX_REQUEST`](crate::MAX_REQUEST) (256 TiB). A request no range of its stream has room
    /// for is served by an ordinary segment.
    pub expandable_reserve: Option<ExpandableReserve>,
    /// PyTorch's `garbage_collection_threshold`, in (0, 1): when a new segment is about to be
    /// reserved while reserved memory is past this share of the cap ([`Config::limit`]:
    /// `memory_limit_mb`, `per_process_memory_fraction` or `max_pool_size_mb`; without one, the
    /// device's memory), cached large-pool transient segments (whole, free) are released first,
    /// in passes of those idle at least as long as the average, until the excess is released
    /// (PyTorch's `garbage_collect_cached_blocks`). Small-pool and persistent segments, and
    /// private pools' memory, are never released by it.
    pub garbage_collection_threshold: Option<f64>,
    /// Bytes reserved up front when the allocator is made (`initial_pool_size_mb`, RMM's
    /// `initial_pool_size`; 0: none): one transient large-pool segment of the default stream,
    /// served from later and kept for the allocator's lifetime (`empty_cache`, the garbage
    /// collection and the out-of-memory ladder leave it).
    pub initial_pool_size: u64,
    /// Never reserve more than this many bytes (`max_pool_size_mb`, RMM's `maximum_pool_size`):
    /// a cap like `memory_limit_mb`; past it an allocation climbs the out-of-memory ladder, then
    /// fails with the report.
    pub max_pool_size: Option<u64>,
    /// Caching on (the default) or off (`caching:false`, PyTorch's
    /// `PYTORCH_NO_CUDA_MEMORY_CACHING=1`, also set by [`NO_CACHING_ENV_VAR`]`=1`): off, every
    /// allocation reserves its own segment and every free returns it to the device (after its
    /// stream-ordered uses completed), so the device's memory checkers see every bad access.
    /// The mode to debug with, not to run with.
    pub caching: bool,
    /// PyTorch's `graph_capture_record_stream_reuse` (off by default, as there): a block of a
    /// capture's pool freed during the capture after `record_stream`/`use_on` on another
    /// captured stream is reused within the capture once the device shows that its stream's
    /// later captured work is ordered after each of those uses (the side stream was joined
    /// back: [`Device::capture_ordered_after`](crate::Device::capture_ordered_after)); off, or
    /// where the device cannot tell, the graph holds it until it goes. The allocator that
    /// begins a capture decides, as its configuration is then (its pools' own do not count).
    pub graph_capture_record_stream_reuse: bool,
    /// PyTorch's `throw_on_cudamalloc_oom` (off by default, as there): a new segment or page
    /// growth that would take the reserved memory of the allocator and its private pools past
    /// the cap ([`Config::limit`]; the device's total memory where none is set) is refused at
    /// once, before the device is asked: no cached memory is released and nothing is retried
    /// (no out-of-memory observer, failure callback or other allocator is asked either), the
    /// error is [`AllocError::OutOfMemory`](crate::AllocError) with
    /// [`OomReport::rejected`](crate::OomReport) set, and it counts in
    /// `num_oom_rejections`, not in `num_ooms`. For a process that would rather fail fast
    /// than flush its cache near its share of the device.
    pub throw_on_oom: bool,
    /// The pinned host allocator's rules (`pinned_max_round_threshold_mb`,
    /// `pinned_max_cached_size_mb`), for a [`HostAllocator`](crate::HostAllocator) made with
    /// [`HostAllocator::with_config`](crate::HostAllocator::with_config); the device allocator
    /// does not read them.
    pub pinned: HostConfig,
    /// PyTorch keys accepted so that a `PYTORCH_CUDA_ALLOC_CONF` string works unchanged, but
    /// with no effect on device memory here, as `key:value` in the order given (see
    /// `tidepool::CONFIG_NO_EFFECT_KEYS`); `memory_summary` lists them.
    pub no_effect: Vec<String>,
}

/// The virtual address space of each expandable range ([`Config::expandable_reserve`],
/// PyTorch's `expandable_segments_reserve`).
///
/// ```
/// use tidepool::{Config, ExpandableReserve, GIB};
/// let c = Config::parse("expandable_segments:true,expandable_segments_reserve:16G").unwrap();
/// assert_eq!(c.expandable_reserve, Some(ExpandableReserve::Bytes(16 * GIB)));
/// assert_eq!(ExpandableReserve::Fraction(0.25).bytes(4 * GIB), GIB);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpandableReserve {
    /// A share of the device's total memory (more than 1 allowed).
    Fraction(f64),
    /// Bytes.
    Bytes(u64),
}

impl ExpandableReserve {
    /// The bytes it stands for on a device of `total` bytes, at most
    /// [`MAX_REQUEST`](crate::MAX_REQUEST) (256 TiB).
    pub fn bytes(&self, total: u64) -> u64 {
        let b = match *self {
            ExpandableReserve::Fraction(f) => (total as f64 * f) as u64,
            ExpandableReserve::Bytes(b) => b,
        };
        b.min(crate::types::MAX_REQUEST)
    }
}

/// The pinned host allocator's rules ([`HostAllocator::with_config`](crate::HostAllocator::with_config)),
/// PyTorch's `pinned_max_round_threshold_mb` and `pinned_max_cached_size_mb`: a request of at
/// most `max_round_threshold` whose class is at most `max_cached_size` gets the next power of
/// two (at least [`MIN_HOST_BLOCK`](crate::MIN_HOST_BLOCK)) as its block, another one a block of
/// its own size (what rounding would waste on a large staging buffer: up to half); a freed block larger
/// than `max_cached_size` goes back to the device once its copies completed instead of into
/// the cache.
///
/// ```
/// use std::sync::Arc;
/// use tidepool::{Config, HostAllocator, MIB, SimDevice};
///
/// let conf = Config::parse("pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:8")?;
/// let pinned = HostAllocator::with_config(Arc::new(SimDevice::backed(64 * MIB)), conf.pinned);
/// let big = pinned.alloc(3 * MIB)?;
/// assert_eq!(big.block_size(), 3 * MIB); // not 4 MiB
/// drop(big); // cached: 3 MiB is within max_cached_size
/// let huge = pinned.alloc(9 * MIB)?;
/// drop(huge); // above max_cached_size: back to the device
/// assert_eq!(pinned.stats().reserved_bytes.current, 3 * MIB);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HostConfig {
    /// Requests above it are not rounded to a power of two (bytes; no limit by default).
    pub max_round_threshold: u64,
    /// Freed blocks above it are not cached, and requests above it not rounded (bytes; no limit
    /// by default).
    pub max_cached_size: u64,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig { max_round_threshold: u64::MAX, max_cached_size: u64::MAX }
    }
}

impl HostConfig {
    /// Sets [`HostConfig::max_round_threshold`] (bytes).
    pub fn with_max_round_threshold(mut self, bytes: u64) -> HostConfig {
        self.max_round_threshold = bytes;
        self
    }

    /// Sets [`HostConfig::max_cached_size`] (bytes).
    pub fn with_max_cached_size(mut self, bytes: u64) -> HostConfig {
        self.max_cached_size = bytes;
        self
    }

    /// Whether a request of `bytes` is rounded to its power-of-two size class: at most
    /// `max_round_threshold`, and its class at most `max_cached_size`. (PyTorch compares the
    /// request with both, so a request whose class passes the cached size is rounded and then
    /// freed at every drop; here it gets a block of its own size, which is cached.)
    pub fn rounds(&self, bytes: u64) -> bool {
        let class = bytes.checked_next_power_of_two().unwrap_or(u64::MAX);
        let class = class.max(crate::types::MIN_HOST_BLOCK);
        // BROKEN (`round_past_cached`): the request compared, as PyTorch does.
        let past = if cfg!(tidepool_broken = "round_past_cached") { bytes } else { class };
        bytes <= self.max_round_threshold && past <= self.max_cached_size
    }

    /// Whether a freed block of `size` bytes is cached (else freed once its copies completed).
    pub fn caches(&self, size: u64) -> bool {
        size <= self.max_cached_size
    }
}

/// The alignment of every pointer handed out (CUDA's `cudaMalloc` and RMM guarantee 256 bytes):
/// the smallest `min_block_size` accepted. (Segments are at least this aligned on every device.)
pub const MIN_ALIGN: u64 = 256;

/// Default of [`Config::release_threshold`]: no limit. Measured on the six traces in
/// `data/traces/` (docs/eager-memory.md): any finite threshold below a step's transient footprint
/// unmaps pages after every step's peak and maps them again in the next step (map/unmap calls in
/// steady state), and lowers no peak, since the peak is reached while those pages are in use.
pub const DEFAULT_RELEASE_THRESHOLD: u64 = u64::MAX;

/// Default of [`Config::fast_cache_entries`]: 1024 blocks per class, so that the per-stream
/// byte bound ([`DEFAULT_FAST_CACHE_BYTES`]) is what limits a lane. A training step's forward
/// pass takes more blocks of a class than 16 (the earlier default) before its backward pass
/// frees them; with 1024, gpt2_train's lock-free hits go 398 → 693 and its replay instructions
/// per op 859 → 784, and no peak reserved on the shipped traces and snapshots rises
/// (mobilenetv2_train's falls 0.27 %; `docs/design-notes.md`, "The slow path's sixth pass").
pub const DEFAULT_FAST_CACHE_ENTRIES: usize = 1024;
/// Default of [`Config::fast_cache_bytes`]: 32 MiB per stream.
pub const DEFAULT_FAST_CACHE_BYTES: u64 = 32 * MIB;

impl Default for Config {
    fn default() -> Self {
        Config {
            sizing: Sizing::default(),
            memory_limit: None,
            memory_fraction: None,
            cross_stream: CrossStream::Strict,
            fast_cache: true,
            fast_cache_entries: DEFAULT_FAST_CACHE_ENTRIES,
            fast_cache_bytes: DEFAULT_FAST_CACHE_BYTES,
            global_lock: false,
            biased_lanes: true,
            expandable_segments: false,
            stitching: false,
            release_threshold: DEFAULT_RELEASE_THRESHOLD,
            expandable_reserve: None,
            garbage_collection_threshold: None,
            initial_pool_size: 0,
            max_pool_size: None,
            caching: true,
            graph_capture_record_stream_reuse: false,
            throw_on_oom: false,
            pinned: HostConfig::default(),
            no_effect: Vec::new(),
        }
    }
}

/// Every key `Config::parse` accepts, with what it sets.
pub const KEYS: &[(&str, &str)] = &[
    ("max_split_size_mb", "blocks of at least this many MiB are never split (≥ large_segment_mb)"),
    (
        "roundup_power2_divisions",
        "round sizes to this many steps between powers of two: 0 or a power of two, or PyTorch's \
         per-interval list [64:8,256:4,>:1] (keys in MiB)",
    ),
    (
        "max_non_split_rounding_mb",
        "an oversized block (≥ max_split_size) serves a large request it exceeds by less than \
         this many MiB (≥ 20; default 20)",
    ),
    ("backend", "native (the only backend: PyTorch's key, for its strings)"),
    ("min_block_size", "rounding granularity in bytes (a power of two, 256..=1048576)"),
    ("small_size_mb", "largest request of the small pool, MiB"),
    ("small_segment_mb", "segment size of the small pool, MiB"),
    ("large_segment_mb", "segment size of the large pool, MiB"),
    ("min_large_alloc_mb", "requests of at least this many MiB get their own segment"),
    ("round_large_mb", "own segments are rounded to a multiple of this many MiB"),
    ("memory_limit_mb", "never reserve more than this many MiB"),
    (
        "per_process_memory_fraction",
        "never reserve more than this share of device memory, in [0, 1]",
    ),
    ("cross_stream", "cross-stream reuse: strict, wait_event or never"),
    (
        "fast_cache",
        "per-stream caches that skip the global lock on a same-size reuse: true or false",
    ),
    ("fast_cache_entries", "blocks a stream caches per size class, 1..=65536"),
    (
        "fast_cache_bytes_mb",
        "MiB of small blocks a stream cache lane holds (and of its one large block), 1..=1048576",
    ),
    ("global_lock", "route everything through one mutex (no fast cache): true or false"),
    (
        "biased_lanes",
        "per-stream caches taken with no atomic read-modify-write by the thread that uses them \
         (Linux membarrier): true or false",
    ),
    (
        "expandable_segments",
        "one growing virtual range per stream, pool and residency, mapped page by page: true or false",
    ),
    (
        "expandable_stitching",
        "with expandable segments, serve a large request from free pages in pieces, mapped again \
         at one address (GMLake's stitching): true or false",
    ),
    (
        "expandable_segments_reserve",
        "with expandable segments, virtual addresses per range: a share of the device's memory \
         (0.25; above 1 allowed) or GiB with a G suffix (16G); default twice the device",
    ),
    (
        "release_threshold_mb",
        "with expandable segments, free MiB a transient range keeps mapped (0.., or none: no limit)",
    ),
    (
        "garbage_collection_threshold",
        "once reserved is past this share of the cap, release idle cached large segments, oldest first, in (0, 1)",
    ),
    ("initial_pool_size_mb", "MiB reserved up front and kept (0: none)"),
    ("max_pool_size_mb", "never reserve more than this many MiB (like memory_limit_mb)"),
    (
        "graph_capture_record_stream_reuse",
        "reuse, within a CUDA graph capture, a block used on a side stream once that stream was \
         joined back (PyTorch's key): true or false",
    ),
    (
        "caching",
        "false: every allocation is its own device allocation, every free returns it (debugging)",
    ),
    (
        "throw_on_cudamalloc_oom",
        "refuse at once, with no cache release or retry, a reservation past the cap (or the \
         device's total): true or false (PyTorch's key)",
    ),
    (
        "pinned_max_round_threshold_mb",
        "pinned host memory: requests above this many MiB get a block of their own size, not \
         the next power of two (0..; PyTorch's key; HostAllocator::with_config)",
    ),
    (
        "pinned_max_cached_size_mb",
        "pinned host memory: freed blocks above this many MiB go back to the device instead of \
         the cache, and requests above it are not rounded (0..; PyTorch's key)",
    ),
    (
        "large_segment_size_mb",
        "PyTorch's spelling of large_segment_mb (> 10); also raises max_non_split_rounding_mb \
         to it",
    ),
];

/// PyTorch keys accepted with no effect on device memory (their values checked as PyTorch
/// checks them: `true` or `false`, `pinned_num_register_threads` a power of two ≤ 128; kept in
/// [`Config::no_effect`]), with what they concern.
pub const NO_EFFECT_KEYS: &[(&str, &str)] = &[
    ("release_lock_on_cudamalloc", "locking only"),
    ("release_lock_on_device_malloc", "locking only"),
    ("pinned_use_cuda_host_register", "pinned host memory"),
    ("pinned_use_device_host_register", "pinned host memory"),
    ("pinned_num_register_threads", "pinned host memory"),
    ("pinned_use_background_threads", "pinned host memory"),
    ("release_lock_on_hipmalloc", "locking only (ROCm's spelling)"),
    ("pinned_use_hip_host_register", "pinned host memory (ROCm's spelling)"),
    (
        "pinned_reserve_segment_size_mb",
        "pinned host memory (a segment carved by a bump pointer; every tidepool pinned block is \
         its own host allocation, cached)",
    ),
    ("pinned_free_catch_all", "pinned host memory (tidepool's frees report errors as values)"),
];

/// A configuration string that could not be applied.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key that is not in [`KEYS`](crate::CONFIG_KEYS).
    UnknownKey(String),
    /// A known key with a value it does not accept.
    BadValue {
        /// The key.
        key: String,
        /// The value as written.
        value: String,
        /// What the key accepts.
        expected: String,
    },
    /// An entry without a `:` separating key and value.
    Malformed(String),
    /// Values that are fine alone but contradict each other.
    Inconsistent(String),
    /// [`Config::from_env`]: the environment variable `var` holds a configuration that `error`
    /// refuses. The other variants do not name where the string came from ([`Config::parse`],
    /// the setters, a command line), so they name no variable. Its `Display` names the
    /// variable only; `error` is its [`source`](std::error::Error::source), printed after it by
    /// whatever prints the chain.
    Env {
        /// The variable ([`ENV_VAR`]).
        var: &'static str,
        /// What is wrong with its value.
        error: Box<ConfigError>,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Where the string came from is the caller's to say (`Env` for `Config::from_env`).
        // BROKEN (`config_errors_blame_env`): every error said `in TIDEPOOL_ALLOC_CONF`, also
        // for `Config::parse`, a `--config` flag and the setters.
        let at = if cfg!(tidepool_broken = "config_errors_blame_env") {
            format!(" in {ENV_VAR}")
        } else {
            String::new()
        };
        match self {
            ConfigError::UnknownKey(k) => {
                let keys: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
                write!(f, "unknown key `{k}`{at}; valid keys: {}", keys.join(", "))
            }
            ConfigError::BadValue { key, value, expected } => {
                write!(f, "bad value `{value}` for `{key}`{at}: expected {expected}")
            }
            ConfigError::Malformed(entry) => {
                write!(f, "malformed entry `{entry}`{at}: expected key:value")
            }
            ConfigError::Inconsistent(why) if at.is_empty() => {
                write!(f, "inconsistent configuration: {why}")
            }
            ConfigError::Inconsistent(why) => write!(f, "inconsistent {ENV_VAR}: {why}"),
            // The variable only: what is wrong with its value is `source()`'s to say, once.
            // BROKEN (`error_text_doubled`): the inner message again.
            ConfigError::Env { var, error } if cfg!(tidepool_broken = "error_text_doubled") => {
                write!(f, "{var} holds an invalid configuration: {error}")
            }
            ConfigError::Env { var, .. } => write!(f, "{var} holds an invalid configuration"),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Env { error, .. } => Some(&**error),
            _ => None,
        }
    }
}

impl Config {
    /// The `(key, value)` entries of a `key:value,...` string, trimmed, empty ones skipped: split
    /// at commas outside brackets, so a PyTorch list value such as `[64:8,>:1]` stays whole.
    ///
    /// ```
    /// use tidepool::Config;
    /// let e = Config::entries("expandable_segments:True, roundup_power2_divisions:[64:8,>:1]");
    /// assert_eq!(
    ///     e.unwrap(),
    ///     [("expandable_segments", "True"), ("roundup_power2_divisions", "[64:8,>:1]")]
    /// );
    /// assert!(Config::entries("roundup_power2_divisions:[64:8").is_err());
    /// ```
    pub fn entries(s: &str) -> Result<Vec<(&str, &str)>, ConfigError> {
        let mut parts = Vec::new();
        let (mut depth, mut start) = (0usize, 0usize);
        let unbalanced = |what: &str, from: usize| {
            ConfigError::Malformed(format!("{what} in `{}`", s[from..].trim()))
        };
        for (i, c) in s.char_indices() {
            match c {
                '[' => depth += 1,
                ']' => {
                    depth =
                        depth.checked_sub(1).ok_or_else(|| unbalanced("`]` without `[`", start))?
                }
                ',' if depth == 0 => {
                    parts.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        if depth != 0 {
            return Err(unbalanced("`[` without `]`", start));
        }
        parts.push(&s[start..]);
        parts
            .into_iter()
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (k, v) =
                    e.split_once(':').ok_or_else(|| ConfigError::Malformed(e.to_string()))?;
                Ok((k.trim(), v.trim()))
            })
            .collect()
    }

    /// Parses a `key:value,key:value` string over the defaults. Empty entries are ignored.
    pub fn parse(s: &str) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        c.apply(s)?;
        Ok(c)
    }

    /// Reads [`ENV_VAR`] (the defaults when it is unset), then [`NO_CACHING_ENV_VAR`]: `1`
    /// turns caching off, `0` or unset leaves it.
    pub fn from_env() -> Result<Config, ConfigError> {
        let var = |name: &str| match std::env::var(name) {
            Ok(s) => Ok(Some(s)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(ConfigError::BadValue {
                key: name.into(),
                value: v.to_string_lossy().into_owned(),
                expected: "valid UTF-8".into(),
            }),
        };
        Config::from_vars(var(ENV_VAR)?.as_deref(), var(NO_CACHING_ENV_VAR)?.as_deref())
    }

    /// [`Config::from_env`] over given values of its two variables.
    fn from_vars(conf: Option<&str>, no_caching: Option<&str>) -> Result<Config, ConfigError> {
        let in_var = |error| match cfg!(tidepool_broken = "config_errors_blame_env") {
            true => error,
            false => ConfigError::Env { var: ENV_VAR, error: Box::new(error) },
        };
        let mut c = Config::parse(conf.unwrap_or("")).map_err(in_var)?;
        match no_caching.map(str::trim) {
            None | Some("" | "0") => {}
            Some("1") => {
                c.caching = false;
                c.validate().map_err(|e| match e {
                    ConfigError::Inconsistent(why) => ConfigError::Inconsistent(format!(
                        "{why} ({ENV_VAR} with {NO_CACHING_ENV_VAR}=1)"
                    )),
                    e => e,
                })?;
            }
            Some(v) => {
                return Err(ConfigError::BadValue {
                    key: NO_CACHING_ENV_VAR.into(),
                    value: v.into(),
                    expected: "1 or 0".into(),
                });
            }
        }
        Ok(c)
    }

    /// Applies a `key:value,...` string on top of this configuration. On error `self` is
    /// unchanged.
    pub fn apply(&mut self, s: &str) -> Result<(), ConfigError> {
        let mut next = self.clone();
        let entries = Config::entries(s)?;
        // PyTorch reads `large_segment_size_mb` first (two passes), sets
        // `max_non_split_rounding` to it, and then wants an explicit `max_non_split_rounding_mb`
        // at least as large, wherever the keys stand in the string.
        let large = |k: &&str| *k == "large_segment_size_mb";
        let large_given = entries.iter().any(|(k, _)| large(k));
        for (key, value) in entries.iter().filter(|(k, _)| large(k)) {
            next.set(key, value)?;
        }
        for (key, value) in entries.iter().filter(|(k, _)| !large(k)) {
            next.set_with(key, value, large_given)?;
        }
        next.validate()?;
        *self = next;
        Ok(())
    }

    fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        self.set_with(key, value, false)
    }

    /// `large_given`: the string sets `large_segment_size_mb`, the floor of
    /// `max_non_split_rounding_mb` (PyTorch's `parseMaxNonSplitRoundingSize`).
    fn set_with(&mut self, key: &str, value: &str, large_given: bool) -> Result<(), ConfigError> {
        let bad = |expected: &str| ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected: expected.to_string(),
        };
        let mib = |max: u64| -> Result<u64, ConfigError> {
            let what = format!("a whole number of MiB in 1..={max}");
            let v: u64 = value.parse().map_err(|_| bad(&what))?;
            if v == 0 || v > max { Err(bad(&what)) } else { Ok(v * MIB) }
        };
        // PyTorch spells them `True` and `False`.
        let flag = || match value {
            "true" | "True" => Ok(true),
            "false" | "False" => Ok(false),
            _ => Err(bad("true or false")),
        };
        const MAX_MIB: u64 = 1 << 28; // 256 TiB
        let clamped = || -> Result<u64, ConfigError> {
            let what = "a whole number of MiB, at least 1";
            match value.parse::<u64>() {
                Ok(0) | Err(_) => Err(bad(what)),
                Ok(v) => Ok(v.min(MAX_MIB) * MIB),
            }
        };
        let z = &mut self.sizing;
        match key {
            // PyTorch clamps a larger value (`std::min(val_env, SIZE_MAX / kMB)`): never split.
            "max_split_size_mb" => z.max_split_size = clamped()?,
            "roundup_power2_divisions" => {
                z.roundup_power2_divisions = RoundupDivisions::parse(value).map_err(|e| bad(&e))?
            }
            "max_non_split_rounding_mb" => {
                let v = clamped()?;
                let floor =
                    if large_given { z.large_segment } else { DEFAULT_MAX_NON_SPLIT_ROUNDING };
                if v < floor {
                    return Err(bad(&format!(
                        "a whole number of MiB, at least {} (large_segment_size_mb, as PyTorch)",
                        floor / MIB
                    )));
                }
                z.max_non_split_rounding = v;
            }
            "backend" if value == "native" => {}
            "backend" => {
                return Err(bad(
                    "native: tidepool is a caching allocator of its own, it does not hand \
                     requests to cudaMallocAsync",
                ));
            }
            k if NO_EFFECT_KEYS.iter().any(|(n, _)| *n == k) => {
                if k == "pinned_num_register_threads" {
                    if !value.parse::<u64>().is_ok_and(|n| n.is_power_of_two() && n <= 128) {
                        return Err(bad("a power of two ≤ 128"));
                    }
                } else if k == "pinned_reserve_segment_size_mb" {
                    mib(MAX_MIB)?; // PyTorch: greater than 0
                } else {
                    flag()?;
                }
                self.no_effect.retain(|e| e.split_once(':').is_none_or(|(old, _)| old != k));
                self.no_effect.push(format!("{k}:{value}"));
            }
            "min_block_size" => {
                let what = "a power of two in 256..=1048576 bytes (pointers stay 256-byte \
                            aligned, as CUDA's and RMM's are)";
                let v: u64 = value.parse().map_err(|_| bad(what))?;
                if !v.is_power_of_two() || !(MIN_ALIGN..=MIB).contains(&v) {
                    return Err(bad(what));
                }
                z.min_block_size = v;
            }
            "small_size_mb" => z.small_size = mib(1024)?,
            "small_segment_mb" => z.small_segment = mib(1024)?,
            "large_segment_mb" => z.large_segment = mib(1 << 16)?,
            "large_segment_size_mb" => {
                let v = mib(1 << 16)?;
                if v <= 10 * MIB {
                    return Err(bad("a whole number of MiB above 10 (as PyTorch)"));
                }
                // PyTorch: `max_non_split_rounding_size_ = large_segment_size_` before the
                // other keys are read (an explicit max_non_split_rounding_mb then overrides it).
                z.large_segment = v;
                z.max_non_split_rounding = v;
            }
            "min_large_alloc_mb" => z.min_large_alloc = mib(1 << 16)?,
            "round_large_mb" => z.round_large = mib(1024)?,
            "memory_limit_mb" => self.memory_limit = Some(mib(MAX_MIB)?),
            "per_process_memory_fraction" => {
                let what = "a number in [0, 1]";
                let v: f64 = value.parse().map_err(|_| bad(what))?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(bad(what));
                }
                self.memory_fraction = Some(v);
            }
            "cross_stream" => {
                self.cross_stream = match value {
                    "strict" => CrossStream::Strict,
                    "wait_event" => CrossStream::WaitEvent,
                    "never" => CrossStream::Never,
                    _ => return Err(bad("strict, wait_event or never")),
                }
            }
            "fast_cache" => self.fast_cache = flag()?,
            "fast_cache_entries" => {
                let what = "a whole number in 1..=65536";
                let v: usize = value.parse().map_err(|_| bad(what))?;
                if v == 0 || v > 65536 {
                    return Err(bad(what));
                }
                self.fast_cache_entries = v;
            }
            "fast_cache_bytes_mb" => self.fast_cache_bytes = mib(1 << 20)?,
            "global_lock" => self.global_lock = flag()?,
            "biased_lanes" => self.biased_lanes = flag()?,
            "expandable_segments" => self.expandable_segments = flag()?,
            "expandable_stitching" => self.stitching = flag()?,
            "graph_capture_record_stream_reuse" => self.graph_capture_record_stream_reuse = flag()?,
            "expandable_segments_reserve" => {
                let what = "a positive share of the device's memory (0.25), or GiB with a G \
                            suffix (16G)";
                let (number, gib) = match value.strip_suffix(['G', 'g']) {
                    Some(n) => (n, true),
                    None => (value, false),
                };
                let v: f64 = number.parse().map_err(|_| bad(what))?;
                if !(v.is_finite() && v > 0.0) {
                    return Err(bad(what));
                }
                self.expandable_reserve = Some(match gib {
                    true => ExpandableReserve::Bytes((v * (1u64 << 30) as f64) as u64),
                    false => ExpandableReserve::Fraction(v),
                });
            }
            "release_threshold_mb" => {
                let what = "a whole number of MiB in 0..=268435456, or none";
                self.release_threshold = match value {
                    "none" => u64::MAX,
                    v => match v.parse::<u64>() {
                        Ok(v) if v <= MAX_MIB => v * MIB,
                        _ => return Err(bad(what)),
                    },
                };
            }
            "garbage_collection_threshold" => {
                let what = "a number in (0, 1)";
                let v: f64 = value.parse().map_err(|_| bad(what))?;
                if !(v > 0.0 && v < 1.0) {
                    return Err(bad(what));
                }
                self.garbage_collection_threshold = Some(v);
            }
            "initial_pool_size_mb" => {
                let what = "a whole number of MiB in 0..=268435456";
                match value.parse::<u64>() {
                    Ok(v) if v <= MAX_MIB => self.initial_pool_size = v * MIB,
                    _ => return Err(bad(what)),
                }
            }
            "max_pool_size_mb" => self.max_pool_size = Some(mib(MAX_MIB)?),
            "caching" => self.caching = flag()?,
            "throw_on_cudamalloc_oom" => self.throw_on_oom = flag()?,
            "pinned_max_round_threshold_mb" | "pinned_max_cached_size_mb" => {
                // PyTorch takes any size, 0 included (nothing rounded, nothing cached).
                let what = "a whole number of MiB in 0..=268435456";
                let v = match value.parse::<u64>() {
                    Ok(v) if v <= MAX_MIB => v * MIB,
                    _ => return Err(bad(what)),
                };
                match key {
                    "pinned_max_round_threshold_mb" => self.pinned.max_round_threshold = v,
                    _ => self.pinned.max_cached_size = v,
                }
            }
            _ => return Err(ConfigError::UnknownKey(key.to_string())),
        }
        Ok(())
    }

    /// Checks that the size rules fit together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let z = &self.sizing;
        let fail = |why: String| Err(ConfigError::Inconsistent(why));
        if !z.min_block_size.is_power_of_two() {
            return fail(format!("min_block_size {} is not a power of two", z.min_block_size));
        }
        if z.min_block_size < MIN_ALIGN {
            return fail(format!(
                "min_block_size {} is below {MIN_ALIGN} bytes: every pointer handed out must stay \
                 {MIN_ALIGN}-byte aligned, as CUDA's and RMM's are",
                z.min_block_size
            ));
        }
        if z.small_size < z.min_block_size || !z.small_size.is_multiple_of(z.min_block_size) {
            return fail("small_size_mb must be a multiple of min_block_size".into());
        }
        if z.small_segment < z.small_size {
            return fail("small_segment_mb must be at least small_size_mb".into());
        }
        if z.min_large_alloc <= z.small_size {
            return fail("min_large_alloc_mb must exceed small_size_mb".into());
        }
        if z.large_segment < z.min_large_alloc {
            return fail("large_segment_mb must be at least min_large_alloc_mb".into());
        }
        // 0 is a multiple of everything: the own segments' rounding would divide by it.
        // BROKEN (`round_large_zero`): a zero rounding accepted (a large request panics).
        if z.round_large == 0 && !cfg!(tidepool_broken = "round_large_zero") {
            return fail("round_large_mb must be at least 1 MiB (got 0 bytes)".into());
        }
        if !z.round_large.is_multiple_of(z.min_block_size) {
            return fail("round_large_mb must be a multiple of min_block_size".into());
        }
        // PyTorch's `parseMaxSplitSize`: at least the large segment size (older releases
        // wanted more than it).
        if z.max_split_size != u64::MAX && z.max_split_size < z.large_segment {
            return fail(format!(
                "max_split_size_mb ({} MiB) must be at least large_segment_mb ({} MiB)",
                z.max_split_size / MIB,
                z.large_segment / MIB
            ));
        }
        if self.fast_cache_entries == 0 {
            return fail("fast_cache_entries must be at least 1".into());
        }
        if let Some(t) = self.garbage_collection_threshold
            && !(t > 0.0 && t < 1.0)
        {
            return fail(format!("garbage_collection_threshold {t} is not in (0, 1)"));
        }
        if let Some(f) = self.memory_fraction
            && !(0.0..=1.0).contains(&f)
        {
            return fail(format!("per_process_memory_fraction {f} is not in [0, 1]"));
        }
        // What the string form caps (`initial_pool_size_mb` ≤ 256 TiB): the reservation is
        // rounded up to a block, which must not overflow.
        // BROKEN (`initial_pool_unbounded`): any size accepted (`u64::MAX` overflows).
        if self.initial_pool_size > crate::MAX_REQUEST
            && !cfg!(tidepool_broken = "initial_pool_unbounded")
        {
            return fail(format!(
                "initial_pool_size_mb ({} bytes) exceeds the largest request ({} bytes)",
                self.initial_pool_size,
                crate::MAX_REQUEST
            ));
        }
        // The initial pool is reserved rounded up to a block (`reserve_initial_pool`): that is
        // what a cap must hold, or a pool the check let through fails `Allocator::new` as "out
        // of memory" on an empty device. Sizes not in whole MiB (the builders take bytes) are
        // named in bytes.
        // BROKEN (`initial_pool_unrounded_check`): the size as asked is checked.
        let initial = if cfg!(tidepool_broken = "initial_pool_unrounded_check") {
            self.initial_pool_size
        } else {
            self.initial_pool_size.next_multiple_of(z.min_block_size)
        };
        for (name, cap) in
            [("max_pool_size_mb", self.max_pool_size), ("memory_limit_mb", self.memory_limit)]
        {
            if let Some(cap) = cap
                && initial > cap
            {
                let asked = self.initial_pool_size;
                let whole_mib = initial == asked && asked.is_multiple_of(MIB);
                let why = if whole_mib && cap.is_multiple_of(MIB) {
                    format!(
                        "initial_pool_size_mb ({} MiB) exceeds {name} ({} MiB)",
                        asked / MIB,
                        cap / MIB
                    )
                } else {
                    let block = z.min_block_size;
                    format!(
                        "initial_pool_size_mb ({asked} bytes, reserved as {initial} bytes: whole \
                         blocks of {block} bytes) exceeds {name} ({cap} bytes)"
                    )
                };
                return fail(why);
            }
        }
        if !self.caching {
            let on = [
                (self.expandable_segments, "expandable_segments"),
                (self.initial_pool_size > 0, "initial_pool_size_mb"),
                (self.garbage_collection_threshold.is_some(), "garbage_collection_threshold"),
            ];
            if let Some((_, key)) = on.iter().find(|(on, _)| *on) {
                return fail(format!(
                    "caching:false (every free returns its memory to the device) cannot be combined with {key}"
                ));
            }
        }
        Ok(())
    }

    /// With these size rules (see [`Sizing`]). [`Config::validate`] (or [`crate::Allocator::new`])
    /// checks that they fit together.
    pub fn with_sizing(mut self, sizing: Sizing) -> Config {
        self.sizing = sizing;
        self
    }

    /// Blocks of at least `mib` MiB are never split (`max_split_size_mb`).
    pub fn with_max_split_size_mb(mut self, mib: u64) -> Config {
        self.sizing.max_split_size = mib.saturating_mul(MIB);
        self
    }

    /// Rounds sizes to `divisions` steps between powers of two (`roundup_power2_divisions`).
    pub fn with_roundup_power2_divisions(mut self, divisions: RoundupDivisions) -> Config {
        self.sizing.roundup_power2_divisions = divisions;
        self
    }

    /// Never reserve more than `bytes` in all (`memory_limit_mb`, in bytes here).
    pub fn with_memory_limit(mut self, bytes: u64) -> Config {
        self.memory_limit = Some(bytes);
        self
    }

    /// Never reserve more than this share of the device (`per_process_memory_fraction`).
    pub fn with_memory_fraction(mut self, fraction: f64) -> Config {
        self.memory_fraction = Some(fraction);
        self
    }

    /// The cross-stream reuse policy (`cross_stream`).
    pub fn with_cross_stream(mut self, policy: CrossStream) -> Config {
        self.cross_stream = policy;
        self
    }

    /// Per-stream caches on or off (`fast_cache`).
    pub fn with_fast_cache(mut self, on: bool) -> Config {
        self.fast_cache = on;
        self
    }

    /// Blocks a stream may cache per size class (`fast_cache_entries`).
    pub fn with_fast_cache_entries(mut self, entries: usize) -> Config {
        self.fast_cache_entries = entries;
        self
    }

    /// Bytes of small blocks a stream cache lane may hold, and the most a large block it
    /// holds may have besides (`fast_cache_bytes_mb`, in bytes here).
    pub fn with_fast_cache_bytes(mut self, bytes: u64) -> Config {
        self.fast_cache_bytes = bytes;
        self
    }

    /// Everything under one mutex, PyTorch's design (`global_lock`).
    pub fn with_global_lock(mut self, on: bool) -> Config {
        self.global_lock = on;
        self
    }

    /// Per-stream cache locks biased towards their thread, or always a compare-and-swap
    /// (`biased_lanes`).
    pub fn with_biased_lanes(mut self, on: bool) -> Config {
        self.biased_lanes = on;
        self
    }

    /// Expandable segments on or off (`expandable_segments`).
    pub fn with_expandable_segments(mut self, on: bool) -> Config {
        self.expandable_segments = on;
        self
    }

    /// The free mapped bytes a transient expandable range keeps (`release_threshold_mb`, in bytes
    /// here; `u64::MAX`: no limit).
    pub fn with_release_threshold(mut self, bytes: u64) -> Config {
        self.release_threshold = bytes;
        self
    }

    /// PyTorch's `garbage_collection_threshold` (`garbage_collection_threshold`; it needs a cap).
    pub fn with_garbage_collection_threshold(mut self, fraction: f64) -> Config {
        self.garbage_collection_threshold = Some(fraction);
        self
    }

    /// Reserve `bytes` up front and keep them (`initial_pool_size_mb`, in bytes here; rounded up
    /// to the block granularity).
    pub fn with_initial_pool_size(mut self, bytes: u64) -> Config {
        self.initial_pool_size = bytes;
        self
    }

    /// Never reserve more than `bytes` (`max_pool_size_mb`, in bytes here).
    pub fn with_max_pool_size(mut self, bytes: u64) -> Config {
        self.max_pool_size = Some(bytes);
        self
    }

    /// Caching on or off (`caching`; off: every allocation and free goes to the device).
    pub fn with_caching(mut self, on: bool) -> Config {
        self.caching = on;
        self
    }

    /// Refuse reservations past the cap at once (`throw_on_cudamalloc_oom`, see
    /// [`Config::throw_on_oom`]).
    pub fn with_throw_on_oom(mut self, on: bool) -> Config {
        self.throw_on_oom = on;
        self
    }

    /// This configuration for a private pool of an allocator configured with it: the same,
    /// with no initial pool (the general allocator's is the only one).
    pub(crate) fn for_pool(mut self) -> Config {
        self.initial_pool_size = 0;
        self
    }

    /// Whether allocations and frees may use the per-stream caches.
    pub(crate) fn fast_path(&self) -> bool {
        self.fast_cache && !self.global_lock && self.caching
    }

    /// The byte limit in force on a device of `total` bytes: the smallest of `memory_limit`,
    /// `memory_fraction × total` and `max_pool_size`, if any is set.
    pub fn limit(&self, total: u64) -> Option<u64> {
        let frac = self.memory_fraction.map(|f| (total as f64 * f) as u64);
        [self.memory_limit, frac, self.max_pool_size].into_iter().flatten().min()
    }

    /// The reserved bytes past which the garbage collection releases idle cached segments:
    /// `garbage_collection_threshold × limit` when a cap is set, else × the device's `total`
    /// memory (as PyTorch documents it: a share of the memory the process may use).
    pub fn gc_limit(&self, total: u64) -> Option<u64> {
        let t = self.garbage_collection_threshold?;
        Some((self.limit(total).unwrap_or(total) as f64 * t) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorChain;

    #[test]
    fn every_key_parses() {
        let c = Config::parse(
            "max_split_size_mb:256, roundup_power2_divisions:8,min_block_size:1024,small_size_mb:2,\
             small_segment_mb:4,large_segment_mb:40,min_large_alloc_mb:20,round_large_mb:4,\
             memory_limit_mb:4096,per_process_memory_fraction:0.5,cross_stream:wait_event,\
             fast_cache:false,fast_cache_entries:4,fast_cache_bytes_mb:8,global_lock:true,\
             expandable_segments:true,release_threshold_mb:0,garbage_collection_threshold:0.75,\
             initial_pool_size_mb:64,max_pool_size_mb:2048,caching:true,\
             max_non_split_rounding_mb:30,backend:native,expandable_stitching:true,\
             graph_capture_record_stream_reuse:True,biased_lanes:false,\
             throw_on_cudamalloc_oom:True",
        )
        .unwrap();
        let z = c.sizing;
        assert_eq!(z.max_split_size, 256 * MIB);
        assert_eq!(z.roundup_power2_divisions, RoundupDivisions::uniform(8).unwrap());
        assert_eq!(z.max_non_split_rounding, 30 * MIB);
        assert_eq!(z.min_block_size, 1024);
        assert_eq!(z.small_size, 2 * MIB);
        assert_eq!(z.small_segment, 4 * MIB);
        assert_eq!(z.large_segment, 40 * MIB);
        assert_eq!(z.min_large_alloc, 20 * MIB);
        assert_eq!(z.round_large, 4 * MIB);
        assert_eq!(c.memory_limit, Some(4096 * MIB));
        assert_eq!(c.memory_fraction, Some(0.5));
        assert_eq!(c.cross_stream, CrossStream::WaitEvent);
        assert!(!c.fast_cache);
        assert_eq!(c.fast_cache_entries, 4);
        assert_eq!(c.fast_cache_bytes, 8 * MIB);
        assert!(c.global_lock);
        assert!(!c.biased_lanes);
        assert!(Config::default().biased_lanes);
        assert!(!c.fast_path());
        assert!(c.expandable_segments);
        assert!(c.stitching);
        assert!(c.graph_capture_record_stream_reuse);
        assert_eq!(c.release_threshold, 0);
        assert_eq!(c.garbage_collection_threshold, Some(0.75));
        assert_eq!(c.initial_pool_size, 64 * MIB);
        assert_eq!(c.max_pool_size, Some(2048 * MIB));
        assert!(c.caching);
        assert!(c.throw_on_oom && !Config::default().throw_on_oom);
        // The cap is the smallest of the three limits; the collection starts at 3/4 of it.
        assert_eq!(c.limit(16384 * MIB), Some(2048 * MIB)); // max_pool_size
        assert_eq!(c.limit(2048 * MIB), Some(1024 * MIB)); // the fraction
        assert_eq!(c.clone().with_max_pool_size(8192 * MIB).limit(16384 * MIB), Some(4096 * MIB));
        assert_eq!(c.gc_limit(16384 * MIB), Some(1536 * MIB));
        assert_eq!(KEYS.len(), 31, "a new key needs a line in this test");
    }

    #[test]
    fn large_segment_size_mb_is_pytorchs_spelling() {
        let c = Config::parse("large_segment_size_mb:64").unwrap();
        assert_eq!((c.sizing.large_segment, c.sizing.max_non_split_rounding), (64 * MIB, 64 * MIB));
        // A larger rounding stays; PyTorch's floor of 10 MiB is exclusive.
        let c = Config::parse("max_non_split_rounding_mb:100,large_segment_size_mb:32").unwrap();
        assert_eq!(
            (c.sizing.large_segment, c.sizing.max_non_split_rounding),
            (32 * MIB, 100 * MIB)
        );
        // As PyTorch: the rounding follows a smaller large segment too, an explicit one must
        // reach it wherever the keys stand, and a huge max_split_size_mb is clamped.
        let c = Config::parse("large_segment_size_mb:12,max_split_size_mb:12").unwrap();
        assert_eq!(c.sizing.max_non_split_rounding, 12 * MIB);
        for s in [
            "max_non_split_rounding_mb:32,large_segment_size_mb:64",
            "large_segment_size_mb:64,max_non_split_rounding_mb:32",
        ] {
            assert!(Config::parse(s).is_err(), "{s}");
        }
        let c = Config::parse("max_split_size_mb:1000000000").unwrap();
        assert_eq!(c.sizing.max_split_size, (1 << 28) * MIB);
        let e = Config::parse("large_segment_size_mb:10").unwrap_err();
        assert!(e.to_string().contains("above 10"), "{e}");
        // max_split_size must still be at least the large segment.
        assert!(Config::parse("large_segment_size_mb:64,max_split_size_mb:40").is_err());
        let c = Config::parse("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:False");
        assert_eq!(c.unwrap().no_effect.len(), 2);
        assert!(Config::parse("throw_on_cudamalloc_oom:maybe").is_err());
    }

    #[test]
    fn expandable_segments_reserve_is_a_share_or_gib() {
        let r = |v: &str| Config::parse(&format!("expandable_segments_reserve:{v}"));
        assert_eq!(r("0.25").unwrap().expandable_reserve, Some(ExpandableReserve::Fraction(0.25)));
        assert_eq!(r("1.5").unwrap().expandable_reserve, Some(ExpandableReserve::Fraction(1.5)));
        assert_eq!(r("2g").unwrap().expandable_reserve, Some(ExpandableReserve::Bytes(2 << 30)));
        assert_eq!(r("0.5G").unwrap().expandable_reserve, Some(ExpandableReserve::Bytes(1 << 29)));
        for bad in ["0", "-1", "nan", "inf", "G", "1T", "", "1e400"] {
            assert!(r(bad).is_err(), "{bad}");
        }
        assert_eq!(Config::default().expandable_reserve, None);
        assert_eq!(ExpandableReserve::Bytes(u64::MAX).bytes(1), crate::types::MAX_REQUEST);
        assert_eq!(ExpandableReserve::Fraction(1e300).bytes(1 << 30), crate::types::MAX_REQUEST);
    }

    #[test]
    fn pinned_keys_set_the_host_config() {
        let d = Config::default().pinned;
        assert_eq!((d.max_round_threshold, d.max_cached_size), (u64::MAX, u64::MAX));
        assert!(d.rounds(u64::MAX) && d.caches(u64::MAX));
        let c = Config::parse("pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:128");
        let p = c.unwrap().pinned;
        assert_eq!((p.max_round_threshold, p.max_cached_size), (64 * MIB, 128 * MIB));
        assert!(p.rounds(64 * MIB) && !p.rounds(64 * MIB + 1));
        // A class past the cached size is not rounded (it would never be cached).
        let c = Config::parse("pinned_max_cached_size_mb:3").unwrap().pinned;
        assert!(c.rounds(2 * MIB) && !c.rounds(2 * MIB + 1) && c.caches(3 * MIB));
        assert!(p.caches(128 * MIB) && !p.caches(128 * MIB + 1));
        // 0 is PyTorch's "never": nothing rounded, nothing cached.
        let z = Config::parse("pinned_max_cached_size_mb:0").unwrap().pinned;
        assert!(!z.rounds(1) && !z.caches(1) && z.caches(0));
        for bad in ["pinned_max_cached_size_mb:-1", "pinned_max_round_threshold_mb:1.5"] {
            assert!(Config::parse(bad).is_err(), "{bad}");
        }
        // Accepted with no effect, PyTorch's check kept (greater than 0).
        let r = Config::parse("pinned_reserve_segment_size_mb:64,pinned_free_catch_all:True");
        assert_eq!(r.unwrap().no_effect.len(), 2);
        assert!(Config::parse("pinned_reserve_segment_size_mb:0").is_err());
    }

    #[test]
    fn fast_path_defaults_and_global_lock() {
        let d = Config::default();
        assert!(d.fast_cache && !d.global_lock && d.fast_path());
        assert_eq!((d.fast_cache_entries, d.fast_cache_bytes), (1024, 32 * MIB));
        assert!(!Config::parse("global_lock:true").unwrap().fast_path());
        assert!(!Config::parse("fast_cache:false").unwrap().fast_path());
        assert!(Config::parse("global_lock:false,fast_cache:true").unwrap().fast_path());
    }

    #[test]
    fn expandable_keys() {
        let d = Config::default();
        assert!(!d.expandable_segments);
        assert_eq!(d.release_threshold, DEFAULT_RELEASE_THRESHOLD);
        let c = Config::parse("expandable_segments:true,release_threshold_mb:64").unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.release_threshold, 64 * MIB);
        let c = Config::parse("release_threshold_mb:0").unwrap();
        assert_eq!(c.release_threshold, 0);
        assert_eq!(Config::parse("release_threshold_mb:none").unwrap().release_threshold, u64::MAX);
        let built = Config::default().with_expandable_segments(true).with_release_threshold(0);
        assert_eq!(
            built,
            Config::parse("expandable_segments:true,release_threshold_mb:0").unwrap()
        );
    }

    #[test]
    fn empty_string_is_the_default() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
        assert_eq!(Config::default().cross_stream, CrossStream::Strict);
        assert_eq!(Config::parse("cross_stream:never").unwrap().cross_stream, CrossStream::Never);
        assert_eq!(Config::parse(" , ,").unwrap(), Config::default());
        assert_eq!(Config::default().limit(1 << 30), None);
    }

    #[test]
    fn unknown_key_names_it_and_lists_valid_keys() {
        let e = Config::parse("max_split_size_mb:64,foo:1").unwrap_err();
        assert_eq!(e, ConfigError::UnknownKey("foo".into()));
        let msg = e.to_string();
        assert!(msg.contains("unknown key `foo`"), "{msg}");
        for (k, _) in KEYS {
            assert!(msg.contains(k), "{msg} lacks {k}");
        }
    }

    #[test]
    fn bad_values_name_key_and_value() {
        for (s, key) in [
            ("max_split_size_mb:abc", "max_split_size_mb"),
            ("max_split_size_mb:0", "max_split_size_mb"),
            ("max_split_size_mb:-5", "max_split_size_mb"),
            ("max_split_size_mb:99999999999999999999", "max_split_size_mb"),
            ("roundup_power2_divisions:3", "roundup_power2_divisions"),
            ("roundup_power2_divisions:8589934592", "roundup_power2_divisions"),
            ("roundup_power2_divisions:[64:3]", "roundup_power2_divisions"),
            ("roundup_power2_divisions:[65:8]", "roundup_power2_divisions"),
            ("max_non_split_rounding_mb:19", "max_non_split_rounding_mb"),
            ("max_non_split_rounding_mb:x", "max_non_split_rounding_mb"),
            ("backend:cudaMallocAsync", "backend"),
            ("expandable_segments:TRUE", "expandable_segments"),
            ("pinned_num_register_threads:3", "pinned_num_register_threads"),
            ("pinned_num_register_threads:256", "pinned_num_register_threads"),
            ("pinned_use_cuda_host_register:yes", "pinned_use_cuda_host_register"),
            ("release_lock_on_cudamalloc:1", "release_lock_on_cudamalloc"),
            ("min_block_size:1000", "min_block_size"),
            ("min_block_size:0", "min_block_size"),
            ("min_block_size:1", "min_block_size"),
            ("min_block_size:128", "min_block_size"),
            ("per_process_memory_fraction:-0.1", "per_process_memory_fraction"),
            ("per_process_memory_fraction:1.5", "per_process_memory_fraction"),
            ("per_process_memory_fraction:NaN", "per_process_memory_fraction"),
            ("cross_stream:lazy", "cross_stream"),
            ("memory_limit_mb:", "memory_limit_mb"),
            ("fast_cache:yes", "fast_cache"),
            ("fast_cache_entries:0", "fast_cache_entries"),
            ("fast_cache_entries:70000", "fast_cache_entries"),
            ("fast_cache_bytes_mb:0", "fast_cache_bytes_mb"),
            ("global_lock:1", "global_lock"),
            ("expandable_segments:on", "expandable_segments"),
            ("release_threshold_mb:-1", "release_threshold_mb"),
            ("release_threshold_mb:inf", "release_threshold_mb"),
            ("garbage_collection_threshold:0", "garbage_collection_threshold"),
            ("garbage_collection_threshold:1", "garbage_collection_threshold"),
            ("garbage_collection_threshold:NaN", "garbage_collection_threshold"),
            ("initial_pool_size_mb:-1", "initial_pool_size_mb"),
            ("initial_pool_size_mb:268435457", "initial_pool_size_mb"),
            ("max_pool_size_mb:0", "max_pool_size_mb"),
            ("caching:off", "caching"),
        ] {
            match Config::parse(s) {
                Err(ConfigError::BadValue { key: k, value, .. }) => {
                    assert_eq!(k, key, "{s}");
                    assert_eq!(value, s.split_once(':').unwrap().1, "{s}");
                }
                other => panic!("{s}: expected BadValue, got {other:?}"),
            }
        }
        // A key after `>` is PyTorch's too (`parseRoundUpPower2Divisions` reads the list in one
        // loop): `>` fills from interval 1, then 64 fills the intervals below it and its own.
        let d = Config::parse("roundup_power2_divisions:[>:8,64:2]").unwrap();
        let d = d.sizing.roundup_power2_divisions;
        assert_eq!(
            (0..16).map(|i| d.interval(i)).collect::<Vec<_>>(),
            [2, 2, 2, 2, 2, 2, 2, 8, 8, 8, 8, 8, 8, 8, 8, 8]
        );
        let msg = Config::parse("cross_stream:lazy").unwrap_err().to_string();
        assert_eq!(
            msg,
            "bad value `lazy` for `cross_stream`: expected strict, wait_event or never"
        );
    }

    #[test]
    fn malformed_and_inconsistent() {
        assert_eq!(
            Config::parse("max_split_size_mb").unwrap_err(),
            ConfigError::Malformed("max_split_size_mb".into())
        );
        let e = Config::parse("max_split_size_mb:19").unwrap_err();
        assert!(
            matches!(e, ConfigError::Inconsistent(ref m) if m.contains("must be at least large_segment_mb")),
            "{e}"
        );
        assert!(matches!(Config::parse("small_size_mb:16"), Err(ConfigError::Inconsistent(_))));
        assert!(matches!(Config::parse("min_large_alloc_mb:1"), Err(ConfigError::Inconsistent(_))));
        assert!(matches!(Config::parse("small_size_mb:4"), Err(ConfigError::Inconsistent(_))));
    }

    #[test]
    fn control_keys_and_their_consistency() {
        let d = Config::default();
        assert_eq!(
            (d.garbage_collection_threshold, d.initial_pool_size, d.max_pool_size, d.caching),
            (None, 0, None, true)
        );
        assert_eq!(d.gc_limit(1 << 30), None);
        // Without a cap the threshold is a share of the device's memory (PyTorch's documented
        // behaviour), so PyTorch's common `garbage_collection_threshold:0.6,...` strings work.
        let no_cap = Config::parse("garbage_collection_threshold:0.5,max_split_size_mb:128");
        assert_eq!(no_cap.unwrap().gc_limit(1 << 30), Some(1 << 29));
        let inconsistent = |s: &str, what: &str| match Config::parse(s) {
            Err(ConfigError::Inconsistent(m)) => assert!(m.contains(what), "{s}: {m}"),
            other => panic!("{s}: expected Inconsistent, got {other:?}"),
        };
        inconsistent("initial_pool_size_mb:64,max_pool_size_mb:32", "exceeds max_pool_size_mb");
        inconsistent("initial_pool_size_mb:64,memory_limit_mb:32", "exceeds memory_limit_mb");
        inconsistent("caching:false,expandable_segments:true", "expandable_segments");
        inconsistent("caching:false,initial_pool_size_mb:2", "initial_pool_size_mb");
        inconsistent(
            "caching:false,memory_limit_mb:8,garbage_collection_threshold:0.5",
            "garbage_collection_threshold",
        );
        // A threshold with any of the three caps is fine.
        for (cap, gc) in [
            ("memory_limit_mb:64", 32),
            ("per_process_memory_fraction:0.5", 64),
            ("max_pool_size_mb:64", 32),
        ] {
            let c = Config::parse(&format!("garbage_collection_threshold:0.5,{cap}")).unwrap();
            assert_eq!(c.gc_limit(256 * MIB), Some(gc * MIB), "{cap}");
        }
        // The setters build the same configurations, and validate() checks them.
        let built = Config::default()
            .with_max_pool_size(64 * MIB)
            .with_garbage_collection_threshold(0.5)
            .with_initial_pool_size(32 * MIB);
        assert_eq!(
            built,
            Config::parse(
                "max_pool_size_mb:64,garbage_collection_threshold:0.5,initial_pool_size_mb:32"
            )
            .unwrap()
        );
        assert!(Config::default().with_garbage_collection_threshold(0.5).validate().is_ok());
        assert!(Config::default().with_garbage_collection_threshold(1.5).validate().is_err());
        assert!(Config::default().with_memory_fraction(0.0).validate().is_ok());
        assert!(Config::default().with_memory_fraction(-0.01).validate().is_err());
        let off = Config::default().with_caching(false);
        assert!(!off.fast_path() && off.validate().is_ok());
        assert_eq!(off, Config::parse("caching:false").unwrap());
    }

    /// Strings copied from PyTorch jobs parse unchanged and mean what they mean there.
    #[test]
    fn pytorch_strings_work_unchanged() {
        // Unsloth's default.
        let c = Config::parse(
            "expandable_segments:True,roundup_power2_divisions:[32:256,64:128,256:64,>:32]",
        )
        .unwrap();
        assert!(c.expandable_segments);
        let d = c.sizing.roundup_power2_divisions;
        assert_eq!(
            [d.for_size(40 * MIB), d.for_size(100 * MIB), d.for_size(4096 * MIB)],
            [256, 128, 32]
        );
        // c10's own parser test string, with the newer generic key names.
        let c = Config::parse(
            "max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,\
             roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],backend:native,\
             expandable_segments:True,release_lock_on_device_malloc:True,\
             pinned_use_device_host_register:True,pinned_num_register_threads:8,\
             pinned_use_background_threads:True",
        )
        .unwrap();
        assert_eq!(c.sizing.max_split_size, 40 * MIB);
        assert_eq!(c.sizing.max_non_split_rounding, 30 * MIB);
        assert_eq!(c.garbage_collection_threshold, Some(0.5));
        assert_eq!(c.sizing.roundup_power2_divisions.for_size(1024 * MIB), 4);
        assert_eq!(
            c.no_effect,
            [
                "release_lock_on_device_malloc:True",
                "pinned_use_device_host_register:True",
                "pinned_num_register_threads:8",
                "pinned_use_background_threads:True"
            ]
        );
        // A key given twice keeps its last value, once.
        let c = Config::parse("pinned_num_register_threads:8,pinned_num_register_threads:4");
        assert_eq!(c.unwrap().no_effect, ["pinned_num_register_threads:4"]);
        // `False` and spaces, as PyTorch's lexer allows.
        let c = Config::parse(
            " expandable_segments : False , roundup_power2_divisions : [ 64 : 8 , > : 2 ] ",
        );
        let c = c.unwrap();
        assert!(!c.expandable_segments);
        assert_eq!(c.sizing.roundup_power2_divisions.for_size(MIB), 8);
        assert_eq!(c.sizing.roundup_power2_divisions.for_size(200 * MIB), 2);
        // Brackets must balance.
        for bad in ["roundup_power2_divisions:[64:8", "roundup_power2_divisions:64:8]", "a:]["] {
            assert!(matches!(Config::parse(bad), Err(ConfigError::Malformed(_))), "{bad}");
        }
        let e = Config::parse("backend:cudaMallocAsync").unwrap_err().to_string();
        assert!(e.contains("does not hand requests to cudaMallocAsync"), "{e}");
    }

    #[test]
    fn no_caching_variable() {
        assert!(Config::from_vars(None, None).unwrap().caching);
        assert!(Config::from_vars(None, Some("0")).unwrap().caching);
        assert!(!Config::from_vars(None, Some("1")).unwrap().caching);
        let c = Config::from_vars(Some("max_split_size_mb:64"), Some("1")).unwrap();
        assert!(!c.caching && c.sizing.max_split_size == 64 * MIB);
        assert!(matches!(
            Config::from_vars(None, Some("yes")),
            Err(ConfigError::BadValue { ref key, .. }) if key == NO_CACHING_ENV_VAR
        ));
        assert!(matches!(
            Config::from_vars(Some("expandable_segments:true"), Some("1")),
            Err(ConfigError::Inconsistent(_))
        ));
    }

    /// The variable is named where the string came from it, and only there: an error of
    /// `Config::parse` (a `--config` flag, a string in code) or of the setters named
    /// `TIDEPOOL_ALLOC_CONF`, which the user never set, and the caching variable's bad value
    /// was said to be *in* `TIDEPOOL_ALLOC_CONF`.
    #[test]
    fn errors_name_the_variable_they_came_from() {
        let e = Config::from_vars(Some("warp_speed:9"), None).unwrap_err();
        let inner = ConfigError::UnknownKey("warp_speed".into());
        assert_eq!(e, ConfigError::Env { var: ENV_VAR, error: Box::new(inner.clone()) });
        // The variable here, what is wrong with it in the source: each said once down the chain.
        assert_eq!(e.to_string(), "TIDEPOOL_ALLOC_CONF holds an invalid configuration");
        assert!(inner.to_string().starts_with("unknown key `warp_speed`; valid keys: "));
        let source = std::error::Error::source(&e).unwrap();
        assert_eq!(source.downcast_ref::<ConfigError>(), Some(&inner));
        assert!(source.source().is_none());
        let e = Config::from_vars(Some("max_split_size_mb:5"), None).unwrap_err();
        assert_eq!(
            ErrorChain(&e).to_string(),
            "TIDEPOOL_ALLOC_CONF holds an invalid configuration: inconsistent configuration: \
             max_split_size_mb (5 MiB) must be at least large_segment_mb (20 MiB)"
        );
        let e = Config::from_vars(None, Some("yes")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad value `yes` for `TIDEPOOL_NO_MEMORY_CACHING`: expected 1 or 0"
        );
        let e = Config::from_vars(Some("expandable_segments:true"), Some("1")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "inconsistent configuration: caching:false (every free returns its memory to the \
             device) cannot be combined with expandable_segments (TIDEPOOL_ALLOC_CONF with \
             TIDEPOOL_NO_MEMORY_CACHING=1)"
        );
        // Not from the variable: no variable named.
        for e in [
            Config::parse("warp_speed:9").unwrap_err(),
            Config::parse("max_split_size_mb").unwrap_err(),
            Config::parse("cross_stream:lazy").unwrap_err(),
            Config::default().with_max_split_size_mb(5).validate().unwrap_err(),
        ] {
            assert!(!e.to_string().contains(ENV_VAR), "{e}");
            assert!(std::error::Error::source(&e).is_none());
        }
        assert_eq!(
            Config::parse("max_split_size_mb").unwrap_err().to_string(),
            "malformed entry `max_split_size_mb`: expected key:value"
        );
    }

    /// `ConfigError::Env`, the one wrapper: its message names the variable and not the inner
    /// error, which is its source, so a reader of the chain prints each once.
    #[test]
    fn the_variables_error_leaves_the_inner_message_to_its_source() {
        for (conf, inner) in [
            ("warp_speed:9", Config::parse("warp_speed:9").unwrap_err()),
            ("max_split_size_mb", Config::parse("max_split_size_mb").unwrap_err()),
            ("max_split_size_mb:5", Config::parse("max_split_size_mb:5").unwrap_err()),
        ] {
            let e = Config::from_vars(Some(conf), None).unwrap_err();
            let text = e.to_string();
            assert!(!text.contains(&inner.to_string()), "{conf}: {text}");
            assert_eq!(text, "TIDEPOOL_ALLOC_CONF holds an invalid configuration");
            let source = std::error::Error::source(&e).expect("the inner error is the source");
            assert_eq!(source.downcast_ref::<ConfigError>(), Some(&inner), "{conf}");
            let whole = ErrorChain(&e).to_string();
            assert_eq!(whole, format!("{text}: {inner}"));
            assert_eq!(whole.matches(&inner.to_string()).count(), 1, "{whole}");
        }
    }

    #[test]
    fn apply_is_all_or_nothing() {
        let mut c = Config::parse("max_split_size_mb:64").unwrap();
        let before = c.clone();
        assert!(c.apply("roundup_power2_divisions:4,bogus:1").is_err());
        assert_eq!(c, before);
        c.apply("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.sizing.roundup_power2_divisions.for_size(1), 4);
        assert_eq!(c.sizing.max_split_size, 64 * MIB);
    }
}
