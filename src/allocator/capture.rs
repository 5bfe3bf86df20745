//! CUDA-graph capture through the allocator: [`Allocator::begin_capture`] starts capturing a
//! stream on the device and routes its allocations to the graph's private pool;
//! [`Allocator::end_capture`] returns a [`Graph`] that replays the captured work and keeps the
//! pool (and every buffer freed during the capture) until it is dropped.
//!
//! ```text
//!  begin_capture(s, pool) ─▶ device.begin_capture(s); table[s] = { pool, deferred: [] }; route s → pool
//!    alloc(n, s)   ─▶ pool's segments (cuMemAlloc during capture is legal; nothing is released)
//!    free of a pool buffer on s   ─▶ back into the pool: reused only by later captured allocations
//!    free of any other buffer on s ─▶ deferred: held by the graph (its replays may read it)
//!  end_capture(s) ─▶ device.end_capture(s) = GraphId; Graph { pool, deferred }
//!  Graph::launch(t) ─▶ device.launch_graph
//!  drop(Graph)    ─▶ destroy the graph, wait for its launches, free the deferred buffers,
//!                    let go of the pool (its memory goes back when its last handle and buffer do)
//! ```
//!
//! What CUDA forbids during a capture (global mode) the allocator never does while one is
//! underway on its device ([`Device::capture_underway`], PyTorch's `captures_underway`): it polls
//! no event, releases no segment, waits for nothing (the out-of-memory ladder goes straight to
//! the error), and records no event on the capturing stream (a freed buffer used there is
//! deferred, not ordered by an event). Frees during capture are ordered by the capture itself:
//! a block freed on the capturing stream is reused only by later work of the same stream inside
//! the same graph — or of a later capture into the same pool once the graph is gone. A second
//! capture into a pool a live graph uses is refused: the graph's replays write every block its
//! capture allocated, freed or not. Only the `unsafe` [`Allocator::begin_capture_sharing`]
//! shares such a pool, under PyTorch's `pool=` contract (graphs sharing a pool are replayed in
//! capture order, never concurrently).
//!
//! A pool's cached memory may have been used last by ordinary work (outputs of an earlier
//! graph, freed since; blocks a `PoolGuard` routed). A replay is ordered after the work of the
//! stream it is launched on only, and a stream joining the capture brings none of its earlier
//! work along, so a capture begins after the capturing stream waits for every stream the pool
//! has memory on, and records a *start* event that a replay launched on another stream waits
//! on; a block of the pool freed outside the capture while it is underway goes back only when
//! it ends (its stream may join it later).
//!
//! A buffer of another stream that was used on the capturing stream (`record_stream`,
//! `use_on`) and is freed during the capture is held back too: no event can be recorded on a
//! capturing stream, and the graph's replays may use it.
//!
//! Scope memory has no pool free to defer, so it is held back in its own way:
//! - a scope's unbound buffer (a planned slice, or a pool block its run or region would take
//!   back) is kept *whole* by the graph: its run and region hear of the free only when the
//!   graph goes, so neither hands the memory out meanwhile (to them it is a live escape);
//! - a bound buffer's pool block is not kept for the run's local reuse: its drop defers it;
//! - a bound buffer's planned slice makes the graph hold the run's whole region: it serves no
//!   more slices in the run and no later run claims it until the graph is gone (the inlined
//!   planned free takes the slow path while any stream is routed, as a capture's is).
//!
//! Other streams join a capture as in CUDA (fork and join): a stream that waits on an event
//! recorded on a capturing stream is captured too until the capture ends, and the allocator
//! treats it as the stream the capture began on — its allocations come from the graph's pool
//! (PyTorch's `test_cuda_graph_allocator_propagates_stream`), what it frees that the graph uses
//! is held back, and what was used on it is held back when freed anywhere. The allocator does
//! not see the join (the application waits on the event through the device); it asks the device
//! ([`Device::capture_of`], CUDA's `cuStreamGetCaptureInfo`) wherever a capture is underway and
//! a stream is not one a capture began on. It never records an event of its own on a capturing
//! stream for a stream outside the capture to wait on ([`Guarded::record_event`](crate::device::Guarded)
//! refuses): that would fork the waiting stream into the graph. The one event it records inside
//! a capture orders `use_on` between two streams of that capture (the buffer's last writer and
//! the user): an edge of the graph, waited on by the other member only.
//!
//! ```text
//!   begin_capture(s)            s ── e ──────────────── wait(e') ── end_capture(s)
//!   (the application) record e,      ╲                  ╱
//!   t waits on e: t joins             t: alloc → graph's pool, frees held back, record e'
//! ```
//!
//! With `graph_capture_record_stream_reuse:true` (PyTorch's key), a block of the capture's own
//! pool freed after uses on its other streams waits instead of being held (see [`Wait`]): the
//! next allocation of the capture after the device shows the block's stream ordered after those
//! uses (the side streams were joined back) frees it into the pool, and so does the capture's
//! end (every stream was joined back by then), for a later capture sharing the pool.
//!
//! A capture begins by polling its pool's events (blocks of it freed after ordinary work on
//! other streams), so it is handed the blocks whose work completed; none is polled during it.
//!
//! Limits: scopes refuse to allocate on a capturing stream, joined or not.
//!
//! **Captures of another family.** The table above is the family's: a capture that another
//! allocator began on the same device, or one begun on the device itself
//! ([`Capture::begin_capture`], a safe call), routes nothing here. The device tells
//! ([`Device::capture_underway`], one load; [`Device::capture_of`]), and the allocator asks it:
//!
//! ```text
//!   hits (small, large, a scope's planned slice) ─▶ capture_underway()? the whole path
//!   whole path on s: capture_of(s) = Some(o), o not this family's ─▶ Err(ForeignCapture { s, o })
//!   free of a pool block on s (or used on s) while capture_of(s) is foreign ─▶ pending for good
//! ```
//!
//! A request on such a stream is refused ([`AllocError::ForeignCapture`]): the captured work
//! would be handed memory that no graph of this family holds, which the foreign graph replays
//! after it has gone back here. A block freed on such a stream (or used there) may be used by
//! the foreign graph's replays for as long as that graph lives, and this allocator cannot see
//! the graph go: it is never handed out again. It stays pending (no longer allocated, still
//! reserved) for the allocator's life and goes back to the device with the allocator's
//! segments (`Shared::hold_for_foreign`). A capture of the family holds the same block only
//! until its graph goes; holding it "until the capture ends" instead would hand it out while
//! the replays still write it. The cost is what a program frees on another allocator's
//! captured streams during the capture, held for good: free such buffers before the capture
//! or after it. A scope's buffers freed then are held the same way
//! ([`Shared::scope_free_foreign`]): a pool block goes to neither the run's local cache nor the
//! region that adopted its segment, and a planned slice's region serves no more slices, is let
//! go of by its plan and kept allocated for the allocator's life.

use super::buffer::Freed;
use super::owner::Owner;
use super::plan::Region;
use super::private_pool::MemPool;
use super::*;
use crate::device::{Capture, CaptureMark, GraphId, Guarded};
use crate::sync::atomic::AtomicUsize;

/// What a graph holds back until it is dropped.
pub(super) enum Held<D: Device> {
    /// A pool block freed during the capture, with its allocator: pending (no longer allocated,
    /// still active) until the graph goes, then freed.
    Block(Arc<Owner<D>>, Freed),
    /// A scope's unbound buffer freed during the capture, kept whole: its scope run and region
    /// hear of the free only when the graph goes (a planned slice or a block a region would
    /// take back has no pool free to defer).
    Buffer(Buffer<D>),
    /// A scope's region, one of whose planned slices (of `stream`, used on `uses` too) was
    /// freed during the capture: claimed by no run while held; when the graph goes, the
    /// slice's reuse is ordered after `uses` and the hold let go through its allocator.
    Region { shared: Arc<Shared<D>>, region: Arc<Region>, stream: StreamId, uses: Vec<StreamId> },
    /// A dropped graph's hold on its pool (its `graphs` count), kept while nothing has shown
    /// that the graph's launches completed: the pool's free memory is the replays' until then.
    Pool(MemPool<D>),
}

impl<D: Device> Held<D> {
    /// Lets go of it: the block is freed, the buffer dropped.
    pub(super) fn release(self) {
        match self {
            Held::Block(owner, f) => owner.free_held(f, false),
            Held::Buffer(b) => drop(b),
            Held::Region { shared, region, stream, uses } => {
                // Nothing could order it (the stream is gone and no host wait is allowed):
                // never served again.
                if !shared.order_after(stream, &uses) {
                    region.poison();
                }
                region.graph_gone();
                shared.release_region(region);
            }
            Held::Pool(pool) => {
                pool.alloc.shared.role.graphs.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Keeps it allocated for good (nothing can tell when the graph's launches end).
    fn leak(self) {
        match self {
            Held::Block(..) => {}
            Held::Buffer(b) => std::mem::forget(b),
            // Never claimed again, never back in the pool.
            Held::Region { region, .. } => std::mem::forget(region),
            // Busy for good: no capture nor guard is given it again.
            Held::Pool(pool) => std::mem::forget(pool),
        }
    }
}

/// What graphs hold back, with the allocators.
type Deferred<D> = Vec<Held<D>>;

/// The captures underway in an allocator family, by stream.
pub(crate) struct CaptureTable<D: Device> {
    active: AtomicUsize,
    /// Blocks waiting in all captures' `waits` (one load tells an allocation there are none).
    waiting: AtomicUsize,
    inner: Mutex<HashMap<StreamId, Entry<D>>>,
}

impl<D: Device> Default for CaptureTable<D> {
    fn default() -> Self {
        CaptureTable {
            active: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            inner: Mutex::new(HashMap::new()),
        }
    }
}

struct Entry<D: Device> {
    route: u64,
    pool: MemPool<D>,
    deferred: Deferred<D>,
    /// Blocks of the capture's pool freed during it after uses on its other streams, waiting
    /// to be reused within it (`graph_capture_record_stream_reuse`); held like `deferred` if
    /// the capture ends first.
    waits: Vec<Wait<D>>,
    /// Blocks of the capture's pool freed during it on a stream outside it: back into the pool
    /// when the capture ends, not before — a stream that joins the capture later would be
    /// handed them, and its captured work is not ordered after its earlier, ordinary work.
    outside: Deferred<D>,
    /// An event recorded on the capturing stream just before the capture began, after the work
    /// that last used the pool's cached memory (`None`: the pool had none): a replay launched
    /// on another stream waits on it ([`Graph::launch`]).
    start: Option<EventId>,
    /// `graph_capture_record_stream_reuse` of the allocator that began the capture, as it was
    /// then.
    reuse: bool,
    /// Test-only: the capture runs as if there were no private pool (`Broken::CaptureGeneral`).
    broken: bool,
}

impl<D: Device> Entry<D> {
    /// The capture is abandoned (it failed to begin or to make a graph): what it held goes
    /// back, its start event too.
    fn abandon(self, device: &Guarded<D>) {
        self.deferred.into_iter().chain(self.outside).for_each(Held::release);
        if let Some(e) = self.start {
            let _ = device.destroy_event(e);
        }
    }
}

/// A block of a capture's pool, freed during the capture after uses on other streams of it
/// (`record_stream`, `use_on`): it goes back to the pool, within the capture, once the device
/// shows that the work captured on the block's stream from then on is ordered after each of
/// those uses (the side streams were joined back). PyTorch's `graph_capture_record_stream_reuse`
/// inserts an empty node per use stream and searches the graph from the stream's frontier;
/// tidepool asks the device ([`Device::capture_mark`], [`Device::capture_ordered_after`]).
///
/// ```text
///   s: alloc x ── fork ──────────── join ── free x ── alloc y  (x's block once s is ordered
///   t:              └─ use x ── record ┘               after t's mark: at the join)
///   free x: Wait { x, marks: [t at its last captured work] }   alloc on s: ordered? ⇒ free
/// ```
pub(super) struct Wait<D: Device> {
    owner: Arc<Owner<D>>,
    freed: Freed,
    /// Where each other stream it was used on stood when it was freed.
    marks: Vec<CaptureMark>,
}

impl<D: Device> Shared<D> {
    /// The origin of the capture that captures `stream`, when the device says one does and it
    /// is not of this allocator's family (another allocator's on the same device, or one begun
    /// on the device itself): this allocator hands out nothing there and holds back what is
    /// freed there ([`Shared::hold_for_foreign`]). One load while no capture is underway.
    #[inline]
    pub(super) fn foreign_capture(&self, stream: StreamId) -> Option<StreamId> {
        if !self.device.capture_underway() {
            return None;
        }
        self.foreign_origin(stream)
    }

    /// [`Shared::foreign_capture`] past its first load.
    #[cold]
    fn foreign_origin(&self, stream: StreamId) -> Option<StreamId> {
        let origin = self.device.capture_of(stream)?;
        (!self.family.captures.began_on(origin)).then_some(origin)
    }

    /// Whether memory of a scope freed now on `stream`, after uses on `uses`, may be used by a
    /// foreign capture's graph (see [`Shared::hold_for_foreign`]): such a capture captures
    /// `stream` or one of `uses`. Then a planned slice's region is never served or returned
    /// again (`Region::mark_foreign`), and a pool block neither goes to the run's local cache
    /// nor joins a region (the buffer's drop holds it for good). One load while no capture is
    /// underway.
    pub(super) fn scope_free_foreign(&self, stream: StreamId, uses: &[StreamId]) -> bool {
        // BROKEN (`foreign_scope_reused`): back to the run and its region as usual.
        if cfg!(tidepool_broken = "foreign_scope_reused") || !self.device.capture_underway() {
            return false;
        }
        std::iter::once(&stream).chain(uses).any(|&s| self.foreign_origin(s).is_some())
    }

    /// A pool block of this allocator is being freed (no capture of its family held it back):
    /// `None` when a foreign capture (see [`Shared::foreign_capture`]) captures its stream or a
    /// stream it was used on. Then its captured work may have used it, and that graph's replays
    /// use it for as long as the graph lives, which this allocator cannot see: the block stays
    /// pending (no longer allocated, still active) for the allocator's life, never handed out
    /// again, and goes back with the allocator's segments when the allocator goes. A capture of
    /// the family instead holds such a block until its graph goes (`CaptureTable::defer`).
    pub(super) fn hold_for_foreign(&self, f: Freed) -> Option<Freed> {
        // BROKEN (`foreign_capture_freed`): freed as usual, handed out again at once.
        if cfg!(tidepool_broken = "foreign_capture_freed") || !self.device.capture_underway() {
            return Some(f);
        }
        let captured = self.foreign_origin(f.stream).is_some()
            || (f.used_elsewhere
                && self.block_uses(f.block).into_iter().any(|u| self.foreign_origin(u).is_some()));
        if !captured {
            return Some(f);
        }
        // Taken back on its stream as the capture sees it (SimDevice: the graph holds it).
        self.device.note_reclaim(f.ptr, f.size, f.stream);
        self.pend_held(&f);
        self.lock_state().foreign_held.push(f);
        None
    }
}

impl<D: Device> CaptureTable<D> {
    /// Whether any capture is underway (one load).
    /// Relaxed is enough: the table itself is read under its lock, and a route (capture) that
    /// happens-before this call is seen by coherence; one installed concurrently by another
    /// thread has no order with this call anyway. (Acquire cost the planned pair 18 → 34 ns:
    /// it keeps the compiler from holding the scope's cursor cells in registers across it.)
    #[inline(always)]
    pub(super) fn any(&self) -> bool {
        self.active.load(Ordering::Relaxed) != 0
    }

    /// Whether a capture began on `stream` (through this family).
    pub(super) fn began_on(&self, stream: StreamId) -> bool {
        self.any() && lock(&self.inner).contains_key(&stream)
    }

    /// Whether `stream` is being captured: a capture of this family began on it, or it joined
    /// one (see [`CaptureTable::origin`]).
    pub(super) fn capturing(&self, sh: &Shared<D>, stream: StreamId) -> bool {
        self.any() && Self::origin(&lock(&self.inner), sh, stream).is_some()
    }

    /// The capture of this family that `stream` belongs to, by the stream it began on: `stream`
    /// itself, or, for a stream that joined a capture by waiting on an event recorded inside
    /// it (CUDA's fork, which the allocator does not see), the origin the device names.
    fn origin(
        t: &HashMap<StreamId, Entry<D>>,
        sh: &Shared<D>,
        stream: StreamId,
    ) -> Option<StreamId> {
        if t.contains_key(&stream) {
            return Some(stream);
        }
        if sh.broken(Broken::JoinedStreamsOutside) {
            return None; // BROKEN: a joined stream counts as outside the capture
        }
        sh.device.capture_of(stream).filter(|o| *o != stream && t.contains_key(o))
    }

    /// Whether `stream` joined a capture of this family (one that began on another stream).
    pub(super) fn joined(&self, sh: &Shared<D>, stream: StreamId) -> bool {
        self.any() && Self::origin(&lock(&self.inner), sh, stream).is_some_and(|o| o != stream)
    }

    /// The private pool a stream that is being captured allocates from: its capture's, with
    /// whether the capture began on it (`true`) or it joined one (`false`); `None` for a
    /// stream no capture of this family has, or whose capture is not routed.
    ///
    /// It wins over any [`PoolGuard`](super::PoolGuard) of the stream: whatever the captured
    /// work writes is the graph's to replay, so it must come from the pool the graph holds.
    /// With `joined_only`, a stream a capture began on gets `None` (its capture's route, the
    /// stream's latest, decides: the broken build `guard_in_capture`).
    pub(super) fn capture_pool(
        &self,
        sh: &Shared<D>,
        stream: StreamId,
        joined_only: bool,
    ) -> Option<(Allocator<D>, bool)> {
        if !self.any() {
            return None;
        }
        let t = lock(&self.inner);
        let origin = Self::origin(&t, sh, stream).filter(|o| !joined_only || *o != stream)?;
        t.get(&origin).filter(|e| !e.broken).map(|e| (e.pool.alloc.clone(), origin == stream))
    }

    /// A buffer is being freed: `Some(f)` to free it now; `None` when a capture holds it back:
    /// the capture of its stream (unless it is of that capture's pool), or the capture of a
    /// stream it was used on (`record_stream`: no event can be recorded there now). The
    /// graph's replays may read it.
    pub(super) fn defer(&self, owner: &Arc<Owner<D>>, f: Freed) -> Option<Freed> {
        if !self.any() {
            return Some(f);
        }
        // The streams it was used on, read before this table is locked. Lock order: this
        // table, then an allocator's state (a held block is pended under the table's lock, so
        // that the end of the capture sees it held or not at all); never the other way round:
        // nothing asks this table while it holds an allocator's state.
        let uses = match f.used_elsewhere {
            true => owner.block_uses(f.block),
            false => Vec::new(),
        };
        let stream = f.stream;
        // Pended under the table's lock: atomic with the capture's end (the graph cannot let go
        // of it before, nor the capture end without it).
        let mut t = lock(&self.inner);
        if !uses.is_empty()
            && let Some((origin, marks)) = Self::marks_for_reuse(&t, owner, stream, &uses)
        {
            let e = t.get_mut(&origin).expect("found by marks_for_reuse");
            owner.pend_held(&f);
            e.waits.push(Wait { owner: owner.clone(), freed: f, marks });
            self.waiting.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mut f = Some(f);
        let held = Self::hold_in(&mut t, owner, stream, &uses, || {
            let f = f.take().expect("once");
            owner.pend_held(&f);
            Held::Block(owner.clone(), f)
        });
        if held {
            return None;
        }
        let f = f.expect("not held");
        match Self::outside_of(&t, owner, stream) {
            Some(key) => {
                owner.pend_held(&f);
                let e = t.get_mut(&key).expect("found by outside_of");
                e.outside.push(Held::Block(owner.clone(), f));
                None
            }
            None => Some(f),
        }
    }

    /// The capture whose pool `mine` is, when a block of it is freed on `stream` outside every
    /// capture: that capture keeps it until it ends (see `Entry::outside`).
    fn outside_of(
        t: &HashMap<StreamId, Entry<D>>,
        mine: &Shared<D>,
        stream: StreamId,
    ) -> Option<StreamId> {
        // BROKEN: back into the pool at once, where a stream joining later is handed it.
        if cfg!(tidepool_broken = "outside_free") || Self::origin(t, mine, stream).is_some() {
            return None;
        }
        t.iter()
            .find(|(_, e)| !e.broken && std::ptr::eq(mine, &*e.pool.alloc.shared))
            .map(|(k, _)| *k)
    }

    /// For a block of `mine` freed on `stream` after uses on `uses`: its capture (by origin)
    /// and a mark of each of those other streams, when it may wait to be reused within the
    /// capture — the block is of the capture's own pool and every use stream is a stream of
    /// the same capture that the device can mark. `None`: it is held as without the key.
    fn marks_for_reuse(
        t: &HashMap<StreamId, Entry<D>>,
        mine: &Shared<D>,
        stream: StreamId,
        uses: &[StreamId],
    ) -> Option<(StreamId, Vec<CaptureMark>)> {
        let origin = Self::origin(t, mine, stream)?;
        let e = &t[&origin];
        if !e.reuse || e.broken || !std::ptr::eq(mine, &*e.pool.alloc.shared) {
            return None;
        }
        let mut marks = Vec::new();
        for &u in uses.iter().filter(|&&u| u != stream) {
            if Self::origin(t, mine, u) != Some(origin) {
                return None;
            }
            marks.push(mine.device.capture_mark(u)?);
        }
        (!marks.is_empty()).then_some((origin, marks))
    }

    /// Whether `stream` belongs to a capture underway (of this family) into the pool `pool`:
    /// one sharing it with the capture about to begin, whose work there the graphs' order
    /// covers (`begin_capture_sharing`'s contract).
    fn captures_into(&self, sh: &Shared<D>, stream: StreamId, pool: &Shared<D>) -> bool {
        let t = lock(&self.inner);
        Self::origin(&t, sh, stream).is_some_and(|o| std::ptr::eq(pool, &*t[&o].pool.alloc.shared))
    }

    /// Takes the entry of the capture begun on `stream` out of the table. The blocks kept out
    /// of its pool (`Entry::outside`) pass to another capture underway into the same pool
    /// (`begin_capture_sharing`), whose joined streams must not be handed them either.
    fn remove(&self, stream: &StreamId) -> Option<Entry<D>> {
        let mut t = lock(&self.inner);
        let mut entry = t.remove(stream)?;
        let same = |e: &&mut Entry<D>| {
            !e.broken && std::ptr::eq(&*e.pool.alloc.shared, &*entry.pool.alloc.shared)
        };
        if !entry.outside.is_empty()
            && let Some(other) = t.values_mut().find(same)
        {
            other.outside.append(&mut entry.outside);
        }
        Some(entry)
    }

    /// Whether blocks wait to be reused within a capture (one load).
    #[inline(always)]
    pub(super) fn waiting(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) != 0
    }

    /// An allocation on `stream` (of a capture): frees into the capture's pool each block
    /// waiting there whose stream the device now shows ordered after every use it waits on
    /// (PyTorch's `free_safe_blocks_in_capture`); returns how many.
    pub(super) fn reclaim(&self, sh: &Shared<D>, stream: StreamId) -> usize {
        let ready: Vec<Wait<D>> = {
            let mut t = lock(&self.inner);
            let Some(origin) = Self::origin(&t, sh, stream) else { return 0 };
            let Some(e) = t.get_mut(&origin) else { return 0 };
            let (ready, waits) = std::mem::take(&mut e.waits).into_iter().partition(|w| {
                // BROKEN: reused without the device's word that the uses come first.
                w.owner.broken(Broken::CaptureReuseUnordered)
                    || w.marks.iter().all(|&m| sh.device.capture_ordered_after(w.freed.stream, m))
            });
            e.waits = waits;
            self.waiting.fetch_sub(ready.len(), Ordering::Relaxed);
            ready
        };
        let n = ready.len();
        for w in ready {
            w.owner.free_held(w.freed, true);
        }
        n
    }

    /// [`CaptureTable::defer`] for a scope's unbound buffer of `owner` on `stream`, used on
    /// `uses` too: `true` when a capture holds it back, and then `take` made the whole buffer
    /// the graph keeps (its drop, when the graph goes, frees it as it would have now).
    pub(super) fn defer_buffer(
        &self,
        owner: &Arc<Owner<D>>,
        stream: StreamId,
        uses: &[StreamId],
        take: impl FnOnce() -> Buffer<D>,
    ) -> bool {
        self.any() && self.hold(owner, stream, uses, || Held::Buffer(take()))
    }

    /// A planned slice of `region` (of `shared`'s scopes) was freed on `stream`: `true` when a
    /// capture holds it back, and then the graph holds the whole region (no run claims it)
    /// until it goes.
    pub(super) fn hold_region(
        &self,
        shared: &Arc<Shared<D>>,
        stream: StreamId,
        uses: &[StreamId],
        region: &Arc<Region>,
    ) -> bool {
        self.any()
            && self.hold(shared, stream, uses, || {
                region.graph_holds();
                let (shared, region, uses) = (shared.clone(), region.clone(), uses.to_vec());
                Held::Region { shared, region, stream, uses }
            })
    }

    /// Memory of `mine` freed on `stream` and used on `uses`: when a capture holds it back
    /// ([`CaptureTable::holder`]), `make` is called, under this table's lock, for what that
    /// capture's graph keeps; `true` then.
    fn hold(
        &self,
        mine: &Shared<D>,
        stream: StreamId,
        uses: &[StreamId],
        make: impl FnOnce() -> Held<D>,
    ) -> bool {
        Self::hold_in(&mut lock(&self.inner), mine, stream, uses, make)
    }

    /// [`CaptureTable::hold`] with the table locked.
    fn hold_in(
        t: &mut HashMap<StreamId, Entry<D>>,
        mine: &Shared<D>,
        stream: StreamId,
        uses: &[StreamId],
        make: impl FnOnce() -> Held<D>,
    ) -> bool {
        let Some(key) = Self::holder(t, mine, stream, uses) else { return false };
        let e = t.get_mut(&key).expect("found by holder");
        e.deferred.push(make());
        true
    }

    /// The capture that holds back memory of `owner` freed on `stream` and used on `uses`: the
    /// capture of its stream (unless the memory is of that capture's own pool), else that of a
    /// stream it was used on; `None` when none does.
    fn holder(
        t: &HashMap<StreamId, Entry<D>>,
        mine: &Shared<D>,
        stream: StreamId,
        uses: &[StreamId],
    ) -> Option<StreamId> {
        // The captures of the streams involved (a stream that joined one counts as its
        // origin's), for those whose capture does not run as if there were no private pool.
        let capture = |s: StreamId| Self::origin(t, mine, s).filter(|o| !t[o].broken);
        let own = Self::origin(t, mine, stream);
        match own.map(|o| (o, t[&o].broken, std::ptr::eq(mine, &*t[&o].pool.alloc.shared))) {
            Some((_, true, _)) => None,
            Some((o, false, false)) => Some(o),
            // Of the capture's own pool (or its stream is not captured): held back only if a
            // captured stream used it.
            _ => uses.iter().find_map(|&u| capture(u)),
        }
    }
}

/// A captured CUDA graph: replays the work captured on a stream ([`Graph::launch`]). It keeps
/// its private pool, and the buffers freed during its capture, until it is dropped; dropping it
/// destroys the graph on the device, waits for its launches (a host sync, if it was launched)
/// and frees what it held. Where the device cannot wait then, what it held is freed by a later
/// [`Allocator::empty_cache`] that can; where it refuses to destroy the graph, the graph's
/// memory stays allocated for good.
pub struct Graph<D: Capture> {
    device: Guarded<D>,
    id: GraphId,
    /// The stream the capture began on.
    origin: StreamId,
    /// Recorded on `origin` just before the capture began (see `Entry::start`).
    start: Option<EventId>,
    pool: MemPool<D>,
    deferred: Deferred<D>,
    launched: AtomicBool,
}

impl<D: Capture> fmt::Debug for Graph<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph")
            .field("id", &self.id)
            .field("pool", &self.pool.id())
            .field("held_buffers", &self.deferred.len())
            .finish()
    }
}

impl<D: Capture> Graph<D> {
    /// Enqueues the graph's work on `stream` (`cuGraphLaunch`); returns at once. The replay
    /// runs the kernels launched during the capture again, on the addresses they were given:
    /// what the graph's pool and held buffers cover stays the graph's, but a buffer from
    /// elsewhere that a captured kernel uses (a static input) must outlive the graph, as the
    /// kernel launch's own contract (`unsafe` on a real device) asks of every buffer it uses.
    /// Graphs sharing a pool through [`Allocator::begin_capture_sharing`] are launched as its
    /// contract says (capture order, never concurrently).
    ///
    /// On a stream other than the one the capture began on, the replay first waits for the
    /// work that last used the pool's memory before the capture (an event wait, no host
    /// sync): the capture began after it on its own stream, a replay elsewhere does not.
    /// Refused on a stream that is capturing ([`AllocError::Capture`]), with no device call.
    pub fn launch(&self, stream: StreamId) -> Result<(), AllocError> {
        // Inside a capture, the launch would make this graph's work, and so its pool's memory,
        // part of the capturing graph, which the allocator does not track; CUDA either refuses
        // (and invalidates that capture) or embeds it. Refused here first. BROKEN
        // (`launch_in_capture`): left to the device.
        let ps = &self.pool.alloc.shared;
        if !cfg!(tidepool_broken = "launch_in_capture")
            && (ps.family.captures.capturing(ps, stream)
                || self.device.capture_of(stream).is_some())
        {
            return Err(AllocError::Capture {
                stream,
                reason: "a graph cannot be launched into a capture underway (the capturing graph \
                         would use its pool's memory, which the allocator does not track)",
            });
        }
        // BROKEN: a replay on another stream runs beside the pool's earlier work.
        if let Some(e) = self.start
            && stream != self.origin
            && !cfg!(tidepool_broken = "replay_elsewhere")
        {
            self.device.wait_event(stream, e)?;
        }
        self.device.launch_graph(self.id, stream)?;
        self.launched.store(true, Ordering::Release);
        Ok(())
    }

    /// The private pool its captured allocations came from (to share it with another capture
    /// while this graph lives, PyTorch's `pool=`: [`Allocator::begin_capture_sharing`]).
    pub fn pool(&self) -> &MemPool<D> {
        &self.pool
    }

    /// The device's id of the graph.
    pub fn id(&self) -> GraphId {
        self.id
    }

    /// How many buffers freed during the capture it holds (not of its pool).
    pub fn held_buffers(&self) -> usize {
        self.deferred.len()
    }
}

impl<D: Capture> Drop for Graph<D> {
    fn drop(&mut self) {
        // A graph the device refused to destroy still references the pool's memory and the
        // held buffers: they stay allocated for good (sound, if wasteful), as below.
        let destroyed = self.device.destroy_graph(self.id).is_ok()
            || self.pool.alloc.shared.broken(Broken::UndestroyedGraphFreed);
        if !destroyed {
            std::mem::forget(self.pool.clone());
        }
        if let Some(e) = self.start.take() {
            // (CUDA lets an event go while work waits on it.)
            let _ = self.device.destroy_event(e);
        }
        // Its launches may still read the held buffers and the pool: done before either is
        // reused. If the device cannot wait now (a capture is underway), the held buffers stay
        // allocated for good: sound, if wasteful.
        let done = destroyed
            && (!self.launched.load(Ordering::Acquire) || self.device.synchronize().is_ok());
        let deferred = std::mem::take(&mut self.deferred);
        // BROKEN (`graph_drop_frees_pool`): the pool is claimable at once, waited for or not.
        if done || cfg!(tidepool_broken = "graph_drop_frees_pool") {
            self.pool.alloc.shared.role.graphs.fetch_sub(1, Ordering::AcqRel);
        }
        if !done && destroyed && !self.pool.alloc.shared.broken(Broken::GraphHoldsLeaked) {
            // The wait failed: the family lets go of them, and of the graph's hold on its
            // pool (whose free memory the launches may still write), after a later device
            // synchronisation succeeds (`Family::take_graph_holds`, from `empty_cache`).
            let mut holds = lock(&self.pool.alloc.shared.family.graph_holds);
            holds.extend(deferred);
            if !cfg!(tidepool_broken = "graph_drop_frees_pool") {
                holds.push(Held::Pool(self.pool.clone()));
            }
            return;
        }
        for held in deferred {
            match done {
                true => held.release(),
                false => held.leak(),
            }
        }
    }
}

/// Ends every capture still underway in `alloc`'s family and drops its graph: the general
/// allocator's last handle is going (`Allocator`'s drop), so no one can end them any more, and
/// each holds its pool and the blocks freed into it, which would never go back to the device
/// (and the device would refuse every synchronisation). A capture begun on another thread
/// than this drop's cannot be ended here (CUDA's global capture mode ends a capture only on
/// the thread that began it): it goes on, and what it holds stays allocated, as before.
fn end_orphaned<D: Capture>(alloc: &Allocator<D>) {
    let streams: Vec<StreamId> =
        lock(&alloc.shared.family.captures.inner).keys().copied().collect();
    for stream in streams {
        drop(alloc.end_capture(stream));
    }
}

impl<D: Capture> Allocator<D> {
    /// Starts capturing `stream` into a CUDA graph (`cuStreamBeginCapture`): until
    /// [`Allocator::end_capture`], work enqueued on it is recorded, allocations on it come from
    /// `pool` (a new private pool if `None`; a pool of earlier graphs, all gone, to use its
    /// cached memory), and buffers of any other pool freed on it are held by the graph.
    ///
    /// Refused: a stream already capturing, a pool of another allocator
    /// ([`AllocError::ForeignPool`]), a pool a [`PoolGuard`](super::PoolGuard) routes to now or
    /// that a live graph (or a capture underway) uses ([`AllocError::PoolBusy`]: a graph's
    /// replays write every block its capture allocated, freed or not, so a later capture
    /// sharing the pool could be handed memory they overwrite — PyTorch's `pool=` sharing is
    /// [`Allocator::begin_capture_sharing`], which is `unsafe`), and whatever the device refuses
    /// (the default stream).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::device::{Access, AccessKind, Kernel, Launch};
    /// use tidepool::{Allocator, Config, Device, SimDevice};
    ///
    /// let device = Arc::new(SimDevice::backed(1 << 30));
    /// let s = device.create_stream().unwrap();
    /// let alloc = Allocator::new(device.clone(), Config::default()).unwrap();
    /// alloc.begin_capture(s, None).unwrap();
    /// let out = alloc.alloc(4096, s).unwrap();              // from the graph's pool
    /// let (ptr, n) = (out.ptr(), out.len());
    /// let acc = vec![Access { ptr, bytes: n, kind: AccessKind::Write }];
    /// device.launch(s, Kernel::replayable("fill", acc, move |m| m.write(ptr, &[7; 4096]).unwrap())).unwrap();
    /// let graph = alloc.end_capture(s).unwrap();
    /// for _ in 0..3 {
    ///     graph.launch(s).unwrap();                          // runs "fill" again
    /// }
    /// device.synchronize().unwrap();
    /// assert!(device.violations().is_empty());
    /// ```
    pub fn begin_capture(
        &self,
        stream: StreamId,
        pool: Option<&MemPool<D>>,
    ) -> Result<(), AllocError> {
        self.begin_capture_in(stream, pool, false)
    }

    /// Captures what `body` enqueues on `stream` into a graph: [`Allocator::begin_capture`],
    /// `body`, [`Allocator::end_capture`], as PyTorch's `with torch.cuda.graph(g, pool=…):`.
    /// Returns the graph and what `body` returned. If `body` panics, the capture is ended and
    /// its graph discarded before the panic goes on: a capture left underway would keep the
    /// stream capturing and refuse every device-wide synchronisation (`synchronize`,
    /// `empty_cache`'s waits) for the rest of the process.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::device::{Access, AccessKind, Kernel, Launch};
    /// use tidepool::{Allocator, Config, Device, SimDevice};
    ///
    /// let device = Arc::new(SimDevice::backed(1 << 30));
    /// let s = device.create_stream().unwrap();
    /// let alloc = Allocator::new(device.clone(), Config::default()).unwrap();
    /// let (graph, out) = alloc
    ///     .capture(s, None, || {
    ///         let out = alloc.alloc(4096, s).unwrap(); // from the graph's pool
    ///         let (ptr, n) = (out.ptr(), out.len());
    ///         let acc = vec![Access { ptr, bytes: n, kind: AccessKind::Write }];
    ///         let fill = Kernel::replayable("fill", acc, move |m| m.write(ptr, &[7; 4096]).unwrap());
    ///         device.launch(s, fill).unwrap();
    ///         out
    ///     })
    ///     .unwrap();
    /// graph.launch(s).unwrap();
    /// device.synchronize().unwrap();
    /// assert!(device.violations().is_empty());
    /// # drop(out);
    /// ```
    pub fn capture<R>(
        &self,
        stream: StreamId,
        pool: Option<&MemPool<D>>,
        body: impl FnOnce() -> R,
    ) -> Result<(Graph<D>, R), AllocError> {
        self.begin_capture(stream, pool)?;
        self.capture_body(stream, body)
    }

    /// [`Allocator::capture`] into `pool` while other graphs (or a capture underway) use it
    /// too: PyTorch's `with torch.cuda.graph(g, pool=…):`.
    ///
    /// # Safety
    ///
    /// The contract of [`Allocator::begin_capture_sharing`]: the graphs sharing the pool are
    /// replayed in the order they were captured and never concurrently, and no buffer of one
    /// graph is read after a graph captured later has been replayed over its memory.
    pub unsafe fn capture_sharing<R>(
        &self,
        stream: StreamId,
        pool: &MemPool<D>,
        body: impl FnOnce() -> R,
    ) -> Result<(Graph<D>, R), AllocError> {
        // SAFETY: the caller keeps the sharing contract (this function's own).
        unsafe { self.begin_capture_sharing(stream, pool)? };
        self.capture_body(stream, body)
    }

    /// The rest of [`Allocator::capture`] once the capture has begun: `body`, then the end,
    /// which also runs if `body` unwinds.
    fn capture_body<R>(
        &self,
        stream: StreamId,
        body: impl FnOnce() -> R,
    ) -> Result<(Graph<D>, R), AllocError> {
        /// Ends the capture as it goes (an unwind out of the body), unless disarmed.
        struct EndOnUnwind<'a, D: Capture>(&'a Allocator<D>, StreamId, bool);
        impl<D: Capture> Drop for EndOnUnwind<'_, D> {
            fn drop(&mut self) {
                if self.2 {
                    // The graph, if the device made one, goes at once: nothing launched it.
                    drop(self.0.end_capture(self.1));
                }
            }
        }
        // BROKEN: a panic in the body leaves the capture underway.
        let mut guard = EndOnUnwind(self, stream, !cfg!(tidepool_broken = "capture_left"));
        let out = body();
        guard.2 = false;
        Ok((self.end_capture(stream)?, out))
    }

    /// [`Allocator::begin_capture`] into `pool` while other graphs (or a capture underway) use
    /// it too: PyTorch's `graph.capture_begin(pool=…)`, `torch.cuda.graph(pool=…)`. The
    /// capture may be handed blocks that the earlier graphs' captures allocated and freed (their
    /// temporaries, outputs since dropped), so the graphs share that memory.
    ///
    /// # Safety
    ///
    /// PyTorch's contract for sharing a pool, which the allocator cannot check: the graphs
    /// sharing it are replayed in the order they were captured and never concurrently (each
    /// launch ordered after the previous one's work), and no buffer of one graph is read after a
    /// graph captured later has been replayed over its memory. Otherwise replays overwrite each
    /// other's memory, or buffers the application holds (`tests/pytorch_parity.rs` shows both,
    /// as PyTorch's `test_graph_three_successive` and `test_graph_concurrent_replay` do).
    pub unsafe fn begin_capture_sharing(
        &self,
        stream: StreamId,
        pool: &MemPool<D>,
    ) -> Result<(), AllocError> {
        self.begin_capture_in(stream, Some(pool), true)
    }

    /// [`Allocator::begin_capture`]; with `share`, other graphs may use the pool too.
    fn begin_capture_in(
        &self,
        stream: StreamId,
        pool: Option<&MemPool<D>>,
        share: bool,
    ) -> Result<(), AllocError> {
        let sh = &self.shared;
        sh.stream_exists(stream)?;
        let pool = match pool {
            Some(p) if !Arc::ptr_eq(&p.alloc.shared.family, &sh.family) => {
                return Err(AllocError::ForeignPool);
            }
            Some(p) => p.clone(),
            None => self.new_pool(super::PoolOptions::default())?,
        };
        let role = &pool.alloc.shared.role;
        use super::private_pool::PoolRole;
        let claimed = match share || sh.broken(Broken::SharedGraphPools) {
            true if PoolRole::claim(&role.graphs, &role.guards) => Ok(()),
            true => Err("a PoolGuard routes allocations to it"),
            false => PoolRole::claim_alone(&role.graphs, &role.guards),
        };
        if let Err(reason) = claimed {
            return Err(AllocError::PoolBusy { reason });
        }
        // The general allocator's last handle ends what is still underway then.
        sh.end_captures.get_or_init(|| end_orphaned::<D>);
        // The pool's blocks that wait on events of ordinary work (its buffers freed after uses
        // on other streams) are polled now, so the capture is handed those that completed:
        // PyTorch polls every pool's events at any allocation outside a capture
        // (`test_graph_capture_pre_capture_stream_use`); here a pool is polled by its own
        // allocations, and a capture's are made where no event may be polled. (Nothing is
        // polled while any capture is underway on the device: `process_events` says so.)
        // BROKEN (`capture_start_unpolled`): the capture is handed none of them.
        if !cfg!(tidepool_broken = "capture_start_unpolled") {
            let ps = &pool.alloc.shared;
            let mut st = ps.lock_state();
            ps.process_events(&mut st);
        }
        let route = sh.family.next_id();
        let broken = sh.broken(Broken::CaptureGeneral);
        let table = &sh.family.captures;
        {
            let mut t = lock(&table.inner);
            if t.contains_key(&stream) {
                drop(t);
                role.graphs.fetch_sub(1, Ordering::AcqRel);
                return Err(AllocError::Capture {
                    stream,
                    reason: "the stream is already capturing",
                });
            }
            let pool = pool.clone();
            let reuse = self.config().graph_capture_record_stream_reuse;
            let (deferred, waits, outside) = (Vec::new(), Vec::new(), Vec::new());
            let start = None;
            t.insert(stream, Entry { route, pool, deferred, waits, outside, start, reuse, broken });
            table.active.fetch_add(1, Ordering::AcqRel);
        }
        // From here the pool's blocks freed outside the capture stay out of it (`outside`);
        // those freed before are ordered before it.
        let begun = self.order_before_capture(stream, &pool).and_then(|start| {
            if let Some(e) = lock(&table.inner).get_mut(&stream) {
                e.start = start;
            }
            sh.device.begin_capture(stream).map_err(AllocError::from)
        });
        if let Err(e) = begun {
            let entry = table.remove(&stream);
            table.active.fetch_sub(1, Ordering::AcqRel);
            role.graphs.fetch_sub(1, Ordering::AcqRel);
            if let Some(entry) = entry {
                entry.abandon(&sh.device);
            }
            return Err(e);
        }
        if !broken {
            sh.routes.add(route, stream, pool.alloc.clone());
        }
        Ok(())
    }

    /// Orders a capture of `stream` into `pool` after the ordinary work that last used the
    /// pool's cached memory: `stream` waits for each stream the pool has memory on, and an
    /// event recorded on `stream` then (returned) lets a replay launched on another stream wait
    /// for the same. A graph's replays are ordered after the work of the stream they are
    /// launched on, nothing else: a block cached on a stream that joins the capture later, or
    /// on `stream` for a replay launched elsewhere, would otherwise be written by a replay
    /// while that work may still use it (PyTorch's `torch.cuda.graph` synchronises the device
    /// before every capture instead). Where an event cannot be recorded or waited on, a
    /// device-wide synchronisation stands in (no capture may be underway then); `None` for an
    /// empty pool, or when that synchronisation made every earlier use complete.
    fn order_before_capture(
        &self,
        stream: StreamId,
        pool: &MemPool<D>,
    ) -> Result<Option<EventId>, AllocError> {
        let ps = &pool.alloc.shared;
        let streams: Vec<StreamId> = {
            let st = ps.lock_state();
            if st.segment_streams.is_empty() {
                return Ok(None);
            }
            st.segment_streams.keys().copied().filter(|&u| u != stream).collect()
        };
        let table = &self.shared.family.captures;
        let streams: Vec<StreamId> =
            streams.into_iter().filter(|&u| !table.captures_into(&self.shared, u, ps)).collect();
        // BROKEN: the capture is not ordered after the pool's earlier work.
        if cfg!(tidepool_broken = "capture_unordered") {
            return Ok(None);
        }
        let refused = || AllocError::Capture {
            stream,
            reason: "the work that last used the pool's memory could not be ordered before it",
        };
        if !ps.order_after(stream, &streams) {
            return Err(refused());
        }
        let dev = &self.shared.device;
        let event = dev.create_event().map_err(AllocError::from)?;
        if dev.record_event(event, stream).is_ok() {
            return Ok(Some(event));
        }
        let _ = dev.destroy_event(event);
        let mut st = ps.lock_state();
        ps.host_wait(&mut st).map_err(|_| refused())?;
        Ok(None)
    }

    /// Ends the capture of `stream` (`cuStreamEndCapture` + `cuGraphInstantiate`) and returns
    /// the graph. Its pool serves no other allocation until a later capture is given it. If the
    /// device fails to make the graph, the capture is over all the same and the error returned,
    /// except where the device refuses because this is not the thread that began the capture
    /// (`CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`, CUDA's global capture mode): then the capture
    /// goes on, and the thread that began it ends it.
    pub fn end_capture(&self, stream: StreamId) -> Result<Graph<D>, AllocError> {
        let sh = &self.shared;
        let table = &sh.family.captures;
        if !table.began_on(stream) {
            let reason = match table.capturing(sh, stream) {
                true => "the capture began on another stream (this one joined it)",
                false => "the stream is not capturing",
            };
            return Err(AllocError::Capture { stream, reason });
        }
        let made = sh.device.end_capture(stream);
        // Not this thread's capture to end (CUDA's global mode): it goes on, as it was.
        // BROKEN (`wrong_thread_ends`): the refusal is taken as the end, as any other is.
        if let Err(e) = &made
            && e.is_capture_wrong_thread()
            && !cfg!(tidepool_broken = "wrong_thread_ends")
        {
            return Err(e.clone().into());
        }
        let Some(mut entry) = table.remove(&stream) else {
            return Err(AllocError::Capture { stream, reason: "the stream is not capturing" });
        };
        table.active.fetch_sub(1, Ordering::AcqRel);
        // Blocks still waiting for their uses to be ordered. The uses are captured work of
        // this capture's streams, and a capture ends only once every stream that joined it was
        // joined back (CUDA refuses the end otherwise, `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`):
        // so those uses come before the graph's end, and the blocks go into the graph's pool as
        // a block freed on the capturing stream does (PyTorch's
        // `test_graph_capture_reclaim_shared_pool`: a later capture sharing the pool gets
        // them). If the device made no graph, they go with the capture's other holds.
        // BROKEN (`waits_held_at_end`): the graph holds them until it goes.
        table.waiting.fetch_sub(entry.waits.len(), Ordering::Relaxed);
        let waits = std::mem::take(&mut entry.waits);
        let ended = made.is_ok() && !cfg!(tidepool_broken = "waits_held_at_end");
        let ordered: Vec<Wait<D>> = match ended {
            true => waits,
            false => {
                entry.deferred.extend(waits.into_iter().map(|w| Held::Block(w.owner, w.freed)));
                Vec::new()
            }
        };
        drop(sh.routes.remove(entry.route));
        // The capture is over: no stream joins it any more (`remove` passed them on to
        // another capture into the pool, if any).
        std::mem::take(&mut entry.outside).into_iter().for_each(Held::release);
        for w in ordered {
            w.owner.free_held(w.freed, true);
        }
        match made {
            Ok(id) => Ok(Graph {
                device: Guarded::new(sh.device.arc().clone()),
                id,
                origin: stream,
                start: entry.start,
                pool: entry.pool,
                deferred: entry.deferred,
                launched: AtomicBool::new(false),
            }),
            Err(e) => {
                entry.pool.alloc.shared.role.graphs.fetch_sub(1, Ordering::AcqRel);
                entry.abandon(&sh.device);
                Err(e.into())
            }
        }
    }

    /// Whether `stream` is being captured through this allocator (or another of its family):
    /// the capture began on it, or it joined one by waiting on an event recorded on a
    /// capturing stream (PyTorch's `is_current_stream_capturing` on a side stream).
    pub fn is_capturing(&self, stream: StreamId) -> bool {
        self.shared.family.captures.capturing(&self.shared, stream)
    }
}
