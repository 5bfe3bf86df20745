//! `graph_capture_record_stream_reuse` (PyTorch's key): within a CUDA-graph capture, a block of
//! the capture's pool that was used on a side stream (`record_stream`, `use_on`) and freed is
//! reused as soon as the device shows the block's stream ordered after those uses — the side
//! stream was joined back — instead of being held until the graph goes. Off (the default, as in
//! PyTorch), or where the device cannot tell, the graph holds it.

mod common;

use common::{replayable_read as read, replayable_write as write, wait_stream};
use std::sync::Arc;
use tidepool::device::{Access, AccessKind, Kernel, Launch};
use tidepool::hooks::Broken;
use tidepool::{
    Allocator, BlockState, Buffer, Config, Device, MIB, MemPool, PoolOptions, SimDevice, StreamId,
};

const GIB: u64 = 1 << 30;

/// A replayable kernel that declares `kind` over the whole of `b` (its body touches nothing: on
/// an unbacked device the sanitizer checks the declared accesses alone).
fn touch(b: &Buffer<SimDevice>, kind: AccessKind) -> Kernel {
    let acc = vec![Access { ptr: b.ptr(), bytes: b.len(), kind }];
    Kernel::replayable("touch", acc, |_| {})
}

/// Large-pool (allocated, active, inactive split, reserved) bytes of the allocator and its pool
/// together: PyTorch's figures are device-wide, a graph's private pool included.
fn large(alloc: &Allocator<SimDevice>, pool: &MemPool<SimDevice>) -> [u64; 4] {
    let row = |s: tidepool::MemoryStats| {
        let b = s.blocks;
        [
            b.allocated_bytes.large_pool.current,
            b.active_bytes.large_pool.current,
            b.inactive_split_bytes.large_pool.current,
            b.reserved_bytes.large_pool.current,
        ]
    };
    let (a, p) = (row(alloc.stats()), row(pool.stats()));
    std::array::from_fn(|i| a[i] + p[i])
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    /// `torch.cuda.stream(stream)`: no capture.
    Eager,
    /// `torch.cuda.graph(graph)`, the key off.
    Captured,
    /// `torch.cuda.graph(graph)` with `graph_capture_record_stream_reuse:True`.
    CapturedReuse,
}

/// The "deferred memory recycling" example of PyTorch's CUDA-graph troubleshooting guide: in a
/// capture (or not), `x1` (4 GB) is used on a side stream with `record_stream` and deleted once
/// the side stream is joined back; a 1-byte `t1`, a 4 GB `x2`, and after the capture a 1-byte
/// `t2` follow. Returns the large-pool (allocated, active, inactive split, reserved) GiB after
/// each of the five steps.
fn deferred_recycling(mode: Mode, expandable: bool) -> [[u64; 4]; 5] {
    deferred_recycling_in(mode, expandable, false)
}

fn deferred_recycling_in(mode: Mode, expandable: bool, broken: bool) -> [[u64; 4]; 5] {
    let conf = format!(
        "expandable_segments:{expandable},graph_capture_record_stream_reuse:{}",
        mode == Mode::CapturedReuse
    );
    let dev = Arc::new(SimDevice::new(16 * GIB));
    let alloc = Allocator::new(dev.clone(), Config::parse(&conf).unwrap()).unwrap();
    alloc.set_broken(Broken::HeldBlocksAllocated, broken);
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    let stream = dev.create_stream().unwrap();
    let captured = mode != Mode::Eager;
    if captured {
        alloc.begin_capture(stream, Some(&pool)).unwrap();
    }
    let side = dev.create_stream().unwrap();
    let gib = |r: [u64; 4]| r.map(|b| b / GIB * 1000 + (b % GIB) * 1000 / GIB);
    let mut rows = Vec::new();
    let x1 = alloc.alloc(4 * GIB, stream).unwrap();
    rows.push(gib(large(&alloc, &pool)));
    wait_stream(&dev, side, stream);
    x1.record_stream(side).unwrap();
    dev.launch(side, touch(&x1, AccessKind::Write)).unwrap(); // `x1.fill_(1)`
    wait_stream(&dev, stream, side);
    drop(x1);
    rows.push(gib(large(&alloc, &pool)));
    if !captured {
        // The fill had finished by `t1` in PyTorch's run (its event query found it complete).
        dev.synchronize().unwrap();
    }
    drop(alloc.alloc(1, stream).unwrap());
    rows.push(gib(large(&alloc, &pool)));
    let x2 = alloc.alloc(4 * GIB, stream).unwrap();
    rows.push(gib(large(&alloc, &pool)));
    let graph = captured.then(|| alloc.end_capture(stream).unwrap());
    drop(alloc.alloc(1, StreamId::DEFAULT).unwrap());
    rows.push(gib(large(&alloc, &pool)));
    if let Some(g) = &graph {
        g.launch(stream).unwrap();
    }
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{mode:?}: {:?}", dev.violations().first());
    drop((x2, graph));
    alloc.check_invariants().unwrap();
    rows.try_into().unwrap()
}

/// The guide's three tables, in thousandths of a GiB: PyTorch's figures, but for one: with the
/// key off, tidepool's graph holds `x1` (active, not allocated) until it goes, where PyTorch
/// frees it into the graph's pool once its events complete after the capture (active 4 GB
/// after `t2`; 8 GB here).
#[test]
fn pytorch_guide_deferred_memory_recycling() {
    const G4: u64 = 4000;
    for expandable in [false, true] {
        assert_eq!(
            deferred_recycling(Mode::Eager, expandable),
            [[G4, G4, 0, G4], [0, G4, 0, G4], [0, 0, 0, G4], [G4, G4, 0, G4], [G4, G4, 0, G4]],
            "no capture (PyTorch's figures), expandable {expandable}"
        );
        assert_eq!(
            deferred_recycling(Mode::Captured, expandable),
            [
                [G4, G4, 0, G4],
                [0, G4, 0, G4],
                [0, G4, 0, G4],
                [G4, 2 * G4, 0, 2 * G4],
                [G4, 2 * G4, 0, 2 * G4]
            ],
            "capture, key off: reserved doubles as in PyTorch, expandable {expandable}"
        );
        assert_eq!(
            deferred_recycling(Mode::CapturedReuse, expandable),
            [[G4, G4, 0, G4], [0, G4, 0, G4], [0, 0, 0, G4], [G4, G4, 0, G4], [G4, G4, 0, G4]],
            "capture with the key: x1 reused at t1, reserved stays 4 GB (PyTorch's figures), \
             expandable {expandable}"
        );
    }
}

/// The state of the block at `addr` in `pool`.
fn block_state(pool: &MemPool<SimDevice>, addr: u64) -> Option<BlockState> {
    let segs = pool.snapshot();
    let mut blocks = segs.iter().flat_map(|g| g.blocks.iter());
    blocks.find(|b| b.address.0 == addr).map(|b| b.state)
}

/// Broken mode `HeldBlocksAllocated` (tidepool's figures before): `x1`, held by the capture,
/// stays allocated where PyTorch counts it active only.
#[test]
fn a_held_block_counted_as_allocated_disagrees_with_pytorch() {
    const G4: u64 = 4000;
    let rows = deferred_recycling_in(Mode::Captured, false, true);
    assert_eq!(rows[1], [G4, G4, 0, G4], "after `del x1`: PyTorch says 0 allocated");
    let rows = deferred_recycling_in(Mode::CapturedReuse, false, true);
    assert_eq!(rows[1], [G4, G4, 0, G4]);
    assert_eq!(rows[2], [0, 0, 0, G4], "reused at t1 all the same");
}

struct Setup {
    dev: Arc<SimDevice>,
    s: StreamId,
    t: StreamId,
    alloc: Allocator<SimDevice>,
}

fn setup(reuse: bool) -> Setup {
    setup_with(&format!("graph_capture_record_stream_reuse:{reuse}"))
}

fn setup_with(conf: &str) -> Setup {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
    Setup { dev, s, t, alloc }
}

/// What one capture did with `x`, a 1 MiB block of the capture's pool written on `s`, read on
/// side stream `t` (`record_stream`) and freed: the addresses of `y`, allocated on `s` before
/// `s` waits for `t`, and of `z`, allocated after; how many buffers the graph held; and the
/// sanitizer's reports over the capture and three replays.
struct Outcome {
    x: u64,
    y: u64,
    z: u64,
    held: usize,
    violations: Vec<String>,
}

fn side_stream_use(reuse: bool, broken: bool) -> Outcome {
    let Setup { dev, s, t, alloc } = setup(reuse);
    alloc.set_broken(Broken::CaptureReuseUnordered, broken);
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let x = alloc.alloc(MIB, s).unwrap();
    dev.launch(s, write(&x, 3)).unwrap();
    wait_stream(&dev, t, s); // t joins the capture
    dev.launch(t, read(&x)).unwrap();
    x.record_stream(t).unwrap();
    let x_addr = x.ptr().0;
    drop(x); // t's read is unordered with s's later work: x waits
    // Freed, not yet reusable: pending (PyTorch's `active_pending_free`), with or without the key.
    assert_eq!(block_state(&pool, x_addr), Some(BlockState::Pending));
    let y = alloc.alloc(MIB, s).unwrap();
    dev.launch(s, write(&y, 4)).unwrap();
    wait_stream(&dev, s, t); // joined back: s's later work comes after t's read
    let z = alloc.alloc(MIB, s).unwrap();
    dev.launch(s, write(&z, 5)).unwrap();
    let (y_addr, z_addr) = (y.ptr().0, z.ptr().0);
    drop((y, z));
    let graph = alloc.end_capture(s).unwrap();
    let held = graph.held_buffers();
    for _ in 0..3 {
        graph.launch(s).unwrap();
    }
    dev.synchronize().unwrap();
    drop((graph, pool));
    let violations = dev.violations().iter().map(|v| v.op.to_string()).collect();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    Outcome { x: x_addr, y: y_addr, z: z_addr, held, violations }
}

#[test]
fn a_block_used_on_a_side_stream_is_reused_once_the_stream_is_joined_back() {
    let o = side_stream_use(true, false);
    assert_eq!(o.y, o.x + MIB, "before the join: x's block still waits, y takes the next MiB");
    assert_eq!(o.z, o.x, "after the join: z gets x's block");
    assert_eq!(o.held, 0, "nothing left for the graph to hold");
    assert!(o.violations.is_empty(), "{:?}", o.violations);
}

#[test]
fn without_the_key_the_graph_holds_the_block() {
    let o = side_stream_use(false, false);
    assert_eq!((o.y, o.z), (o.x + MIB, o.x + 2 * MIB), "x's block is never reused in the capture");
    assert_eq!(o.held, 1);
    assert!(o.violations.is_empty(), "{:?}", o.violations);
}

/// The broken mode reuses x's block before the join: `y`, handed out on `s` over memory `t`'s
/// unordered captured read touches, is caught when it is handed out and when its kernel is
/// captured (at every replay the two branches run concurrently on a GPU).
#[test]
fn reuse_without_the_devices_word_is_caught_by_the_sanitizer() {
    let o = side_stream_use(true, true);
    assert_eq!(o.y, o.x, "the broken mode handed x's block out before the join");
    assert!(
        o.violations.iter().any(|v| v.contains("unordered branch") || v.contains("not ordered")),
        "{:?}",
        o.violations
    );
}

/// The allocator that begins the capture decides, as its configuration is then: a pool made
/// before the key was turned on (its own configuration a copy without it) reuses all the same.
#[test]
fn the_capturing_allocators_setting_decides() {
    let Setup { dev, s, t, alloc } = setup(false);
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    alloc.set_config(Config::parse("graph_capture_record_stream_reuse:true").unwrap()).unwrap();
    assert!(alloc.config().graph_capture_record_stream_reuse);
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let x = alloc.alloc(MIB, s).unwrap();
    dev.launch(s, write(&x, 1)).unwrap();
    wait_stream(&dev, t, s);
    dev.launch(t, read(&x)).unwrap();
    x.record_stream(t).unwrap();
    let x_addr = x.ptr().0;
    drop(x);
    wait_stream(&dev, s, t);
    let y = alloc.alloc(MIB, s).unwrap();
    assert_eq!(y.ptr().0, x_addr);
    drop(y);
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!(graph.held_buffers(), 0);
    drop(graph);
    alloc.set_config(Config::default()).unwrap();
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let x = alloc.alloc(MIB, s).unwrap();
    wait_stream(&dev, t, s);
    dev.launch(t, read(&x)).unwrap();
    x.record_stream(t).unwrap();
    drop(x);
    wait_stream(&dev, s, t);
    let y = alloc.alloc(MIB, s).unwrap();
    assert_eq!(y.ptr().0, x_addr + MIB, "off again: held by the graph");
    drop(y);
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!(graph.held_buffers(), 1);
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations().first());
}

/// An event recorded on the side stream *before* its last use of the block does not order that
/// use: the block keeps waiting through the capture. Its end (every stream joined back by then)
/// frees it into the graph's pool.
#[test]
fn a_join_before_the_last_use_does_not_free_the_block() {
    let Setup { dev, s, t, alloc } = setup(true);
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let x = alloc.alloc(MIB, s).unwrap();
    dev.launch(s, write(&x, 1)).unwrap();
    wait_stream(&dev, t, s);
    let early = dev.create_event().unwrap();
    dev.record_event(early, t).unwrap(); // before t's read
    dev.launch(t, read(&x)).unwrap();
    x.record_stream(t).unwrap();
    let x_addr = x.ptr().0;
    drop(x);
    dev.wait_event(s, early).unwrap();
    let y = alloc.alloc(MIB, s).unwrap();
    assert_eq!(y.ptr().0, x_addr + MIB, "t's read is not ordered before s's later work");
    dev.launch(s, write(&y, 2)).unwrap();
    wait_stream(&dev, s, t);
    drop(y); // freed on s, no other use: back in the pool at once
    assert_eq!(block_state(&pool, x_addr), Some(BlockState::Pending));
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!(graph.held_buffers(), 0, "x waited to the end, and the end ordered it");
    assert_eq!(block_state(&pool, x_addr), Some(BlockState::Free));
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations().first());
    drop((graph, pool));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.reserved_bytes(), 0, "everything went back");
    alloc.check_invariants().unwrap();
}

/// Ordering through a third stream counts: `t` used the block, `u` waited on `t` after that use,
/// and `s` waited on `u`.
#[test]
fn ordering_through_another_stream_frees_the_block() {
    let Setup { dev, s, t, alloc } = setup(true);
    let u = dev.create_stream().unwrap();
    alloc.begin_capture(s, None).unwrap();
    let x = alloc.alloc(MIB, s).unwrap();
    dev.launch(s, write(&x, 1)).unwrap();
    wait_stream(&dev, t, s);
    dev.launch(t, read(&x)).unwrap();
    x.record_stream(t).unwrap();
    x.record_stream(u).unwrap(); // u joins below and never touches x: its mark is its start
    let x_addr = x.ptr().0;
    wait_stream(&dev, u, t);
    drop(x);
    wait_stream(&dev, s, u);
    let y = alloc.alloc(MIB, s).unwrap();
    assert_eq!(y.ptr().0, x_addr, "s is ordered after t's read through u");
    dev.launch(s, write(&y, 2)).unwrap();
    drop(y);
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!(graph.held_buffers(), 0);
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations().first());
}

/// A capture that fails to end (its side stream never joined back) lets go of the block that
/// was waiting; the allocator keeps working and gives everything back.
#[test]
fn a_failed_capture_lets_go_of_waiting_blocks() {
    let Setup { dev, s, t, alloc } = setup(true);
    alloc.begin_capture(s, None).unwrap();
    let x = alloc.alloc(MIB, s).unwrap();
    wait_stream(&dev, t, s);
    dev.launch(t, read(&x)).unwrap();
    x.record_stream(t).unwrap();
    drop(x);
    assert!(alloc.end_capture(s).is_err(), "t was never joined back");
    let again = alloc.alloc(MIB, s).unwrap();
    drop(again);
    dev.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(dev.reserved_bytes(), 0);
    alloc.check_invariants().unwrap();
}

/// The device's marks: a position per stream of a capture, ordered after through events
/// recorded after it (directly or through other streams); a mark orders nothing in another
/// capture or once its capture ended.
#[test]
fn the_simulators_capture_marks() {
    let dev = SimDevice::backed(16 * MIB);
    let (s, t, u) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    assert_eq!(dev.capture_mark(s), None, "not capturing");
    tidepool::Capture::begin_capture(&dev, s).unwrap();
    let m0 = dev.capture_mark(s).unwrap();
    assert_eq!((m0.stream, m0.position), (s, 0));
    assert_eq!(dev.capture_mark(t), None, "t has not joined");
    wait_stream(&dev, t, s); // s: record (1)
    let mt = dev.capture_mark(t).unwrap();
    assert_eq!((mt.capture, mt.stream, mt.position), (m0.capture, t, 0));
    let k = || Kernel::replayable("k", vec![], |_| {});
    dev.launch(t, k()).unwrap(); // t: 1
    let mt1 = dev.capture_mark(t).unwrap();
    assert_eq!(mt1.position, 1);
    assert!(dev.capture_ordered_after(t, mt1), "a stream is ordered after its own marks");
    assert!(!dev.capture_ordered_after(s, mt1), "s never waited on t");
    assert!(dev.capture_ordered_after(t, m0), "t joined after s's position 0");
    wait_stream(&dev, u, t); // t: record (2); u joins
    assert!(dev.capture_ordered_after(u, mt1));
    wait_stream(&dev, s, u); // u: record (1)
    assert!(dev.capture_ordered_after(s, mt1), "through u");
    dev.launch(t, k()).unwrap(); // t: 3
    let mt3 = dev.capture_mark(t).unwrap();
    assert!(!dev.capture_ordered_after(s, mt3), "t's later work is not ordered before s");
    wait_stream(&dev, s, t);
    assert!(dev.capture_ordered_after(s, mt3));
    let g = tidepool::Capture::end_capture(&dev, s).unwrap();
    assert!(!dev.capture_ordered_after(s, mt1), "the capture ended");
    tidepool::Capture::begin_capture(&dev, s).unwrap();
    assert_ne!(dev.capture_mark(s).unwrap().capture, m0.capture, "a new capture, a new number");
    assert!(!dev.capture_ordered_after(s, m0), "a mark of another capture");
    tidepool::Capture::end_capture(&dev, s).map(drop).unwrap();
    tidepool::Capture::destroy_graph(&dev, g).unwrap();
}

/// Two captures underway at once, each with a side stream: each reuses its own block once its
/// own side stream is joined back, and the other capture's join frees nothing of it. Then the
/// same on two threads, each running one capture, many times over.
#[test]
fn two_captures_at_once_reuse_only_their_own_blocks() {
    let Setup { dev, s, t, alloc } = setup(true);
    let (s2, t2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    alloc.begin_capture(s, None).unwrap();
    alloc.begin_capture(s2, None).unwrap();
    let (x, x2) = (alloc.alloc(MIB, s).unwrap(), alloc.alloc(MIB, s2).unwrap());
    dev.launch(s, write(&x, 1)).unwrap();
    dev.launch(s2, write(&x2, 2)).unwrap();
    wait_stream(&dev, t, s);
    wait_stream(&dev, t2, s2);
    dev.launch(t, read(&x)).unwrap();
    dev.launch(t2, read(&x2)).unwrap();
    x.record_stream(t).unwrap();
    x2.record_stream(t2).unwrap();
    let (xa, x2a) = (x.ptr().0, x2.ptr().0);
    drop((x, x2));
    wait_stream(&dev, s, t); // the first capture's join only
    let y2 = alloc.alloc(MIB, s2).unwrap();
    assert_ne!(y2.ptr().0, x2a, "the second capture's side stream is not joined back yet");
    dev.launch(s2, write(&y2, 3)).unwrap();
    let y = alloc.alloc(MIB, s).unwrap();
    assert_eq!(y.ptr().0, xa);
    dev.launch(s, write(&y, 4)).unwrap();
    wait_stream(&dev, s2, t2);
    let z2 = alloc.alloc(MIB, s2).unwrap();
    assert_eq!(z2.ptr().0, x2a);
    dev.launch(s2, write(&z2, 5)).unwrap();
    drop((y, y2, z2));
    let (g, g2) = (alloc.end_capture(s).unwrap(), alloc.end_capture(s2).unwrap());
    assert_eq!((g.held_buffers(), g2.held_buffers()), (0, 0));
    g.launch(s).unwrap();
    g2.launch(s2).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations().first());
    drop((g, g2));

    let threads: Vec<_> = [(s, t), (s2, t2)]
        .into_iter()
        .map(|(s, t)| {
            let (dev, alloc) = (dev.clone(), alloc.clone());
            std::thread::spawn(move || {
                for i in 0..50u8 {
                    alloc.begin_capture(s, None).unwrap();
                    let x = alloc.alloc(MIB, s).unwrap();
                    dev.launch(s, write(&x, i)).unwrap();
                    wait_stream(&dev, t, s);
                    dev.launch(t, read(&x)).unwrap();
                    x.record_stream(t).unwrap();
                    let xa = x.ptr().0;
                    drop(x);
                    wait_stream(&dev, s, t);
                    let y = alloc.alloc(MIB, s).unwrap();
                    assert_eq!(y.ptr().0, xa, "round {i}");
                    dev.launch(s, write(&y, i)).unwrap();
                    drop(y);
                    let g = alloc.end_capture(s).unwrap();
                    assert_eq!(g.held_buffers(), 0);
                    g.launch(s).unwrap();
                }
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations().first());
    alloc.empty_cache().unwrap();
    assert_eq!(dev.reserved_bytes(), 0);
    alloc.check_invariants().unwrap();
}

/// PyTorch's `test_graph_capture_reclaim_4_streams` (`test/test_cuda.py`, `TestMemPool`):
/// `data1` (8 floats) is read on three side streams, each with `record_stream`, and freed; s1
/// joins s2 and s3 joins s4, but s1 is not yet ordered after s3's and s4's reads: `data2` must
/// not get `data1`'s block. Once s1 joins s3, `data3` gets it. Returns (data1, data2, data3) and
/// the sanitizer's reports over the capture and three replays.
fn reclaim_4_streams(broken: bool, expandable: bool) -> ([u64; 3], Vec<String>) {
    let conf = "graph_capture_record_stream_reuse:true";
    let Setup { dev, s: s1, t: s2, alloc } =
        setup_with(&format!("{conf},expandable_segments:{expandable}"));
    alloc.set_broken(Broken::CaptureReuseUnordered, broken);
    let (s3, s4) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    alloc.begin_capture(s1, None).unwrap();
    let data1 = alloc.alloc(32, s1).unwrap();
    dev.launch(s1, touch(&data1, AccessKind::Write)).unwrap(); // torch.ones
    let sink1 = alloc.alloc(32, s1).unwrap();
    let sink3 = alloc.alloc(32, s1).unwrap();
    let mut side_bufs = Vec::new();
    for side in [s2, s3, s4] {
        wait_stream(&dev, side, s1);
        let buf = alloc.alloc(32, side).unwrap();
        dev.launch(side, touch(&data1, AccessKind::Read)).unwrap(); // torch.add(data1, k, out=buf)
        dev.launch(side, touch(&buf, AccessKind::Write)).unwrap();
        data1.record_stream(side).unwrap();
        side_bufs.push(buf);
    }
    let data1_ptr = data1.ptr().0;
    drop(data1);
    wait_stream(&dev, s1, s2); // partial joins
    dev.launch(s1, touch(&sink1, AccessKind::Write)).unwrap();
    wait_stream(&dev, s3, s4);
    dev.launch(s3, touch(&sink3, AccessKind::Write)).unwrap();
    sink3.record_stream(s3).unwrap();
    let data2 = alloc.alloc(32, s1).unwrap();
    dev.launch(s1, touch(&data2, AccessKind::Write)).unwrap();
    wait_stream(&dev, s1, s3); // the final join
    dev.launch(s1, touch(&sink3, AccessKind::Read)).unwrap(); // sink1.add_(sink3)
    dev.launch(s1, touch(&sink1, AccessKind::Write)).unwrap();
    let data3 = alloc.alloc(32, s1).unwrap();
    dev.launch(s1, touch(&data3, AccessKind::Write)).unwrap();
    let ptrs = [data1_ptr, data2.ptr().0, data3.ptr().0];
    let graph = alloc.end_capture(s1).unwrap();
    for _ in 0..3 {
        graph.launch(s1).unwrap();
    }
    dev.synchronize().unwrap();
    let violations = dev.violations().iter().map(|v| v.op.to_string()).collect();
    drop((graph, sink1, sink3, side_bufs, data2, data3));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.reserved_bytes(), 0, "everything went back");
    alloc.check_invariants().unwrap();
    (ptrs, violations)
}

#[test]
fn pytorch_reclaim_4_streams_reuses_only_after_every_branch_is_joined() {
    // As `test_cuda_expandable_segments.py` runs it again, with expandable segments.
    for expandable in [false, true] {
        let ([data1, data2, data3], violations) = reclaim_4_streams(false, expandable);
        // s1's small segment (or range) of the capture's pool: data1, sink1, sink3 (512-byte
        // blocks), data2 after them; the side streams' buffers are in segments of their own.
        assert_eq!(data2, data1 + 3 * 512, "s3's and s4's reads are not ordered before s1's");
        assert_eq!(data3, data1, "after the final join data3 gets data1's block");
        assert!(violations.is_empty(), "expandable {expandable}: {violations:?}");
    }
}

/// Broken mode `CaptureReuseUnordered`: data2 takes data1's block after the partial joins, and
/// the sanitizer sees s1's write race s3's and s4's captured reads.
#[test]
fn pytorch_reclaim_4_streams_broken_reuse_is_caught() {
    let ([data1, data2, _], violations) = reclaim_4_streams(true, false);
    assert_eq!(data2, data1);
    assert!(!violations.is_empty(), "the unordered reuse went unseen");
}

/// The start of PyTorch's shared-pool tests: the key on (and expandable segments or not), a
/// pool made first, and a capture into it begun on `s` that has allocated an 8 MiB `data`.
fn data_in_a_shared_pool(expandable: bool) -> (Setup, MemPool<SimDevice>, Buffer<SimDevice>) {
    let conf = format!("graph_capture_record_stream_reuse:true,expandable_segments:{expandable}");
    let setup = setup_with(&conf);
    let shared = setup.alloc.new_pool(PoolOptions::default()).unwrap();
    setup.alloc.begin_capture(setup.s, Some(&shared)).unwrap();
    let data = setup.alloc.alloc(8 * MIB, setup.s).unwrap();
    (setup, shared, data)
}

/// PyTorch's `test_graph_capture_reclaim_shared_pool`: g1, capturing into a shared pool, writes
/// an 8 MiB `data` on a side stream (`record_stream`), joins it back and frees `data`; g2,
/// captured next into the same pool, gets `data`'s block. (Sharing a pool between live graphs
/// is the `unsafe` `begin_capture_sharing` here; its contract, replays in capture order, holds.)
/// With and without expandable segments, as `test_cuda_expandable_segments.py` runs it again.
#[test]
fn pytorch_reclaim_shared_pool_hands_a_joined_block_to_the_next_capture() {
    reclaim_shared_pool(false);
    reclaim_shared_pool(true);
}

fn reclaim_shared_pool(expandable: bool) {
    let (Setup { dev, s: cap, t: side, alloc }, shared, data) = data_in_a_shared_pool(expandable);
    let data_ptr = data.ptr().0;
    wait_stream(&dev, side, cap);
    dev.launch(side, touch(&data, AccessKind::Write)).unwrap(); // data.add_(1.0)
    data.record_stream(side).unwrap();
    wait_stream(&dev, cap, side);
    drop(data);
    let g1 = alloc.end_capture(cap).unwrap();
    assert_eq!(g1.held_buffers(), 0, "the join ordered the side stream's use before the free");
    dev.synchronize().unwrap();
    // SAFETY: g1 and g2 are replayed below in capture order, one after the other on one stream.
    unsafe { alloc.begin_capture_sharing(cap, &shared) }.unwrap();
    let data2 = alloc.alloc(8 * MIB, cap).unwrap();
    dev.launch(cap, touch(&data2, AccessKind::Write)).unwrap(); // data2.fill_(42.0)
    let g2 = alloc.end_capture(cap).unwrap();
    assert_eq!(data2.ptr().0, data_ptr);
    for _ in 0..2 {
        g1.launch(cap).unwrap();
        g2.launch(cap).unwrap();
    }
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations().first());
    drop((data2, g1, g2, shared));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.reserved_bytes(), 0);
    alloc.check_invariants().unwrap();
}

/// PyTorch's `test_graph_capture_pre_capture_stream_use`: `data`, allocated in g1's capture
/// into a shared pool, is used on a side stream *between* captures (a kernel held by a gate:
/// PyTorch's spin-wait on a pinned flag) and freed in g2's capture. While that kernel runs the
/// block is not reused (g3 gets other memory); once it ran, an allocation outside any capture
/// makes the block free and g4 gets it. With and without expandable segments.
#[test]
fn pytorch_pre_capture_stream_use_waits_for_the_side_streams_work() {
    pre_capture_stream_use(false);
    pre_capture_stream_use(true);
}

fn pre_capture_stream_use(expandable: bool) {
    let (Setup { dev, s: cap, t: side, alloc }, shared, data) = data_in_a_shared_pool(expandable);
    let data_ptr = data.ptr().0;
    let g1 = alloc.end_capture(cap).unwrap();
    dev.synchronize().unwrap();

    let (spin, flag) = common::gated(data.ptr(), data.len(), AccessKind::Write);
    dev.launch(side, spin).unwrap();
    data.record_stream(side).unwrap();

    let capture_sharing = || {
        // SAFETY: no graph sharing `shared` is replayed in this test; nothing reads a buffer
        // after another graph's replay.
        unsafe { alloc.begin_capture_sharing(cap, &shared) }.unwrap();
    };
    capture_sharing();
    drop(data);
    let g2 = alloc.end_capture(cap).unwrap();
    let one = alloc.alloc(4, StreamId::DEFAULT).unwrap(); // torch.empty(1): events are polled
    capture_sharing();
    let not_reused = alloc.alloc(8 * MIB, cap).unwrap();
    let g3 = alloc.end_capture(cap).unwrap();
    assert_ne!(not_reused.ptr().0, data_ptr, "the side stream's kernel still runs");
    assert_eq!(not_reused.ptr().0, data_ptr + 8 * MIB, "the next 8 MiB of the pool's segment");

    flag.send(()).unwrap();
    dev.synchronize().unwrap();
    let two = alloc.alloc(4, StreamId::DEFAULT).unwrap();
    capture_sharing();
    let reused = alloc.alloc(8 * MIB, cap).unwrap();
    let g4 = alloc.end_capture(cap).unwrap();
    assert_eq!(reused.ptr().0, data_ptr);
    assert_eq!(
        [&g1, &g2, &g3, &g4].map(|g| g.held_buffers()),
        [0; 4],
        "no graph holds a buffer: data's only use outside g1's capture was waited for by event"
    );
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations().first());
    drop((one, two, not_reused, reused, g1, g2, g3, g4, shared));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.reserved_bytes(), 0);
    alloc.check_invariants().unwrap();
}

/// PyTorch's `test_graph_capture_reclaim_2_streams`: in one capture on s1, `sink1` and then
/// `data1` (8 floats); s2 forks, allocates `buf2`, reads `data1` into it and records its use;
/// `data1` is freed. Before s1 joins s2, `data2` must not get `data1`'s block; after the join
/// (and a kernel on s1), `data3` does.
#[test]
fn pytorch_reclaim_2_streams() {
    let Setup { dev, s: s1, t: s2, alloc } = setup(true);
    alloc.begin_capture(s1, None).unwrap();
    let sink1 = alloc.alloc(32, s1).unwrap();
    let data1 = alloc.alloc(32, s1).unwrap();
    let data1_ptr = data1.ptr().0;
    wait_stream(&dev, s2, s1);
    let buf2 = alloc.alloc(32, s2).unwrap();
    dev.launch(s2, touch(&data1, AccessKind::Read)).unwrap(); // torch.add(data1, 2.0, out=buf2)
    dev.launch(s2, touch(&buf2, AccessKind::Write)).unwrap();
    data1.record_stream(s2).unwrap();
    drop(data1);
    let data2 = alloc.alloc(32, s1).unwrap();
    assert_eq!(data2.ptr().0, data1_ptr + 512, "before the join: the next small block");
    wait_stream(&dev, s1, s2);
    dev.launch(s1, touch(&sink1, AccessKind::Write)).unwrap(); // sink1.fill_(1.0)
    let data3 = alloc.alloc(32, s1).unwrap();
    assert_eq!(data3.ptr().0, data1_ptr, "after the join: data1's block");
    dev.launch(s1, touch(&data3, AccessKind::Write)).unwrap();
    let graph = alloc.end_capture(s1).unwrap();
    assert_eq!(graph.held_buffers(), 0);
    graph.launch(s1).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations().first());
    drop((graph, sink1, buf2, data2, data3));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.reserved_bytes(), 0);
    alloc.check_invariants().unwrap();
}
