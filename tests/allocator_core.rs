//! Whole-allocator scenarios on the SimDevice: exact addresses, byte counts and device calls.

use std::sync::Arc;
use tidepool::PoolKind;
use tidepool::SegmentInfo;
use tidepool::device::{SIM_BASE, SimDevice};
use tidepool::{AllocError, Allocator, Config, Device, DeviceAddr, Residency, StreamId};
use tidepool::{BlockState, MIB};

const S0: StreamId = StreamId::DEFAULT;

fn setup(capacity: u64) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::new(capacity));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, alloc)
}

/// Device and allocator agree: reserved bytes, live segments, invariants.
fn check(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![], "stream-order violations");
    let stats = alloc.stats();
    let live: u64 = dev.live_segments().iter().map(|s| s.1).sum();
    assert_eq!(stats.blocks.reserved_bytes.all.current, live);
    assert_eq!(dev.reserved_bytes(), live);
    assert_eq!(stats.blocks.segment.all.current, dev.live_segments().len() as u64);
}

#[test]
fn free_then_alloc_reuses_the_same_block() {
    let (dev, alloc) = setup(1 << 30);
    let a = alloc.alloc(1000, S0).unwrap();
    assert_eq!(a.ptr(), DeviceAddr(SIM_BASE));
    assert_eq!((a.len(), a.block_size(), a.stream()), (1000, 1024, S0));
    let b = alloc.alloc(3 * MIB, S0).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(SIM_BASE + 2 * MIB));
    drop(a);
    let c = alloc.alloc(600, S0).unwrap();
    assert_eq!(c.ptr(), DeviceAddr(SIM_BASE));
    assert_eq!(dev.counters().mallocs, 2);
    check(&dev, &alloc);
    let s = alloc.stats();
    assert_eq!(s.blocks.allocated_bytes.all.current, 1024 + 3 * MIB);
    assert_eq!(s.blocks.allocated_bytes.small_pool.current, 1024);
    assert_eq!(s.blocks.allocated_bytes.large_pool.current, 3 * MIB);
    assert_eq!(s.blocks.requested_bytes.all.current, 600 + 3 * MIB);
    assert_eq!(s.blocks.requested_bytes.all.peak, 1000 + 3 * MIB);
    assert_eq!(s.blocks.reserved_bytes.all.current, 22 * MIB);
    assert_eq!(s.blocks.allocation.all.allocated, 3);
    assert_eq!(s.blocks.allocation.all.freed, 1);
    assert_eq!(s.num_device_alloc, 2);
    assert_eq!(s.num_host_syncs, 0);
    drop((b, c));
}

#[test]
fn zero_bytes_is_an_empty_buffer_without_memory() {
    let (dev, alloc) = setup(1 << 30);
    let z = alloc.alloc(0, S0).unwrap();
    assert_eq!((z.ptr(), z.len(), z.block_size()), (DeviceAddr::NULL, 0, 0));
    assert!(z.is_empty());
    assert_eq!(dev.counters().mallocs, 0);
    drop(z);
    assert_eq!(alloc.stats().blocks.allocation.all.allocated, 0);
    check(&dev, &alloc);
}

#[test]
fn absurd_sizes_are_errors_and_the_allocator_keeps_working() {
    let (dev, alloc) = setup(1 << 30);
    for bytes in [u64::MAX, u64::MAX - 511, (1 << 48) + 1] {
        let e = alloc.alloc(bytes, S0).unwrap_err();
        assert_eq!(e, AllocError::InvalidSize { requested: bytes });
        assert!(e.to_string().contains("invalid allocation size"));
    }
    // Larger than the device but a valid size: an out-of-memory error, not a panic.
    let e = alloc.alloc(1 << 40, S0).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)));
    assert_eq!(dev.counters().mallocs, 0);
    let ok = alloc.alloc(512, S0).unwrap();
    assert_eq!(ok.ptr(), DeviceAddr(SIM_BASE));
    check(&dev, &alloc);
}

#[test]
fn out_of_memory_reports_a_breakdown_and_recovers() {
    let (dev, alloc) = setup(64 * MIB);
    let a = alloc.alloc(40 * MIB, S0).unwrap();
    let small = alloc.alloc(4096, S0).unwrap();
    let e = alloc.alloc(30 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(r) = &e else { panic!("{e:?}") };
    assert_eq!(r.requested, 30 * MIB);
    assert_eq!(r.rounded, 30 * MIB);
    assert_eq!(r.segment, 30 * MIB);
    assert_eq!(r.device_total, 64 * MIB);
    assert_eq!(r.device_free, 22 * MIB);
    assert_eq!(r.reserved, 42 * MIB);
    assert_eq!(r.allocated, 40 * MIB + 4096);
    assert_eq!(r.largest_free_block, 2 * MIB - 4096);
    assert_eq!(r.inactive_split, 2 * MIB - 4096);
    assert_eq!(r.free_on_other_streams, 0);
    assert_eq!(r.waiting_on_events, 0);
    assert_eq!(r.transient_reserved, 42 * MIB);
    assert_eq!(r.persistent_reserved, 0);
    let msg = e.to_string();
    assert!(msg.starts_with("tidepool ran out of device memory allocating 30.00 MiB"), "{msg}");
    assert!(msg.contains("22.00 MiB free of 64.00 MiB total"), "{msg}");
    assert!(!msg.contains('\n'), "one paragraph: {msg}");
    let s = alloc.stats();
    // The last attempt, after the ladder's wait and release, is a retry (PyTorch's
    // `alloc_block(isRetry = true)`), failed or not (`tests/pytorch_parity.rs`).
    assert_eq!((s.num_ooms, s.num_alloc_retries, s.num_sync_all_streams), (1, 1, 1));
    // Both segments hold live blocks, so the ladder released nothing.
    assert_eq!(s.num_device_free, 0);
    check(&dev, &alloc);
    drop(a);
    let b = alloc.alloc(30 * MIB, S0).unwrap();
    assert_eq!(b.len(), 30 * MIB);
    drop((b, small));
    check(&dev, &alloc);
}

#[test]
fn ladder_releases_cached_segments_and_retries() {
    let (dev, alloc) = setup(64 * MIB);
    drop(alloc.alloc(30 * MIB, S0).unwrap());
    drop(alloc.alloc(20 * MIB, S0).unwrap());
    assert_eq!(alloc.reserved_bytes(), 30 * MIB);
    // 50 MiB does not fit beside the cached 30 MiB segment: release it, retry.
    let big = alloc.alloc(50 * MIB, S0).unwrap();
    assert_eq!(big.ptr(), DeviceAddr(SIM_BASE + 30 * MIB));
    let s = alloc.stats();
    assert_eq!(
        (s.num_alloc_retries, s.num_ooms, s.num_device_free, s.num_device_alloc),
        (1, 0, 1, 2)
    );
    assert_eq!(s.num_host_syncs, 1, "cuMemFree synchronises");
    check(&dev, &alloc);
}

#[test]
fn injected_device_failures_are_survived() {
    let (dev, alloc) = setup(1 << 30);
    dev.fail_nth_malloc(Some(1));
    // One failure, then the retry succeeds.
    let a = alloc.alloc(1 << 20, S0).unwrap();
    assert_eq!(alloc.stats().num_alloc_retries, 1);
    assert_eq!(dev.counters().failed_mallocs, 1);
    dev.fail_mallocs_above(Some(16 * MIB));
    let e = alloc.alloc(100 * MIB, S0).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)));
    assert_eq!(alloc.stats().num_ooms, 1);
    check(&dev, &alloc);
    dev.fail_mallocs_above(None);
    let b = alloc.alloc(100 * MIB, S0).unwrap();
    drop((a, b));
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    check(&dev, &alloc);
}

#[test]
fn memory_limit_and_fraction_cap_reservations() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::parse("memory_limit_mb:32").unwrap()).unwrap();
    let a = alloc.alloc(30 * MIB, S0).unwrap();
    let e = alloc.alloc(3 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(r) = &e else { panic!("{e:?}") };
    assert_eq!(r.limit, Some(32 * MIB));
    assert!(e.to_string().contains("limited to 32.00 MiB"));
    drop(a);
    let frac =
        Allocator::new(dev.clone(), Config::parse("per_process_memory_fraction:0.25").unwrap())
            .unwrap();
    assert!(frac.alloc(257 * MIB, S0).is_err());
    let ok = frac.alloc(256 * MIB, S0).unwrap();
    assert_eq!(ok.block_size(), 256 * MIB);
}

#[test]
fn empty_cache_releases_only_unused_segments() {
    let (dev, alloc) = setup(1 << 30);
    let keep = alloc.alloc(512, S0).unwrap();
    drop(alloc.alloc(2 * MIB, S0).unwrap());
    // 24 MiB does not fit the cached 20 MiB segment: a third segment of its own.
    drop(alloc.alloc(24 * MIB, S0).unwrap());
    assert_eq!(dev.live_segments().len(), 3);
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(SIM_BASE), 2 * MIB)]);
    assert_eq!(alloc.stats().num_device_free, 2);
    drop(keep);
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    check(&dev, &alloc);
}

#[test]
fn persistent_segments_survive_empty_cache() {
    let (dev, alloc) = setup(1 << 30);
    let w = alloc.alloc_in(4 * MIB, S0, Residency::Persistent).unwrap();
    // 18 MiB: more than the weight segment's free tail, so a transient segment of its own.
    let t = alloc.alloc(18 * MIB, S0).unwrap();
    assert_eq!(w.ptr(), DeviceAddr(SIM_BASE));
    assert_eq!(t.ptr(), DeviceAddr(SIM_BASE + 20 * MIB));
    drop((w, t));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(SIM_BASE), 20 * MIB)]);
    assert_eq!(alloc.stats().blocks.reserved_bytes.persistent.current, 20 * MIB);
    alloc.release_persistent().unwrap();
    assert!(dev.live_segments().is_empty());
}

#[test]
fn snapshot_lists_every_block() {
    let (_dev, alloc) = setup(1 << 30);
    let _a = alloc.alloc(700, S0).unwrap();
    let b = alloc.alloc(512, S0).unwrap();
    let _c = alloc.alloc(512, S0).unwrap();
    drop(b);
    let snap = alloc.snapshot();
    assert_eq!(snap.len(), 1);
    let SegmentInfo { address, size, stream, pool, residency, blocks } = &snap[0];
    assert_eq!(
        (*address, *size, *stream, *pool, *residency),
        (DeviceAddr(SIM_BASE), 2 * MIB, S0, PoolKind::Small, Residency::Transient)
    );
    let got: Vec<(u64, u64, u64, BlockState)> =
        blocks.iter().map(|b| (b.address.0 - SIM_BASE, b.size, b.requested, b.state)).collect();
    assert_eq!(
        got,
        vec![
            (0, 1024, 700, BlockState::Allocated),
            (1024, 512, 0, BlockState::Free),
            (1536, 512, 512, BlockState::Allocated),
            (2048, 2 * MIB - 2048, 0, BlockState::Free),
        ]
    );
}

#[test]
fn stats_peaks_fragmentation_and_reset() {
    let (_dev, alloc) = setup(1 << 30);
    let a = alloc.alloc(3 * MIB, S0).unwrap();
    let b = alloc.alloc(3 * MIB, S0).unwrap();
    drop(a);
    let s = alloc.stats();
    assert_eq!(s.blocks.allocated_bytes.all.peak, 6 * MIB);
    assert_eq!(s.blocks.allocated_bytes.all.current, 3 * MIB);
    // The freed 3 MiB at the start waits in the stream's cache (counted there, not as an
    // inactive split); the 14 MiB tail is one inactive split.
    assert_eq!(s.cached_fast_bytes, 3 * MIB);
    assert_eq!(s.blocks.inactive_split_bytes.all.current, 14 * MIB);
    assert_eq!(s.blocks.inactive_split.all.current, 1);
    // 1 - 6 MiB peak requested / 20 MiB peak reserved
    assert!((s.fragmentation() - 0.7).abs() < 1e-12, "{}", s.fragmentation());
    alloc.reset_peak_stats();
    let s = alloc.stats();
    assert_eq!(s.blocks.allocated_bytes.all.peak, 3 * MIB);
    assert_eq!(s.blocks.reserved_bytes.all.peak, 20 * MIB);
    drop(b);
    // The stream caches one large block at most: `b` goes to the pool and merges with the tail.
    let s = alloc.stats();
    assert_eq!(
        (s.cached_fast_bytes, s.blocks.inactive_split_bytes.all.current),
        (3 * MIB, 17 * MIB)
    );
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().blocks.inactive_split_bytes.all.current, 0);
}

#[test]
fn memory_summary_is_a_table_of_the_stats() {
    let (_dev, alloc) = setup(1 << 30);
    let _a = alloc.alloc(3 * MIB, S0).unwrap();
    let text = alloc.memory_summary();
    assert!(text.contains("tidepool memory summary"), "{text}");
    let line = text.lines().find(|l| l.starts_with("| Allocated memory")).unwrap();
    assert_eq!(
        line.split('|').map(str::trim).collect::<Vec<_>>(),
        vec!["", "Allocated memory", "3.00 MiB", "3.00 MiB", "3.00 MiB", "0 B", ""]
    );
    let line = text.lines().find(|l| l.starts_with("| Reserved memory")).unwrap();
    assert!(line.contains("20.00 MiB"), "{line}");
    assert!(text.lines().all(|l| l.chars().count() == 89), "every line is 89 columns:\n{text}");
}

#[test]
fn record_stream_holds_the_block_until_its_events_complete() {
    let (dev, alloc) = setup(1 << 30);
    let s1 = dev.create_stream().unwrap();
    let a = alloc.alloc(4096, S0).unwrap();
    alloc.record_stream(&a, s1).unwrap();
    alloc.record_stream(&a, s1).unwrap();
    alloc.record_stream(&a, S0).unwrap();
    drop(a);
    let s = alloc.stats();
    assert_eq!(s.blocks.allocated_bytes.all.current, 0);
    assert_eq!(s.blocks.active_bytes.all.current, 4096, "pending on its event");
    assert_eq!(dev.counters().event_records, 1, "one event for the one other stream");
    alloc.check_invariants().unwrap();
    // The next allocation polls the event (complete on this device) and reuses the block.
    let b = alloc.alloc(4096, S0).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(SIM_BASE));
    assert_eq!(alloc.stats().blocks.active_bytes.all.current, 4096);
    check(&dev, &alloc);
}

#[test]
fn same_stream_hot_loop_makes_no_device_calls() {
    let (dev, alloc) = setup(1 << 30);
    drop(alloc.alloc(4096, S0).unwrap());
    let before = dev.counters();
    for _ in 0..1000 {
        let b = alloc.alloc(4096, S0).unwrap();
        assert_eq!(b.ptr(), DeviceAddr(SIM_BASE));
    }
    assert_eq!(dev.counters(), before);
    assert_eq!(alloc.stats().num_host_syncs, 0);
}

#[test]
fn another_stream_takes_a_free_segment_once_its_work_is_done() {
    let (dev, alloc) = setup(1 << 30);
    let s1 = dev.create_stream().unwrap();
    drop(alloc.alloc(4096, S0).unwrap());
    assert_eq!(alloc.stats().cached_free_bytes_per_stream, vec![(0, 2 * MIB)]);
    // Stream 0 is idle: stream 1 takes its free segment instead of reserving one.
    let b = alloc.alloc(4096, s1).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(SIM_BASE));
    assert_eq!(dev.counters().mallocs, 1);
    assert_eq!(alloc.snapshot()[0].stream, s1);
    drop(b);
    assert_eq!(alloc.stats().cached_free_bytes_per_stream, vec![(1, 2 * MIB)]);
    alloc.release_stream(s1).unwrap();
    assert!(dev.live_segments().is_empty());
    check(&dev, &alloc);
}

#[test]
fn dropping_everything_leaves_no_segment() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let w = alloc.alloc_in(1 << 20, S0, Residency::Persistent).unwrap();
    let bufs: Vec<_> = (1..20).map(|i| alloc.alloc(i * 100_000, S0).unwrap()).collect();
    drop(alloc);
    // Buffers keep the allocator alive.
    assert!(!dev.live_segments().is_empty());
    let t = std::thread::spawn(move || drop(bufs));
    t.join().unwrap();
    assert!(!dev.live_segments().is_empty());
    drop(w);
    assert!(dev.live_segments().is_empty());
    assert_eq!(dev.counters().mallocs, dev.counters().frees);
}

#[test]
fn buffers_on_streams_without_a_fast_path_keep_the_allocator_alive_too() {
    // Stream 70 sits in slot 6 of the fast-path table (`id mod 64`), stream 1 in slot 1: the
    // buffers of both hold their slots' owner handles, which must keep the allocator up.
    let dev = Arc::new(SimDevice::new(1 << 30));
    let streams: Vec<StreamId> = (0..70).map(|_| dev.create_stream().unwrap()).collect();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let far = alloc.alloc(4096, streams[69]).unwrap();
    let near = alloc.alloc(4096, streams[0]).unwrap();
    assert_eq!(streams[69].0, 70);
    drop(alloc);
    drop(near);
    // The allocator is closed (no handle left): `near`'s segment went back as it was freed,
    // `far`'s stays while `far` uses it.
    assert_eq!(dev.live_segments().len(), 1, "the segment of the buffer still in use");
    drop(far);
    assert!(dev.live_segments().is_empty());
    assert_eq!(dev.counters().mallocs, 2);
}

#[test]
fn set_config_applies_to_later_allocations() {
    let (_dev, alloc) = setup(1 << 30);
    let a = alloc.alloc(MIB + 1, S0).unwrap();
    assert_eq!(a.block_size(), MIB + 512);
    alloc.set_config(Config::parse("roundup_power2_divisions:4").unwrap()).unwrap();
    let b = alloc.alloc(MIB + 1, S0).unwrap();
    assert_eq!(b.block_size(), MIB + 256 * 1024);
    let mut bad = Config::default();
    bad.sizing.small_size = 64 * MIB;
    assert!(alloc.set_config(bad).is_err());
    assert_eq!(alloc.config().sizing.roundup_power2_divisions.for_size(1), 4);
}
