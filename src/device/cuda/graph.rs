//! Stream capture on a GPU: [`Capture`] for [`CudaDevice`], one driver call (or pair) per trait
//! method, through `result.rs`.
//!
//! ```text
//!   begin_capture(s)  ─▶ cuStreamBeginCapture(s, GLOBAL)            order.begin(s)
//!   wait_event(t, e)  ─▶ (e recorded in s's capture) t joins it     order.wait(t, e)
//!   end_capture(s)    ─▶ cuStreamEndCapture + cuGraphInstantiate    live[g] = (CUgraph, CUgraphExec)
//!                        (the driver refuses a fork not joined back) order.end(s): s and its joiners leave
//!   launch_graph(g,t) ─▶ cuGraphLaunch(exec, t)
//!   destroy_graph(g)  ─▶ cuGraphExecDestroy + cuGraphDestroy        (the device's drop: all left)
//! ```
//!
//! The default stream is the legacy null stream, which CUDA cannot capture: refused.
//! `capture_underway`, `capture_of`, `capture_mark` and `capture_ordered_after` answer from the
//! capture order (`capture_order.rs`: capturing streams, and what each one's captured work is
//! ordered after), with no driver call, so the allocator can ask them on every slow-path step: a
//! stream joins a capture only through a wait on an event recorded inside it, which
//! [`CudaDevice`]'s `wait_event` sees.

use super::capture_order::{CaptureOrder, CapturedEvent};
use super::result::{self, RawGraph};
use super::{CudaDevice, lock};
use crate::device::{Capture, CaptureMark, DeviceError, GraphId, StreamId};
use std::collections::HashMap;

/// Captures underway and live graphs.
#[derive(Default)]
pub(super) struct CudaGraphs {
    /// The capturing streams, and what their captured work is ordered after.
    order: CaptureOrder,
    next: u64,
    live: HashMap<u64, RawGraph>,
}

impl CudaDevice {
    /// Whether a capture is underway on this device (no driver call, one relaxed load: stored
    /// under the graphs' lock as captures begin and end; what a capture's state holds is read
    /// under that lock, as `SimDevice::capture_underway` explains).
    #[inline]
    pub(super) fn capturing_any(&self) -> bool {
        self.capturing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The stream the capture `stream` belongs to began on, if it is capturing (no driver call).
    pub(super) fn capture_origin(&self, stream: StreamId) -> Option<StreamId> {
        lock(&self.graphs).order.origin_of(stream.0).map(StreamId)
    }

    /// Whether the capture an event was recorded in is still underway (the event is a node of
    /// a live capture, not a completed one).
    pub(super) fn capture_live(&self, event: &CapturedEvent) -> bool {
        lock(&self.graphs).order.live(event)
    }

    /// An event is being recorded on `stream`: the capture node it is, if `stream` is capturing.
    pub(super) fn capture_record(&self, stream: StreamId) -> Option<CapturedEvent> {
        lock(&self.graphs).order.record(stream.0)
    }

    /// `stream` waited on `event`, recorded in a live capture: it joins it or is ordered after
    /// the event.
    pub(super) fn capture_wait(&self, stream: StreamId, event: &CapturedEvent) {
        lock(&self.graphs).order.wait(stream.0, event);
    }

    /// [`Device::capture_mark`](crate::Device::capture_mark), from the capture order.
    pub(super) fn mark_of(&self, stream: StreamId) -> Option<CaptureMark> {
        lock(&self.graphs).order.mark(stream.0)
    }

    /// [`Device::capture_ordered_after`](crate::Device::capture_ordered_after), from the
    /// capture order.
    pub(super) fn ordered_after(&self, stream: StreamId, mark: CaptureMark) -> bool {
        lock(&self.graphs).order.ordered_after(stream.0, mark)
    }

    /// Destroys every graph left (the device's drop).
    pub(super) fn destroy_graphs(&self) {
        for (_, g) in lock(&self.graphs).live.drain() {
            // SAFETY: a graph made by `end_capture` in this context, destroyed once (just taken
            // out of the table); the context is bound by the caller.
            let _ = unsafe { result::graph_destroy(g) };
        }
    }
}

impl Capture for CudaDevice {
    fn begin_capture(&self, stream: StreamId) -> Result<(), DeviceError> {
        if stream == StreamId::DEFAULT {
            return Err(DeviceError::Unsupported("capturing the default (legacy null) stream"));
        }
        let s = self.stream(stream)?;
        let mut graphs = lock(&self.graphs);
        if graphs.order.origin_of(stream.0).is_some() {
            return Err(DeviceError::Driver {
                op: "cuStreamBeginCapture",
                code: DeviceError::CUDA_ERROR_ILLEGAL_STATE,
            });
        }
        self.bind()?;
        // SAFETY: `s` is a live non-null stream of this context, kept alive by the `Arc`.
        unsafe { result::stream_begin_capture(s.cu_stream()) }?;
        graphs.order.begin(stream.0);
        self.capturing.store(graphs.order.any(), std::sync::atomic::Ordering::Release);
        Ok(())
    }

    fn end_capture(&self, stream: StreamId) -> Result<GraphId, DeviceError> {
        let s = self.stream(stream)?;
        let mut graphs = lock(&self.graphs);
        if !graphs.order.began_on(stream.0) {
            return Err(DeviceError::Driver {
                op: "cuStreamEndCapture",
                code: DeviceError::CUDA_ERROR_ILLEGAL_STATE,
            });
        }
        self.bind()?;
        // SAFETY: `s` is a live stream of this context being captured (begun above, not ended:
        // the table said so).
        let made = unsafe { result::stream_end_capture(s.cu_stream()) };
        // The capture ends whatever the outcome (the driver invalidates one whose forks were
        // not joined back, `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`): its streams leave it. Except
        // on another thread than the one that began it (global mode): refused, it goes on.
        if !made.as_ref().is_err_and(DeviceError::is_capture_wrong_thread) {
            graphs.order.end(stream.0);
            self.capturing.store(graphs.order.any(), std::sync::atomic::Ordering::Release);
        }
        let g = made?;
        graphs.next += 1;
        let id = graphs.next;
        graphs.live.insert(id, g);
        Ok(GraphId(id))
    }

    fn launch_graph(&self, graph: GraphId, stream: StreamId) -> Result<(), DeviceError> {
        let s = self.stream(stream)?;
        let graphs = lock(&self.graphs);
        let g = *graphs.live.get(&graph.0).ok_or(DeviceError::Driver {
            op: "cuGraphLaunch",
            code: DeviceError::CUDA_ERROR_INVALID_HANDLE,
        })?;
        self.bind()?;
        // SAFETY: `g` is live (in the table, which we hold locked, so no destroy races) and `s`
        // is a live stream of this context.
        unsafe { result::graph_launch(g, s.cu_stream()) }
    }

    fn destroy_graph(&self, graph: GraphId) -> Result<(), DeviceError> {
        let g = lock(&self.graphs).live.remove(&graph.0).ok_or(DeviceError::Driver {
            op: "cuGraphExecDestroy",
            code: DeviceError::CUDA_ERROR_INVALID_HANDLE,
        })?;
        self.bind()?;
        // SAFETY: made by `end_capture` in this context, destroyed once (taken out of the table);
        // launches already enqueued complete (the driver defers the release).
        unsafe { result::graph_destroy(g) }
    }
}
