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
//!
//! Here: the capture calls of [`Allocator`]. [`Graph`] is in `graph.rs`; the family's capture
//! table, what graphs hold back and the blocks waiting within a capture, in `table.rs`.

mod graph;
mod table;

pub use graph::Graph;
pub(crate) use table::CaptureTable;
pub(super) use table::Held;
use table::{Deferred, Entry, Wait};

use super::buffer::Freed;
use super::owner::Owner;
use super::plan::Region;
use super::private_pool::MemPool;
use super::*;
use crate::device::{Capture, CaptureMark, GraphId, Guarded};
use crate::sync::atomic::AtomicUsize;

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
    /// ([`AllocError::ForeignPool`]), a pool a [`PoolGuard`] routes to now or
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
            None => self.new_pool_made(super::PoolOptions::default(), true)?,
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
            sh.routes.add(route, stream, pool.alloc.clone(), false);
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
        // A capture is over: what families of the device with no general allocator left
        // (graphs dropped during it, or their allocator gone during it) may go now, where no
        // other capture is underway (`peers.rs`; nothing of theirs would call for it).
        let _ = crate::peers::let_go_of_orphans(&sh.device);
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
