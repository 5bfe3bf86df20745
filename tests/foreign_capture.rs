//! Captures of another family: two allocators (families) over one device, one capturing a
//! stream, and a capture begun on the device itself (`Capture::begin_capture`, a safe call).
//! An allocator hands out no memory on a stream a capture it did not begin captures (no graph
//! of its own would hold it: the foreign graph's replays would write it after it went back),
//! and holds for its life what it frees there during that capture. Exact addresses and byte
//! counts; the sanitizer (a backed device) checks every hand-out and replay.

mod common;

use common::{N, assert_no_leak, gated_write, wait_stream};
use std::sync::Arc;
use tidepool::device::{Access, AccessKind, Capture, Kernel, Launch, SIM_BASE};
use tidepool::{
    AllocError, Allocator, Config, Device, DeviceAddr, MIB, SimConfig, SimDevice, StreamId,
};

const SEG: u64 = 2 * MIB; // a small-pool segment
const LARGE: u64 = 4 * MIB; // a large-pool request
const LARGE_SEG: u64 = 20 * MIB; // the large pool's segment for it

/// A replayable kernel writing `byte` over `[p, p + N)`.
fn write_at(p: DeviceAddr, byte: u8) -> Kernel {
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
    Kernel::replayable("write", acc, move |m| m.write(p, &[byte; N as usize]).unwrap())
}

/// A backed device (sanitizer on) with streams `s`, `t`, `u`, and allocators `a` and `b` over
/// it, each of its own family.
fn two() -> (Arc<SimDevice>, [StreamId; 3], Allocator<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let streams = [(); 3].map(|_| dev.create_stream().unwrap());
    let a = Allocator::new(dev.clone(), Config::default()).unwrap();
    let b = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, streams, a, b)
}

/// A quiet device (sanitizer off: the lock-free paths run) with a stream `s`, and allocators
/// `a` and `b` over it, each of its own family.
fn quiet_two() -> (Arc<SimDevice>, StreamId, Allocator<SimDevice>, Allocator<SimDevice>) {
    let config = SimConfig { capacity: 256 * MIB, sanitize: false, ..SimConfig::default() };
    let dev = Arc::new(SimDevice::with_config(config));
    let s = dev.create_stream().unwrap();
    let a = Allocator::new(dev.clone(), Config::default()).unwrap();
    let b = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, s, a, b)
}

fn foreign(stream: StreamId, origin: StreamId) -> AllocError {
    AllocError::ForeignCapture { stream, origin }
}

/// A captures `s`; B is asked for memory on `s` (small, large, aligned, zero bytes, in a scope)
/// and refuses each with the capture's origin, serves `t` as usual (its own segments, exact
/// addresses), and once the capture is over serves `s` again from its cache (the hit). A's own
/// capture still takes its allocations into the graph's pool.
#[test]
fn another_allocators_capture_refuses_its_streams_and_nothing_else() {
    let (dev, [s, t, _], a, b) = two();
    // B's cached blocks on `s`: one small, one large.
    let (x, big) = (b.alloc(N, s).unwrap(), b.alloc(LARGE, s).unwrap());
    let (xa, biga) = (x.ptr(), big.ptr());
    assert_eq!((xa.0, biga.0), (SIM_BASE, SIM_BASE + SEG));
    drop((x, big));
    dev.synchronize().unwrap();
    a.begin_capture(s, None).unwrap();
    assert!(a.is_capturing(s) && !b.is_capturing(s));
    assert_eq!(b.alloc(N, s).unwrap_err(), foreign(s, s), "the small hit");
    assert_eq!(b.alloc(LARGE, s).unwrap_err(), foreign(s, s), "the large hit");
    assert_eq!(b.alloc(3 * MIB, s).unwrap_err(), foreign(s, s), "the whole path");
    assert_eq!(b.alloc_aligned(N, 4096, s).unwrap_err(), foreign(s, s));
    assert_eq!(b.alloc(0, s).unwrap_err(), foreign(s, s));
    {
        let scope = b.scope(s);
        assert_eq!(scope.alloc(N).map(|_| ()).unwrap_err(), foreign(s, s));
        assert_eq!(scope.alloc_unbound(N).unwrap_err(), foreign(s, s));
    }
    assert_eq!(b.allocated_bytes(), 0);
    assert_eq!(b.reserved_bytes(), SEG + LARGE_SEG, "nothing reserved for the refusals");
    // A's capture: its allocation comes from its graph's pool (a segment of its own).
    let ax = a.alloc(N, s).unwrap();
    assert_eq!(ax.ptr().0, SIM_BASE + SEG + LARGE_SEG);
    dev.launch(s, write_at(ax.ptr(), 3)).unwrap();
    // B on another stream, during the capture: its own new segment (the blocks cached on `s`
    // are `s`'s).
    let y = b.alloc(N, t).unwrap();
    assert_eq!(y.ptr().0, SIM_BASE + 2 * SEG + LARGE_SEG);
    dev.launch(t, write_at(y.ptr(), 4)).unwrap();
    let graph = a.end_capture(s).unwrap();
    assert_eq!(graph.pool().stats().blocks.allocated_bytes.all.current, N);
    // Over: B serves `s` from its cache again.
    let (x2, big2) = (b.alloc(N, s).unwrap(), b.alloc(LARGE, s).unwrap());
    assert_eq!((x2.ptr(), big2.ptr()), (xa, biga));
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
    a.check_invariants().unwrap();
    b.check_invariants().unwrap();
    drop((x2, big2, y, ax, graph, a, b));
    assert_no_leak(&dev);
}

/// B's buffers made before A's capture of `s` and freed during it, one written by the captured
/// work (a static input of the graph) and one not: the graph may use either for as long as it
/// lives, which B cannot see, so B never hands them out again — not on `s` after the capture,
/// not on another stream — while the graph's replays (behind gated work on two streams) write
/// them. They stay pending in B (no longer allocated, still reserved) and go back with B.
#[test]
fn frees_during_another_allocators_capture_are_never_handed_out_again() {
    let (dev, [s, t, u], a, b) = two();
    let x = b.alloc(N, s).unwrap(); // written by the captured work
    let z = b.alloc(N, s).unwrap(); // freed on `s` during the capture, untouched by it
    let w = b.alloc(N, t).unwrap(); // used on `s` (record_stream), freed on `t` during it
    let (xa, za, wa) = (x.ptr(), z.ptr(), w.ptr());
    assert_eq!((xa.0, za.0, wa.0), (SIM_BASE, SIM_BASE + N, SIM_BASE + SEG));
    w.record_stream(s).unwrap();
    dev.synchronize().unwrap();
    a.begin_capture(s, None).unwrap();
    dev.launch(s, write_at(xa, 7)).unwrap(); // captured: each replay writes x's block
    drop((x, z, w));
    assert_eq!(b.allocated_bytes(), 0, "freed: no longer allocated");
    assert_eq!(b.reserved_bytes(), 2 * SEG, "held: still B's");
    // During the capture, B on `t` and `u`: never a block freed during it.
    let on_t = b.alloc(N, t).unwrap();
    let on_u = b.alloc(N, u).unwrap();
    assert_eq!((on_t.ptr().0, on_u.ptr().0), (SIM_BASE + SEG + N, SIM_BASE + 2 * SEG));
    let graph = a.end_capture(s).unwrap();
    // Replays queued behind unfinished work on `s` and on `t`.
    let (gs, open_s) = gated_write(on_u.ptr(), 1);
    dev.launch(s, gs).unwrap();
    let (gt, open_t) = gated_write(on_t.ptr(), 2);
    dev.launch(t, gt).unwrap();
    graph.launch(s).unwrap();
    graph.launch(t).unwrap();
    // B on `s`, `t` and `u` while the replays are pending: new blocks only.
    let again_s = b.alloc(N, s).unwrap();
    let again_t = b.alloc(N, t).unwrap();
    let again_u = b.alloc(N, u).unwrap();
    open_s.send(()).unwrap();
    open_t.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "a block the graph uses handed out again");
    let got = [again_s.ptr().0, again_t.ptr().0, again_u.ptr().0];
    assert_eq!(got, [SIM_BASE + 2 * N, SIM_BASE + SEG + 2 * N, SIM_BASE + 2 * SEG + N]);
    for p in [xa, za, wa] {
        assert!(!got.contains(&p.0), "{p:?} handed out again while the graph lives");
    }
    b.check_invariants().unwrap();
    // Still held after the graph and every replay are gone (B cannot see them go).
    drop(graph);
    b.empty_cache().unwrap();
    assert_eq!(b.reserved_bytes(), 3 * SEG);
    drop((on_t, on_u, again_s, again_t, again_u));
    b.check_invariants().unwrap();
    drop((a, b));
    assert_no_leak(&dev);
}

/// A capture begun on the device itself is foreign to every allocator: both refuse its stream
/// and a stream that joined it (with the capture's origin), serve other streams, and hold what
/// they free on them during it; after it, they serve its streams again.
#[test]
fn a_capture_begun_on_the_device_is_every_allocators_foreign_capture() {
    let (dev, [s, t, u], a, b) = two();
    let x = a.alloc(N, s).unwrap();
    let xa = x.ptr();
    dev.synchronize().unwrap();
    Capture::begin_capture(&*dev, s).unwrap();
    assert!(!a.is_capturing(s) && !b.is_capturing(s));
    wait_stream(&dev, t, s); // t joins the device's capture
    for alloc in [&a, &b] {
        assert_eq!(alloc.alloc(N, s).unwrap_err(), foreign(s, s));
        assert_eq!(alloc.alloc(LARGE, t).unwrap_err(), foreign(t, s));
    }
    let on_u = b.alloc(N, u).unwrap();
    assert_eq!(on_u.ptr().0, SIM_BASE + SEG);
    dev.launch(s, write_at(xa, 5)).unwrap();
    drop(x); // held by `a` for good
    wait_stream(&dev, s, t); // joined back
    let g = Capture::end_capture(&*dev, s).unwrap();
    let (gate, open) = gated_write(on_u.ptr(), 6);
    dev.launch(s, gate).unwrap();
    dev.launch_graph(g, s).unwrap();
    let again = a.alloc(N, s).unwrap();
    let on_t = a.alloc(N, t).unwrap();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "x's block handed out again");
    assert_eq!(again.ptr().0, SIM_BASE + N, "not x's block");
    assert_eq!(on_t.ptr().0, SIM_BASE + 2 * SEG);
    dev.destroy_graph(g).unwrap();
    a.check_invariants().unwrap();
    drop((again, on_t, on_u, a, b));
    assert_no_leak(&dev);
}

/// The same with the sanitizer off, where the lock-free paths run: a block B cached on `s`
/// (small and large) is not handed out by the hits while A captures `s`, and B's buffers freed
/// on `s` during the capture (dropped, or through `free_batch`) go neither to the stream caches
/// nor straight into the pool (the hits would hand them out after the capture, while the graph
/// lives). Exact addresses before, during and after.
#[test]
fn the_lock_free_paths_see_another_allocators_capture() {
    let (dev, s, a, b) = quiet_two();
    let (x, z, v) = (b.alloc(N, s).unwrap(), b.alloc(N, s).unwrap(), b.alloc(N, s).unwrap());
    let (big, w) = (b.alloc(LARGE, s).unwrap(), b.alloc(LARGE, s).unwrap());
    let (xa, biga) = (x.ptr().0, big.ptr().0);
    assert_eq!([xa, z.ptr().0, v.ptr().0], [SIM_BASE, SIM_BASE + N, SIM_BASE + 2 * N]);
    assert_eq!((biga, w.ptr().0), (SIM_BASE + SEG, SIM_BASE + SEG + LARGE));
    drop((x, big)); // cached in `s`'s lanes: the hits' blocks
    a.begin_capture(s, None).unwrap();
    assert_eq!(b.alloc(N, s).unwrap_err(), foreign(s, s), "the small hit");
    assert_eq!(b.alloc(LARGE, s).unwrap_err(), foreign(s, s), "the large hit");
    drop((z, w)); // held for good
    b.free_batch(vec![v]).unwrap(); // likewise
    assert_eq!(b.allocated_bytes(), 0);
    let graph = a.end_capture(s).unwrap();
    let smalls = [b.alloc(N, s).unwrap(), b.alloc(N, s).unwrap()];
    let larges = [b.alloc(LARGE, s).unwrap(), b.alloc(LARGE, s).unwrap()];
    assert_eq!(smalls.each_ref().map(|b| b.ptr().0), [xa, xa + 3 * N], "never z's nor v's");
    assert_eq!(larges.each_ref().map(|b| b.ptr().0), [biga, biga + 2 * LARGE], "never w's");
    assert_eq!(b.allocated_bytes(), 2 * N + 2 * LARGE);
    assert_eq!(b.reserved_bytes(), SEG + LARGE_SEG);
    b.check_invariants().unwrap();
    drop((smalls, larges, graph, a, b));
    assert_no_leak(&dev);
}

/// A named scope of B following its plan on `s` (sanitizer off: the planned path serves) while
/// A captures `s`: its planned slice is refused like every other allocation there (the run's
/// region would serve the slice again while the graph replays), and the run follows its plan
/// again once the capture is over, at the plan's addresses.
#[test]
fn a_planned_scope_stops_while_another_allocator_captures_its_stream() {
    let (dev, s, a, b) = quiet_two();
    let run = |capture: bool| {
        let scope = b.named_scope("step", s);
        let x = scope.alloc(N).unwrap();
        let refused = capture.then(|| {
            a.begin_capture(s, None).unwrap();
            let r = scope.alloc(2 * N).map(|y| y.ptr()).unwrap_err();
            drop(a.end_capture(s).unwrap());
            r
        });
        let y = scope.alloc(2 * N).unwrap();
        let got = [(x.ptr(), x.is_planned()), (y.ptr(), y.is_planned())];
        drop((x, y));
        (got, refused)
    };
    let (learned, _) = run(false);
    assert!(learned.iter().all(|&(_, planned)| !planned), "the first run learns");
    let (planned, refused) = run(true);
    assert_eq!(refused, Some(foreign(s, s)));
    assert!(planned.iter().all(|&(_, planned)| planned), "{planned:?}");
    let addrs = planned.map(|(p, _)| p.0);
    assert_eq!(addrs, [SIM_BASE + SEG + 2 * N, SIM_BASE + SEG], "the region, in the plan's order");
    drop((a, b));
    assert_no_leak(&dev);
}

/// A named scope of B whose buffers are freed while A captures their stream, the captured work
/// writing each: a bound pool block of the learning run (not reused by the run's local cache),
/// a bound planned slice and an unbound planned slice of runs following the plan (the run's
/// region serves no more slices, and the next run does not claim it: its plan lets go of it and
/// the scope learns again, the region's memory held for good). The graphs' replays, queued
/// behind gated work, write that memory while every later run allocates: the sanitizer sees
/// no hand-out of it, and nothing of it is handed out again until B goes.
#[test]
fn a_scopes_frees_during_another_allocators_capture_are_never_handed_out_again() {
    let (dev, [s, t, _], a, b) = two();
    let mut graphs = Vec::new();
    // One run: x (bound or unbound), freed during A's capture of `s` after a captured write,
    // then y. Returns (x's address, whether planned; y's address, whether planned).
    let mut run = |capture: bool, unbound: bool| {
        let scope = b.named_scope("step", s);
        let (x, xb) = match unbound {
            false => {
                let x = scope.alloc(N).unwrap();
                ((x.ptr(), x.is_planned()), Some(x))
            }
            true => {
                let x = scope.alloc_unbound(N).unwrap();
                let got = (x.ptr(), x.is_planned());
                if capture {
                    a.begin_capture(s, None).unwrap();
                    dev.launch(s, write_at(got.0, 7)).unwrap();
                }
                drop(x);
                (got, None)
            }
        };
        if let Some(xb) = xb {
            if capture {
                a.begin_capture(s, None).unwrap();
                dev.launch(s, write_at(x.0, 7)).unwrap();
            }
            drop(xb);
        }
        if capture {
            graphs.push(a.end_capture(s).unwrap());
        }
        let y = scope.alloc(N).unwrap();
        let got = (x, (y.ptr(), y.is_planned()));
        drop(y);
        got
    };
    let at = |k: u64| DeviceAddr(SIM_BASE + k * N);
    // The learning run: x, a pool block, is held for good (not reused by the run's y).
    assert_eq!(run(true, false), ((at(0), false), (at(1), false)));
    // The plan's region adopted y's block: x planned there and freed during the capture; y,
    // planned at x's slice, comes from the pool.
    assert_eq!(run(true, false), ((at(1), true), (at(2), false)));
    // The plan went with its adopted region: the scope learns again (y reuses x's block
    // locally), then follows, x unbound.
    assert_eq!(run(false, false), ((at(2), false), (at(2), false)));
    assert_eq!(run(true, true), ((at(2), true), (at(3), false)));
    assert_eq!(run(false, false), ((at(3), false), (at(3), false)));
    assert_eq!(run(false, false), ((at(3), true), (at(3), true)));
    // The two regions held for good and the current one are allocated; x's pool block pending;
    // the two ys served by the pool are plan misses.
    let st = b.stats();
    assert_eq!((b.allocated_bytes(), b.reserved_bytes()), (3 * N, SEG));
    assert_eq!((st.plan_region_bytes, st.plan_hits, st.plan_misses), (3 * N, 4, 2));
    // Every graph replayed behind gated work on `s`, while B allocates on `s` and `t`.
    let z = b.alloc(N, s).unwrap();
    let zt = b.alloc(N, t).unwrap();
    assert_eq!((z.ptr(), zt.ptr().0), (at(4), SIM_BASE + SEG));
    let (gate, open) = gated_write(z.ptr(), 1);
    dev.launch(s, gate).unwrap();
    for g in &graphs {
        g.launch(s).unwrap();
    }
    dev.launch(t, write_at(zt.ptr(), 2)).unwrap();
    {
        // Another run while the replays wait: the current region, nothing held.
        let scope = b.named_scope("step", s);
        let x = scope.alloc(N).unwrap();
        assert_eq!((x.ptr(), x.is_planned()), (at(3), true));
    }
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "memory a live graph uses handed out again");
    b.check_invariants().unwrap();
    // Still held once the graphs are gone (B cannot see them go): only the idle region and
    // the segment on `t` go back.
    drop((z, zt, graphs));
    b.empty_cache().unwrap();
    assert_eq!((b.allocated_bytes(), b.reserved_bytes()), (2 * N, SEG));
    assert_eq!(b.stats().plan_region_bytes, 2 * N);
    b.check_invariants().unwrap();
    drop((a, b));
    assert_no_leak(&dev);
}

/// An escape of a named scope's learning run (its block pinned in the region that adopted its
/// segment) freed while A captures its stream, after a captured write: its block does not join
/// the region (held for good, its slice pinned), so the next runs miss the plan there and are
/// served elsewhere while the graph replays.
#[test]
fn an_escape_freed_during_another_allocators_capture_never_joins_its_region() {
    let (dev, [s, _, _], a, b) = two();
    let run = || {
        let scope = b.named_scope("step", s);
        let e = scope.alloc_unbound(N).unwrap();
        let x = scope.alloc(2 * N).unwrap();
        let got = [(e.ptr(), e.is_planned()), (x.ptr(), x.is_planned())];
        drop(x);
        (got, e)
    };
    let (got, e) = run();
    assert_eq!(got, [(DeviceAddr(SIM_BASE), false), (DeviceAddr(SIM_BASE + N), false)]);
    a.begin_capture(s, None).unwrap();
    dev.launch(s, write_at(e.ptr(), 7)).unwrap();
    drop(e); // held for good, its slice pinned in the region for good
    let graph = a.end_capture(s).unwrap();
    // The replay waits behind gated work on `s` while B's runs allocate.
    let g = a.alloc(N, s).unwrap();
    let (gate, open) = gated_write(g.ptr(), 1);
    dev.launch(s, gate).unwrap();
    graph.launch(s).unwrap();
    for _ in 0..2 {
        // The region is the rest of the segment: e planned above it; x, planned over the
        // pinned block, misses and comes from a new segment (after the one A made for g).
        let (got, e) = run();
        let want = [(DeviceAddr(SIM_BASE + 2 * N), true), (DeviceAddr(SIM_BASE + 2 * SEG), false)];
        assert_eq!(got, want);
        assert_eq!((b.allocated_bytes(), b.reserved_bytes()), (SEG - N, 2 * SEG));
        drop(e);
    }
    let st = b.stats();
    assert_eq!((st.plan_hits, st.plan_misses, st.plan_region_bytes), (2, 2, SEG));
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "memory a live graph uses handed out again");
    b.check_invariants().unwrap();
    drop((g, graph, a));
    // Held still: the idle second segment goes, the region (its pin) and the block stay.
    b.empty_cache().unwrap();
    assert_eq!((b.allocated_bytes(), b.reserved_bytes()), (SEG - N, SEG));
    b.check_invariants().unwrap();
    drop(b);
    assert_no_leak(&dev);
}

/// The same for the planned path's own free (sanitizer off, so it runs): a planned slice of a
/// run following its plan, freed while A captures `s`, takes the whole path and is held with its
/// region; the run's next allocation, planned at the same slice, comes from the pool, and the
/// next run learns again (the plan held the adopted region's addresses) and then follows it in
/// a new region.
#[test]
fn the_planned_free_sees_another_allocators_capture() {
    let (dev, s, a, b) = quiet_two();
    let mut graphs = Vec::new();
    let mut run = |capture: bool| {
        let scope = b.named_scope("step", s);
        let x = scope.alloc(N).unwrap();
        let got = (x.ptr().0, x.is_planned());
        if capture {
            a.begin_capture(s, None).unwrap();
        }
        drop(x);
        if capture {
            graphs.push(a.end_capture(s).unwrap());
        }
        let y = scope.alloc(N).unwrap();
        [got, (y.ptr().0, y.is_planned())]
    };
    assert_eq!(run(false), [(SIM_BASE, false), (SIM_BASE, false)]);
    let r = SIM_BASE + SEG; // the first region: a fresh block (the run's segment released)
    assert_eq!(run(true), [(r, true), (r + N, false)]);
    // Relearned in y's block, adopted as the new region (the held one is a wall).
    assert_eq!(run(false), [(r + N, false), (r + N, false)]);
    assert_eq!(run(false), [(r + N, true), (r + N, true)]);
    assert_eq!((b.allocated_bytes(), b.reserved_bytes()), (2 * N, SEG));
    let st = b.stats();
    assert_eq!((st.plan_hits, st.plan_misses, st.plan_region_bytes), (3, 1, 2 * N));
    drop(graphs);
    b.empty_cache().unwrap();
    assert_eq!((b.allocated_bytes(), b.reserved_bytes()), (N, SEG), "the first region, for good");
    b.check_invariants().unwrap();
    drop((a, b));
    assert_no_leak(&dev);
}

/// A planned scoped buffer forgotten (`mem::forget`) and its scope ended while A captures `s`,
/// the captured work writing it: the run's end frees its slice during the capture, so the
/// region is held for good, and the next runs are planned elsewhere (sanitizer on, the graph
/// replaying behind gated work while they allocate).
#[test]
fn a_forgotten_planned_buffer_freed_at_a_scopes_end_during_another_allocators_capture() {
    let (dev, [s, _, _], a, b) = two();
    let run = |capture: bool| {
        let scope = b.named_scope("step", s);
        let x = scope.alloc(N).unwrap();
        let got = (x.ptr().0, x.is_planned());
        if capture {
            a.begin_capture(s, None).unwrap();
            dev.launch(s, write_at(x.ptr(), 7)).unwrap();
            std::mem::forget(x);
            drop(scope);
            return (got, Some(a.end_capture(s).unwrap()));
        }
        drop(x);
        (got, None)
    };
    assert_eq!(run(false).0, (SIM_BASE, false));
    let (got, graph) = run(true);
    let graph = graph.unwrap();
    let r = SIM_BASE + SEG; // a fresh block (the learning run's segment released)
    assert_eq!(got, (r, true));
    // The run (x never freed) was learned, and the old plan's region let go of: held for
    // good. The new plan makes its region anew, next to it; never at x.
    assert_eq!(run(false).0, (r + N, true));
    assert_eq!(run(false).0, (r + N, true));
    assert_eq!((b.allocated_bytes(), b.reserved_bytes()), (2 * N, SEG));
    assert_eq!(b.stats().plan_region_bytes, 2 * N);
    // Once more while the graph replays behind gated work.
    let g = a.alloc(N, s).unwrap();
    let (gate, open) = gated_write(g.ptr(), 1);
    dev.launch(s, gate).unwrap();
    graph.launch(s).unwrap();
    assert_eq!(run(false).0, (r + N, true));
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "memory a live graph uses handed out again");
    b.check_invariants().unwrap();
    drop((g, graph, a));
    b.empty_cache().unwrap();
    assert_eq!((b.allocated_bytes(), b.reserved_bytes()), (N, SEG), "the first region, for good");
    drop(b);
    assert_no_leak(&dev);
}
