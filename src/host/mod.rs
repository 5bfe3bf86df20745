//! Pinned host memory: [`HostAllocator`], a caching allocator of page-locked host buffers for
//! asynchronous copies (PyTorch's `CachingHostAllocator`, RMM's pinned pool), and its
//! [`PinnedBuffer`]s.
//!
//! ```text
//!   alloc(n) ── class = max(512, n.next_power_of_two())   (n above a HostConfig threshold: n)
//!      │  poll the freed blocks' events (oldest first): completed → free lists
//!      ├─ free[class] has a block ─▶ reuse it   (unrounded n: the smallest free block in
//!      │                                         [n, n.next_power_of_two()])
//!      └─ Device::host_alloc(class) (cuMemHostAlloc; on failure: free the cache, retry once),
//!         zeroed once; both with the lock let go (other threads allocate and free meanwhile)
//!   PinnedBuffer ── copy_to_device / copy_from_device / upload / download: the copy is enqueued
//!      │            on a stream and an event recorded after it (one per stream, the latest)
//!      │  as_slice / as_mut_slice: wait for the copies first (a host sync when one still runs)
//!      ├─ drop: back to the allocator ─▶ free[class] at once if no copy is recorded on it,
//!      │                                 else pending until every event completed (a block
//!      │                                 above max_cached_size: freed then, not cached)
//!      └─ a copy (or recorded use) on a stream being captured into a CUDA graph: the buffer is
//!         the graph's (replays copy at any time): no slice, no copy outside the capture, and
//!         on drop its block is kept for good (captured_bytes), never reused nor freed
//!   empty_cache ── frees every free block (cuMemFreeHost); pending blocks stay until completed
//!   last handle ── closed: pending blocks waited for, every free block freed; a buffer
//!                  dropped later is freed as it goes (a forgotten one keeps its own block)
//! ```
//!
//! **The rule.** Host memory that a copy may still read or write is never given out as a safe
//! slice, and a block is reused only after every event recorded on it completed:
//!
//! - a copy needs `&mut PinnedBuffer`, so no slice borrowed from the buffer is alive while one
//!   is enqueued;
//! - [`PinnedBuffer::as_slice`] waits for the copies that write the buffer (device to host),
//!   [`PinnedBuffer::as_mut_slice`] for every copy;
//! - a dropped buffer's block waits for its events before any `alloc` can return it; a copy on
//!   another stream is ordered after the buffer's earlier conflicting copies on the device
//!   (`wait_event`), so two copies never race on the same host bytes;
//! - a failed event record never becomes a skipped wait: the use is then complete only after a
//!   device synchronisation that started later (done by the accessors and by `empty_cache`).
//!
//! Statistics use the device allocator's names ([`HostStats`]: `allocated_bytes`,
//! `reserved_bytes`, `active_bytes`, `requested_bytes`, `allocation`, `segment`, `active`, each
//! a [`Stat`]; `num_host_alloc`, `num_host_free`, `num_alloc_retries`, `num_ooms`,
//! `num_host_syncs`; the device calls' times, `host_alloc_time` and `host_free_time`).
//! [`HostStats::to_pytorch`] gives the keys of `torch.cuda.host_memory_stats()`, whose names
//! count differently; [`HostAllocator::reset_peak_stats`] and
//! [`HostAllocator::reset_accumulated_stats`] are PyTorch's two resets.
//!
//! ```
//! use std::sync::Arc;
//! use tidepool::{Allocator, Config, Device, HostAllocator, SimDevice, StreamId};
//!
//! let dev = Arc::new(SimDevice::backed(64 << 20));
//! let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
//! let pinned = HostAllocator::new(dev.clone());
//!
//! let weights = alloc.alloc(1000, StreamId::DEFAULT).unwrap();
//! let mut staging = pinned.alloc(1000).unwrap();
//! staging.as_mut_slice().unwrap().fill(7);
//! staging.upload(&weights).unwrap(); // async copy on the buffer's stream, event recorded
//! drop(staging); // cached, but reusable only once the copy completed
//! dev.synchronize().unwrap(); // (here it has: the next allocation reuses the block)
//!
//! let mut back = pinned.alloc(1000).unwrap();
//! back.download(&weights).unwrap();
//! assert!(back.as_slice().unwrap().iter().all(|&b| b == 7)); // waits for the copy
//! assert_eq!(pinned.stats().reserved_bytes.current, 1024);
//! ```

mod buffer;

pub use buffer::PinnedBuffer;

use crate::config::HostConfig;
use crate::device::{AccessKind, Device, DeviceError, EventId, Guarded, HostPtr, StreamId};
use crate::sync::{Arc, Mutex, MutexGuard, lock};
use crate::types::{Bytes, DurationStat, MAX_REQUEST, Stat};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;

pub use crate::types::MIN_HOST_BLOCK;

/// Why a pinned host allocation or copy failed. The allocator stays usable after any of them.
///
/// [`std::error::Error::source`] gives the device's error where there is one
/// ([`HostAllocError::OutOfMemory`], [`HostAllocError::Device`]); their `Display` does not
/// repeat it, so print the whole chain for a user.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostAllocError {
    /// A request of zero bytes.
    ZeroSize,
    /// A request above [`crate::MAX_REQUEST`]: an error, not an out-of-memory.
    TooLarge {
        /// Bytes asked for.
        requested: u64,
    },
    /// The device refused the pinned allocation, even after the cache was freed.
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// The size class that was to be allocated.
        class: u64,
        /// Pinned bytes this allocator held when it gave up.
        reserved: u64,
        /// The device's answer.
        error: DeviceError,
    },
    /// A device call failed (event, copy, synchronisation).
    Device(DeviceError),
    /// A copy outside the buffer: `offset + bytes` exceeds `len` (or the other buffer is too
    /// small).
    OutOfRange {
        /// First byte of the copy in the pinned buffer.
        offset: u64,
        /// Length of the copy.
        bytes: u64,
        /// Length of the buffer.
        len: u64,
    },
    /// The device buffer belongs to another device than the pinned allocator's.
    WrongDevice,
    /// The buffer and a CUDA-graph capture: work captured into a graph copies to or from the
    /// buffer (its replays do, whenever they run), so it gives no slice and takes no copy
    /// outside the capture; or a copy on a capturing stream was asked of a buffer with copies
    /// not known complete (the capture cannot be ordered after them).
    Captured {
        /// Which of the two.
        reason: &'static str,
    },
}

impl fmt::Display for HostAllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostAllocError::ZeroSize => write!(f, "pinned host allocation of 0 bytes"),
            HostAllocError::TooLarge { requested } => write!(
                f,
                "pinned host allocation of {requested} bytes exceeds the limit of {MAX_REQUEST}"
            ),
            // The device's answer is `source()`'s to say, once down the chain.
            // BROKEN (`error_text_doubled`): said here too.
            HostAllocError::OutOfMemory { requested, class, reserved, error } => {
                write!(
                    f,
                    "out of pinned host memory allocating {} (class {}; {} held)",
                    Bytes(*requested),
                    Bytes(*class),
                    Bytes(*reserved)
                )?;
                match cfg!(tidepool_broken = "error_text_doubled") {
                    true => write!(f, ": {error}"),
                    false => Ok(()),
                }
            }
            HostAllocError::Device(e) if cfg!(tidepool_broken = "error_text_doubled") => {
                write!(f, "a device call on pinned host memory failed: {e}")
            }
            HostAllocError::Device(_) => write!(f, "a device call on pinned host memory failed"),
            HostAllocError::OutOfRange { offset, bytes, len } => write!(
                f,
                "copy of {bytes} bytes at offset {offset} is outside a buffer of {len} bytes"
            ),
            HostAllocError::WrongDevice => {
                write!(f, "the device buffer is on another device than the pinned allocator")
            }
            HostAllocError::Captured { reason } => {
                write!(f, "pinned buffer and CUDA-graph capture: {reason}")
            }
        }
    }
}

impl std::error::Error for HostAllocError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HostAllocError::OutOfMemory { error, .. } | HostAllocError::Device(error) => {
                Some(error)
            }
            _ => None,
        }
    }
}

impl From<DeviceError> for HostAllocError {
    fn from(e: DeviceError) -> Self {
        HostAllocError::Device(e)
    }
}

/// What [`HostAllocator::stats`] reports, with the device allocator's names. Bytes are block
/// bytes (the size class, or the request where [`HostConfig`] leaves it unrounded) except
/// `requested_bytes`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HostStats {
    /// Bytes of blocks handed to live [`PinnedBuffer`]s.
    pub allocated_bytes: Stat,
    /// Bytes of pinned memory held from the device (live, pending and free blocks).
    pub reserved_bytes: Stat,
    /// Bytes of blocks live or freed but still waiting on their copies' events.
    pub active_bytes: Stat,
    /// Bytes asked for by live buffers (before rounding).
    pub requested_bytes: Stat,
    /// Number of live buffers.
    pub allocation: Stat,
    /// Number of pinned allocations held (`cuMemHostAlloc` not yet freed).
    pub segment: Stat,
    /// Number of blocks live or waiting on events.
    pub active: Stat,
    /// `cuMemHostAlloc` calls that succeeded.
    pub num_host_alloc: u64,
    /// `cuMemFreeHost` calls that succeeded.
    pub num_host_free: u64,
    /// Allocations that freed the cache and retried.
    pub num_alloc_retries: u64,
    /// Allocations that failed for want of pinned memory.
    pub num_ooms: u64,
    /// Host synchronisations: accessors waiting on copies, device synchronisations.
    pub num_host_syncs: u64,
    /// Bytes of free blocks ready for reuse (now).
    pub cached_bytes: u64,
    /// Bytes of freed blocks still waiting on their copies' events (now).
    pub pending_bytes: u64,
    /// Bytes of freed blocks that work captured into a CUDA graph copies to or from: never
    /// reused nor freed (a replay may run at any time), counted as active (now).
    pub captured_bytes: u64,
    /// Time in successful `cuMemHostAlloc` calls (one per `num_host_alloc`).
    pub host_alloc_time: DurationStat,
    /// Time in successful `cuMemFreeHost` calls (one per `num_host_free`).
    pub host_free_time: DurationStat,
}

impl HostStats {
    /// Every [`Stat`] of the struct.
    fn stats_mut(&mut self) -> [&mut Stat; 7] {
        [
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.requested_bytes,
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
        ]
    }

    /// Sets every peak to its current value.
    pub fn reset_peak(&mut self) {
        self.stats_mut().into_iter().for_each(Stat::reset_peak);
        self.host_alloc_time.reset_peak();
        self.host_free_time.reset_peak();
    }

    /// Zeroes every cumulative figure (PyTorch's `reset_accumulated_host_memory_stats`): each
    /// [`Stat`]'s `allocated` and `freed`, the call counters and the timings' totals and counts.
    /// Current values, peaks, `cached_bytes` and `pending_bytes` stay.
    pub fn reset_accumulated(&mut self) {
        self.stats_mut().into_iter().for_each(Stat::reset_accumulated);
        self.num_host_alloc = 0;
        self.num_host_free = 0;
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_host_syncs = 0;
        self.host_alloc_time.reset_accumulated();
        self.host_free_time.reset_accumulated();
    }

    /// The flat dictionary `torch.cuda.host_memory_stats()` returns, with the keys of
    /// PyTorch's current `test_host_memory_stats`, sorted.
    /// PyTorch's names count differently from this struct's, so the mapping is:
    ///
    /// | PyTorch key              | from                        | what it counts                       |
    /// |--------------------------|-----------------------------|--------------------------------------|
    /// | `allocations.*`          | [`Self::segment`]           | pinned blocks held (live, waiting, free) |
    /// | `allocated_bytes.*`      | [`Self::reserved_bytes`]    | their bytes (size classes)           |
    /// | `active_requests.*`      | [`Self::active`]            | blocks live or waiting on their copies |
    /// | `active_bytes.*`         | [`Self::active_bytes`]      | their bytes                          |
    /// | `num_host_alloc`, `num_host_free` | the same fields    | successful device calls              |
    /// | `host_alloc_time.*`, `host_free_time.*` | the same fields | `total`, `max`, `min`, `count`, `avg` in µs |
    ///
    /// Each `*` above is `current`, `peak`, `allocated` and `freed`. PyTorch sums per-size-class
    /// peaks (its docs call them "a best-effort approximation of the true peak"); these peaks
    /// are exact. (Earlier PyTorch named them `allocation`, `segment`, `allocated_bytes` and
    /// `reserved_bytes`, with `allocated_bytes` then meaning the bytes handed out.)
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{HostAllocator, SimDevice};
    ///
    /// let pinned = HostAllocator::new(Arc::new(SimDevice::new(1 << 20)));
    /// let buf = pinned.alloc(40 << 10).unwrap(); // 40 KiB: a 64 KiB block
    /// let stats = pinned.stats().to_pytorch();
    /// assert_eq!(stats["allocations.current"], 1);
    /// assert_eq!(stats["allocated_bytes.current"], 64 << 10);
    /// assert_eq!(stats["active_requests.current"], 1);
    /// assert_eq!(stats["num_host_alloc"], 1);
    /// assert_eq!(stats["host_alloc_time.count"], 1);
    /// drop(buf); // no copy used it: free at once, still held
    /// let stats = pinned.stats().to_pytorch();
    /// assert_eq!((stats["allocations.current"], stats["active_requests.current"]), (1, 0));
    /// ```
    pub fn to_pytorch(&self) -> BTreeMap<String, i64> {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let mut out = BTreeMap::new();
        for (name, s) in [
            ("allocations", &self.segment),
            ("allocated_bytes", &self.reserved_bytes),
            ("active_requests", &self.active),
            ("active_bytes", &self.active_bytes),
        ] {
            for (field, v) in s.fields() {
                out.insert(format!("{name}.{field}"), n(v));
            }
        }
        for (name, t) in
            [("host_alloc_time", &self.host_alloc_time), ("host_free_time", &self.host_free_time)]
        {
            for (field, v) in [
                ("total", t.total_us),
                ("max", t.max_us),
                ("min", t.min_us),
                ("count", t.count),
                ("avg", t.avg_us()),
            ] {
                out.insert(format!("{name}.{field}"), n(v));
            }
        }
        out.insert("num_host_alloc".to_string(), n(self.num_host_alloc));
        out.insert("num_host_free".to_string(), n(self.num_host_free));
        out
    }
}

/// One recorded use of a block by a copy on `stream`: complete once `event` completed, or, when
/// the event could not be recorded, once a device synchronisation with ticket `after` or later
/// completed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Use {
    stream: StreamId,
    event: Option<EventId>,
    after: u64,
    /// A copy to the host (device to host) is among the uses merged here.
    writes_host: bool,
}

/// A freed block waiting on its uses.
struct Pending {
    ptr: HostPtr,
    size: u64,
    uses: Vec<Use>,
}

/// Everything under the allocator's lock.
struct State {
    /// Every block held: address → size class.
    blocks: HashMap<usize, u64>,
    /// Reusable blocks per size class (last freed first).
    free: BTreeMap<u64, Vec<HostPtr>>,
    /// Freed blocks that captured work uses (`captured_bytes`): kept for good.
    retired: Vec<(HostPtr, u64)>,
    /// Freed blocks waiting on events, oldest first.
    pending: VecDeque<Pending>,
    /// Events not in use, for the next copies.
    events: Vec<EventId>,
    /// The ticket the next device synchronisation takes.
    next_sync: u64,
    /// The highest ticket of a completed device synchronisation.
    synced: u64,
    stats: HostStats,
    /// No handle is left (only buffers hold the allocator): a freed block goes back to the
    /// device once its copies completed, instead of into the cache (see [`Inner::close`]).
    closed: bool,
    /// Blocks above the cached size were cached because a capture forbade their free: the
    /// next poll outside a capture frees them.
    over_cached: bool,
}

pub(crate) struct Inner<D: Device> {
    device: Guarded<D>,
    /// Rounding and caching thresholds, fixed when the allocator is made.
    config: HostConfig,
    state: Mutex<State>,
    /// The [`HostAllocator`] values of the application (those buffers hold do not count):
    /// when the last one goes, the allocator closes.
    handles: crate::sync::atomic::AtomicUsize,
    #[cfg(feature = "test-hooks")]
    broken_skip_events: crate::sync::atomic::AtomicBool,
    #[cfg(feature = "test-hooks")]
    broken_drop_waits: crate::sync::atomic::AtomicBool,
}

/// A caching allocator of pinned host memory on one device; see the module docs. `Send + Sync`,
/// cheap to clone (clones share the cache); buffers keep it alive, but when the last handle
/// goes the cache goes back to the device and each buffer's block as the buffer is dropped.
///
/// ```
/// use std::sync::Arc;
/// use tidepool::{HostAllocator, SimDevice};
///
/// let pinned = HostAllocator::new(Arc::new(SimDevice::backed(1 << 20)));
/// let a = pinned.alloc(3000).unwrap();
/// assert_eq!((a.len(), a.block_size()), (3000, 4096)); // a power-of-two size class
/// drop(a);
/// let b = pinned.alloc(4000).unwrap(); // same class, no copy recorded: reused at once
/// assert_eq!(pinned.stats().num_host_alloc, 1);
/// drop(b);
/// pinned.empty_cache().unwrap();
/// assert_eq!(pinned.stats().reserved_bytes.current, 0);
/// ```
pub struct HostAllocator<D: Device> {
    inner: Arc<Inner<D>>,
    /// An application's handle (counted in `Inner::handles`), or a buffer's (not counted).
    counted: bool,
}

impl<D: Device> Clone for HostAllocator<D> {
    /// A new handle, counted whichever it is cloned from: a clone of a buffer's
    /// ([`PinnedBuffer::allocator`]) reopens a closed allocator.
    fn clone(&self) -> Self {
        use crate::sync::atomic::Ordering;
        if self.inner.handles.fetch_add(1, Ordering::AcqRel) == 0 {
            self.inner.lock().closed = false;
        }
        HostAllocator { inner: self.inner.clone(), counted: true }
    }
}

impl<D: Device> Drop for HostAllocator<D> {
    /// The last handle closes the allocator (see the module docs).
    fn drop(&mut self) {
        use crate::sync::atomic::Ordering;
        if self.counted && self.inner.handles.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.inner.close();
        }
    }
}

impl<D: Device> fmt::Debug for HostAllocator<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.inner.state);
        f.debug_struct("HostAllocator")
            .field("device", &self.inner.device.name())
            .field("blocks", &st.blocks.len())
            .field("pending", &st.pending.len())
            .field("reserved", &Bytes(st.stats.reserved_bytes.current))
            .finish()
    }
}

/// Whole microseconds since `start`.
fn micros(start: std::time::Instant) -> u64 {
    u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX)
}

fn is_oom(e: &DeviceError) -> bool {
    matches!(
        e,
        DeviceError::OutOfMemory { .. }
            | DeviceError::Driver { code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY, .. }
    )
}

/// Takes a free block for a request of `bytes` (size class `class`): one of exactly the class
/// where the request is `rounded`, else the smallest of `bytes` to `class` bytes (never more
/// than rounding would have used, never less than asked). Returns it with its size.
fn take_free(
    free: &mut BTreeMap<u64, Vec<HostPtr>>,
    bytes: u64,
    class: u64,
    rounded: bool,
) -> Option<(HostPtr, u64)> {
    let size = match rounded {
        true => class,
        // BROKEN (`pinned_reuse_unchecked`): any block of the request's power-of-two bucket,
        // its size unchecked, as PyTorch's free lists hand out (a smaller one included).
        false if cfg!(tidepool_broken = "pinned_reuse_unchecked") => {
            let bucket = (class / 2 + 1)..=class;
            free.range(bucket).rev().find(|(_, v)| !v.is_empty()).map(|(&s, _)| s)?
        }
        false => free.range(bytes..=class).find(|(_, v)| !v.is_empty()).map(|(&s, _)| s)?,
    };
    let list = free.get_mut(&size)?;
    let ptr = list.pop()?;
    if list.is_empty() {
        free.remove(&size);
    }
    Some((ptr, size))
}

impl<D: Device> HostAllocator<D> {
    /// An empty cache over `device`'s pinned memory, every request rounded to its size
    /// class and every freed block cached. Makes no device call.
    pub fn new(device: Arc<D>) -> HostAllocator<D> {
        Self::with_config(device, HostConfig::default())
    }

    /// An empty cache over `device`'s pinned memory with `config`'s thresholds (PyTorch's
    /// `pinned_max_round_threshold_mb` and `pinned_max_cached_size_mb`; see [`HostConfig`]:
    /// `Config::from_env()?.pinned` reads them from `TIDEPOOL_ALLOC_CONF`). Makes no device call.
    pub fn with_config(device: Arc<D>, config: HostConfig) -> HostAllocator<D> {
        let h = HostAllocator {
            inner: Arc::new(Inner {
                device: Guarded::new(device),
                config,
                state: Mutex::new(State {
                    blocks: HashMap::new(),
                    free: BTreeMap::new(),
                    retired: Vec::new(),
                    pending: VecDeque::new(),
                    events: Vec::new(),
                    next_sync: 1,
                    synced: 0,
                    stats: HostStats::default(),
                    closed: false,
                    over_cached: false,
                }),
                handles: crate::sync::atomic::AtomicUsize::new(1),
                #[cfg(feature = "test-hooks")]
                broken_skip_events: crate::sync::atomic::AtomicBool::new(false),
                #[cfg(feature = "test-hooks")]
                broken_drop_waits: crate::sync::atomic::AtomicBool::new(false),
            }),
            counted: true,
        };
        crate::peers::join(crate::peers::Kind::PinnedHost, &h.inner.device, &h.inner);
        h
    }

    /// The size class of a request: the next power of two, at least [`MIN_HOST_BLOCK`].
    ///
    /// ```
    /// use tidepool::{HostAllocError, HostAllocator, SimDevice};
    ///
    /// assert_eq!(HostAllocator::<SimDevice>::size_class(1), Ok(512));
    /// assert_eq!(HostAllocator::<SimDevice>::size_class(513), Ok(1024));
    /// assert_eq!(HostAllocator::<SimDevice>::size_class(1 << 20), Ok(1 << 20));
    /// assert_eq!(HostAllocator::<SimDevice>::size_class(0), Err(HostAllocError::ZeroSize));
    /// ```
    pub fn size_class(bytes: u64) -> Result<u64, HostAllocError> {
        match bytes {
            0 => Err(HostAllocError::ZeroSize),
            b if b > MAX_REQUEST => Err(HostAllocError::TooLarge { requested: b }),
            b => Ok(b.next_power_of_two().max(MIN_HOST_BLOCK)),
        }
    }

    /// The device whose pinned memory this allocator caches.
    pub fn device(&self) -> &Arc<D> {
        self.inner.device.arc()
    }

    /// The thresholds it was made with.
    pub fn config(&self) -> HostConfig {
        self.inner.config
    }

    /// A pinned buffer of `bytes` bytes (its block is the size class, [`Self::size_class`], or,
    /// above the thresholds of [`HostConfig`], `bytes` itself): a cached block of the class
    /// whose copies all completed (for an unrounded request, the smallest cached block from
    /// `bytes` to its size class), or a new pinned allocation (zeroed). Errors: [`HostAllocError::ZeroSize`], [`HostAllocError::TooLarge`],
    /// [`HostAllocError::OutOfMemory`] (after freeing the cache and retrying once, then after
    /// the other pinned allocators of the device freed theirs, once more).
    pub fn alloc(&self, bytes: u64) -> Result<PinnedBuffer<D>, HostAllocError> {
        match self.alloc_once(bytes) {
            Err(HostAllocError::OutOfMemory { .. }) if self.release_peers() => {
                let r = self.alloc_once(bytes);
                if matches!(r, Err(HostAllocError::OutOfMemory { .. })) {
                    // Still one allocation that failed.
                    let mut st = self.inner.lock();
                    st.stats.num_ooms = st.stats.num_ooms.saturating_sub(1);
                }
                r
            }
            r => r,
        }
    }

    /// Asks the other pinned allocators of this device to free their free blocks
    /// (`src/peers.rs`), with no lock of this one held; whether any did.
    #[cold]
    fn release_peers(&self) -> bool {
        let me = Arc::as_ptr(&self.inner) as *const ();
        crate::peers::ask(crate::peers::Kind::PinnedHost, &self.inner.device, me)
    }

    /// One attempt of [`HostAllocator::alloc`].
    fn alloc_once(&self, bytes: u64) -> Result<PinnedBuffer<D>, HostAllocError> {
        let class = Self::size_class(bytes)?;
        let rounded = self.inner.config.rounds(bytes);
        let mut guard = lock(&self.inner.state);
        let st = &mut *guard;
        // A failed query leaves its block waiting; the allocation goes on without it.
        let _ = self.inner.process_events(st);
        let (ptr, size) = match take_free(&mut st.free, bytes, class, rounded) {
            Some((ptr, size)) => {
                st.stats.cached_bytes -= size;
                (ptr, size)
            }
            // BROKEN (`pinned_alloc_locked`): the lock held through `cuMemHostAlloc` and the
            // zeroing, so every other thread's allocation and free waited for them.
            None if cfg!(tidepool_broken = "pinned_alloc_locked") => {
                let size = if rounded { class } else { bytes };
                (self.inner.new_block(Some(st), bytes, size)?, size)
            }
            None => {
                // `cuMemHostAlloc` page-locks the whole block (milliseconds per MiB on CUDA)
                // and the block is zeroed: neither under the lock, which every allocation and
                // every buffer's drop takes (PyTorch holds no lock there either).
                drop(guard);
                let size = if rounded { class } else { bytes };
                let ptr = self.inner.new_block(None, bytes, size)?;
                guard = lock(&self.inner.state);
                (ptr, size)
            }
        };
        let st = &mut *guard;
        let s = &mut st.stats;
        s.allocation.increase(1);
        s.allocated_bytes.increase(size);
        s.requested_bytes.increase(bytes);
        s.active.increase(1);
        s.active_bytes.increase(size);
        drop(guard);
        self.inner.device.note_host_access(ptr, size, AccessKind::Write);
        // The buffer's handle is not counted: a buffer alone leaves the allocator closed.
        let handle = HostAllocator { inner: self.inner.clone(), counted: false };
        Ok(PinnedBuffer::new(handle, ptr, bytes, size))
    }

    /// Makes every freed block whose copies completed reusable (`alloc` does this first).
    /// Never blocks. An error when an event query failed (the block stays waiting). Polls
    /// nothing while a CUDA graph is being captured on the device (CUDA forbids the queries).
    pub fn process_events(&self) -> Result<(), HostAllocError> {
        let mut st = lock(&self.inner.state);
        Ok(self.inner.process_events(&mut st)?)
    }

    /// Returns every free pinned block to the device (`cuMemFreeHost`). Blocks of live buffers
    /// stay; freed blocks whose copies have not completed stay until they have (a block whose
    /// event could not be recorded is released after a device synchronisation). On an error the
    /// blocks not freed stay cached and the first error is returned. While a CUDA graph is
    /// being captured on the device it releases nothing (CUDA forbids the calls).
    pub fn empty_cache(&self) -> Result<(), HostAllocError> {
        // CUDA forbids the waits and `cuMemFreeHost` (it synchronises) while a capture is
        // underway: a forbidden call would invalidate it. Nothing is released now.
        // BROKEN (`capture_calls_unguarded`): released all the same.
        if self.inner.capture_forbids_waits_and_frees() {
            return Ok(());
        }
        let needs_sync = {
            let mut st = lock(&self.inner.state);
            let _ = self.inner.process_events(&mut st);
            st.pending.iter().any(|p| p.uses.iter().any(|u| u.event.is_none()))
        };
        let mut first_err = None;
        if needs_sync && let Err(e) = self.inner.synchronize() {
            first_err = Some(HostAllocError::Device(e));
        }
        let mut st = lock(&self.inner.state);
        if let Err(e) = self.inner.process_events(&mut st) {
            first_err.get_or_insert(HostAllocError::Device(e));
        }
        if let Err(e) = self.inner.release_free(&mut st) {
            first_err.get_or_insert(HostAllocError::Device(e));
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Statistics now.
    pub fn stats(&self) -> HostStats {
        lock(&self.inner.state).stats.clone()
    }

    /// Resets every peak to its current value (PyTorch's `reset_peak_host_memory_stats`).
    pub fn reset_peak_stats(&self) {
        lock(&self.inner.state).stats.reset_peak();
    }

    /// Zeroes the cumulative figures ([`HostStats::reset_accumulated`]; PyTorch's
    /// `reset_accumulated_host_memory_stats`).
    pub fn reset_accumulated_stats(&self) {
        lock(&self.inner.state).stats.reset_accumulated();
    }

    /// Recomputes every figure from the blocks and compares: an error naming the first figure
    /// that differs.
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = lock(&self.inner.state);
        let s = &st.stats;
        let free: Vec<(u64, usize)> =
            st.free.iter().flat_map(|(&size, v)| v.iter().map(move |p| (size, p.addr()))).collect();
        let pending: Vec<(u64, usize)> =
            st.pending.iter().map(|p| (p.size, p.ptr.addr())).collect();
        let retired: Vec<(u64, usize)> =
            st.retired.iter().map(|&(p, size)| (size, p.addr())).collect();
        let mut seen = std::collections::HashSet::new();
        for &(size, addr) in free.iter().chain(&pending).chain(&retired) {
            if st.blocks.get(&addr) != Some(&size) {
                return Err(format!("block {addr:#x} of class {size} is not held as such"));
            }
            if !seen.insert(addr) {
                return Err(format!("block {addr:#x} is cached twice"));
            }
        }
        let reserved: u64 = st.blocks.values().sum();
        let cached: u64 = free.iter().map(|b| b.0).sum();
        let waiting: u64 = pending.iter().map(|b| b.0).sum();
        let kept: u64 = retired.iter().map(|b| b.0).sum();
        let live = st.blocks.len() - free.len() - pending.len() - retired.len();
        let checks = [
            ("reserved_bytes", s.reserved_bytes.current, reserved),
            ("segment", s.segment.current, st.blocks.len() as u64),
            ("cached_bytes", s.cached_bytes, cached),
            ("pending_bytes", s.pending_bytes, waiting),
            ("captured_bytes", s.captured_bytes, kept),
            ("allocated_bytes", s.allocated_bytes.current, reserved - cached - waiting - kept),
            ("allocation", s.allocation.current, live as u64),
            ("active_bytes", s.active_bytes.current, reserved - cached),
            ("active", s.active.current, (live + pending.len() + retired.len()) as u64),
            ("host_alloc_time.count", s.host_alloc_time.count, s.num_host_alloc),
            ("host_free_time.count", s.host_free_time.count, s.num_host_free),
        ];
        for (name, got, want) in checks {
            if got != want {
                return Err(format!("{name} is {got}, recount gives {want}"));
            }
        }
        Ok(())
    }

    /// **Test only — a deliberate bug.** While on, a dropped buffer's block is reusable at once,
    /// its copies' events ignored, so tests can show the SimDevice sanitizer (and wrong bytes)
    /// catch premature reuse of pinned memory.
    #[cfg(feature = "test-hooks")]
    pub fn set_broken_skip_events(&self, on: bool) {
        use crate::sync::atomic::Ordering;
        self.inner.broken_skip_events.store(on, Ordering::Relaxed);
    }

    /// **Test only — a deliberate bug**: while on, a block whose copies cannot be waited for as
    /// the allocator goes is leaked at once, with no device synchronisation tried.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn set_broken_drop_waits(&self, on: bool) {
        use crate::sync::atomic::Ordering;
        self.inner.broken_drop_waits.store(on, Ordering::Relaxed);
    }

    /// **Test only — a deliberate bug** (`Broken::DevicePanicsUnwind` for this allocator): while
    /// on, a panic in a device method unwinds through the host allocator instead of being caught
    /// at the call.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn set_broken_unwind(&self, on: bool) {
        self.inner.device.set_unwind(on);
    }

    pub(crate) fn inner(&self) -> &Inner<D> {
        &self.inner
    }
}

impl<D: Device> Inner<D> {
    /// Whether the deliberate bug of [`HostAllocator::set_broken_drop_waits`] is on.
    fn broken_drop_waits(&self) -> bool {
        #[cfg(feature = "test-hooks")]
        return self.broken_drop_waits.load(crate::sync::atomic::Ordering::Relaxed);
        #[cfg(not(feature = "test-hooks"))]
        false
    }

    pub(crate) fn device(&self) -> &Guarded<D> {
        &self.device
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Has `u` completed? Never blocks.
    pub(crate) fn use_complete(&self, u: &Use) -> Result<bool, DeviceError> {
        match u.event {
            Some(e) => self.device.query_event(e),
            None => Ok(self.lock().synced >= u.after),
        }
    }

    /// [`Inner::use_complete`] under the lock already held.
    fn use_done(&self, st: &State, u: &Use) -> Result<bool, DeviceError> {
        match u.event {
            Some(e) => self.device.query_event(e),
            None => Ok(st.synced >= u.after),
        }
    }

    /// Moves pending blocks whose uses all completed to the free lists.
    fn process_events(&self, st: &mut State) -> Result<(), DeviceError> {
        // BROKEN (`capture_calls_unguarded`, with `Guarded`'s check): polled all the same.
        if !st.pending.is_empty() && self.capture_forbids_waits_and_frees() {
            return Ok(()); // no event may be polled during a capture: later
        }
        let mut i = 0;
        while i < st.pending.len() {
            let mut done = true;
            for u in &st.pending[i].uses {
                if !self.use_done(st, u)? {
                    done = false;
                    break;
                }
            }
            if !done {
                i += 1;
                continue;
            }
            let p = st.pending.remove(i).expect("index checked");
            st.events.extend(p.uses.iter().filter_map(|u| u.event));
            st.stats.pending_bytes -= p.size;
            st.stats.active.decrease(1);
            st.stats.active_bytes.decrease(p.size);
            self.cache_or_free(st, p.ptr, p.size);
        }
        if st.over_cached && !cfg!(tidepool_broken = "over_cached_kept") {
            // (Not during a capture: returned above, or nothing was pending.)
            self.free_over_cached(st);
        }
        Ok(())
    }

    /// Frees the cached blocks above the cached size, kept while a capture forbade their
    /// free; once no capture is underway.
    #[cold]
    fn free_over_cached(&self, st: &mut State) {
        if self.capture_forbids_waits_and_frees() {
            return;
        }
        st.over_cached = false;
        let above = self.config.max_cached_size.saturating_add(1);
        let sizes: Vec<u64> = st.free.range(above..).map(|(&s, _)| s).collect();
        for size in sizes {
            for ptr in st.free.remove(&size).unwrap_or_default() {
                // A refused free leaves the block cached; `empty_cache` tries again.
                let _ = self.release_block(st, ptr, size);
            }
        }
    }

    /// A block no buffer holds and no copy uses any more: into the free lists, or, above the
    /// configured `max_cached_size`, back to the device (kept cached where that fails, or while
    /// a capture forbids the free; `empty_cache` tries again).
    fn cache_or_free(&self, st: &mut State, ptr: HostPtr, size: u64) {
        st.stats.cached_bytes += size;
        // BROKEN (`pinned_cache_unbounded`): every block is cached, whatever its size.
        let fits = self.config.caches(size) || cfg!(tidepool_broken = "pinned_cache_unbounded");
        if fits || self.capture_forbids_waits_and_frees() {
            st.over_cached |= !fits;
            st.free.entry(size).or_default().push(ptr);
            return;
        }
        let _ = self.release_block(st, ptr, size);
    }

    /// Returns a free block (out of the free lists, counted in `cached_bytes`) to the device;
    /// on an error it goes back to the free lists.
    fn release_block(&self, st: &mut State, ptr: HostPtr, size: u64) -> Result<(), DeviceError> {
        let start = std::time::Instant::now();
        // SAFETY: a free block belongs to no buffer (no slice into it exists) and every use
        // recorded on it completed (it left `pending` only then); it came from this device's
        // `host_alloc` and leaves the allocator's tables just below.
        match unsafe { self.device.host_free(ptr) } {
            Ok(()) => {
                st.stats.host_free_time.record(micros(start));
                st.blocks.remove(&ptr.addr());
                st.stats.cached_bytes -= size;
                st.stats.num_host_free += 1;
                st.stats.segment.decrease(1);
                st.stats.reserved_bytes.decrease(size);
                Ok(())
            }
            Err(e) => {
                st.free.entry(size).or_default().push(ptr);
                Err(e)
            }
        }
    }

    /// A new zeroed pinned block of `size` bytes; on failure frees the cache and retries once.
    /// Made with no lock held when `held` is `None` (the state is locked only to free the cache
    /// and to count the block), else under the lock the caller holds.
    fn new_block(
        &self,
        mut held: Option<&mut State>,
        requested: u64,
        size: u64,
    ) -> Result<HostPtr, HostAllocError> {
        let mut with_state = |f: &mut dyn FnMut(&mut State)| match held.as_deref_mut() {
            Some(st) => f(st),
            None => f(&mut self.lock()),
        };
        let mut result = self.timed_host_alloc(size);
        if let Err(e) = &result
            && is_oom(e)
            && !self.capture_forbids_waits_and_frees()
        {
            let mut freed = false;
            with_state(&mut |st| {
                if st.stats.cached_bytes > 0 {
                    st.stats.num_alloc_retries += 1;
                    // Errors freeing leave those blocks cached; the retry says whether it was
                    // enough.
                    let _ = self.release_free(st);
                    freed = true;
                }
            });
            if freed {
                result = self.timed_host_alloc(size);
            }
        }
        let (ptr, micros) = match result {
            Ok(done) => done,
            Err(error) if is_oom(&error) => {
                let mut reserved = 0;
                with_state(&mut |st| {
                    st.stats.num_ooms += 1;
                    reserved = st.stats.reserved_bytes.current;
                });
                return Err(HostAllocError::OutOfMemory {
                    requested,
                    class: size,
                    reserved,
                    error,
                });
            }
            Err(e) => return Err(HostAllocError::Device(e)),
        };
        // SAFETY: `ptr` is a fresh pinned allocation of `size` bytes (what `host_alloc` returns),
        // not yet handed to anyone (not even in the allocator's tables) and not used by any
        // copy; zeroing initialises it, so slices of it are valid `u8`s from now on.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, size as usize) };
        with_state(&mut |st| {
            st.stats.host_alloc_time.record(micros);
            st.blocks.insert(ptr.addr(), size);
            st.stats.num_host_alloc += 1;
            st.stats.segment.increase(1);
            st.stats.reserved_bytes.increase(size);
        });
        Ok(ptr)
    }

    /// `Device::host_alloc`, with the microseconds it took when it succeeded.
    fn timed_host_alloc(&self, size: u64) -> Result<(HostPtr, u64), DeviceError> {
        let start = std::time::Instant::now();
        self.device.host_alloc(size).map(|ptr| (ptr, micros(start)))
    }

    /// Frees every free block; the first error is returned, the failed block stays cached.
    fn release_free(&self, st: &mut State) -> Result<(), DeviceError> {
        let mut first_err = None;
        for (size, blocks) in std::mem::take(&mut st.free) {
            for ptr in blocks {
                if let Err(e) = self.release_block(st, ptr, size) {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Synchronises the device, so every use whose event could not be recorded before now is
    /// complete. A host sync.
    pub(crate) fn synchronize(&self) -> Result<(), DeviceError> {
        let ticket = {
            let mut st = self.lock();
            st.next_sync += 1;
            st.next_sync - 1
        };
        self.device.synchronize()?;
        let mut st = self.lock();
        st.synced = st.synced.max(ticket);
        st.stats.num_host_syncs += 1;
        Ok(())
    }

    /// Blocks until `u` completed.
    pub(crate) fn wait_use(&self, u: &Use) -> Result<(), DeviceError> {
        match u.event {
            Some(e) => {
                if !self.device.query_event(e)? {
                    self.device.synchronize_event(e)?;
                    self.lock().stats.num_host_syncs += 1;
                }
                Ok(())
            }
            None if self.lock().synced >= u.after => Ok(()),
            None => self.synchronize(),
        }
    }

    /// Makes `stream`'s later work wait on the device for `u` (a host sync when `u` has no
    /// event).
    pub(crate) fn order_after(&self, stream: StreamId, u: &Use) -> Result<(), DeviceError> {
        match u.event {
            Some(e) => self.device.wait_event(stream, e),
            None => self.wait_use(u),
        }
    }

    /// Records the use of a block by work just enqueued on `stream`. On an error the use is
    /// still returned, without an event (complete after a later device synchronisation).
    pub(crate) fn record_use(
        &self,
        stream: StreamId,
        writes_host: bool,
    ) -> (Use, Result<(), DeviceError>) {
        let pooled = self.lock().events.pop();
        let event = match pooled {
            Some(e) => Ok(e),
            None => self.device.create_event(),
        };
        let recorded = event.and_then(|e| match self.device.record_event(e, stream) {
            Ok(()) => Ok(e),
            Err(err) => {
                self.lock().events.push(e);
                Err(err)
            }
        });
        match recorded {
            Ok(e) => (Use { stream, event: Some(e), after: 0, writes_host }, Ok(())),
            Err(err) => {
                let after = self.lock().next_sync;
                (Use { stream, event: None, after, writes_host }, Err(err))
            }
        }
    }

    /// Returns events of uses known complete (or superseded) to the pool.
    pub(crate) fn recycle(&self, uses: impl IntoIterator<Item = Use>) {
        let mut st = self.lock();
        st.events.extend(uses.into_iter().filter_map(|u| u.event));
    }

    /// A buffer gives its block back, with the uses recorded on it.
    pub(crate) fn give_back(&self, ptr: HostPtr, requested: u64, size: u64, uses: Vec<Use>) {
        let mut guard = self.lock();
        let st = &mut *guard;
        #[cfg(feature = "test-hooks")]
        let uses = if self.broken_skip_events.load(crate::sync::atomic::Ordering::Relaxed) {
            st.events.extend(uses.iter().filter_map(|u| u.event));
            Vec::new()
        } else {
            uses
        };
        let s = &mut st.stats;
        s.allocation.decrease(1);
        s.allocated_bytes.decrease(size);
        s.requested_bytes.decrease(requested);
        if uses.is_empty() {
            s.active.decrease(1);
            s.active_bytes.decrease(size);
            self.cache_or_free(st, ptr, size);
        } else {
            s.pending_bytes += size;
            st.pending.push_back(Pending { ptr, size, uses });
        }
        if st.closed {
            drop(guard);
            self.drain_closed();
        }
    }

    /// A dropped buffer that work captured into a CUDA graph copies to or from: its block is
    /// kept for good, neither reused nor freed (a replay may copy at any time, and nothing can
    /// tell when the graph's last one ran), as PyTorch keeps pinned memory used in a capture.
    /// Its other uses' events go back to the pool.
    pub(crate) fn retire(&self, ptr: HostPtr, requested: u64, size: u64, uses: Vec<Use>) {
        if cfg!(tidepool_broken = "captured_recycled") {
            // BROKEN: the block goes back to the cache, reusable at once.
            self.recycle(uses);
            return self.give_back(ptr, requested, size, Vec::new());
        }
        self.recycle(uses);
        let mut st = self.lock();
        let s = &mut st.stats;
        s.allocation.decrease(1);
        s.allocated_bytes.decrease(size);
        s.requested_bytes.decrease(requested);
        s.captured_bytes += size;
        st.retired.push((ptr, size));
    }

    /// The last handle is gone (only buffers hold the allocator): nothing is cached any more.
    /// The freed blocks waiting on copies are waited for (host syncs, counted) and every free
    /// block goes back to the device; a buffer freed later goes back the same way
    /// ([`Inner::give_back`]). Without it one `mem::forget`ten buffer kept the whole pinned
    /// cache, page-locked, until the process ended.
    fn close(&self) {
        if cfg!(tidepool_broken = "closed_keeps_cache") {
            return; // BROKEN: the cache stays until the last buffer goes
        }
        {
            // (Under the lock, as a clone's reopening: a handle cloned from a buffer since the
            // count reached 0 keeps the allocator open.)
            let mut st = self.lock();
            if self.handles.load(crate::sync::atomic::Ordering::Acquire) != 0 {
                return;
            }
            st.closed = true;
        }
        self.drain_closed();
    }

    /// Waits for the pending blocks' copies and frees every free block (a closed allocator).
    fn drain_closed(&self) {
        let pending = std::mem::take(&mut self.lock().pending);
        for p in pending {
            self.settle(p);
        }
        let mut st = self.lock();
        if st.closed && !self.capture_forbids_waits_and_frees() {
            let _ = self.release_free(&mut st);
        }
    }

    /// Waits for every copy recorded on a freed block, then makes it free. A block whose
    /// copies cannot be waited for (a device error, or a capture underway) is waited for by a
    /// device synchronisation; if that fails too it stays pending, for a later drain (or, when
    /// the allocator goes, leaked rather than freed under a copy).
    fn settle(&self, p: Pending) {
        let waited = p.uses.iter().all(|u| self.wait_use(u).is_ok())
            || !self.broken_drop_waits() && self.synchronize().is_ok();
        let mut st = self.lock();
        if waited {
            st.events.extend(p.uses.iter().filter_map(|u| u.event));
            st.stats.pending_bytes -= p.size;
            // No longer active, as `process_events` has it. (BROKEN `settle_keeps_active`:
            // counted active for good.)
            if !cfg!(tidepool_broken = "settle_keeps_active") {
                st.stats.active.decrease(1);
                st.stats.active_bytes.decrease(p.size);
            }
            self.cache_or_free(&mut st, p.ptr, p.size);
        } else if cfg!(tidepool_broken = "settle_drops_pending") {
            // BROKEN: the block leaves the pending list and is never freed.
            st.events.extend(p.uses.iter().filter_map(|u| u.event));
        } else {
            st.pending.push_back(p);
        }
    }

    /// Whether a capture is underway, so no event may be polled nor waited for, and no pinned
    /// memory freed (`cuMemFreeHost` synchronises). BROKEN (`capture_calls_unguarded`): never.
    fn capture_forbids_waits_and_frees(&self) -> bool {
        !cfg!(tidepool_broken = "capture_calls_unguarded") && self.device.capture_underway()
    }
}

/// What a pinned allocator does for another of its device that ran out of pinned memory
/// (`src/peers.rs`): frees its free blocks whose copies completed (no wait).
impl<D: Device> crate::peers::Peer for Inner<D> {
    fn release_for_peer(&self) -> bool {
        if cfg!(tidepool_broken = "peers_kept") {
            return false; // BROKEN: the peers keep their caches
        }
        if self.capture_forbids_waits_and_frees() {
            return false; // nothing is freed while a capture is underway
        }
        let mut st = self.lock();
        let before = st.stats.reserved_bytes.current;
        let _ = self.process_events(&mut st);
        let _ = self.release_free(&mut st);
        st.stats.reserved_bytes.current < before
    }
}

impl<D: Device> Drop for Inner<D> {
    /// Runs when the last handle and the last buffer are gone: waits for pending blocks, frees
    /// every block and destroys the events. A block whose copies cannot be waited for (a device
    /// error) is waited for by a device synchronisation, and leaked rather than freed under a
    /// copy only if that fails too. While a capture is underway nothing can be waited for nor
    /// freed (CUDA forbids it): the blocks are leaked, the one case where pinned memory is.
    fn drop(&mut self) {
        let pending = std::mem::take(&mut self.lock().pending);
        for p in pending {
            self.settle(p);
        }
        let mut st = self.lock();
        if self.capture_forbids_waits_and_frees() {
            return;
        }
        let _ = self.release_free(&mut st);
        for e in std::mem::take(&mut st.events) {
            let _ = self.device.destroy_event(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimDevice;

    #[test]
    fn size_classes_are_powers_of_two_from_512() {
        let class = HostAllocator::<SimDevice>::size_class;
        assert_eq!(class(1), Ok(512));
        assert_eq!(class(512), Ok(512));
        assert_eq!(class(513), Ok(1024));
        assert_eq!(class(4097), Ok(8192));
        assert_eq!(class(MAX_REQUEST), Ok(MAX_REQUEST));
        assert_eq!(
            class(MAX_REQUEST + 1),
            Err(HostAllocError::TooLarge { requested: MAX_REQUEST + 1 })
        );
        assert_eq!(class(u64::MAX), Err(HostAllocError::TooLarge { requested: u64::MAX }));
        assert_eq!(class(0), Err(HostAllocError::ZeroSize));
    }
}
