//! The family's capture table: which streams a capture began on, each capture's pool and what
//! its graph holds back (buffers freed during it, scope regions), the blocks that wait for their
//! reuse within a capture, and the buffers freed on streams of another family's capture.

use super::*;

/// What a graph holds back until it is dropped.
pub(in crate::allocator) enum Held<D: Device> {
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
    pub(in crate::allocator) fn release(self) {
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
    pub(super) fn leak(self) {
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
pub(super) type Deferred<D> = Vec<Held<D>>;

/// The captures underway in an allocator family, by stream.
pub(crate) struct CaptureTable<D: Device> {
    pub(super) active: AtomicUsize,
    /// Blocks waiting in all captures' `waits` (one load tells an allocation there are none).
    pub(super) waiting: AtomicUsize,
    pub(super) inner: Mutex<HashMap<StreamId, Entry<D>>>,
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

pub(super) struct Entry<D: Device> {
    pub(super) route: u64,
    pub(super) pool: MemPool<D>,
    pub(super) deferred: Deferred<D>,
    /// Blocks of the capture's pool freed during it after uses on its other streams, waiting
    /// to be reused within it (`graph_capture_record_stream_reuse`); held like `deferred` if
    /// the capture ends first.
    pub(super) waits: Vec<Wait<D>>,
    /// Blocks of the capture's pool freed during it on a stream outside it: back into the pool
    /// when the capture ends, not before — a stream that joins the capture later would be
    /// handed them, and its captured work is not ordered after its earlier, ordinary work.
    pub(super) outside: Deferred<D>,
    /// An event recorded on the capturing stream just before the capture began, after the work
    /// that last used the pool's cached memory (`None`: the pool had none): a replay launched
    /// on another stream waits on it ([`Graph::launch`]).
    pub(super) start: Option<EventId>,
    /// `graph_capture_record_stream_reuse` of the allocator that began the capture, as it was
    /// then.
    pub(super) reuse: bool,
    /// Test-only: the capture runs as if there were no private pool (`Broken::CaptureGeneral`).
    pub(super) broken: bool,
}

impl<D: Device> Entry<D> {
    /// The capture is abandoned (it failed to begin or to make a graph): what it held goes
    /// back, its start event too.
    pub(super) fn abandon(self, device: &Guarded<D>) {
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
pub(in crate::allocator) struct Wait<D: Device> {
    pub(super) owner: Arc<Owner<D>>,
    pub(super) freed: Freed,
    /// Where each other stream it was used on stood when it was freed.
    marks: Vec<CaptureMark>,
}

impl<D: Device> Shared<D> {
    /// The origin of the capture that captures `stream`, when the device says one does and it
    /// is not of this allocator's family (another allocator's on the same device, or one begun
    /// on the device itself): this allocator hands out nothing there and holds back what is
    /// freed there ([`Shared::hold_for_foreign`]). One load while no capture is underway.
    #[inline]
    pub(in crate::allocator) fn foreign_capture(&self, stream: StreamId) -> Option<StreamId> {
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
    pub(in crate::allocator) fn scope_free_foreign(
        &self,
        stream: StreamId,
        uses: &[StreamId],
    ) -> bool {
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
    pub(in crate::allocator) fn hold_for_foreign(&self, f: Freed) -> Option<Freed> {
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
    pub(in crate::allocator) fn any(&self) -> bool {
        self.active.load(Ordering::Relaxed) != 0
    }

    /// Whether a capture began on `stream` (through this family).
    pub(in crate::allocator) fn began_on(&self, stream: StreamId) -> bool {
        self.any() && lock(&self.inner).contains_key(&stream)
    }

    /// Whether `stream` is being captured: a capture of this family began on it, or it joined
    /// one (see [`CaptureTable::origin`]).
    pub(in crate::allocator) fn capturing(&self, sh: &Shared<D>, stream: StreamId) -> bool {
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
    pub(in crate::allocator) fn joined(&self, sh: &Shared<D>, stream: StreamId) -> bool {
        self.any() && Self::origin(&lock(&self.inner), sh, stream).is_some_and(|o| o != stream)
    }

    /// The private pool a stream that is being captured allocates from: its capture's, with
    /// whether the capture began on it (`true`) or it joined one (`false`); `None` for a
    /// stream no capture of this family has, or whose capture is not routed.
    ///
    /// It wins over any [`PoolGuard`] of the stream: whatever the captured
    /// work writes is the graph's to replay, so it must come from the pool the graph holds.
    /// With `joined_only`, a stream a capture began on gets `None` (its capture's route, the
    /// stream's latest, decides: the broken build `guard_in_capture`).
    pub(in crate::allocator) fn capture_pool(
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
    pub(in crate::allocator) fn defer(&self, owner: &Arc<Owner<D>>, f: Freed) -> Option<Freed> {
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
    pub(super) fn captures_into(&self, sh: &Shared<D>, stream: StreamId, pool: &Shared<D>) -> bool {
        let t = lock(&self.inner);
        Self::origin(&t, sh, stream).is_some_and(|o| std::ptr::eq(pool, &*t[&o].pool.alloc.shared))
    }

    /// Takes the entry of the capture begun on `stream` out of the table. The blocks kept out
    /// of its pool (`Entry::outside`) pass to another capture underway into the same pool
    /// (`begin_capture_sharing`), whose joined streams must not be handed them either.
    pub(super) fn remove(&self, stream: &StreamId) -> Option<Entry<D>> {
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
    pub(in crate::allocator) fn waiting(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) != 0
    }

    /// An allocation on `stream` (of a capture): frees into the capture's pool each block
    /// waiting there whose stream the device now shows ordered after every use it waits on
    /// (PyTorch's `free_safe_blocks_in_capture`); returns how many.
    pub(in crate::allocator) fn reclaim(&self, sh: &Shared<D>, stream: StreamId) -> usize {
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
    pub(in crate::allocator) fn defer_buffer(
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
    pub(in crate::allocator) fn hold_region(
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
    pub(super) fn hold(
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
