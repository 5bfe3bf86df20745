//! [`Graph`]: a captured CUDA graph, its launches, and what dropping it frees.

use super::*;

/// A captured CUDA graph: replays the work captured on a stream ([`Graph::launch`]). It keeps
/// its private pool, and the buffers freed during its capture, until it is dropped; dropping it
/// destroys the graph on the device, waits for its launches (a host sync, if it was launched)
/// and frees what it held. Where the device cannot wait then, what it held is freed by a later
/// [`Allocator::empty_cache`] that can; where it refuses to destroy the graph, the graph's
/// memory stays allocated for good.
pub struct Graph<D: Capture> {
    pub(super) device: Guarded<D>,
    pub(super) id: GraphId,
    /// The stream the capture began on.
    pub(super) origin: StreamId,
    /// Recorded on `origin` just before the capture began (see `Entry::start`).
    pub(super) start: Option<EventId>,
    pub(super) pool: MemPool<D>,
    pub(super) deferred: Deferred<D>,
    pub(super) launched: AtomicBool,
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
