//! Same-stream reuse of large blocks over expandable segments: a freed large block waits in its
//! stream's first cache lane and is handed out again only where freeing it and allocating would
//! give the same block — the pool's best fit with the range's split rule (a large block is split
//! whenever anything is left) and the end of the range's top run used last. Only while a free
//! releases no pages at once: not under `release_threshold_mb`, not during a named scope's
//! learning run. Exact addresses, pages and map counts; the sanitizer checks every hand-out
//! against the mapped pages.

use std::sync::Arc;
use tidepool::MIB;
use tidepool::device::{SIM_BASE, SimDevice};
use tidepool::hooks::Broken;
use tidepool::{Allocator, Config, DeviceAddr, StreamId};

const P: u64 = 2 * MIB;
const S0: StreamId = StreamId::DEFAULT;

fn setup(config: &str) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::backed(64 * MIB));
    let config = Config::parse(config).unwrap().with_expandable_segments(true);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    (dev, alloc)
}

fn at(offset: u64) -> DeviceAddr {
    DeviceAddr(SIM_BASE + offset)
}

/// The pages the device has mapped, as page offsets from the first range's base.
fn mapped_pages(dev: &SimDevice) -> Vec<u64> {
    let mut pages: Vec<u64> = dev
        .live_mappings()
        .iter()
        .flat_map(|&(a, n)| (a.0 - SIM_BASE) / P..(a.0 - SIM_BASE + n) / P)
        .collect();
    pages.sort_unstable();
    pages
}

fn check(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn a_large_block_is_reused_in_place_with_no_page_mapped_or_lock_on_the_free() {
    let (dev, alloc) = setup("");
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!((a.ptr(), a.block_size()), (at(0), 4 * MIB));
    assert_eq!(mapped_pages(&dev), vec![0, 1]);
    let n = alloc.global_lock_acquisitions();
    drop(a);
    assert_eq!(alloc.global_lock_acquisitions(), n, "the free takes no global lock");
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * MIB);
    let n = alloc.global_lock_acquisitions();
    for _ in 0..50 {
        let b = alloc.alloc(4 * MIB, S0).unwrap();
        assert_eq!(b.ptr(), at(0));
    }
    // The first reuse checks the pool under the lock; the others need no lock (nothing changed).
    assert_eq!(alloc.global_lock_acquisitions(), n + 1, "one lock, for the first reuse's check");
    let s = alloc.stats();
    assert_eq!((s.num_device_map, s.num_device_unmap, s.num_physical_create), (1, 0, 1));
    assert_eq!(s.blocks.reserved_bytes.all.current, 4 * MIB);
    let count = s.blocks.allocation.large_pool;
    assert_eq!((count.current, count.peak, count.allocated, count.freed), (0, 1, 51, 51));
    assert_eq!(s.best_fit_searches, 1, "only the first allocation searched");
    assert_eq!(mapped_pages(&dev), vec![0, 1]);
    check(&dev, &alloc);
    // empty_cache returns the cached block to the pool and its pages to the device.
    alloc.empty_cache().unwrap();
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.blocks.reserved_bytes.all.current), (0, 0));
    assert_eq!(mapped_pages(&dev), Vec::<u64>::new());
    check(&dev, &alloc);
}

/// Range: [a 6 MiB][g 2 MiB][x 4 MiB] in one run; `x` (the end of the top run) waits in the
/// cache, `a` is free in the pool. A 4 MiB request: returns its address.
fn end_of_top_run_scenario(broken: bool) -> DeviceAddr {
    let (dev, alloc) = setup("");
    alloc.set_broken(Broken::ReuseGrowthEnd, broken);
    let a = alloc.alloc(6 * MIB, S0).unwrap();
    let g = alloc.alloc(2 * MIB, S0).unwrap();
    let x = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!((a.ptr(), g.ptr(), x.ptr()), (at(0), at(6 * MIB), at(8 * MIB)));
    assert_eq!(mapped_pages(&dev), (0..6).collect::<Vec<_>>());
    drop(x); // cached
    drop(a); // the lane holds one large block already: into the pool
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * MIB);
    let b = alloc.alloc(4 * MIB, S0).unwrap();
    let ptr = b.ptr();
    let s = alloc.stats();
    assert_eq!((s.num_device_map, s.num_device_unmap), (3, 0), "no growth either way");
    assert_eq!(s.blocks.reserved_bytes.all.current, 12 * MIB);
    drop((b, g));
    check(&dev, &alloc);
    ptr
}

#[test]
fn the_end_of_the_top_run_is_used_last_by_a_reuse_as_by_the_pool() {
    // Freed, `x` would be the best fit but ends the top run: the 6 MiB block serves, split.
    assert_eq!(end_of_top_run_scenario(false), at(0));
}

#[test]
fn broken_reuse_that_ignores_the_growth_end_places_elsewhere() {
    assert_eq!(end_of_top_run_scenario(true), at(8 * MIB));
}

#[test]
fn a_block_that_does_not_end_its_run_is_reused_even_where_a_larger_one_is_free() {
    let (dev, alloc) = setup("");
    let a = alloc.alloc(6 * MIB, S0).unwrap();
    let h = alloc.alloc(2 * MIB, S0).unwrap();
    let x = alloc.alloc(4 * MIB, S0).unwrap();
    let g = alloc.alloc(2 * MIB, S0).unwrap();
    assert_eq!((a.ptr(), x.ptr(), g.ptr()), (at(0), at(8 * MIB), at(12 * MIB)));
    drop(x);
    drop(a);
    // [free 6][h][x 4 cached][g]: freed, x merges with nothing, ends nothing, and fits best.
    let b = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(b.ptr(), at(8 * MIB));
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.best_fit_searches), (0, 4));
    drop((b, g, h));
    check(&dev, &alloc);
}

#[test]
fn under_a_release_threshold_large_frees_release_pages_at_once() {
    let (dev, alloc) = setup("release_threshold_mb:0");
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    drop(a);
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.blocks.reserved_bytes.all.current), (0, 0));
    assert_eq!((s.num_device_map, s.num_device_unmap), (1, 1));
    assert_eq!(mapped_pages(&dev), Vec::<u64>::new());
    check(&dev, &alloc);
}

#[test]
fn a_learning_run_frees_cached_large_blocks_and_caches_none_while_open() {
    let (dev, alloc) = setup("");
    let keep = alloc.alloc(2 * MIB, S0).unwrap();
    drop(alloc.alloc(4 * MIB, S0).unwrap());
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * MIB);
    assert_eq!(mapped_pages(&dev), vec![0, 1, 2]);
    {
        let scope = alloc.named_scope("step", S0);
        // The run opened: the cached block went to the pool, and its pages back to the device.
        let s = alloc.stats();
        assert_eq!((s.cached_fast_bytes, s.blocks.reserved_bytes.all.current), (0, 2 * MIB));
        assert_eq!(mapped_pages(&dev), vec![0]);
        let b = alloc.alloc(4 * MIB, S0).unwrap();
        assert_eq!(b.ptr(), at(2 * MIB));
        drop(b); // not cached: its pages go at once
        let s = alloc.stats();
        assert_eq!((s.cached_fast_bytes, s.blocks.reserved_bytes.all.current), (0, 2 * MIB));
        assert_eq!(mapped_pages(&dev), vec![0]);
        drop(scope);
    }
    // The run is over: large blocks are cached again.
    drop(alloc.alloc(4 * MIB, S0).unwrap());
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * MIB);
    drop(keep);
    check(&dev, &alloc);
}

/// Range: [x 12 MiB cached][r 16 MiB free][z 12 MiB] under `max_split_size_mb:20`. Freed, `x`
/// merges with `r` into 28 MiB: an oversize block, which the pool's search never gives a
/// 12 MiB request (`Sizing::may_serve`: below `max_split_size`, only blocks below it serve),
/// so a 12 MiB request grows the range at its top, as without the cache. Before, the reuse
/// check took the range's split rule (`max_split_size` lifted, `Shared::alloc_sizing`) for
/// the serving rule too and handed `x` out again. Returns the request's address and the bytes
/// then mapped. Broken build `reuse_oversize_in_range`.
fn oversize_merge_scenario(config: &str) -> (DeviceAddr, u64) {
    let (dev, alloc) = setup(config);
    let x = alloc.alloc(12 * MIB, S0).unwrap();
    let r = alloc.alloc(16 * MIB, S0).unwrap();
    let z = alloc.alloc(12 * MIB, S0).unwrap();
    assert_eq!((x.ptr(), r.ptr(), z.ptr()), (at(0), at(12 * MIB), at(28 * MIB)));
    drop(x); // cached (with the fast path)
    drop(r); // the lane holds one large block already: into the pool
    let b = alloc.alloc(12 * MIB, S0).unwrap();
    let ptr = b.ptr();
    let mapped = alloc.stats().blocks.reserved_bytes.all.current;
    drop((b, z));
    check(&dev, &alloc);
    (ptr, mapped)
}

#[test]
fn a_cached_block_that_would_merge_into_an_oversize_one_is_not_reused_for_a_smaller_request() {
    let pool = oversize_merge_scenario("max_split_size_mb:20,fast_cache:false");
    assert_eq!(pool, (at(40 * MIB), 52 * MIB), "the pool's own placement: a growth");
    assert_eq!(oversize_merge_scenario("max_split_size_mb:20"), pool);
    // Without the cap the merged block serves, split: the cached block's own place.
    assert_eq!(oversize_merge_scenario(""), (at(0), 40 * MIB));
    assert_eq!(oversize_merge_scenario("fast_cache:false"), (at(0), 40 * MIB));
}

/// A block freed on S0 and gone from the lane into the pool (a persistent request's search took
/// it there) while no trim was due; then a named scope's learning run, whose trims keep no free
/// page. Whether or not the statistics were read before the run, it gives the 14 MiB back at
/// its opening, as `global_lock:true` does: its blocks then map 4 + 5 MiB and the region's
/// remainder one page. (A read takes the stream from the trims: the 14 MiB stay mapped and
/// the region keeps 5 MiB of them: broken build `trim_dirty_published`.)
#[test]
fn a_statistics_read_before_a_learning_run_does_not_keep_the_streams_free_pages() {
    for (config, read) in [("", false), ("", true), ("global_lock:true", true)] {
        let (dev, alloc) = setup(config);
        drop(alloc.alloc(14 * MIB, S0).unwrap());
        let p = alloc.alloc_in(12 * MIB, S0, tidepool::Residency::Persistent).unwrap();
        if read {
            assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 26 * MIB);
        }
        let scope = alloc.named_scope("step", S0);
        let x = scope.alloc(4 * MIB).unwrap();
        let u = scope.alloc_unbound(5 * MIB).unwrap();
        let (xp, up) = (x.ptr(), u.ptr());
        drop(x);
        drop(scope);
        let s = alloc.stats();
        let what = format!("{config:?}, read {read}");
        assert_eq!(up.0 - xp.0, 4 * MIB, "{what}");
        assert_eq!(s.blocks.reserved_bytes.transient.current, 10 * MIB, "{what}");
        assert_eq!(s.blocks.reserved_bytes.transient.freed, 18 * MIB, "{what}");
        assert_eq!(s.blocks.allocated_bytes.transient.current, 10 * MIB, "{what}");
        drop((u, p));
        check(&dev, &alloc);
    }
}
