//! CUDA-graph capture through the allocator on SimDevice: captured allocations come from the
//! graph's private pool, frees during capture are reused only inside the graph, replays really
//! read and write memory and the sanitizer checks each one against the current owners.

mod common;

use common::{N, device_bytes};
use std::sync::Arc;
use tidepool::device::{Access, AccessKind, Capture, DeviceError, Kernel, Launch, SIM_BASE};
use tidepool::hooks::Broken;
use tidepool::{AllocError, Allocator, Buffer, Config, Device, MIB, SimDevice, StreamId};

const SEG: u64 = 2 * MIB;

fn acc(b: &Buffer<SimDevice>, kind: AccessKind) -> Access {
    Access { ptr: b.ptr(), bytes: N, kind }
}

/// A replayable kernel: `dst[i] = f(src[i])` over N bytes.
fn map(src: &Buffer<SimDevice>, dst: &Buffer<SimDevice>, f: fn(u8) -> u8) -> Kernel {
    let (s, d) = (src.ptr(), dst.ptr());
    Kernel::replayable(
        "map",
        vec![acc(src, AccessKind::Read), acc(dst, AccessKind::Write)],
        move |m| {
            let mut v = vec![0u8; N as usize];
            m.read(s, &mut v).unwrap();
            v.iter_mut().for_each(|x| *x = f(*x));
            m.write(d, &v).unwrap();
        },
    )
}

/// A one-shot kernel writing `byte` over `b` (not captured).
fn fill(b: &Buffer<SimDevice>, byte: u8) -> Kernel {
    fill_at(b.ptr(), byte)
}

struct Setup {
    dev: Arc<SimDevice>,
    s: StreamId,
    alloc: Allocator<SimDevice>,
}

fn setup() -> Setup {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    Setup { dev, s, alloc }
}

#[test]
fn a_graph_replays_100_times_while_the_general_pool_is_used_in_between() {
    let Setup { dev, s, alloc } = setup();
    let input = alloc.alloc(N, s).unwrap(); // static input, general pool
    let scratch = alloc.alloc(N, s).unwrap(); // general, freed during the capture
    assert_eq!((input.ptr().0, scratch.ptr().0), (SIM_BASE, SIM_BASE + N));
    dev.launch(s, fill(&scratch, 0)).unwrap();

    alloc.begin_capture(s, None).unwrap();
    assert!(alloc.is_capturing(s));
    let tmp = alloc.alloc(N, s).unwrap(); // the graph's pool: its own segment
    assert_eq!(tmp.ptr().0, SIM_BASE + SEG);
    let out = alloc.alloc(N, s).unwrap();
    assert_eq!(out.ptr().0, SIM_BASE + SEG + N);
    dev.launch(s, map(&input, &tmp, |x| x + 1)).unwrap();
    dev.launch(s, map(&scratch, &out, |x| x)).unwrap(); // reads scratch ...
    dev.launch(s, map(&tmp, &out, |x| x * 2)).unwrap();
    let tmp_ptr = tmp.ptr();
    drop(tmp); // freed during capture: reused by the capture only
    drop(scratch); // ... which is freed during capture: the graph holds it
    let tmp2 = alloc.alloc(N, s).unwrap();
    assert_eq!(tmp2.ptr(), tmp_ptr);
    let res = alloc.alloc(N, s).unwrap();
    assert_eq!(res.ptr().0, SIM_BASE + SEG + 2 * N);
    dev.launch(s, map(&out, &tmp2, |x| x + 3)).unwrap();
    dev.launch(s, map(&tmp2, &res, |x| x)).unwrap();
    drop(tmp2);
    let graph = alloc.end_capture(s).unwrap();
    assert!(!alloc.is_capturing(s));
    assert_eq!(graph.held_buffers(), 1);
    let pool = graph.pool().clone();
    let ps = pool.stats();
    assert_eq!(ps.blocks.allocated_bytes.all.current, 2 * N); // out, res
    assert_eq!(ps.blocks.reserved_bytes.all.current, SEG);
    // input; scratch, held by the graph, is active but no longer allocated (as PyTorch counts a
    // block whose free waits).
    let general = alloc.stats().blocks;
    assert_eq!((general.allocated_bytes.all.current, general.active_bytes.all.current), (N, 2 * N));
    assert_eq!(dev.graph_counters().captured_kernels, 5);
    assert_eq!(dev.counters().launches, 1); // the fill only: nothing captured ran

    let pool_range = SIM_BASE + SEG..SIM_BASE + 2 * SEG;
    for i in 0..100u8 {
        dev.launch(s, fill(&input, i)).unwrap();
        graph.launch(s).unwrap();
        // The general pool in between, on the graph's stream and another.
        for stream in [s, StreamId::DEFAULT] {
            let x = alloc.alloc(N, stream).unwrap();
            assert!(!pool_range.contains(&x.ptr().0));
            assert_ne!(x.ptr().0, SIM_BASE + N, "the held buffer was reused");
            dev.launch(stream, fill(&x, 0xEE)).unwrap();
        }
        let want = (i.wrapping_add(1)).wrapping_mul(2).wrapping_add(3);
        assert_eq!(device_bytes(&dev, &res), vec![want; N as usize], "replay {i}");
        alloc.check_invariants().unwrap();
        pool.check_invariants().unwrap();
    }
    assert_eq!(dev.graph_counters().graph_launches, 100);
    assert_eq!(dev.graph_counters().replayed_kernels, 500);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    assert!(dev.kernel_failures().is_empty());

    // Teardown: the graph lets go of scratch and of the pool; the pool goes with its buffers.
    assert!(matches!(alloc.use_pool(&pool, s), Err(AllocError::PoolBusy { .. })));
    drop(graph);
    assert_eq!(dev.graph_counters().live_graphs, 0);
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, N);
    drop(pool);
    assert_eq!(dev.live_segments().len(), 3);
    drop((out, res));
    assert_eq!(dev.live_segments().len(), 2); // the general allocator's (s and default)
    drop(input);
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

/// The capture of the first test, cut down: a block freed during the capture, then a general
/// allocation of the same size on the same stream while the graph is alive.
fn capture_free_then_reuse(broken: bool) -> (Vec<tidepool::device::Violation>, bool) {
    let Setup { dev, s, alloc } = setup();
    alloc.set_broken(Broken::CaptureGeneral, broken);
    let out = alloc.alloc(N, s).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let tmp = alloc.alloc(N, s).unwrap();
    dev.launch(s, map(&out, &tmp, |x| x + 1)).unwrap();
    dev.launch(s, map(&tmp, &out, |x| x)).unwrap();
    let tmp_ptr = tmp.ptr();
    drop(tmp);
    let graph = alloc.end_capture(s).unwrap();
    let other = alloc.alloc(N, s).unwrap();
    let reused = other.ptr() == tmp_ptr;
    dev.launch(s, fill(&other, 9)).unwrap();
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    drop((graph, other, out));
    (dev.violations(), reused)
}

#[test]
fn capture_time_frees_are_not_reused_outside_the_graph() {
    let (v, reused) = capture_free_then_reuse(false);
    assert!(v.is_empty(), "{v:?}");
    assert!(!reused);
}

#[test]
fn the_sanitizer_catches_capture_frees_reused_outside_the_graph() {
    let (v, reused) = capture_free_then_reuse(true);
    assert!(reused, "the broken mode hands the captured block out again");
    assert_eq!(v[0].op, "handout of memory a CUDA graph uses");
    assert_eq!(v[0].bytes, N);
}

#[test]
fn graphs_share_a_pool_in_capture_order() {
    let Setup { dev, s, alloc } = setup();
    let input = alloc.alloc(N, s).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let t1 = alloc.alloc(N, s).unwrap();
    let o1 = alloc.alloc(N, s).unwrap();
    dev.launch(s, map(&input, &t1, |x| x + 1)).unwrap();
    dev.launch(s, map(&t1, &o1, |x| x + 1)).unwrap();
    let t1_ptr = t1.ptr();
    drop(t1);
    let g1 = alloc.end_capture(s).unwrap();
    // The second graph's capture reuses what the first freed (PyTorch's `pool=`): only through
    // the unsafe call; the safe one refuses a pool a live graph uses.
    let refused = alloc.begin_capture(s, Some(g1.pool()));
    assert!(matches!(refused, Err(AllocError::PoolBusy { .. })), "{refused:?}");
    // SAFETY: g1 and g2 are replayed in capture order on one stream, and o1 (g1's output, which
    // g2 reads) is read only before g2's replay could overwrite it — it never does: g2 reuses
    // only t1, which nothing reads after g1's replay.
    unsafe { alloc.begin_capture_sharing(s, g1.pool()) }.unwrap();
    let t2 = alloc.alloc(N, s).unwrap();
    assert_eq!(t2.ptr(), t1_ptr);
    let o2 = alloc.alloc(N, s).unwrap();
    dev.launch(s, map(&o1, &t2, |x| x * 3)).unwrap();
    dev.launch(s, map(&t2, &o2, |x| x)).unwrap();
    drop(t2);
    let g2 = alloc.end_capture(s).unwrap();
    assert_eq!(g1.pool().id(), g2.pool().id());
    assert_eq!(g1.pool().graphs(), 2);
    for i in 0..10u8 {
        dev.launch(s, fill(&input, i)).unwrap();
        g1.launch(s).unwrap();
        g2.launch(s).unwrap();
        assert_eq!(device_bytes(&dev, &o2), vec![(i + 2) * 3; N as usize]);
    }
    assert!(matches!(g1.pool().empty_cache(), Err(AllocError::PoolBusy { .. })));
    drop(g1);
    assert_eq!(g2.pool().graphs(), 1);
    drop((g2, o1, o2, input));
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn a_capture_makes_no_call_cuda_forbids_and_refuses_what_it_cannot_do() {
    let Setup { dev, s, alloc } = setup();
    let t = dev.create_stream().unwrap();
    // Memory cached for the out-of-memory ladder to release, and an event pending.
    let other = alloc.alloc(N, t).unwrap();
    other.record_stream(s).unwrap();
    drop(other);
    drop(alloc.alloc(64 * MIB, t).unwrap());
    assert!(matches!(alloc.begin_capture(StreamId::DEFAULT, None), Err(AllocError::Device(_))));
    assert!(!alloc.is_capturing(StreamId::DEFAULT));
    alloc.begin_capture(s, None).unwrap();
    assert!(matches!(alloc.begin_capture(s, None), Err(AllocError::Capture { .. })));
    let syncs = dev.counters().host_syncs;
    let frees = dev.counters().frees;
    // Out of memory during capture: no sync, no release, straight to the error.
    assert!(matches!(alloc.alloc(200 * MIB, s), Err(AllocError::OutOfMemory(_))));
    alloc.empty_cache().unwrap(); // releases nothing now
    assert_eq!((dev.counters().host_syncs, dev.counters().frees), (syncs, frees));
    let code = |r: Result<(), DeviceError>| match r {
        Err(DeviceError::Driver { code, .. }) => code,
        r => panic!("{r:?}"),
    };
    let e = dev.create_event().unwrap();
    // An event recorded on the capturing stream is a node of the capture (a wait on it would
    // fork another stream into it); recorded again outside, a captured stream cannot wait on it.
    dev.record_event(e, s).unwrap();
    dev.record_event(e, t).unwrap();
    assert_eq!(code(dev.wait_event(s, e)), DeviceError::CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    let b = alloc.alloc(N, s).unwrap();
    assert!(matches!(dev.launch(s, fill(&b, 1)), Err(DeviceError::Unsupported(_))));
    let scope = alloc.scope(s);
    assert_eq!(scope.alloc(16).err(), Some(AllocError::StreamRouted(s)));
    drop(scope);
    drop(b);
    let graph = alloc.end_capture(s).unwrap();
    assert!(matches!(alloc.end_capture(s), Err(AllocError::Capture { .. })));
    dev.synchronize().unwrap();
    drop(graph);
    alloc.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    // A graph launched on a capturing stream, and an unknown graph, are refused by the device.
    assert!(dev.launch_graph(tidepool::GraphId(999), s).is_err());
    assert_eq!(dev.graph_counters().refused_in_capture, 0, "the allocator made no such call");

    // The device refuses what CUDA refuses during a capture, and (global mode) that refusal
    // invalidates the capture: its end makes no graph. The allocator works on.
    alloc.begin_capture(s, None).unwrap();
    assert_eq!(code(dev.synchronize()), DeviceError::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert!(dev.query_event(e).is_err());
    assert_eq!(dev.graph_counters().refused_in_capture, 2);
    let ended = alloc.end_capture(s).map(drop);
    assert!(
        matches!(
            ended,
            Err(AllocError::Device(DeviceError::Driver {
                code: DeviceError::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                ..
            }))
        ),
        "{ended:?}"
    );
    assert!(!alloc.is_capturing(s));
    drop(alloc.alloc(N, s).unwrap());
    dev.destroy_event(e).unwrap();
    alloc.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
}

#[test]
fn a_buffer_of_another_stream_used_by_the_capture_is_held_back() {
    let Setup { dev, s, alloc } = setup();
    let t = dev.create_stream().unwrap();
    let shared = alloc.alloc(N, t).unwrap(); // general pool, stream t
    dev.launch(t, fill(&shared, 4)).unwrap();
    dev.synchronize().unwrap();
    alloc.begin_capture(s, None).unwrap();
    alloc.record_stream(&shared, s).unwrap();
    let out = alloc.alloc(N, s).unwrap();
    dev.launch(s, map(&shared, &out, |x| x * 10)).unwrap();
    let shared_ptr = shared.ptr();
    drop(shared); // used by the capture: no event can be recorded on s now
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!(graph.held_buffers(), 1);
    let general = alloc.stats().blocks; // `shared`, held: active, not allocated
    assert_eq!((general.allocated_bytes.all.current, general.active_bytes.all.current), (0, N));
    let again = alloc.alloc(N, t).unwrap();
    assert_ne!(again.ptr(), shared_ptr, "held by the graph");
    graph.launch(s).unwrap();
    assert_eq!(device_bytes(&dev, &out), vec![40; N as usize]);
    drop(graph); // frees it: ordered after s by an event now
    alloc.synchronize().unwrap();
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, N); // `again` only
    let reuse = alloc.alloc(N, t).unwrap();
    assert_eq!(reuse.ptr(), shared_ptr);
    drop((reuse, out, again));
    alloc.empty_cache().unwrap();
    dev.synchronize().unwrap();
    assert!(dev.live_segments().is_empty());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn garbage_collection_and_caching_off_release_nothing_during_a_capture() {
    for conf in ["garbage_collection_threshold:0.5,memory_limit_mb:64", "caching:false"] {
        let dev = Arc::new(SimDevice::backed(256 * MIB));
        let s = dev.create_stream().unwrap();
        let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
        alloc.begin_capture(s, None).unwrap();
        let frees = dev.counters().frees;
        drop(alloc.alloc(3 * MIB, s).unwrap()); // caching:false would release it now
        // 20 MiB cached + 26 MiB new > 32 MiB: the collection would release the cached one now.
        let b = alloc.alloc(25 * MIB, s).unwrap();
        assert_eq!(dev.counters().frees, frees, "{conf}: a release during the capture");
        let graph = alloc.end_capture(s).unwrap();
        drop((graph, b));
        alloc.empty_cache().unwrap();
        assert!(dev.live_segments().is_empty(), "{conf}");
        assert!(dev.violations().is_empty(), "{conf}: {:?}", dev.violations());
    }
}

/// What a free that needs a host wait while a capture is underway leaves: the allocator's
/// active bytes right after the free, its reserved bytes after `empty_cache` once the capture
/// ended, and the device's live segments once everything is dropped.
struct Refused {
    active_during: u64,
    syncs_during: u64,
    reserved_after: u64,
    live_at_end: usize,
}

/// A buffer used on a stream destroyed outside the allocator (so no event can mark that work)
/// is freed while another stream is being captured: the host wait the free needs is refused.
fn free_needing_a_refused_wait(broken: bool) -> Refused {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, s2, s3) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    alloc.set_broken(Broken::RefusedWaitLeaks, broken);
    let a = alloc.alloc(N, s).unwrap();
    assert_eq!(a.ptr().0, SIM_BASE);
    dev.launch(s2, fill(&a, 1)).unwrap();
    alloc.record_stream(&a, s2).unwrap();
    dev.destroy_stream(s2).unwrap(); // not through the allocator: nothing says it drained
    alloc.begin_capture(s3, None).unwrap();
    let syncs = alloc.stats().num_host_syncs;
    drop(a); // the free's host wait is refused: the capture is underway
    let during = alloc.stats();
    alloc.check_invariants().unwrap();
    let graph = alloc.end_capture(s3).unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    let reserved_after = alloc.stats().blocks.reserved_bytes.all.current;
    drop((graph, alloc));
    Refused {
        active_during: during.blocks.active_bytes.all.current,
        syncs_during: during.num_host_syncs - syncs,
        reserved_after,
        live_at_end: dev.live_segments().len(),
    }
}

#[test]
fn a_free_whose_host_wait_a_capture_refuses_waits_for_the_capture_to_end() {
    let r = free_needing_a_refused_wait(false);
    assert_eq!(r.active_during, N.next_multiple_of(512)); // pending: not reusable yet
    assert_eq!(r.syncs_during, 0); // the wait was refused: the host never waited
    assert_eq!(r.reserved_after, 0); // freed after the capture, its segment released
    assert_eq!(r.live_at_end, 0);
}

#[test]
fn a_refused_host_wait_that_gives_the_block_up_leaks_its_segment() {
    let r = free_needing_a_refused_wait(true);
    assert_eq!(r.reserved_after, SEG);
    assert_eq!(r.live_at_end, 1);
}

/// A graph pool's buffer used on a stream that the general allocator then destroys, freed
/// during a later capture into the same pool: the pool knows the stream drained (the family
/// shares what its allocators destroyed), so the free completes at once and the capture
/// reuses the block, with no host wait.
fn pool_free_after_family_destroyed_stream(broken: bool) -> (bool, u64, usize) {
    let Setup { dev, s, alloc } = setup();
    alloc.set_broken(Broken::PoolDestroyedStreams, broken);
    let s2 = dev.create_stream().unwrap();
    alloc.begin_capture(s, None).unwrap();
    let out = alloc.alloc(N, s).unwrap();
    let g1 = alloc.end_capture(s).unwrap();
    alloc.record_stream(&out, s2).unwrap();
    alloc.destroy_stream(s2).unwrap();
    // SAFETY: neither graph is replayed (the test is about the free's host wait).
    unsafe { alloc.begin_capture_sharing(s, g1.pool()) }.unwrap();
    let syncs = g1.pool().stats().num_host_syncs;
    let out_ptr = out.ptr();
    drop(out);
    let next = alloc.alloc(N, s).unwrap();
    let reused = next.ptr() == out_ptr;
    let syncs = g1.pool().stats().num_host_syncs - syncs;
    drop(next);
    let g2 = alloc.end_capture(s).unwrap();
    drop((g1, g2, alloc));
    (reused, syncs, dev.live_segments().len())
}

#[test]
fn a_pool_knows_the_streams_its_family_destroyed() {
    assert_eq!(pool_free_after_family_destroyed_stream(false), (true, 0, 0));
}

#[test]
fn a_pool_not_told_of_a_destroyed_stream_needs_a_host_wait() {
    // The wait is refused (capture): the block waits, so the capture cannot reuse it (and no
    // host sync is counted: the host never waited).
    assert_eq!(pool_free_after_family_destroyed_stream(true), (false, 0, 0));
}

/// Which scope memory a capture frees in [`scope_memory_freed_during_capture`].
#[derive(Clone, Copy, Debug)]
enum ScopeVictim {
    /// An unbound buffer that escaped the learning run (no plan yet).
    LearningEscape,
    /// An unbound buffer that escaped a planned run (a pinned slice of its region).
    PlannedEscape,
    /// An unbound buffer of a run still open, freed during a capture of its stream.
    OpenRun,
    /// A bound buffer of a learning run still open (a pool block), freed during a capture.
    BoundLearning,
    /// A bound buffer of a planned run still open (a slice of its region), freed during a
    /// capture.
    BoundPlanned,
}

/// Scope memory freed while its stream is captured, after a captured kernel read it: the graph
/// holds it until it is dropped, so neither a general allocation nor later runs of the scope
/// hand it out while the graph lives (broken mode `CaptureScopeFrees`: the free goes to the
/// scope or its region at once, as before the fix). Returns the sanitizer's findings and
/// whether the victim's address was handed out again while the graph lived.
/// With `sanitize` off, the scope's planned paths (inlined, taken only where no sanitizer
/// watches) serve the run.
fn scope_memory_freed_during_capture(
    victim: ScopeVictim,
    broken: bool,
    sanitize: bool,
) -> (Vec<tidepool::device::Violation>, bool) {
    let dev = Arc::new(SimDevice::with_config(tidepool::SimConfig {
        capacity: 256 * MIB,
        backed: true,
        sanitize,
    }));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    alloc.set_broken(Broken::CaptureScopeFrees, broken);
    let out = alloc.alloc(N, s).unwrap();
    let runs = match victim {
        ScopeVictim::LearningEscape | ScopeVictim::BoundLearning => 0,
        _ => 2,
    };
    if let ScopeVictim::BoundLearning | ScopeVictim::BoundPlanned = victim {
        return bound_freed_during_capture(dev, s, alloc, out, runs);
    }
    for _ in 0..runs {
        let sc = alloc.named_scope("step", s);
        let b = sc.alloc_unbound(N).unwrap();
        dev.launch(s, fill(&b, 1)).unwrap();
    }
    let open = alloc.named_scope("step", s);
    let v = open.alloc_unbound(N).unwrap();
    dev.launch(s, fill(&v, 7)).unwrap();
    let open = match victim {
        ScopeVictim::OpenRun => Some(open),
        _ => {
            drop(open); // `v` escapes the run
            None
        }
    };
    let v_ptr = v.ptr();
    alloc.begin_capture(s, None).unwrap();
    dev.launch(s, map(&v, &out, |x| x + 1)).unwrap();
    drop(v);
    let graph = alloc.end_capture(s).unwrap();
    let mut handed = Vec::new();
    // The open run goes on, and ends; then more runs and a general allocation.
    if let Some(open) = open {
        let b = open.alloc_unbound(N).unwrap();
        dev.launch(s, fill(&b, 2)).unwrap();
        handed.push(b.ptr());
    }
    for _ in 0..2 {
        let sc = alloc.named_scope("step", s);
        let b = sc.alloc_unbound(N).unwrap();
        dev.launch(s, fill(&b, 3)).unwrap();
        handed.push(b.ptr());
    }
    let other = alloc.alloc(N, s).unwrap();
    dev.launch(s, fill(&other, 9)).unwrap();
    handed.push(other.ptr());
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    drop((graph, other));
    alloc.check_invariants().unwrap();
    // Once the graph is gone, its memory is the allocator's again.
    let again = alloc.alloc(N, s).unwrap();
    drop((again, out));
    alloc.check_invariants().unwrap();
    (dev.violations(), handed.contains(&v_ptr))
}

/// [`scope_memory_freed_during_capture`] for a bound buffer of an open learning run: the run
/// must not keep its block for local reuse while the graph lives.
fn bound_freed_during_capture(
    dev: Arc<SimDevice>,
    s: StreamId,
    alloc: Allocator<SimDevice>,
    out: Buffer<SimDevice>,
    runs: usize,
) -> (Vec<tidepool::device::Violation>, bool) {
    let write = |b: &tidepool::ScopedBuffer<'_, SimDevice>, byte: u8| {
        dev.launch(s, fill_at(b.ptr(), byte)).unwrap();
    };
    // Each run: a buffer forgotten (`mem::forget`: the run's end takes its slice back, held
    // region or not), then two buffers of one size, one after the other (a plan gives them
    // one slice).
    let forget = |sc: &tidepool::Scope<'_, SimDevice>| {
        let f = sc.alloc(N).unwrap();
        write(&f, 5);
        std::mem::forget(f);
    };
    for _ in 0..runs {
        let sc = alloc.named_scope("bound", s);
        forget(&sc);
        let b = sc.alloc(N).unwrap();
        write(&b, 1);
        drop(b);
        let c = sc.alloc(N).unwrap();
        write(&c, 1);
    }
    let sc = alloc.named_scope("bound", s);
    forget(&sc);
    let v = sc.alloc(N).unwrap();
    let v_ptr = v.ptr();
    write(&v, 7);
    alloc.begin_capture(s, None).unwrap();
    dev.launch(s, map_at(v_ptr, out.ptr())).unwrap();
    drop(v);
    let graph = alloc.end_capture(s).unwrap();
    // The run goes on: the same size again, used at once; then two more runs.
    let again = sc.alloc(N).unwrap();
    write(&again, 3);
    let mut handed = vec![again.ptr()];
    drop(again);
    drop(sc);
    for _ in 0..2 {
        let sc = alloc.named_scope("bound", s);
        forget(&sc);
        let b = sc.alloc(N).unwrap();
        write(&b, 4);
        handed.push(b.ptr());
        drop(b);
        let c = sc.alloc(N).unwrap();
        write(&c, 4);
        handed.push(c.ptr());
    }
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    drop(graph);
    alloc.check_invariants().unwrap();
    drop(out);
    alloc.check_invariants().unwrap();
    (dev.violations(), handed.contains(&v_ptr))
}

#[test]
fn scope_memory_freed_during_a_capture_is_held_by_the_graph() {
    for victim in [
        ScopeVictim::LearningEscape,
        ScopeVictim::PlannedEscape,
        ScopeVictim::OpenRun,
        ScopeVictim::BoundLearning,
        ScopeVictim::BoundPlanned,
    ] {
        let (v, reused) = scope_memory_freed_during_capture(victim, false, true);
        assert!(v.is_empty(), "{victim:?}: {v:?}");
        assert!(!reused, "{victim:?}");
        let (v, reused) = scope_memory_freed_during_capture(victim, true, true);
        assert!(reused, "{victim:?}: the broken mode hands the victim out again");
        assert_eq!(v[0].op, "handout of memory a CUDA graph uses", "{victim:?}");
        // The same on the planned fast paths (no sanitizer: addresses tell).
        assert!(!scope_memory_freed_during_capture(victim, false, false).1, "{victim:?}");
        assert!(scope_memory_freed_during_capture(victim, true, false).1, "{victim:?}");
    }
}

/// A planned bound slice used on another stream (`record_stream`) and freed while its stream is
/// captured: no event can be waited on by the captured stream then, so its reuse is ordered as
/// the graph goes, and the region returns to the pool when its stream goes (broken mode
/// `CaptureScopeFrees`: ordered during the capture, which fails, so the region is poisoned:
/// its memory stays allocated until a device-wide synchronisation that no capture refuses,
/// once its plan let go of it). Returns the sanitizer's findings, whether
/// the slice was handed out again while the graph lived, the bytes still allocated once the
/// stream went, and the segments left once all is gone.
fn planned_slice_used_elsewhere(
    broken: bool,
) -> (Vec<tidepool::device::Violation>, bool, u64, usize) {
    let Setup { dev, s, alloc } = setup();
    alloc.set_broken(Broken::CaptureScopeFrees, broken);
    let t = dev.create_stream().unwrap();
    let order = |stream: StreamId, after: StreamId| {
        let e = dev.create_event().unwrap();
        dev.record_event(e, after).unwrap();
        dev.wait_event(stream, e).unwrap();
        dev.destroy_event(e).unwrap();
    };
    let out = alloc.alloc(N, s).unwrap();
    let mut handed = Vec::new();
    let mut graph = None;
    let mut v_ptr = None;
    for run in 0..5 {
        let sc = alloc.named_scope("used", s);
        let v = sc.alloc(N).unwrap();
        dev.launch(s, fill_at(v.ptr(), 1)).unwrap();
        order(t, s);
        dev.launch(t, read_at(v.ptr())).unwrap();
        sc.record_stream(&v, t).unwrap();
        if run == 2 {
            v_ptr = Some(v.ptr());
            assert!(v.is_planned());
            alloc.begin_capture(s, None).unwrap();
            dev.launch(s, map_at(v.ptr(), out.ptr())).unwrap();
            drop(v);
            let g = alloc.end_capture(s).unwrap();
            g.launch(s).unwrap();
            graph = Some(g);
        } else if run > 2 {
            handed.push(v.ptr());
        }
    }
    dev.synchronize().unwrap();
    drop(graph);
    alloc.check_invariants().unwrap();
    drop(out);
    // The stream goes, and its plans with it (their regions return to the pool), then the
    // allocator, and every segment with it.
    alloc.destroy_stream(s).unwrap();
    alloc.check_invariants().unwrap();
    let allocated = alloc.stats().blocks.allocated_bytes.all.current;
    drop(alloc);
    let left = dev.live_segments().len();
    (dev.violations(), handed.contains(&v_ptr.unwrap()), allocated, left)
}

/// Kernels over N bytes at an address: a one-shot fill, a one-shot read, and a replayable copy.
fn fill_at(p: tidepool::DeviceAddr, byte: u8) -> Kernel {
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
    Kernel::new("fill", acc, move |m| m.write(p, &[byte; N as usize]).unwrap())
}

fn read_at(p: tidepool::DeviceAddr) -> Kernel {
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Read }];
    Kernel::new("read", acc, move |m| m.read(p, &mut [0u8; N as usize]).unwrap())
}

fn map_at(src: tidepool::DeviceAddr, dst: tidepool::DeviceAddr) -> Kernel {
    let acc = vec![
        Access { ptr: src, bytes: N, kind: AccessKind::Read },
        Access { ptr: dst, bytes: N, kind: AccessKind::Write },
    ];
    Kernel::replayable("copy", acc, move |m| {
        let mut x = vec![0u8; N as usize];
        m.read(src, &mut x).unwrap();
        m.write(dst, &x).unwrap();
    })
}

#[test]
fn a_planned_slice_used_elsewhere_and_freed_in_a_capture_is_ordered_when_the_graph_goes() {
    let (v, reused, allocated, left) = planned_slice_used_elsewhere(false);
    assert!(v.is_empty(), "{v:?}");
    assert!(!reused);
    assert_eq!(allocated, 0, "the region went back to the pool with its stream");
    assert_eq!(left, 0, "every segment went back with the allocator");
    // Broken: ordered during the capture, which fails: the region is poisoned, its memory
    // allocated until a host wait. Its plan lets go of it as run 3 opens (before 2026-12-07
    // the plan kept it, and it stayed allocated until the allocator's drop), and the next
    // event poll's host wait gives it back to the pool; the allocator's drop gives back the
    // rest (the broken build `cfg(tidepool_broken = "poison_kept")` keeps the poisoned
    // region's 4096 bytes allocated, and its segment on the device). (What the sanitizer
    // finds depends on timing now: back in the pool while the graph lives, the memory may be
    // handed out again — the broken mode's own fault, which
    // `scope_memory_freed_during_capture` catches every time.)
    let (_, _, allocated, left) = planned_slice_used_elsewhere(true);
    assert_eq!(allocated, 0, "the poisoned region went back to the pool after a host wait");
    assert_eq!(left, 0, "and every segment goes back with the allocator");
}

/// A run whose region a graph holds (a planned slice freed during a capture) still takes back,
/// as it ends, the slices of the buffers it forgot (`mem::forget`): the next run hands them out
/// again with the sanitizer told (they were reclaimed), and each run's freed slice waits for
/// its graph.
#[test]
fn a_run_whose_region_a_graph_holds_takes_its_forgotten_slices_back() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let n = 700_000u64; // a 700416-byte slice
    let mut seen = Vec::new();
    for _ in 0..3 {
        let sc = alloc.named_scope("x", s);
        let a = sc.alloc(n).unwrap();
        let a_ptr = a.ptr().0;
        std::mem::forget(a);
        let b = sc.alloc(n).unwrap();
        seen.push((a_ptr, b.ptr().0, b.is_planned()));
        alloc.begin_capture(s, None).unwrap();
        let p = b.ptr();
        let acc = vec![Access { ptr: p, bytes: n, kind: AccessKind::Read }];
        let k = Kernel::replayable("read", acc, move |m| m.read(p, &mut [0u8; 64]).unwrap());
        dev.launch(s, k).unwrap();
        drop(b);
        let graph = alloc.end_capture(s).unwrap();
        graph.launch(s).unwrap();
        drop(sc);
        drop(graph);
        let post = alloc.alloc(n, s).unwrap();
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
        drop(post);
    }
    // The learning run's blocks in the first segment, the plan's region in a new one: each
    // planned run serves the same two slices.
    let region = SIM_BASE + SEG;
    assert_eq!(seen[0], (SIM_BASE, SIM_BASE + 700_416, false));
    assert_eq!(seen[1..], [(region, region + 700_416, true), (region, region + 700_416, true)]);
    alloc.check_invariants().unwrap();
}

/// A capture's temporary (freed during the capture) stays in the graph's pool, and nothing
/// returns it to the device while the graph lives — not the trim after every free under
/// `release_threshold_mb:0` (expandable segments), not the release of every free segment with
/// caching off — although a free of the pool's output, after the capture, runs them. Returns
/// the replay's violations.
fn temporary_released_under_its_graph(
    conf: &str,
    broken: bool,
) -> Vec<tidepool::device::Violation> {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
    alloc.set_broken(Broken::GraphPoolReleased, broken);
    alloc.begin_capture(s, None).unwrap();
    let out = alloc.alloc(4 * MIB, s).unwrap();
    let tmp = alloc.alloc(8 * MIB, s).unwrap();
    let p = tmp.ptr();
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
    dev.launch(s, Kernel::replayable("tmp", acc, move |m| drop(m.write(p, &[1; N as usize]))))
        .unwrap();
    drop(tmp);
    let graph = alloc.end_capture(s).unwrap();
    drop(out); // a free in the pool after the capture: the pool's release rules run
    let busy = graph.pool().empty_cache();
    assert!(matches!(busy, Err(AllocError::PoolBusy { .. })), "{busy:?}");
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    drop(graph);
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    dev.violations()
}

#[test]
fn a_pool_a_graph_uses_releases_none_of_its_free_memory() {
    for conf in ["expandable_segments:true,release_threshold_mb:0", "caching:false"] {
        let v = temporary_released_under_its_graph(conf, false);
        assert!(v.is_empty(), "{conf}: {v:?}");
        let v = temporary_released_under_its_graph(conf, true);
        assert!(v.iter().any(|v| v.op.contains("unallocated")), "{conf}: {v:?}");
    }
}

/// CUDA orders each launch of a graph after its previous launches, on whichever streams they
/// ran (`cuGraphLaunch`); the simulator did not, and `multi_props` flagged a graph replayed on
/// two streams (this test failed with its violations then).
#[test]
fn launches_of_one_graph_on_several_streams_run_one_after_another() {
    let Setup { dev, s, alloc } = setup();
    let t = dev.create_stream().unwrap();
    let x = alloc.alloc(N, s).unwrap();
    dev.launch(s, fill(&x, 0)).unwrap();
    dev.synchronize().unwrap();
    alloc.begin_capture(s, None).unwrap();
    dev.launch(s, map(&x, &x, |v| v + 1)).unwrap();
    let graph = alloc.end_capture(s).unwrap();
    for i in 0..12 {
        graph.launch(if i % 3 == 0 { s } else { t }).unwrap();
    }
    dev.synchronize().unwrap();
    assert_eq!(device_bytes(&dev, &x), vec![12; N as usize]);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    drop(graph);
}

/// `Allocator::capture` (PyTorch's `with torch.cuda.graph(g):`): the body's work becomes the
/// graph, and its value comes back with it. A body that panics halfway (a buffer of the graph's
/// pool allocated and written, one of the general pool freed on the stream, held by the capture)
/// ends the capture before the panic goes on: the stream is no longer capturing, device-wide
/// waits work again, the panicking capture's pool and the held buffer go back (nothing leaked
/// when the allocator goes), and the next capture on the stream runs and replays with no
/// sanitizer violation. The broken build `cfg(tidepool_broken = "capture_left")` leaves the
/// capture underway: `synchronize` is refused.
#[test]
fn a_capture_whose_body_panics_is_ended_before_the_panic_goes_on() {
    let Setup { dev, s, alloc } = setup();
    let input = alloc.alloc(N, s).unwrap();
    let scratch = alloc.alloc(N, s).unwrap();
    dev.launch(s, fill(&input, 5)).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        alloc.capture(s, None, || {
            let tmp = alloc.alloc(N, s).unwrap();
            assert_eq!(tmp.ptr().0, SIM_BASE + SEG, "the capture's pool: a segment of its own");
            dev.launch(s, map(&input, &tmp, |x| x + 1)).unwrap();
            drop(scratch); // held by the capture
            panic!("the body panics");
        })
    }));
    assert!(panicked.is_err());
    assert!(!alloc.is_capturing(s), "the capture was ended");
    alloc.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    // The general pool keeps `input` alone; the panicking capture's pool and the held
    // `scratch` went back.
    let general = alloc.stats().blocks;
    assert_eq!((general.allocated_bytes.all.current, general.active_bytes.all.current), (N, N));
    assert_eq!(dev.live_segments().len(), 1, "{:?}", dev.live_segments());
    assert_eq!(dev.graph_counters().captured_kernels, 1);

    let (graph, out) = alloc
        .capture(s, None, || {
            let out = alloc.alloc(N, s).unwrap();
            dev.launch(s, map(&input, &out, |x| x * 3)).unwrap();
            out
        })
        .unwrap();
    assert!(!alloc.is_capturing(s));
    for i in 0..3u8 {
        dev.launch(s, fill(&input, i)).unwrap();
        graph.launch(s).unwrap();
        assert_eq!(device_bytes(&dev, &out), vec![i * 3; N as usize], "replay {i}");
    }
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop((graph, out, input));
    drop(alloc);
    assert!(dev.live_segments().is_empty(), "{:?}", dev.live_segments());
}

/// As above, with a side stream forked into the capture and not joined back when the body
/// panics: `end_capture` fails (`CUDA_ERROR_STREAM_CAPTURE_UNJOINED`) and the capture is over
/// all the same, for the side stream too. Its block, allocated from the capture's pool, and the
/// pool go back; the side stream allocates from the general pool again.
#[test]
fn a_capture_whose_body_panics_with_a_side_stream_still_joined_is_ended_too() {
    let Setup { dev, s, alloc } = setup();
    let t = dev.create_stream().unwrap();
    let kept = alloc.alloc(N, t).unwrap();
    assert_eq!(kept.ptr().0, SIM_BASE);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        alloc.capture(s, None, || {
            let e = dev.create_event().unwrap();
            dev.record_event(e, s).unwrap();
            dev.wait_event(t, e).unwrap(); // t joins the capture
            assert!(alloc.is_capturing(t));
            let side = alloc.alloc(N, t).unwrap();
            assert_eq!(side.ptr().0, SIM_BASE + SEG, "the capture's pool");
            panic!("the body panics before joining t back");
        })
    }));
    assert!(panicked.is_err());
    assert!(!alloc.is_capturing(s) && !alloc.is_capturing(t));
    alloc.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    let again = alloc.alloc(N, t).unwrap();
    assert_eq!(again.ptr().0, SIM_BASE + N, "the general pool, beside `kept`");
    assert_eq!(dev.live_segments().len(), 1, "{:?}", dev.live_segments());
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop((kept, again, alloc));
    assert!(dev.live_segments().is_empty(), "{:?}", dev.live_segments());
}

/// The application drops its last handle of the allocator in the middle of a capture (it never
/// called `end_capture`). The capture holds its pool, and through the general buffer freed into
/// it the allocator itself, so before, nothing ever went back to the device, which stayed
/// capturing. Now the last handle ends the capture and drops its graph: the device is no longer
/// capturing, the capture's pool goes back, and the held block returns to the general pool,
/// which a buffer the application still holds keeps alive until it is dropped (closed: its
/// cached segments go back at once, see `closed.rs`). The broken build
/// `cfg(tidepool_broken = "orphan_capture")` leaves the capture underway.
#[test]
fn the_last_handle_of_an_allocator_ends_its_capture_underway() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let kept = alloc.alloc(N, t).unwrap(); // the application keeps it past the allocator
    let freed = alloc.alloc(3 * MIB, s).unwrap(); // a 20 MiB segment, freed in the capture
    assert_eq!((kept.ptr().0, freed.ptr().0), (SIM_BASE, SIM_BASE + SEG));
    let spare = alloc.clone();
    alloc.begin_capture(s, None).unwrap();
    let tmp = alloc.alloc(N, s).unwrap();
    assert_eq!(tmp.ptr().0, SIM_BASE + SEG + 20 * MIB, "the capture's pool");
    let p = tmp.ptr();
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
    let write = Kernel::replayable("w", acc, move |m| m.write(p, &[1; N as usize]).unwrap());
    dev.launch(s, write).unwrap();
    drop(freed); // held by the capture
    drop(tmp);
    drop(alloc);
    assert!(dev.capture_underway(), "another handle lives: the capture goes on");
    assert_eq!(dev.live_segments().len(), 3);
    drop(spare); // the last handle
    assert!(!dev.capture_underway(), "the last handle ended the capture");
    // The capture's pool went back; the general allocator lives on in `kept` (a buffer holds
    // its allocator), closed: the freed block's 20 MiB segment went back too.
    assert_eq!(dev.live_segments(), vec![(tidepool::DeviceAddr(SIM_BASE), SEG)]);
    dev.synchronize().unwrap();
    drop(kept);
    assert!(dev.live_segments().is_empty(), "{:?}", dev.live_segments());
    assert_eq!(dev.violations(), vec![]);
}

/// `capture_sharing` (PyTorch's `with torch.cuda.graph(g, pool=…):`): a second graph captured
/// into the pool of a live first one, replayed after it in capture order (the sharing
/// contract). A third capture into the pool whose body panics is ended and lets go of the pool
/// (two graphs use it after, not three), and the two graphs replay with exact results and no
/// violation.
#[test]
fn capture_sharing_shares_a_live_graphs_pool_and_ends_a_body_that_panics() {
    let Setup { dev, s, alloc } = setup();
    let input = alloc.alloc(N, s).unwrap();
    let (g1, out1) = alloc
        .capture(s, None, || {
            let out = alloc.alloc(N, s).unwrap();
            dev.launch(s, map(&input, &out, |x| x + 1)).unwrap();
            out
        })
        .unwrap();
    let pool = g1.pool().clone();
    assert!(alloc.capture(s, Some(&pool), || ()).is_err(), "the safe call refuses a live pool");
    // SAFETY: g1 and g2 are replayed in capture order, one after the other on `s`, and out1 is
    // read only by g2's replay that follows g1's.
    let (g2, out2) = unsafe {
        alloc.capture_sharing(s, &pool, || {
            let out = alloc.alloc(N, s).unwrap();
            dev.launch(s, map(&out1, &out, |x| x * 2)).unwrap();
            out
        })
    }
    .unwrap();
    assert_eq!(pool.graphs(), 2);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the graph is never made (the body panics).
        unsafe {
            alloc.capture_sharing(s, &pool, || {
                let tmp = alloc.alloc(N, s).unwrap();
                dev.launch(s, map(&out2, &tmp, |x| x)).unwrap();
                panic!("the body panics");
            })
        }
    }));
    assert!(panicked.is_err());
    assert!(!alloc.is_capturing(s));
    assert_eq!(pool.graphs(), 2, "the panicking capture let go of the pool");
    for i in 0..4u8 {
        dev.launch(s, fill(&input, i)).unwrap();
        g1.launch(s).unwrap();
        g2.launch(s).unwrap();
        assert_eq!(device_bytes(&dev, &out2), vec![(i + 1) * 2; N as usize], "replay {i}");
    }
    alloc.check_invariants().unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop((g2, g1, out2, out1, input, pool, alloc));
    assert!(dev.live_segments().is_empty(), "{:?}", dev.live_segments());
}

/// CUDA's global capture mode (the one `CudaDevice` uses) ends a capture only on the thread that
/// began it; SimDevice refuses another thread's end the same way
/// (`CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`) and the capture goes on. The allocator keeps it
/// too: the stream is still capturing into the graph's pool, and the thread that began it then
/// ends it and replays the graph. The broken build `cfg(tidepool_broken = "wrong_thread_ends")`
/// takes the refusal as the end (as for any other refusal): the stream is then no longer
/// capturing for the allocator while it still is on the device, and the right thread's end is
/// refused.
#[test]
fn a_capture_ended_on_another_thread_goes_on_until_its_own_thread_ends_it() {
    let Setup { dev, s, alloc } = setup();
    let input = alloc.alloc(N, s).unwrap();
    dev.launch(s, fill(&input, 4)).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let out = alloc.alloc(N, s).unwrap();
    dev.launch(s, map(&input, &out, |x| x + 1)).unwrap();
    common::end_capture_elsewhere(&alloc, s);
    let more = alloc.alloc(N, s).unwrap(); // still from the graph's pool
    assert_eq!(more.ptr().0, out.ptr().0 + N);
    dev.launch(s, map(&out, &more, |x| x * 2)).unwrap();
    let graph = alloc.end_capture(s).unwrap();
    assert!(!dev.capture_underway());
    for i in 0..3u8 {
        dev.launch(s, fill(&input, i)).unwrap();
        graph.launch(s).unwrap();
        assert_eq!(device_bytes(&dev, &more), vec![(i + 1) * 2; N as usize], "replay {i}");
    }
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// A graph launched on a stream that is capturing (the capture's own stream, or a side stream
/// joined to it) is refused with a clear error and no device call: the capturing graph would
/// otherwise use the launched graph's pool untracked (CUDA either refuses, invalidating the
/// capture, or embeds the graph). The capture goes on and ends, and the graph replays where no
/// capture is. The broken build `cfg(tidepool_broken = "launch_in_capture")` leaves it to the
/// device, whose refusal is not the allocator's error.
#[test]
fn a_graph_launched_into_a_capture_underway_is_refused() {
    let Setup { dev, s, alloc } = setup();
    let input = alloc.alloc(N, s).unwrap();
    dev.launch(s, fill(&input, 1)).unwrap();
    let (graph, out) = alloc
        .capture(s, None, || {
            let out = alloc.alloc(N, s).unwrap();
            dev.launch(s, map(&input, &out, |x| x + 1)).unwrap();
            out
        })
        .unwrap();
    let (t, u) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    alloc.begin_capture(t, None).unwrap();
    let e = dev.create_event().unwrap();
    dev.record_event(e, t).unwrap();
    dev.wait_event(u, e).unwrap(); // u joins t's capture
    let launches = dev.graph_counters().graph_launches;
    for on in [t, u] {
        let r = graph.launch(on);
        assert!(
            matches!(r, Err(AllocError::Capture { stream, .. }) if stream == on),
            "{on:?}: {r:?}"
        );
    }
    assert_eq!(dev.graph_counters().graph_launches, launches, "no device call");
    dev.record_event(e, u).unwrap();
    dev.wait_event(t, e).unwrap(); // joined back
    drop(alloc.end_capture(t).unwrap());
    graph.launch(s).unwrap();
    assert_eq!(device_bytes(&dev, &out), vec![2; N as usize]);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// The capture gate. A capture that begins while a call CUDA forbids during captures is
/// already inside the device (here a host wait for a kernel that waits on the test) waits for
/// that call to end; meanwhile new forbidden calls on the device are refused at once (as during
/// the capture), not queued, so the thread that will end the wait is not held up; and a capture
/// on another device does not wait at all. Broken build `capture_gate_open` lets the capture
/// begin under the call inside (on CUDA, that call then invalidates it).
#[test]
fn a_capture_begins_after_the_forbidden_calls_inside_and_refuses_new_ones() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::mpsc;
    let Setup { dev, s, alloc } = setup();
    let pinned = tidepool::HostAllocator::new(dev.clone());
    let gpu = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    // A kernel that runs only once the test opens its gate, and says it ran.
    let (open, gate) = mpsc::channel::<()>();
    let ran = Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    let acc = vec![Access { ptr: gpu.ptr(), bytes: N, kind: AccessKind::Read }];
    dev.launch(
        StreamId::DEFAULT,
        Kernel::new("gated", acc, move |_| {
            let _ = gate.recv();
            flag.store(true, SeqCst);
        }),
    )
    .unwrap();
    let mut inside = pinned.alloc(N).unwrap();
    inside.upload(&gpu).unwrap(); // behind the gated kernel
    let mut probe = pinned.alloc(N).unwrap();
    probe.upload(&gpu).unwrap();
    let ran_when_begun = AtomicBool::new(false);
    let (other_dev, other_alloc) = {
        let d = Arc::new(SimDevice::backed(64 * MIB));
        let a = Allocator::new(d.clone(), Config::default()).unwrap();
        (d, a)
    };
    std::thread::scope(|scope| {
        let syncs = dev.counters().host_syncs;
        scope.spawn(|| inside.synchronize().unwrap()); // inside the device until the gate opens
        while dev.counters().host_syncs == syncs {
            std::thread::yield_now();
        }
        // Another device's capture begins and ends at once.
        let t = other_dev.create_stream().unwrap();
        other_alloc.begin_capture(t, None).unwrap();
        drop(other_alloc.end_capture(t).unwrap());
        let (began_tx, began_rx) = mpsc::channel();
        let (alloc, ran, ran_when_begun) = (&alloc, &ran, &ran_when_begun);
        scope.spawn(move || {
            alloc.begin_capture(s, None).unwrap();
            ran_when_begun.store(ran.load(SeqCst), SeqCst);
            let _ = began_tx.send(()); // (the test may have stopped listening)
            end_here(alloc, s);
        });
        // Give the capture time to reach the gate (it waits there for the call inside).
        let early = began_rx.recv_timeout(std::time::Duration::from_millis(500));
        if early.is_err() {
            // A new forbidden call is refused at once while the capture waits to begin.
            assert!(probe.is_ready().is_err(), "refused, not queued behind the capture");
        }
        open.send(()).unwrap();
    });
    assert!(
        ran_when_begun.load(SeqCst),
        "the capture began while the host wait for the gated kernel was inside the device"
    );
    drop((inside, probe, gpu));
    alloc.synchronize().unwrap();
    assert_eq!(dev.graph_counters().refused_in_capture, 0);
}

/// Ends the capture begun on `s` by this thread (CUDA's global mode: the thread that began it).
fn end_here(alloc: &Allocator<SimDevice>, s: StreamId) {
    drop(alloc.end_capture(s).unwrap());
}

/// The caps hold for an allocator and its private pools together: during a capture, a graph's
/// pool holds 40 MiB of a 64 MiB `memory_limit_mb`, and a 30 MiB request on another stream
/// fails out of memory with the allocator itself holding nothing. The report says why: the
/// family's 40 MiB (`family_reserved`, `over_limit`), in its text too. Broken build
/// `oom_family_unreported`: the report counted the allocator's own bytes only, under the cap
/// by 34 MiB — an out-of-memory with no cause in it.
#[test]
fn an_out_of_memory_report_counts_what_the_private_pools_hold_under_the_cap() {
    let dev = Arc::new(SimDevice::new(1024 * MIB));
    let alloc = Allocator::new(dev.clone(), Config::parse("memory_limit_mb:64").unwrap()).unwrap();
    let (s, c) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = alloc.new_pool(Default::default()).unwrap();
    alloc.begin_capture(c, Some(&pool)).unwrap();
    let g = alloc.alloc(40 * MIB, c).unwrap();
    let e = alloc.alloc(30 * MIB, s).map(|b| b.ptr());
    let Err(AllocError::OutOfMemory(r)) = &e else { panic!("{e:?}") };
    assert_eq!((r.reserved, r.family_reserved, r.segment), (0, 40 * MIB, 30 * MIB));
    assert!(r.over_limit());
    let text = r.to_string();
    assert!(
        text.contains(
            "tidepool is limited to 64.00 MiB, a cap shared with this allocator's private pools \
             (MemPools, CUDA graphs' pools) or its general allocator, which hold 40.00 MiB of it."
        ),
        "{text}"
    );
    drop(g);
    drop(alloc.end_capture(c).unwrap());
    dev.synchronize().unwrap();
    pool.empty_cache().unwrap();
    let b = alloc.alloc(30 * MIB, s).unwrap(); // the graph's pool is empty: room under the cap
    drop(b);
    alloc.check_invariants().unwrap();
}
