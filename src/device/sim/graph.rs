//! Stream capture on the simulator: CUDA graphs without a GPU.
//!
//! While a stream is captured, the kernels launched on it are recorded (with their declared
//! accesses and a body that may run many times) instead of enqueued; `end_capture` turns the
//! recording into a graph, and each `launch_graph` enqueues the recorded kernels again, on any
//! stream, so they really read and write memory and the sanitizer checks every replay against
//! the memory's *current* owners and the unfinished work on it.
//!
//! ```text
//!   begin_capture(s) ─▶ active[s] = Recording { ops, held }
//!     launch(s, k)    ─▶ ops.push(k)                       (nothing runs)
//!     handout/reclaim on s ─▶ held.push(range)             (memory the graph will use)
//!   end_capture(s)   ─▶ graphs[g] = Recording              (GraphId g)
//!   launch_graph(g, t) ─▶ every op enqueued on t; accesses count as allocated if held by g
//!   handout on a stream not capturing of memory any graph holds ─▶ Violation
//! ```
//!
//! Like CUDA's global capture mode, the device refuses while any capture is underway what
//! would synchronise or look into captured work: event queries and synchronisations, segment
//! releases (`cuMemFree`), destroying a capturing stream; and on the capturing stream itself,
//! recording or waiting on events and pinned-host copies (the simulator is stricter than CUDA
//! about events: the allocator never records one on a capturing stream).

use super::{Shared, State};
use crate::device::{Access, DeviceError, Kernel, ReplayFn, StreamId};
use std::collections::HashMap;
use std::time::Duration;

/// One recorded kernel.
pub(super) struct Captured {
    name: &'static str,
    accesses: Vec<Access>,
    sleep: Duration,
    body: Option<ReplayFn>,
}

/// A capture in progress, or a finished graph.
#[derive(Default)]
pub(super) struct Recording {
    ops: Vec<Captured>,
    /// Memory handed out or taken back on the stream while it was captured, as `[lo, hi)`:
    /// what the graph's replays may touch, reserved for the graph until it is destroyed.
    held: Vec<(u64, u64)>,
}

impl Recording {
    fn hold(&mut self, lo: u64, hi: u64) {
        if lo < hi && !self.held.iter().any(|&(a, b)| a <= lo && hi <= b) {
            self.held.push((lo, hi));
        }
    }
}

/// Every capture and graph of a device.
#[derive(Default)]
pub(super) struct Graphs {
    /// Captures underway, by stream.
    pub(super) active: HashMap<u32, Recording>,
    graphs: HashMap<u64, Recording>,
    next: u64,
    /// Kernels recorded and graph launches, for tests.
    pub(super) counters: SimGraphCounters,
}

/// Counters of the simulator's graph calls ([`super::SimDevice::graph_counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimGraphCounters {
    /// Captures begun.
    pub captures: u64,
    /// Kernels recorded into graphs.
    pub captured_kernels: u64,
    /// Graph launches.
    pub graph_launches: u64,
    /// Kernels enqueued by graph launches.
    pub replayed_kernels: u64,
    /// Graphs that exist now.
    pub live_graphs: u64,
}

/// The error of an operation CUDA refuses while a capture is underway.
pub(super) fn capture_error(op: &'static str) -> DeviceError {
    DeviceError::Driver { op, code: DeviceError::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED }
}

impl Graphs {
    /// Whether `stream` is being captured.
    pub(super) fn capturing(&self, stream: u32) -> bool {
        !self.active.is_empty() && self.active.contains_key(&stream)
    }

    /// Fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` while any capture is underway.
    pub(super) fn refuse_during_capture(&self, op: &'static str) -> Result<(), DeviceError> {
        if self.active.is_empty() { Ok(()) } else { Err(capture_error(op)) }
    }

    /// Records `kernel` if `stream` is captured: `Ok(None)` then; `Ok(Some(kernel))` back if not.
    pub(super) fn record(
        &mut self,
        stream: u32,
        kernel: Kernel,
    ) -> Result<Option<Kernel>, DeviceError> {
        let Some(rec) = self.active.get_mut(&stream) else { return Ok(Some(kernel)) };
        if !kernel.is_replayable() {
            return Err(DeviceError::Unsupported(
                "capturing a kernel whose body runs once (build it with Kernel::replayable)",
            ));
        }
        rec.ops.push(Captured {
            name: kernel.name,
            accesses: kernel.accesses,
            sleep: kernel.sleep,
            body: kernel.replay,
        });
        self.counters.captured_kernels += 1;
        Ok(None)
    }

    /// `[lo, hi)` was handed out or taken back on `stream`: held by its capture, if any. Returns
    /// whether the stream is captured.
    pub(super) fn note(&mut self, stream: u32, lo: u64, hi: u64) -> bool {
        match self.active.get_mut(&stream) {
            Some(rec) => {
                rec.hold(lo, hi);
                true
            }
            None => false,
        }
    }

    /// A range of `[lo, hi)` that a graph (or a capture underway) holds, if any.
    pub(super) fn held(&self, lo: u64, hi: u64) -> Option<(u64, u64)> {
        self.graphs.values().chain(self.active.values()).find_map(|r| {
            r.held.iter().find(|&&(a, b)| a < hi && lo < b).map(|&(a, b)| (a.max(lo), b.min(hi)))
        })
    }

    /// Whether nothing is captured and no graph exists (the cheap case).
    pub(super) fn is_empty(&self) -> bool {
        self.active.is_empty() && self.graphs.is_empty()
    }

    pub(super) fn begin(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        if stream == StreamId::DEFAULT {
            return Err(DeviceError::Unsupported("capturing the default stream"));
        }
        if self.active.contains_key(&stream.0) {
            return Err(DeviceError::Driver {
                op: "cuStreamBeginCapture",
                code: DeviceError::CUDA_ERROR_ILLEGAL_STATE,
            });
        }
        self.active.insert(stream.0, Recording::default());
        self.counters.captures += 1;
        Ok(())
    }

    pub(super) fn end(&mut self, stream: StreamId) -> Result<u64, DeviceError> {
        let rec = self.active.remove(&stream.0).ok_or(DeviceError::Driver {
            op: "cuStreamEndCapture",
            code: DeviceError::CUDA_ERROR_ILLEGAL_STATE,
        })?;
        self.next += 1;
        self.graphs.insert(self.next, rec);
        self.counters.live_graphs += 1;
        Ok(self.next)
    }

    pub(super) fn destroy(&mut self, graph: u64) -> Result<(), DeviceError> {
        self.graphs.remove(&graph).ok_or(DeviceError::Driver {
            op: "cuGraphExecDestroy",
            code: DeviceError::CUDA_ERROR_INVALID_HANDLE,
        })?;
        self.counters.live_graphs -= 1;
        Ok(())
    }
}

impl State {
    /// Enqueues graph `graph`'s kernels on `stream`; returns the violations found.
    pub(super) fn launch_graph(
        &mut self,
        graph: u64,
        stream: StreamId,
    ) -> Result<Vec<super::Violation>, DeviceError> {
        if self.graphs.capturing(stream.0) {
            return Err(capture_error("cuGraphLaunch"));
        }
        self.open_stream(stream)?;
        let rec = self.graphs.graphs.get(&graph).ok_or(DeviceError::Driver {
            op: "cuGraphLaunch",
            code: DeviceError::CUDA_ERROR_INVALID_HANDLE,
        })?;
        let kernels: Vec<Kernel> = rec
            .ops
            .iter()
            .map(|op| Kernel {
                name: op.name,
                accesses: op.accesses.clone(),
                sleep: op.sleep,
                body: None,
                replay: op.body.clone(),
            })
            .collect();
        let held = rec.held.clone();
        self.graphs.counters.graph_launches += 1;
        self.graphs.counters.replayed_kernels += kernels.len() as u64;
        let mut found = Vec::new();
        for kernel in kernels {
            found.extend(self.enqueue_kernel(stream, kernel, &held)?);
        }
        Ok(found)
    }
}

impl Shared {
    /// The graph counters.
    pub(super) fn graph_counters(&self) -> SimGraphCounters {
        crate::sync::lock(&self.state).graphs.counters
    }
}
