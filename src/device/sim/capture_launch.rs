//! [`Capture`](crate::device::Capture) and [`Launch`](crate::device::Launch) for [`SimDevice`]:
//! stream capture into graphs, and kernels checked by the sanitizer before they are queued.

use super::stream::Op;
use super::{SimDevice, State, Violation, graph};
use crate::device::{DeviceError, Kernel, StreamId};

impl SimDevice {
    /// Stores the number of captures underway where the lock-free questions read it (under the
    /// lock, as it changes).
    fn count_captures(&self, st: &State) {
        let n = st.graphs.active.len();
        self.captures.store(n, crate::sync::atomic::Ordering::Release);
    }
}

impl crate::device::Capture for SimDevice {
    fn begin_capture(&self, stream: StreamId) -> Result<(), DeviceError> {
        let mut st = self.state();
        st.open_stream(stream)?;
        let r = st.graphs.begin(stream);
        self.count_captures(&st);
        r
    }

    fn end_capture(&self, stream: StreamId) -> Result<crate::device::GraphId, DeviceError> {
        let mut st = self.state();
        let r = st.graphs.end(stream).map(crate::device::GraphId);
        self.count_captures(&st);
        r
    }

    fn launch_graph(
        &self,
        graph: crate::device::GraphId,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let mut st = self.state();
        let found = st.launch_graph(graph.0, stream)?;
        let panic = st.panic_on_violation;
        drop(st);
        self.shared.progress.notify_all();
        Self::after_check(found, panic);
        Ok(())
    }

    fn destroy_graph(&self, graph: crate::device::GraphId) -> Result<(), DeviceError> {
        let mut st = self.state();
        if let Some(event) = st.graphs.destroy(graph.0)? {
            st.san.forget_event(event);
        }
        Ok(())
    }
}

impl crate::device::Launch for SimDevice {
    /// On a stream being captured, the kernel is recorded into the capture instead (it must be
    /// [`Kernel::replayable`]).
    fn launch(&self, stream: StreamId, kernel: Kernel) -> Result<(), DeviceError> {
        let mut st = self.state();
        st.open_stream(stream)?;
        let found = match st.graphs.record(stream.0, kernel)? {
            graph::Recorded::No(kernel) => st.enqueue_kernel(stream, kernel, &[])?,
            graph::Recorded::Yes(races) => {
                let op = "kernel touch (branches of a captured graph not ordered)";
                let mut found = Vec::new();
                for (lo, hi, other) in races {
                    found.extend(st.san.flag(lo, hi, stream.0, Some(other), op));
                }
                found
            }
        };
        let panic = st.panic_on_violation;
        drop(st);
        self.shared.progress.notify_all();
        Self::after_check(found, panic);
        Ok(())
    }
}

impl State {
    /// Enqueues `kernel` on `stream` after the sanitizer's checks; `held` lists ranges that
    /// count as allocated (a graph's memory, for its replays).
    pub(super) fn enqueue_kernel(
        &mut self,
        stream: StreamId,
        kernel: Kernel,
        held: &[(u64, u64)],
    ) -> Result<Vec<Violation>, DeviceError> {
        let st = self;
        let pos = st.open_stream(stream)?.next_pos();
        st.counters.launches += 1;
        let found = st.check_kernel(stream, pos, &kernel, held);
        st.open_stream(stream)?.push(Op::Kernel { pos, kernel });
        Ok(found)
    }

    /// The sanitizer's checks of `kernel` (a pinned copy's too) about to take position `pos` of
    /// `stream`: its accesses against what is handed out (or in `held`), live segments, mapped
    /// pages, unfinished work, and unfinished work on the same physical pages mapped elsewhere.
    pub(super) fn check_kernel(
        &mut self,
        stream: StreamId,
        pos: u64,
        kernel: &Kernel,
        held: &[(u64, u64)],
    ) -> Vec<Violation> {
        let (mem, vm) = (&self.mem, &self.vm);
        let mut found =
            self.san.launch(stream.0, pos, kernel.name, &kernel.accesses, held, |lo, hi| {
                mem.contains(lo, hi) || vm.mapped(lo, hi)
            });
        if !self.vm.is_empty() {
            for a in kernel.accesses.iter().filter(|a| a.bytes > 0) {
                let aliases = self.vm.aliases(a.ptr.0, a.ptr.0 + a.bytes);
                let write = a.kind == crate::device::AccessKind::Write;
                let op = format!("kernel {} (physical memory also mapped elsewhere)", kernel.name);
                found.extend(self.san.check_aliases(stream.0, &aliases, write, &op));
            }
        }
        found
    }
}
