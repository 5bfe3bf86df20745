//! Graph captures in one step: allocations from the graph's pool with captured kernels, frees
//! during the capture, a side stream forked in and joined back, bodies that panic, and a pool
//! captured again; what a fault in the middle of a capture may excuse.

use super::{BodyPanic, CapturedKernel, Harness, captured_alloc, dev_err};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;
use tidepool::device::{Access, AccessKind, DeviceError, Kernel, Launch, SimDevice, StreamId};
use tidepool::{AllocError, Buffer, MemPool, PoolOptions, Residency};

impl Harness<'_> {
    /// [`Op::Capture`]: a capture whole in one step, forked into a second stream or not. A
    /// forked capture replayed twice keeps the side stream's block past its graph, writes it
    /// there outside any capture and frees it, then captures again into the same pool, forked
    /// into the same stream (which may be handed that block), and replays on both streams: the
    /// sanitizer checks that the second graph's replays are ordered after that write. With
    /// `panics`, the capture's body panics instead ([`Harness::capture_panicking`]).
    ///
    /// [`Op::Capture`]: crate::program::Op::Capture
    pub(super) fn capture(
        &mut self,
        stream: u8,
        fork: u8,
        bytes: u64,
        launches: u8,
        panics: bool,
    ) -> Result<(), String> {
        let slot = stream.max(1);
        let s = self.stream(slot)?;
        let t = match fork {
            f if f != 0 && f != slot => Some(self.stream(f)?),
            _ => None,
        };
        let a = self.alloc;
        // Every other forked capture reuses, after the join, the block the side stream used
        // (`graph_capture_record_stream_reuse`); the others hold it until the graph goes.
        let reuse = t.is_some() && (stream ^ fork) & 1 == 1;
        if a.config().graph_capture_record_stream_reuse != reuse {
            let mut c = (*a.config()).clone();
            c.graph_capture_record_stream_reuse = reuse;
            a.set_config(c).map_err(|e| format!("set_config: {e}"))?;
        }
        // One graph pool in three never splits a block (`PoolOptions::no_split`).
        let no_split = bytes.wrapping_add(u64::from(stream)) % 3 == 0;
        let options = PoolOptions::default().with_no_split(no_split);
        let pool = a.new_pool(options).map_err(|e| format!("new_pool: {e}"))?;
        if panics {
            self.capture_panicking(s, t, &pool, bytes, launches % 2 == 1)?;
            return self.graph_pool_gone(pool);
        }
        if !self.tolerate(a.begin_capture(s, Some(&pool)), &format!("begin_capture on {s}"))? {
            // Refused by an injected fault: no capture, and the pool serves nothing.
            ensure!(!a.is_capturing(s), "{s} captures after a refused begin_capture");
            return self.graph_pool_gone(pool);
        }
        let second = t.is_some() && launches == 2;
        let mut kept = None;
        let alloc = |on: StreamId| captured_alloc(a, bytes, on);
        // A captured kernel writing `dst` (after reading `src`): replayable, with no body (the
        // device is unbacked); the sanitizer checks its accesses at capture and at each replay.
        let kernel = |src: Option<&Buffer<SimDevice>>, dst: &Buffer<SimDevice>| {
            let mut acc =
                vec![Access { ptr: dst.ptr(), bytes: dst.len(), kind: AccessKind::Write }];
            acc.extend(src.map(|b| Access {
                ptr: b.ptr(),
                bytes: b.len(),
                kind: AccessKind::Read,
            }));
            Kernel::replayable("captured", acc, |_| {})
        };
        let mut bufs = Vec::new();
        for _ in 0..2 {
            let Some(b) = alloc(s)? else { break };
            self.dev
                .launch(s, kernel(bufs.last(), &b))
                .map_err(|e| dev_err("captured launch", e))?;
            bufs.push(b);
        }
        if let Some(t) = t {
            self.order_after(t, s)?; // the fork
            ensure!(
                a.is_capturing(t),
                "{t} waited on an event of {s}'s capture but is not capturing"
            );
            if let Some(b) = alloc(t)? {
                if let Some(last) = bufs.last() {
                    // Announced with `use_on` (ordered inside the capture by an event edge)
                    // or `record_stream` (recorded only: the fork ordered it).
                    let announced = match (stream ^ fork) & 2 != 0 {
                        true => last.use_on(t, AccessKind::Read),
                        false => a.record_stream(last, t),
                    };
                    if self.tolerate_in_capture(announced, "use of a captured block")? {
                        let k = kernel(Some(last), &b);
                        self.dev.launch(t, k).map_err(|e| dev_err("forked", e))?;
                    }
                }
                match second {
                    true => kept = Some(b), // outlives the graph
                    false => drop(b),       // back into the graph's pool, on `t`
                }
            }
            if reuse && bufs.len() == 2 {
                drop(bufs.pop()); // used on `t`: waits for the join
            }
            self.order_after(s, t)?; // the join
            if let Some(b) = alloc(s)? {
                // With the reuse, maybe the block `t` used: ordered after its read now.
                self.dev.launch(s, kernel(None, &b)).map_err(|e| dev_err("after the join", e))?;
                bufs.push(b);
            }
        }
        // Unforked, the other stream allocates four times the captured size meanwhile, outside
        // the capture: its growth, page moves or out-of-memory ladder run while the capture
        // refuses every host wait and event query. The buffer lives on as any other.
        if t.is_none() {
            let o = self.stream(3 - slot)?;
            self.alloc_op(bytes.saturating_mul(4), o, Residency::Transient)?;
        }
        if !bufs.is_empty() {
            drop(bufs.remove(0)); // freed during the capture: reused by the capture only
        }
        let graph = match a.end_capture(s) {
            Ok(graph) => graph,
            Err(_) if self.capture_broken_by_fault() => {
                // Invalidated: no graph. The capture is over all the same.
                self.note_excused();
                for u in std::iter::once(s).chain(t) {
                    ensure!(!a.is_capturing(u), "{u} still captures after a failed end");
                }
                drop((bufs, kept));
                return self.graph_pool_gone(pool);
            }
            Err(e) => return Err(format!("end_capture on {s}: {e}")),
        };
        ensure!(t.is_none_or(|t| !a.is_capturing(t)), "a joined stream outlived its capture");
        for _ in 0..launches {
            graph.launch(s).map_err(|e| format!("graph launch: {e}"))?;
        }
        drop(bufs);
        drop(graph); // waits for its launches, then lets go of what it held
        if let (Some(t), Some(b)) = (t, kept) {
            self.capture_again(&pool, s, t, b, &kernel)?;
        }
        self.graph_pool_gone(pool)
    }

    /// [`Op::Capture`] with `panics`: the capture's work (two allocations from the graph's
    /// pool with captured kernels, the first freed; `t` forked in, allocating and writing,
    /// joined back when `join`) as the body of `Allocator::capture`, which then panics. The
    /// panic is caught here, with the panic hook silenced meanwhile (libFuzzer's aborts): a
    /// panic of anything else goes on. The capture must be over for both streams.
    ///
    /// [`Op::Capture`]: crate::program::Op::Capture
    fn capture_panicking(
        &self,
        s: StreamId,
        t: Option<StreamId>,
        pool: &MemPool<SimDevice>,
        bytes: u64,
        join: bool,
    ) -> Result<(), String> {
        let a = self.alloc;
        let alloc = |on: StreamId| captured_alloc(a, bytes, on);
        let write = |b: &Buffer<SimDevice>, on: StreamId| {
            let acc = vec![Access { ptr: b.ptr(), bytes: b.len(), kind: AccessKind::Write }];
            self.dev.launch(on, Kernel::replayable("captured", acc, |_| {}))
        };
        let body = || -> Result<(), String> {
            let mut bufs = Vec::new();
            for _ in 0..2 {
                let Some(b) = alloc(s)? else { break };
                write(&b, s).map_err(|e| dev_err("captured launch", e))?;
                bufs.push(b);
            }
            if let Some(t) = t {
                self.order_after(t, s)?; // the fork
                if let Some(b) = alloc(t)? {
                    write(&b, t).map_err(|e| dev_err("forked launch", e))?;
                    bufs.push(b);
                }
                if join {
                    self.order_after(s, t)?;
                }
            }
            if !bufs.is_empty() {
                drop(bufs.remove(0)); // freed in the body; the rest as the panic unwinds
            }
            std::panic::panic_any(BodyPanic)
        };
        // One swap at a time in the process (tests run harnesses on several threads), so each
        // puts back the hook it found.
        static HOOK_SWAP: Mutex<()> = Mutex::new(());
        let swap = HOOK_SWAP.lock().unwrap_or_else(PoisonError::into_inner);
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            a.capture(s, Some(pool), body)
        }));
        std::panic::set_hook(hook);
        drop(swap);
        match caught {
            Err(p) if p.is::<BodyPanic>() => {}
            Err(p) => std::panic::resume_unwind(p),
            Ok(Err(_)) if self.capture_broken_by_fault() => self.note_excused(),
            Ok(Err(e)) => return Err(format!("capture on {s}: {e}")),
            Ok(Ok((_, r))) => r?, // the body failed before its panic
        }
        for u in std::iter::once(s).chain(t) {
            ensure!(!a.is_capturing(u), "{u} still captures after the body on {s} panicked");
        }
        Ok(())
    }

    /// The end of [`Op::Capture`]: the graph's pool serves nothing more. Emptied, it holds
    /// nothing, and its device calls join the count the device's must match.
    ///
    /// [`Op::Capture`]: crate::program::Op::Capture
    fn graph_pool_gone(&mut self, pool: MemPool<SimDevice>) -> Result<(), String> {
        if !self.tolerate(pool.empty_cache(), "empty_cache of a graph's pool")? {
            // A refused unmap (each fault refuses one call): the pages stay in its range,
            // and the next try gives them back.
            pool.empty_cache().map_err(|e| format!("empty_cache of a graph's pool again: {e}"))?;
        }
        let left = pool.snapshot();
        ensure!(left.is_empty(), "the graph's pool kept {left:?} once the graph was gone");
        let st = pool.stats();
        self.pool_calls.0 += st.num_device_alloc;
        self.pool_calls.1 += st.num_device_free;
        Ok(())
    }

    /// The second capture of [`Harness::capture`]'s forked case: `b` (of `pool`, on `t`) is
    /// written on `t` outside any capture, by a kernel that takes a while, and freed; then `s`
    /// is captured into `pool` again, forked into `t`, which allocates `b`'s size and writes
    /// it, and the graph is replayed on `s` and then on `t`.
    fn capture_again(
        &mut self,
        pool: &MemPool<SimDevice>,
        s: StreamId,
        t: StreamId,
        b: Buffer<SimDevice>,
        kernel: &CapturedKernel,
    ) -> Result<(), String> {
        let a = self.alloc;
        let write = Kernel {
            name: "after the graph",
            accesses: vec![Access { ptr: b.ptr(), bytes: b.len(), kind: AccessKind::Write }],
            sleep: Duration::from_micros(200),
            body: None,
            replay: None,
        };
        self.dev.launch(t, write).map_err(|e| dev_err("launch", e))?;
        let bytes = b.len();
        drop(b); // on its own stream: cached in the pool at once
        if !self
            .tolerate(a.begin_capture(s, Some(pool)), &format!("second begin_capture on {s}"))?
        {
            ensure!(!a.is_capturing(s), "{s} captures after a refused begin_capture");
            return Ok(());
        }
        self.order_after(t, s)?; // the fork
        let made = match a.alloc(bytes.max(1), t) {
            Ok(c) => {
                self.dev.launch(t, kernel(None, &c)).map_err(|e| dev_err("forked again", e))?;
                Some(c)
            }
            Err(AllocError::OutOfMemory(_)) => None,
            Err(e) => return Err(format!("alloc of {bytes} in the second capture: {e}")),
        };
        self.order_after(s, t)?; // the join
        let graph = match a.end_capture(s) {
            Ok(graph) => graph,
            Err(_) if self.capture_broken_by_fault() => {
                self.note_excused();
                for u in [s, t] {
                    ensure!(!a.is_capturing(u), "{u} still captures after a failed end");
                }
                return Ok(());
            }
            Err(e) => return Err(format!("second end_capture on {s}: {e}")),
        };
        for on in [s, t] {
            graph.launch(on).map_err(|e| format!("second graph's launch on {on}: {e}"))?;
        }
        drop(made);
        drop(graph);
        Ok(())
    }

    /// Whether a capture of this step may have been broken by an injected fault: an event
    /// creation refusal is armed, and the device refused a call because a capture was
    /// underway (the allocator, left with no event to order a use by, waited for the whole
    /// device instead, which CUDA refuses during a capture and which invalidates it).
    fn capture_broken_by_fault(&self) -> bool {
        self.event_create_armed
            && self.dev.graph_counters().refused_in_capture > self.refused_in_capture
    }

    /// [`Harness::tolerate`] in a capture: also a failure of a capture a fault broke, and the
    /// refusal of a device-wide wait that stood in for a refused event creation.
    fn tolerate_in_capture(&self, r: Result<(), AllocError>, what: &str) -> Result<bool, String> {
        // The allocator refuses a device-wide wait during a capture itself (`Guarded`).
        let unsupported = |e: &AllocError| {
            matches!(e, AllocError::Device(DeviceError::Driver { code, .. })
                if *code == DeviceError::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        };
        match r {
            Err(e)
                if self.capture_broken_by_fault() || self.event_create_armed && unsupported(&e) =>
            {
                self.note_excused();
                Ok(false)
            }
            r => self.tolerate(r, what),
        }
    }
}
