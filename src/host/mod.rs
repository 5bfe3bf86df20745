//! Pinned host memory: [`HostAllocator`], a caching allocator of page-locked host buffers for
//! asynchronous copies (PyTorch's `CachingHostAllocator`, RMM's pinned pool), and its
//! [`PinnedBuffer`]s.
//!
//! ```text
//!   alloc(n) ── class = max(512, n.next_power_of_two())   (n above a HostConfig threshold: n)
//!      │  poll the freed blocks' events (oldest first): completed → free lists
//!      ├─ free[class] has a block ─▶ reuse it   (unrounded n: the smallest free block in
//!      │                                         [n, n.next_power_of_two()])
//!      └─ Device::host_alloc(class) (cuMemHostAlloc; on failure: free the cache, retry once;
//!         not for a block above Device::host_capacity, which no freed cache could make fit),
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
//! a [`Stat`](crate::Stat); `num_host_alloc`, `num_host_free`, `num_alloc_retries`, `num_ooms`,
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
mod error;
mod inner;
mod stats;

pub use buffer::PinnedBuffer;
pub use error::HostAllocError;
pub use stats::HostStats;

use crate::config::HostConfig;
use crate::device::{AccessKind, Device, DeviceError, EventId, Guarded, HostPtr, StreamId};
use crate::sync::{Arc, Mutex, lock};
use crate::types::{Bytes, MAX_REQUEST};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;

pub use crate::types::MIN_HOST_BLOCK;

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
    /// A closed allocator's drain waits for its uses (no lock held) and takes it off the list
    /// in the section that counts it out of `pending_bytes` (`Inner::drain_closed`): no other
    /// drain or poll takes it meanwhile.
    settling: bool,
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
    /// the other pinned allocators of the device freed theirs, once more; at once, every cache
    /// left as it was, for a block larger than the device could ever hold,
    /// [`Device::host_capacity`]).
    pub fn alloc(&self, bytes: u64) -> Result<PinnedBuffer<D>, HostAllocError> {
        let r = match self.alloc_once(bytes) {
            // Not for a block the device could never hold: freeing the peers' caches could not
            // make it fit.
            Err(HostAllocError::OutOfMemory { class, .. })
                if self.inner.could_hold(class) && self.release_peers() =>
            {
                let r = self.alloc_once(bytes);
                if cfg!(tidepool_broken = "rescued_oom_counted")
                    && matches!(r, Err(HostAllocError::OutOfMemory { .. }))
                {
                    // Still one allocation that failed.
                    let mut st = self.inner.lock();
                    st.stats.num_ooms = st.stats.num_ooms.saturating_sub(1);
                }
                r
            }
            r => r,
        };
        // One failed request, counted once it failed for good: a request the peers' caches
        // rescued is none (as the device allocator counts `num_ooms`).
        if !cfg!(tidepool_broken = "rescued_oom_counted")
            && matches!(r, Err(HostAllocError::OutOfMemory { .. }))
        {
            self.inner.lock().stats.num_ooms += 1;
        }
        r
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
        // (A new block is counted handed out by `new_block`, as it is counted reserved.)
        let apart = cfg!(tidepool_broken = "pinned_handout_apart");
        let (ptr, size, counted) = match take_free(&mut st.free, bytes, class, rounded) {
            Some((ptr, size)) => {
                st.stats.cached_bytes -= size;
                (ptr, size, false)
            }
            // BROKEN (`pinned_alloc_locked`): the lock held through `cuMemHostAlloc` and the
            // zeroing, so every other thread's allocation and free waited for them.
            None if cfg!(tidepool_broken = "pinned_alloc_locked") => {
                let size = if rounded { class } else { bytes };
                (self.inner.new_block(Some(st), bytes, size)?, size, !apart)
            }
            None => {
                // `cuMemHostAlloc` page-locks the whole block (milliseconds per MiB on CUDA)
                // and the block is zeroed: neither under the lock, which every allocation and
                // every buffer's drop takes (PyTorch holds no lock there either).
                drop(guard);
                let size = if rounded { class } else { bytes };
                let ptr = self.inner.new_block(None, bytes, size)?;
                guard = lock(&self.inner.state);
                (ptr, size, !apart)
            }
        };
        if !counted {
            inner::count_hand_out(&mut guard, bytes, size);
        }
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
