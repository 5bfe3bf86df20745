//! Stream capture on the simulator: CUDA graphs without a GPU.
//!
//! While a stream is captured, the kernels launched on it are recorded (with their declared
//! accesses and a body that may run many times) instead of enqueued; `end_capture` turns the
//! recording into a graph, and each `launch_graph` enqueues the recorded kernels again, on any
//! stream, so they really read and write memory and the sanitizer checks every replay against
//! the memory's *current* owners and the unfinished work on it.
//!
//! Other streams join a capture as CUDA's do (fork and join): an event recorded on a capturing
//! stream is a node of the capture, and a stream outside any capture that waits on it joins the
//! capture (its later work is recorded too); the capture ends only once every stream that joined
//! is joined back into the origin (the origin waits on an event recorded on it after its last
//! captured work), else `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` and the capture is gone.
//!
//! ```text
//!   begin_capture(s) ─▶ active[s] = Recording { ops, held, branches: { s } }; members[s] = s
//!     launch(t, k)     ─▶ ops.push((t, k))  for every t in the capture (nothing runs)
//!     record_event(e, t) ─▶ captured[e] = (s, t's branch clock ∪ { t: its position })
//!     wait_event(u, e)   ─▶ u outside: members[u] = s (u joins), branch u starts at e's clock
//!                           u inside: u's branch clock ∪= e's clock
//!     handout/reclaim on t ─▶ held.push(range)          (memory the graph will use)
//!   end_capture(s)   ─▶ every branch joined back into s? graphs[g] = Recording (GraphId g)
//!   launch_graph(g, t) ─▶ every op enqueued on t, in capture order; accesses count as
//!                         allocated if held by g
//!   handout on a stream not capturing of memory any graph holds ─▶ Violation
//!   pinned copy on a captured stream ─▶ recorded (replayable), host range noted; a host free
//!                         or hand-out of that range while the graph exists ─▶ Violation
//! ```
//!
//! A graph's replay runs its kernels one after another on the launch stream, so the sanitizer
//! cannot see two branches race at replay; it checks them as they are captured instead, with the
//! branches' clocks: a kernel recorded on one branch that touches memory a kernel of another
//! branch touched (one of them writing) without being ordered after it, and memory handed out on
//! one branch that another branch's unordered captured kernel touched, are violations (on a GPU
//! those branches run concurrently at every replay).
//!
//! Like CUDA's global capture mode, the device refuses while any capture is underway what
//! would synchronise or look into captured work: event queries and synchronisations, segment
//! releases (`cuMemFree`), destroying a capturing stream; and on a capturing stream itself,
//! waiting on an event recorded outside the capture. As in CUDA, the
//! first four also *invalidate* every capture underway: its end makes no graph
//! (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`), so a library that makes such a call during an
//! application's capture breaks it (counted in `SimGraphCounters::refused_in_capture`).

use super::{Shared, State};
use crate::device::clock::Clock;
use crate::device::{Access, AccessKind, CaptureMark, DeviceError, Kernel, ReplayFn, StreamId};
use std::collections::HashMap;
use std::time::Duration;

/// One recorded kernel.
pub(super) struct Captured {
    name: &'static str,
    accesses: Vec<Access>,
    sleep: Duration,
    body: Option<ReplayFn>,
    /// The stream it was launched on, and its position in that stream's branch (1, 2, …).
    stream: u32,
    pos: u64,
}

/// One stream's part of a capture.
#[derive(Default)]
struct Branch {
    /// Operations captured on it so far (kernels and event records).
    pos: u64,
    /// The positions of the other branches its later work is ordered after.
    clock: Clock,
}

/// A capture in progress, or a finished graph.
#[derive(Default)]
pub(super) struct Recording {
    ops: Vec<Captured>,
    /// Memory handed out or taken back on the capture's streams while it was captured, as
    /// `[lo, hi)`: what the graph's replays may touch, reserved for the graph until it is
    /// destroyed.
    held: Vec<(u64, u64)>,
    /// The branches of a capture underway, by stream (the origin's included).
    branches: HashMap<u32, Branch>,
    /// The capture's number (`SimGraphCounters::captures` when it began): what its marks carry.
    id: u64,
    /// A finished graph's last launch: the sanitizer's event recorded after it (an id no
    /// application event has), its stream and that stream's queue position then. CUDA orders
    /// each launch of a graph after the previous ones (`cuGraphLaunch`), on any stream.
    last_launch: Option<(u64, u32, u64)>,
    /// The thread that began the capture: in CUDA's global capture mode (`CudaDevice`'s) only
    /// it may end it.
    thread: Option<std::thread::ThreadId>,
    /// The first operation refused while the capture was underway: CUDA's global mode then
    /// invalidates it, and its end makes no graph (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`).
    invalidated_by: Option<&'static str>,
    /// Pinned host memory its captured copies read or write, as `[lo, hi)` and whether the copy
    /// writes it: every replay copies again, so it must stay allocated and unreused while the
    /// graph exists (and while a replay of it is queued).
    host: Vec<(usize, usize, bool)>,
}

impl Recording {
    fn hold(&mut self, lo: u64, hi: u64) {
        if lo < hi && !self.held.iter().any(|&(a, b)| a <= lo && hi <= b) {
            self.held.push((lo, hi));
        }
    }

    /// The captured kernels of other branches that `stream`'s next work is not ordered after
    /// and that touch `[lo, hi)` (writing, unless `write`): each overlap, with its stream.
    fn unordered(&self, stream: u32, lo: u64, hi: u64, write: bool) -> Vec<(u64, u64, u32)> {
        let Some(branch) = self.branches.get(&stream) else { return Vec::new() };
        let mut found = Vec::new();
        for op in self.ops.iter().filter(|op| op.stream != stream) {
            if branch.clock.get(op.stream) >= op.pos {
                continue;
            }
            for a in op.accesses.iter().filter(|a| write || a.kind == AccessKind::Write) {
                let (a_lo, a_hi) = (a.ptr.0, a.ptr.0.saturating_add(a.bytes));
                if a_lo < hi && lo < a_hi {
                    found.push((a_lo.max(lo), a_hi.min(hi), op.stream));
                }
            }
        }
        found
    }
}

/// Every capture and graph of a device.
#[derive(Default)]
pub(super) struct Graphs {
    /// Captures underway, by the stream each began on (its origin).
    pub(super) active: HashMap<u32, Recording>,
    /// Every stream of a capture underway, the origins included → its origin.
    members: HashMap<u32, u32>,
    /// Events last recorded on a capturing stream → (the capture's origin, what work waiting
    /// on them is ordered after: the recording branch's clock and its position).
    captured_events: HashMap<u64, (u32, Clock)>,
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
    /// Streams that joined a capture underway (a wait on an event recorded inside it).
    pub joined_streams: u64,
    /// Operations refused because a capture was underway (each invalidated the captures then
    /// underway).
    pub refused_in_capture: u64,
}

/// What [`Graphs::record`] did with a kernel.
pub(super) enum Recorded {
    /// Its stream is not capturing: enqueue it.
    No(Kernel),
    /// Recorded into a capture: the ranges it touches that another branch's unordered captured
    /// kernel touched, with that branch's stream.
    Yes(Vec<(u64, u64, u32)>),
}

impl Graphs {
    /// Whether `stream` is being captured (it began a capture, or joined one).
    pub(super) fn capturing(&self, stream: u32) -> bool {
        !self.members.is_empty() && self.members.contains_key(&stream)
    }

    /// Notes that the capture `stream` belongs to copies to or from host `[lo, hi)`.
    pub(super) fn record_host(&mut self, stream: u32, lo: usize, hi: usize, writes_host: bool) {
        if let Some((rec, _)) = self.branch(stream) {
            rec.host.push((lo, hi, writes_host));
        }
    }

    /// Whether a capture underway or a graph that exists copies to or from host memory that
    /// overlaps `[lo, hi)`.
    pub(super) fn uses_host(&self, lo: usize, hi: usize) -> bool {
        self.active
            .values()
            .chain(self.graphs.values())
            .any(|r| r.host.iter().any(|&(a, b, _)| a < hi && lo < b))
    }

    /// The origin of the capture `stream` belongs to, if it is capturing.
    pub(super) fn origin_of(&self, stream: u32) -> Option<u32> {
        self.members.get(&stream).copied()
    }

    /// Fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` while any capture is underway.
    /// Refuses `op` while any capture is underway, and invalidates every capture underway (as
    /// CUDA's global mode does: the application's capture fails to end).
    pub(super) fn refuse_during_capture(&mut self, op: &'static str) -> Result<(), DeviceError> {
        if self.active.is_empty() {
            return Ok(());
        }
        for rec in self.active.values_mut() {
            rec.invalidated_by.get_or_insert(op);
        }
        self.counters.refused_in_capture += 1;
        Err(DeviceError::capture_unsupported(op))
    }

    /// The capture `stream` belongs to, and its branch there.
    fn branch(&mut self, stream: u32) -> Option<(&mut Recording, u32)> {
        let origin = self.origin_of(stream)?;
        self.active.get_mut(&origin).map(|rec| (rec, origin))
    }

    /// Records `kernel` if `stream` is captured.
    pub(super) fn record(&mut self, stream: u32, kernel: Kernel) -> Result<Recorded, DeviceError> {
        let Some((rec, _)) = self.branch(stream) else { return Ok(Recorded::No(kernel)) };
        if !kernel.is_replayable() {
            return Err(DeviceError::Unsupported(
                "capturing a kernel whose body runs once (build it with Kernel::replayable)",
            ));
        }
        let mut races = Vec::new();
        for a in kernel.accesses.iter().filter(|a| a.bytes > 0) {
            let write = a.kind == AccessKind::Write;
            races.extend(rec.unordered(stream, a.ptr.0, a.ptr.0.saturating_add(a.bytes), write));
        }
        let branch = rec.branches.entry(stream).or_default();
        branch.pos += 1;
        rec.ops.push(Captured {
            name: kernel.name,
            accesses: kernel.accesses,
            sleep: kernel.sleep,
            body: kernel.replay,
            stream,
            pos: branch.pos,
        });
        self.counters.captured_kernels += 1;
        Ok(Recorded::Yes(races))
    }

    /// `[lo, hi)` was handed out or taken back on `stream`: held by its capture, if any. Returns
    /// whether the stream is captured.
    pub(super) fn note(&mut self, stream: u32, lo: u64, hi: u64) -> bool {
        match self.branch(stream) {
            Some((rec, _)) => {
                rec.hold(lo, hi);
                true
            }
            None => false,
        }
    }

    /// Memory handed out on capturing `stream`: the ranges of it that a captured kernel of
    /// another branch touches without `stream`'s later work being ordered after it.
    pub(super) fn unordered_handout(&self, stream: u32, lo: u64, hi: u64) -> Vec<(u64, u64, u32)> {
        let rec = self.origin_of(stream).and_then(|o| self.active.get(&o));
        rec.map(|r| r.unordered(stream, lo, hi, true)).unwrap_or_default()
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
        if self.members.contains_key(&stream.0) {
            return Err(DeviceError::Driver {
                op: "cuStreamBeginCapture",
                code: DeviceError::CUDA_ERROR_ILLEGAL_STATE,
            });
        }
        self.counters.captures += 1;
        let thread = Some(std::thread::current().id());
        let mut rec = Recording { id: self.counters.captures, thread, ..Recording::default() };
        rec.branches.insert(stream.0, Branch::default());
        self.active.insert(stream.0, rec);
        self.members.insert(stream.0, stream.0);
        Ok(())
    }

    /// Where capturing `stream`'s branch stands: its position, in its capture.
    pub(super) fn mark(&self, stream: u32) -> Option<CaptureMark> {
        let rec = self.active.get(&self.origin_of(stream)?)?;
        let position = rec.branches.get(&stream).map_or(0, |b| b.pos);
        Some(CaptureMark { capture: rec.id, stream: StreamId(stream), position })
    }

    /// Whether `stream`'s later captured work is ordered after `mark`: same capture, and the
    /// mark's stream itself or a branch whose clock covers the mark's position.
    pub(super) fn ordered_after(&self, stream: u32, mark: CaptureMark) -> bool {
        let Some(rec) = self.origin_of(stream).and_then(|o| self.active.get(&o)) else {
            return false;
        };
        if rec.id != mark.capture {
            return false;
        }
        stream == mark.stream.0
            || rec
                .branches
                .get(&stream)
                .is_some_and(|b| b.clock.get(mark.stream.0) >= mark.position)
    }

    /// `event` is recorded on capturing `stream` (a node of the capture): `true`; `false` if the
    /// stream is not capturing (an ordinary record). Either way an earlier capture record of the
    /// event is forgotten.
    pub(super) fn record_event(&mut self, event: u64, stream: u32) -> bool {
        self.captured_events.remove(&event);
        let Some((rec, origin)) = self.branch(stream) else { return false };
        let branch = rec.branches.entry(stream).or_default();
        branch.pos += 1;
        let mut clock = branch.clock.clone();
        clock.raise(stream, branch.pos);
        self.captured_events.insert(event, (origin, clock));
        true
    }

    /// `stream` waits on `event`: `Ok(true)` if the event was recorded inside a capture (the
    /// wait is part of it: `stream` joins it, or orders its branch after the event's);
    /// `Ok(false)` for an ordinary event (refused on a capturing stream: its work would depend on
    /// work outside the capture).
    pub(super) fn wait_event(&mut self, stream: StreamId, event: u64) -> Result<bool, DeviceError> {
        let isolation = Err(DeviceError::Driver {
            op: "cuStreamWaitEvent",
            code: DeviceError::CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
        });
        let Some((origin, clock)) = self.captured_events.get(&event).cloned() else {
            return match self.capturing(stream.0) {
                true => isolation,
                false => Ok(false),
            };
        };
        match self.origin_of(stream.0) {
            Some(o) if o != origin => return isolation,
            Some(_) => {}
            None if stream == StreamId::DEFAULT => {
                return Err(DeviceError::Unsupported("capturing the default stream"));
            }
            None => {
                self.members.insert(stream.0, origin);
                self.counters.joined_streams += 1;
            }
        }
        let rec = self.active.get_mut(&origin).expect("a member's capture is underway");
        rec.branches.entry(stream.0).or_default().clock.join(&clock);
        Ok(true)
    }

    /// Ends the capture begun on `stream`. Every other stream that joined it must have been
    /// joined back (the origin ordered after its last captured operation), else the capture is
    /// dropped with `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`; either way its streams leave it.
    pub(super) fn end(&mut self, stream: StreamId) -> Result<u64, DeviceError> {
        // Another thread's end is refused, and the capture goes on (global capture mode).
        let began = self.active.get(&stream.0).and_then(|r| r.thread);
        if began.is_some_and(|t| t != std::thread::current().id()) {
            return Err(DeviceError::Driver {
                op: "cuStreamEndCapture",
                code: DeviceError::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
            });
        }
        let rec = self.active.remove(&stream.0).ok_or(DeviceError::Driver {
            op: "cuStreamEndCapture",
            code: DeviceError::CUDA_ERROR_ILLEGAL_STATE,
        })?;
        self.members.retain(|_, o| *o != stream.0);
        self.captured_events.retain(|_, (o, _)| *o != stream.0);
        let origin = &rec.branches[&stream.0];
        let unjoined = rec
            .branches
            .iter()
            .any(|(&s, b)| s != stream.0 && (b.pos == 0 || origin.clock.get(s) < b.pos));
        if unjoined {
            return Err(DeviceError::Driver {
                op: "cuStreamEndCapture",
                code: DeviceError::CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
            });
        }
        if rec.invalidated_by.is_some() {
            return Err(DeviceError::Driver {
                op: "cuStreamEndCapture",
                code: DeviceError::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            });
        }
        self.next += 1;
        self.graphs.insert(self.next, Recording { branches: HashMap::new(), ..rec });
        self.counters.live_graphs += 1;
        Ok(self.next)
    }

    /// Destroys `graph`; returns the sanitizer event of its last launch, to forget.
    pub(super) fn destroy(&mut self, graph: u64) -> Result<Option<u64>, DeviceError> {
        let rec = self.graphs.remove(&graph).ok_or(DeviceError::Driver {
            op: "cuGraphExecDestroy",
            code: DeviceError::CUDA_ERROR_INVALID_HANDLE,
        })?;
        self.counters.live_graphs -= 1;
        Ok(rec.last_launch.map(|(e, ..)| e))
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
            return Err(DeviceError::capture_unsupported("cuGraphLaunch"));
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
        let (held, last, host) = (rec.held.clone(), rec.last_launch, rec.host.clone());
        // After the graph's previous launch, wherever it ran.
        let event = match last {
            Some((event, a, p)) => {
                if a != stream.0 && !self.reached(a, p) {
                    self.open_stream(stream)?.push(super::stream::Op::Wait { stream: a, pos: p });
                }
                self.san.wait(stream.0, event);
                event
            }
            None => {
                self.next_event += 1;
                self.next_event - 1
            }
        };
        self.graphs.counters.graph_launches += 1;
        self.graphs.counters.replayed_kernels += kernels.len() as u64;
        let mut found = Vec::new();
        for kernel in kernels {
            found.extend(self.enqueue_kernel(stream, kernel, &held)?);
        }
        let pos = self.open_stream(stream)?.enqueued;
        // The replay's copies use their host memory until the launch has run.
        self.note_replayed_copies(&host, stream.0, pos);
        self.san.record(event, stream.0, pos);
        if let Some(rec) = self.graphs.graphs.get_mut(&graph) {
            rec.last_launch = Some((event, stream.0, pos));
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
