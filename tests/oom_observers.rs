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
