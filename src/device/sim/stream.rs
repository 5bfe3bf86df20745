//! Streams: in-order queues, each drained by its own worker thread.
//!
//! Every operation enqueued on a stream takes the next *position* (1, 2, 3, …). The worker pops
//! operations in order and bumps `completed` when one is done, so "position `p` has been passed"
//! is `completed >= p`. An event marker is such a position: recording an event on a stream notes
//! `(stream, enqueued)` and needs no queue entry of its own.
//!
//! ```text
//!   host ── launch / wait_event ──▶ queue: [Kernel@5][Wait(A@3)@6][Kernel@7]
//!                                     │ worker pops front, runs it (Kernel: without the lock)
//!                                     ▼
//!   completed = 4   enqueued = 7   event recorded now → target (stream, 7)
//! ```
//!
//! All streams share the device lock and one condition variable (`Shared::progress`), notified
//! whenever work is enqueued or completes; workers, `Wait` operations and host syncs wait on it.

use super::{KernelFailure, Shared, memory::SimMemory};
use crate::device::{Kernel, StreamId};
use crate::sync::{Arc, lock, thread, wait};
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// One operation in a stream's queue.
pub(super) enum Op {
    /// Run a kernel (the operation at position `pos`).
    Kernel { pos: u64, kernel: Kernel },
    /// Block this stream until stream `stream` has passed position `pos`.
    Wait { stream: u32, pos: u64 },
}

/// A stream's queue and progress.
pub(super) struct Stream {
    pub(super) queue: VecDeque<Op>,
    /// Operations ever enqueued (the position of the last one).
    pub(super) enqueued: u64,
    /// Operations completed by the worker.
    pub(super) completed: u64,
    /// No new work is accepted; the worker exits once the queue is empty.
    pub(super) closing: bool,
    /// The worker, until someone joins it.
    pub(super) handle: Option<thread::JoinHandle<()>>,
}

impl Stream {
    /// A new stream whose worker `spawn` will start.
    pub(super) fn new() -> Stream {
        Stream { queue: VecDeque::new(), enqueued: 0, completed: 0, closing: false, handle: None }
    }

    /// Has every enqueued operation completed?
    pub(super) fn idle(&self) -> bool {
        self.completed == self.enqueued
    }

    /// The position the next operation will take.
    pub(super) fn next_pos(&self) -> u64 {
        self.enqueued + 1
    }

    /// Enqueues `op`, which must carry position `next_pos()` if it is a kernel.
    pub(super) fn push(&mut self, op: Op) {
        self.enqueued += 1;
        self.queue.push_back(op);
    }
}

/// Starts the worker of stream `id` (whose entry must be in the state before it runs). The
/// system may refuse another thread (a trace with tens of thousands of streams reaches its
/// limit): an error, not a panic. With `refuse`, the thread is refused without being asked
/// for (an injected fault).
pub(super) fn spawn(
    shared: Arc<Shared>,
    id: u32,
    refuse: bool,
) -> std::io::Result<thread::JoinHandle<()>> {
    // BROKEN (`stream_spawn_panics`): `thread::spawn`, which panics when refused.
    if cfg!(tidepool_broken = "stream_spawn_panics") {
        return Ok(thread::spawn(move || worker(&shared, id)));
    }
    if refuse {
        return Err(std::io::Error::from(std::io::ErrorKind::WouldBlock));
    }
    thread::Builder::new().spawn(move || worker(&shared, id))
}

/// What the worker does next.
enum Step {
    Exit,
    Sleep,
    PassWait,
    Run,
}

fn worker(shared: &Shared, id: u32) {
    let mut st = lock(&shared.state);
    loop {
        let step = match st.streams.get(&id) {
            None => Step::Exit,
            Some(s) => match s.queue.front() {
                None if s.closing => Step::Exit,
                None => Step::Sleep,
                Some(Op::Wait { stream, pos }) if st.reached(*stream, *pos) => Step::PassWait,
                Some(Op::Wait { .. }) => Step::Sleep,
                Some(Op::Kernel { .. }) => Step::Run,
            },
        };
        match step {
            Step::Exit => return,
            Step::Sleep => st = wait(&shared.progress, st),
            Step::PassWait => {
                let s = st.streams.get_mut(&id).expect("stream entry outlives its worker");
                s.queue.pop_front();
                s.completed += 1;
                shared.progress.notify_all();
            }
            Step::Run => {
                let s = st.streams.get_mut(&id).expect("stream entry outlives its worker");
                let Some(Op::Kernel { pos, mut kernel }) = s.queue.pop_front() else {
                    unreachable!("front was a kernel")
                };
                drop(st);
                let failure = run(shared, &mut kernel);
                st = lock(&shared.state);
                let s = st.streams.get_mut(&id).expect("stream entry outlives its worker");
                s.completed += 1;
                st.san.complete(id, pos, &kernel.accesses);
                if let Some(message) = failure {
                    st.failures.push(KernelFailure {
                        stream: StreamId(id),
                        kernel: kernel.name,
                        message,
                    });
                }
                shared.progress.notify_all();
            }
        }
    }
}

/// Sleeps, then runs the kernel's body; returns the panic message if the body panicked.
fn run(shared: &Shared, kernel: &mut Kernel) -> Option<String> {
    std::thread::sleep(kernel.sleep);
    let body = kernel.body.take();
    if body.is_none() && kernel.replay.is_none() {
        return None;
    }
    let mem = SimMemory { shared, accesses: &kernel.accesses };
    let replay = kernel.replay.as_deref();
    let payload = catch_unwind(AssertUnwindSafe(|| match body {
        Some(body) => body(&mem),
        None => replay.expect("checked above")(&mem),
    }))
    .err()?;
    Some(if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "kernel panicked".to_string()
    })
}
