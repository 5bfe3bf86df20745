//! Ports of PyTorch's `test_cuda.py` tests about graphs, pools and pinned memory across
//! captures that the other parity files do not hold: `test_two_graphs`
//! (`TestCachingHostAllocatorCudaGraph`), `test_mempool_ctx_multithread` (in stream form:
//! tidepool routes per stream, PyTorch per thread), `test_graph_capture_reset_recapture`,
//! the allocator half of `test_graph_rng_after_failed_capture`,
//! `test_snapshot_include_traces_correctness` and `test_device_memory_used`.

mod common;
use common::{N, device_bytes, replayable_write};
use std::sync::{Arc, Barrier};
use tidepool::device::{Launch, SimDevice};
use tidepool::{Allocator, Config, Device, HistoryOptions, HostAllocator, MIB, PoolOptions};

fn setup() -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, alloc)
}

/// A graph captured on `s` that writes `byte` over its output, and the output.
fn capture_writing(
    dev: &SimDevice,
    alloc: &Allocator<SimDevice>,
    s: tidepool::StreamId,
    byte: u8,
) -> (tidepool::Graph<SimDevice>, tidepool::Buffer<SimDevice>) {
    alloc
        .capture(s, None, || {
            let out = alloc.alloc(N, s).unwrap();
            dev.launch(s, replayable_write(&out, byte)).unwrap();
            out
        })
        .unwrap()
}

/// `out` holds `byte` over its first N bytes, and the sanitizer saw nothing.
fn holds(dev: &SimDevice, out: &tidepool::Buffer<SimDevice>, byte: u8) {
    assert_eq!(device_bytes(dev, out)[..N as usize], [byte; N as usize][..]);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

/// `test_two_graphs`: two graphs captured into one shared pool, each allocating a pinned
/// buffer; the first's is uploaded inside the capture (`use_memory`) or not, and dropped inside
/// it (`delete_memory`) or kept. The second capture's buffer reuses the first's block exactly
/// when the first was dropped and no captured work used it: a block a capture copies from is
/// the graph's for good, and a live one is nobody else's.
#[test]
fn two_graphs_reuse_a_pinned_block_only_if_it_was_freed_unused() {
    for (use_memory, delete_memory) in [(false, false), (false, true), (true, false), (true, true)]
    {
        let (dev, alloc) = setup();
        let pinned = HostAllocator::new(dev.clone());
        let s = dev.create_stream().unwrap();
        let pool = alloc.new_pool(PoolOptions::default()).unwrap();
        alloc.begin_capture(s, Some(&pool)).unwrap();
        let mut data = pinned.alloc(32).unwrap();
        let gpu = alloc.alloc(32, s).unwrap();
        if use_memory {
            data.upload(&gpu).unwrap(); // a captured copy
        }
        let old = data.host_ptr();
        let kept = if delete_memory {
            drop(data);
            None
        } else {
            Some(data)
        };
        let graph = alloc.end_capture(s).unwrap();
        // SAFETY: the graphs are replayed in capture order only (here: never concurrently, and
        // no buffer of the first is read after the second ran).
        unsafe { alloc.begin_capture_sharing(s, &pool) }.unwrap();
        let data2 = pinned.alloc(32).unwrap();
        let new = data2.host_ptr();
        let graph2 = alloc.end_capture(s).unwrap();
        let reused = old == new;
        assert_eq!(
            reused,
            !use_memory && delete_memory,
            "use {use_memory}, delete {delete_memory}"
        );
        assert_eq!(
            pinned.stats().captured_bytes,
            if use_memory && delete_memory { 512 } else { 0 },
            "a dropped block captured work copies from is kept for good"
        );
        drop((kept, data2, gpu, graph, graph2));
        pinned.check_invariants().unwrap();
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }
}

/// `test_mempool_ctx_multithread`, in stream form: while one thread routes its stream to a pool
/// and allocates and frees 1 MiB there, another thread's 1 MiB on its own stream comes from the
/// general allocator. Two segments in all, one per allocator; the general allocator holds the
/// other thread's live 1 MiB, the pool nothing live.
#[test]
fn a_pool_routes_one_threads_stream_and_not_anothers() {
    let (dev, alloc) = setup();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    let (routed, done) = (Barrier::new(2), Barrier::new(2));
    let other = std::thread::scope(|t| {
        t.spawn(|| {
            let guard = alloc.use_pool(&pool, s1).unwrap();
            drop(alloc.alloc(MIB, s1).unwrap());
            routed.wait(); // the other thread allocates while the route stands
            done.wait();
            drop(guard);
        });
        let other = t.spawn(|| {
            routed.wait();
            let b = alloc.alloc(MIB, s2).unwrap();
            done.wait();
            b
        });
        other.join().unwrap()
    });
    let (general, in_pool) = (alloc.snapshot(), pool.snapshot());
    assert_eq!((general.len(), in_pool.len()), (1, 1));
    assert_eq!(general[0].stream, s2);
    assert_eq!(in_pool[0].stream, s1);
    assert_eq!(alloc.stats().blocks.active_bytes.all.current, MIB);
    assert_eq!(pool.stats().blocks.active_bytes.all.current, 0);
    drop(other);
    alloc.check_invariants().unwrap();
    pool.check_invariants().unwrap();
}

/// `test_graph_capture_reset_recapture`: a graph dropped while its output lives, then a new
/// capture on the same stream, launched: the first output keeps its bytes, and the second
/// capture's buffers do not overlap it.
#[test]
fn a_recapture_after_a_graph_goes_leaves_its_output_alone() {
    let (dev, alloc) = setup();
    let s = dev.create_stream().unwrap();
    let (graph, out) = capture_writing(&dev, &alloc, s, 1);
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    drop(graph); // its output lives on
    let (graph2, out2) = alloc
        .capture(s, None, || {
            let tmp = alloc.alloc(N, s).unwrap(); // freed inside: the graph's temporary
            dev.launch(s, replayable_write(&tmp, 2)).unwrap();
            drop(tmp);
            let out2 = alloc.alloc(N, s).unwrap();
            dev.launch(s, replayable_write(&out2, 3)).unwrap();
            out2
        })
        .unwrap();
    let overlaps = |a: &tidepool::Buffer<SimDevice>, b: &tidepool::Buffer<SimDevice>| {
        a.ptr().0 < b.ptr().0 + b.block_size() && b.ptr().0 < a.ptr().0 + a.block_size()
    };
    assert!(!overlaps(&out, &out2));
    for _ in 0..2 {
        graph2.launch(s).unwrap();
    }
    dev.synchronize().unwrap();
    holds(&dev, &out, 1);
    holds(&dev, &out2, 3);
    drop((out, out2, graph2));
    alloc.check_invariants().unwrap();
}

/// The allocator half of `test_graph_rng_after_failed_capture`: a capture that a forbidden call
/// invalidated ends with an error; then eager allocation works, and a new capture on the same
/// stream succeeds and replays.
#[test]
fn a_capture_after_a_failed_one_succeeds() {
    let (dev, alloc) = setup();
    let s = dev.create_stream().unwrap();
    alloc.begin_capture(s, None).unwrap();
    let during = alloc.alloc(N, s).unwrap();
    assert!(dev.synchronize().is_err(), "refused during a capture, which it invalidates");
    assert!(alloc.end_capture(s).is_err(), "the invalidated capture fails");
    drop(during);
    let eager = alloc.alloc(N, s).unwrap();
    let (graph, out) = capture_writing(&dev, &alloc, s, 9);
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    holds(&dev, &out, 9);
    drop((eager, out, graph));
    alloc.check_invariants().unwrap();
}

/// `test_snapshot_include_traces_correctness`: the snapshot's active allocated bytes are the
/// same with the history recorded and without, and the same in `snapshot()` as in the dump.
#[test]
fn snapshots_with_and_without_traces_count_the_same_bytes() {
    let active = |segs: &[tidepool::SegmentInfo]| -> u64 {
        let allocated = |b: &&tidepool::BlockInfo| b.state == tidepool::BlockState::Allocated;
        segs.iter().flat_map(|s| &s.blocks).filter(allocated).map(|b| b.size).sum()
    };
    let (_dev, alloc) = setup();
    let a = alloc.alloc(3 * MIB, tidepool::StreamId::DEFAULT).unwrap();
    let without = active(&alloc.snapshot());
    alloc.record_history(HistoryOptions::new(100));
    let b = alloc.alloc(1000, tidepool::StreamId::DEFAULT).unwrap();
    drop(b);
    let with = active(&alloc.snapshot());
    assert_eq!((without, with), (3 * MIB, 3 * MIB));
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 3 * MIB);
    drop(a);
}

/// `test_device_memory_used`: the device's used memory rises by the buffer's segment while it
/// lives, `empty_cache` leaves it, and it falls once the buffer is gone and the cache emptied.
#[test]
fn device_memory_used_follows_a_live_buffer_through_empty_cache() {
    let (dev, alloc) = setup();
    let used = |d: &SimDevice| {
        let m = d.mem_info().unwrap();
        m.total - m.free
    };
    let before = used(&dev);
    let a = alloc.alloc(128 * MIB, tidepool::StreamId::DEFAULT).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(used(&dev) - before, 128 * MIB);
    drop(a);
    alloc.empty_cache().unwrap();
    assert_eq!(used(&dev), before);
}

/// `test_mempool_no_split`: two 4 MiB allocations in a default pool share one 20 MiB segment
/// (the second split off the first's remainder), in a `no_split` pool each takes a 20 MiB
/// segment whole: more segments, one block each. Freed and asked again, a whole block serves
/// the request as it is; the pool's invariants hold. The broken build `no_split_splits` splits.
#[test]
fn a_no_split_pool_gives_each_allocation_a_whole_segment() {
    let (dev, alloc) = setup();
    let s = dev.create_stream().unwrap();
    let split = alloc.new_pool(PoolOptions::default()).unwrap();
    let whole = alloc.new_pool(PoolOptions::default().with_no_split(true)).unwrap();
    let mut live = Vec::new();
    for _ in 0..2 {
        for pool in [&split, &whole] {
            let guard = alloc.use_pool(pool, s).unwrap();
            live.push(alloc.alloc(4 * MIB, s).unwrap());
            drop(guard);
        }
    }
    let shape = |p: &tidepool::MemPool<SimDevice>| -> Vec<(u64, Vec<u64>)> {
        let segs = p.snapshot();
        segs.iter().map(|g| (g.size, g.blocks.iter().map(|b| b.size).collect())).collect()
    };
    assert_eq!(shape(&split), vec![(20 * MIB, vec![4 * MIB, 4 * MIB, 12 * MIB])]);
    assert_eq!(shape(&whole), vec![(20 * MIB, vec![20 * MIB]); 2]);
    assert_eq!(live[1].block_size(), 20 * MIB);
    assert_eq!(live[1].len(), 4 * MIB);
    let s_whole = whole.stats();
    assert_eq!(s_whole.blocks.allocated_bytes.all.current, 40 * MIB);
    assert_eq!(s_whole.blocks.requested_bytes.all.current, 8 * MIB);
    // Freed, then asked again (a smaller request too): served by a whole block, no new segment.
    let at = live[3].ptr();
    drop(live.remove(3));
    let guard = alloc.use_pool(&whole, s).unwrap();
    let again = alloc.alloc(MIB + 1, s).unwrap();
    drop(guard);
    assert_eq!((again.ptr(), again.block_size()), (at, 20 * MIB));
    assert_eq!(whole.snapshot().len(), 2);
    drop((live, again));
    split.check_invariants().unwrap();
    whole.check_invariants().unwrap();
    assert!(dev.violations().is_empty());
}

/// A `no_split` pool over expandable segments: each request takes the free block its growth
/// made whole (a run of pages may hold several), blocks never overlap, and everything goes
/// back to the device.
#[test]
fn a_no_split_pool_over_expandable_segments_stays_sound() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    dev.set_virtual_memory(true);
    let alloc =
        Allocator::new(dev.clone(), Config::parse("expandable_segments:true").unwrap()).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = alloc.new_pool(PoolOptions::default().with_no_split(true)).unwrap();
    let guard = alloc.use_pool(&pool, s).unwrap();
    let mut live: Vec<_> =
        [4 * MIB, 3 * MIB, 10 * MIB, 5 * MIB].iter().map(|&n| alloc.alloc(n, s).unwrap()).collect();
    drop(live.remove(1));
    live.push(alloc.alloc(2 * MIB, s).unwrap());
    drop(guard);
    let mut spans: Vec<(u64, u64)> =
        live.iter().map(|b| (b.ptr().0, b.ptr().0 + b.block_size())).collect();
    spans.sort_unstable();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:?}");
    assert!(live.iter().all(|b| b.block_size() >= b.len()));
    pool.check_invariants().unwrap();
    drop((live, pool));
    alloc.empty_cache().unwrap();
    assert!(dev.live_mappings().is_empty());
    assert!(dev.violations().is_empty());
}
