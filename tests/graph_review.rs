//! CUDA-graph capture and private pools, probed the way users break them (a review against
//! PyTorch's `CUDACachingAllocator` and `test_cuda.py`): guards begun during a capture, errors
//! in the middle of one, graphs and buffers forgotten or outliving their allocator, captures on
//! several threads at once. Exact addresses and byte counts; the sanitizer checks every replay.

mod common;

use common::{N, Setup, device_bytes, setup};
use std::sync::Arc;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SIM_BASE};
use tidepool::{AllocError, Allocator, Config, Device, MIB, MemPool, PoolOptions, SimDevice};

const SEG: u64 = 2 * MIB; // a small-pool segment

/// A replayable kernel writing `byte` over `[p, p + N)`.
fn write_at(p: tidepool::DeviceAddr, byte: u8) -> Kernel {
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
    Kernel::replayable("write", acc, move |m| m.write(p, &[byte; N as usize]).unwrap())
}

fn allocated(p: &MemPool<SimDevice>) -> u64 {
    p.stats().blocks.allocated_bytes.all.current
}

fn reserved(p: &MemPool<SimDevice>) -> u64 {
    p.stats().blocks.reserved_bytes.all.current
}

/// A guard begun on the capturing stream during the capture (PyTorch's
/// `with torch.cuda.graph(g): with torch.cuda.use_mem_pool(pool): x = ...`). Before the fix
/// the guard, the stream's latest route, won: `x` came from the guard's pool, which no graph
/// holds, so once `x` was dropped after the capture the pool handed its block to `y` on another
/// stream, and each replay of the graph wrote over `y`. Now the capture's pool serves every
/// allocation of a captured stream and `use_pool` refuses a capturing stream.
#[test]
fn a_guard_begun_during_a_capture_does_not_take_its_allocations() {
    let Setup { dev, s, t, alloc } = setup();
    let pool2 = alloc.new_pool(PoolOptions::default()).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let guard = alloc.use_pool(&pool2, s);
    let x = alloc.alloc(N, s).unwrap(); // the graph's pool: its own segment
    let x_ptr = x.ptr();
    let pool2_during = allocated(&pool2);
    dev.launch(s, write_at(x_ptr, 1)).unwrap();
    drop(guard);
    let graph = alloc.end_capture(s).unwrap();
    drop(x); // back into the graph's pool, which only captures are given
    let guard2 = alloc.use_pool(&pool2, t).unwrap();
    let y = alloc.alloc(N, t).unwrap();
    drop(guard2);
    dev.launch(t, write_at(y.ptr(), 2)).unwrap();
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "the replay wrote over y");
    assert_eq!(device_bytes(&dev, &y), vec![2u8; N as usize]);
    assert_ne!(y.ptr(), x_ptr);
    assert_eq!(x_ptr.0, SIM_BASE, "the graph's pool's first segment");
    assert_eq!(y.ptr().0, SIM_BASE + SEG, "pool2's first segment");
    assert_eq!(pool2_during, 0);
    assert_eq!((allocated(graph.pool()), reserved(graph.pool())), (0, SEG));
    assert_eq!((allocated(&pool2), reserved(&pool2)), (N, SEG));
    assert!(alloc.use_pool(&pool2, s).is_ok(), "the capture is over");
    // The refusal itself (a fresh capture: the guard above was refused, not given).
    alloc.begin_capture(s, None).unwrap();
    let refused = alloc.use_pool(&pool2, s).map(|_| ());
    assert!(matches!(refused, Err(AllocError::Capture { .. })), "{refused:?}");
    drop(alloc.end_capture(s).unwrap());
    drop((graph, y));
    assert!(dev.violations().is_empty());
}

/// A guard that routed streams before the capture: the capture's pool serves the capturing
/// stream and a stream that joins the capture (PyTorch's `get_pool` searches
/// `captures_underway` last-in first: the capture, begun after the guard, wins on both).
/// After the capture the guard routes again.
#[test]
fn a_guard_begun_before_a_capture_yields_to_it_on_captured_streams() {
    let Setup { dev, s, t, alloc } = setup();
    let pool2 = alloc.new_pool(PoolOptions::default()).unwrap();
    let gs = alloc.use_pool(&pool2, s).unwrap();
    let gt = alloc.use_pool(&pool2, t).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let fork = dev.create_event().unwrap();
    dev.record_event(fork, s).unwrap();
    dev.wait_event(t, fork).unwrap(); // t joins the capture
    let a = alloc.alloc(N, s).unwrap();
    let b = alloc.alloc(N, t).unwrap();
    // Each stream its own segment of the graph's pool (blocks are per stream, as PyTorch's).
    assert_eq!((a.ptr().0, b.ptr().0), (SIM_BASE, SIM_BASE + SEG));
    assert_eq!(allocated(&pool2), 0);
    dev.launch(s, write_at(a.ptr(), 1)).unwrap();
    dev.launch(t, write_at(b.ptr(), 2)).unwrap();
    let join = dev.create_event().unwrap();
    dev.record_event(join, t).unwrap();
    dev.wait_event(s, join).unwrap();
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!((allocated(graph.pool()), reserved(graph.pool())), (2 * N, 2 * SEG));
    let c = alloc.alloc(N, t).unwrap(); // the guard again
    assert_eq!(c.ptr().0, SIM_BASE + 2 * SEG);
    assert_eq!((allocated(&pool2), reserved(&pool2)), (N, SEG));
    drop((a, b));
    let d = alloc.alloc(N, s).unwrap(); // pool2 (a segment for s), not the graph's freed block
    assert_eq!(d.ptr().0, SIM_BASE + 3 * SEG);
    assert_eq!((allocated(&pool2), reserved(&pool2)), (2 * N, 2 * SEG));
    drop((gs, gt));
    dev.launch(s, write_at(d.ptr(), 3)).unwrap();
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    assert_eq!(device_bytes(&dev, &d), vec![3u8; N as usize]);
    drop((c, d, graph));
}

/// A kernel on `stream`'s queue that writes `[p, p + N)` once `gate` opens: a use that is
/// still running until the test says so.
fn gated_write_at(p: tidepool::DeviceAddr) -> (Kernel, std::sync::mpsc::Sender<()>) {
    common::gated_write(p, 5)
}

/// A private pool whose last holder is a buffer used on another stream and freed during a
/// capture (of another stream, into another pool). Its last handle went before, so the free
/// drops the pool: its block waits on an event of the other stream, which no one may wait for
/// while the capture is underway. Before the fix the pool's drop left the block pending and
/// listed only free segments for its family to give back: the segment outlived the capture,
/// every `empty_cache`, the other allocators and the device's synchronisations, for good
/// (with expandable segments, its pages). Now what no wait showed complete is taken as done
/// and given back by the family after a device-wide synchronisation succeeds: here, the
/// graph's drop, which gives back its own pool too.
#[test]
fn a_pool_dropped_during_a_capture_with_a_block_in_use_elsewhere_gives_its_memory_back() {
    for conf in ["expandable_segments:false", "expandable_segments:true"] {
        let dev = Arc::new(SimDevice::backed(256 * MIB));
        let (s, t, u) = (
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
        );
        let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
        let pool = alloc.new_pool(PoolOptions::default()).unwrap();
        let guard = alloc.use_pool(&pool, t).unwrap();
        let b = alloc.alloc(3 * N, t).unwrap();
        drop(guard);
        assert_eq!((allocated(&pool), reserved(&pool)), (3 * N, SEG), "{conf}");
        drop(pool); // b holds the pool now
        let used = dev.physical_bytes() + dev.reserved_bytes();
        assert_eq!(used, SEG, "{conf}");
        b.use_on(u, AccessKind::Write).unwrap();
        let (k, gate) = gated_write_at(b.ptr());
        dev.launch(u, k).unwrap();

        alloc.begin_capture(s, None).unwrap();
        drop(b); // the pool goes: its block waits on u's work, which no one may wait for now
        let out = alloc.alloc(N, s).unwrap();
        dev.launch(s, write_at(out.ptr(), 1)).unwrap();
        let graph = alloc.end_capture(s).unwrap();
        let graph_pool = graph.pool().clone();
        assert_eq!((allocated(&graph_pool), reserved(&graph_pool)), (N, SEG), "{conf}");
        // The dropped pool's memory is still there (u's kernel writes it) ...
        assert_eq!(dev.physical_bytes() + dev.reserved_bytes(), 2 * SEG, "{conf}");
        gate.send(()).unwrap();
        graph.launch(s).unwrap();
        // ... and goes back at the next `empty_cache`, after a device synchronisation (which
        // waits for u's kernel).
        let syncs = dev.counters().host_syncs;
        alloc.empty_cache().unwrap();
        assert!(dev.counters().host_syncs > syncs, "{conf}");
        assert_eq!(dev.physical_bytes() + dev.reserved_bytes(), SEG, "{conf}: the pool's segment");
        drop((graph, graph_pool, out));
        assert_eq!(dev.physical_bytes() + dev.reserved_bytes(), 0, "{conf}");
        assert!(dev.live_segments().is_empty() && dev.physical_bytes() == 0, "{conf}");
        assert!(dev.violations().is_empty(), "{conf}: {:?}", dev.violations());
        alloc.check_invariants().unwrap();
    }
}

/// A private pool whose last handle goes during a capture while the work of its own stream
/// still uses its free memory (no event involved: a block freed on its stream is free at
/// once, ordered by the stream). The drop cannot release during the capture, so its family
/// keeps what it held; with expandable segments that list held unmaps, which the device
/// allows during a capture, and which the family tried at once: the pages were unmapped under
/// the running kernel. Now, whatever an allocator leaves during a capture is given back only
/// after a device-wide synchronisation.
#[test]
fn a_pool_dropped_during_a_capture_gives_nothing_back_under_running_work() {
    for conf in ["expandable_segments:false", "expandable_segments:true"] {
        let dev = Arc::new(SimDevice::backed(256 * MIB));
        let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
        let pool = alloc.new_pool(PoolOptions::default()).unwrap();
        let guard = alloc.use_pool(&pool, t).unwrap();
        let b = alloc.alloc(3 * N, t).unwrap();
        drop(guard);
        let (k, gate) = common::gated_write(b.ptr(), 5);
        dev.launch(t, k).unwrap(); // t's work uses b until the gate opens
        drop(b); // free at once (its own stream)
        alloc.begin_capture(s, None).unwrap();
        drop(pool); // the pool goes during the capture
        assert_eq!(dev.violations(), vec![], "{conf}: released under t's kernel");
        assert_eq!(dev.physical_bytes() + dev.reserved_bytes(), SEG, "{conf}");
        let graph = alloc.end_capture(s).unwrap();
        gate.send(()).unwrap();
        let syncs = dev.counters().host_syncs;
        alloc.empty_cache().unwrap(); // a device synchronisation, then the pool's memory
        assert!(dev.counters().host_syncs > syncs, "{conf}");
        assert_eq!(dev.physical_bytes() + dev.reserved_bytes(), 0, "{conf}");
        drop(graph);
        assert!(dev.violations().is_empty(), "{conf}: {:?}", dev.violations());
        alloc.check_invariants().unwrap();
    }
}

/// The pool's count of graphs, as PyTorch's `PrivatePool::use_count` counts the captures
/// that share a pool (`beginAllocateToPool` adds one, the graph's reset gives it back through
/// `releasePool`; when it reaches zero the pool's memory is freeable, and `empty_cache` frees
/// it). tidepool counts graphs only (a `MemPool` handle is counted apart, where PyTorch's
/// `MemPool` object holds one use): 0 → 1 while the capture is underway and while its graph
/// lives → 2 with a second graph sharing the pool → back to 0 as they go; a refused or failed
/// capture leaves it as it was. The pool's memory stays until the last graph is gone, then
/// its `empty_cache` gives it back.
#[test]
fn a_pools_graph_count_follows_its_captures_and_graphs() {
    let Setup { dev, s, t, alloc } = setup();
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    assert_eq!(pool.graphs(), 0);
    alloc.begin_capture(s, Some(&pool)).unwrap();
    assert_eq!(pool.graphs(), 1);
    // Refused: the stream is capturing, and the pool is busy (the safe call shares nothing).
    assert!(matches!(alloc.begin_capture(s, None), Err(AllocError::Capture { .. })));
    let busy = alloc.begin_capture(t, Some(&pool));
    assert!(matches!(busy, Err(AllocError::PoolBusy { .. })), "{busy:?}");
    assert_eq!(pool.graphs(), 1);
    let a = alloc.alloc(N, s).unwrap();
    assert_eq!(a.ptr().0, SIM_BASE);
    dev.launch(s, write_at(a.ptr(), 1)).unwrap();
    let g1 = alloc.end_capture(s).unwrap();
    assert_eq!(pool.graphs(), 1);
    assert!(matches!(alloc.use_pool(&pool, t), Err(AllocError::PoolBusy { .. })));
    assert!(matches!(pool.empty_cache(), Err(AllocError::PoolBusy { .. })));
    // Shared (PyTorch's `pool=`): two graphs, replayed in capture order only.
    // SAFETY: g1 and g2 are launched in the order they were captured, on one stream.
    let (g2, b) = unsafe {
        alloc.capture_sharing(s, &pool, || {
            let b = alloc.alloc(N, s).unwrap();
            dev.launch(s, write_at(b.ptr(), 2)).unwrap();
            b
        })
    }
    .unwrap();
    assert_eq!(b.ptr().0, SIM_BASE + N, "next to g1's live output");
    assert_eq!(pool.graphs(), 2);
    // A capture the device fails (a forbidden call invalidates it) gives its count back.
    // SAFETY: nothing of the failed capture is ever launched.
    unsafe { alloc.begin_capture_sharing(t, &pool).unwrap() };
    assert_eq!(pool.graphs(), 3);
    assert!(dev.synchronize().is_err()); // refused during a capture, which it invalidates
    assert!(alloc.end_capture(t).is_err());
    assert_eq!(pool.graphs(), 2);
    g1.launch(s).unwrap();
    g2.launch(s).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(common::device_bytes(&dev, &a), vec![1u8; N as usize]);
    assert_eq!(common::device_bytes(&dev, &b), vec![2u8; N as usize]);
    drop(g1);
    assert_eq!(pool.graphs(), 1);
    drop(g2);
    assert_eq!(pool.graphs(), 0);
    drop((a, b));
    assert_eq!((allocated(&pool), reserved(&pool)), (0, SEG), "kept until emptied");
    pool.empty_cache().unwrap();
    assert_eq!((allocated(&pool), reserved(&pool)), (0, 0));
    // Free again: a new capture (or a guard) may have it.
    alloc.begin_capture(s, Some(&pool)).unwrap();
    assert_eq!(pool.graphs(), 1);
    drop(alloc.end_capture(s).unwrap());
    assert_eq!(pool.graphs(), 0);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    alloc.check_invariants().unwrap();
}

/// `mem::forget` of a graph: its pool stays the graph's for good (no guard, no capture, no
/// `empty_cache` is given it, its memory never goes back), and the general blocks the graph
/// held stay pending: leaked, never reused (PyTorch's graph never reset: `releasePool` is
/// never called and the pool never becomes freeable). The rest of the allocator works on.
#[test]
fn a_forgotten_graph_keeps_its_pool_and_holds_for_good() {
    let Setup { dev, s, t, alloc } = setup();
    let input = alloc.alloc(N, s).unwrap(); // general, freed during the capture
    assert_eq!(input.ptr().0, SIM_BASE);
    alloc.begin_capture(s, None).unwrap();
    let x = alloc.alloc(N, s).unwrap();
    assert_eq!(x.ptr().0, SIM_BASE + SEG);
    dev.launch(s, write_at(x.ptr(), 1)).unwrap();
    drop(input); // held by the graph
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!(graph.held_buffers(), 1);
    let pool = graph.pool().clone();
    graph.launch(s).unwrap();
    std::mem::forget(graph);
    drop(x);
    assert_eq!(pool.graphs(), 1);
    assert!(matches!(alloc.use_pool(&pool, t), Err(AllocError::PoolBusy { .. })));
    assert!(matches!(pool.empty_cache(), Err(AllocError::PoolBusy { .. })));
    let busy = alloc.begin_capture(t, Some(&pool));
    assert!(matches!(busy, Err(AllocError::PoolBusy { .. })), "{busy:?}");
    alloc.empty_cache().unwrap();
    let st = alloc.stats();
    // The held block: no longer allocated, still active (pending), its segment kept.
    assert_eq!(st.blocks.allocated_bytes.all.current, 0);
    assert_eq!(st.blocks.active_bytes.all.current, N);
    assert_eq!(st.blocks.reserved_bytes.all.current, SEG);
    let y = alloc.alloc(N, s).unwrap(); // never the held block
    assert_eq!(y.ptr().0, SIM_BASE + N);
    dev.launch(s, write_at(y.ptr(), 2)).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    drop((y, pool));
    alloc.empty_cache().unwrap();
    // Both segments stay: the general one (its held block) and the graph's pool.
    assert_eq!(
        dev.live_segments(),
        vec![(tidepool::DeviceAddr(SIM_BASE), SEG), (tidepool::DeviceAddr(SIM_BASE + SEG), SEG)]
    );
    alloc.check_invariants().unwrap();
}
