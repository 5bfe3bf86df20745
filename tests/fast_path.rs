//! The lock-light front: per-stream caches that skip the global lock, their bounds and flushes,
//! exact statistics (peaks included) read without a lock, `global_lock` mode, and configuration
//! swaps racing allocations. Exact counts; no timing.

use std::sync::{Arc, Barrier};
use tidepool::PoolKind;
use tidepool::device::{SIM_BASE, SimDevice};
use tidepool::{Allocator, Buffer, Config, Device, DeviceAddr, MemoryStats, StreamId};
use tidepool::{BlockState, MIB};

const S0: StreamId = StreamId::DEFAULT;

fn setup(config: &str, capacity: u64) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::new(capacity));
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    (dev, alloc)
}

fn check(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn same_size_same_stream_never_takes_the_global_lock() {
    let (dev, alloc) = setup("", 1 << 30);
    drop(alloc.alloc(4096, S0).unwrap());
    let before = alloc.global_lock_acquisitions();
    // The first read publishes what the slow path (the first allocation) left unpublished.
    alloc.stats();
    assert_eq!(alloc.global_lock_acquisitions(), before + 1, "stats() publishes the slow path");
    alloc.stats();
    assert_eq!(alloc.global_lock_acquisitions(), before + 1, "once");
    for _ in 0..1000 {
        let b = alloc.alloc(4096, S0).unwrap();
        assert_eq!(b.ptr(), DeviceAddr(SIM_BASE));
    }
    let s = alloc.stats();
    assert_eq!(alloc.global_lock_acquisitions(), before + 1, "neither the pairs nor stats() lock");
    let a = s.blocks.allocation.all;
    assert_eq!((a.current, a.peak, a.allocated, a.freed), (0, 1, 1001, 1001));
    assert_eq!(s.blocks.allocated_bytes.all.peak, 4096);
    assert_eq!(s.blocks.requested_bytes.small_pool.allocated, 1001 * 4096);
    assert_eq!(s.cached_fast_bytes, 4096);
    assert_eq!(s.cached_free_bytes_per_stream, vec![(0, 2 * MIB)]);
    // The pool still sees the cached block as allocated; the invariant check accounts for it.
    check(&dev, &alloc);
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    assert_eq!(alloc.stats().cached_fast_bytes, 0);
}

#[test]
fn a_different_request_of_the_same_class_is_served_under_the_lock_once() {
    let (dev, alloc) = setup("", 1 << 30);
    drop(alloc.alloc(4096, S0).unwrap());
    let n = alloc.global_lock_acquisitions();
    let b = alloc.alloc(4000, S0).unwrap();
    assert_eq!((b.ptr(), b.block_size()), (DeviceAddr(SIM_BASE), 4096));
    assert_eq!(alloc.global_lock_acquisitions(), n + 1);
    assert_eq!(alloc.stats().blocks.requested_bytes.all.current, 4000);
    assert_eq!(alloc.global_lock_acquisitions(), n + 2, "the read publishes the locked hand-out");
    drop(b);
    let c = alloc.alloc(4000, S0).unwrap();
    assert_eq!(c.ptr(), DeviceAddr(SIM_BASE));
    assert_eq!(alloc.global_lock_acquisitions(), n + 2, "same request again: lock-free");
    check(&dev, &alloc);
}

/// The lanes round a small request with one mask where no power-of-two division applies below
/// the small bound; whether one does was asked of the small bound's own size interval only.
/// With `small_size_mb:2` the small pool spans two intervals (below 2 MiB, and 2 MiB itself),
/// and `[1:4,2:1]` divides only the first (`small_size_mb:4` and `[1:4,4:1]` alike): 9000 bytes round to 10 240 (8 KiB..16 KiB in steps
/// of 2 KiB), the mask made 9216, a class no block has, so every same-size reuse missed the
/// lanes and took the global lock. Each division count the small pool's intervals hold is
/// asked now; the hit rounds as the pool does.
#[test]
fn a_division_below_the_small_bounds_interval_keeps_the_hits() {
    for conf in [
        "small_size_mb:2,small_segment_mb:4,roundup_power2_divisions:[1:4,2:1]",
        "small_size_mb:4,small_segment_mb:4,roundup_power2_divisions:[1:4,4:1]",
    ] {
        let (dev, alloc) = setup(conf, 1 << 30);
        let a = alloc.alloc(9000, S0).unwrap();
        let (ptr, size) = (a.ptr(), a.block_size());
        assert_eq!(size, 10240, "{conf}");
        drop(a);
        let n = alloc.global_lock_acquisitions();
        for _ in 0..3 {
            let b = alloc.alloc(9000, S0).unwrap();
            assert_eq!((b.ptr(), b.block_size()), (ptr, size), "{conf}");
        }
        assert_eq!(alloc.global_lock_acquisitions(), n, "{conf}: same request again: lock-free");
        // Below 4 divisions × 512 B the granule alone rounds, in the lanes as in the pool.
        let c = alloc.alloc(1000, S0).unwrap();
        assert_eq!(c.block_size(), 1024, "{conf}");
        drop(c);
        check(&dev, &alloc);
    }
}

#[test]
fn peaks_stay_exact_when_the_slow_path_runs_between_a_free_and_a_reuse() {
    let (dev, alloc) = setup("", 1 << 30);
    let x = alloc.alloc(4096, S0).unwrap();
    drop(x); // cached: 4096 of credit under the peak of 4096
    let y = alloc.alloc(8192, S0).unwrap(); // new peak 8192: the credit is revoked
    let n = alloc.global_lock_acquisitions();
    let z = alloc.alloc(4096, S0).unwrap(); // no credit left: accounted under the lock
    assert_eq!(alloc.global_lock_acquisitions(), n + 1);
    assert_eq!(z.ptr(), DeviceAddr(SIM_BASE));
    let s = alloc.stats().blocks.allocated_bytes.all;
    assert_eq!((s.current, s.peak), (12288, 12288));
    drop((y, z));
    // Below the peak, a reuse spends credit and stays lock-free.
    let a = alloc.alloc(8192, S0).unwrap();
    let b = alloc.alloc(4096, S0).unwrap();
    let n = alloc.global_lock_acquisitions();
    drop(b);
    let c = alloc.alloc(4096, S0).unwrap();
    assert_eq!(alloc.global_lock_acquisitions(), n);
    let s = alloc.stats().blocks.allocated_bytes.all;
    assert_eq!((s.current, s.peak, s.allocated), (12288, 12288, 4096 + 8192 + 4096 + 8192 + 8192));
    drop((a, c));
    alloc.reset_peak_stats();
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.peak, 0);
    check(&dev, &alloc);
}

#[test]
fn record_stream_keeps_a_buffer_out_of_the_stream_cache() {
    let (dev, alloc) = setup("", 1 << 30);
    let s1 = dev.create_stream().unwrap();
    let a = alloc.alloc(4096, S0).unwrap();
    alloc.record_stream(&a, s1).unwrap();
    let n = alloc.global_lock_acquisitions();
    drop(a);
    assert_eq!(alloc.global_lock_acquisitions(), n + 1, "the free records an event");
    let s = alloc.stats();
    assert_eq!(s.cached_fast_bytes, 0);
    assert_eq!(s.blocks.active_bytes.all.current, 4096);
    assert_eq!(dev.counters().event_records, 1);
    check(&dev, &alloc);
}

#[test]
fn the_caches_are_bounded_per_class_and_in_bytes() {
    let (dev, alloc) = setup("fast_cache_entries:2", 1 << 30);
    let bufs: Vec<_> = (0..3).map(|_| alloc.alloc(4096, S0).unwrap()).collect();
    drop(bufs);
    assert_eq!(alloc.stats().cached_fast_bytes, 8192);
    check(&dev, &alloc);

    let (dev, alloc) = setup("fast_cache_bytes_mb:1", 1 << 30);
    let bufs: Vec<_> = (0..3).map(|_| alloc.alloc(512 * 1024, S0).unwrap()).collect();
    drop(bufs);
    assert_eq!(alloc.stats().cached_fast_bytes, MIB);
    // Large-pool blocks always go back to the pool, where they coalesce at once.
    let big = alloc.alloc(3 * MIB, S0).unwrap();
    assert_eq!(alloc.stats().cached_fast_bytes, 0, "reserving a segment flushes the caches first");
    drop(big);
    assert_eq!(alloc.stats().cached_fast_bytes, 0);
    check(&dev, &alloc);
}

/// (`locked_allocations`, `blocks.allocation.all.allocated`) now.
fn locked_and_all(alloc: &Allocator<SimDevice>) -> (u64, u64) {
    let s = alloc.stats();
    (s.locked_allocations, s.blocks.allocation.all.allocated)
}

#[test]
fn locked_allocations_count_the_requests_no_stream_cache_served() {
    let (dev, alloc) = setup("", 1 << 30);
    assert_eq!(locked_and_all(&alloc), (0, 0));
    drop(alloc.alloc(0, S0).unwrap()); // empty: neither an allocation nor the lock
    assert_eq!(locked_and_all(&alloc), (0, 0));
    drop(alloc.alloc(4096, S0).unwrap()); // the first of its class: the whole path
    assert_eq!(locked_and_all(&alloc), (1, 1));
    for _ in 0..10 {
        drop(alloc.alloc(4096, S0).unwrap()); // lock-free hits
    }
    assert_eq!(locked_and_all(&alloc), (1, 11));
    // The same class for another request: served under the lock (its requested bytes change),
    // and so is the next 4096, whose cached block last served 4000.
    drop(alloc.alloc(4000, S0).unwrap());
    assert_eq!(locked_and_all(&alloc), (2, 12));
    drop(alloc.alloc(4096, S0).unwrap());
    assert_eq!(locked_and_all(&alloc), (3, 13));
    drop(alloc.alloc(4096, S0).unwrap());
    assert_eq!(locked_and_all(&alloc), (3, 14));
    // A large block and its same-stream reuse: the whole path, then the large hit only where
    // the lock's check of it still stands (it does: nothing took the lock between).
    drop(alloc.alloc(8 * MIB, S0).unwrap());
    assert_eq!(locked_and_all(&alloc), (4, 15));
    drop(alloc.alloc(8 * MIB, S0).unwrap());
    assert_eq!(locked_and_all(&alloc), (5, 16));
    drop(alloc.alloc(8 * MIB, S0).unwrap());
    assert_eq!(locked_and_all(&alloc), (5, 17));
    // Refused attempts count (they took the lock), allocations do not: an unknown stream, and
    // a request beyond the device (the ladder's release and retry run inside one attempt).
    assert!(alloc.alloc(4096, StreamId(99)).is_err());
    assert_eq!(locked_and_all(&alloc), (6, 17));
    assert!(alloc.alloc(2 << 30, S0).is_err());
    assert_eq!(locked_and_all(&alloc), (7, 17));
    // A failure callback that asks for another attempt makes one more.
    let asked = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = asked.clone();
    alloc.set_failure_callback(move |_, _| {
        seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0
    });
    assert!(alloc.alloc(2 << 30, S0).is_err());
    assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert_eq!(locked_and_all(&alloc), (9, 17));
    // A reset of the accumulated figures restarts both counts together. (The ladder emptied
    // the lanes: the next 4096 locks, the one after hits.)
    alloc.reset_accumulated_stats();
    assert_eq!(locked_and_all(&alloc), (0, 0));
    drop(alloc.alloc(4096, S0).unwrap());
    drop(alloc.alloc(4096, S0).unwrap());
    assert_eq!(locked_and_all(&alloc), (1, 2));
    check(&dev, &alloc);
    // Without lanes, or under the global lock, every allocation counts.
    for config in ["fast_cache:false", "global_lock:true"] {
        let (dev, alloc) = setup(config, 1 << 30);
        for _ in 0..10 {
            drop(alloc.alloc(4096, S0).unwrap());
        }
        assert_eq!(locked_and_all(&alloc), (10, 10), "{config}");
        check(&dev, &alloc);
    }
}

#[test]
fn without_the_fast_cache_or_under_the_global_lock_every_operation_locks() {
    // Either way the read locks once: to publish (fast_cache:false) or to read (global_lock).
    for (config, stats_locks) in [("fast_cache:false", 1), ("global_lock:true", 1)] {
        let (dev, alloc) = setup(config, 1 << 30);
        drop(alloc.alloc(4096, S0).unwrap());
        let n = alloc.global_lock_acquisitions();
        for _ in 0..10 {
            drop(alloc.alloc(4096, S0).unwrap());
        }
        assert_eq!(alloc.global_lock_acquisitions(), n + 20, "{config}");
        let s = alloc.stats();
        assert_eq!(alloc.global_lock_acquisitions(), n + 20 + stats_locks, "{config}");
        assert_eq!(s.cached_fast_bytes, 0);
        assert_eq!(s.blocks.allocation.all.allocated, 11);
        assert_eq!(s.blocks.allocated_bytes.all.peak, 4096);
        assert_eq!(s.cached_free_bytes_per_stream, vec![(0, 2 * MIB)]);
        check(&dev, &alloc);
    }
}

#[test]
fn the_invariant_check_under_the_global_lock_sees_unpublished_statistics() {
    // Under the global lock nothing is published; the check must not compare stale copies.
    let (dev, alloc) = setup("global_lock:true", 1 << 30);
    let a = alloc.alloc(4096, S0).unwrap();
    let b = alloc.alloc(4 * MIB, S0).unwrap();
    alloc.check_invariants().unwrap();
    drop(a);
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 2 * MIB + 20 * MIB);
    drop(b);
    check(&dev, &alloc);
}

#[test]
fn switching_global_lock_at_run_time_keeps_the_statistics_exact() {
    let (dev, alloc) = setup("", 1 << 30);
    let a = alloc.alloc(4096, S0).unwrap();
    alloc.set_config(Config::parse("global_lock:true").unwrap()).unwrap();
    let b = alloc.alloc(8192, S0).unwrap();
    drop(a);
    let locked = alloc.stats();
    alloc.set_config(Config::default()).unwrap();
    let free = alloc.stats();
    assert_eq!(locked, free);
    assert_eq!(free.blocks.allocated_bytes.all.current, 8192);
    assert_eq!(free.blocks.allocated_bytes.all.peak, 12288);
    drop(b);
    assert_eq!(alloc.stats().cached_fast_bytes, 8192);
    check(&dev, &alloc);
}

#[test]
fn flushes_return_cached_blocks_to_the_pool() {
    // Memory pressure: the only segment holds a cached block; another stream needs it.
    let (dev, alloc) = setup("", 2 * MIB);
    let s1 = dev.create_stream().unwrap();
    drop(alloc.alloc(MIB, S0).unwrap());
    assert_eq!(alloc.stats().cached_fast_bytes, MIB);
    let b = alloc.alloc(MIB, s1).unwrap();
    assert_eq!((b.ptr(), dev.counters().mallocs), (DeviceAddr(SIM_BASE), 1));
    drop(b);
    check(&dev, &alloc);

    // The out-of-memory ladder: flush, then release the now empty segment, then retry.
    let (dev, alloc) = setup("", 22 * MIB);
    drop(alloc.alloc(4096, S0).unwrap());
    let big = alloc.alloc(21 * MIB, S0).unwrap();
    assert_eq!(big.block_size(), 22 * MIB);
    let s = alloc.stats();
    assert_eq!((s.num_alloc_retries, s.num_device_free, s.cached_fast_bytes), (1, 1, 0));
    drop(big);
    check(&dev, &alloc);

    // release_stream, destroy_stream, snapshot and drop.
    let (dev, alloc) = setup("", 1 << 30);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    drop(alloc.alloc(4096, a).unwrap());
    let keep = alloc.alloc(4096, b).unwrap();
    drop(alloc.alloc(8192, b).unwrap());
    alloc.release_stream(a).unwrap();
    assert_eq!(dev.live_segments().len(), 1);
    let snap = alloc.snapshot();
    assert_eq!(snap[0].blocks[1].state, BlockState::Free, "snapshot flushes first");
    alloc.destroy_stream(b).unwrap();
    assert_eq!(dev.live_segments().len(), 1, "the live buffer pins its segment");
    drop(keep); // its stream is gone: into the pool, not a closed cache
    assert_eq!(alloc.stats().cached_fast_bytes, 0);
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    check(&dev, &alloc);
    drop(alloc.alloc(4096, S0).unwrap());
    drop(alloc);
    assert!(dev.live_segments().is_empty(), "dropping the allocator flushes");
}

#[test]
fn buffers_freed_on_other_threads_go_to_their_streams_cache() {
    let (dev, alloc) = setup("", 1 << 30);
    let bufs: Vec<Buffer<SimDevice>> = (0..4).map(|_| alloc.alloc(4096, S0).unwrap()).collect();
    let n = alloc.global_lock_acquisitions();
    std::thread::spawn(move || drop(bufs)).join().unwrap();
    assert_eq!(alloc.global_lock_acquisitions(), n);
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * 4096);
    check(&dev, &alloc);
}

#[test]
fn free_batch_returns_blocks_to_the_pool_under_one_lock() {
    let (dev, alloc) = setup("", 1 << 30);
    let (a, b, c) = (
        alloc.alloc(4096, S0).unwrap(),
        alloc.alloc(4096, S0).unwrap(),
        alloc.alloc(4096, S0).unwrap(),
    );
    drop(b);
    let n = alloc.global_lock_acquisitions();
    alloc.free_batch(vec![a, c]).unwrap();
    assert_eq!(alloc.global_lock_acquisitions(), n + 1);
    let s = alloc.stats();
    assert_eq!((s.blocks.allocated_bytes.all.current, s.cached_fast_bytes), (0, 0));
    assert_eq!(s.blocks.inactive_split.all.current, 0, "everything coalesced");
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    check(&dev, &alloc);
}

#[test]
fn memory_summary_has_a_fast_cache_row_and_a_hits_row() {
    let (_dev, alloc) = setup("", 1 << 30);
    drop(alloc.alloc(4096, S0).unwrap());
    drop(alloc.alloc(4096, S0).unwrap());
    drop(alloc.alloc(4096, S0).unwrap());
    let text = alloc.memory_summary();
    let line = text.lines().find(|l| l.starts_with("| Fast-cached memory")).unwrap();
    assert!(line.contains("4.00 KiB"), "{line}");
    let line = text.lines().find(|l| l.starts_with("| Lock-free hits")).unwrap();
    assert!(line.contains("|            2 |") && line.contains("(of 3 allocations;"), "{line}");
    assert!(text.lines().all(|l| l.chars().count() == 89), "{text}");
}

/// Every snapshot taken while other threads allocate is internally consistent.
fn consistent(s: &MemoryStats) {
    let b = &s.blocks;
    for g in [b.allocated_bytes, b.active_bytes, b.requested_bytes, b.allocation, b.active] {
        for c in [g.all, g.small_pool, g.large_pool, g.persistent, g.transient] {
            assert!(c.current <= c.peak, "{c:?}");
            assert_eq!(c.allocated - c.freed, c.current, "{c:?}");
        }
        assert_eq!(g.all.current, g.small_pool.current + g.large_pool.current);
        assert_eq!(g.all.current, g.persistent.current + g.transient.current);
    }
    assert!(b.active_bytes.all.current >= b.allocated_bytes.all.current);
    assert!(b.allocated_bytes.all.current >= b.requested_bytes.all.current);
    assert_eq!(b.allocated_bytes.all.current, 4096 * b.allocation.all.current);
}

#[test]
fn statistics_read_during_allocation_are_consistent_snapshots() {
    let (dev, alloc) = setup("", 1 << 30);
    let streams = [S0, dev.create_stream().unwrap()];
    let start = Arc::new(Barrier::new(3));
    let workers: Vec<_> = streams
        .into_iter()
        .map(|s| {
            let (alloc, start) = (alloc.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut live = Vec::new();
                for i in 0..4000 {
                    if i % 3 == 2 {
                        live.clear();
                    }
                    live.push(alloc.alloc(4096, s).unwrap());
                }
            })
        })
        .collect();
    start.wait();
    for _ in 0..2000 {
        consistent(&alloc.stats());
    }
    for w in workers {
        w.join().unwrap();
    }
    let s = alloc.stats();
    consistent(&s);
    assert_eq!(s.blocks.allocation.all.allocated, 8000);
    assert_eq!(s.blocks.allocation.all.current, 0);
    check(&dev, &alloc);
}

#[test]
fn an_allocation_racing_set_config_follows_one_configuration() {
    // A: 1.5 MiB rounds to 1.5 MiB in the large pool (12 MiB segments hold eight exactly, so no
    // larger unsplit tail). B: it rounds to 2 MiB in the small pool. A mix would be 1.5 MiB in
    // the small pool or 2 MiB in the large one.
    let a = Config::parse("large_segment_mb:12").unwrap();
    let b = Config::parse("min_block_size:1048576,small_size_mb:2").unwrap();
    let (dev, alloc) = setup("large_segment_mb:12", 8 << 30);
    let bytes = 3 * MIB / 2;
    let start = Arc::new(Barrier::new(3));
    let swapper = {
        let (alloc, start, a, b) = (alloc.clone(), start.clone(), a.clone(), b.clone());
        std::thread::spawn(move || {
            start.wait();
            for i in 0..200 {
                alloc.set_config(if i % 2 == 0 { b.clone() } else { a.clone() }).unwrap();
            }
        })
    };
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (alloc, start) = (alloc.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                (0..200).map(|_| alloc.alloc(bytes, S0).unwrap()).collect::<Vec<_>>()
            })
        })
        .collect();
    swapper.join().unwrap();
    let bufs: Vec<_> = workers.into_iter().flat_map(|w| w.join().unwrap()).collect();
    for seg in alloc.snapshot() {
        for blk in seg.blocks.iter().filter(|b| b.state == BlockState::Allocated) {
            assert!(
                (blk.size, seg.pool) == (bytes, PoolKind::Large)
                    || (blk.size, seg.pool) == (2 * MIB, PoolKind::Small),
                "{} bytes in the {:?} pool",
                blk.size,
                seg.pool
            );
        }
    }
    assert_eq!(bufs.len(), 400);
    drop(bufs);
    check(&dev, &alloc);
}

#[test]
fn threads_on_one_stream_hit_their_cache_lanes_and_every_lane_is_flushed() {
    // Threads on one stream are spread over its cache lanes; whichever lanes they get, each
    // thread's pairs hit a cache without the global lock, the statistics list the stream once,
    // and `empty_cache` reaches every lane.
    let (dev, alloc) = setup("", 1 << 30);
    let step = Arc::new(Barrier::new(3));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (alloc, step) = (alloc.clone(), step.clone());
            std::thread::spawn(move || {
                let a = alloc.alloc(4096, S0).unwrap(); // both live at once: two blocks
                step.wait();
                drop(a);
                step.wait(); // the main thread reads the lock count
                step.wait();
                for _ in 0..100 {
                    drop(alloc.alloc(4096, S0).unwrap());
                }
                step.wait();
            })
        })
        .collect();
    step.wait();
    step.wait();
    let locks = alloc.global_lock_acquisitions();
    step.wait();
    step.wait();
    assert_eq!(alloc.global_lock_acquisitions(), locks, "200 pairs, no global lock");
    threads.into_iter().for_each(|t| t.join().unwrap());
    let s = alloc.stats();
    assert_eq!(s.cached_fast_bytes, 8192);
    assert_eq!(s.cached_free_bytes_per_stream, vec![(0, 2 * MIB)], "one entry per stream");
    check(&dev, &alloc);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().cached_fast_bytes, 0);
    assert!(dev.live_segments().is_empty(), "every lane was flushed");
    check(&dev, &alloc);
}

/// A block freed on another thread goes back to the lane that handed it out (its buffer's
/// owner's), so the allocating thread's next request is a hit in its own lane; the freeing
/// thread, whose lane holds nothing, is served from the stream's other lane, still without the
/// global lock. Every figure stays exact.
#[test]
fn a_cross_thread_free_returns_the_block_to_the_allocating_lane() {
    let (dev, alloc) = setup("", 1 << 30);
    let a = alloc.alloc(4096, S0).unwrap();
    let p = a.ptr();
    let n = alloc.global_lock_acquisitions();
    std::thread::spawn(move || drop(a)).join().unwrap();
    let b = alloc.alloc(4096, S0).unwrap(); // this thread's lane holds it
    assert_eq!((b.ptr(), alloc.global_lock_acquisitions()), (p, n));
    let alloc2 = alloc.clone();
    let q = std::thread::spawn(move || {
        let c = alloc2.alloc(4096, S0).unwrap(); // a new block: nothing is cached
        c.ptr()
    })
    .join()
    .unwrap();
    assert_eq!(q.0, p.0 + 4096, "the next free block of the segment");
    drop(b);
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.blocks.allocated_bytes.all.current), (8192, 0));
    assert_eq!(s.blocks.allocated_bytes.all.peak, 8192);
    check(&dev, &alloc);
}

/// A thread whose own lane of a stream is empty takes a block the stream's other lane caches
/// (here: the main thread's, which freed it there), without the global lock, and its buffer
/// then holds the thread's own lane: the free caches the block there, so the thread's next
/// pairs are hits in its own lane. (Broken mode `CrossLaneHitStays`: the buffer holds the other lane, the block
/// goes back there, and every later pair of the thread misses its lane and pops from the other
/// one — twice the instructions per pair, measured with `benches/threads.rs`.)
#[test]
fn a_block_taken_from_another_lane_moves_to_the_takers_lane() {
    use tidepool::hooks::Broken;
    for broken in [false, true] {
        let (dev, alloc) = setup("", 1 << 30);
        alloc.set_broken(Broken::CrossLaneHitStays, broken);
        let p = alloc.alloc(4096, S0).unwrap().ptr(); // freed: cached in this thread's lane
        let (lanes, mine) = alloc.lanes_cached_bytes(S0);
        let holding = |lane: usize| {
            let mut v = vec![0; lanes.len()];
            v[lane] = 4096;
            v
        };
        assert_eq!(lanes, holding(mine));
        // A thread on another lane of the stream (threads are spread over the lanes in the
        // order they first ask, across the whole process: spawn until one lands elsewhere).
        let (theirs, after) = (0..1000)
            .find_map(|_| {
                let alloc = alloc.clone();
                std::thread::spawn(move || {
                    let (_, lane) = alloc.lanes_cached_bytes(S0);
                    if lane == mine {
                        return None;
                    }
                    let n = alloc.global_lock_acquisitions();
                    let mut seen = Vec::new();
                    for _ in 0..3 {
                        let b = alloc.alloc(4096, S0).unwrap();
                        assert_eq!(b.ptr(), p, "the cached block, from either lane");
                        drop(b);
                        seen.push(alloc.lanes_cached_bytes(S0).0);
                    }
                    assert_eq!(alloc.global_lock_acquisitions(), n, "no global lock taken");
                    Some((lane, seen))
                })
                .join()
                .unwrap()
            })
            .expect("a thread on another lane");
        let lane = if broken { mine } else { theirs };
        assert_eq!(after, vec![holding(lane); 3], "the block waits in the taker's lane");
        let s = alloc.stats();
        assert_eq!((s.cached_fast_bytes, s.blocks.allocated_bytes.all.current), (4096, 0));
        assert_eq!(s.blocks.allocation.all.allocated, 4);
        check(&dev, &alloc);
        drop(alloc);
        assert!(dev.live_segments().is_empty(), "no hold left behind in a lane");
    }
}

/// A buffer handed out by a hit is small: the rare parts (a scope's tag) are boxed, so the hit
/// and the `Result` around it move 88 bytes, not 128.
#[test]
fn a_buffer_is_at_most_88_bytes() {
    assert!(std::mem::size_of::<Buffer<SimDevice>>() <= 88);
}

#[test]
fn a_block_freed_on_another_thread_is_reused_without_the_global_lock() {
    // The other thread may use another cache lane of the stream: an allocation that misses its
    // own lane looks in the stream's other lanes before taking the lock.
    let (dev, alloc) = setup("", 1 << 30);
    let a = alloc.alloc(4096, S0).unwrap();
    let p = a.ptr();
    std::thread::spawn(move || drop(a)).join().unwrap();
    let n = alloc.global_lock_acquisitions();
    let b = alloc.alloc(4096, S0).unwrap();
    assert_eq!((b.ptr(), alloc.global_lock_acquisitions()), (p, n));
    drop(b);
    assert_eq!(alloc.stats().cached_fast_bytes, 4096);
    check(&dev, &alloc);
}

/// A hit takes over the hold on the allocator that its block's last buffer left in the lane
/// (`owner.rs`): after many pairs, the holds kept in lanes never keep the allocator alive past
/// its last handle, and every segment goes back to the device.
#[test]
fn holds_kept_in_lanes_never_outlive_the_last_handle() {
    let (dev, alloc) = setup("", 1 << 30);
    for _ in 0..100 {
        drop(alloc.alloc(4096, S0).unwrap());
        drop(alloc.alloc_in(512, S0, tidepool::Residency::Persistent).unwrap());
    }
    let other = alloc.clone();
    drop(alloc);
    assert_eq!(
        dev.live_segments().len(),
        1,
        "a handle is left (both residencies share small segments)"
    );
    drop(other);
    assert!(dev.live_segments().is_empty(), "the allocator outlived its handles");
}

/// Buffers outliving the allocator, freed afterwards on this thread and on another: their
/// blocks go into lanes whose stash is closed, so each keeps its own hold, and the last one
/// lets go of the allocator.
#[test]
fn buffers_freed_after_the_last_handle_let_go_of_the_allocator() {
    let (dev, alloc) = setup("", 1 << 30);
    let a = alloc.alloc(4096, S0).unwrap();
    let b = alloc.alloc(4096, S0).unwrap();
    let c = alloc.alloc(8192, S0).unwrap();
    drop(alloc.alloc(4096, S0).unwrap()); // one hold kept in the lane
    drop(alloc);
    drop(a);
    assert_eq!(dev.live_segments().len(), 1);
    std::thread::spawn(move || drop(b)).join().unwrap();
    assert_eq!(dev.live_segments().len(), 1);
    drop(c);
    assert!(dev.live_segments().is_empty(), "the last buffer did not let go of the allocator");
}

/// A forgotten buffer leaks its block and keeps the allocator (never undefined behaviour), also
/// when its hold was one a hit took over from a lane.
#[test]
fn a_forgotten_buffer_keeps_the_allocator() {
    let (dev, alloc) = setup("", 1 << 30);
    drop(alloc.alloc(4096, S0).unwrap());
    let b = alloc.alloc(4096, S0).unwrap(); // took over the kept hold
    std::mem::forget(b);
    let c = alloc.alloc(4096, S0).unwrap();
    assert_ne!(c.ptr(), DeviceAddr(SIM_BASE), "the forgotten block stays out of the cache");
    drop(c);
    drop(alloc);
    assert_eq!(dev.live_segments().len(), 1, "the forgotten buffer keeps the allocator");
}

/// Statistics of lanes are published when read: after hits on two threads and two streams,
/// one read sees every pair, exactly, and neither the hits nor the read take the global lock.
#[test]
fn lane_statistics_are_published_when_read() {
    let (dev, alloc) = setup("", 1 << 30);
    let s1 = dev.create_stream().unwrap();
    // Both streams' segments first, both live at once (a stream short of memory flushes every
    // cache and may take over another stream's free segment, which would race the warm-up).
    let (a, b) = (alloc.alloc(4096, S0).unwrap(), alloc.alloc(4096, s1).unwrap());
    drop((a, b));
    let warm = Barrier::new(3);
    let measured = Barrier::new(3);
    let mut before = 0;
    std::thread::scope(|t| {
        for s in [S0, s1] {
            let (alloc, warm, measured) = (&alloc, &warm, &measured);
            t.spawn(move || {
                // Warm-up: each thread's own lane of its stream ends up holding the block.
                for _ in 0..3 {
                    drop(alloc.alloc(4096, s).unwrap());
                }
                warm.wait();
                measured.wait();
                for _ in 0..500 {
                    drop(alloc.alloc(4096, s).unwrap());
                }
            });
        }
        warm.wait();
        alloc.stats(); // publishes what the warm-up's slow path left
        before = alloc.global_lock_acquisitions();
        measured.wait();
    });
    let st = alloc.stats();
    let a = st.blocks.allocation.all;
    assert_eq!((a.current, a.allocated, a.freed), (0, 1008, 1008));
    assert_eq!(st.blocks.requested_bytes.all.allocated, 1008 * 4096);
    let peak = st.blocks.allocated_bytes.all.peak;
    assert!((4096..=2 * 4096).contains(&peak), "peak {peak}");
    assert_eq!(st.cached_fast_bytes, 2 * 4096);
    assert_eq!(alloc.global_lock_acquisitions(), before, "no global lock taken");
    check(&dev, &alloc);
}

/// The drop's common case is one compare of the buffer's flags byte (with the sanitizer's hooks
/// off, as on a real device). Tagging a scope's unbound buffer sets the byte, so its free still
/// goes through its scope, which learns from it: the learning run below frees its activation,
/// so the next run is planned whole (activation at the region's base, gradient above it), and
/// nothing leaks. (Broken mode `UnflaggedScopeTag`: the tag leaves the byte, the activation's
/// free goes straight to its lane, the scope never sees it, the next run falls back for the
/// gradient and the activation's segment is never given back.)
#[test]
fn a_scope_tagged_buffer_is_freed_through_its_scope() {
    // Small blocks (the drop's small case) and large ones (its large case) alike.
    for (act_bytes, grad_bytes) in [(64 * 1024, 16 * 1024), (8 * MIB, 4 * MIB)] {
        a_scope_tagged_buffer_of(act_bytes, grad_bytes);
    }
}

fn a_scope_tagged_buffer_of(act_bytes: u64, grad_bytes: u64) {
    use tidepool::SimConfig;
    use tidepool::hooks::Broken;
    let step = |alloc: &Allocator<SimDevice>| {
        let scope = alloc.named_scope("step", S0);
        let act = scope.alloc_unbound(act_bytes).unwrap();
        let grad = scope.alloc_unbound(grad_bytes).unwrap();
        let planned = (act.ptr(), act.is_planned(), grad.ptr(), grad.is_planned());
        drop(act);
        (grad, planned)
    };
    for broken in [false, true] {
        let sim = SimConfig { capacity: 1 << 30, sanitize: false, ..SimConfig::default() };
        let dev = Arc::new(SimDevice::with_config(sim));
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        alloc.set_broken(Broken::UnflaggedScopeTag, broken);
        let (grad, _) = step(&alloc);
        assert_eq!(grad.ptr(), DeviceAddr(SIM_BASE + act_bytes));
        drop(grad);
        let (grad, planned) = step(&alloc);
        let s = alloc.stats();
        let whole = (DeviceAddr(SIM_BASE), true, DeviceAddr(SIM_BASE + act_bytes), true);
        assert_eq!(planned == whole && (s.plan_hits, s.plan_fallbacks) == (2, 0), !broken);
        assert_eq!(dev.counters().mallocs, 1);
        alloc.check_invariants().unwrap();
        drop(grad);
        drop(alloc);
        assert_eq!(dev.live_segments().is_empty(), !broken, "the allocator gave everything back");
    }
}

/// A routed stream's large request never takes the large block the stream's general lane holds,
/// even with that block's verdict current: the large hit asks for routes first, as the small
/// hit does.
#[test]
fn a_routed_stream_never_takes_the_general_large_block() {
    use tidepool::PoolOptions;
    let (dev, alloc) = setup("", 1 << 30);
    let s = dev.create_stream().unwrap();
    // The block is cached, checked under the lock, then handed out again without it.
    let mut at = Vec::new();
    for _ in 0..4 {
        let b = alloc.alloc(4 * MIB, s).unwrap();
        at.push(b.ptr());
    }
    assert!(at.iter().all(|&p| p == at[0]));
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    let guard = alloc.use_pool(&pool, s).unwrap();
    let b = alloc.alloc(4 * MIB, s).unwrap();
    assert_ne!(b.ptr(), at[0], "a routed request took the general allocator's block");
    assert_eq!(pool.stats().blocks.allocated_bytes.all.current, 4 * MIB);
    drop(b);
    drop(guard);
    check(&dev, &alloc);
}

/// An allocator with the sanitizer's hooks off (as on a real device), where frees take the
/// inlined common case and a lane's only block waits in its hot entry (`class_table.rs`).
fn quiet(config: &str) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    use tidepool::SimConfig;
    let sim = SimConfig { capacity: 1 << 30, sanitize: false, ..SimConfig::default() };
    let dev = Arc::new(SimDevice::with_config(sim));
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    (dev, alloc)
}

/// The hot entry changes no outcome: blocks come back last in, first out per class, another
/// class finds nothing, the bounds hold, the statistics and the checker see the hot block, and
/// flushes take it.
#[test]
fn the_hot_block_keeps_the_lanes_order_bounds_and_figures() {
    let (dev, alloc) = quiet("");
    let at = |n: u64| DeviceAddr(SIM_BASE + n);
    let a = alloc.alloc(4096, S0).unwrap();
    let b = alloc.alloc(4096, S0).unwrap();
    let c = alloc.alloc(8192, S0).unwrap();
    assert_eq!((a.ptr(), b.ptr(), c.ptr()), (at(0), at(4096), at(8192)));
    drop(a); // the lane's only block: hot
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.blocks.allocated_bytes.all.current), (4096, 12288));
    alloc.check_invariants().unwrap();
    let n = alloc.global_lock_acquisitions();
    drop(b); // a second block: the hot one moves into its list first
    let (b2, a2) = (alloc.alloc(4096, S0).unwrap(), alloc.alloc(4096, S0).unwrap());
    assert_eq!((b2.ptr(), a2.ptr()), (at(4096), at(0)), "last in, first out");
    assert_eq!(alloc.global_lock_acquisitions(), n, "both hits lock-free");
    drop(c); // hot, of another class
    let d = alloc.alloc(4096, S0).unwrap(); // nothing of its class: the slow path
    assert_eq!(d.ptr(), at(16384));
    assert_eq!(alloc.global_lock_acquisitions(), n + 1);
    let c2 = alloc.alloc(8192, S0).unwrap();
    assert_eq!(c2.ptr(), at(8192));
    let s = alloc.stats();
    let a = s.blocks.allocation.all;
    assert_eq!((a.current, a.peak, a.allocated), (4, 4, 7));
    assert_eq!(s.blocks.allocated_bytes.all.current, 3 * 4096 + 8192);
    assert_eq!(s.cached_fast_bytes, 0);
    alloc.check_invariants().unwrap();
    drop((a2, b2, c2, d));
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty(), "a flush takes the hot block too");

    let (_dev, alloc) = quiet("fast_cache_entries:2");
    let bufs: Vec<_> = (0..3).map(|_| alloc.alloc(4096, S0).unwrap()).collect();
    drop(bufs);
    assert_eq!(alloc.stats().cached_fast_bytes, 8192, "two per class, the hot one counted");
    alloc.check_invariants().unwrap();
    let (_dev, alloc) = quiet("fast_cache_bytes_mb:1");
    let bufs: Vec<_> = (0..3).map(|_| alloc.alloc(512 * 1024, S0).unwrap()).collect();
    drop(bufs);
    assert_eq!(alloc.stats().cached_fast_bytes, MIB);
    alloc.check_invariants().unwrap();
}

/// A revocation locks the lanes only when one was granted credit since the last revocation
/// (a free marks its lane); with none marked, `upper` is exact and the peak is raised at once.
/// (Broken mode `UnmarkedCredit`: a free grants credit without the mark; the next revocation
/// skips its lane and raises the peak from an `upper` that still counts that credit.)
#[test]
fn a_revocation_sees_every_lane_granted_credit() {
    use tidepool::hooks::Broken;
    for broken in [false, true] {
        let (dev, alloc) = quiet("");
        drop(alloc.alloc(4096, S0).unwrap()); // the stream's lanes exist (and one is marked)
        alloc.set_broken(Broken::UnmarkedCredit, broken);
        let peak = |alloc: &Allocator<SimDevice>| {
            let s = alloc.stats().blocks.allocated_bytes.all;
            (s.current, s.peak)
        };
        let y = alloc.alloc(8192, S0).unwrap(); // past the peak: the marked lane is revoked
        assert_eq!(peak(&alloc), (8192, 8192));
        drop(y); // cached: 8192 of credit, the lane marked (not in the broken mode)
        let z = alloc.alloc(12288, S0).unwrap(); // past the peak again
        let (current, p) = peak(&alloc);
        assert_eq!(current, 12288);
        assert_eq!(p == 12288, !broken, "the peak stays exact: {p}");
        let w = alloc.alloc(16384, S0).unwrap(); // no lane marked since: no lane is locked
        let (current, p) = peak(&alloc);
        assert_eq!(current, 28672);
        assert_eq!(p == 28672, !broken, "the peak stays exact: {p}");
        alloc.check_invariants().unwrap();
        drop((z, w));
        drop(alloc);
        assert!(dev.live_segments().is_empty());
    }
}

/// A hot block's hit checks no credit (its own free granted it, and nothing else spent it), so
/// a credit revocation moves it into its list. (Broken mode `HotCreditKept`: it stays hot, and
/// its hit spends headroom the lane no longer holds: the current passes the peak.)
#[test]
fn a_revocation_takes_the_hot_blocks_credit_too() {
    use tidepool::hooks::Broken;
    for broken in [false, true] {
        let (dev, alloc) = quiet("");
        drop(alloc.alloc(4096, S0).unwrap()); // the stream's lanes exist from here
        alloc.set_broken(Broken::HotCreditKept, broken);
        let x = alloc.alloc(4096, S0).unwrap();
        drop(x); // hot, with 4096 of credit under the peak of 4096
        let y = alloc.alloc(8192, S0).unwrap(); // a new peak: the credit is revoked
        let n = alloc.global_lock_acquisitions();
        let z = alloc.alloc(4096, S0).unwrap();
        assert_eq!(z.ptr(), DeviceAddr(SIM_BASE));
        assert_eq!(alloc.global_lock_acquisitions() == n + 1, !broken, "no credit: under the lock");
        let s = alloc.stats().blocks.allocated_bytes.all;
        assert_eq!(s.current, 12288);
        assert_eq!(s.peak == 12288, !broken, "the peak stays exact");
        assert_eq!(alloc.check_invariants().is_ok(), !broken);
        drop((y, z));
        drop(alloc);
        assert!(dev.live_segments().is_empty());
    }
}

/// Whether lanes get biased on this machine (Linux with `membarrier`): the summary says.
fn lanes_bias_here(alloc: &Allocator<SimDevice>) -> bool {
    let summary = alloc.memory_summary();
    let on = summary.contains("biased lanes: on");
    if !on {
        assert!(summary.contains("biased lanes: off (no membarrier here)"), "{summary}");
        eprintln!("membarrier is refused here: checking that no lane is ever biased");
    }
    on
}

/// The thread that hits a lane owns it: after its first cached free the lane is biased (its
/// takes need no atomic read-modify-write). A buffer of that lane dropped on another thread
/// revokes the bias before touching the lane; the block still goes to the lane, and the owner's
/// next pair is a hit at the same address with the statistics exact. After 1024 takes of the
/// owner with no other thread's (512 pairs) the lane is biased again. With `biased_lanes:false`
/// the same run gives the same addresses and figures, and no lane is ever biased.
#[test]
fn the_hitting_thread_owns_its_lane_and_another_threads_free_revokes_the_bias() {
    for (config, want_bias) in [("", true), ("biased_lanes:false", false)] {
        let (dev, alloc) = setup(config, 1 << 30);
        let biased = want_bias && lanes_bias_here(&alloc);
        let a = alloc.alloc(4096, S0).unwrap();
        let p = a.ptr();
        let lane = alloc.lanes_cached_bytes(S0).1;
        assert_eq!(alloc.lanes_biased(S0), vec![false; 2], "{config}: no owner before a free");
        drop(a); // cached in this thread's lane: the first user claims it
        assert_eq!(alloc.lanes_biased(S0)[lane], biased, "{config}");
        let n = alloc.global_lock_acquisitions();
        let b = alloc.alloc(4096, S0).unwrap();
        assert_eq!((b.ptr(), alloc.global_lock_acquisitions()), (p, n), "{config}: a hit");
        std::thread::spawn(move || drop(b)).join().unwrap();
        assert!(!alloc.lanes_biased(S0)[lane], "{config}: another thread's take revokes it");
        assert_eq!(alloc.lanes_cached_bytes(S0).0[lane], 4096, "{config}: back in the lane");
        for i in 0..512 {
            let c = alloc.alloc(4096, S0).unwrap();
            assert_eq!(c.ptr(), p, "{config}: pair {i}");
            if i == 510 {
                assert!(!alloc.lanes_biased(S0)[lane], "{config}: a take short of 1024");
            }
        }
        assert_eq!(alloc.lanes_biased(S0)[lane], biased, "{config}: biased again");
        assert_eq!(alloc.global_lock_acquisitions(), n, "{config}: every pair a hit");
        let s = alloc.stats();
        assert_eq!(s.blocks.allocated_bytes.all.current, 0, "{config}");
        assert_eq!(s.blocks.allocated_bytes.all.peak, 4096, "{config}");
        assert_eq!((s.cached_fast_bytes, s.num_alloc_retries), (4096, 0), "{config}");
        check(&dev, &alloc);
    }
}

/// A lane whose owner thread has ended passes to the next thread that uses it: that thread's
/// first take (a hit) makes it the owner and biases the lane for it, so a pool of worker
/// threads that come and go does not leave its lanes on the compare-and-swap for good. The
/// ended owner's bias is revoked first (`thread_token.rs`: it never reads its token again).
/// The broken build `cfg(tidepool_broken = "owner_kept")` keeps the ended owner: the lane
/// stays unbiased, take after take.
#[test]
fn a_lane_whose_owner_thread_ended_passes_to_the_next_thread_that_uses_it() {
    let (dev, alloc) = setup("", 1 << 30);
    let biased = lanes_bias_here(&alloc);
    let (p, lane) = std::thread::scope(|s| {
        s.spawn(|| {
            let a = alloc.alloc(4096, S0).unwrap();
            let lane = alloc.lanes_cached_bytes(S0).1;
            let p = a.ptr();
            drop(a); // cached: this thread owns the lane
            assert_eq!(alloc.lanes_biased(S0)[lane], biased);
            (p, lane)
        })
        .join()
        .unwrap()
    });
    assert_eq!(alloc.lanes_biased(S0)[lane], biased, "the ended owner's bias stays until a take");
    let n = alloc.global_lock_acquisitions();
    // Threads take lanes round-robin (other tests' threads too): one of the next few does.
    let mut tries = 0;
    loop {
        tries += 1;
        assert!(tries <= 64, "no thread of 64 took lane {lane}");
        let took = std::thread::scope(|s| {
            s.spawn(|| {
                if tidepool::hooks::thread_lane() != lane {
                    return false;
                }
                for i in 0..600 {
                    let b = alloc.alloc(4096, S0).unwrap();
                    assert_eq!(b.ptr(), p, "pair {i}: a hit in the lane");
                    drop(b);
                    assert_eq!(alloc.lanes_biased(S0)[lane], biased, "pair {i}: biased for it");
                }
                true
            })
            .join()
            .unwrap()
        });
        if took {
            break;
        }
    }
    assert_eq!(alloc.global_lock_acquisitions(), n, "every pair a hit");
    let s = alloc.stats();
    assert_eq!(s.blocks.allocated_bytes.all.current, 0);
    assert_eq!(s.blocks.allocation.all.allocated, 601);
    assert_eq!(s.cached_fast_bytes, 4096);
    check(&dev, &alloc);
}

/// `biased_lanes` switched at run time: off revokes every bias at once (the lanes' owners then
/// take them with a CAS); on again, an owner's lane is biased after its next 1024 takes.
#[test]
fn switching_biased_lanes_at_run_time_revokes_and_restores_the_bias() {
    let (dev, alloc) = setup("", 1 << 30);
    let biased = lanes_bias_here(&alloc);
    drop(alloc.alloc(4096, S0).unwrap());
    let lane = alloc.lanes_cached_bytes(S0).1;
    assert_eq!(alloc.lanes_biased(S0)[lane], biased);
    alloc.set_config(Config::parse("biased_lanes:false").unwrap()).unwrap();
    assert_eq!(alloc.lanes_biased(S0), vec![false; 2]);
    assert!(alloc.memory_summary().contains("biased lanes: off"));
    for _ in 0..1024 {
        drop(alloc.alloc(4096, S0).unwrap());
    }
    assert_eq!(alloc.lanes_biased(S0), vec![false; 2], "off stays off");
    alloc.set_config(Config::default()).unwrap();
    for _ in 0..512 {
        drop(alloc.alloc(4096, S0).unwrap());
    }
    assert_eq!(alloc.lanes_biased(S0)[lane], biased);
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 0);
    check(&dev, &alloc);
}

/// Buffers made on one thread (which owns its lanes) are dropped on two others while it goes on
/// hitting, with the sanitizer on: every cross-thread take revokes the bias before it touches
/// the lane, so no block is handed out twice (the sanitizer and the invariant check would see
/// it), and every figure adds up at the end.
#[test]
fn cross_thread_frees_against_a_biased_owner_keep_every_block_once() {
    let (dev, alloc) = setup("", 1 << 30);
    let (tx, rx) = std::sync::mpsc::channel::<Buffer<SimDevice>>();
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let droppers: Vec<_> = (0..2)
        .map(|_| {
            let rx = rx.clone();
            std::thread::spawn(move || {
                loop {
                    let next = rx.lock().unwrap().recv();
                    match next {
                        Ok(b) => drop(b),
                        Err(_) => break,
                    }
                }
            })
        })
        .collect();
    let mut live = std::collections::HashSet::new();
    for i in 0..4000u64 {
        let size = 512 * (1 + i % 4);
        let b = alloc.alloc(size, S0).unwrap();
        let kept = alloc.alloc(size, S0).unwrap();
        assert!(live.insert(kept.ptr().0), "a block handed out twice");
        live.remove(&kept.ptr().0);
        drop(kept); // the owner's own free
        tx.send(b).unwrap(); // freed on another thread
    }
    drop(tx);
    for t in droppers {
        t.join().unwrap();
    }
    let s = alloc.stats();
    assert_eq!(s.blocks.allocated_bytes.all.current, 0);
    assert_eq!(s.blocks.allocation.all.current, 0);
    check(&dev, &alloc);
}

/// A large block's free takes its inlined case (into its stream's first lane, no global lock)
/// only where nothing else is owed: with the sanitizer's hooks off (as on a real device), a
/// plain large buffer is cached and handed out again in place, but one used on another stream
/// waits for that stream's event in the pool (a scope's unbound large buffer:
/// `a_scope_tagged_buffer_is_freed_through_its_scope`). (The deliberately broken build `--cfg tidepool_broken="large_drop"`, which sends
/// every large block down the inlined case, fails here: the buffer used on another stream is
/// cached at once, with no event, and handed out again while that stream may still use it.)
#[test]
fn a_large_free_takes_the_lane_only_when_nothing_else_is_owed() {
    let (dev, alloc) = quiet("");
    let s1 = dev.create_stream().unwrap();
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    let base = a.ptr();
    let n = alloc.global_lock_acquisitions();
    drop(a);
    assert_eq!(alloc.global_lock_acquisitions(), n, "the free takes no global lock");
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.blocks.allocated_bytes.all.current), (4 * MIB, 0));
    let b = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(b.ptr(), base, "handed out again in place");
    assert_eq!(alloc.stats().cached_fast_bytes, 0);

    // Used on s1, whose work is not done (a kernel waits for a gate): the free records an
    // event there and the block waits for it in the pool (active, not allocated, not cached),
    // so the next request of its size takes another.
    use tidepool::device::{Kernel, Launch};
    let (open, gate) = std::sync::mpsc::channel::<()>();
    dev.launch(
        s1,
        Kernel::new("gate", vec![], move |_| {
            let _ = gate.recv();
        }),
    )
    .unwrap();
    alloc.record_stream(&b, s1).unwrap();
    drop(b);
    let s = alloc.stats();
    assert_eq!(s.cached_fast_bytes, 0, "a block owed to s1's event is not cached");
    assert_eq!(s.blocks.allocated_bytes.all.current, 0);
    assert_eq!(s.blocks.active_bytes.all.current, 4 * MIB, "pending on s1's event");
    let c = alloc.alloc(4 * MIB, S0).unwrap();
    assert_ne!(c.ptr(), base, "a pending block is not handed out");
    drop(c);
    open.send(()).unwrap();
    alloc.synchronize().unwrap();
    alloc.check_invariants().unwrap();
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert!(dev.live_segments().is_empty(), "everything given back");
}

/// A lane whose credit was revoked, popped under the global lock, is *topped up* there: it is
/// granted, out of the headroom under the peaks that no lane holds, the credit its class's next
/// blocks need (whole blocks, from the one the next pop takes down), so that those pops hit
/// without the lock. Before the top-up each of them took the global lock (credit was granted by
/// frees alone). Peaks and currents stay exact after every step.
///
/// First with room: the whole class is granted. Then near the peak: only the blocks that fit
/// under it, and the pop past it is accounted under the lock, where the peak rises exactly.
/// (Broken build `top_up_past_headroom`: the grant ignores the peaks, the second part's last
/// pop hits past the peak, which then reads below the current.)
#[test]
fn a_locked_pop_tops_the_lanes_credit_up_under_the_peak() {
    // (current, peak) of the allocated bytes and of the allocation count, the requested bytes'
    // current, and the allocations that took the global lock.
    fn figures(alloc: &Allocator<SimDevice>) -> ([u64; 4], u64, u64) {
        let s = alloc.stats();
        let (b, n) = (s.blocks.allocated_bytes.all, s.blocks.allocation.all);
        assert!(b.current <= b.peak && n.current <= n.peak, "{b:?} {n:?}");
        alloc.check_invariants().unwrap();
        (
            [b.current, b.peak, n.current, n.peak],
            s.blocks.requested_bytes.all.current,
            s.locked_allocations,
        )
    }
    const K: u64 = 4096;

    // With room: a 1 MiB block the lane cannot hold (its bound is 1 MiB) goes to the pool.
    let (dev, alloc) = quiet("fast_cache_bytes_mb:1");
    let a: Vec<Buffer<SimDevice>> = (0..3).map(|_| alloc.alloc(K, S0).unwrap()).collect();
    let ptrs: Vec<DeviceAddr> = a.iter().map(|b| b.ptr()).collect();
    let m = alloc.alloc(MIB, S0).unwrap();
    assert_eq!(figures(&alloc), ([3 * K + MIB, 3 * K + MIB, 4, 4], 3 * K + MIB, 4));
    drop(a); // cached: 3 × 4096 of credit
    assert_eq!(figures(&alloc), ([MIB, 3 * K + MIB, 1, 4], MIB, 4));
    // Another class, past the peak with the lane's credit: revoked; under the peak without it.
    let e = alloc.alloc(2 * K, S0).unwrap();
    assert_eq!(figures(&alloc), ([MIB + 2 * K, 3 * K + MIB, 2, 4], MIB + 2 * K, 5));
    drop(m); // refused by the lane (12 KiB + 1 MiB > 1 MiB): into the pool, under the lock
    assert_eq!(figures(&alloc), ([2 * K, 3 * K + MIB, 1, 4], 2 * K, 5));
    // No credit: the pop takes the lock, and tops the lane up for the class's other two blocks.
    let p1 = alloc.alloc(K, S0).unwrap();
    assert_eq!(p1.ptr(), ptrs[2], "last freed, first out");
    assert_eq!(figures(&alloc), ([3 * K, 3 * K + MIB, 2, 4], 3 * K, 6));
    let p2 = alloc.alloc(K, S0).unwrap();
    assert_eq!(p2.ptr(), ptrs[1]);
    assert_eq!(figures(&alloc), ([4 * K, 3 * K + MIB, 3, 4], 4 * K, 6), "a hit: no lock");
    let p3 = alloc.alloc(K, S0).unwrap();
    assert_eq!(p3.ptr(), ptrs[0]);
    assert_eq!(figures(&alloc), ([5 * K, 3 * K + MIB, 4, 4], 5 * K, 6), "a hit: no lock");
    drop((e, p1, p2, p3));
    drop(alloc);
    assert!(dev.live_segments().is_empty());

    // Near the peak: 16 KiB live at most so far.
    let (dev, alloc) = quiet("");
    let a: Vec<Buffer<SimDevice>> = (0..3).map(|_| alloc.alloc(K, S0).unwrap()).collect();
    let ptrs: Vec<DeviceAddr> = a.iter().map(|b| b.ptr()).collect();
    let b = alloc.alloc(K, S0).unwrap();
    assert_eq!(figures(&alloc), ([4 * K, 4 * K, 4, 4], 4 * K, 4));
    drop(a); // cached: 3 × 4096 of credit
    let e = alloc.alloc(512, S0).unwrap(); // past the peak with the credit: revoked
    assert_eq!(figures(&alloc), ([K + 512, 4 * K, 2, 4], K + 512, 5));
    // The locked pop leaves 4 × 4096 − (2 × 4096 + 512) = 7680 bytes of headroom: room for the
    // next block (4096), not for the two.
    let p1 = alloc.alloc(K, S0).unwrap();
    assert_eq!(p1.ptr(), ptrs[2]);
    assert_eq!(figures(&alloc), ([2 * K + 512, 4 * K, 3, 4], 2 * K + 512, 6));
    let p2 = alloc.alloc(K, S0).unwrap();
    assert_eq!(p2.ptr(), ptrs[1]);
    assert_eq!(figures(&alloc), ([3 * K + 512, 4 * K, 4, 4], 3 * K + 512, 6), "a hit: no lock");
    // No credit left, and past the peak: under the lock, which raises the peak exactly.
    let p3 = alloc.alloc(K, S0).unwrap();
    assert_eq!(p3.ptr(), ptrs[0]);
    assert_eq!(figures(&alloc), ([4 * K + 512, 4 * K + 512, 5, 5], 4 * K + 512, 7));
    drop((b, e, p1, p2, p3));
    drop(alloc);
    assert!(dev.live_segments().is_empty());
}

/// A large-pool block handed out before a `set_config` raised `small_size` to its class, and
/// freed after, waited in its stream's first lane under that class, so the next small request
/// of the class was a hit on it: a small request served by a large-pool block (counted in the
/// large pool) where the pool places it in a small segment (found by the differential
/// harness, `switching_sizing_mixed` seed 767). It goes to the pool now.
#[test]
fn a_large_block_freed_after_small_size_grew_past_it_serves_no_small_request() {
    let (dev, alloc) = setup("", 1 << 30);
    let large = alloc.alloc(2 * MIB, S0).unwrap();
    assert_eq!(alloc.stats().blocks.allocation.large_pool.current, 1);
    let at = large.ptr();
    alloc.set_config(Config::parse("small_size_mb:2,small_segment_mb:4").unwrap()).unwrap();
    drop(large);
    small_request_served_small(&dev, &alloc, at);
}

/// A 2 MiB request under `small_size_mb:2,small_segment_mb:4` after the large block at `at`
/// (2 MiB of a 20 MiB large segment) went back: a new 4 MiB small segment serves it, beside the
/// large segment, which is wholly free again.
fn small_request_served_small(dev: &SimDevice, alloc: &Allocator<SimDevice>, at: DeviceAddr) {
    let small = alloc.alloc(2 * MIB, S0).unwrap();
    let s = alloc.stats();
    assert_eq!(
        (s.blocks.allocation.small_pool.current, s.blocks.allocation.large_pool.current),
        (1, 0)
    );
    assert_ne!(small.ptr(), at);
    assert_eq!(s.blocks.reserved_bytes.small_pool.current, 4 * MIB);
    assert_eq!(s.blocks.reserved_bytes.large_pool.current, 20 * MIB);
    assert_eq!(s.cached_fast_bytes, 0);
    let segs = alloc.snapshot();
    let large_seg = segs.iter().find(|g| g.pool == PoolKind::Large).unwrap();
    assert_eq!(large_seg.blocks.len(), 1);
    assert_eq!(large_seg.blocks[0].state, BlockState::Free);
    drop(small);
    check(dev, alloc);
}

/// The window of the test above: between the lanes taking a raised `small_size` and their
/// flush (one lock section of `set_config`), a lock-free small hit on another thread finds the
/// large block cached before the call under what is now a small class. The hit must pass it
/// over (the flush then returns it to the pool).
#[test]
fn a_small_hit_racing_set_config_takes_no_large_block() {
    // (The lock-free hit serves with the sanitizer's hooks off only.)
    let (dev, alloc) = quiet("");
    let large = alloc.alloc(2 * MIB, S0).unwrap();
    let at = large.ptr();
    drop(large);
    // Served again from the lane, which holds the block and the credit of its class after.
    let again = alloc.alloc(2 * MIB, S0).unwrap();
    assert_eq!(again.ptr(), at);
    drop(again);
    // (No `stats()` here: a read takes the lanes' credit back, and the hit would need the lock.)
    let (tx, rx) = std::sync::mpsc::channel();
    let racer = alloc.clone();
    alloc.before_next_flush(move || {
        // (Sent out whole: its drop here would wait for the lock the call holds.)
        tx.send(racer.hit_only(2 * MIB, S0)).unwrap();
    });
    alloc.set_config(Config::parse("small_size_mb:2,small_segment_mb:4").unwrap()).unwrap();
    // The hit in the window missed: the block went back to the pool with the flush.
    let hit = rx.recv().unwrap();
    assert_eq!(hit.as_ref().map(|b| b.ptr()), None, "a small hit took the large block");
    let s = alloc.stats();
    assert_eq!(s.cached_fast_bytes, 0);
    assert_eq!(s.blocks.allocation.large_pool.current, 0);
    small_request_served_small(&dev, &alloc, at);
}
