//! Allocator configuration: a [`Config`] struct, and the `TIDEPOOL_ALLOC_CONF` string in the style
//! of `PYTORCH_CUDA_ALLOC_CONF` (`key:value,key:value`).
//!
//! Every key is listed in [`KEYS`] (`tidepool::CONFIG_KEYS`); an unknown key or a bad value is an error naming it (and, for
//! an unknown key, listing the valid ones). Parsing never panics.
//!
//! Here: [`Config`], [`CrossStream`], [`HostConfig`] and the defaults. The keys are listed in
//! `keys.rs`, parsed in `parse.rs` and checked in `validate.rs`; the builder methods are in
//! `builder.rs`, [`ConfigError`] in `error.rs`.

mod builder;
mod error;
mod keys;
mod parse;
#[cfg(test)]
mod tests;
mod validate;

pub use error::ConfigError;
pub use keys::{KEYS, NO_EFFECT_KEYS};
pub(crate) use validate::{INITIAL_POOL_OVERSIZE, mib_or_bytes};

use crate::pool::{MIB, Sizing};

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
