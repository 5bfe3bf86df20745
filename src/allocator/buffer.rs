//! `Buffer`: device memory handed out by the allocator, returned to it on drop.
//!
//! A buffer's memory comes from one of three places ([`Origin`]): a block of the pool, a slice
//! of a learned plan's region, or nowhere (zero bytes). A buffer made inside a scope also carries
//! a [`ScopeTag`], so the scope can record its free and keep its block for local reuse.

use super::fast_cache::{CachedBlock, ClassKey, StreamCache};
use super::owner::Owner;
use super::plan::Region;
use super::scope::ScopeTag;
use super::stats_layout::is_small;
use crate::device::{AccessKind, Device, DeviceAddr, StreamId};
use crate::pool::BlockId;
use crate::stats::Residency;
use crate::sync::Arc;
use crate::sync::atomic::{AtomicU8, Ordering};
use std::fmt;
use std::mem::ManuallyDrop;

/// Where a buffer's memory lives.
pub(super) enum Origin {
    /// Zero bytes, or a block a scope took back for local reuse.
    None,
    /// A block of the pool.
    Pool(BlockId),
    /// A slice of a learned plan's region, at this offset.
    Region(Arc<Region>, u64),
}

/// A piece of device memory owned by one user. Dropping it frees it, stream-ordered: its block
/// is reusable at once by later allocations on its stream, and by other streams once the uses
/// announced with [`crate::Allocator::record_stream`] have completed.
///
/// `Buffer` is `Send + Sync`: it may be dropped on any thread.
#[must_use = "dropping a Buffer frees its memory at once"]
pub struct Buffer<D: Device> {
    pub(super) ptr: DeviceAddr,
    pub(super) requested: u64,
    pub(super) size: u64,
    pub(super) stream: StreamId,
    /// (`ManuallyDrop`, as `scope`: the drop lets go of them by hand, on its cold path only, so
    /// the common free runs no drop glue after [`Buffer`]'s drop.) Private, as `scope` and
    /// `flags`: every change goes through the methods below, which keep `flags` right.
    origin: ManuallyDrop<Origin>,
    /// Boxed: only unbound scope buffers carry one, and the common hand-out then moves one word
    /// for it instead of the tag's six.
    scope: ManuallyDrop<Option<Box<ScopeTag>>>,
    /// Its hold on the allocator. Dropped by hand at the end of [`Buffer`]'s drop, or left in a
    /// stream cache for the next hit to take over (`owner.rs`).
    pub(super) owner: ManuallyDrop<Arc<Owner<D>>>,
    /// The requested bytes its block is accounted with in the statistics: `requested`, except
    /// for a block a scope reused locally for another request of the same rounded size.
    pub(super) accounted: u64,
    /// The rounded request it served: with the residency, its class in the stream cache.
    pub(super) rounded: u64,
    pub(super) residency: Residency,
    /// Its statistics quadrant (pool kind × residency).
    pub(super) quadrant: u8,
    /// [`USED_ELSEWHERE`], [`UNCOMMON`], [`LARGE`] and [`POOL_ONLY`]: 0 (one compare) lets the
    /// drop take its common case, [`LARGE`] alone its common large case.
    flags: AtomicU8,
}

/// A flag bit: `record_stream` recorded a use on another stream, so its free must take the slow
/// path (events), never the stream cache. The uses themselves sit in the locked state.
const USED_ELSEWHERE: u8 = 1;
/// A flag bit: not a small-pool block with no scope tag (set at hand-out, or as the origin
/// or the scope tag changes): the drop looks at everything, out of line.
const UNCOMMON: u8 = 2;
/// The flags of a large-pool block with no scope tag, alone (any other bit set, it is not the
/// common large case): its drop tries its stream's first lane inline before `drop_cold`.
const LARGE: u8 = 4;
/// A flag bit: a stitched block (`stitch.rs`), whose free is its segment's: the segment leaves
/// the pool and the chunks it borrowed go home. It never waits in a stream cache, where that
/// would wait too (the statistics keeping a segment `global_lock:true` lets go of, the chunks
/// lent), and where its reuse would skip the surgery the pool's own reuse counts. An oversize
/// block (`max_split_size`) too: it counts in `oversize_allocations` until the pool frees it.
const POOL_ONLY: u8 = 8;

impl<D: Device> Buffer<D> {
    /// A buffer of `size` bytes at `ptr` that served a request of `requested` bytes (rounded
    /// to `rounded`) on `stream`, from `origin`, accounted in `quadrant`, holding `owner`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(super) fn new(
        ptr: DeviceAddr,
        requested: u64,
        size: u64,
        stream: StreamId,
        origin: Origin,
        owner: Arc<Owner<D>>,
        rounded: u64,
        residency: Residency,
        quadrant: usize,
    ) -> Buffer<D> {
        let pooled = matches!(origin, Origin::Pool(_));
        let flags = match (pooled, is_small(quadrant)) {
            (true, true) => 0,
            (true, false) => LARGE,
            (false, _) => UNCOMMON,
        };
        Buffer {
            ptr,
            requested,
            accounted: requested,
            size,
            stream,
            origin: ManuallyDrop::new(origin),
            scope: ManuallyDrop::new(None),
            owner: ManuallyDrop::new(owner),
            rounded,
            residency,
            quadrant: quadrant as u8,
            flags: AtomicU8::new(flags),
        }
    }

    /// Whether `record_stream` recorded a use on another stream.
    pub(super) fn used_elsewhere(&self) -> bool {
        #[cfg(tidepool_broken = "events")]
        return false; // BROKEN: forgets the recorded uses, so the block skips its events.
        #[cfg(not(tidepool_broken = "events"))]
        return self.flags.load(Ordering::Acquire) & USED_ELSEWHERE != 0;
    }

    pub(super) fn mark_used_elsewhere(&self) {
        self.flags.fetch_or(USED_ELSEWHERE, Ordering::Release);
    }

    /// Whether its free goes straight to the pool, never to a stream cache ([`POOL_ONLY`]).
    pub(super) fn pool_only(&self) -> bool {
        self.flags.load(Ordering::Relaxed) & POOL_ONLY != 0
    }

    /// Sends its free straight to the pool ([`POOL_ONLY`]): a stitched or oversize block's.
    pub(super) fn mark_pool_only(&mut self) {
        // (Not a large block's common case any more: its drop takes `drop_cold`.)
        self.flags.fetch_or(POOL_ONLY | UNCOMMON, Ordering::Relaxed); // (`&mut self`)
    }

    /// Where its memory lives.
    pub(super) fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Makes it a slice of a region (`Origin::Region`).
    pub(super) fn set_origin(&mut self, origin: Origin) {
        *self.origin = origin;
        self.flags.fetch_or(UNCOMMON, Ordering::Relaxed); // (cold: `&mut self`, any ordering)
    }

    /// Takes its pool block, if it has one, for the caller to free: its drop then frees nothing.
    pub(super) fn take_block(&mut self) -> Option<BlockId> {
        let Origin::Pool(block) = *self.origin else { return None };
        *self.origin = Origin::None;
        self.flags.fetch_or(UNCOMMON, Ordering::Relaxed); // (cold: `&mut self`, any ordering)
        Some(block)
    }

    /// Its scope tag, if an unbound scope buffer.
    pub(super) fn scope_tag(&self) -> Option<&ScopeTag> {
        self.scope.as_deref()
    }

    /// Tags it as a scope's unbound buffer.
    pub(super) fn set_scope(&mut self, tag: Box<ScopeTag>) {
        *self.scope = Some(tag);
        // BROKEN (`UnflaggedScopeTag`): the drop then takes the common case.
        if !self.owner.broken(super::Broken::UnflaggedScopeTag) {
            self.flags.fetch_or(UNCOMMON, Ordering::Relaxed); // (cold: `&mut self`, any ordering)
        }
    }
}

impl<D: Device> Buffer<D> {
    /// The device address of the first byte ([`DeviceAddr::NULL`] for a zero-byte buffer).
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        self.requested
    }

    /// Whether this is a zero-byte buffer (it holds no device memory).
    pub fn is_empty(&self) -> bool {
        self.requested == 0
    }

    /// Bytes of the block behind it (the request rounded up; 0 for a zero-byte buffer).
    pub fn block_size(&self) -> u64 {
        self.size
    }

    /// The stream it was allocated on, which owns it.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Whether it was served from a learned plan's region.
    pub fn is_planned(&self) -> bool {
        matches!(*self.origin, Origin::Region(..))
    }

    /// The pool block behind it, if any.
    pub(super) fn block(&self) -> Option<BlockId> {
        match *self.origin {
            Origin::Pool(b) => Some(b),
            _ => None,
        }
    }

    /// Marks it as used on `stream` as well, in its own allocator (see
    /// [`crate::Allocator::record_stream`]).
    pub fn record_stream(&self, stream: StreamId) -> Result<(), super::AllocError> {
        self.owner.record_use(self, stream)
    }

    /// Announces that work about to be enqueued on `stream` will `access` this buffer, as
    /// cudarc's `DevicePtr::device_ptr(&stream)` does for its own slices: `stream` waits, on the
    /// device, for the buffer's last write (its owner stream's work so far, or the last write
    /// announced on another stream) and, for a write, for the reads announced on other streams
    /// since; and the use is recorded ([`Buffer::record_stream`]), so the block is not reused
    /// before that work completed. On its own stream, with no other stream involved, it does
    /// nothing (stream order suffices). `CudaBuffer` (feature `cuda`) calls it for every cudarc use.
    /// Inside a CUDA-graph capture it orders streams of that capture (a side stream joined to it)
    /// with an event edge of the graph; it fails for a stream outside the capture, which no
    /// captured work can wait for.
    ///
    /// ```
    /// use std::sync::{Arc, mpsc};
    /// use std::time::Duration;
    /// use tidepool::device::{Access, AccessKind, Kernel, Launch};
    /// use tidepool::{Allocator, Config, Device, SimDevice, StreamId};
    ///
    /// let device = Arc::new(SimDevice::backed(1 << 30));
    /// let other = device.create_stream().unwrap();
    /// let alloc = Allocator::new(device.clone(), Config::default()).unwrap();
    /// let buf = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    /// let (p, n) = (buf.ptr(), buf.len());
    /// // A slow write on the buffer's own stream...
    /// let write = vec![Access { ptr: p, bytes: n, kind: AccessKind::Write }];
    /// let fill = Kernel::new("fill", write, move |m| m.write(p, &[42; 4096]).unwrap());
    /// device.launch(StreamId::DEFAULT, Kernel { sleep: Duration::from_millis(20), ..fill }).unwrap();
    /// // ...announced before `other` reads it: `other` waits for it on the device.
    /// buf.use_on(other, AccessKind::Read).unwrap();
    /// let (tx, rx) = mpsc::channel();
    /// let read = vec![Access { ptr: p, bytes: n, kind: AccessKind::Read }];
    /// device.launch(other, Kernel::new("read", read, move |m| {
    ///     let mut b = [0u8; 1];
    ///     m.read(p, &mut b).unwrap();
    ///     tx.send(b[0]).unwrap();
    /// })).unwrap();
    /// assert_eq!(rx.recv().unwrap(), 42); // the read ran after the write
    /// assert_eq!(device.counters().event_waits, 1);
    /// drop(buf); // its block waits for `other`'s read before any reuse
    /// assert!(device.violations().is_empty());
    /// ```
    pub fn use_on(&self, stream: StreamId, access: AccessKind) -> Result<(), super::AllocError> {
        self.owner.use_on(self, stream, access)
    }

    /// The device its memory lives on (the allocator's device).
    pub fn device(&self) -> &Arc<D> {
        self.owner.device.arc()
    }
}

impl<D: Device> Drop for Buffer<D> {
    /// Frees the memory, stream-ordered. A planned slice (of a scope's region) is taken back
    /// and its stream ordered after the other streams it was used on *before* its scope (or a
    /// later run of it) can see the free and hand the slice out again.
    ///
    /// Inlined: the common case (a small pool block with no scope, capture, sanitizer or use on
    /// another stream, into its owner's lane, which keeps the hold on the allocator) is the push
    /// alone; the common large case (a large pool block with none of these) is
    /// `Buffer::drop_large`, everything else `Buffer::drop_cold`, both out of line, so the
    /// common case saves no registers for them. (The large test comes first: after the small
    /// case it moved the 4 KiB pair from 22.3 to 23.3 ns with one instruction fewer.)
    #[inline]
    fn drop(&mut self) {
        let mut state = Freeing::NotTried;
        // (A relaxed load: `&mut self` orders it after every `record_stream`.)
        let flags = self.flags.load(Ordering::Relaxed);
        #[cfg(not(tidepool_broken = "large_drop"))]
        let large = flags == LARGE;
        // BROKEN: any large block takes the large case, a use on another stream or a scope tag
        // notwithstanding (`tests/fast_path.rs::a_large_free_takes_the_lane_only_when_nothing_else_is_owed`).
        #[cfg(tidepool_broken = "large_drop")]
        let large = flags & LARGE != 0;
        if large {
            return self.drop_large();
        }
        if flags == 0
            && let Origin::Pool(block) = *self.origin
            && self.no_capture()
            && let Some(lane) = self.owner.quiet_lane()
        {
            if lane.push_small(self.class(), self.cached(block), self.stream) {
                return; // `owner` now belongs to the lane (nothing to forget)
            }
            state = Freeing::Refused;
        }
        self.drop_cold(state);
    }
}

impl<D: Device> Buffer<D> {
    /// [`Buffer`]'s drop for a large-pool block with no scope tag: into its stream's first
    /// lane, whose owner this buffer holds, with none of `drop_cold`'s questions. Where the lane
    /// holds a large block already, `drop_cold` sends it straight to the pool (`Refused`: it
    /// asked `lane_for_free`'s question again before, 2026-12-06); anything else (a capture,
    /// the sanitizer, a lane that is not the stream's first) is left to `drop_cold` whole.
    #[inline(never)]
    fn drop_large(&mut self) {
        let mut state = Freeing::NotTried;
        if let Origin::Pool(block) = *self.origin
            && self.no_capture()
            && let Some(lane) = self.owner.quiet_lane()
            && lane.is_first_of(self.stream)
        {
            if self.owner.takes_large(lane, self.size) {
                if lane.push_stash(self.class(), self.cached(block), self.stream, true).is_ok() {
                    return; // `owner` now belongs to the lane (nothing to forget)
                }
                state = Freeing::Refused;
            } else if !cfg!(tidepool_broken = "large_drop") {
                // The lane holds a large block already (its hint): straight to the pool, where
                // `free_fast` would send it too after asking `lane_for_free` the same again;
                // from here, not through `drop_cold` (a call fewer on every such free, 2897 of
                // gpt2_train's 5322). (Not in the broken build, whose large case may carry a
                // scope tag.)
                self.owner.free_into_pool(self.freed(block));
                // SAFETY: the buffer's drop ends here; nothing of it is used after.
                unsafe { self.let_go(false) };
                return;
            }
        }
        self.drop_cold(state);
    }

    /// Lets go of the buffer's hold on the allocator (unless the lane `kept` it), its origin
    /// and its scope tag: the end of its drop.
    ///
    /// # Safety
    ///
    /// Called once, as the buffer's drop ends: nothing of the buffer is used after.
    #[inline(always)]
    unsafe fn let_go(&mut self, kept: bool) {
        // SAFETY: each is let go once, here (the caller's promise), and the buffer is not used
        // after. (`owner` only where the lane did not keep it: the lane owns that reference
        // now.)
        unsafe {
            if !kept {
                ManuallyDrop::drop(&mut self.owner);
            }
            ManuallyDrop::drop(&mut self.origin);
            ManuallyDrop::drop(&mut self.scope);
        }
    }
}

/// How far the inlined part of [`Buffer`]'s drop got.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Freeing {
    /// Not the common case: everything is left to [`Buffer::drop_cold`].
    NotTried,
    /// Its owner's lane refused the block (full, closed, caching off): to the pool.
    Refused,
}

impl<D: Device> Buffer<D> {
    /// Whether no capture may hold its free back: none of its family is underway, nor any on
    /// the device (one of another family, or begun on the device itself:
    /// `Shared::hold_for_foreign`). Two loads.
    #[inline(always)]
    fn no_capture(&self) -> bool {
        // BROKEN (`foreign_capture_freed`, and `foreign_capture_lane` alone): a free during a
        // foreign capture goes to the lane, which hands it out again.
        !self.owner.cells().family.captures.any()
            && (cfg!(tidepool_broken = "foreign_capture_freed")
                || cfg!(tidepool_broken = "foreign_capture_lane")
                || !self.owner.device.capture_underway())
    }

    /// Its class in a stream cache.
    #[inline(always)]
    fn class(&self) -> ClassKey {
        ClassKey { residency: self.residency, rounded: self.rounded }
    }

    /// Its pool block as a stream cache keeps it.
    #[inline(always)]
    fn cached(&self, block: BlockId) -> CachedBlock {
        CachedBlock {
            block,
            ptr: self.ptr,
            size: self.size,
            requested: self.accounted,
            quadrant: self.quadrant as usize,
        }
    }

    /// The rest of [`Buffer`]'s drop, out of line: the free (unless the inlined part did it),
    /// then its hold on the allocator, its origin and its scope tag are let go.
    #[cold]
    #[inline(never)]
    fn drop_cold(&mut self, state: Freeing) {
        let kept = match (state, &*self.origin) {
            (Freeing::Refused, &Origin::Pool(block)) => {
                self.owner.free_into_pool(self.freed(block));
                false
            }
            (_, &Origin::Pool(block)) if self.scope.is_none() && self.no_capture() => {
                self.free_fast(block)
            }
            _ => {
                self.drop_slow();
                false
            }
        };
        // SAFETY: the buffer's drop ends here; nothing of it is used after.
        unsafe { self.let_go(kept) };
    }

    /// Frees its pool block (`Shared::free_stash`, read straight from the buffer: a free into
    /// a lane copies no `Freed`). `true`: the block went to a lane, which kept the buffer's
    /// hold on the allocator (see `owner.rs`).
    ///
    /// A small block goes to its owner's lane: no lookup. (Caching off, history recorded or the
    /// lane closed: its `room` is 0 and the push refuses.) A large one goes to its stream's
    /// first lane, which holds one at most; the hold stays there only if that lane is its
    /// owner's (large buffers are handed out with it).
    fn free_fast(&self, block: BlockId) -> bool {
        let owner: &Owner<D> = &self.owner;
        if owner.cells().observes {
            owner.device.note_reclaim(self.ptr, self.size, self.stream);
        }
        let q = self.quadrant as usize;
        if !self.used_elsewhere()
            && !self.pool_only()
            && let Some(lane) = owner.lane()
        {
            let (class, b) = (self.class(), self.cached(block));
            if is_small(q) {
                if let Ok(stashed) = lane.push_stash(class, b, self.stream, true) {
                    return stashed;
                }
            } else if let Some(first) = owner.lane_for_free(q, self.size, self.stream) {
                // (A reference under std, a clone under loom.)
                #[allow(clippy::needless_borrow)]
                let first: &StreamCache = &first;
                let stash = std::ptr::eq(lane, first);
                if let Ok(stashed) = first.push_stash(class, b, self.stream, stash) {
                    return stashed;
                }
            }
        }
        owner.free_into_pool(self.freed(block));
        false
    }

    /// What freeing its pool block needs to know.
    #[inline]
    fn freed(&self, block: BlockId) -> Freed {
        Freed {
            block,
            ptr: self.ptr,
            size: self.size,
            requested: self.accounted,
            stream: self.stream,
            rounded: self.rounded,
            residency: self.residency,
            quadrant: self.quadrant as usize,
            used_elsewhere: self.used_elsewhere(),
            pool_only: self.pool_only(),
        }
    }

    /// [`Buffer`]'s drop for everything but the common case: scoped buffers, planned slices,
    /// frees a capture may hold back (all but letting go of `owner`).
    #[cold]
    fn drop_slow(&mut self) {
        let planned = matches!(*self.origin, Origin::Region(..));
        // A scope's unbound buffer freed while a capture holds it goes to the graph whole: its
        // run or region would hand its memory out again at once (`capture/`).
        if (planned || self.scope.is_some())
            && self.owner.family.captures.any()
            && !self.owner.broken(super::Broken::CaptureScopeFrees)
        {
            let owner = Arc::clone(&self.owner);
            let uses = self.uses_for_capture();
            if owner.family.captures.defer_buffer(&owner, self.stream, &uses, || self.take_whole())
            {
                return;
            }
        }
        // A planned slice freed during a foreign capture: its region is never served nor
        // returned again (marked before the scope can see the free, `Shared::scope_free_foreign`).
        if let Origin::Region(region, _) = &*self.origin
            && self.owner.scope_free_foreign(self.stream, &self.uses_for_capture())
        {
            region.mark_foreign();
        }
        let uses = self.scope.as_ref().map(|t| t.take_uses()).unwrap_or_default();
        // BROKEN (finding 4): the free is visible to the scope before the ordering is in place.
        let late = cfg!(tidepool_broken = "unbound_free")
            || (planned && self.owner.broken(super::Broken::UnboundFreeOrder));
        let mut ordered = true;
        if planned && !late {
            self.owner.device.note_reclaim(self.ptr, self.size, self.stream);
            ordered = self.owner.order_after(self.stream, &uses);
            if let (false, Origin::Region(region, _)) = (ordered, &*self.origin) {
                region.poison();
            }
        }
        if let Some(tag) = self.scope.take() {
            tag.on_drop(self);
        }
        if planned && late {
            #[cfg(not(loom))]
            if self.owner.broken(super::Broken::UnboundFreeOrder) {
                // Stands for the wait on the global lock that opened the window.
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            self.owner.device.note_reclaim(self.ptr, self.size, self.stream);
            ordered = self.owner.order_after(self.stream, &uses);
        }
        match std::mem::replace(&mut *self.origin, Origin::None) {
            Origin::Pool(block) => {
                let freed = self.freed(block);
                // A capture of its stream may hold it back (`capture/`), or one of another
                // family that captures it (`Shared::hold_for_foreign`).
                if let Some(freed) = self.owner.family.captures.defer(&self.owner, freed)
                    && let Some(freed) = self.owner.hold_for_foreign(freed)
                {
                    self.owner.free(freed);
                }
            }
            Origin::Region(region, _) => {
                if !ordered {
                    region.poison();
                }
                if self.used_elsewhere() {
                    self.owner.forget_uses(self.ptr);
                }
                self.owner.release_region(region);
            }
            Origin::None => {}
        }
    }
}

impl<D: Device> Buffer<D> {
    /// The other streams it was used on, for a capture deciding whether it holds the buffer
    /// back (read, not taken: the buffer's drop still needs them).
    fn uses_for_capture(&self) -> Vec<StreamId> {
        if !self.used_elsewhere() {
            return Vec::new();
        }
        let mut uses = self.scope.as_ref().map(|t| t.uses()).unwrap_or_default();
        if let Origin::Pool(block) = *self.origin {
            uses.extend(self.owner.block_uses(block));
        }
        uses
    }

    /// Moves everything it holds into a new buffer (a capture keeps that one): this one is
    /// left with no origin and no scope tag, and its own hold on the allocator, for its drop
    /// to let go of.
    fn take_whole(&mut self) -> Buffer<D> {
        Buffer {
            ptr: self.ptr,
            requested: self.requested,
            size: self.size,
            stream: self.stream,
            origin: ManuallyDrop::new(std::mem::replace(&mut *self.origin, Origin::None)),
            scope: ManuallyDrop::new(self.scope.take()),
            owner: ManuallyDrop::new(Arc::clone(&self.owner)),
            accounted: self.accounted,
            rounded: self.rounded,
            residency: self.residency,
            quadrant: self.quadrant,
            flags: AtomicU8::new(self.flags.load(Ordering::Acquire) | UNCOMMON),
        }
    }
}

#[cfg(tidepool_broken = "from_buffer_drops")]
impl<D: Device> Buffer<D> {
    /// BROKEN (`from_buffer_drops`): frees this buffer and returns an empty one (no memory, at
    /// [`DeviceAddr::NULL`]) of its allocator and stream: all a caller of
    /// `CudaBuffer::from_buffer` had left after a refusal, before the refusal gave it back.
    pub(crate) fn dropped(self) -> Buffer<D> {
        let owner = Arc::clone(&self.owner);
        let empty = Buffer::new(
            DeviceAddr::NULL,
            0,
            0,
            self.stream,
            Origin::None,
            owner,
            0,
            self.residency,
            0,
        );
        drop(self);
        empty
    }
}

/// What the allocator needs to know about a buffer being freed.
pub(super) struct Freed {
    pub(super) block: BlockId,
    pub(super) ptr: DeviceAddr,
    pub(super) size: u64,
    pub(super) requested: u64,
    pub(super) stream: StreamId,
    pub(super) rounded: u64,
    pub(super) residency: Residency,
    pub(super) quadrant: usize,
    pub(super) used_elsewhere: bool,
    /// Never into a stream cache ([`POOL_ONLY`]).
    pub(super) pool_only: bool,
}

impl<D: Device> fmt::Debug for Buffer<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &self.ptr)
            .field("len", &self.requested)
            .field("block_size", &self.size)
            .field("stream", &self.stream)
            .field("planned", &self.is_planned())
            .finish()
    }
}
