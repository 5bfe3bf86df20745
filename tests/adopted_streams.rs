//! Streams the application owns (a cudarc user's `Arc<CudaStream>`), adopted by the device and
//! used by the allocator exactly like its own: allocation, stream-ordered frees, record_stream and
//! cross-stream reuse, then released before the application destroys them. On SimDevice, with the
//! stream-order sanitizer on and kernels that really write; gates make the unfinished work, so
//! nothing depends on timing.

use std::sync::Arc;
use tidepool::device::{AppStream, Launch, SimDevice};
use tidepool::{AllocError, Allocator, Config, Device, DeviceError, StreamId};

mod common;
use common::{N, gated_write};

fn setup(config: &str) -> (Arc<SimDevice>, Allocator<SimDevice>, AppStream, StreamId) {
    let dev = Arc::new(SimDevice::backed(64 << 20));
    let app = dev.create_app_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    let id = dev.adopt_stream(&app).unwrap();
    (dev, alloc, app, id)
}

#[test]
fn adoption_gives_the_stream_its_own_id_and_is_idempotent() {
    let (dev, _alloc, app, id) = setup("");
    assert_eq!(id, app.id());
    assert_ne!(id, StreamId::DEFAULT);
    assert_eq!(dev.adopt_stream(&app), Ok(id), "adopting again answers the same id");
    assert!(dev.is_adopted(id));
    assert!(!dev.is_adopted(StreamId::DEFAULT));
}

#[test]
fn an_adopted_stream_allocates_and_reuses_in_its_own_order() {
    let (dev, alloc, _app, s) = setup("");
    let a = alloc.alloc(N, s).unwrap();
    let addr = a.ptr();
    assert_eq!(a.stream(), s);
    let (k, open) = gated_write(addr, 1);
    dev.launch(s, k).unwrap();
    drop(a); // freed while the kernel still writes: same-stream reuse is ordered by the stream
    let b = alloc.alloc(N, s).unwrap();
    assert_eq!(b.ptr(), addr, "same stream, same size: the block comes back at once");
    open.send(()).unwrap();
    drop(b);
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
    alloc.check_invariants().unwrap();
}

#[test]
fn record_stream_on_an_adopted_stream_orders_reuse_by_another_stream() {
    let (dev, alloc, _app, s) = setup("");
    let a = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    let addr = a.ptr();
    let (k, open) = gated_write(addr, 7);
    dev.launch(s, k).unwrap();
    alloc.record_stream(&a, s).unwrap();
    drop(a);
    // The adopted stream's kernel has not run: the block must not come back yet.
    let b = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    assert_ne!(b.ptr(), addr, "the block waits for the adopted stream's use");
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    let c = alloc.alloc(N, StreamId::DEFAULT).unwrap();
    assert_eq!(c.ptr(), addr, "reusable once the recorded use completed");
    drop((b, c));
    assert_eq!(dev.violations(), vec![]);
    alloc.check_invariants().unwrap();
}

#[test]
fn releasing_a_stream_in_use_is_an_error_that_changes_nothing() {
    let (dev, alloc, app, s) = setup("");
    let live = alloc.alloc(3 * N, s).unwrap();
    let reserved = alloc.reserved_bytes();
    assert_eq!(alloc.release_stream(s), Err(AllocError::StreamInUse { stream: s, bytes: 3 * N }));
    assert!(dev.is_adopted(s), "still adopted");
    assert_eq!(alloc.reserved_bytes(), reserved);
    // The application cannot destroy it either while it is adopted.
    let err = dev.destroy_app_stream(app).unwrap_err();
    assert_eq!(err, DeviceError::StreamAdopted(s));
    // Still fully usable.
    let more = alloc.alloc(N, s).unwrap();
    drop((live, more));
    alloc.check_invariants().unwrap();
}

#[test]
fn release_then_destroy_returns_everything_and_forgets_the_stream() {
    let (dev, alloc, app, s) = setup("");
    let a = alloc.alloc(N, s).unwrap();
    let (k, open) = gated_write(a.ptr(), 3);
    dev.launch(s, k).unwrap();
    drop(a);
    open.send(()).unwrap();
    alloc.release_stream(s).unwrap();
    assert!(!dev.is_adopted(s));
    assert_eq!(alloc.reserved_bytes(), 0, "its cached segment went back to the device");
    assert!(dev.live_segments().is_empty());
    // Its id is no longer the allocator's to use.
    assert!(alloc.alloc(N, s).is_err(), "a released stream is unknown");
    dev.destroy_app_stream(app).unwrap();
    assert_eq!(dev.violations(), vec![]);
    alloc.check_invariants().unwrap();
}

#[test]
fn a_released_stream_can_be_adopted_again() {
    let (dev, alloc, app, s) = setup("");
    drop(alloc.alloc(N, s).unwrap());
    alloc.release_stream(s).unwrap();
    let again = dev.adopt_stream(&app).unwrap();
    assert_eq!(again, s);
    let b = alloc.alloc(N, again).unwrap();
    assert_eq!(b.stream(), again);
    drop(b);
    alloc.release_stream(again).unwrap();
    dev.destroy_app_stream(app).unwrap();
    assert!(dev.live_segments().is_empty());
}

#[test]
fn an_application_stream_never_adopted_is_unknown_to_the_allocator() {
    let dev = Arc::new(SimDevice::backed(16 << 20));
    let app = dev.create_app_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    assert_eq!(dev.destroy_stream(app.id()), Err(DeviceError::UnknownStream(app.id())));
    assert!(alloc.alloc(N, app.id()).is_err(), "not adopted: not the allocator's stream");
    dev.destroy_app_stream(app).unwrap();
}

/// A named scope runs twice on an adopted stream (a learned plan, its region on the stream),
/// then the stream is released: the answer, and the plan region bytes left.
fn release_after_a_named_scope(broken: bool) -> (Result<(), AllocError>, u64) {
    let (dev, alloc, app, s) = setup("");
    alloc.set_broken(tidepool::hooks::Broken::StreamKeepsRegions, broken);
    for _ in 0..2 {
        let scope = alloc.named_scope("step", s);
        let a = scope.alloc_unbound(N).unwrap();
        let (k, open) = gated_write(a.ptr(), 3);
        dev.launch(s, k).unwrap();
        open.send(()).unwrap();
        drop(a);
    }
    assert!(alloc.stats().plan_region_bytes > 0, "a learned plan with its region");
    let r = alloc.release_stream(s);
    if r.is_ok() {
        assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 0, "nothing left");
        assert!(!dev.is_adopted(s), "let go of");
        dev.destroy_app_stream(app).unwrap(); // the application takes it back
    }
    assert_eq!(dev.violations(), vec![]);
    alloc.check_invariants().unwrap();
    (r, alloc.stats().plan_region_bytes)
}

/// `release_stream` lets go of the stream's idle plan regions (as `empty_cache` does) before it
/// checks that nothing on the stream is live, so the application can take its stream back.
#[test]
fn release_stream_lets_go_of_an_idle_plan_region_on_the_stream() {
    assert_eq!(release_after_a_named_scope(false), (Ok(()), 0));
}

#[test]
fn the_checks_catch_release_stream_keeping_the_regions() {
    let (r, region) = release_after_a_named_scope(true);
    assert!(matches!(r, Err(AllocError::StreamInUse { .. })), "{r:?}");
    assert!(region > 0);
}
