//! Out-of-memory observers and the failure callback: called once per out-of-memory error with
//! the report, with no lock held (they may use the allocator), and a callback that frees memory
//! makes the retried allocation succeed.

use std::sync::{Arc, Mutex};
use tidepool::{AllocError, Allocator, Buffer, Config, MIB, SimDevice, StreamId};

fn setup(capacity: u64) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::new(capacity));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, alloc)
}

#[test]
fn observers_see_each_out_of_memory_error_once_with_its_report() {
    let (_dev, alloc) = setup(64 * MIB);
    let seen = Arc::new(Mutex::new(Vec::new()));
    for tag in ["a", "b"] {
        let log = seen.clone();
        alloc.attach_oom_observer(move |r| {
            log.lock().unwrap().push((tag, r.requested, r.device_total))
        });
    }
    let held = alloc.alloc(40 * MIB, StreamId::DEFAULT).unwrap();
    let err = alloc.alloc(30 * MIB, StreamId::DEFAULT).unwrap_err();
    let AllocError::OutOfMemory(report) = err else { panic!("{err:?}") };
    assert_eq!(report.requested, 30 * MIB);
    assert_eq!(*seen.lock().unwrap(), vec![("a", 30 * MIB, 64 * MIB), ("b", 30 * MIB, 64 * MIB)]);
    // A request that succeeds calls nobody.
    drop(alloc.alloc(MIB, StreamId::DEFAULT).unwrap());
    assert_eq!(seen.lock().unwrap().len(), 2);
    drop(held);
    alloc.check_invariants().unwrap();
}

#[test]
fn a_failure_callback_that_frees_memory_gets_the_allocation_retried() {
    let (_dev, alloc) = setup(64 * MIB);
    let hoard: Arc<Mutex<Vec<Buffer<SimDevice>>>> = Arc::new(Mutex::new(Vec::new()));
    for _ in 0..3 {
        hoard.lock().unwrap().push(alloc.alloc(20 * MIB, StreamId::DEFAULT).unwrap());
    }
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let (h, a, inner) = (hoard.clone(), attempts.clone(), alloc.clone());
    alloc.set_failure_callback(move |report, attempt| {
        a.lock().unwrap().push((report.requested, attempt));
        // The callback may use the allocator: no lock is held while it runs.
        let _ = inner.stats();
        h.lock().unwrap().pop().is_some() // free one buffer, ask for another attempt
    });
    let big = alloc.alloc(30 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(big.len(), 30 * MIB);
    assert_eq!(*attempts.lock().unwrap(), vec![(30 * MIB, 1), (30 * MIB, 2)]);
    assert_eq!(hoard.lock().unwrap().len(), 1, "two buffers were given up");
    // Nothing left to give: the callback says no and the error returns.
    let err = alloc.alloc(50 * MIB, StreamId::DEFAULT).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    alloc.clear_failure_callback();
    drop(big);
    hoard.lock().unwrap().clear();
    alloc.check_invariants().unwrap();
}

/// How the user code that runs on an out-of-memory error behaves in
/// [`a_panic_in_an_observer_leaves_a_scope_run_as_an_error_would`].
#[derive(Clone, Copy, Debug, PartialEq)]
enum OnOom {
    /// The observer returns: the request is an error.
    Returns,
    /// The observer panics; the caller catches it.
    ObserverPanics,
    /// The failure callback panics; the caller catches it.
    CallbackPanics,
}

/// What a run of [`scope_runs`] saw: the addresses of its three buffers, and whether its failed
/// request came back as an error (or as a caught panic).
type Run = ([u64; 3], Option<bool>);

/// Six runs of a named scope of three buffers (4, 8 and 2 MiB, scoped, unbound, scoped); runs 1
/// and 2 also ask for 1 GiB of a 64 MiB device (scoped, then unbound) in the middle, which
/// runs the out-of-memory user code. Every run checks the invariants; the end, the figures.
fn scope_runs(on_oom: OnOom) -> (Vec<Run>, tidepool::Stat) {
    let (dev, alloc) = setup(64 * MIB);
    let panics = on_oom == OnOom::ObserverPanics;
    alloc.attach_oom_observer(move |_| assert!(!panics, "the observer panics"));
    if on_oom == OnOom::CallbackPanics {
        alloc.set_failure_callback(|_, _| panic!("the failure callback panics"));
    }
    let s0 = StreamId::DEFAULT;
    let runs = (0..6)
        .map(|run| {
            let scope = alloc.named_scope("step", s0);
            let x = scope.alloc(4 * MIB).unwrap();
            let y = scope.alloc_unbound(8 * MIB).unwrap();
            let failed = (run == 1 || run == 2).then(|| {
                let ask = std::panic::AssertUnwindSafe(|| match run {
                    1 => scope.alloc(1 << 30).map(|_| ()),
                    _ => scope.alloc_unbound(1 << 30).map(drop),
                });
                match std::panic::catch_unwind(ask) {
                    Ok(r) => r.is_err(),
                    Err(_) => false,
                }
            });
            let z = scope.alloc(2 * MIB).unwrap();
            let seen = [x.ptr().0, y.ptr().0, z.ptr().0];
            drop((x, y, z));
            drop(scope);
            alloc.check_invariants().unwrap();
            assert_eq!(dev.violations(), vec![]);
            (seen, failed)
        })
        .collect();
    let bytes = alloc.stats().blocks.allocated_bytes.all;
    drop(alloc);
    assert!(dev.live_segments().is_empty(), "{on_oom:?}: {:?}", dev.live_segments());
    (runs, bytes)
}

/// A panic in the user code the allocator runs on an out-of-memory error (an observer, the
/// failure callback), caught by the caller in the middle of a named scope's run, leaves the run
/// as the error would have: the request is not one of the run's steps, so the plan learned
/// from it is the same and the next runs are served from it at the same addresses, with the
/// same figures. (Before, the run kept a step for an allocation that never happened: run 1's
/// last buffer moved, runs 2 and 3 relearned at new addresses, and the peak rose by 2 MiB.)
/// The broken build `cfg(tidepool_broken = "unwind_step")` keeps the step on a panic.
#[test]
fn a_panic_in_an_observer_leaves_a_scope_run_as_an_error_would() {
    let (runs, bytes) = scope_runs(OnOom::Returns);
    let at = |offset: u64| tidepool::device::SIM_BASE + offset;
    let first = [at(0), at(0x40_0000), at(0xc0_0000)];
    let planned = [at(0x1c0_0000), at(0x140_0000), at(0x200_0000)];
    let want: Vec<Run> = vec![
        (first, None),
        (planned, Some(true)),
        (planned, Some(true)),
        (planned, None),
        (planned, None),
        (planned, None),
    ];
    assert_eq!(runs, want);
    assert_eq!((bytes.current, bytes.peak), (14 * MIB, 14 * MIB));
    for on_oom in [OnOom::ObserverPanics, OnOom::CallbackPanics] {
        let (runs, got) = scope_runs(on_oom);
        let caught: Vec<Run> = want.iter().map(|&(a, f)| (a, f.map(|_| false))).collect();
        assert_eq!(runs, caught, "{on_oom:?}");
        assert_eq!(got, bytes, "{on_oom:?}");
    }
}
