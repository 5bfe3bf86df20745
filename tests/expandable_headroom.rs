//! The growth headroom of expandable segments: a growth at the top of a transient range maps at
//! least 1/512 of the range's mapped pages (at most 10 pages, 20 MiB), so a range that grows in
//! many small steps makes a device call per ~0.2 % of its size, not per request. Exact pages,
//! addresses and device calls; the headroom never costs a request that fits without it
//! (out of memory for the headroom falls back to the exact growth: broken mode `HeadroomOom`),
//! stays within `release_threshold`, and persistent ranges grow by exactly what is asked. A
//! build-up (growths before any block was freed) ramps the headroom up, one page per growth
//! after its first eight, until the first free (into the pool or a stream cache).
//!
//! The device is unbacked (no host memory behind its pages), so ranges of several GiB cost
//! nothing to map. Pages are 2 MiB; the first range a test makes starts at `SIM_BASE`.

use std::sync::Arc;
use tidepool::device::{SIM_BASE, SimDevice};
use tidepool::hooks::Broken;
use tidepool::{AllocError, Allocator, Config, DeviceAddr, GIB, MIB, Residency, StreamId};

const P: u64 = 2 * MIB;
const S0: StreamId = StreamId::DEFAULT;

fn setup(config: &str, capacity: u64) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::new(capacity));
    let config = Config::parse(config).unwrap().with_expandable_segments(true);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    (dev, alloc)
}

fn at(offset: u64) -> DeviceAddr {
    DeviceAddr(SIM_BASE + offset)
}

/// (maps, creates, failed creates) the device has counted.
fn calls(dev: &SimDevice) -> (u64, u64, u64) {
    let c = dev.vm_counters();
    (c.maps, c.creates, c.failed_creates)
}

fn check(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    alloc.check_invariants().unwrap();
    assert_eq!(dev.physical_bytes(), alloc.reserved_bytes());
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn a_growth_at_the_top_maps_a_share_of_the_range_ahead() {
    let (dev, alloc) = setup("", 16 * GIB);
    // An empty range grows by exactly what is asked: 2048 pages, in chunks of 32.
    let big = alloc.alloc(4 * GIB, S0).unwrap();
    assert_eq!(big.ptr(), at(0));
    assert_eq!(calls(&dev), (64, 64, 0));
    assert_eq!(alloc.reserved_bytes(), 4 * GIB);
    check(&dev, &alloc);

    // 2048 pages mapped: a growth maps at least 2048 / 512 = 4 pages, one chunk.
    let mut small = vec![alloc.alloc(P, S0).unwrap()];
    assert_eq!(calls(&dev), (65, 65, 0));
    assert_eq!(alloc.reserved_bytes(), 4 * GIB + 4 * P);
    // The next three fit in those pages: no device call, one after another.
    for _ in 1..4 {
        small.push(alloc.alloc(P, S0).unwrap());
        assert_eq!(calls(&dev), (65, 65, 0));
        assert_eq!(alloc.reserved_bytes(), 4 * GIB + 4 * P);
        check(&dev, &alloc);
    }
    let addrs: Vec<DeviceAddr> = small.iter().map(|b| b.ptr()).collect();
    assert_eq!(addrs, (0..4).map(|i| at(4 * GIB + i * P)).collect::<Vec<_>>());

    // A request larger than the headroom grows by exactly its own pages (5), at the top.
    let wide = alloc.alloc(5 * P, S0).unwrap();
    assert_eq!(wide.ptr(), at(4 * GIB + 4 * P));
    assert_eq!(calls(&dev), (66, 66, 0));
    assert_eq!(alloc.reserved_bytes(), 4 * GIB + 9 * P);

    // 2057 pages mapped: 4 again for the next small one.
    small.push(alloc.alloc(P, S0).unwrap());
    assert_eq!(small[4].ptr(), at(4 * GIB + 9 * P));
    assert_eq!(calls(&dev), (67, 67, 0));
    assert_eq!(alloc.reserved_bytes(), 4 * GIB + 13 * P);
    check(&dev, &alloc);

    drop((big, small, wide));
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    drop(alloc);
    assert_eq!(dev.physical_bytes(), 0);
    assert_eq!(dev.live_mappings(), vec![]);
}

#[test]
fn a_build_up_ramps_the_headroom_until_the_first_free() {
    let (dev, alloc) = setup("", 16 * GIB);
    let mut held = Vec::new();
    // Nothing freed yet: the first eight growths are exact, and the ninth (one page of ramp,
    // as much as the request) too.
    for i in 0..9 {
        held.push(alloc.alloc(P, S0).unwrap());
        assert_eq!(held[i as usize].ptr(), at(i * P));
        assert_eq!(calls(&dev), (i + 1, i + 1, 0));
        assert_eq!(alloc.reserved_bytes(), (i + 1) * P);
    }
    check(&dev, &alloc);
    // The tenth maps two pages (one ahead), the eleventh three: the requests between need no
    // device call.
    for (grown, ahead) in [(10, 1), (11, 2)] {
        let before = held.len() as u64;
        for j in 0..=ahead {
            held.push(alloc.alloc(P, S0).unwrap());
            assert_eq!(held.last().unwrap().ptr(), at((before + j) * P));
            assert_eq!(calls(&dev), (grown, grown, 0));
            assert_eq!(alloc.reserved_bytes(), (before + ahead + 1) * P);
        }
        check(&dev, &alloc);
    }
    assert_eq!(held.len(), 14);
    // A free ends the build-up (the stream cache holds the freed block until the next search
    // returns it to the pool): growths are exact again.
    drop(held.swap_remove(0));
    let two = alloc.alloc(2 * P, S0).unwrap();
    assert_eq!(two.ptr(), at(14 * P));
    assert_eq!(calls(&dev), (12, 12, 0));
    assert_eq!(alloc.reserved_bytes(), 16 * P);
    let reuse = alloc.alloc(P, S0).unwrap();
    assert_eq!(reuse.ptr(), at(0));
    let next = alloc.alloc(P, S0).unwrap();
    assert_eq!(next.ptr(), at(16 * P));
    assert_eq!(calls(&dev), (13, 13, 0));
    assert_eq!(alloc.reserved_bytes(), 17 * P);
    check(&dev, &alloc);
    drop((held, two, reuse, next));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
}

/// A free ends the build-up wherever the block goes: into the pool (`global_lock:true`), or into
/// a stream cache, where the next request of its size takes it again and the pool never sees a
/// free (the differential harness, `stitch_kernels` seed 2476: a private pool's one-page growth
/// mapped two on the fast path). Both paths alike.
#[test]
fn a_free_into_a_stream_cache_ends_the_build_up() {
    for config in ["", "global_lock:true"] {
        let (dev, alloc) = setup(config, 16 * GIB);
        // Nine exact growths: one more and the build-up would map a page ahead.
        let mut held: Vec<_> = (0..9).map(|_| alloc.alloc(P, S0).unwrap()).collect();
        assert_eq!(calls(&dev), (9, 9, 0), "{config}");
        assert_eq!(alloc.reserved_bytes(), 9 * P, "{config}");
        // The last block freed (the fast path keeps it in the stream's cache) and taken again.
        drop(held.pop());
        let lanes = if config.is_empty() { P } else { 0 };
        assert_eq!(alloc.stats().cached_fast_bytes, lanes, "{config}");
        held.push(alloc.alloc(P, S0).unwrap());
        assert_eq!(held[8].ptr(), at(8 * P), "{config}");
        assert_eq!(alloc.stats().cached_fast_bytes, 0, "{config}");
        // The tenth growth is exact: one page, where a build-up's would have been two.
        held.push(alloc.alloc(P, S0).unwrap());
        assert_eq!(held[9].ptr(), at(9 * P), "{config}");
        assert_eq!(calls(&dev), (10, 10, 0), "{config}");
        assert_eq!(alloc.reserved_bytes(), 10 * P, "{config}");
        let s = alloc.stats().blocks;
        assert_eq!((s.allocated_bytes.all.allocated, s.allocated_bytes.all.freed), (11 * P, P));
        check(&dev, &alloc);
        drop(held);
        alloc.empty_cache().unwrap();
        assert_eq!(dev.physical_bytes(), 0, "{config}");
    }
}

/// A device with room for 2049 pages: the 4 GiB block, then one page.
fn headroom_without_room(broken: bool) -> Result<DeviceAddr, AllocError> {
    let (dev, alloc) = setup("", 4 * GIB + P);
    alloc.set_broken(Broken::HeadroomOom, broken);
    let big = alloc.alloc(4 * GIB, S0).unwrap();
    let got = alloc.alloc(P, S0).map(|b| b.ptr());
    if got.is_ok() {
        // The headroom's four pages were refused, the exact page was not.
        assert_eq!(calls(&dev), (65, 65, 1));
        assert_eq!(alloc.reserved_bytes(), 4 * GIB + P);
    }
    check(&dev, &alloc);
    // Whatever happened, the allocator works on and gives everything back.
    drop(big);
    let again = alloc.alloc(2 * GIB, S0).unwrap();
    assert_eq!(again.ptr(), at(0));
    drop(again);
    alloc.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
    got
}

#[test]
fn headroom_the_device_cannot_hold_falls_back_to_the_exact_growth() {
    assert_eq!(headroom_without_room(false).unwrap(), at(4 * GIB));
    // Broken: the headroom's out-of-memory fails a request the device has room for.
    assert!(matches!(headroom_without_room(true), Err(AllocError::OutOfMemory(_))));
}

#[test]
fn release_threshold_bounds_the_headroom() {
    // The range may keep 4 MiB of free pages: the headroom is 2 pages, not 4.
    let (dev, alloc) = setup("release_threshold_mb:4", 16 * GIB);
    let big = alloc.alloc(4 * GIB, S0).unwrap();
    let a = alloc.alloc(P, S0).unwrap();
    assert_eq!(a.ptr(), at(4 * GIB));
    assert_eq!(calls(&dev), (65, 65, 0));
    assert_eq!(alloc.reserved_bytes(), 4 * GIB + 2 * P);
    let b = alloc.alloc(P, S0).unwrap();
    assert_eq!(b.ptr(), at(4 * GIB + P));
    assert_eq!(calls(&dev), (65, 65, 0));
    check(&dev, &alloc);
    drop((big, a, b));
}

#[test]
fn persistent_ranges_grow_by_exactly_what_is_asked() {
    let (dev, alloc) = setup("", 16 * GIB);
    let big = alloc.alloc_in(4 * GIB, S0, Residency::Persistent).unwrap();
    let w = alloc.alloc_in(P, S0, Residency::Persistent).unwrap();
    assert_eq!(w.ptr(), at(4 * GIB));
    assert_eq!(calls(&dev), (65, 65, 0));
    assert_eq!(alloc.reserved_bytes(), 4 * GIB + P);
    check(&dev, &alloc);
    drop((big, w));
}

/// The headroom counts the free bytes the stream has already: with `release_threshold` 8 MiB
/// and three one-page holes (6 MiB free) below the top, a two-page request at the top maps
/// three pages, leaving 8 MiB free — not four (the threshold alone), which left 10 MiB free,
/// past the threshold, for the trim at the stream's next free to unmap again.
#[test]
fn the_headroom_counts_the_free_bytes_already_there() {
    let (dev, alloc) = setup("release_threshold_mb:8,fast_cache:false", 16 * GIB);
    let big = alloc.alloc(4 * GIB, S0).unwrap();
    // 2048 pages mapped: each growth maps 4 pages (1/512, and 8 MiB of free pages at most).
    let mut v: Vec<_> = (0..8).map(|_| Some(alloc.alloc(P, S0).unwrap())).collect();
    let addrs: Vec<_> = v.iter().map(|b| b.as_ref().unwrap().ptr()).collect();
    assert_eq!(addrs, (0..8).map(|i| at(4 * GIB + i * P)).collect::<Vec<_>>());
    assert_eq!(calls(&dev), (66, 66, 0));
    assert_eq!(alloc.reserved_bytes(), 4 * GIB + 8 * P);
    for i in [1, 3, 5] {
        v[i] = None; // one-page holes: 6 MiB free, within the threshold (nothing unmapped)
    }
    let free = |alloc: &Allocator<SimDevice>| alloc.reserved_bytes() - alloc.allocated_bytes();
    assert_eq!(free(&alloc), 6 * MIB);
    assert_eq!(dev.vm_counters().unmaps, 0);
    // Two pages fit no hole: the top grows by them and one page of headroom.
    let w = alloc.alloc(2 * P, S0).unwrap();
    assert_eq!(w.ptr(), at(4 * GIB + 8 * P));
    assert_eq!(calls(&dev), (67, 67, 0));
    assert_eq!(alloc.reserved_bytes(), 4 * GIB + 11 * P, "three pages mapped");
    assert_eq!(free(&alloc), 8 * MIB, "the threshold's worth free, no more");
    // The next free trims nothing: no page mapped by the growth goes at once.
    v[7] = None;
    assert_eq!(dev.vm_counters().unmaps, 0);
    check(&dev, &alloc);
    drop((big, v, w));
}
