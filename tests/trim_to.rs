//! `Allocator::trim_to` (CUDA's `cudaMemPoolTrimTo`): cached memory given back until reserved
//! bytes are down to a floor, never below it — ordinary segments the largest first, then the
//! expandable ranges' free chunks from their tops — with persistent memory, live blocks and
//! blocks whose stream-ordered uses have not completed left where they are. Exact device
//! figures after every step.
//!
//! The simulated device reserves segments at rising addresses from `SIM_BASE`; an expandable
//! range spans twice the device's capacity, so the second range begins at `SIM_BASE + 2 × CAP`.
//! Pages are 2 MiB.

mod common;

use common::{assert_no_leak, consistent};
use std::sync::Arc;
use tidepool::MIB;
use tidepool::device::{AccessKind, Launch, SIM_BASE, SimDevice};
use tidepool::{Allocator, Buffer, Config, Device, DeviceAddr, PoolOptions, Residency, StreamId};

const CAP: u64 = 256 * MIB;
const P: u64 = 2 * MIB;
const S0: StreamId = StreamId::DEFAULT;

/// The allocator's segments as (offset from `SIM_BASE`, size), in MiB, by address.
fn segments(alloc: &Allocator<SimDevice>) -> Vec<(u64, u64)> {
    let mut v: Vec<_> =
        alloc.snapshot().iter().map(|s| ((s.address.0 - SIM_BASE) / MIB, s.size / MIB)).collect();
    v.sort_unstable();
    v
}

/// The device's mappings as (offset from `SIM_BASE`, size), in MiB.
fn mappings(dev: &SimDevice) -> Vec<(u64, u64)> {
    dev.live_mappings().iter().map(|&(a, n)| ((a.0 - SIM_BASE) / MIB, n / MIB)).collect()
}

/// Segments of 10 MiB (persistent), 12, 16, 20 (a 4 MiB block's), 2 (a small block's) and
/// 18 MiB (live, returned) at offsets 0, 10, 22, 38, 58 and 60 MiB; all but the last free.
fn ordinary(alloc: &Allocator<SimDevice>) -> Buffer<SimDevice> {
    // The persistent one first: made later, it would take the 20 MiB segment's free 16 MiB.
    let p = alloc.alloc_in(10 * MIB, S0, Residency::Persistent).unwrap();
    let a = alloc.alloc(12 * MIB, S0).unwrap();
    let b = alloc.alloc(16 * MIB, S0).unwrap();
    let c = alloc.alloc(4 * MIB, S0).unwrap();
    let d = alloc.alloc(1024, S0).unwrap();
    let live = alloc.alloc(18 * MIB, S0).unwrap(); // more than c's segment has left
    drop((p, a, b, c, d));
    assert_eq!(segments(alloc), vec![(0, 10), (10, 12), (22, 16), (38, 20), (58, 2), (60, 18)]);
    assert_eq!(alloc.reserved_bytes(), 78 * MIB);
    live
}

/// Device segment releases and host syncs, as the allocator's statistics and the device count
/// them (each release is one of each).
fn releases(dev: &SimDevice, alloc: &Allocator<SimDevice>) -> (u64, u64, u64, u64) {
    let (s, d) = (alloc.stats(), dev.counters());
    (s.num_device_free, s.num_host_syncs, d.frees, d.host_syncs)
}

#[test]
fn a_floor_at_or_above_reserved_releases_nothing() {
    let dev = Arc::new(SimDevice::backed(CAP));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let live = ordinary(&alloc);
    for floor in [78 * MIB, 78 * MIB + 1, u64::MAX] {
        assert_eq!(alloc.trim_to(floor).unwrap(), 0);
    }
    assert_eq!(alloc.reserved_bytes(), 78 * MIB);
    assert_eq!(releases(&dev, &alloc), (0, 0, 0, 0));
    assert_eq!(dev.counters().event_queries, 0);
    assert_eq!(dev.live_segments().len(), 6);
    alloc.check_invariants().unwrap();
    drop(live);
    drop(alloc);
    assert_no_leak(&dev);
}

/// Free transient segments of 20, 16, 12 and 2 MiB above a 10 MiB persistent one and an 18 MiB
/// live one: each trim takes the largest that keeps reserved at or above its floor, passing
/// over those that would not. Broken builds `trim_ignores_floor` (everything goes at the first
/// trim) and `trim_releases_persistent` (the persistent segment goes at the last).
#[test]
fn ordinary_segments_go_largest_first_and_never_below_the_floor() {
    let dev = Arc::new(SimDevice::backed(CAP));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let live = ordinary(&alloc);
    // 22 MiB above 56: the 20 MiB segment goes; 16 and 12 would leave 42 and 46, passed
    // over; the 2 MiB one goes: exactly 56 left.
    assert_eq!(alloc.trim_to(56 * MIB).unwrap(), 22 * MIB);
    assert_eq!(alloc.reserved_bytes(), 56 * MIB);
    assert_eq!(segments(&alloc), vec![(0, 10), (10, 12), (22, 16), (60, 18)]);
    assert_eq!(releases(&dev, &alloc), (2, 2, 2, 2));
    // 16 above 40: the 16 MiB segment, then reserved is at the floor.
    assert_eq!(alloc.trim_to(40 * MIB).unwrap(), 16 * MIB);
    assert_eq!(segments(&alloc), vec![(0, 10), (10, 12), (60, 18)]);
    assert_eq!(releases(&dev, &alloc), (3, 3, 3, 3));
    // Everything that may go: the 12 MiB segment. The persistent and the live one stay.
    assert_eq!(alloc.trim_to(0).unwrap(), 12 * MIB);
    assert_eq!(alloc.trim_to(0).unwrap(), 0);
    assert_eq!(segments(&alloc), vec![(0, 10), (60, 18)]);
    assert_eq!(releases(&dev, &alloc), (4, 4, 4, 4));
    assert_eq!(alloc.stats().num_sync_all_streams, 0);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.persistent.current, 10 * MIB);
    assert_eq!(s.blocks.allocated_bytes.all.current, 18 * MIB);
    assert_eq!(live.ptr(), DeviceAddr(SIM_BASE + 60 * MIB));
    alloc.check_invariants().unwrap();
    // The allocator goes on: a new request reserves anew, the live block is written.
    let again = alloc.alloc(12 * MIB, S0).unwrap();
    assert_eq!(alloc.reserved_bytes(), 40 * MIB);
    let (k, open) = common::gated_write(live.ptr(), 7);
    dev.launch(S0, k).unwrap();
    drop(open);
    assert_eq!(common::device_bytes(&dev, &live)[..4], [7; 4]);
    alloc.release_persistent().unwrap();
    assert_eq!(segments(&alloc).len(), 2);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop((live, again));
    drop(alloc);
    assert_no_leak(&dev);
}

/// A transient range of chunks of 2, 3, 1 and 4 pages (the first live) above a persistent
/// range's free 2-page chunk: each trim releases whole chunks from the top down, passing over a
/// chunk larger than what the floor lets go. Broken builds `trim_ignores_floor` and
/// `trim_releases_persistent`.
#[test]
fn expandable_chunks_go_from_the_top_down_and_never_below_the_floor() {
    let (dev, alloc) = common::expandable_setup("", CAP);
    let t = 2 * CAP / MIB; // the transient range's offset, in MiB
    let p = alloc.alloc_in(4 * MIB, S0, Residency::Persistent).unwrap();
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    let b = alloc.alloc(6 * MIB, S0).unwrap();
    let c = alloc.alloc(2 * MIB, S0).unwrap();
    let d = alloc.alloc(8 * MIB, S0).unwrap();
    assert_eq!(a.ptr(), DeviceAddr(SIM_BASE + 2 * CAP));
    assert_eq!(mappings(&dev), vec![(0, 4), (t, 4), (t + 4, 6), (t + 10, 2), (t + 12, 8)]);
    drop((p, b, c, d));
    assert_eq!(alloc.reserved_bytes(), 12 * P);
    assert_eq!(alloc.trim_to(12 * P).unwrap(), 0);
    // Two pages above the floor: the top chunk (4 pages) is passed over, the 1-page one goes,
    // the 3-page one is passed over.
    assert_eq!(alloc.trim_to(10 * P).unwrap(), P);
    assert_eq!(mappings(&dev), vec![(0, 4), (t, 4), (t + 4, 6), (t + 12, 8)]);
    let s = alloc.stats();
    assert_eq!((s.num_device_unmap, s.num_physical_release, s.num_host_syncs), (1, 1, 0));
    consistent(&dev, &alloc);
    // 11 MiB above a floor that is no whole number of pages: 5 pages may go, the top chunk's
    // 4 do.
    assert_eq!(alloc.trim_to(11 * MIB).unwrap(), 4 * P);
    assert_eq!(alloc.reserved_bytes(), 7 * P);
    assert_eq!(mappings(&dev), vec![(0, 4), (t, 4), (t + 4, 6)]);
    // All that may go: the 3-page chunk. The persistent chunk and the live one stay.
    assert_eq!(alloc.trim_to(0).unwrap(), 3 * P);
    assert_eq!(mappings(&dev), vec![(0, 4), (t, 4)]);
    let s = alloc.stats();
    assert_eq!((s.num_device_unmap, s.num_physical_release, s.num_host_syncs), (3, 3, 0));
    assert_eq!((s.num_device_free, s.num_sync_all_streams), (0, 0));
    assert_eq!(s.blocks.reserved_bytes.persistent.current, 2 * P);
    consistent(&dev, &alloc);
    // The allocator goes on: the range grows again above the live block.
    let again = alloc.alloc(6 * MIB, S0).unwrap();
    assert_eq!(again.ptr(), DeviceAddr(SIM_BASE + 2 * CAP + 4 * MIB));
    assert_eq!(alloc.reserved_bytes(), 7 * P);
    consistent(&dev, &alloc);
    alloc.release_persistent().unwrap();
    assert_eq!(mappings(&dev), vec![(t, 4), (t + 4, 6)]);
    drop((a, again));
    drop(alloc);
    assert_no_leak(&dev);
}

/// A block freed after `record_stream` waits for another stream's kernel: the trim polls its
/// event and keeps its segment, with no host wait (`cudaMemPoolTrimTo` does not synchronise);
/// a trim after the kernel completed releases it. Broken build `trim_waits_pending`: the first
/// trim waited for the kernel and released the segment.
#[test]
fn a_segment_pending_on_another_stream_stays_until_its_event_completes() {
    let common::Setup { dev, s, t, alloc } = common::setup();
    let x = alloc.alloc(4 * MIB, s).unwrap();
    x.record_stream(t).unwrap();
    let (k, open) = common::gated(x.ptr(), 4 * MIB, AccessKind::Write);
    dev.launch(t, k).unwrap();
    // The gate opens at the device's next host sync: a wait for the kernel ends.
    let opener = common::open_on_next_sync(&dev, open);
    drop(x);
    assert_eq!(alloc.trim_to(0).unwrap(), 0);
    assert_eq!(segments(&alloc), vec![(0, 20)]);
    let st = alloc.stats();
    assert_eq!((st.num_device_free, st.num_host_syncs, st.num_sync_all_streams), (0, 0, 0));
    assert_eq!(dev.counters().host_syncs, 0);
    // The kernel completes; the next trim finds the event completed.
    dev.synchronize().unwrap();
    opener.join().unwrap();
    assert_eq!(alloc.trim_to(0).unwrap(), 20 * MIB);
    assert_eq!(segments(&alloc), vec![]);
    let st = alloc.stats();
    assert_eq!((st.num_device_free, st.num_host_syncs, st.num_sync_all_streams), (1, 1, 0));
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    assert_no_leak(&dev);
}

/// Over expandable segments: the chunk of a block pending on another stream's kernel stays
/// mapped while a free chunk below it goes (its own stream idle: no wait). Broken build
/// `trim_waits_pending`: both went.
#[test]
fn a_chunk_pending_on_another_stream_stays_while_a_free_one_goes() {
    let (dev, alloc) = common::expandable_setup("", CAP);
    let t = dev.create_stream().unwrap();
    let y = alloc.alloc(4 * MIB, S0).unwrap();
    let x = alloc.alloc(6 * MIB, S0).unwrap();
    assert_eq!(mappings(&dev), vec![(0, 4), (4, 6)]);
    x.record_stream(t).unwrap();
    let (k, open) = common::gated(x.ptr(), 6 * MIB, AccessKind::Write);
    dev.launch(t, k).unwrap();
    let opener = common::open_on_next_sync(&dev, open);
    drop((x, y));
    assert_eq!(alloc.trim_to(0).unwrap(), 4 * MIB);
    assert_eq!(mappings(&dev), vec![(4, 6)]);
    let st = alloc.stats();
    assert_eq!((st.num_device_unmap, st.num_physical_release), (1, 1));
    assert_eq!((st.num_host_syncs, st.num_sync_all_streams), (0, 0));
    assert_eq!(dev.counters().host_syncs, 0);
    consistent(&dev, &alloc);
    dev.synchronize().unwrap();
    opener.join().unwrap();
    assert_eq!(alloc.trim_to(0).unwrap(), 6 * MIB);
    assert_eq!(mappings(&dev), vec![]);
    let st = alloc.stats();
    assert_eq!((st.num_device_unmap, st.num_physical_release, st.num_host_syncs), (2, 2, 0));
    consistent(&dev, &alloc);
    drop(alloc);
    assert_no_leak(&dev);
}

/// The same work on two devices: live blocks, persistent ones, small and large, on two streams,
/// one freed after `record_stream` (its event completed at once, the stream being idle).
fn workload(alloc: &Allocator<SimDevice>, t: StreamId) -> Vec<Buffer<SimDevice>> {
    let keep = vec![
        alloc.alloc(3 * MIB, S0).unwrap(),
        alloc.alloc_in(5 * MIB, S0, Residency::Persistent).unwrap(),
        alloc.alloc(512, t).unwrap(),
        alloc.alloc(11 * MIB, t).unwrap(),
    ];
    let gone = vec![
        alloc.alloc(12 * MIB, S0).unwrap(),
        alloc.alloc(700, S0).unwrap(),
        alloc.alloc(4 * MIB, t).unwrap(),
        alloc.alloc_in(2 * MIB, S0, Residency::Persistent).unwrap(),
        alloc.alloc(30 * MIB, S0).unwrap(),
        alloc.alloc(2 * MIB, S0).unwrap(),
    ];
    gone[0].record_stream(t).unwrap();
    drop(gone);
    keep
}

/// `trim_to(0)` gives back what `empty_cache` does, ordinary segments and expandable ranges
/// alike; `empty_cache` waits for the pending free's event (a counted host sync, and a sync of
/// all streams) where the trim only polled it.
#[test]
fn trim_to_zero_releases_what_empty_cache_releases() {
    for (expandable, released) in [(false, 52 * MIB), (true, 50 * MIB)] {
        let run = |trim: bool| {
            let dev = Arc::new(SimDevice::backed(CAP));
            let t = dev.create_stream().unwrap();
            let config = Config::default().with_expandable_segments(expandable);
            let alloc = Allocator::new(dev.clone(), config).unwrap();
            let keep = workload(&alloc, t);
            let before = alloc.reserved_bytes();
            match trim {
                true => assert_eq!(alloc.trim_to(0).unwrap(), released, "{expandable}"),
                false => alloc.empty_cache().unwrap(),
            }
            assert_eq!(before - alloc.reserved_bytes(), released, "{expandable}");
            alloc.check_invariants().unwrap();
            assert_eq!(dev.violations(), vec![]);
            let s = alloc.stats();
            let figures = (s.num_device_free, s.num_device_unmap, s.num_physical_release);
            let view = (segments(&alloc), alloc.expandable_ranges(), mappings(&dev), figures);
            let syncs = (s.num_host_syncs, s.num_sync_all_streams);
            drop(keep);
            drop(alloc);
            assert_no_leak(&dev);
            (view, syncs)
        };
        let (trimmed, trim_syncs) = run(true);
        let (emptied, empty_syncs) = run(false);
        assert_eq!(trimmed, emptied, "{expandable}");
        assert_eq!((empty_syncs.0 - trim_syncs.0, trim_syncs.1, empty_syncs.1), (1, 0, 1));
    }
}

/// A private pool trims its own memory, transient first, then persistent (its `empty_cache`
/// gives back both); the general allocator's is not touched.
#[test]
fn a_private_pool_trims_its_transient_memory_then_its_persistent_memory() {
    let dev = Arc::new(SimDevice::backed(CAP));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let outside = alloc.alloc(12 * MIB, S0).unwrap();
    drop(outside);
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    let bufs = {
        let _guard = alloc.use_pool(&pool, S0).unwrap();
        let p = alloc.alloc_in(10 * MIB, S0, Residency::Persistent).unwrap();
        (p, alloc.alloc(12 * MIB, S0).unwrap(), alloc.alloc(16 * MIB, S0).unwrap())
    };
    drop(bufs);
    let reserved = |p: &tidepool::MemPool<SimDevice>| p.stats().blocks.reserved_bytes.all.current;
    assert_eq!(reserved(&pool), 38 * MIB);
    // 18 above 20: the 16 MiB segment; 12 and then the persistent 10 would go below.
    assert_eq!(pool.trim_to(20 * MIB).unwrap(), 16 * MIB);
    assert_eq!(reserved(&pool), 22 * MIB);
    assert_eq!(pool.trim_to(0).unwrap(), 22 * MIB);
    assert_eq!(reserved(&pool), 0);
    assert_eq!(pool.stats().num_device_free, 3);
    assert_eq!(alloc.reserved_bytes(), 12 * MIB);
    pool.check_invariants().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.trim_to(0).unwrap(), 12 * MIB);
    drop(pool);
    drop(alloc);
    assert_no_leak(&dev);
}

/// The regions of named scopes' plans that nothing holds are cached memory too (`empty_cache`
/// lets them go), but the last a trim takes: only while reserved is still above the floor once
/// the free segments went. A region lives in a segment (here 4 MiB of a 20 MiB one): let go, it
/// frees that segment, which goes where its release keeps the floor.
#[test]
fn idle_plan_regions_go_last() {
    let dev = Arc::new(SimDevice::new(CAP));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    for _ in 0..2 {
        let scope = alloc.named_scope("step", S0);
        drop(scope.alloc_unbound(4 * MIB).unwrap());
    }
    assert_eq!(alloc.stats().plan_region_bytes, 4 * MIB);
    drop(alloc.alloc(40 * MIB, S0).unwrap()); // a segment of its own, then free
    assert_eq!(segments(&alloc), vec![(20, 20), (40, 40)]);
    // A floor the free segment reaches: the region stays.
    assert_eq!(alloc.trim_to(20 * MIB).unwrap(), 40 * MIB);
    assert_eq!(alloc.stats().plan_region_bytes, 4 * MIB);
    assert_eq!(segments(&alloc), vec![(20, 20)]);
    // Above a floor of 0 still: the region goes, and the segment it freed.
    assert_eq!(alloc.trim_to(0).unwrap(), 20 * MIB);
    assert_eq!(alloc.stats().plan_region_bytes, 0);
    assert_eq!(alloc.reserved_bytes(), 0);
    assert_eq!(dev.live_segments(), vec![]);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    // The scope learns again and serves as before.
    for _ in 0..2 {
        let scope = alloc.named_scope("step", S0);
        drop(scope.alloc_unbound(4 * MIB).unwrap());
    }
    assert_eq!(alloc.stats().plan_region_bytes, 4 * MIB);
}

/// An idle region whose segment cannot go without crossing the floor stays its plan's: letting
/// it go would release nothing, and cost the plan's next run a new region (here, the region
/// being its first plan's, adopted: the plan itself). A 4 MiB region in a 20 MiB segment, the
/// only one: a floor of 10 MiB keeps both, and the next run follows the plan in the region with
/// no device call; a floor of 0 releases them. (The broken build
/// `cfg(tidepool_broken = "trim_regions_past_floor")` lets the region go at 10 MiB as before:
/// 0 bytes released and 0 bytes of region left, and the next run learns again.)
#[test]
fn an_idle_region_whose_segment_cannot_go_within_the_floor_stays() {
    let dev = Arc::new(SimDevice::new(CAP));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let run = || {
        let scope = alloc.named_scope("step", S0);
        drop(scope.alloc_unbound(4 * MIB).unwrap());
    };
    run();
    run();
    assert_eq!(alloc.stats().plan_region_bytes, 4 * MIB);
    assert_eq!(segments(&alloc), vec![(20, 20)]);
    // 20 MiB reserved: the segment's release would leave 0, under the floor.
    assert_eq!(alloc.trim_to(10 * MIB).unwrap(), 0);
    let s = alloc.stats();
    assert_eq!((s.plan_region_bytes, alloc.reserved_bytes()), (4 * MIB, 20 * MIB));
    let (hits, misses, mallocs) = (s.plan_hits, s.plan_misses, dev.counters().mallocs);
    run();
    let s = alloc.stats();
    assert_eq!(
        (s.plan_hits - hits, s.plan_misses - misses, dev.counters().mallocs - mallocs),
        (1, 0, 0)
    );
    // A floor of 0: the region goes, and its segment.
    assert_eq!(alloc.trim_to(0).unwrap(), 20 * MIB);
    assert_eq!((alloc.stats().plan_region_bytes, alloc.reserved_bytes()), (0, 0));
    assert_eq!(dev.live_segments(), vec![]);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// Chunks a trim under `release_threshold` retired behind their stream's unfinished work are
/// out of the pool but still mapped and counted reserved until a lock section sees their
/// event complete; `trim_to`'s release of expandable chunks lets them go first, whatever the
/// floor. So they go before the floor weighs anything: here a 12 MiB chunk retired behind a
/// kernel that has completed since, and a free 20 MiB ordinary segment (expandable segments
/// switched off meanwhile): `trim_to(10 MiB)` lets the chunk go and keeps the segment (20 MiB
/// reserved). Weighed with the chunk still counted, the segment's release seemed to leave
/// 12 MiB, and both went: 0 bytes reserved under a floor of 10 MiB (broken build
/// `trim_floor_counts_retiring`).
#[test]
fn retiring_chunks_go_before_the_floor_weighs_the_segments() {
    let (dev, alloc) = common::expandable_setup("release_threshold_mb:0", CAP);
    let a = alloc.alloc(12 * MIB, S0).unwrap();
    let (k, open) = common::gated(a.ptr(), 12 * MIB, AccessKind::Write);
    dev.launch(S0, k).unwrap();
    drop(a); // the trim retires its chunk behind the kernel
    assert_eq!((alloc.reserved_bytes(), mappings(&dev)), (12 * MIB, vec![(0, 12)]));
    alloc.set_config(Config::default()).unwrap();
    drop(alloc.alloc(20 * MIB, S0).unwrap()); // an ordinary segment, cached
    assert_eq!(dev.live_segments().len(), 1);
    assert_eq!(alloc.reserved_bytes(), 32 * MIB);
    // The kernel completes; no lock section has seen it since.
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(alloc.trim_to(10 * MIB).unwrap(), 12 * MIB);
    assert_eq!(alloc.reserved_bytes(), 20 * MIB, "never below the floor");
    assert_eq!((dev.live_segments().len(), mappings(&dev)), (1, vec![]));
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    assert_eq!(alloc.trim_to(0).unwrap(), 20 * MIB);
    drop(alloc);
    assert_no_leak(&dev);
}
