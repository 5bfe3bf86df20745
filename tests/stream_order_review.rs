//! Stream-ordered frees, events and stream lifetimes, broken the way users break them: kernels
//! that really read and write on several streams (gated, so nothing depends on timing), the
//! sanitizer on, injected event faults, streams destroyed while frees wait on them, and the
//! exact addresses, byte counts and host waits that follow.

use std::sync::Arc;
use tidepool::device::{AccessKind, Launch, SIM_BASE, SimDevice};
use tidepool::{Allocator, Config, Device, DeviceAddr, StreamId};

mod common;
use common::{N, gated, open_on_next_sync};

/// A backed 256 MiB device with streams `s`, `t` and an allocator of `config`.
fn setup(config: &str) -> (Arc<SimDevice>, Allocator<SimDevice>, StreamId, StreamId) {
    let dev = Arc::new(SimDevice::backed(256 * tidepool::MIB));
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    (dev, alloc, s, t)
}

/// The address `k` small blocks of N bytes into the first small segment.
fn at(k: u64) -> DeviceAddr {
    DeviceAddr(SIM_BASE + k * N)
}

/// Everything is back on the device once the allocator goes, no event is left, and the
/// sanitizer saw no premature reuse.
fn assert_all_returned(dev: &SimDevice, alloc: Allocator<SimDevice>) {
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_eq!(dev.live_segments(), vec![]);
    assert_eq!(dev.live_events(), 0, "the allocator leaked events");
    assert_eq!(dev.violations(), vec![]);
}

/// `destroy_stream(s)` frees the blocks whose free waited on `s` (the device drained it) and
/// leaves those waiting on another stream's unfinished work pending: it neither blocks the host
/// on that other stream (a gated read here, which would have hung it) nor frees its block.
/// Before, an event pending on `s` made it wait on the host for every pending event of every
/// stream (`sync_events`).
#[test]
fn destroying_a_stream_waits_for_no_other_streams_work() {
    let (dev, alloc, s, t) = setup("");
    let z = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    let x = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    assert_eq!((z.ptr(), x.ptr()), (at(0), at(1)));
    // `t` reads `x` until the gate opens; `x` is freed behind `t`'s event.
    let (k, open) = gated(x.ptr(), N, AccessKind::Read);
    dev.launch(t, k).unwrap();
    x.record_stream(t).unwrap();
    drop(x);
    // `s` reads `z` (done at once); `z` is freed behind `s`'s event, not polled yet.
    let (k, gate) = gated(z.ptr(), N, AccessKind::Read);
    drop(gate);
    dev.launch(s, k).unwrap();
    z.record_stream(s).unwrap();
    drop(z);
    let syncs = dev.counters().host_syncs;
    // (Were the host to wait for `t`, this opens the gate, so the test fails instead of hanging.)
    let opener = open_on_next_sync(&dev, open);
    alloc.destroy_stream(s).unwrap();
    let st = alloc.stats();
    assert_eq!((st.num_sync_all_streams, st.num_host_syncs), (0, 0), "waited on the host");
    assert_eq!(dev.counters().host_syncs, syncs);
    // `z`'s block is free; `x`'s still waits for `t`'s read.
    assert_eq!(st.blocks.active_bytes.all.current, N, "x pending");
    assert_eq!(st.blocks.allocated_bytes.all.current, 0);
    let a = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    let b = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    assert_eq!((a.ptr(), b.ptr()), (at(0), at(2)), "x's block handed out while `t` reads it");
    alloc.check_invariants().unwrap();
    // The gate opens at the test's own host sync; then `x`'s block is free again.
    dev.synchronize().unwrap();
    opener.join().unwrap();
    let c = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    assert_eq!(c.ptr(), at(1));
    drop((a, b, c));
    assert_all_returned(&dev, alloc);
}

/// A closed allocator (its last handle gone) keeps no pooled event: a forgotten buffer keeps
/// its own segment and nothing else, and a buffer freed after the close, used on another
/// stream, gets an event for its free that goes back to the device with it. Before, the
/// events stayed until the last buffer went: for good with a forgotten one.
#[test]
fn a_forgotten_buffer_keeps_no_event_of_its_closed_allocator() {
    let (dev, alloc, s, t) = setup("");
    let forgotten = alloc.alloc(N, s).unwrap();
    // Eight frees behind events on `t` at once: eight events made and pooled.
    let used: Vec<_> = (0..8).map(|_| alloc.alloc(N, s).unwrap()).collect();
    used.iter().for_each(|b| b.record_stream(t).unwrap());
    drop(used);
    alloc.synchronize().unwrap();
    assert_eq!(dev.live_events(), 8);
    // A buffer that outlives the allocator's last handle, used on `t`.
    let late = alloc.alloc(2 << 20, s).unwrap();
    let late_ptr = late.ptr();
    let (k, open) = gated(late_ptr, N, AccessKind::Read);
    dev.launch(t, k).unwrap();
    late.record_stream(t).unwrap();
    std::mem::forget(forgotten);
    drop(alloc);
    assert_eq!(dev.live_events(), 0, "the closed allocator kept its pooled events");
    let small = (DeviceAddr(SIM_BASE), 2 << 20);
    assert_eq!(dev.live_segments(), vec![small, (late_ptr, 20 << 20)], "a 20 MiB large segment");
    // Its free waits for `t` on the host (the gate opens as it starts to), with an event that
    // goes back at once; then its segment goes too.
    let opener = open_on_next_sync(&dev, open);
    drop(late);
    opener.join().unwrap();
    assert_eq!(dev.live_events(), 0);
    assert_eq!(dev.live_segments(), vec![small], "only the forgotten buffer's segment is left");
    assert_eq!(dev.violations(), vec![]);
}

/// `destroy_stream(s)` while another stream captures a graph: the device destroys `s` (it is
/// not capturing), and the free that waited on `s`'s work is done with no host wait, which the
/// capture would refuse. Before, that wait failed (`cuEventSynchronize` during a capture) and
/// the call returned the error after `s` was already destroyed, its segments still cached.
#[test]
fn destroying_a_stream_during_another_streams_capture_succeeds() {
    let (dev, alloc, s, t) = setup("");
    let z = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    let on_s = alloc.alloc(N, s).unwrap();
    assert_eq!((z.ptr(), on_s.ptr()), (at(0), DeviceAddr(SIM_BASE + (2 << 20))));
    drop(on_s); // cached for `s`: its segment goes with it
    let (k, gate) = gated(z.ptr(), N, AccessKind::Read);
    drop(gate);
    dev.launch(s, k).unwrap();
    z.record_stream(s).unwrap();
    drop(z);
    alloc.begin_capture(t, None).unwrap();
    alloc.destroy_stream(s).unwrap();
    assert!(!dev.has_stream(s));
    let st = alloc.stats();
    assert_eq!((st.blocks.active_bytes.all.current, st.num_host_syncs), (0, 0));
    let graph = alloc.end_capture(t).unwrap();
    drop(graph);
    // `s`'s segment (released during the capture: no `cuMemFree` then) goes with `empty_cache`.
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_segments(), vec![]);
    assert_all_returned(&dev, alloc);
}

/// A free whose other stream's work nothing can mark (the event record fails) waits on the
/// host; when the device fails that wait too, the block waits, never handed out, for the next
/// host wait that succeeds (an event poll, the out-of-memory ladder, `empty_cache` here, the
/// allocator's drop): not lost. Before, it stayed allocated for good (counted in
/// `allocated_bytes`, its segment never released, not even as the allocator went).
#[test]
fn a_free_whose_host_wait_fails_waits_for_the_next_one() {
    let (dev, alloc, s, t) = setup("");
    let x = alloc.alloc(N, s).unwrap();
    assert_eq!(x.ptr(), at(0));
    let (k, open) = gated(x.ptr(), N, AccessKind::Read);
    dev.launch(t, k).unwrap();
    x.record_stream(t).unwrap();
    dev.fail_event_records(true);
    dev.fail_host_syncs(true);
    drop(x); // no event on `t`, no host wait: nothing shows `t` done with it
    let st = alloc.stats();
    assert_eq!(st.blocks.allocated_bytes.all.current, 0, "the free was lost: still allocated");
    assert_eq!(st.blocks.active_bytes.all.current, N, "pending");
    let y = alloc.alloc(N, s).unwrap();
    assert_eq!(y.ptr(), at(1), "handed out while `t` reads it");
    alloc.check_invariants().unwrap();
    dev.fail_event_records(false);
    dev.fail_host_syncs(false);
    let z = alloc.alloc(N, s).unwrap(); // (no event is pending: nothing polled)
    assert_eq!(z.ptr(), at(2), "handed out while `t` reads it");
    // `empty_cache` waits on the host (the gate opens as it starts to): then it is free.
    let opener = open_on_next_sync(&dev, open.clone());
    alloc.empty_cache().unwrap();
    let _ = open.send(()); // (were nothing waited for, `t` still runs: end it)
    let w = alloc.alloc(N, s).unwrap();
    let st = alloc.stats();
    dev.synchronize().unwrap();
    opener.join().unwrap();
    assert_eq!(w.ptr(), at(0), "the block was lost");
    // One host sync: `empty_cache`'s (the free's host wait was refused: the host never
    // waited, and it is not counted).
    assert_eq!((st.blocks.active_bytes.all.current, st.num_host_syncs), (3 * N, 1));
    drop((y, z, w));
    assert_all_returned(&dev, alloc);
}

/// `use_on` where the device refuses the device-side wait: the host waits for the owner's
/// write instead (so the other stream reads the written bytes), and that wait is counted in
/// `num_host_syncs` as the device counts it. Where the host wait fails too, `use_on` is a clear
/// error that records nothing (the free takes no event). Before, the fallback's host wait was
/// not counted.
#[test]
fn use_on_falls_back_to_a_counted_host_wait() {
    let (dev, alloc, s, t) = setup("");
    let x = alloc.alloc(N, s).unwrap();
    let (k, open) = common::gated_write(x.ptr(), 0xAB);
    dev.launch(s, k).unwrap();
    dev.fail_event_waits(true);
    let opener = open_on_next_sync(&dev, open);
    x.use_on(t, AccessKind::Read).unwrap();
    opener.join().unwrap();
    dev.fail_event_waits(false);
    assert_eq!(dev.counters().host_syncs, 1);
    assert_eq!(alloc.stats().num_host_syncs, 1, "the host wait went uncounted");
    // `t` reads what `s` wrote.
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (p, out) = (x.ptr(), got.clone());
    let acc = vec![tidepool::device::Access { ptr: p, bytes: N, kind: AccessKind::Read }];
    let read = tidepool::device::Kernel::new("read", acc, move |m| {
        let mut v = vec![0u8; N as usize];
        m.read(p, &mut v).unwrap();
        *out.lock().unwrap() = v;
    });
    dev.launch(t, read).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(*got.lock().unwrap(), vec![0xAB; N as usize]);
    // No wait at all: an error, and nothing recorded.
    let y = alloc.alloc(N, s).unwrap();
    dev.fail_event_waits(true);
    dev.fail_host_syncs(true);
    assert!(matches!(y.use_on(t, AccessKind::Write), Err(tidepool::AllocError::Device(_))));
    dev.fail_event_waits(false);
    dev.fail_host_syncs(false);
    // Neither refused host wait kept the host waiting: none is counted (broken build
    // `refused_syncs_counted`: 3). (The device's second is the test's own.)
    assert_eq!((alloc.stats().num_host_syncs, dev.counters().host_syncs), (1, 2));
    let (records, py) = (dev.counters().event_records, y.ptr());
    drop(y);
    assert_eq!(dev.counters().event_records, records, "the refused use was recorded");
    assert_eq!(alloc.alloc(N, s).unwrap().ptr(), py);
    drop(x);
    assert_all_returned(&dev, alloc);
}

/// During a capture on `t`, a buffer written on `s` announced for `t`: the device refuses `t`'s
/// wait for `s` (capture isolation), and the fallback host waits too (a capture allows none),
/// so `use_on` fails — with no host sync counted, since the host never waited (broken build
/// `refused_syncs_counted`: 2). Once the capture ends, the same call orders `t` on the device.
#[test]
fn a_use_refused_in_a_capture_counts_no_host_wait() {
    let (dev, alloc, s, t) = setup("");
    let x = alloc.alloc(N, s).unwrap();
    let (k, open) = common::gated_write(x.ptr(), 0xAB);
    dev.launch(s, k).unwrap();
    alloc.begin_capture(t, None).unwrap();
    let e = x.use_on(t, AccessKind::Read).unwrap_err();
    assert!(matches!(e, tidepool::AllocError::Device(_)), "{e}");
    assert_eq!((alloc.stats().num_host_syncs, dev.counters().host_syncs), (0, 0));
    drop(alloc.end_capture(t).unwrap());
    x.use_on(t, AccessKind::Read).unwrap();
    assert_eq!((alloc.stats().num_host_syncs, dev.counters().event_waits), (0, 1));
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    drop(x);
    assert_eq!(dev.violations(), vec![]);
    assert_all_returned(&dev, alloc);
}

/// What one [`cross_thread_frees`] run saw: the sanitizer's violations, the reads that saw
/// another owner's bytes, and the reads made.
struct Relay {
    violations: Vec<tidepool::device::Violation>,
    torn: usize,
    reads: usize,
}

/// Three threads, each with a stream of its own that it destroys and makes anew every 40
/// rounds. Each round a thread allocates (a small and a large size in turn) on its stream,
/// fills the buffer on it, and hands it to the next thread, which announces a read on its own
/// stream (`use_on`), enqueues the read gated (opened a few rounds later), and frees it: frees
/// on threads that did not allocate, of blocks that another stream still reads, some of them of
/// streams destroyed since. With `broken` the allocator skips the events those frees need.
/// (Each thread sends, then waits for the one buffer the thread before sent; the threads meet
/// around the destroys, their gates open: nothing waits in a cycle.)
fn cross_thread_frees(config: &str, broken: bool) -> Relay {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use tidepool::device::{Access, Kernel};
    const THREADS: usize = 3;
    let dev = Arc::new(SimDevice::backed(tidepool::GIB));
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    alloc.set_broken_skip_events(broken);
    let (torn, reads) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (txs, rxs): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<(tidepool::Buffer<SimDevice>, u8)>()).unzip();
    let barrier = std::sync::Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for (i, rx) in rxs.into_iter().enumerate() {
            let tx = txs[(i + 1) % THREADS].clone();
            let (dev, alloc, torn, reads) = (&dev, &alloc, torn.clone(), reads.clone());
            let barrier = &barrier;
            scope.spawn(move || {
                let mut me = dev.create_stream().unwrap();
                let mut gates: Vec<mpsc::Sender<()>> = Vec::new();
                for round in 0..160u32 {
                    let bytes = if round % 2 == 0 { N } else { 3 << 20 };
                    let b = alloc.alloc(bytes, me).unwrap();
                    let (p, byte) = (b.ptr(), (round as u8) ^ (i as u8 * 85));
                    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
                    let fill = Kernel::new("fill", acc, move |m| {
                        m.write(p, &[byte; N as usize]).unwrap();
                    });
                    dev.launch(me, fill).unwrap();
                    tx.send((b, byte)).unwrap();
                    // (One from the thread before, each round: every buffer is read once.)
                    if let Ok((other, byte)) = rx.recv() {
                        other.use_on(me, AccessKind::Read).unwrap();
                        let (p, (open, gate)) = (other.ptr(), mpsc::channel::<()>());
                        let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Read }];
                        let (torn, reads) = (torn.clone(), reads.clone());
                        let read = Kernel::new("read", acc, move |m| {
                            let _ = gate.recv();
                            let mut v = vec![0u8; N as usize];
                            m.read(p, &mut v).unwrap();
                            if v.iter().any(|&x| x != byte) {
                                torn.fetch_add(1, Ordering::Relaxed);
                            }
                            reads.fetch_add(1, Ordering::Relaxed);
                        });
                        dev.launch(me, read).unwrap();
                        gates.push(open);
                        drop(other); // another thread's buffer, still read on `me`
                    }
                    if gates.len() > 6 {
                        gates.drain(..3).for_each(|g| _ = g.send(()));
                    }
                    if round % 40 == 39 {
                        // Every thread's reads are let go before any stream drains, and none
                        // is gated again until every destroy is done: the drain waits for the
                        // other streams `me` waited on, and a segment's release for the device.
                        gates.drain(..).for_each(|g| _ = g.send(()));
                        barrier.wait();
                        alloc.destroy_stream(me).unwrap();
                        me = dev.create_stream().unwrap();
                        barrier.wait();
                    }
                }
                gates.drain(..).for_each(|g| _ = g.send(()));
            });
        }
        drop(txs);
    });
    dev.synchronize().unwrap();
    let relay = Relay {
        violations: dev.violations(),
        torn: torn.load(Ordering::Relaxed),
        reads: reads.load(Ordering::Relaxed),
    };
    alloc.set_broken_skip_events(false);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_eq!(dev.live_segments(), vec![]);
    assert_eq!(dev.live_events(), 0);
    relay
}

/// [`cross_thread_frees`] under both cross-stream policies: no block is handed out while
/// another stream still reads it, every read sees its own owner's bytes, nothing is left.
#[test]
fn frees_on_other_threads_of_blocks_other_streams_read_wait_for_them() {
    for config in ["", "cross_stream:wait_event"] {
        let r = cross_thread_frees(config, false);
        assert_eq!(r.violations, vec![], "{config}");
        assert_eq!(r.torn, 0, "{config}");
        assert_eq!(r.reads, 3 * 160, "{config}");
    }
}

/// The same with the frees' events skipped (`set_broken_skip_events`): the sanitizer sees
/// blocks handed out under the gated reads.
#[test]
fn the_relay_catches_frees_that_skip_their_events() {
    let r = cross_thread_frees("", true);
    assert!(r.violations.iter().any(|v| v.op == "handout"), "not caught: {:?}", r.violations);
}
