//! Private pools (`MemPool`, `Allocator::use_pool`): routing by stream, exact addresses and
//! bytes per pool, teardown with live buffers, nested guards, refusals, `use_on_oom`.

use std::sync::Arc;
use tidepool::MIB;
use tidepool::device::SIM_BASE;
use tidepool::hooks::Broken;
use tidepool::{AllocError, Allocator, Config, Device, MemPool, PoolOptions, SimDevice, StreamId};

const SEG: u64 = 2 * MIB; // a small-pool segment

fn allocated(p: &MemPool<SimDevice>) -> u64 {
    p.stats().blocks.allocated_bytes.all.current
}

fn reserved(p: &MemPool<SimDevice>) -> u64 {
    p.stats().blocks.reserved_bytes.all.current
}

/// Once the device finished its work: no segment left on it, and no sanitizer finding.
fn nothing_left(dev: &SimDevice) {
    dev.synchronize().unwrap();
    assert!(dev.live_segments().is_empty(), "{:?}", dev.live_segments());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

fn check(alloc: &Allocator<SimDevice>, pools: &[&MemPool<SimDevice>]) {
    alloc.check_invariants().unwrap();
    for p in pools {
        p.check_invariants().unwrap();
    }
}

#[test]
fn guard_routes_its_stream_and_the_pool_is_freed_as_a_whole() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let a = alloc.alloc(1000, s).unwrap();
    assert_eq!(a.ptr().0, SIM_BASE);

    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    assert_ne!(pool.id(), 0);
    let guard = alloc.use_pool(&pool, s).unwrap();
    let b = alloc.alloc(1000, s).unwrap(); // the pool's own segment
    assert_eq!(b.ptr().0, SIM_BASE + SEG);
    let c = alloc.alloc(1000, StreamId::DEFAULT).unwrap(); // not routed: general
    assert_eq!(c.ptr().0, SIM_BASE + 2 * SEG);
    let b2 = alloc.alloc(3000, s).unwrap(); // the pool again, next to b
    assert_eq!(b2.ptr().0, SIM_BASE + SEG + 1024);
    check(&alloc, &[&pool]);
    assert_eq!((allocated(&pool), reserved(&pool)), (1024 + 3072, SEG));
    let general = alloc.stats();
    assert_eq!(general.blocks.allocated_bytes.all.current, 2048);
    assert_eq!(general.blocks.reserved_bytes.all.current, 2 * SEG);
    assert_eq!(pool.snapshot().len(), 1);
    assert_eq!(pool.snapshot()[0].address.0, SIM_BASE + SEG);

    drop(guard);
    let d = alloc.alloc(1000, s).unwrap(); // general again: next to a
    assert_eq!(d.ptr().0, SIM_BASE + 1024);
    drop(b);
    check(&alloc, &[&pool]);
    assert_eq!((allocated(&pool), reserved(&pool)), (3072, SEG));
    assert_eq!(dev.live_segments().len(), 3);

    // Dropped with a live buffer: the segment stays until the buffer returns.
    let frees = dev.counters().frees;
    drop(pool);
    assert_eq!(dev.live_segments().len(), 3);
    assert_eq!(dev.counters().frees, frees);
    drop(b2);
    assert_eq!(dev.counters().frees, frees + 1);
    assert_eq!(
        dev.live_segments(),
        vec![
            (tidepool::DeviceAddr(SIM_BASE), SEG),
            (tidepool::DeviceAddr(SIM_BASE + 2 * SEG), SEG)
        ]
    );
    check(&alloc, &[]);
    drop((a, c, d));
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
}

#[test]
fn guards_nest_per_stream_and_scopes_refuse_routed_streams() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let (p1, p2) = (
        alloc.new_pool(PoolOptions::default()).unwrap(),
        alloc.new_pool(PoolOptions::default()).unwrap(),
    );
    let g1 = alloc.use_pool(&p1, s).unwrap();
    let x = alloc.alloc(512, s).unwrap();
    let g2 = alloc.use_pool(&p2, s).unwrap();
    let y = alloc.alloc(512, s).unwrap();
    let scope = alloc.scope(s);
    assert_eq!(scope.alloc(512).err(), Some(AllocError::StreamRouted(s)));
    assert!(matches!(scope.alloc_unbound(512), Err(AllocError::StreamRouted(t)) if t == s));
    drop(scope);
    drop(g2);
    let z = alloc.alloc(512, s).unwrap();
    drop(g1);
    assert_eq!((allocated(&p1), allocated(&p2)), (1024, 512));
    assert_eq!(x.ptr().0, SIM_BASE);
    assert_eq!(y.ptr().0, SIM_BASE + SEG);
    assert_eq!(z.ptr().0, SIM_BASE + 512);
    // Unrouted again: scopes work.
    let scope = alloc.scope(s);
    let w = scope.alloc(512).unwrap();
    assert_eq!(w.ptr().0, SIM_BASE + 2 * SEG);
    drop(w);
    drop(scope);
    // A pool buffer is recorded and freed through the general allocator's calls.
    let t = dev.create_stream().unwrap();
    alloc.record_stream(&x, t).unwrap();
    alloc.free_batch(vec![x, y, z]).unwrap();
    check(&alloc, &[&p1, &p2]);
    assert_eq!((allocated(&p1), allocated(&p2)), (0, 0));
    drop((p1, p2));
    alloc.empty_cache().unwrap();
    nothing_left(&dev);
}

#[test]
fn pools_of_another_allocator_and_unknown_streams_are_refused() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let s = dev.create_stream().unwrap();
    let a = Allocator::new(dev.clone(), Config::default()).unwrap();
    let b = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pb = b.new_pool(PoolOptions::default()).unwrap();
    assert_eq!(
        a.use_pool(&pb, s).err().map(|e| e.to_string()),
        Some(AllocError::ForeignPool.to_string())
    );
    assert!(matches!(a.use_pool(&pb, s), Err(AllocError::ForeignPool)));
    let pa = a.new_pool(PoolOptions::default()).unwrap();
    assert!(matches!(a.use_pool(&pa, StreamId(77)), Err(AllocError::UnknownStream(_))));
    // A pool's buffer is foreign to another allocator.
    let g = a.use_pool(&pa, s).unwrap();
    let x = a.alloc(512, s).unwrap();
    drop(g);
    assert_eq!(b.record_stream(&x, s), Err(AllocError::ForeignBuffer));
    assert_eq!(b.free_batch(vec![x]), Err(AllocError::ForeignBuffer));
    assert_eq!(allocated(&pa), 0);
}

#[test]
fn use_on_oom_pools_give_their_free_segments_back() {
    const CAP: u64 = 64 * MIB;
    for use_on_oom in [false, true] {
        let dev = Arc::new(SimDevice::new(CAP));
        let s = dev.create_stream().unwrap();
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let pool = alloc.new_pool(PoolOptions::default().with_use_on_oom(use_on_oom)).unwrap();
        let g = alloc.use_pool(&pool, s).unwrap();
        drop(alloc.alloc(30 * MIB, s).unwrap()); // cached in the pool
        drop(g);
        assert_eq!((allocated(&pool), reserved(&pool)), (0, 30 * MIB));
        let r = alloc.alloc(40 * MIB, s);
        match use_on_oom {
            false => {
                assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{r:?}");
                assert_eq!(reserved(&pool), 30 * MIB);
            }
            true => {
                let b = r.unwrap();
                assert_eq!(b.len(), 40 * MIB);
                assert_eq!(reserved(&pool), 0);
                assert_eq!(dev.reserved_bytes(), 40 * MIB);
            }
        }
        check(&alloc, &[&pool]);
    }
}

/// A request that the `use_on_oom` pool's release does not rescue is one failed allocation:
/// `num_ooms` counts it once, not once per attempt inside it (it counted 2 before).
#[test]
fn a_request_a_use_on_oom_pool_cannot_rescue_counts_one_oom() {
    let dev = Arc::new(SimDevice::new(64 * MIB));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pool = alloc.new_pool(PoolOptions::default().with_use_on_oom(true)).unwrap();
    let g = alloc.use_pool(&pool, s).unwrap();
    drop(alloc.alloc(30 * MIB, s).unwrap()); // cached in the pool
    drop(g);
    assert!(matches!(alloc.alloc(80 * MIB, s), Err(AllocError::OutOfMemory(_))));
    assert_eq!(reserved(&pool), 0, "the pool gave its segment back");
    assert_eq!(alloc.stats().num_ooms, 1);
    check(&alloc, &[&pool]);
}

/// The same for a request a guard routes to a pool, where the general allocator's release does
/// not rescue it: the pool, which counted the failure, counts it once; the general allocator
/// counts nothing.
#[test]
fn a_routed_request_the_general_allocator_cannot_rescue_counts_one_oom_in_its_pool() {
    let dev = Arc::new(SimDevice::new(64 * MIB));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    let live = alloc.alloc(20 * MIB, s).unwrap();
    drop(alloc.alloc(30 * MIB, s).unwrap()); // cached in the general allocator
    let g = alloc.use_pool(&pool, s).unwrap();
    assert!(matches!(alloc.alloc(50 * MIB, s), Err(AllocError::OutOfMemory(_))));
    drop(g);
    assert_eq!(alloc.reserved_bytes(), 20 * MIB, "the general allocator gave its cache back");
    assert_eq!((pool.stats().num_ooms, alloc.stats().num_ooms), (1, 0));
    drop(live);
    check(&alloc, &[&pool]);
}

#[test]
fn a_pool_reserves_no_initial_pool_of_its_own() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let conf = Config::parse("initial_pool_size_mb:64").unwrap();
    let alloc = Allocator::new(dev.clone(), conf).unwrap();
    assert_eq!(dev.reserved_bytes(), 64 * MIB);
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    assert_eq!(dev.reserved_bytes(), 64 * MIB);
    assert_eq!(reserved(&pool), 0);
}

/// A scope's allocation on a stream routed to a private pool *after* the scope checked the
/// route: here in the out-of-memory callback of that very allocation (another thread beginning
/// a guard or a capture at that moment does the same). The pool serves it, so its free goes
/// to the pool; the scope must not keep the block for local reuse and hand it back to the
/// general pool at its end (broken mode `ScopeKeepsRouted`: the general pool's tables take a
/// block id of the pool's, a double free or a stale block found by the checker).
fn routed_after_the_scope_checked(broken: bool) -> Result<(), String> {
    let dev = Arc::new(SimDevice::new(64 * MIB));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    alloc.set_broken(tidepool::hooks::Broken::ScopeKeepsRouted, broken);
    let pool = Arc::new(alloc.new_pool(PoolOptions::default()).unwrap());
    // The callback's allocator handle lives for the test's process, so its guard can be kept.
    let inner: &'static Allocator<SimDevice> = Box::leak(Box::new(alloc.clone()));
    let hoard = Arc::new(std::sync::Mutex::new(vec![alloc.alloc(60 * MIB, s).unwrap()]));
    let guard = Arc::new(std::sync::Mutex::new(None));
    let (h, g, p) = (hoard.clone(), guard.clone(), pool.clone());
    alloc.set_failure_callback(move |_, attempt| {
        if attempt > 1 {
            return false;
        }
        h.lock().unwrap().clear();
        inner.empty_cache().unwrap();
        *g.lock().unwrap() = Some(inner.use_pool(&p, s).unwrap());
        true
    });
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let scope = alloc.scope(s);
        let b = scope.alloc(8 * MIB).unwrap();
        assert_eq!(allocated(&pool), 8 * MIB, "the pool served the scope's allocation");
        assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 0);
        guard.lock().unwrap().take(); // the route ends
        drop(b);
        drop(scope);
        alloc.check_invariants()?;
        pool.check_invariants()?;
        // Everything went back where it came from: the general pool has nothing allocated,
        // the pool's block is free, and the next allocation takes it from the general pool.
        assert_eq!(allocated(&pool), 0);
        assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 0);
        let again = alloc.alloc(8 * MIB, s).unwrap();
        alloc.check_invariants()?;
        drop(again);
        Ok::<(), String>(())
    }));
    alloc.clear_failure_callback();
    run.unwrap_or_else(|_| Err("panicked".into()))
}

#[test]
fn a_scope_never_keeps_a_block_a_private_pool_served() {
    routed_after_the_scope_checked(false).unwrap();
    // Broken: the scope keeps the pool's block and its exit frees it in the general pool.
    assert!(routed_after_the_scope_checked(true).is_err());
}

/// A stream destroyed while a guard routes it to a pool (by this allocator, or by another
/// allocator on the device and then released here): allocations on it are refused, through
/// the pool's stream caches as through its whole path (broken mode `RoutedDeadStreams`: the
/// pool still knows the stream and its cached block serves the allocation).
fn alloc_on_a_destroyed_routed_stream(by_other: bool, broken: bool) -> Result<(), String> {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    alloc.set_broken(tidepool::hooks::Broken::RoutedDeadStreams, broken);
    let other = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    let guard = alloc.use_pool(&pool, s).unwrap();
    let a = alloc.alloc(4096, s).unwrap(); // the pool's segment
    assert_eq!(a.ptr().0, SIM_BASE);
    let b = alloc.alloc(3 * MIB, s).unwrap(); // a large one, cached too
    drop(a); // cached in the pool's lane of `s`
    drop(b);
    assert_eq!(allocated(&pool), 0);
    if by_other {
        other.destroy_stream(s).map_err(|e| e.to_string())?;
        match alloc.release_stream(s) {
            Ok(()) | Err(AllocError::UnknownStream(_)) => {}
            Err(e) => return Err(format!("release_stream: {e}")),
        }
    } else {
        alloc.destroy_stream(s).map_err(|e| e.to_string())?;
    }
    for bytes in [4096, 3 * MIB, 100] {
        match alloc.alloc(bytes, s) {
            Err(AllocError::UnknownStream(g)) if g == s => {}
            r => return Err(format!("alloc of {bytes} on the destroyed {s}: {r:?}")),
        }
    }
    assert_eq!(allocated(&pool), 0);
    drop(guard);
    alloc.check_invariants()?;
    pool.check_invariants()?;
    // The pool's memory is still the pool's, and goes back with it.
    pool.empty_cache().map_err(|e| e.to_string())?;
    assert_eq!(reserved(&pool), 0);
    Ok(())
}

#[test]
fn a_routed_stream_destroyed_under_its_guard_is_refused() {
    for by_other in [false, true] {
        alloc_on_a_destroyed_routed_stream(by_other, false).unwrap();
        // Broken: the pool serves the destroyed stream from its cache.
        let e = alloc_on_a_destroyed_routed_stream(by_other, true).unwrap_err();
        assert!(e.starts_with("alloc of 4096 on the destroyed"), "{by_other}: {e}");
    }
}

/// A graph captured into a `use_on_oom` pool (a temporary freed during the capture), then an
/// out-of-memory error in the general allocator, whose ladder asks the `use_on_oom` pools for
/// their free segments: the violations the graph's replay then meets.
fn oom_ladder_over_a_graph_pool(broken: bool) -> Vec<tidepool::device::Violation> {
    use tidepool::device::{Access, AccessKind, Kernel, Launch};
    let dev = Arc::new(SimDevice::backed(64 * MIB));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    alloc.set_broken(Broken::GraphPoolReleased, broken);
    let pool = alloc.new_pool(PoolOptions::default().with_use_on_oom(true)).unwrap();
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let t = alloc.alloc(4096, s).unwrap(); // a temporary: the pool's one segment
    let p = t.ptr();
    let acc = vec![Access { ptr: p, bytes: 4096, kind: AccessKind::Write }];
    dev.launch(s, Kernel::replayable("tmp", acc, move |m| drop(m.write(p, &[1; 4096])))).unwrap();
    drop(t);
    let graph = alloc.end_capture(s).unwrap();
    let hog = alloc.alloc(60 * MIB, StreamId::DEFAULT).unwrap();
    let r = alloc.alloc(8 * MIB, StreamId::DEFAULT);
    assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{r:?}");
    let kept = if broken { 0 } else { SEG };
    assert_eq!(reserved(&pool), kept);
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    drop((graph, hog, pool));
    alloc.check_invariants().unwrap();
    dev.violations()
}

/// The ladder never returns the free segments of a pool a graph uses: its free blocks are what
/// the replays write. (Every release looks under the pool's lock, so a capture that begins
/// while the ladder runs is seen, or allocates only after the release.) With
/// `Broken::GraphPoolReleased` the ladder releases the temporary's segment and the replay
/// writes released memory.
#[test]
fn the_oom_ladder_never_releases_a_pool_a_graph_uses() {
    let v = oom_ladder_over_a_graph_pool(false);
    assert!(v.is_empty(), "{v:?}");
    let v = oom_ladder_over_a_graph_pool(true);
    assert!(v.iter().any(|v| v.op.contains("unallocated")), "{v:?}");
}

/// A `mem::forget`ten guard routes its stream for good, and its pool lives on behind the route
/// when its last `MemPool` handle goes: the stream's allocations are the pool's (the general
/// allocator reserves nothing), its free memory serves the stream again at the same address
/// (the general allocator's `empty_cache` empties it, as the test after this one shows),
/// scopes on the stream are refused, a capture on it still allocates from the graph's own pool,
/// and when the allocator goes, the pool goes with it: nothing is left on the device.
#[test]
fn a_forgotten_guard_routes_for_good_and_its_pool_goes_with_the_allocator() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    std::mem::forget(alloc.use_pool(&pool, s).unwrap());
    drop(pool);
    let x = alloc.alloc(4096, s).unwrap();
    assert_eq!(x.ptr().0, SIM_BASE);
    assert!(!alloc.owns(&x), "the pool's buffer");
    assert_eq!((alloc.allocated_bytes(), alloc.reserved_bytes()), (0, 0));
    assert_eq!(dev.reserved_bytes(), SEG);
    let scope = alloc.scope(s);
    assert_eq!(scope.alloc(512).err(), Some(AllocError::StreamRouted(s)));
    drop(scope);
    drop(x);
    assert_eq!(alloc.alloc(4096, s).unwrap().ptr().0, SIM_BASE, "the pool's block again");
    let (graph, at) = alloc.capture(s, None, || alloc.alloc(4096, s).unwrap().ptr()).unwrap();
    assert_eq!(at.0, SIM_BASE + SEG, "the graph's pool: a segment of its own");
    drop(graph);
    alloc.check_invariants().unwrap();
    drop(alloc);
    nothing_left(&dev);
}

/// The general allocator's `empty_cache` empties a pool that only a `mem::forget`ten guard's
/// route reaches (its last `MemPool` handle gone), as the pool's own would: its free segment
/// goes back, and the routed stream's next allocation reserves a new one. A pool someone still
/// holds is left to them. Before, nothing could give that cache back while the allocator lived
/// (found in review; broken build `forgotten_guard_pool_kept`).
#[test]
fn the_allocators_empty_cache_empties_a_pool_only_a_forgotten_guard_reaches() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let (forgotten, held) = (
        alloc.new_pool(PoolOptions::default()).unwrap(),
        alloc.new_pool(PoolOptions::default()).unwrap(),
    );
    std::mem::forget(alloc.use_pool(&forgotten, s).unwrap());
    std::mem::forget(alloc.use_pool(&held, t).unwrap());
    drop(forgotten);
    drop((alloc.alloc(4096, s).unwrap(), alloc.alloc(4096, t).unwrap()));
    assert_eq!(dev.live_segments().len(), 2);
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_segments(), vec![(tidepool::DeviceAddr(SIM_BASE + SEG), SEG)], "held's");
    assert_eq!(held.stats().blocks.reserved_bytes.all.current, SEG);
    let x = alloc.alloc(4096, s).unwrap();
    assert_eq!(x.ptr().0, SIM_BASE + 2 * SEG, "a new segment of the forgotten guard's pool");
    assert!(!alloc.owns(&x));
    assert_eq!(alloc.reserved_bytes(), 0);
    drop((x, held));
    drop(alloc);
    nothing_left(&dev);
}

/// A closed general allocator (its last handle gone, a buffer of it still live: here one
/// `mem::forget`ten) keeps only its live buffers' segments; the pool only a forgotten guard's
/// route reached goes with the routes, its cache back to the device at once. Before, the route
/// kept the pool, and its cached segment stayed as long as the allocator's last buffer — for
/// good here (found in review; broken build `closed_keeps_routes`).
#[test]
fn a_closed_allocator_lets_go_of_the_pools_of_forgotten_guards() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    std::mem::forget(alloc.use_pool(&pool, s).unwrap());
    drop(pool);
    drop(alloc.alloc(4096, s).unwrap()); // the pool's segment, cached
    let kept = alloc.alloc(4096, t).unwrap();
    assert!(alloc.owns(&kept));
    assert_eq!(kept.ptr().0, SIM_BASE + SEG);
    std::mem::forget(kept);
    drop(alloc);
    let only_kept = vec![(tidepool::DeviceAddr(SIM_BASE + SEG), SEG)];
    assert_eq!(dev.live_segments(), only_kept, "the forgotten buffer's segment only");
    assert!(dev.violations().is_empty());
}

/// A device whose captures forbid nothing (the trait's default `capture_underway`: never, as a
/// device in CUDA's relaxed capture mode may answer): the allocator climbs its out-of-memory
/// ladder during a capture too. Everything else is the simulator's.
struct Relaxed(SimDevice);

impl Device for Relaxed {
    fn name(&self) -> String {
        self.0.name()
    }
    fn reserve(&self, bytes: u64) -> Result<tidepool::DeviceAddr, tidepool::DeviceError> {
        self.0.reserve(bytes)
    }
    fn release(&self, ptr: tidepool::DeviceAddr) -> Result<(), tidepool::DeviceError> {
        self.0.release(ptr)
    }
    fn mem_info(&self) -> Result<tidepool::device::MemInfo, tidepool::DeviceError> {
        self.0.mem_info()
    }
    fn create_stream(&self) -> Result<StreamId, tidepool::DeviceError> {
        self.0.create_stream()
    }
    fn destroy_stream(&self, stream: StreamId) -> Result<(), tidepool::DeviceError> {
        self.0.destroy_stream(stream)
    }
    fn has_stream(&self, stream: StreamId) -> bool {
        self.0.has_stream(stream)
    }
    fn create_event(&self) -> Result<tidepool::device::EventId, tidepool::DeviceError> {
        self.0.create_event()
    }
    fn destroy_event(&self, event: tidepool::device::EventId) -> Result<(), tidepool::DeviceError> {
        self.0.destroy_event(event)
    }
    fn record_event(
        &self,
        event: tidepool::device::EventId,
        stream: StreamId,
    ) -> Result<(), tidepool::DeviceError> {
        self.0.record_event(event, stream)
    }
    fn query_event(&self, event: tidepool::device::EventId) -> Result<bool, tidepool::DeviceError> {
        self.0.query_event(event)
    }
    fn wait_event(
        &self,
        stream: StreamId,
        event: tidepool::device::EventId,
    ) -> Result<(), tidepool::DeviceError> {
        self.0.wait_event(stream, event)
    }
    fn synchronize_event(
        &self,
        event: tidepool::device::EventId,
    ) -> Result<(), tidepool::DeviceError> {
        self.0.synchronize_event(event)
    }
    fn synchronize(&self) -> Result<(), tidepool::DeviceError> {
        self.0.synchronize()
    }
    fn capture_of(&self, stream: StreamId) -> Option<StreamId> {
        self.0.capture_of(stream)
    }
}

impl tidepool::Capture for Relaxed {
    fn begin_capture(&self, stream: StreamId) -> Result<(), tidepool::DeviceError> {
        self.0.begin_capture(stream)
    }
    fn end_capture(&self, stream: StreamId) -> Result<tidepool::GraphId, tidepool::DeviceError> {
        self.0.end_capture(stream)
    }
    fn launch_graph(
        &self,
        graph: tidepool::GraphId,
        stream: StreamId,
    ) -> Result<(), tidepool::DeviceError> {
        self.0.launch_graph(graph, stream)
    }
    fn destroy_graph(&self, graph: tidepool::GraphId) -> Result<(), tidepool::DeviceError> {
        self.0.destroy_graph(graph)
    }
}

/// The ladder's first rung under `max_split_size_mb` (PyTorch's
/// `release_available_cached_blocks`) in a pool a capture uses: the pool's free oversize
/// segment (40 MiB, freed during the capture) may not go (the graph's replays write it), so
/// the rung released nothing, and says so: the ladder goes on to its wait and its last attempt.
/// Before, the rung answered "found" for the segment it had not released, and the request
/// tried the device once more for nothing (a third failed reservation where two are made).
#[test]
fn the_oversize_rung_in_a_pool_a_capture_uses_says_it_released_nothing() {
    let dev = Arc::new(Relaxed(SimDevice::new(50 * MIB)));
    let s = dev.create_stream().unwrap();
    let config = Config::default().with_max_split_size_mb(20).with_fast_cache(false);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let a = alloc.alloc(40 * MIB, s).unwrap(); // an oversize segment of its own
    drop(a);
    assert_eq!(pool.stats().blocks.reserved_bytes.all.current, 40 * MIB);
    let failed_before = dev.0.counters().failed_mallocs;
    // 12 MiB: the oversize block may not serve it, and the device has 10 MiB left.
    let r = alloc.alloc(12 * MIB, s);
    assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{:?}", r.map(|b| b.len()));
    assert_eq!(
        dev.0.counters().failed_mallocs - failed_before,
        2,
        "the first attempt and the ladder's last one"
    );
    assert_eq!(pool.stats().blocks.reserved_bytes.all.current, 40 * MIB, "kept for the graph");
    let graph = alloc.end_capture(s).unwrap();
    pool.check_invariants().unwrap();
    alloc.check_invariants().unwrap();
    drop(graph);
    drop(pool);
    drop(alloc);
    dev.0.synchronize().unwrap();
    assert_eq!(dev.0.live_segments(), vec![]);
}
