//! Same-stream reuse of large-pool blocks: a freed large block waits in its stream's first cache
//! lane (one at most) and is handed out again only where that is exactly what freeing it and
//! taking the pool's best fit would do; every other search of the large pool frees it into the
//! pool first, so placement is the pool's best fit throughout. Exact addresses and counts.

use std::sync::Arc;
use tidepool::MIB;
use tidepool::device::{SIM_BASE, SimDevice};
use tidepool::{Allocator, Config, Device, DeviceAddr, Residency, StreamId};

const S0: StreamId = StreamId::DEFAULT;

fn setup(config: &str) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    (dev, alloc)
}

fn check(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

fn at(offset: u64) -> DeviceAddr {
    DeviceAddr(SIM_BASE + offset)
}

#[test]
fn a_large_block_is_reused_in_place_without_split_or_coalesce() {
    let (dev, alloc) = setup("");
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(a.ptr(), at(0));
    let n = alloc.global_lock_acquisitions();
    drop(a);
    assert_eq!(alloc.global_lock_acquisitions(), n, "the free takes no global lock");
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * MIB);
    // That read published the first allocation's figures, under the lock, once.
    assert_eq!(alloc.global_lock_acquisitions(), n + 1);
    let n = n + 1;
    for _ in 0..100 {
        let b = alloc.alloc(4 * MIB, S0).unwrap();
        assert_eq!(b.ptr(), at(0));
    }
    // The first reuse checks the pool under the lock; the pool cannot change without the lock,
    // so the others hand the checked block out without it.
    assert_eq!(alloc.global_lock_acquisitions(), n + 1, "one lock, for the first reuse's check");
    let s = alloc.stats();
    assert_eq!(s.num_device_alloc, 1);
    let count = s.blocks.allocation.large_pool;
    assert_eq!((count.current, count.peak, count.allocated, count.freed), (0, 1, 101, 101));
    assert_eq!(s.blocks.allocated_bytes.all.peak, 4 * MIB);
    assert_eq!(s.blocks.inactive_split_bytes.large_pool.current, 16 * MIB);
    assert_eq!(s.cached_fast_bytes, 4 * MIB);
    check(&dev, &alloc);
}

#[test]
fn a_large_block_is_not_reused_where_another_free_block_fits_better() {
    let (dev, alloc) = setup("");
    // Segment 1: [a 4][d 16]. Segment 2: [e 4][f 12][free 4].
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    let d = alloc.alloc(16 * MIB, S0).unwrap();
    let e = alloc.alloc(4 * MIB, S0).unwrap();
    let f = alloc.alloc(12 * MIB, S0).unwrap();
    assert_eq!(
        (a.ptr(), d.ptr(), e.ptr(), f.ptr()),
        (at(0), at(4 * MIB), at(20 * MIB), at(24 * MIB))
    );
    drop(a); // cached
    drop(d); // the stream holds a large block already: into the pool, [a][free 16]
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * MIB);
    // Freed, `a` would make segment 1 whole (20 MiB); the 4 MiB hole of segment 2 fits better.
    let b = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(b.ptr(), at(36 * MIB));
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.num_device_alloc), (0, 2));
    assert_eq!(s.blocks.inactive_split.large_pool.current, 0, "segment 1 is whole again");
    drop((b, e, f));
    check(&dev, &alloc);
}

/// Segment 1: [a 4][free 16] with `a` cached and checked (its reuse left the verdict in the
/// lane); segment 2: [e 4][f 12][g 4]. Returns the allocator with `e`, `f`, `g`.
/// Freed, a cached transient block would make its segment whole (20 MiB), and a persistent
/// segment of the stream has a 4 MiB hole: the search weighs the other residency's best fit
/// and takes the smaller (`residency.rs`), so the reuse check must too.
fn cached_block_and_a_persistent_hole(config: &str) -> Vec<DeviceAddr> {
    let (dev, alloc) = setup(config);
    // Transient segment: [a 4][d 16]. Persistent segment: [p 4][q 12][free 4].
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    let d = alloc.alloc(16 * MIB, S0).unwrap();
    let p = alloc.alloc_in(4 * MIB, S0, Residency::Persistent).unwrap();
    let q = alloc.alloc_in(12 * MIB, S0, Residency::Persistent).unwrap();
    let placed = vec![a.ptr(), d.ptr(), p.ptr(), q.ptr()];
    drop(a); // cached
    drop(d); // the stream holds a large block already: into the pool, [a][free 16]
    let b = alloc.alloc(4 * MIB, S0).unwrap();
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.num_device_alloc), (0, 2));
    assert_eq!(s.blocks.inactive_split.large_pool.current, 0, "the transient segment is whole");
    // Accounted by its segment's residency: persistent.
    let bytes = &s.blocks.allocated_bytes;
    assert_eq!((bytes.persistent.current, bytes.transient.current), (20 * MIB, 0));
    let placed = [placed, vec![b.ptr()]].concat();
    drop((b, p, q));
    check(&dev, &alloc);
    placed
}

#[test]
fn a_large_block_is_not_reused_where_the_other_residency_has_a_smaller_fit() {
    let want = vec![at(0), at(4 * MIB), at(20 * MIB), at(24 * MIB), at(36 * MIB)];
    assert_eq!(cached_block_and_a_persistent_hole(""), want);
    assert_eq!(cached_block_and_a_persistent_hole("global_lock:true"), want, "the pool's own");
    assert_eq!(cached_block_and_a_persistent_hole("max_split_size_mb:20"), want);
}

/// Two segments on `S0`: [a 4][d 16] at 0 and [e 4][f 12][g 4] at 20 MiB, all live.
fn two_segments(alloc: &Allocator<SimDevice>) -> [tidepool::Buffer<SimDevice>; 5] {
    let bufs = [4, 16, 4, 12, 4].map(|n| alloc.alloc(n * MIB, S0).unwrap());
    let at_ = |i: usize| bufs[i].ptr();
    assert_eq!((at_(0), at_(2), at_(4)), (at(0), at(20 * MIB), at(36 * MIB)));
    bufs
}

fn checked_block_then_a_better_fit(
    broken: bool,
) -> (Arc<SimDevice>, Allocator<SimDevice>, DeviceAddr, Vec<tidepool::Buffer<SimDevice>>) {
    let (dev, alloc) = setup("");
    alloc.set_broken(tidepool::hooks::Broken::StaleLargeVerdict, broken);
    let [a, d, e, f, g] = two_segments(&alloc);
    drop(a); // cached
    drop(d); // into the pool: [a][free 16]
    // Checked under the lock: freed, `a` would make segment 1 whole, the only free space.
    let n = alloc.global_lock_acquisitions();
    let x = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!((x.ptr(), alloc.global_lock_acquisitions()), (at(0), n + 1));
    drop(x); // cached again, still checked
    let again = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!((again.ptr(), alloc.global_lock_acquisitions()), (at(0), n + 1), "no lock");
    drop(again);
    // The lane holds `a`: `g` goes to the pool, under the lock, and is a better fit.
    drop(g);
    (dev, alloc, at(36 * MIB), vec![e, f])
}

#[test]
fn a_checked_large_block_is_checked_again_once_the_pool_changed() {
    let (dev, alloc, better, rest) = checked_block_then_a_better_fit(false);
    let n = alloc.global_lock_acquisitions();
    let y = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(y.ptr(), better, "the pool's best fit, not the block checked before");
    assert_eq!(alloc.global_lock_acquisitions(), n + 1);
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.num_device_alloc), (0, 2));
    assert_eq!(s.blocks.inactive_split.large_pool.current, 0, "segment 1 is whole again");
    drop((y, rest));
    check(&dev, &alloc);
}

/// The deliberate bug: the verdict is trusted after the pool changed, and the test above sees
/// the block placed where the pool would not put it.
#[test]
fn a_stale_verdict_is_caught() {
    let (dev, alloc, better, rest) = checked_block_then_a_better_fit(true);
    let y = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(y.ptr(), at(0));
    assert_ne!(y.ptr(), better);
    drop((y, rest));
    alloc.set_broken(tidepool::hooks::Broken::StaleLargeVerdict, false);
    check(&dev, &alloc);
}

#[test]
fn any_other_search_of_the_large_pool_sees_the_cached_block_coalesced() {
    let (dev, alloc) = setup("");
    drop(alloc.alloc(4 * MIB, S0).unwrap());
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * MIB);
    // 18 MiB does not fit the 16 MiB tail, but does fit the whole segment once `a` is freed.
    let b = alloc.alloc(18 * MIB, S0).unwrap();
    assert_eq!(b.ptr(), at(0));
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.num_device_alloc), (0, 1));
    drop(b);
    check(&dev, &alloc);
}

#[test]
fn one_large_block_per_stream_waits_the_others_go_to_the_pool() {
    let (dev, alloc) = setup("");
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    let b = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(b.ptr(), at(4 * MIB));
    drop(a);
    drop(b); // merges with the 12 MiB tail
    let s = alloc.stats();
    assert_eq!(s.cached_fast_bytes, 4 * MIB);
    assert_eq!(s.blocks.inactive_split_bytes.large_pool.current, 16 * MIB);
    assert_eq!(s.blocks.inactive_split.large_pool.current, 1);
    // [a][free 16]: `a` is the best fit again.
    let c = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!((c.ptr(), alloc.stats().cached_fast_bytes), (at(0), 0));
    drop(c);
    check(&dev, &alloc);
}

#[test]
fn a_different_request_of_the_class_is_reused_and_accounted_under_the_lock() {
    let (dev, alloc) = setup("");
    drop(alloc.alloc(4 * MIB, S0).unwrap());
    let b = alloc.alloc(4 * MIB - 100, S0).unwrap();
    assert_eq!((b.ptr(), b.block_size()), (at(0), 4 * MIB));
    let s = alloc.stats();
    assert_eq!(s.blocks.requested_bytes.all.current, 4 * MIB - 100);
    assert_eq!(s.blocks.requested_bytes.all.allocated, 8 * MIB - 100);
    assert_eq!(s.cached_fast_bytes, 0);
    drop(b);
    check(&dev, &alloc);
}

#[test]
fn own_segments_are_reused_and_still_move_to_other_streams() {
    let (dev, alloc) = setup("");
    let s1 = dev.create_stream().unwrap();
    // 11 MiB + 1 gets its own 12 MiB segment; freed, it waits in the cache of S0.
    drop(alloc.alloc(11 * MIB + 1, S0).unwrap());
    let a = alloc.alloc(11 * MIB + 1, S0).unwrap();
    assert_eq!((a.ptr(), a.block_size()), (at(0), 12 * MIB));
    drop(a);
    assert_eq!(alloc.stats().cached_fast_bytes, 12 * MIB);
    // Another stream's search frees it first, then takes the whole segment (no new one).
    let b = alloc.alloc(11 * MIB + 1, s1).unwrap();
    assert_eq!(b.ptr(), at(0));
    let s = alloc.stats();
    assert_eq!((s.num_device_alloc, s.cached_fast_bytes), (1, 0));
    drop(b);
    check(&dev, &alloc);
}

#[test]
fn without_the_fast_cache_or_after_record_stream_large_blocks_go_to_the_pool() {
    let (dev, alloc) = setup("fast_cache:false");
    drop(alloc.alloc(4 * MIB, S0).unwrap());
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.blocks.inactive_split.all.current), (0, 0));
    check(&dev, &alloc);

    let (dev, alloc) = setup("");
    let s1 = dev.create_stream().unwrap();
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    alloc.record_stream(&a, s1).unwrap();
    drop(a);
    assert_eq!(alloc.stats().cached_fast_bytes, 0);
    alloc.synchronize().unwrap();
    check(&dev, &alloc);
}

/// A kernel on `stream` that runs until the returned gate opens: work the events recorded after
/// it wait for.
fn gated_work(dev: &SimDevice, stream: StreamId) -> std::sync::mpsc::Sender<()> {
    use tidepool::device::{Kernel, Launch};
    let (open, gate) = std::sync::mpsc::channel::<()>();
    dev.launch(
        stream,
        Kernel::new("gated", vec![], move |_| {
            let _ = gate.recv();
        }),
    )
    .unwrap();
    open
}

/// Segment 1: [a 4][free 16] with `a` cached; segment 2: [e 4][f 12][g 4] with `g` freed while
/// its use on another stream runs (pending). With `checked`, a reuse of `a` checked under the
/// lock while `g` is pending, then `a` cached again. Then `g`'s use completes (no allocator call
/// sees it). Returns the allocator with `e`, `f`.
fn cached_block_and_a_pending_better_fit(
    checked: bool,
) -> (Arc<SimDevice>, Allocator<SimDevice>, Vec<tidepool::Buffer<SimDevice>>) {
    let (dev, alloc) = setup("");
    let s1 = dev.create_stream().unwrap();
    let [a, d, e, f, g] = two_segments(&alloc);
    let gate = gated_work(&dev, s1);
    alloc.record_stream(&g, s1).unwrap();
    drop(g); // pending on `s1`'s kernel
    drop(a); // cached
    drop(d); // into the pool: [a][free 16]
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * MIB);
    if checked {
        // `g` pending: freed, `a` would make segment 1 whole, the only free space.
        let x = alloc.alloc(4 * MIB, S0).unwrap();
        assert_eq!(x.ptr(), at(0));
        drop(x); // cached again
    }
    gate.send(()).unwrap();
    dev.synchronize().unwrap();
    (dev, alloc, vec![e, f])
}

/// `g`'s event completed: the allocation polls it before the reuse check (as PyTorch's `malloc`
/// polls before its search), and `g`'s hole is the best fit, not the cached block.
#[test]
fn a_reuse_check_sees_the_blocks_whose_events_completed() {
    let (dev, alloc, rest) = cached_block_and_a_pending_better_fit(false);
    let y = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(y.ptr(), at(36 * MIB), "the completed block's hole, not the cached block");
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.num_device_alloc), (0, 2));
    assert_eq!(s.blocks.inactive_split.large_pool.current, 0, "segment 1 is whole again");
    assert_eq!(s.blocks.requested_bytes.all.current, 20 * MIB);
    drop((y, rest));
    check(&dev, &alloc);
}

/// A reuse checked while `g` was pending leaves no verdict for a hit to trust: `g`'s event
/// completes with no global-lock section, so the next request is checked again, under the lock.
#[test]
fn a_reuse_checked_while_blocks_are_pending_is_checked_again() {
    let (dev, alloc, rest) = cached_block_and_a_pending_better_fit(true);
    let n = alloc.global_lock_acquisitions();
    let y = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(y.ptr(), at(36 * MIB), "the completed block's hole, not the cached block");
    assert_eq!(alloc.global_lock_acquisitions(), n + 1);
    let s = alloc.stats();
    assert_eq!((s.cached_fast_bytes, s.num_device_alloc), (0, 2));
    assert_eq!(s.blocks.inactive_split.large_pool.current, 0, "segment 1 is whole again");
    drop((y, rest));
    check(&dev, &alloc);
}
