//! Property tests of named scopes: random programs of several runs of one named scope on the
//! default stream, checked after every step, with the plan's promise on exact repeats.
//!
//! ```text
//!   Program = [RunSpec]        one RunSpec per run of named_scope("step", default stream)
//!   RunSpec = ops: [RunOp]     Alloc { bytes, bound }: scope.alloc (bound) / alloc_unbound
//!                              Free { pick }: drop the pick-th live buffer of this run
//!             delays: [Delay]  at the run's end, bound buffers still live are freed (last
//!                              first) and unbound ones *escape*; the i-th escape is freed as
//!                              delays[i % len] says: before the run `runs` later opens, or
//!                              just after it opened (inside it); at the end if none is left
//! ```
//!
//! Programs are "mostly repeated": a template run, with some runs changed a little (one size,
//! a shorter run, one more allocation). After every step: live buffers (escapes, this run's
//! unbound and bound buffers, planned ones included) never overlap and lie in live device
//! segments, `check_invariants` holds, and the sanitizer saw nothing. A run that repeats the
//! previous one exactly, with every escape of earlier runs freed before it began, must follow
//! the plan: no plan miss and no device malloc. At the end every buffer and the allocator are
//! dropped, and the device must hold no segment.
//!
//! The tests at the end are regressions for two allocator bugs that fuzzing `allocator_ops`
//! with scope operations found (now fixed); each is explained above its tests.

use proptest::prelude::*;
use std::sync::Arc;
use tidepool::MIB;
use tidepool::ScopedBuffer;
use tidepool::device::Launch;
use tidepool::{Allocator, Buffer, Config, SimDevice, StreamId};

const S0: StreamId = StreamId::DEFAULT;

/// An unbacked device far larger than any program needs (no plan region is ever refused).
const CAPACITY: u64 = 8 << 30;

/// One step of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
enum RunOp {
    /// `scope.alloc(bytes)` (`bound`) or `scope.alloc_unbound(bytes)`.
    Alloc { bytes: u64, bound: bool },
    /// Drops the `pick % n`-th of the run's `n` live buffers (nothing if none).
    Free { pick: usize },
}

/// When an escape is freed: before the run `runs` runs later opens, or just after it opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Delay {
    runs: usize,
    inside: bool,
}

/// One run of the named scope.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RunSpec {
    ops: Vec<RunOp>,
    delays: Vec<Delay>,
}

/// A live buffer of the current run.
enum Held<'s> {
    Bound(ScopedBuffer<'s, SimDevice>),
    Unbound(Buffer<SimDevice>),
}

impl Held<'_> {
    fn span(&self) -> (u64, u64) {
        match self {
            Held::Bound(b) => (b.ptr().0, b.block_size()),
            Held::Unbound(b) => (b.ptr().0, b.block_size()),
        }
    }
}

/// An escaped buffer, freed when the run `due` begins (`inside`: just after it opened).
struct Escaped {
    buf: Buffer<SimDevice>,
    due: usize,
    inside: bool,
}

/// Everything that must hold between two steps: `spans` (every live buffer's address and
/// block size) do not overlap and lie in live device segments, the allocator's invariants
/// hold, and the sanitizer found no violation.
fn check(
    dev: &SimDevice,
    alloc: &Allocator<SimDevice>,
    spans: impl Iterator<Item = (u64, u64)>,
    at: &str,
) -> Result<(), TestCaseError> {
    let mut spans: Vec<(u64, u64)> = spans.collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        prop_assert!(w[0].0 + w[0].1 <= w[1].0, "{at}: live buffers overlap: {w:x?}");
    }
    let segs = dev.live_segments();
    for &(p, n) in &spans {
        prop_assert!(
            segs.iter().any(|&(s, len)| s.0 <= p && p + n <= s.0 + len),
            "{at}: live buffer [{p:#x}, +{n}) is in no live device segment"
        );
    }
    if let Err(e) = alloc.check_invariants() {
        return Err(TestCaseError::fail(format!("{at}: invariants: {e}")));
    }
    let v = dev.violations();
    prop_assert!(v.is_empty(), "{at}: stream-order violations: {v:?}");
    Ok(())
}

fn spans_of<'a>(
    escaped: &'a [Escaped],
    held: &'a [Held<'_>],
) -> impl Iterator<Item = (u64, u64)> + 'a {
    escaped.iter().map(|e| (e.buf.ptr().0, e.buf.block_size())).chain(held.iter().map(Held::span))
}

/// Frees the escapes due at run `k` (`inside`: those freed just after it opened), checking
/// after each.
fn free_due(
    dev: &SimDevice,
    alloc: &Allocator<SimDevice>,
    escaped: &mut Vec<Escaped>,
    k: usize,
    inside: bool,
) -> Result<(), TestCaseError> {
    while let Some(i) = escaped.iter().position(|e| e.due == k && e.inside == inside) {
        drop(escaped.remove(i));
        check(dev, alloc, spans_of(escaped, &[]), &format!("run {k}: freeing an escape"))?;
    }
    Ok(())
}

/// Runs `runs` (see the module docs).
fn run_program(runs: &[RunSpec]) -> Result<(), TestCaseError> {
    let dev = Arc::new(SimDevice::new(CAPACITY));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let mut escaped: Vec<Escaped> = Vec::new();
    for (k, spec) in runs.iter().enumerate() {
        free_due(&dev, &alloc, &mut escaped, k, false)?;
        // The plan's promise: an exact repeat with nothing of earlier runs left misses nothing.
        let promised = k > 0 && runs[k - 1].ops == spec.ops && escaped.is_empty();
        // ... and reserves nothing if the plan already has its region: a scope's first plan
        // gets one as its run ends (adopted), a relearned plan only when a run first follows
        // it (`make_region` trims the stream's cache and may reserve: by design).
        let region_ready = k == 1 || k >= 2 && runs[k - 2].ops == runs[k - 1].ops;
        let (misses, mallocs) = (alloc.stats().plan_misses, dev.counters().mallocs);
        let scope = alloc.named_scope("step", S0);
        free_due(&dev, &alloc, &mut escaped, k, true)?;
        let mut held: Vec<Held<'_>> = Vec::new();
        for (i, op) in spec.ops.iter().enumerate() {
            match *op {
                RunOp::Alloc { bytes, bound } => {
                    let h = if bound {
                        Held::Bound(scope.alloc(bytes).unwrap())
                    } else {
                        Held::Unbound(scope.alloc_unbound(bytes).unwrap())
                    };
                    let (_, size) = h.span();
                    prop_assert!(size >= bytes, "run {k} step {i}: {size} bytes for {bytes}");
                    held.push(h);
                }
                RunOp::Free { pick } => {
                    if !held.is_empty() {
                        let n = held.len();
                        drop(held.remove(pick % n));
                    }
                }
            }
            check(&dev, &alloc, spans_of(&escaped, &held), &format!("run {k} step {i} {op:?}"))?;
        }
        // Bound buffers cannot outlive the scope; unbound ones escape.
        let mut n_escapes = 0;
        while let Some(h) = held.pop() {
            match h {
                Held::Bound(b) => drop(b),
                Held::Unbound(buf) => {
                    let d = spec.delays[n_escapes % spec.delays.len()];
                    escaped.push(Escaped { buf, due: k + d.runs, inside: d.inside });
                    n_escapes += 1;
                }
            }
            check(&dev, &alloc, spans_of(&escaped, &held), &format!("run {k} end"))?;
        }
        drop(held);
        drop(scope);
        check(&dev, &alloc, spans_of(&escaped, &[]), &format!("run {k} exit"))?;
        if promised {
            let s = alloc.stats();
            prop_assert_eq!(s.plan_misses, misses, "run {} repeats run {} but missed", k, k - 1);
            let m = dev.counters().mallocs;
            prop_assert!(
                !region_ready || m == mallocs,
                "run {} repeats run {} but reserved memory ({} -> {} mallocs)",
                k,
                k - 1,
                mallocs,
                m
            );
        }
    }
    while let Some(e) = escaped.pop() {
        drop(e);
        check(&dev, &alloc, spans_of(&escaped, &[]), "the end")?;
    }
    drop(alloc);
    prop_assert_eq!(dev.live_segments(), vec![], "segments left after the allocator's drop");
    prop_assert_eq!(dev.violations(), vec![]);
    Ok(())
}

/// Request sizes: common ones (so runs share rounded sizes) and any in 512 B ..= 24 MiB.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => prop::sample::select(vec![512, 4096, 65_536, MIB, 2 * MIB + 1, 8 * MIB, 24 * MIB]),
        1 => 512..=24 * MIB,
    ]
}

fn run_op() -> impl Strategy<Value = RunOp> {
    prop_oneof![
        3 => (size(), prop::bool::weighted(0.4)).prop_map(|(bytes, bound)| RunOp::Alloc { bytes, bound }),
        2 => any::<usize>().prop_map(|pick| RunOp::Free { pick }),
    ]
}

fn delay() -> impl Strategy<Value = Delay> {
    prop_oneof![
        4 => Just(Delay { runs: 1, inside: false }),
        1 => Just(Delay { runs: 1, inside: true }),
        1 => (2..=3usize, any::<bool>()).prop_map(|(runs, inside)| Delay { runs, inside }),
    ]
}

/// How a run differs from the template.
#[derive(Clone, Debug)]
enum Change {
    None,
    /// Another size for the `i`-th op, if it allocates.
    Size(usize, u64),
    /// Only the first `n` ops.
    Truncate(usize),
    /// One more op at the end.
    Push(RunOp),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        6 => Just(Change::None),
        1 => (any::<usize>(), size()).prop_map(|(i, s)| Change::Size(i, s)),
        1 => any::<usize>().prop_map(Change::Truncate),
        1 => run_op().prop_map(Change::Push),
    ]
}

/// A template run and 2..=7 runs made from it.
fn program() -> impl Strategy<Value = Vec<RunSpec>> {
    (
        prop::collection::vec(run_op(), 1..=14),
        prop::collection::vec((change(), prop::collection::vec(delay(), 1..=3)), 2..=7),
    )
        .prop_map(|(template, runs)| {
            runs.into_iter()
                .map(|(change, delays)| {
                    let mut ops = template.clone();
                    match change {
                        Change::None => {}
                        Change::Size(i, s) => {
                            let n = ops.len();
                            if let RunOp::Alloc { bytes, .. } = &mut ops[i % n] {
                                *bytes = s;
                            }
                        }
                        Change::Truncate(n) => ops.truncate(n % ops.len() + 1),
                        Change::Push(op) => ops.push(op),
                    }
                    RunSpec { ops, delays }
                })
                .collect()
        })
}

proptest! {
    // `PROPTEST_CASES` raises the count for a long hunt.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn named_scope_runs_never_overlap_and_repeats_follow_the_plan(runs in program()) {
        run_program(&runs)?;
    }
}

/// The property's pieces, on one hand-written program: a template whose escape is freed before
/// the next run, repeated; then an escape kept across a run (its slice stays pinned).
#[test]
fn a_hand_written_program_passes_and_is_planned() {
    use RunOp::*;
    let ops = vec![
        Alloc { bytes: 8 * MIB, bound: false },
        Alloc { bytes: 4096, bound: true },
        Alloc { bytes: 2 * MIB + 1, bound: false },
        Free { pick: 0 },
        Alloc { bytes: 3 * MIB, bound: false },
        Free { pick: 0 },
    ];
    let next = RunSpec { ops: ops.clone(), delays: vec![Delay { runs: 1, inside: false }] };
    let later = RunSpec { ops, delays: vec![Delay { runs: 2, inside: true }] };
    run_program(&[next.clone(), next.clone(), next.clone(), later.clone(), later, next]).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Regressions for an allocator bug found by fuzzing `allocator_ops` with scope operations,
// fixed by `Scope::unstep` (a failed allocation takes its step back) and by `planned_claiming`
// denying the region on any error:
//
// A scoped allocation that failed (out of memory) was still recorded as a step of the run:
// `Scope::alloc_unbound` and `Scope::alloc_slow` call `self.step(Step::Alloc(rounded))` before
// `pool_block`. The learned plan then holds a phantom allocation that is never freed, so it
// lives to the end of the run and the plan's region must hold it. With a request of
// `MAX_REQUEST` (256 TiB) the first plan cannot be adopted (its fresh block does not round), so
// it is learned the ordinary way with a region of 256 TiB + the rest. The next run's first
// planned allocation claims the region: `make_region` fails to round its size and returns
// `InvalidSize { requested: region size }`, and `planned_claiming` passes every error but
// out-of-memory on to the caller. The run keeps following the plan (so it is never relearned)
// and never claims the region: every allocation of every later run of the scope fails with
// `InvalidSize`, for requests that are perfectly valid.
//
// With a smaller failed request (1 TiB on a 256 MiB device) the region is refused instead
// (out of memory, so the run is `Denied`): no error, but the plan is never served again, and
// every later run trims the stream's cached segments, climbs the OOM ladder once more (one more
// `num_ooms` per run) and reserves its memory from the device again.
// ---------------------------------------------------------------------------------------------

/// The minimized fuzz input: ScopeEnter{0, named}, ScopeAlloc{8 MiB}, ScopeAlloc{MAX_REQUEST}
/// (out of memory), ScopeEnter{0, named} (ends the first run), ScopeAlloc{8 MiB} (fails with
/// `InvalidSize(2^48 + 8 MiB)`).
#[test]
fn fuzz_regression_a_failed_scoped_allocation_is_planned() {
    let input = [
        0x01, 0x00, 0x00, 0x33, 0x00, 0x01, 0x23, 0x02, 0xff, 0xff, 0x6f, 0x00, 0x23, 0xf9, 0xf9,
        0x33, 0x00, 0x01, 0x23, 0x02, 0xff, 0xff, 0x6f,
    ];
    tidepool_fuzzing::allocator_ops(&input);
}

#[test]
fn a_failed_scoped_allocation_does_not_break_later_runs() {
    use tidepool::AllocError;
    use tidepool::MAX_REQUEST;
    let dev = Arc::new(SimDevice::new(256 * MIB));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    for run in 0..3 {
        let scope = alloc.named_scope("step", S0);
        let a = scope.alloc_unbound(8 * MIB);
        assert!(a.is_ok(), "run {run}: a valid 8 MiB request failed: {:?}", a.err());
        let b = scope.alloc_unbound(MAX_REQUEST);
        assert!(matches!(b, Err(AllocError::OutOfMemory(_))), "run {run}: {:?}", b.err());
    }
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn a_failed_scoped_allocation_does_not_disable_the_plan() {
    let dev = Arc::new(SimDevice::new(256 * MIB));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let run = || {
        let scope = alloc.named_scope("step", S0);
        let a = scope.alloc_unbound(8 * MIB).unwrap();
        assert!(scope.alloc_unbound(1 << 40).is_err(), "1 TiB on a 256 MiB device");
        drop(a);
    };
    run();
    run();
    let (s, mallocs) = (alloc.stats(), dev.counters().mallocs);
    run();
    let t = alloc.stats();
    assert_eq!(t.num_ooms, s.num_ooms + 1, "only the 1 TiB request runs out of memory");
    assert_eq!(dev.counters().mallocs, mallocs, "the 8 MiB buffer comes from the plan or cache");
    assert!(t.plan_hits > s.plan_hits, "the 8 MiB buffer is planned: {t:?}");
}

// ---------------------------------------------------------------------------------------------
// A second allocator bug found by fuzzing `allocator_ops`, fixed in `Shared::order_after`
// (when the owner stream cannot wait, the other stream's work is waited for on the host):
//
// A planned buffer (a slice of a plan's region) used on another stream orders its reuse only
// through its owner stream: when it is dropped, `Buffer::drop` (`Origin::Region`) calls
// `order_after(owner, uses)`, which records an event on each use stream and makes the *owner*
// wait for it, and then lets go of the region; if that was the last hold (the plan was relearned
// since), the region's blocks go back to the pool as plain free blocks, with no pending event.
// When the owner stream was destroyed before the free, `wait_event(owner, ..)` fails and the
// error was ignored (`Shared::order_after`), so nothing ordered the reuse after the other
// stream's work; `take_from_other_stream` then hands the segment to another stream at once
// ("the owner was destroyed, hence drained"), while the other stream may still be writing it.
// A pool buffer in the same position is safe: its free records pending events on the streams
// it was used on.
// ---------------------------------------------------------------------------------------------

/// The minimized fuzz input: ScopeEnter{1, named}, ScopeAlloc{8 MiB}, ScopeAlloc{196866},
/// Free{0}, ScopeEnter{1, named} (the first run ends: the 196866-byte buffer escapes, the plan's
/// region is adopted), ScopeAlloc{8 MiB} (planned), Free{0} (the escape), DestroyStream{1} (the
/// scope ends first; the run diverged, so the plan is relearned and the planned buffer holds the
/// old region), Inspect, Launch{the planned buffer on a new stream, write, 5 µs} (after
/// `record_stream`), Free{it} (the region goes back to the pool), Alloc{9 MiB on the default
/// stream}: handed the planned buffer's memory while the kernel still writes it.
#[test]
fn fuzz_regression_a_planned_buffer_freed_after_its_stream_was_destroyed() {
    let input = [
        0x01, 0x00, 0x00, 0x33, 0x01, 0x01, 0x23, 0x02, 0xff, 0xff, 0x6f, 0x00, 0x23, 0x01, 0x01,
        0x01, 0x23, 0x00, 0x08, 0x00, 0x33, 0x01, 0x01, 0x23, 0x02, 0xff, 0xff, 0x6f, 0x00, 0x08,
        0x00, 0x1a, 0x01, 0xff, 0xff, 0x0d, 0x02, 0x01, 0x01, 0x17, 0x08, 0x08, 0x00, 0x17,
    ];
    tidepool_fuzzing::allocator_ops(&input);
}

#[test]
fn a_planned_buffer_used_elsewhere_and_freed_after_its_stream_was_destroyed() {
    use std::time::Duration;
    use tidepool::Device;
    use tidepool::device::{Access, AccessKind, Kernel};
    let dev = Arc::new(SimDevice::new(256 * MIB));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let s1 = dev.create_stream().unwrap();
    // Run 1 learns; its 196866-byte buffer escapes (the region adopts its segment).
    let escape = {
        let scope = alloc.named_scope("f", s1);
        let a = scope.alloc_unbound(8 * MIB).unwrap();
        let b = scope.alloc_unbound(196_866).unwrap();
        drop(a);
        b
    };
    // Run 2 diverges (relearned at exit): its planned buffer escapes holding the old region.
    let planned = {
        let scope = alloc.named_scope("f", s1);
        let c = scope.alloc_unbound(8 * MIB).unwrap();
        assert!(c.is_planned());
        drop(escape);
        c
    };
    alloc.destroy_stream(s1).unwrap();
    // Used on another stream, announced; freed while the kernel runs.
    let s2 = dev.create_stream().unwrap();
    alloc.record_stream(&planned, s2).unwrap();
    let write = Access { ptr: planned.ptr(), bytes: planned.len(), kind: AccessKind::Write };
    let k = Kernel {
        name: "w",
        accesses: vec![write],
        sleep: Duration::from_millis(50),
        body: None,
        replay: None,
    };
    dev.launch(s2, k).unwrap();
    drop(planned);
    let other = alloc.alloc(9 * MIB, S0).unwrap();
    assert_eq!(dev.violations(), vec![], "{other:?} was handed out under the kernel on {s2}");
}
