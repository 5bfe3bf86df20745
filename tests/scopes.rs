//! Scopes, learned plans and residency, on the asynchronous SimDevice with its sanitizer.

use proptest::prelude::*;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use tidepool::MIB;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SimDevice};
use tidepool::hooks::Broken;
use tidepool::{AllocError, Allocator, Buffer, Config, Device, DeviceAddr, Residency, StreamId};

const S0: StreamId = StreamId::DEFAULT;

fn setup(capacity: u64) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::new(capacity));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, alloc)
}

fn gated_write(ptr: DeviceAddr, bytes: u64) -> (Kernel, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel::<()>();
    let k = Kernel::new("gated", vec![Access { ptr, bytes, kind: AccessKind::Write }], move |_| {
        let _ = gate.recv();
    });
    (k, open)
}

#[test]
fn a_freed_scoped_buffer_is_reused_by_the_next_scoped_allocation_without_a_search() {
    let (dev, alloc) = setup(1 << 30);
    let scope = alloc.scope(S0);
    let a = scope.alloc(4096).unwrap();
    let p = a.ptr();
    let searches = alloc.stats().best_fit_searches;
    drop(a);
    for _ in 0..10 {
        let b = scope.alloc(4000).unwrap(); // same rounded size
        assert_eq!(b.ptr(), p);
    }
    assert_eq!(alloc.stats().best_fit_searches, searches, "served from the scope's cache");
    // While the scope is open its cached block still counts as allocated.
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 4096);
    drop(scope);
    let s = alloc.stats();
    assert_eq!(s.blocks.allocated_bytes.all.current, 0, "returned at exit");
    assert_eq!(s.scope_escapes, 0);
    assert_eq!(dev.counters().event_records, 0, "a same-stream batch needs no event");
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn scope_exit_is_stream_ordered() {
    let (dev, alloc) = setup(1 << 30);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p;
    let open;
    {
        let scope = alloc.scope(a);
        let buf = scope.alloc(4096).unwrap();
        p = buf.ptr();
        let (k, o) = gated_write(p, 4096);
        open = o;
        dev.launch(a, k).unwrap();
    }
    // Stream b may not take the memory while a's kernel runs (strict): fresh memory.
    let other = alloc.alloc(4096, b).unwrap();
    assert_ne!(other.ptr(), p);
    // Stream a may: its own order makes it safe.
    let same = alloc.alloc(4096, a).unwrap();
    assert_eq!(same.ptr(), p);
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// Runs one "training step" in a named scope: a fixed sequence of allocations and frees, with
/// one gradient-like buffer that escapes. Returns the step's addresses and the escaped buffer.
fn step(alloc: &Allocator<SimDevice>, sizes: &[u64]) -> (Vec<DeviceAddr>, Buffer<SimDevice>) {
    let scope = alloc.named_scope("train_step", S0);
    let mut ptrs = Vec::new();
    let mut held = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let b = scope.alloc_unbound(n).unwrap();
        ptrs.push(b.ptr());
        held.push(b);
        if i % 2 == 1 {
            drop(held.remove(0)); // free the older one: lifetimes overlap pairwise
        }
    }
    let grad = scope.alloc_unbound(3 * MIB).unwrap();
    ptrs.push(grad.ptr());
    drop(held);
    (ptrs, grad)
}

const SIZES: [u64; 6] = [8 * MIB, 8 * MIB, 2 * MIB, 4096, 12 * MIB, 512];

#[test]
fn a_repeated_named_scope_is_served_from_its_plan_at_identical_addresses() {
    let (dev, alloc) = setup(1 << 32);
    let (first, grad) = step(&alloc, &SIZES);
    let s1 = alloc.stats();
    assert_eq!((s1.plan_hits, s1.scope_escapes), (0, 1));
    // Next step: the previous gradient is freed first (zero_grad), then the step repeats.
    drop(grad);
    let (second, grad) = step(&alloc, &SIZES);
    let s2 = alloc.stats();
    assert_eq!(s2.plan_hits, 7, "every allocation of the second run is planned");
    assert_eq!(s2.plan_misses, 0);
    assert_ne!(first, second, "the plan lives in its own region");
    let region = s2.plan_region_bytes;
    assert!(region > 0);
    let mallocs = dev.counters().mallocs;
    let searches = s2.best_fit_searches;
    let mut grad = grad;
    for run in 3..8 {
        drop(grad);
        let (ptrs, g) = step(&alloc, &SIZES);
        grad = g;
        assert_eq!(ptrs, second, "run {run}: identical offsets");
    }
    let s = alloc.stats();
    assert_eq!(s.plan_hits, 7 * 6);
    assert_eq!(dev.counters().mallocs, mallocs, "no device malloc after the region exists");
    assert_eq!(s.best_fit_searches, searches, "no best-fit search in planned runs");
    assert_eq!((s.plan_fallbacks, s.plan_region_bytes), (0, region));
    // Planned buffers never overlap while live: the region is packed by lifetimes.
    drop(grad);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn a_diverging_run_falls_back_stays_correct_and_relearns() {
    let (dev, alloc) = setup(1 << 32);
    let (_, g) = step(&alloc, &SIZES);
    drop(g);
    let mut other = SIZES;
    other[2] = 5 * MIB; // third allocation differs
    let scope = alloc.named_scope("train_step", S0);
    let mut live = Vec::new();
    for &n in &other {
        live.push(scope.alloc_unbound(n).unwrap()); // all live at once: most overlap-prone
    }
    let mut ranges: Vec<(u64, u64)> = live.iter().map(|b| (b.ptr().0, b.block_size())).collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "live buffers overlap: {ranges:?}");
    }
    let planned = live.iter().filter(|b| b.is_planned()).count();
    assert_eq!(planned, 2, "the two allocations before the divergence were planned");
    drop(live);
    drop(scope);
    assert_eq!(alloc.stats().plan_fallbacks, 1);
    // The new sequence was learned: repeating it hits the plan all the way.
    let hits = alloc.stats().plan_hits;
    let scope = alloc.named_scope("train_step", S0);
    let live: Vec<_> = other.iter().map(|&n| scope.alloc_unbound(n).unwrap()).collect();
    assert!(live.iter().all(Buffer::is_planned));
    drop(live);
    drop(scope);
    assert_eq!(alloc.stats().plan_hits, hits + other.len() as u64);
    assert_eq!(alloc.stats().plan_fallbacks, 1);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn an_escape_that_is_still_live_pins_its_slice() {
    let (dev, alloc) = setup(1 << 32);
    let (_, g1) = step(&alloc, &SIZES);
    drop(g1);
    let (_, g2) = step(&alloc, &SIZES); // planned; g2 escapes from the region
    assert!(g2.is_planned());
    // Run 3 without freeing g2 first: g2's slice is pinned, so that allocation misses.
    let (ptrs, g3) = step(&alloc, &SIZES);
    let s = alloc.stats();
    assert!(s.plan_misses >= 1, "{s:?}");
    assert!(!ptrs.contains(&g2.ptr()) || !g3.is_planned());
    assert_ne!(g3.ptr(), g2.ptr(), "the escaped gradient is never handed out again");
    drop((g2, g3));
    let misses = alloc.stats().plan_misses;
    let (_, g4) = step(&alloc, &SIZES);
    assert_eq!(alloc.stats().plan_misses, misses, "unpinned once freed");
    drop(g4);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    assert!(dev.live_segments().is_empty(), "regions go back when the allocator goes");
}

#[test]
fn a_planned_buffer_used_on_another_stream_orders_its_reuse() {
    for broken in [false, true] {
        let (dev, alloc) = setup(1 << 30);
        let b = dev.create_stream().unwrap();
        alloc.set_broken_skip_events(broken);
        let run = |gate: Option<mpsc::Sender<()>>| -> Option<mpsc::Sender<()>> {
            let scope = alloc.named_scope("s", S0);
            let x = scope.alloc(4096).unwrap();
            let mut open = None;
            if gate.is_none() && x.is_planned() {
                // Used on b (after b waits for S0), still running when x is freed.
                let e = dev.create_event().unwrap();
                dev.record_event(e, S0).unwrap();
                dev.wait_event(b, e).unwrap();
                let (k, o) = gated_write(x.ptr(), 4096);
                dev.launch(b, k).unwrap();
                x.record_stream(b).unwrap();
                open = Some(o);
            }
            drop(x);
            let y = scope.alloc(4096).unwrap(); // the same planned slice
            drop(y);
            open
        };
        run(Some(mpsc::channel().0)); // learn
        let open = run(None).expect("second run is planned");
        open.send(()).unwrap();
        dev.synchronize().unwrap();
        if broken {
            assert!(!dev.violations().is_empty(), "the sanitizer sees the unordered reuse");
        } else {
            assert_eq!(dev.violations(), vec![]);
            // One host sync: the release of the learning run's segment when the region replaced
            // it. Ordering the reuse after stream b adds none (a device-side wait).
            assert_eq!(alloc.stats().num_host_syncs, 1);
            assert_eq!(dev.counters().event_waits, 2, "the test's own wait and the allocator's");
        }
    }
}

#[test]
fn out_of_memory_never_releases_persistent_segments() {
    let (dev, alloc) = setup(64 * MIB);
    drop(alloc.alloc_in(30 * MIB, S0, Residency::Persistent).unwrap());
    drop(alloc.alloc(20 * MIB, S0).unwrap());
    // 40 MiB needs the transient cache released; the persistent 30 MiB stays.
    let e = alloc.alloc(40 * MIB, S0).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)));
    assert_eq!(dev.live_segments().len(), 1);
    assert_eq!(alloc.stats().blocks.reserved_bytes.persistent.current, 30 * MIB);
    let ok = alloc.alloc(34 * MIB, S0).unwrap();
    assert_eq!(ok.len(), 34 * MIB);
    drop(ok);
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_segments().len(), 1, "empty_cache keeps persistent segments");
    alloc.release_persistent().unwrap();
    assert!(dev.live_segments().is_empty());
}

/// Where a persistent 4 MiB block goes after a transient 4 MiB one on ordinary segments:
/// (base of the first segment, address of each block, live segments, reserved persistent and
/// transient bytes, allocated transient bytes).
fn large_sharing(broken: bool) -> (u64, [u64; 2], usize, u64, u64, u64) {
    let (dev, alloc) = setup(1 << 30);
    alloc.set_broken(Broken::ResidencySplit, broken);
    let t = alloc.alloc(4 * MIB, S0).unwrap();
    let w = alloc.alloc_in(4 * MIB, S0, Residency::Persistent).unwrap();
    alloc.check_invariants().unwrap();
    let b = alloc.stats().blocks;
    let base = dev.live_segments().iter().map(|(p, _)| p.0).min().unwrap();
    let out = (
        base,
        [t.ptr().0, w.ptr().0],
        dev.live_segments().len(),
        b.reserved_bytes.persistent.current,
        b.reserved_bytes.transient.current,
        b.allocated_bytes.transient.current,
    );
    drop((t, w));
    alloc.release_persistent().unwrap();
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    out
}

#[test]
fn a_weight_takes_free_space_in_a_transient_segment_instead_of_a_new_segment() {
    let (base, [t, w], segments, persistent, transient, allocated) = large_sharing(false);
    // One 20 MiB transient segment: the activation at its base, the weight right after it (the
    // best fit is the segment's 16 MiB tail), accounted with its segment.
    assert_eq!((t, w), (base, base + 4 * MIB));
    assert_eq!((segments, persistent, transient, allocated), (1, 0, 20 * MIB, 8 * MIB));
}

#[test]
fn broken_residency_split_reserves_a_segment_for_the_weight() {
    let (base, [t, _], segments, persistent, transient, allocated) = large_sharing(true);
    assert_eq!(t, base);
    assert_eq!((segments, persistent, transient, allocated), (2, 20 * MIB, 20 * MIB, 4 * MIB));
}

#[test]
fn an_activation_takes_the_free_tail_of_a_weight_segment() {
    let (dev, alloc) = setup(1 << 30);
    let w = alloc.alloc_in(4 * MIB, S0, Residency::Persistent).unwrap();
    let a = alloc.alloc(6 * MIB, S0).unwrap();
    assert_eq!(a.ptr().0, w.ptr().0 + 4 * MIB);
    assert_eq!(dev.live_segments().len(), 1);
    let b = alloc.stats().blocks;
    assert_eq!(b.reserved_bytes.persistent.current, 20 * MIB);
    assert_eq!(b.allocated_bytes.persistent.current, 10 * MIB, "accounted with its segment");
    drop(a);
    // The tail is free again: the transient cache releases nothing of a persistent segment.
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_segments().len(), 1);
    drop(w);
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_segments().len(), 1, "a free persistent segment stays cached");
    alloc.release_persistent().unwrap();
    assert!(dev.live_segments().is_empty());
}

#[test]
fn a_transient_segment_holding_a_weight_is_released_only_after_the_weight() {
    let (dev, alloc) = setup(1 << 30);
    let a = alloc.alloc(4 * MIB, S0).unwrap();
    let w = alloc.alloc_in(4 * MIB, S0, Residency::Persistent).unwrap();
    assert_eq!(w.ptr().0, a.ptr().0 + 4 * MIB);
    drop(a);
    alloc.empty_cache().unwrap();
    alloc.release_persistent().unwrap();
    assert_eq!(dev.live_segments().len(), 1, "the weight pins its segment");
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 4 * MIB);
    drop(w);
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty(), "a transient segment is recycled");
    alloc.check_invariants().unwrap();
}

#[test]
fn small_blocks_of_both_residencies_share_one_small_segment() {
    for broken in [false, true] {
        let (dev, alloc) = setup(1 << 30);
        alloc.set_broken(Broken::ResidencySplit, broken);
        let w = alloc.alloc_in(4096, S0, Residency::Persistent).unwrap();
        let a = alloc.alloc(4096, S0).unwrap();
        let b = alloc.stats().blocks;
        let (persistent, transient) =
            (b.allocated_bytes.persistent.current, b.allocated_bytes.transient.current);
        if broken {
            assert_eq!(dev.live_segments().len(), 2, "a small segment per residency");
            assert_eq!((persistent, transient), (4096, 4096));
        } else {
            assert_eq!(a.ptr().0, w.ptr().0 + 4096);
            assert_eq!(dev.live_segments().len(), 1);
            assert_eq!((persistent, transient), (0, 8192), "small blocks count as transient");
        }
        // A freed small weight is cached for the stream and serves either residency (split: a
        // transient request never takes it).
        let at = w.ptr();
        drop(w);
        let again = alloc.alloc(4096, S0).unwrap();
        assert_eq!(again.ptr() == at, !broken);
        drop((a, again));
        alloc.empty_cache().unwrap();
        alloc.release_persistent().unwrap();
        assert!(dev.live_segments().is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever the mix of residencies: small-pool buffers sit in transient segments, no two
    /// live buffers overlap, `empty_cache` keeps every persistent segment and every segment
    /// holding a live buffer and releases the rest, and everything goes once all is freed.
    #[test]
    fn residency_placement_keeps_the_release_rules(
        ops in prop::collection::vec((1u64..24 * MIB, any::<bool>(), any::<prop::sample::Index>(), 0u8..8), 1..80)
    ) {
        let (dev, alloc) = setup(1 << 32);
        let mut live: Vec<Buffer<SimDevice>> = Vec::new();
        for (bytes, persistent, victim, what) in ops {
            match what {
                0..=2 if !live.is_empty() => drop(live.swap_remove(victim.index(live.len()))),
                3 => {
                    let persistent_before: Vec<_> = alloc.snapshot().into_iter()
                        .filter(|s| s.residency == Residency::Persistent).map(|s| s.address).collect();
                    alloc.empty_cache().unwrap();
                    let snap = alloc.snapshot();
                    for seg in &snap {
                        let holds = live.iter().any(|b| seg.address.0 <= b.ptr().0 && b.ptr().0 < seg.address.0 + seg.size);
                        prop_assert!(holds || seg.residency == Residency::Persistent, "a free transient segment survived empty_cache");
                    }
                    for a in persistent_before {
                        prop_assert!(snap.iter().any(|s| s.address == a), "empty_cache released a persistent segment");
                    }
                }
                _ => {
                    let r = if persistent { Residency::Persistent } else { Residency::Transient };
                    live.push(alloc.alloc_in(bytes, S0, r).unwrap());
                }
            }
            alloc.check_invariants().map_err(TestCaseError::fail)?;
            let snap = alloc.snapshot();
            for b in &live {
                let seg = snap.iter().find(|s| s.address.0 <= b.ptr().0 && b.ptr().0 < s.address.0 + s.size);
                prop_assert!(seg.is_some(), "a live buffer in no segment");
                let seg = seg.unwrap();
                prop_assert!(seg.pool != tidepool::PoolKind::Small || seg.residency == Residency::Transient);
            }
        }
        drop(live);
        alloc.release_persistent().unwrap();
        alloc.empty_cache().unwrap();
        prop_assert!(dev.live_segments().is_empty());
        drop(alloc);
        prop_assert!(dev.live_segments().is_empty());
    }
}

#[test]
fn two_concurrent_runs_of_one_named_scope_never_share_the_region() {
    let (dev, alloc) = setup(1 << 32);
    let learn = alloc.named_scope("s", S0);
    drop(learn.alloc_unbound(MIB).unwrap());
    drop(learn);
    let first = alloc.named_scope("s", S0);
    let second = alloc.named_scope("s", S0);
    let a = first.alloc_unbound(MIB).unwrap();
    let b = second.alloc_unbound(MIB).unwrap();
    assert!(a.is_planned());
    assert!(!b.is_planned(), "the region is held by the first run");
    assert_ne!(a.ptr(), b.ptr());
    drop((a, b));
    drop((first, second));
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// One step mixing bound buffers (activations) with unbound ones freed on another thread
/// while the scope is open (a gradient handed to a worker). Returns the bound buffers'
/// addresses.
fn mixed_step(alloc: &Allocator<SimDevice>) -> Vec<DeviceAddr> {
    let scope = alloc.named_scope("mixed", S0);
    let a = scope.alloc(MIB).unwrap();
    let u = scope.alloc_unbound(3 * MIB).unwrap();
    let b = scope.alloc(64 * 1024).unwrap();
    std::thread::spawn(move || drop(u)).join().unwrap(); // queued; recorded at the next alloc
    let c = scope.alloc(3 * MIB).unwrap(); // may take u's slice: its free is recorded first
    let ptrs = vec![a.ptr(), b.ptr(), c.ptr()];
    drop((a, b, c));
    ptrs
}

#[test]
fn unbound_frees_from_other_threads_are_recorded_in_order_and_the_plan_holds() {
    let (dev, alloc) = setup(1 << 32);
    mixed_step(&alloc);
    let planned = mixed_step(&alloc);
    let s = alloc.stats();
    assert_eq!((s.plan_hits, s.plan_misses, s.plan_fallbacks), (4, 0, 0));
    // Run 2's `c` reuses the slice of run 2's `u`, freed on the other thread before it.
    let layout = alloc.snapshot();
    assert_eq!(layout.iter().filter(|seg| seg.size >= 4 * MIB).count(), 1, "one region");
    for run in 3..6 {
        assert_eq!(mixed_step(&alloc), planned, "run {run}");
    }
    let s = alloc.stats();
    assert_eq!((s.plan_hits, s.plan_fallbacks, s.scope_escapes), (4 * 4, 0, 0));
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn bound_planned_buffers_take_no_lock_and_reuse_slices_by_lifetime() {
    let (dev, alloc) = setup(1 << 32);
    let run = |alloc: &Allocator<SimDevice>| {
        let scope = alloc.named_scope("bound", S0);
        let x = scope.alloc(MIB).unwrap();
        let y = scope.alloc(MIB).unwrap();
        let (px, py) = (x.ptr(), y.ptr());
        drop(x);
        let z = scope.alloc(MIB).unwrap(); // x is dead: the plan gives z x's slice
        let pz = z.ptr();
        let planned = [&y, &z].iter().all(|b| b.is_planned());
        drop((y, z));
        (px, py, pz, planned)
    };
    let (_, _, _, planned) = run(&alloc);
    assert!(!planned, "the learning run comes from the pool");
    let (px, py, pz, planned) = run(&alloc);
    assert!(planned);
    assert_eq!(pz, px, "z reuses x's slice");
    assert_eq!(py.0, px.0 + MIB, "y sits right after x");
    assert_eq!(alloc.stats().plan_region_bytes, 2 * MIB);
    let locks = alloc.global_lock_acquisitions();
    let mallocs = dev.counters().mallocs;
    for _ in 0..5 {
        assert_eq!(run(&alloc), (px, py, pz, true));
    }
    assert_eq!(alloc.global_lock_acquisitions(), locks, "planned runs never take the lock");
    assert_eq!(dev.counters().mallocs, mallocs);
    let s = alloc.stats();
    assert_eq!((s.plan_hits, s.plan_misses, s.plan_fallbacks), (3 * 6, 0, 0));
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn a_forgotten_scoped_buffer_is_reclaimed_at_exit_and_a_forgotten_slice_forces_relearning() {
    let (dev, alloc) = setup(1 << 32);
    {
        let scope = alloc.named_scope("leaky", S0);
        let a = scope.alloc(MIB).unwrap();
        std::mem::forget(a); // a pool block: the scope still holds it and frees it at exit
    }
    let s = alloc.stats();
    assert_eq!(s.plan_region_bytes, MIB, "the plan's region, made as the scope learned");
    assert_eq!(s.blocks.allocated_bytes.all.current, MIB, "nothing else stays allocated");
    {
        let scope = alloc.named_scope("leaky", S0);
        drop(scope.alloc(MIB).unwrap()); // planned, then diverges (a free); learns [alloc, free]
    }
    {
        let scope = alloc.named_scope("leaky", S0);
        let a = scope.alloc(MIB).unwrap();
        assert!(a.is_planned());
        std::mem::forget(a); // its free never happens: the run did not follow the plan
    }
    let s = alloc.stats();
    assert_eq!((s.plan_hits, s.plan_fallbacks), (2, 2));
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert!(dev.live_segments().is_empty(), "nothing leaked");
}

/// A learning run with one activation and one escaping gradient in a fresh 2 MiB segment.
/// Returns the gradient.
fn adopt_step(alloc: &Allocator<SimDevice>) -> Buffer<SimDevice> {
    adopt_step_on(alloc, S0)
}

/// [`adopt_step`] on `stream`.
fn adopt_step_on(alloc: &Allocator<SimDevice>, stream: StreamId) -> Buffer<SimDevice> {
    let scope = alloc.named_scope("adopt", stream);
    let act = scope.alloc_unbound(64 * 1024).unwrap();
    let grad = scope.alloc_unbound(16 * 1024).unwrap();
    drop(act);
    grad
}

/// [`assert_clean_end`] after `empty_cache` has let go of every plan region (nothing is live).
fn empty_cache_clean_end(dev: &SimDevice, alloc: Allocator<SimDevice>) {
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().plan_region_bytes, 0);
    assert_clean_end(dev, alloc);
}

/// With every allocator and buffer gone: the sanitizer saw nothing and nothing is left on the
/// device.
fn assert_device_clean(dev: &SimDevice) {
    assert_eq!(dev.violations(), vec![]);
    assert!(dev.live_segments().is_empty(), "nothing leaked");
}

/// The end of a test: the invariants hold, the sanitizer saw nothing, and once the allocator
/// goes nothing is left on the device.
fn assert_clean_end(dev: &SimDevice, alloc: Allocator<SimDevice>) {
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    assert!(dev.live_segments().is_empty(), "nothing leaked");
}

#[test]
fn the_first_plan_adopts_the_segment_of_its_escapes_so_the_second_run_calls_nothing() {
    use tidepool::device::SIM_BASE;
    let (dev, alloc) = setup(1 << 30);
    let g1 = adopt_step(&alloc);
    // Run 1 put act at the base and grad after it; at its exit the segment (only grad live)
    // became the region: grad's range pinned, the rest allocated to the region.
    assert_eq!(g1.ptr(), DeviceAddr(SIM_BASE + 64 * 1024));
    let s = alloc.stats();
    assert_eq!(s.plan_region_bytes, 2 * MIB);
    assert_eq!(s.blocks.allocated_bytes.all.current, 2 * MIB, "region blocks + the escape");
    assert_eq!((dev.counters().mallocs, s.best_fit_searches), (1, 2));
    drop(g1); // zero_grad: the escape's block joins the region
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 2 * MIB);
    let g2 = adopt_step(&alloc);
    // Largest first: act (64 KiB) at the base, grad (16 KiB, live to the end) above it.
    assert_eq!(g2.ptr(), DeviceAddr(SIM_BASE + 64 * 1024));
    assert!(g2.is_planned());
    let s = alloc.stats();
    assert_eq!((s.plan_hits, s.plan_misses, s.plan_fallbacks), (2, 0, 0));
    assert_eq!((dev.counters().mallocs, s.best_fit_searches), (1, 2), "run 2: no call at all");
    drop(g2);
    for _ in 0..3 {
        drop(adopt_step(&alloc));
    }
    assert_eq!(alloc.stats().plan_hits, 2 * 4, "runs 2 to 5");
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    assert!(dev.live_segments().is_empty());
}

#[test]
fn an_escape_still_live_keeps_its_range_out_of_the_plan_and_one_used_elsewhere_joins_later() {
    let (dev, alloc) = setup(1 << 30);
    let other = dev.create_stream().unwrap();
    let g1 = adopt_step(&alloc);
    alloc.record_stream(&g1, other).unwrap();
    // Run 2 before g1 is freed: the gradient's slice overlaps g1's pinned range, so that one
    // allocation misses the plan and comes from the pool.
    let g2 = adopt_step(&alloc);
    assert!(!g2.is_planned());
    assert_ne!(g2.ptr(), g1.ptr());
    assert_eq!(alloc.stats().plan_misses, 1);
    // g1 was used on another stream: its block joins the region once an event recorded there
    // completes (at once: `other` has no work), and run 3 is planned at its address. (Before,
    // its range stayed pinned for good; `cfg(tidepool_broken = "escape_pinned")`.)
    let escape = g1.ptr();
    drop(g1);
    drop(g2);
    let g3 = adopt_step(&alloc);
    assert!(g3.is_planned());
    assert_eq!(g3.ptr(), escape);
    drop(g3);
    alloc.synchronize().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    assert!(dev.live_segments().is_empty(), "nothing leaked");
}

#[test]
fn escapes_freed_on_other_threads_while_the_scope_exits_are_never_lost() {
    for round in 0..200 {
        let (dev, alloc) = setup(1 << 30);
        let scope = alloc.named_scope("race", S0);
        let grads: Vec<_> = (0..4).map(|i| scope.alloc_unbound((i + 1) * 4096).unwrap()).collect();
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let freer = {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                drop(grads); // before, during or after the exit's adoption
            })
        };
        barrier.wait();
        drop(scope);
        freer.join().unwrap();
        alloc.check_invariants().unwrap_or_else(|e| panic!("round {round}: {e}"));
        let region = alloc.stats().plan_region_bytes;
        assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, region, "round {round}");
        drop(alloc);
        assert!(dev.live_segments().is_empty(), "round {round}");
    }
}

/// A learning run whose segment also holds a block allocated outside the scope (still live).
fn walls_step(alloc: &Allocator<SimDevice>) -> (Buffer<SimDevice>, Buffer<SimDevice>) {
    let scope = alloc.named_scope("walls", S0);
    let grad = scope.alloc_unbound(2 * MIB).unwrap();
    let other = alloc.alloc(2 * MIB, S0).unwrap(); // not the scope's: stays busy
    let act = scope.alloc_unbound(6 * MIB).unwrap();
    drop(act);
    (grad, other)
}

#[test]
fn a_busy_block_in_the_segment_of_the_escapes_is_a_wall_of_the_plan() {
    let (dev, alloc) = setup(1 << 30);
    // Run 1, one 20 MiB segment: grad [0, 2) MiB, other [2, 4), act [4, 10) then freed. At the
    // exit the segment holds an escape, so it is a bin, and `other` is a wall inside it.
    let (g1, other) = walls_step(&alloc);
    let seg = g1.ptr().0;
    assert_eq!(other.ptr().0, seg + 2 * MIB);
    // The region: the segment but the wall, no fresh block.
    assert_eq!(alloc.stats().plan_region_bytes, 18 * MIB);
    drop(g1);
    // Run 2: act (largest first) cannot start at 0 (it would cover the wall): it goes above it,
    // and grad takes the bottom again.
    let scope = alloc.named_scope("walls", S0);
    let g2 = scope.alloc_unbound(2 * MIB).unwrap();
    let act = scope.alloc_unbound(6 * MIB).unwrap();
    assert!(g2.is_planned() && act.is_planned());
    assert_eq!((g2.ptr().0, act.ptr().0), (seg, seg + 4 * MIB));
    assert_eq!(dev.counters().mallocs, 1, "run 2 calls nothing");
    assert_eq!(dev.violations(), vec![]);
    drop((act, scope, g2, other));
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert!(dev.live_segments().is_empty());
}

/// With the sanitizer on, the planned path leaves every run to the general path, which tells
/// the sanitizer each hand-out and free: a planned slice reused while another stream still
/// writes it (the user forgot `record_stream`) is reported. The planned path itself tells it
/// nothing, so with it (broken mode `PlannedUnobserved`) the misuse goes unseen.
#[test]
fn the_sanitizer_sees_every_planned_handout() {
    for broken in [false, true] {
        let (dev, alloc) = setup(1 << 30);
        alloc.set_broken(Broken::PlannedUnobserved, broken);
        let b = dev.create_stream().unwrap();
        let run = |misuse: bool| {
            let scope = alloc.named_scope("s", S0);
            let x = scope.alloc(4096).unwrap();
            let w = scope.alloc(4096).unwrap();
            let px = x.ptr();
            let mut open = None;
            if misuse {
                let e = dev.create_event().unwrap();
                dev.record_event(e, S0).unwrap();
                dev.wait_event(b, e).unwrap();
                let (k, o) = gated_write(px, 4096);
                dev.launch(b, k).unwrap();
                open = Some(o); // no record_stream: the allocator cannot know
            }
            drop(x);
            let y = scope.alloc(4096).unwrap();
            let planned = [&w, &y].iter().all(|b| b.is_planned());
            assert_eq!(y.ptr(), px, "y takes x's slice");
            drop((w, y));
            (planned, open)
        };
        let (planned, _) = run(false); // learn
        assert!(!planned);
        assert!(run(false).0, "the second run is planned");
        let (planned, open) = run(true);
        assert!(planned);
        open.unwrap().send(()).unwrap();
        dev.synchronize().unwrap();
        let v = dev.violations();
        let reuse =
            |x: &tidepool::device::Violation| x.op.contains("handout") && x.other == Some(b);
        match broken {
            false => assert!(
                v.len() == 1 && reuse(&v[0]),
                "the reuse of x's slice while b writes it is reported: {v:?}"
            ),
            true => assert!(!v.iter().any(reuse), "the planned path told the sanitizer nothing"),
        }
        assert_eq!(alloc.stats().plan_hits, 6);
    }
}

/// The planned path (a device without a sanitizer) serves exactly as the general path (the
/// same device with one): the same slices, sizes and plan figures, through runs with an
/// unbound buffer freed on another thread, a zero-byte buffer, a divergence, a planned buffer
/// used on another stream and a failed allocation.
#[test]
fn the_planned_path_serves_as_the_general_path_does() {
    let runs = |sanitize: bool| {
        let dev = Arc::new(SimDevice::with_config(tidepool::SimConfig {
            capacity: 1 << 32,
            backed: false,
            sanitize,
        }));
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let b = dev.create_stream().unwrap();
        let mut seen = Vec::new();
        for run in 0..7u64 {
            let scope = alloc.named_scope("same", S0);
            let x = scope.alloc(MIB).unwrap();
            let u = scope.alloc_unbound(3 * MIB).unwrap();
            let z = scope.alloc(0).unwrap();
            let y = scope.alloc(64 * 1024 - 100).unwrap();
            std::thread::spawn(move || drop(u)).join().unwrap(); // queued for the scope
            let w = scope.alloc(3 * MIB - 511).unwrap(); // its step comes after u's free
            if run == 4 {
                y.record_stream(b).unwrap();
            }
            if run == 5 {
                assert!(matches!(scope.alloc(u64::MAX), Err(AllocError::InvalidSize { .. })));
            }
            let v = scope.alloc(if run == 3 { 8192 } else { 4096 }).unwrap(); // run 3 diverges
            let base = x.ptr().0 as i64;
            for buf in [&x, &z, &y, &w, &v] {
                let at = (buf.ptr().0 as i64 - base) * i64::from(buf.is_planned());
                seen.push((run, at, buf.len(), buf.block_size(), buf.is_planned()));
            }
            drop((x, y));
            drop((z, w, v));
            drop(scope);
            let s = alloc.stats();
            seen.push((run, s.plan_hits as i64, s.plan_misses, s.plan_fallbacks, false));
        }
        alloc.check_invariants().unwrap();
        assert_eq!(dev.violations(), vec![]);
        seen
    };
    let general = runs(true);
    assert_eq!(runs(false), general);
    // Runs 1, 2, 5 and 6 follow their plan: five planned allocations each (x, u, y, w, v; the
    // zero-byte one is no step, the failed one neither). Run 3 diverges at v (8192 bytes) and
    // relearns; run 4 diverges from that plan at v (4096 again) and relearns.
    let hits: Vec<i64> = general.iter().skip(5).step_by(6).map(|s| s.1).collect();
    assert_eq!(hits, vec![0, 5, 10, 14, 18, 23, 28]);
    assert!(general.iter().filter(|s| s.0 == 6 && s.2 > 0).all(|s| s.4), "run 6 is planned");
    // A scoped buffer is four words: scope, address, length, and an id that is its free's code.
    assert_eq!(std::mem::size_of::<tidepool::ScopedBuffer<'_, SimDevice>>(), 32);
}

/// A guard or a capture that begins on a scope's stream while a planned run is open, on this
/// thread or another, stops the planned path at once: the next allocation is refused
/// (`StreamRouted`) as any scoped allocation on a routed stream, and once the route ends the
/// run goes on following its plan. The planned path reads the routes at every allocation (a
/// relaxed load ORed into its size check); reading them as they were when the scope opened
/// (broken mode `PlannedStaleRoutes`) serves the refused request from the plan.
#[test]
fn a_route_begun_while_a_planned_scope_is_open_stops_its_planned_path() {
    for broken in [false, true] {
        // No sanitizer: the planned path serves (with one, every run takes the general path).
        let cfg = tidepool::SimConfig { capacity: 1 << 30, backed: false, sanitize: false };
        let dev = Arc::new(SimDevice::with_config(cfg));
        let s = dev.create_stream().unwrap();
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        alloc.set_broken(Broken::PlannedStaleRoutes, broken);
        let pool = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
        // Each refused request is the plan's next allocation, so a stale route flag serves it.
        let refused = |r: Result<tidepool::ScopedBuffer<'_, SimDevice>, AllocError>| match r {
            Ok(b) => format!("served, planned: {}", b.is_planned()),
            Err(e) => format!("{e:?}"),
        };
        let run = || {
            let scope = alloc.named_scope("routed", s);
            let a = scope.alloc(4096).unwrap();
            let guard = alloc.use_pool(&pool, s).unwrap(); // a guard on this thread
            let r1 = refused(scope.alloc(8192));
            drop(guard);
            let b = scope.alloc(8192).unwrap();
            let (began, began_rx) = mpsc::channel();
            let (end, end_rx) = mpsc::channel::<()>();
            let r2 = std::thread::scope(|t| {
                let (alloc, pool) = (&alloc, &pool);
                t.spawn(move || {
                    let guard = alloc.use_pool(pool, s).unwrap(); // and on another thread
                    began.send(()).unwrap();
                    end_rx.recv().unwrap();
                    drop(guard);
                });
                began_rx.recv().unwrap();
                let r = refused(scope.alloc(16384));
                end.send(()).unwrap();
                r
            });
            let c = scope.alloc(16384).unwrap();
            alloc.begin_capture(s, None).unwrap(); // a capture
            let r3 = refused(scope.alloc(512));
            drop(alloc.end_capture(s).unwrap());
            let d = scope.alloc(512).unwrap();
            let bufs = [&a, &b, &c, &d];
            let planned = bufs.iter().map(|b| b.is_planned()).collect::<Vec<_>>();
            let ptrs = bufs.iter().map(|b| b.ptr()).collect::<Vec<_>>();
            drop((a, b, c, d));
            ([r1, r2, r3], planned, ptrs)
        };
        let routed = format!("{:?}", AllocError::StreamRouted(s));
        let (learned, planned, _) = run();
        assert_eq!(learned, [routed.clone(), routed.clone(), routed.clone()]);
        assert_eq!(planned, [false; 4], "the first run learns");
        let (r, planned, ptrs) = run();
        match broken {
            false => {
                assert_eq!(r, [routed.clone(), routed.clone(), routed.clone()]);
                assert_eq!(planned, [true; 4], "the run follows its plan around the routes");
                let (r, planned, again) = run();
                assert_eq!(
                    (r, planned, again),
                    ([routed.clone(), routed.clone(), routed], vec![true; 4], ptrs)
                );
                let st = alloc.stats();
                assert_eq!((st.plan_hits, st.plan_misses, st.plan_fallbacks), (8, 0, 0));
            }
            true => assert_eq!(r[0], "served, planned: true", "a stale flag serves the plan"),
        }
        alloc.check_invariants().unwrap();
        assert_eq!(dev.violations(), vec![]);
    }
}

/// A kernel on the default stream writes the first 4 KiB of `buf`; waits for it (the
/// sanitizer reports a write to memory the allocator does not hold).
fn write_and_wait(dev: &SimDevice, buf: &Buffer<SimDevice>) {
    let access = vec![Access { ptr: buf.ptr(), bytes: 4096, kind: AccessKind::Write }];
    dev.launch(S0, Kernel::new("w", access, |_| {})).unwrap();
    dev.synchronize().unwrap();
}

/// Runs `train_step` until it is planned, lets its region go idle with a kernel still writing
/// it, calls `empty_cache`, then runs the step twice more, a kernel writing each run's gradient.
/// Returns (region bytes before, region bytes after `empty_cache`, plan hits of the two runs,
/// violations).
fn empty_cache_between_runs(
    broken: bool,
) -> (u64, u64, [u64; 2], Vec<tidepool::device::Violation>) {
    let (dev, alloc) = setup(1 << 32);
    alloc.set_broken(Broken::AdoptedPlanKept, broken);
    let (_, grad) = step(&alloc, &SIZES);
    drop(grad);
    let (_, grad) = step(&alloc, &SIZES);
    let region = alloc.stats().plan_region_bytes;
    let line = |a: &Allocator<SimDevice>| {
        a.memory_summary().lines().find(|l| l.starts_with("| Plan regions")).map(str::to_string)
    };
    let shown = line(&alloc).expect("the summary shows the region");
    assert!(shown.contains(&tidepool::Bytes(region).to_string()), "{shown}");
    // A live escape of the planned run (the gradient) holds the region: kept.
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().plan_region_bytes, region, "an escape holds it");
    // A kernel still writes the region's memory as its last holder goes.
    let (k, open) = gated_write(grad.ptr(), 4096);
    dev.launch(S0, k).unwrap();
    drop(grad);
    let reserved = alloc.stats().blocks.reserved_bytes.all.current;
    let frees = dev.counters().frees;
    let gate = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(20));
        open.send(()).unwrap();
    });
    alloc.empty_cache().unwrap(); // waits for the kernel (cudaFree's device sync)
    gate.join().unwrap();
    let s = alloc.stats();
    let after = s.plan_region_bytes;
    assert_eq!(line(&alloc).is_some(), after > 0, "shown while there is one");
    assert!(dev.counters().frees > frees, "the region's memory went back to the device");
    assert!(s.blocks.reserved_bytes.all.current < reserved);
    assert_eq!(s.blocks.allocated_bytes.all.current, 0);
    alloc.check_invariants().unwrap();
    let mut hits = [0; 2];
    for h in &mut hits {
        let before = alloc.stats().plan_hits;
        let (_, grad) = step(&alloc, &SIZES);
        *h = alloc.stats().plan_hits - before;
        write_and_wait(&dev, &grad);
        drop(grad);
    }
    alloc.check_invariants().unwrap();
    (region, after, hits, dev.violations())
}

/// `empty_cache` releases the region of a plan that no run, planned buffer, graph or escape
/// holds (PyTorch's `empty_cache` releases every cached block no tensor uses; a region is
/// cached memory). This plan's region adopted its learning run's segments, so its offsets are
/// addresses in them: the plan goes with the region, the next run learns again and the one
/// after is planned throughout.
#[test]
fn empty_cache_releases_an_idle_plan_region() {
    let (region, after, hits, violations) = empty_cache_between_runs(false);
    assert!(region > 0);
    assert_eq!(after, 0, "the idle region went");
    assert_eq!(hits, [0, 7], "a learning run, then a planned one");
    assert_eq!(violations, vec![]);
}

/// The broken mode keeps the adopted plan: the next run makes a region elsewhere and hands out
/// slices at the old addresses, which the kernel finds unallocated.
#[test]
fn the_checks_catch_an_adopted_plan_kept_past_its_region() {
    let (_, after, hits, violations) = empty_cache_between_runs(true);
    assert_eq!(after, 0);
    assert_eq!(hits[0], 7, "planned from the kept plan");
    assert!(
        violations.iter().any(|v| v.op.contains("touches unallocated memory")),
        "{violations:?}"
    );
}

/// A plan whose offsets are relative to its region (learned again after a diverging run, its
/// region made by `make_region`) stays learned when `empty_cache` releases the region: the
/// next run makes the region anew and is planned throughout.
#[test]
fn empty_cache_keeps_a_relative_plan_and_the_next_run_makes_its_region() {
    let (dev, alloc) = setup(1 << 32);
    // Learn, then diverge (a different step) so the scope learns a plan with its own region.
    for sizes in [&SIZES[..], &SIZES[..4], &SIZES[..4]] {
        let (_, grad) = step(&alloc, sizes);
        drop(grad);
    }
    let region = alloc.stats().plan_region_bytes;
    alloc.empty_cache().unwrap();
    let released = alloc.stats().plan_region_bytes;
    let hits = alloc.stats().plan_hits;
    let (_, grad) = step(&alloc, &SIZES[..4]);
    write_and_wait(&dev, &grad);
    drop(grad);
    assert_eq!((region > 0, released), (true, 0));
    assert_eq!(alloc.stats().plan_hits - hits, 5, "planned throughout");
    assert_eq!(alloc.stats().plan_region_bytes, region, "made anew, the same size");
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// A run that holds the plan's region (open, claimed) keeps it through `empty_cache`.
#[test]
fn empty_cache_keeps_the_region_of_an_open_run() {
    let (dev, alloc) = setup(1 << 32);
    for _ in 0..2 {
        let (_, grad) = step(&alloc, &SIZES);
        drop(grad);
    }
    let region = alloc.stats().plan_region_bytes;
    let scope = alloc.named_scope("train_step", S0);
    let a = scope.alloc_unbound(SIZES[0]).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().plan_region_bytes, region, "the open run holds it");
    let (k, open) = gated_write(a.ptr(), 4096);
    dev.launch(S0, k).unwrap();
    open.send(()).unwrap();
    drop(a);
    drop(scope);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().plan_region_bytes, 0, "idle once the run ended");
    alloc.check_invariants().unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// A request the device holds only with the memory of an idle plan region: (the allocation
/// succeeded, region bytes before, region bytes after, `num_ooms`).
fn oom_with_an_idle_region(broken: bool) -> (bool, u64, u64, u64) {
    let (dev, alloc) = setup(64 * MIB);
    alloc.set_broken(Broken::OomKeepsRegions, broken);
    for _ in 0..2 {
        let (_, grad) = step(&alloc, &SIZES);
        drop(grad);
    }
    let region = alloc.stats().plan_region_bytes;
    let big = alloc.alloc(60 * MIB, S0);
    let ok = big.is_ok();
    if let Ok(b) = &big {
        write_and_wait(&dev, b);
    }
    drop(big);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    let s = alloc.stats();
    (ok, region, s.plan_region_bytes, s.num_ooms)
}

/// Out of memory, the ladder lets go of idle plan regions with the other cached memory, as
/// `empty_cache` would (PyTorch frees every cached block before giving up): the request
/// succeeds, and no out-of-memory error is counted.
#[test]
fn an_allocation_out_of_memory_releases_idle_plan_regions_first() {
    let (ok, region, after, ooms) = oom_with_an_idle_region(false);
    assert!(region > 4 * MIB, "{region}");
    assert_eq!((ok, after, ooms), (true, 0, 0));
}

#[test]
fn the_checks_catch_an_oom_that_keeps_idle_regions() {
    let (ok, region, after, ooms) = oom_with_an_idle_region(true);
    assert_eq!((ok, after, ooms), (false, region, 1), "the region held the memory");
}

/// What [`escape_used_elsewhere`] saw of each run after the first.
#[derive(Debug, PartialEq)]
struct ElsewhereRun {
    /// Whether run 2 (the other stream still writing the escape) and run 3 (that work done)
    /// placed their gradient at the escape's address, planned.
    planned_at_escape: [bool; 2],
    /// Plan hits and misses of runs 2 and 3.
    hits_misses: [(u64, u64); 2],
    /// Region bytes after `empty_cache`, with nothing live.
    region_after_empty_cache: u64,
}

/// A learning run's escape (the gradient) is written by a kernel on another stream, still
/// running when the escape is freed (a gradient the communication stream reads, in data
/// parallel training). Run 2 comes while that kernel runs, run 3 after it; last, `empty_cache`
/// with nothing live. Every kernel writes its buffer, so the sanitizer sees any premature reuse.
fn escape_used_elsewhere() -> ElsewhereRun {
    let (dev, alloc) = setup(1 << 30);
    let other = dev.create_stream().unwrap();
    let write = |ptr: DeviceAddr| {
        Kernel::new("w", vec![Access { ptr, bytes: 4096, kind: AccessKind::Write }], |_| {})
    };
    let g1 = adopt_step(&alloc);
    let escape = g1.ptr();
    g1.use_on(other, AccessKind::Write).unwrap();
    let (k, open) = gated_write(escape, 4096);
    dev.launch(other, k).unwrap();
    drop(g1); // `other` still writes it
    let mut planned_at_escape = [false; 2];
    let mut hits_misses = [(0, 0); 2];
    for run in 0..2 {
        if run == 1 {
            open.send(()).unwrap();
            dev.synchronize().unwrap();
        }
        let before = alloc.stats();
        let g = adopt_step(&alloc);
        let after = alloc.stats();
        planned_at_escape[run] = g.is_planned() && g.ptr() == escape;
        hits_misses[run] =
            (after.plan_hits - before.plan_hits, after.plan_misses - before.plan_misses);
        dev.launch(S0, write(g.ptr())).unwrap();
        drop(g);
        alloc.check_invariants().unwrap();
    }
    dev.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    let region_after_empty_cache = alloc.stats().plan_region_bytes;
    assert_clean_end(&dev, alloc);
    ElsewhereRun { planned_at_escape, hits_misses, region_after_empty_cache }
}

/// An escape used on another stream joins the region that adopted its segment once that
/// stream's work on it is done: run 2, while the work runs, misses the plan there (the slice
/// stays pinned); run 3 is planned throughout, at the escape's address; and the region is idle
/// once nothing is live, so `empty_cache` lets go of it. Before, the slice stayed pinned for
/// good: every later run missed there and no `empty_cache` ever let go of the region (the
/// broken build `cfg(tidepool_broken = "escape_pinned")`).
#[test]
fn an_escape_used_on_another_stream_joins_its_region_after_that_streams_work() {
    let r = escape_used_elsewhere();
    assert_eq!(
        r,
        ElsewhereRun {
            planned_at_escape: [false, true],
            hits_misses: [(1, 1), (2, 0)],
            region_after_empty_cache: 0,
        }
    );
}

/// The allocator goes (its last handle dropped, on another thread) while an escape still
/// settles into its region: the region's memory goes back to the device only after the other
/// stream's work on the escape is done.
#[test]
fn an_allocator_dropped_while_an_escape_settles_waits_for_the_other_streams_work() {
    let (dev, alloc, open) = settling_escape(1 << 30);
    let dropper = std::thread::spawn(move || drop(alloc));
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(!dropper.is_finished(), "the drop waits for the other stream");
    assert_eq!(dev.live_segments().len(), 1);
    open.send(()).unwrap();
    dropper.join().unwrap();
    assert_device_clean(&dev);
}

/// An escape used on a stream that the allocator then destroyed (drained: nothing of its work
/// is left) joins its region as it is freed, with no event to wait for.
#[test]
fn an_escape_used_on_a_destroyed_stream_joins_its_region_at_once() {
    let (dev, alloc) = setup(1 << 30);
    let other = dev.create_stream().unwrap();
    let g1 = adopt_step(&alloc);
    let escape = g1.ptr();
    g1.use_on(other, AccessKind::Write).unwrap();
    alloc.destroy_stream(other).unwrap();
    let events = dev.counters().event_records;
    drop(g1);
    assert_eq!(dev.counters().event_records, events, "no event on a destroyed stream");
    let g2 = adopt_step(&alloc);
    assert!(g2.is_planned());
    assert_eq!(g2.ptr(), escape);
    drop(g2);
    empty_cache_clean_end(&dev, alloc);
}

/// The allocator dropped right after an escape used on a destroyed stream is freed: nothing is
/// left on the device.
#[test]
fn an_allocator_dropped_after_an_escape_used_on_a_destroyed_stream_leaks_nothing() {
    let (dev, alloc) = setup(1 << 30);
    let other = dev.create_stream().unwrap();
    let g1 = adopt_step(&alloc);
    g1.use_on(other, AccessKind::Write).unwrap();
    alloc.destroy_stream(other).unwrap();
    drop(g1);
    assert_clean_end(&dev, alloc);
}

/// An escape used on a stream destroyed through the allocator, then the scope's own stream
/// destroyed (its plans forgotten, their region let go of): the escape's block goes back with
/// the region, and nothing is left on the device once the allocator goes. (`multi_props` found
/// the first version pending such a block on no event, for good: its segment leaked.)
#[test]
fn a_region_let_go_of_after_an_escape_used_on_a_destroyed_stream_leaks_nothing() {
    let (dev, alloc) = setup(1 << 30);
    let s = dev.create_stream().unwrap();
    let other = dev.create_stream().unwrap();
    let g1 = adopt_step_on(&alloc, s);
    g1.use_on(other, AccessKind::Write).unwrap();
    alloc.destroy_stream(other).unwrap();
    drop(g1);
    alloc.destroy_stream(s).unwrap();
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 0);
    assert_clean_end(&dev, alloc);
}

/// An escape used on another stream whose event the device refuses to record: its free waits
/// on the host for every stream's work (one counted sync; the other stream's kernel is still
/// writing the escape until its gate opens 50 ms later), then the escape joins its region at
/// once. The next run is planned throughout at the escape's address, and `empty_cache` lets go
/// of the region. (The broken build `cfg(tidepool_broken = "escape_unmarked_pinned")` frees the
/// block into the pool without the wait, as before: its slice stays pinned for good.)
#[test]
fn an_escape_whose_event_cannot_be_recorded_joins_its_region_after_a_host_wait() {
    let (dev, alloc) = setup(1 << 30);
    let (g1, _, open) = escape_written_elsewhere(&dev, &alloc);
    let escape = g1.ptr();
    let syncs = alloc.stats().num_host_syncs;
    dev.fail_event_records(true);
    let opener = open_later(open);
    drop(g1); // waits for `other`'s kernel
    opener.join().unwrap();
    dev.fail_event_records(false);
    assert_eq!(alloc.stats().num_host_syncs, syncs + 1, "one counted host wait");
    let before = alloc.stats();
    let g2 = adopt_step(&alloc);
    let after = alloc.stats();
    assert_eq!((g2.is_planned(), g2.ptr()), (true, escape));
    assert_eq!(
        (after.plan_hits - before.plan_hits, after.plan_misses - before.plan_misses),
        (2, 0)
    );
    let w = vec![Access { ptr: g2.ptr(), bytes: 4096, kind: AccessKind::Write }];
    dev.launch(S0, Kernel::new("w", w, |_| {})).unwrap();
    drop(g2);
    dev.synchronize().unwrap();
    empty_cache_clean_end(&dev, alloc);
}

/// An escape that joins its region at once as it is freed (used on another stream, no event
/// recordable, so the host waited) must be taken back from the sanitizer's view *before* its
/// slice is unpinned: a run holding the region on another thread may plan a slice over it as
/// soon as it is. The device stops the free inside that `note_reclaim` while the other thread's
/// run asks for the escape's slice. Now the slice is still pinned then: the run misses the plan
/// there and waits for the lock, and the sanitizer sees nothing. (The broken build
/// `cfg(tidepool_broken = "escape_reclaimed_late")` reclaims after the unpin, as before: the run
/// is handed the slice while the sanitizer still counts the escape live — "handout of memory
/// already handed out". `multi_props` found it, as a run's planned slice and a pool block over
/// one range, with the host-waiting free of the last commit making such escapes common.)
#[test]
fn an_escape_joining_its_region_at_once_is_reclaimed_before_a_run_can_plan_over_it() {
    let (dev, alloc) = setup(1 << 30);
    let (g1, _, open) = escape_written_elsewhere(&dev, &alloc);
    open.send(()).unwrap();
    let escape = g1.ptr();
    let (go, go_rx) = mpsc::channel::<()>();
    let (done, done_rx) = mpsc::channel::<()>();
    let (ready, ready_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let alloc = &alloc;
        s.spawn(move || {
            let scope = alloc.named_scope("adopt", S0); // run 2: claims the region
            let act = scope.alloc_unbound(64 * 1024).unwrap();
            ready.send(()).unwrap();
            go_rx.recv().unwrap();
            let grad = scope.alloc_unbound(16 * 1024).unwrap(); // the escape's slice in the plan
            let _ = done.send(()); // (fixed: the free stopped waiting already)
            drop((grad, act));
        });
        ready_rx.recv().unwrap();
        let once = Mutex::new(Some((go, done_rx)));
        dev.before_reclaim(Some(Arc::new(move |ptr, _| {
            let Some((go, done_rx)) = once.lock().unwrap().take_if(|_| ptr == escape) else {
                return;
            };
            go.send(()).unwrap();
            // Fixed: the run waits for the lock this free holds, so this times out.
            let _ = done_rx.recv_timeout(std::time::Duration::from_millis(100));
        })));
        dev.fail_event_records(true);
        drop(g1);
        dev.fail_event_records(false);
    });
    dev.before_reclaim(None);
    assert_eq!(dev.violations(), vec![]);
    empty_cache_clean_end(&dev, alloc);
}

/// An escape used on another stream, freed after the allocator's last handle went (closed),
/// while that stream's kernel still writes it: the free waits on the host for that work, as a
/// freed buffer's block does in a closed allocator, and the region, idle then, goes back to the
/// device at once. Only the segment of the buffer still live on the other stream is left.
/// (The broken build `cfg(tidepool_broken = "closed_settling")` lets the escape settle, as in
/// an open allocator: no later lock section lets it join, and the region's 2 MiB segment stays
/// until the last buffer goes. Fuzzing found it once the closed-teardown rule held programs
/// with escapes too.)
#[test]
fn an_escape_freed_into_a_closed_allocator_waits_for_the_other_stream_and_its_region_goes() {
    let (dev, alloc) = setup(1 << 30);
    let (g1, other, open) = escape_written_elsewhere(&dev, &alloc);
    let keep = alloc.alloc(4096, other).unwrap();
    drop(alloc); // closed: `g1` and `keep` still hold it
    assert_eq!(dev.live_segments().len(), 2, "the region's segment and keep's");
    let opener = open_later(open);
    drop(g1); // waits for `other`'s kernel
    opener.join().unwrap();
    assert_eq!(dev.live_segments(), vec![(keep.ptr(), 2 * MIB)]);
    drop(keep);
    assert_device_clean(&dev);
}

/// A closed allocator's region let go of with an escape still settling into it: run 1 leaves
/// two escapes in its region; the first is freed while another stream still writes it
/// (settling); run 2 diverges, so the scope learns anew and the plan lets go of the region
/// (only the second escape's run holds it now); the allocator closes (its last handle goes);
/// then the second escape is freed, and the region, held by nothing, hands the settling block
/// to the pool *pending* on its event. In a closed allocator no later lock section may come to
/// poll that event, so the free waits for it on the host (the gate opens 50 ms later) and the
/// region's segment goes back: only `keep`'s is left. (The broken build
/// `cfg(tidepool_broken = "closed_pending_polled")` only polls: the region's 2 MiB segment stays
/// after the free. Fuzzing found it, once the closed-teardown rule held programs with escapes.)
#[test]
fn a_closed_allocator_waits_for_a_block_pending_from_a_region_let_go_of() {
    let (dev, alloc) = setup(1 << 30);
    let other = dev.create_stream().unwrap();
    let (g1, g2) = {
        let scope = alloc.named_scope("adopt", S0);
        let act = scope.alloc_unbound(64 * 1024).unwrap();
        let g1 = scope.alloc_unbound(16 * 1024).unwrap();
        let g2 = scope.alloc_unbound(16 * 1024).unwrap();
        drop(act);
        (g1, g2)
    };
    g1.use_on(other, AccessKind::Write).unwrap();
    let (k, open) = gated_write(g1.ptr(), 4096);
    dev.launch(other, k).unwrap();
    drop(g1); // settles into the region
    {
        let scope = alloc.named_scope("adopt", S0); // run 2 diverges: the scope learns anew
        drop(scope.alloc_unbound(128 * 1024).unwrap());
    }
    let keep = alloc.alloc(4096, other).unwrap();
    drop(alloc); // closed
    let opener = open_later(open);
    drop(g2); // the region goes: its settling block is waited for
    let segments = dev.live_segments();
    opener.join().unwrap();
    assert_eq!(segments, vec![(keep.ptr(), 2 * MIB)]);
    drop(keep);
    assert_device_clean(&dev);
}

/// Frees `open` after 50 ms on another thread (a kernel gate), for a call that waits for it.
fn open_later(open: mpsc::Sender<()>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        open.send(()).unwrap();
    })
}

/// A learning run's escape that a gated kernel on a new stream writes: the escape, that stream,
/// and the kernel's gate.
fn escape_written_elsewhere(
    dev: &SimDevice,
    alloc: &Allocator<SimDevice>,
) -> (Buffer<SimDevice>, StreamId, mpsc::Sender<()>) {
    let other = dev.create_stream().unwrap();
    let g1 = adopt_step(alloc);
    g1.use_on(other, AccessKind::Write).unwrap();
    let (k, open) = gated_write(g1.ptr(), 4096);
    dev.launch(other, k).unwrap();
    (g1, other, open)
}

/// An escape freed while another stream still writes it, on a device of `capacity`: the
/// allocator, and the gate of that stream's kernel.
fn settling_escape(capacity: u64) -> (Arc<SimDevice>, Allocator<SimDevice>, mpsc::Sender<()>) {
    let (dev, alloc) = setup(capacity);
    let (g1, _, open) = escape_written_elsewhere(&dev, &alloc);
    drop(g1);
    assert_eq!(alloc.stats().plan_region_bytes, 2 * MIB);
    (dev, alloc, open)
}

/// `empty_cache` waits for the other stream's work on an escape settling into its region (as
/// it waits for pending frees), so the region, idle then, goes back to the device. (The broken
/// build `cfg(tidepool_broken = "settling_polled")` only polls: this test and the next fail.)
#[test]
fn empty_cache_waits_for_an_escape_settling_into_its_region() {
    let (dev, alloc, open) = settling_escape(1 << 30);
    let syncs = alloc.stats().num_host_syncs;
    let opener = open_later(open);
    alloc.empty_cache().unwrap();
    opener.join().unwrap();
    assert_eq!(alloc.stats().plan_region_bytes, 0);
    assert!(alloc.stats().num_host_syncs > syncs, "the wait is counted");
    assert_eq!(dev.live_segments(), vec![]);
    assert_eq!(dev.violations(), vec![]);
}

/// The out-of-memory ladder waits for it too: a request that fits only once the region's
/// segment is released succeeds.
#[test]
fn the_out_of_memory_ladder_waits_for_an_escape_settling_into_its_region() {
    let (dev, alloc, open) = settling_escape(20 * MIB);
    let opener = open_later(open);
    let big = alloc.alloc(5 * MIB, S0).unwrap();
    opener.join().unwrap();
    assert_eq!(alloc.stats().plan_region_bytes, 0);
    assert_eq!(dev.live_segments(), vec![(big.ptr(), 20 * MIB)]);
    assert_eq!(dev.violations(), vec![]);
}

/// Memory a run holds and no longer uses is the out-of-memory ladder's first rung (found in
/// review: a request the allocator alone serves failed inside a scope). A 14 MiB block freed
/// into the run's local cache goes back to the pool for a 16 MiB request on a 24 MiB device,
/// and a run that left its plan at its first allocation lets go of the plan's 20 MiB region
/// for a 24 MiB request on a 32 MiB device. As after the other rungs (peers, `use_on_oom`
/// pools), the rescued request counts no failure in `num_ooms` (PyTorch counts the requests
/// `malloc` gives up on); the region's plan is learned again.
/// Broken build `scope_idle_kept`: both fail.
#[test]
fn a_runs_idle_memory_goes_back_when_its_request_runs_out() {
    let (dev, alloc) = setup(24 * MIB);
    let scope = alloc.scope(S0);
    drop(scope.alloc(14 * MIB).unwrap()); // into the run's local cache
    let b = scope.alloc(16 * MIB).unwrap();
    assert_eq!(alloc.stats().num_ooms, 0, "rescued by the run's local cache");
    drop(b);
    drop(scope);
    alloc.check_invariants().unwrap();

    let (dev2, alloc2) = setup(32 * MIB);
    for _ in 0..2 {
        let s = alloc2.named_scope("step", S0);
        drop(s.alloc(20 * MIB).unwrap());
    }
    assert_eq!(alloc2.stats().plan_region_bytes, 20 * MIB);
    let s = alloc2.named_scope("step", S0); // claims the region
    let big = s.alloc(24 * MIB).unwrap(); // diverges at once: the region is idle
    let st = alloc2.stats();
    assert_eq!((st.num_ooms, st.plan_region_bytes), (0, 0));
    assert_eq!(dev2.reserved_bytes() + dev2.physical_bytes(), 24 * MIB);
    drop(big);
    drop(s);
    alloc2.check_invariants().unwrap();
    // The plan is learned again, its region made for the next run.
    for _ in 0..2 {
        let s = alloc2.named_scope("step", S0);
        drop(s.alloc(24 * MIB).unwrap());
    }
    alloc2.empty_cache().unwrap();
    alloc2.check_invariants().unwrap();
    drop((alloc, alloc2));
    assert_eq!((dev.live_segments(), dev2.live_segments()), (vec![], vec![]));
}

/// The region stays claimed while a planned slice the run was served is live (a buffer still
/// held), and the request fails with the out-of-memory report, counted once.
#[test]
fn a_left_plans_region_stays_while_one_of_its_slices_is_live() {
    let (_dev, alloc) = setup(32 * MIB);
    for _ in 0..2 {
        let s = alloc.named_scope("step", S0);
        let a = s.alloc(8 * MIB).unwrap();
        drop(s.alloc(8 * MIB).unwrap());
        drop(a);
    }
    let s = alloc.named_scope("step", S0);
    let a = s.alloc(8 * MIB).unwrap(); // planned, live
    assert!(a.ptr() != DeviceAddr::NULL);
    let r = s.alloc(24 * MIB).map(|b| b.ptr()); // leaves the plan; the region holds `a`
    assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{r:?}");
    assert_eq!(alloc.stats().num_ooms, 1);
    assert_eq!(alloc.stats().plan_region_bytes, 16 * MIB);
    drop(a);
    drop(s);
    alloc.check_invariants().unwrap();
}

/// A scope's end frees the blocks its local cache holds in address order, so the garbage
/// collection, which releases the longest idle segments first (each free ticks the pool's
/// clock), releases the same ones in every run of a program. In the cache map's order, which
/// its hasher's random keys change from one map to the next, it released another four of the
/// eight each time. Broken build `scope_frees_unordered`.
#[test]
fn a_scope_end_frees_its_cached_blocks_in_address_order() {
    let config = "garbage_collection_threshold:0.5,memory_limit_mb:256";
    for _ in 0..3 {
        let dev = Arc::new(SimDevice::new(1 << 30));
        let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
        let sizes: Vec<u64> = (0..8).map(|i| (12 + 2 * i) * MIB).collect();
        let scope = alloc.scope(S0);
        let bufs: Vec<_> = sizes.iter().map(|&n| scope.alloc(n).unwrap()).collect();
        let mut bases: Vec<u64> = bufs.iter().map(|b| b.ptr().0).collect();
        bases.sort_unstable();
        assert_eq!(bases[0], bufs[0].ptr().0, "the segments are reserved in address order");
        drop(bufs); // into the scope's cache: eight sizes, eight keys
        drop(scope); // 152 MiB of whole free segments, freed in address order: the lowest oldest
        assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 152 * MIB);
        // 152 MiB reserved is past 0.5 × 256: the request collects 24 MiB or more. The first
        // pass releases the four idle at least the average: the first four freed.
        let x = alloc.alloc(28 * MIB, S0).unwrap();
        let mut left: Vec<u64> = alloc.snapshot().iter().map(|s| s.size / MIB).collect();
        left.sort_unstable();
        assert_eq!(left, vec![20, 22, 24, 26, 28]);
        assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 120 * MIB);
        drop(x);
        alloc.check_invariants().unwrap();
    }
}

/// What a scope open on stream `s` sees once `s` is destroyed through the allocator (`elsewhere`:
/// on another thread) after its first three allocations. `planned`: the second run of a named
/// scope, served by its learned plan's planned path; else an anonymous scope (the general path),
/// whose two freed 8 KiB blocks wait in its local cache. Returns the two allocations after the
/// destruction (bound, unbound), the first buffer still written once it is destroyed, the
/// statistics at the scope's end, and the device's reserved bytes after `empty_cache`.
fn scope_across_destroy(planned: bool, elsewhere: bool) -> (AllocError, AllocError, u64, u64) {
    let (dev, alloc) = setup(1 << 30);
    let s = dev.create_stream().unwrap();
    let name = if planned { Some("dead") } else { None };
    let open = || match name {
        Some(n) => alloc.named_scope(n, s),
        None => alloc.scope(s),
    };
    if planned {
        // Run 1 learns: a, b1, b2, free b1, free b2, c, u, free u, free c, free a.
        let scope = open();
        let a = scope.alloc(4096).unwrap();
        let (b1, b2) = (scope.alloc(8192).unwrap(), scope.alloc(8192).unwrap());
        drop((b1, b2));
        let c = scope.alloc(8192).unwrap();
        drop(scope.alloc_unbound(8192).unwrap());
        drop((c, a));
    }
    let hits = alloc.stats().plan_hits;
    let scope = open();
    let a = scope.alloc(4096).unwrap();
    let (b1, b2) = (scope.alloc(8192).unwrap(), scope.alloc(8192).unwrap());
    drop((b1, b2)); // planned: the plan's next step is c's slice; else both cached locally
    match elsewhere {
        true => std::thread::scope(|t| t.spawn(|| alloc.destroy_stream(s)).join().unwrap()),
        false => alloc.destroy_stream(s),
    }
    .unwrap();
    let bound = scope.alloc(8192).map(|b| b.ptr()).unwrap_err();
    let unbound = scope.alloc_unbound(8192).map(|b| b.ptr()).unwrap_err();
    // What the scope handed out before stays valid: written on the default stream.
    let w = vec![Access { ptr: a.ptr(), bytes: 4096, kind: AccessKind::Write }];
    dev.launch(S0, Kernel::new("w", w, |_| {})).unwrap();
    dev.synchronize().unwrap();
    drop(a);
    drop(scope);
    let st = alloc.stats();
    assert_eq!(st.blocks.allocated_bytes.all.current, 0, "nothing left allocated");
    assert_eq!((st.plan_hits - hits, st.plan_region_bytes), (if planned { 3 } else { 0 }, 0));
    alloc.check_invariants().unwrap();
    // The stream is refused everywhere; the allocator works on.
    assert_eq!(alloc.alloc(4096, s).map(|b| b.ptr()), Err(AllocError::UnknownStream(s)));
    let scope = open();
    assert_eq!(scope.alloc(4096).map(|b| b.ptr()), Err(AllocError::UnknownStream(s)));
    drop(scope);
    drop(alloc.alloc(4096, S0).unwrap());
    alloc.empty_cache().unwrap();
    let reserved = dev.reserved_bytes();
    assert_clean_end(&dev, alloc);
    (bound, unbound, st.plan_fallbacks, reserved)
}

/// A named scope's run served by its learned plan, open while its stream is destroyed through
/// the allocator (on the same thread, then on another): its later allocations are refused as
/// every other allocation on the stream is (`UnknownStream`), where the planned path, and the
/// general path behind it, went on handing out the plan's slices on the dead stream. The
/// buffer handed out before stays valid until freed; the run's end learns nothing (the plan
/// was forgotten with the stream), leaves nothing allocated, and the allocator works on.
/// (The broken build `cfg(tidepool_broken = "scope_outlives_stream")` serves both.)
#[test]
fn a_planned_run_refuses_allocations_once_its_stream_is_destroyed() {
    for elsewhere in [false, true] {
        let e = AllocError::UnknownStream(StreamId(1));
        assert_eq!(scope_across_destroy(true, elsewhere), (e.clone(), e, 1, 0), "{elsewhere}");
    }
}

/// As [`a_planned_run_refuses_allocations_once_its_stream_is_destroyed`], for an anonymous
/// scope (the general path): its local cache served its freed blocks again on the dead stream.
#[test]
fn a_scopes_general_path_refuses_allocations_once_its_stream_is_destroyed() {
    for elsewhere in [false, true] {
        let e = AllocError::UnknownStream(StreamId(1));
        assert_eq!(scope_across_destroy(false, elsewhere), (e.clone(), e, 0, 0), "{elsewhere}");
    }
}

/// A scope's stream destroyed on the device behind the allocator's back (here by the device
/// itself; another allocator's `destroy_stream` is the same to this one): nothing tells the
/// allocator until `release_stream` finds the stream gone and forgets it, and until then the
/// scope, like the allocator, serves on (its local cache's block; the allocator a fresh one).
/// From then on both refuse it, and nothing leaks.
#[test]
fn a_scope_refuses_a_stream_gone_from_the_device_once_release_stream_forgets_it() {
    let (dev, alloc) = setup(1 << 30);
    let s = dev.create_stream().unwrap();
    let scope = alloc.scope(s);
    let a = scope.alloc(4096).unwrap();
    drop((scope.alloc(8192).unwrap(), scope.alloc(8192).unwrap()));
    dev.destroy_stream(s).unwrap();
    let b = scope.alloc(8192).unwrap(); // from the local cache: nothing asks the device
    drop(alloc.alloc(4096, s).unwrap());
    assert_eq!(alloc.release_stream(s), Ok(()));
    assert_eq!(scope.alloc(8192).map(|b| b.ptr()), Err(AllocError::UnknownStream(s)));
    assert_eq!(scope.alloc_unbound(8192).map(|b| b.ptr()), Err(AllocError::UnknownStream(s)));
    assert_eq!(alloc.alloc(4096, s).map(|b| b.ptr()), Err(AllocError::UnknownStream(s)));
    drop((a, b));
    drop(scope);
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 0);
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(dev.reserved_bytes(), 0);
    assert_clean_end(&dev, alloc);
}

/// One run of scope `poison` on the default stream: one 1 MiB buffer, freed. Whether it was
/// planned.
fn poison_run(alloc: &Allocator<SimDevice>) -> bool {
    let scope = alloc.named_scope("poison", S0);
    let b = scope.alloc(MIB).unwrap();
    let planned = b.is_planned();
    drop(b);
    planned
}

/// A planned run whose slice, used on stream `t`, is freed while the device can neither record
/// an event nor wait on the host: nothing orders its reuse, so its region is poisoned.
fn poison_the_region(dev: &SimDevice, alloc: &Allocator<SimDevice>, t: StreamId) {
    let scope = alloc.named_scope("poison", S0);
    let b = scope.alloc(MIB).unwrap();
    assert!(b.is_planned());
    b.record_stream(t).unwrap();
    dev.fail_event_records(true);
    dev.fail_host_syncs(true);
    drop(b);
    dev.fail_event_records(false);
    dev.fail_host_syncs(false);
}

/// A poisoned region (a planned slice's reuse that nothing could order: the event record and
/// the host wait both refused) is let go of by its plan: `empty_cache` returns its memory once
/// its host wait succeeds, and the scope's next run makes a new one (here it learns again: the
/// region was its first plan's, adopted). (The broken build
/// `cfg(tidepool_broken = "poisoned_region_kept")` keeps it the plan's, as before: every later
/// run is denied it — all plan misses, never a planned slice again — and its 1 MiB stays
/// allocated through `empty_cache` for as long as the allocator lives.)
#[test]
fn a_poisoned_region_is_let_go_of_by_its_plan() {
    let (dev, alloc) = setup(1 << 30);
    let t = dev.create_stream().unwrap();
    assert_eq!([poison_run(&alloc), poison_run(&alloc)], [false, true]);
    // The scope does not run again: `empty_cache` gives the poisoned memory back.
    poison_the_region(&dev, &alloc, t);
    alloc.empty_cache().unwrap();
    let s = alloc.stats();
    assert_eq!(
        (s.blocks.allocated_bytes.all.current, s.plan_region_bytes, alloc.reserved_bytes()),
        (0, 0, 0)
    );
    assert_eq!(dev.live_segments(), vec![]);
    // It runs again: it learns, then follows its plan.
    assert_eq!([poison_run(&alloc), poison_run(&alloc), poison_run(&alloc)], [false, true, true]);
    // Poisoned again, the next run lets go of it at once: a learning run, then planned runs.
    poison_the_region(&dev, &alloc, t);
    let misses = alloc.stats().plan_misses;
    assert_eq!([poison_run(&alloc), poison_run(&alloc), poison_run(&alloc)], [false, true, true]);
    // (The poisoned region, let go of, waits for a host wait: still counted until then.)
    let s = alloc.stats();
    assert_eq!((s.plan_misses - misses, s.plan_region_bytes), (0, 2 * MIB));
    alloc.empty_cache().unwrap();
    let s = alloc.stats();
    assert_eq!(
        (s.blocks.allocated_bytes.all.current, s.plan_region_bytes, alloc.reserved_bytes()),
        (0, 0, 0)
    );
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}
