//! The harness's own tests: programs that must pass, and broken builds it must catch.

use super::*;
use tidepool::hooks::Broken;
use tidepool::{MIB, OomReport};

fn program(config: u8, ops: Vec<Op>) -> Program {
    Program {
        capacity: 1,
        config,
        explicit_teardown: false,
        late_streams: false,
        quiet: false,
        handles_first: false,
        ops,
    }
}

/// Streams past the 64 fast-path slots: the head start leaves two 4 KiB buffers whose
/// streams are gone (live indexes 0 and 1). Slot 1's first stream re-tags the slot of the
/// stream destroyed through the allocator, slot 2's the slot of the one destroyed behind
/// its back (its lane still caching a block); after a destroy, slot 1's next stream takes
/// the slot only the second allocator used, and slot 2's next one the live default stream's.
fn late_stream_ops() -> Vec<Op> {
    let small = |stream| Op::Alloc { bytes: 4096, stream, persistent: false };
    vec![
        small(1),
        small(2),
        Op::Free { index: 2 },
        Op::Free { index: 2 },
        small(1),
        small(2),
        Op::Launch { index: 1, stream: 2, write: true, sleep_us: 5 },
        Op::Free { index: 0 },
        small(1),
        small(1),
        Op::Free { index: 0 },
        small(2),
        small(2),
        Op::DestroyStream { stream: 1 },
        small(1),
        Op::Free { index: 3 },
        small(1),
        Op::DestroyStream { stream: 2 },
        small(2),
        small(0),
        Op::Free { index: 0 },
        small(2),
        Op::Free { index: 1 },
        small(0),
        Op::EmptyCache,
        small(2),
        small(1),
    ]
}

#[test]
fn programs_on_streams_past_the_fast_slots_pass() {
    // Every configuration (plain, expandable, caching off, limits), both teardowns.
    for config in 0..CONFIGS.len() as u8 {
        for explicit_teardown in [false, true] {
            let p = Program {
                explicit_teardown,
                late_streams: true,
                quiet: false,
                handles_first: false,
                ..program(config, late_stream_ops())
            };
            run(&p, Options::default()).unwrap_or_else(|e| panic!("config {config}: {e}"));
        }
    }
    // The flag rides in bit 1 of the teardown byte: encoded and decoded unchanged.
    let p = Program { late_streams: true, ..program(3, late_stream_ops()) };
    assert_eq!(Program::decode(&p.encode()), p);
}

/// Buffers of every kind outlive both allocators' handles ([`Program::handles_first`]):
/// small and large, persistent, used on other streams (`record_stream`, a kernel still
/// sleeping), an unbound scope buffer, the second allocator's, a capture's pool gone before.
/// The allocators close, and after each buffer goes every device segment and mapping must
/// hold a live one, in every configuration; the broken build
/// `cfg(tidepool_broken = "closed_keeps_cache")` fails it (the cache stays).
#[test]
fn programs_torn_down_handles_first_pass() {
    let alloc = |bytes, stream, persistent| Op::Alloc { bytes, stream, persistent };
    let ops = vec![
        alloc(4096, 0, false),
        alloc(3 * MIB, 1, false),
        alloc(30 * MIB, 2, true),
        alloc(1000, 1, true),
        alloc(25 * MIB, 0, false),
        Op::Free { index: 4 },
        alloc(12 * MIB, 1, false),
        Op::RecordStream { index: 1, stream: 2 },
        Op::Launch { index: 1, stream: 2, write: false, sleep_us: 5 },
        Op::ScopeEnter { stream: 1, named: true },
        Op::ScopeAlloc { bytes: 2 * MIB },
        Op::ScopeExit,
        Op::Other { index: 1 + 8, action: 0 },
        Op::Other { index: 3 * MIB as u8, action: 0 },
        Op::Capture { stream: 1, fork: 2, bytes: 4096, launches: 1, panics: false },
        alloc(6 * MIB, 2, false),
        Op::Free { index: 0 },
        Op::Launch { index: 2, stream: 1, write: true, sleep_us: 1 },
    ];
    for config in 0..CONFIGS.len() as u8 {
        for quiet in [false, true] {
            let p = Program { handles_first: true, quiet, ..program(config, ops.clone()) };
            run(&p, Options::default()).unwrap_or_else(|e| panic!("config {config}: {e}"));
        }
    }
    let p = Program { handles_first: true, ..program(2, ops) };
    assert_eq!(Program::decode(&p.encode()), p, "bit 3 of the teardown byte");
}

/// A forked capture replayed twice captures again into its pool (see `Harness::capture`),
/// in every configuration; the broken build `cfg(tidepool_broken = "capture_unordered")`
/// (the second capture not ordered after the side stream's write) fails it.
#[test]
fn a_pool_captured_again_after_ordinary_work_on_its_side_stream() {
    let ops = vec![
        Op::Capture { stream: 1, fork: 2, bytes: 4096, launches: 2, panics: false },
        Op::Capture { stream: 2, fork: 1, bytes: 3 * MIB, launches: 2, panics: false },
    ];
    for config in 0..CONFIGS.len() as u8 {
        run(&program(config, ops.clone()), Options::default())
            .unwrap_or_else(|e| panic!("config {config}: {e}"));
    }
}

/// Captures whose bodies panic (`Allocator::capture`), forked and joined back, left forked,
/// or not forked, then an ordinary capture, in every configuration: each is over for both
/// streams and its pool empties. The broken build `cfg(tidepool_broken = "capture_left")`
/// (a panicking body leaves the capture underway) fails it.
#[test]
fn captures_whose_bodies_panic_end_and_give_their_pools_back() {
    let ops = vec![
        Op::Capture { stream: 1, fork: 2, bytes: 4096, launches: 1, panics: true },
        Op::Capture { stream: 2, fork: 1, bytes: 3 * MIB, launches: 0, panics: true },
        Op::Capture { stream: 2, fork: 0, bytes: 700_000, launches: 2, panics: true },
        Op::Capture { stream: 1, fork: 2, bytes: 4096, launches: 2, panics: false },
    ];
    for config in 0..CONFIGS.len() as u8 {
        run(&program(config, ops.clone()), Options::default())
            .unwrap_or_else(|e| panic!("config {config}: {e}"));
    }
}

#[test]
fn late_streams_reach_the_lane_re_tags() {
    // The re-tag fixes, reverted one at a time, fail the same program: a stale buffer's
    // free cached in a re-tagged lane, or a hit that does not check the lane's stream.
    let p = Program { late_streams: true, ..program(0, late_stream_ops()) };
    run(&p, Options::default()).unwrap();
    for mode in [Broken::RetaggedLaneTakesStaleFrees, Broken::RetaggedLaneServesAnyStream] {
        let r = run(&p, Options { broken: Some(mode), ..Options::default() });
        assert!(r.is_err(), "{mode:?} not caught");
    }
}

#[test]
fn a_program_touching_every_operation_passes() {
    let ops = vec![
        Op::Alloc { bytes: 0, stream: 0, persistent: false },
        Op::Alloc { bytes: 1000, stream: 1, persistent: false },
        Op::Alloc { bytes: 3 * MIB, stream: 2, persistent: true },
        Op::Alloc { bytes: u64::MAX, stream: 0, persistent: false },
        Op::Alloc { bytes: 1 << 40, stream: 0, persistent: false },
        Op::Launch { index: 1, stream: 2, write: true, sleep_us: 5 },
        Op::RecordStream { index: 2, stream: 1 },
        Op::Sleep { stream: 2, sleep_us: 1 },
        Op::WaitEvent { from: 2, to: 0 },
        Op::Free { index: 1 },
        Op::Inspect { summary: true },
        Op::EmptyCache,
        Op::FailNthMalloc { n: 1 },
        Op::Alloc { bytes: 12 * MIB, stream: 1, persistent: false },
        Op::FailMallocsAbove { limit: Some(MIB) },
        Op::Alloc { bytes: 4 * MIB, stream: 1, persistent: false },
        Op::FailMallocsAbove { limit: None },
        Op::FailEventQueries { on: true },
        Op::Free { index: 1 },
        Op::Alloc { bytes: 3 * MIB, stream: 2, persistent: true },
        Op::SetConfig { config: 1 },
        Op::Synchronize,
        Op::DeviceSynchronize,
        Op::ReleasePersistent,
        Op::ReleaseStream { stream: 2 },
        Op::DestroyStream { stream: 0 },
        Op::DestroyStream { stream: 2 },
        Op::Alloc { bytes: 5000, stream: 2, persistent: false },
        Op::ScopeAlloc { bytes: 100 },
        Op::ScopeBurst { n: 3, seed: 1 },
        Op::ScopeExit,
        Op::ScopeEnter { stream: 1, named: true },
        Op::ScopeAlloc { bytes: 0 },
        Op::ScopeAlloc { bytes: u64::MAX },
        Op::ScopeAlloc { bytes: 3 * MIB },
        Op::ScopeBurst { n: 8, seed: 7 },
        Op::Launch { index: 3, stream: 2, write: true, sleep_us: 1 },
        Op::ScopeEnter { stream: 2, named: false },
        Op::ScopeAlloc { bytes: 700 },
        Op::ScopeBurst { n: 2, seed: 3 },
        Op::DestroyStream { stream: 2 },
        Op::ScopeEnter { stream: 0, named: true },
        Op::ScopeAlloc { bytes: 12 * MIB },
    ];
    for explicit_teardown in [false, true] {
        let p = Program { explicit_teardown, ..program(0, ops.clone()) };
        run(&p, Options::default()).unwrap();
    }
}

/// Every fault SimDevice injects, armed at points where the allocator calls what it
/// refuses, over ordinary and expandable segments: the allocators' errors for them are
/// excused, every check holds after each step, and nothing is left on the device.
#[test]
fn a_program_arming_every_fault_passes() {
    use crate::program::{EventFault, NthFault};
    let ops = vec![
        Op::Alloc { bytes: 3 * MIB, stream: 1, persistent: false },
        Op::Launch { index: 0, stream: 2, write: true, sleep_us: 5 },
        Op::FailEvents { fault: EventFault::Records, on: true },
        Op::Free { index: 0 },
        Op::Alloc { bytes: 3 * MIB, stream: 2, persistent: false },
        Op::RecordStream { index: 0, stream: 1 },
        Op::FailEvents { fault: EventFault::Panic, on: true },
        Op::Launch { index: 0, stream: 0, write: false, sleep_us: 1 },
        Op::Free { index: 0 },
        Op::FailEvents { fault: EventFault::Waits, on: true },
        Op::Alloc { bytes: 5 * MIB, stream: 1, persistent: false },
        Op::Synchronize,
        Op::FailEvents { fault: EventFault::Records, on: false },
        Op::FailEvents { fault: EventFault::Panic, on: false },
        Op::FailEvents { fault: EventFault::Waits, on: false },
        Op::FailNth { fault: NthFault::EventCreate, n: 1 },
        Op::Alloc { bytes: 2 * MIB, stream: 2, persistent: false },
        Op::Launch { index: 1, stream: 1, write: true, sleep_us: 1 },
        Op::Free { index: 1 },
        Op::FailNth { fault: NthFault::VmUnmap, n: 1 },
        Op::EmptyCache,
        Op::FailNth { fault: NthFault::VmMap, n: 2 },
        Op::Alloc { bytes: 9 * MIB, stream: 1, persistent: true },
        Op::FailNth { fault: NthFault::VmCreate, n: 1 },
        Op::Alloc { bytes: 9 * MIB, stream: 0, persistent: false },
        Op::FailNth { fault: NthFault::Malloc, n: 1 },
        Op::Alloc { bytes: 30 * MIB, stream: 0, persistent: false },
        Op::VirtualRoom { room: Some(0) },
        Op::SetConfig { config: 16 },
        Op::Alloc { bytes: 7 * MIB, stream: 2, persistent: false },
        Op::VirtualRoom { room: None },
        Op::FailNth { fault: NthFault::VmUnmap, n: 2 },
        Op::ReleaseStream { stream: 1 },
        Op::DestroyStream { stream: 2 },
        Op::ReleasePersistent,
    ];
    // (Ordinary segments meet these faults with no error; expandable ones return some.)
    for config in [0, 1, 9, 10, 17] {
        let before = EXCUSED.with(|c| c.get());
        for explicit_teardown in [false, true] {
            let p = Program { explicit_teardown, ..program(config, ops.clone()) };
            run(&p, Options::default()).unwrap_or_else(|e| panic!("config {config}: {e}"));
        }
        let excused = EXCUSED.with(|c| c.get()) - before;
        let expandable = config >= 9;
        assert!(excused > 0 || !expandable, "config {config}: no error of an injected fault");
    }
}

/// One run of the named scope on the default stream, with `base` older buffers at the front
/// of the live list: three unbound buffers (one used by a kernel), a burst of bound ones
/// between them, and a 3 MiB buffer that escapes.
fn scope_run(base: u8) -> Vec<Op> {
    vec![
        Op::ScopeEnter { stream: 0, named: true },
        Op::ScopeAlloc { bytes: 8 * MIB },
        Op::ScopeAlloc { bytes: 4096 },
        Op::Launch { index: base + 1, stream: 0, write: true, sleep_us: 1 },
        Op::ScopeBurst { n: 6, seed: 42 },
        Op::Free { index: base },
        Op::ScopeAlloc { bytes: 2 * MIB + 1 },
        Op::Free { index: base },
        Op::ScopeAlloc { bytes: 3 * MIB },
        Op::Free { index: base },
        Op::ScopeExit,
    ]
}

/// Runs `ops` like [`run`] and returns the statistics before the teardown.
fn stats_after(ops: Vec<Op>) -> tidepool::MemoryStats {
    let p = program(0, ops);
    let (alloc, base) = start(&p).unwrap();
    let other = second(&alloc, &p).unwrap();
    let mut h = Harness::new(&alloc, &other, base);
    for (i, op) in p.ops.iter().enumerate() {
        h.step(op).unwrap_or_else(|e| panic!("step {i} {op:?}: {e}"));
        h.check().unwrap_or_else(|e| panic!("after step {i} {op:?}: {e}"));
    }
    let stats = alloc.stats();
    let dev = h.teardown(false).unwrap();
    drop((other, alloc));
    finish(dev).unwrap();
    stats
}

#[test]
fn repeated_named_scope_runs_are_planned() {
    // Each escape is freed before the next run begins: runs 2 and 3 follow the plan.
    let mut ops = scope_run(0);
    for _ in 0..2 {
        ops.push(Op::Free { index: 0 });
        ops.extend(scope_run(0));
    }
    let s = stats_after(ops);
    assert_eq!(s.scope_escapes, 3);
    assert!(s.plan_hits > 0, "{s:?}");
    assert_eq!((s.plan_misses, s.plan_fallbacks), (0, 0));
    // An escape still live in the next run pins its slice: that allocation misses.
    let mut ops = scope_run(0);
    ops.extend(scope_run(1));
    let s = stats_after(ops);
    assert!(s.plan_hits > 0 && s.plan_misses > 0, "{s:?}");
}

/// The allocator's deliberate bug (no events for `record_stream` uses) must be caught.
fn reuse_while_another_stream_runs() -> Program {
    let mut ops = vec![Op::Alloc { bytes: 4096, stream: 1, persistent: false }];
    // Hold stream 2 busy for a while, then touch the buffer on it. 100 ms: the broken run
    // reuses the block before that work ends unless this thread is kept off a core for that
    // long (5 ms was not enough under a loaded `cargo test`: a broken run came out clean).
    ops.extend((0..400).map(|_| Op::Sleep { stream: 2, sleep_us: 250 }));
    ops.push(Op::Launch { index: 0, stream: 2, write: true, sleep_us: 0 });
    // Free it and take the same block again on its owner stream at once.
    ops.push(Op::Free { index: 0 });
    ops.push(Op::Alloc { bytes: 4096, stream: 1, persistent: false });
    program(0, ops)
}

#[test]
fn the_harness_catches_premature_reuse() {
    let p = reuse_while_another_stream_runs();
    run(&p, Options::default()).unwrap();
    let err = run(&p, Options { broken_skip_events: true, ..Options::default() }).unwrap_err();
    assert!(err.contains("stream-order violations"), "{err}");
}

/// The second allocator and forgotten scoped buffers: buffers given to the wrong allocator
/// are refused (a broken identity check is caught), and a forgotten planned buffer read on
/// another stream is ordered at its scope's exit (a broken exit is caught).
#[test]
fn foreign_buffers_and_forgotten_scoped_buffers() {
    let mut ops = vec![
        Op::Alloc { bytes: 4096, stream: 1, persistent: false },
        Op::Other { index: 1 + 8, action: 0 }, // 1000 B on slot 1
        Op::Other { index: 3, action: 2 },
        Op::Other { index: 0, action: 4 },
        Op::Other { index: 1, action: 4 },
        Op::Other { index: 1, action: 3 }, // the second allocator's buffer to the first
        Op::Alloc { bytes: 4096, stream: 1, persistent: false },
        Op::Other { index: 0, action: 3 }, // the first's to the second
        Op::Alloc { bytes: 4096, stream: 1, persistent: false },
    ];
    let p = program(0, ops.clone());
    run(&p, Options::default()).unwrap();
    let err = run(&p, Options { broken: Some(Broken::ForeignBuffers), ..Options::default() });
    let err = err.unwrap_err();
    assert!(err.contains("accepted") || err.contains("foreign"), "not caught: {err}");
    // A named scope's planned buffer, read on slot 2 by a long kernel and forgotten; the
    // next run hands its slice out again.
    ops.clear();
    for _ in 0..3 {
        ops.push(Op::ScopeEnter { stream: 1, named: true });
        // Long enough (32 × 200 µs) that the read is still running when the next run
        // hands the slice out, even on a loaded machine.
        ops.extend((0..32).map(|_| Op::Sleep { stream: 2, sleep_us: 200 }));
        ops.push(Op::ScopeForget { bytes: 4096, used: true, stream: 2 });
        ops.push(Op::ScopeExit);
    }
    let p = program(0, ops);
    run(&p, Options::default()).unwrap();
    let err = run(&p, Options { broken: Some(Broken::ForgottenUses), ..Options::default() });
    let err = err.unwrap_err();
    assert!(err.contains("stream-order violations"), "not caught: {err}");
}

#[test]
fn out_of_memory_must_be_explained() {
    // A 64 MiB device cannot hold 128 MiB: an explained OOM, so the program passes.
    let p = Program {
        capacity: 0,
        ..program(0, vec![Op::Alloc { bytes: 128 * MIB, stream: 0, persistent: false }])
    };
    run(&p, Options::default()).unwrap();
    // An OOM on a roomy device with no fault armed and no limit is a failure.
    let (alloc, base) = start(&program(0, vec![])).unwrap();
    let other = second(&alloc, &program(0, vec![])).unwrap();
    let h = Harness::new(&alloc, &other, base);
    let mut report = OomReport::default();
    report.segment = 2 * MIB;
    report.device_free = 256 * MIB;
    let before = h.reserve_calls();
    let err = h.explain_oom(&report, before).unwrap_err();
    assert!(err.contains("unexplained out-of-memory"), "{err}");
    // The same report is explained by a fault armed for the reserve call it made.
    let h = Harness { nth_fires_at: Some(before + 1), ..h };
    assert!(h.explain_oom(&report, before).is_err(), "no reserve call was made");
    h.dev.fail_nth_malloc(Some(1));
    assert!(h.dev.reserve(MIB).is_err());
    h.explain_oom(&report, before).unwrap();
}

#[test]
fn devices_are_reused_only_when_clean() {
    // (The only test on the 64 GiB device, so no other test takes it from the pool.)
    let ops = vec![Op::Alloc { bytes: 4096, stream: 2, persistent: false }];
    let p = Program { capacity: 3, ..program(0, ops) };
    run(&p, Options::default()).unwrap();
    // The device (with the stream it created) went back to the pool and is picked again.
    let (alloc, base) = start(&p).unwrap();
    let other = second(&alloc, &p).unwrap();
    let h = Harness::new(&alloc, &other, base);
    assert!(h.slots[1].is_some() && h.slots[2].is_none(), "{:?}", h.slots);
    drop(h);
    drop((other, alloc));
    // A program that failed leaves its device out of the pool.
    let broken = reuse_while_another_stream_runs();
    run(&broken, Options { broken_skip_events: true, ..Options::default() }).unwrap_err();
    let pool = DEVICES.lock().unwrap();
    assert!(pool.iter().all(|d| d.violations().is_empty()));
}
