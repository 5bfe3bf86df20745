//! CUDA-graph captures that other streams join (fork and join, as CUDA's and PyTorch's): an
//! event recorded on a capturing stream and waited on by another stream pulls that stream into
//! the capture. The device records its work too and refuses to end the capture until it is
//! joined back; the allocator routes its allocations to the capture's pool, holds back what it
//! frees there that the graph uses, and never records an event on it itself.

mod common;

use common::{
    N, Setup, replayable_read as read, replayable_write as write, setup, wait_stream as wait,
};
use tidepool::device::{Access, AccessKind, DeviceError, Kernel, Launch};
use tidepool::hooks::Broken;
use tidepool::{AllocError, Buffer, Device, SimDevice, StreamId};

fn code<T: std::fmt::Debug>(r: Result<T, DeviceError>) -> u32 {
    match r {
        Err(DeviceError::Driver { code, .. }) => code,
        r => panic!("{r:?}"),
    }
}

#[test]
fn a_stream_that_waits_on_a_captured_event_joins_the_capture_until_it_ends() {
    let Setup { dev, s, t, alloc } = setup();
    let u = dev.create_stream().unwrap();
    let before = alloc.alloc(N, s).unwrap();
    alloc.begin_capture(s, None).unwrap();
    assert_eq!((dev.capture_of(s), dev.capture_of(t)), (Some(s), None));
    assert!(!alloc.is_capturing(t));
    wait(&dev, t, s); // the fork
    assert_eq!(dev.capture_of(t), Some(s));
    assert!(alloc.is_capturing(t));
    assert_eq!(dev.graph_counters().joined_streams, 1);
    // Its work is recorded, not run; it cannot wait on work outside the capture, nor be
    // destroyed, nor begin or end a capture of its own.
    dev.launch(t, write(&before, 1)).unwrap();
    assert_eq!(dev.graph_counters().captured_kernels, 1);
    let outside = dev.create_event().unwrap();
    dev.record_event(outside, u).unwrap();
    assert_eq!(code(dev.wait_event(t, outside)), DeviceError::CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    assert_eq!(code(dev.destroy_stream(t)), DeviceError::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert!(matches!(alloc.destroy_stream(t), Err(AllocError::Device(_))));
    assert!(dev.has_stream(t), "refused: the stream is still there");
    assert!(matches!(alloc.begin_capture(t, None), Err(AllocError::Device(_))));
    assert!(matches!(
        alloc.end_capture(t),
        Err(AllocError::Capture { reason, .. }) if reason.contains("joined")
    ));
    // The default stream cannot join (CUDA cannot capture the legacy stream).
    let e = dev.create_event().unwrap();
    dev.record_event(e, s).unwrap();
    assert!(matches!(dev.wait_event(StreamId::DEFAULT, e), Err(DeviceError::Unsupported(_))));
    // Not joined back: the capture fails and is over for both streams.
    let r = alloc.end_capture(s);
    assert!(
        matches!(r, Err(AllocError::Device(DeviceError::Driver { code, .. }))
            if code == DeviceError::CUDA_ERROR_STREAM_CAPTURE_UNJOINED),
        "{r:?}"
    );
    assert_eq!((dev.capture_of(s), dev.capture_of(t)), (None, None));
    assert!(!alloc.is_capturing(t) && !alloc.is_capturing(s));
    assert!(!dev.capture_underway());
    dev.synchronize().unwrap();
    drop(before);
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn a_forked_capture_joined_back_replays_both_branches() {
    let Setup { dev, s, t, alloc } = setup();
    let input = alloc.alloc(N, s).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let a = alloc.alloc(N, s).unwrap(); // the capture's pool, on s
    dev.launch(s, write(&a, 7)).unwrap();
    wait(&dev, t, s); // fork: t is ordered after the write
    let b = alloc.alloc(N, t).unwrap(); // the capture's pool too, on t
    assert_ne!(a.ptr(), b.ptr());
    dev.launch(t, read(&a)).unwrap();
    dev.launch(t, write(&b, 9)).unwrap();
    dev.launch(s, read(&input)).unwrap(); // s's own branch meanwhile
    wait(&dev, s, t); // join
    let graph = alloc.end_capture(s).unwrap();
    assert!(!alloc.is_capturing(t));
    // Both branches' allocations are the graph's pool's (PyTorch's
    // `test_cuda_graph_allocator_propagates_stream`: two segments, one pool).
    let segs = graph.pool().snapshot();
    assert_eq!(segs.len(), 2, "{segs:?}");
    let mut streams: Vec<StreamId> = segs.iter().map(|g| g.stream).collect();
    streams.sort();
    assert_eq!(streams, [s, t]);
    assert_eq!(alloc.snapshot().len(), 1, "the general allocator only has `input`'s segment");
    for _ in 0..5 {
        graph.launch(s).unwrap();
    }
    assert_eq!(dev.graph_counters().replayed_kernels, 5 * 4);
    dev.synchronize().unwrap();
    assert_eq!(common::device_bytes(&dev, &b), vec![9; N as usize]);
    drop((a, b, graph, input));
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

/// A block allocated and freed on a joined stream during the capture, then the same size on
/// that stream once the capture is over, with the graph replayed: returns the two addresses
/// and the violations.
fn joined_free_then_reuse(broken: bool) -> (u64, u64, Vec<tidepool::device::Violation>) {
    let Setup { dev, s, t, alloc } = setup();
    alloc.set_broken(Broken::JoinedStreamsOutside, broken);
    drop(alloc.alloc(N, t).unwrap()); // a general-pool block cached on t
    alloc.begin_capture(s, None).unwrap();
    wait(&dev, t, s);
    let b = alloc.alloc(N, t).unwrap();
    dev.launch(t, write(&b, 3)).unwrap();
    let inside = b.ptr().0;
    drop(b); // on t, in the capture: the graph's replays write it
    wait(&dev, s, t);
    let graph = alloc.end_capture(s).unwrap();
    let after = alloc.alloc(N, t).unwrap();
    dev.launch(t, write_once(&after)).unwrap();
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    let outside = after.ptr().0;
    drop((after, graph));
    (inside, outside, dev.violations())
}

/// A one-shot kernel writing `b`.
fn write_once(b: &Buffer<SimDevice>) -> Kernel {
    let p = b.ptr();
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
    Kernel::new("write", acc, move |m| m.write(p, &[1; N as usize]).unwrap())
}

#[test]
fn a_joined_streams_captured_frees_stay_in_the_graphs_pool() {
    let (inside, outside, v) = joined_free_then_reuse(false);
    assert_ne!(inside, outside);
    assert!(v.is_empty(), "{v:?}");
}

#[test]
fn the_sanitizer_catches_a_joined_stream_treated_as_outside_the_capture() {
    let (inside, outside, v) = joined_free_then_reuse(true);
    assert_eq!(inside, outside, "the general pool's cached block, handed out again");
    assert!(v.iter().any(|x| x.op.contains("CUDA graph")), "{v:?}");
}

/// PyTorch's `test_graph_record_stream`, its side-stream half: a block of the capture's pool
/// used on a joined stream (`record_stream`) and freed there during the capture is held by the
/// graph (no event can be recorded on a capturing stream); the first allocation after the
/// capture succeeds. Returns what the graph held.
fn record_stream_on_joined(broken: bool) -> usize {
    let Setup { dev, s, t, alloc } = setup();
    alloc.set_broken(Broken::JoinedStreamsOutside, broken);
    let a = alloc.alloc(N, s).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let b = alloc.alloc(N, s).unwrap();
    dev.launch(s, write(&b, 2)).unwrap();
    wait(&dev, t, s);
    dev.launch(t, read(&b)).unwrap();
    b.record_stream(t).unwrap();
    drop(b);
    // Before the join: a scope refuses the joined stream (its memory would be the general
    // pool's), as it refuses the capturing one.
    let scope = alloc.scope(t);
    if !broken {
        assert_eq!(scope.alloc(16).err(), Some(AllocError::StreamRouted(t)));
    }
    drop(scope);
    wait(&dev, s, t);
    let graph = alloc.end_capture(s).unwrap();
    let held = graph.held_buffers();
    dev.synchronize().unwrap();
    drop(alloc.alloc(N, s).unwrap());
    graph.launch(s).unwrap();
    drop((graph, a));
    alloc.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    held
}

#[test]
fn a_block_used_on_a_joined_stream_and_freed_in_the_capture_is_held_by_the_graph() {
    assert_eq!(record_stream_on_joined(false), 1);
}

#[test]
fn a_joined_stream_treated_as_outside_lets_the_graph_hold_nothing() {
    assert_eq!(record_stream_on_joined(true), 0);
}

/// A buffer written in the capture, then announced for a stream outside it (`use_on`): the
/// allocator must not record its ordering event on the capturing stream, which would pull the
/// outside stream into the capture. Returns whether the outside stream was pulled in and the
/// end of the capture.
fn use_on_outside_during_capture(broken: bool) -> (Option<StreamId>, Result<(), AllocError>) {
    let Setup { dev, s, t, alloc } = setup();
    alloc.set_broken(Broken::CaptureForks, broken);
    alloc.begin_capture(s, None).unwrap();
    let b = alloc.alloc(N, s).unwrap();
    dev.launch(s, write(&b, 4)).unwrap();
    b.use_on(s, AccessKind::Write).unwrap(); // its own stream: nothing to order
    let r = b.use_on(t, AccessKind::Read); // refused (no event, no host wait in a capture)
    assert!(r.is_err() || broken, "{r:?}");
    let pulled = dev.capture_of(t);
    let ended = alloc.end_capture(s).map(drop);
    drop(b);
    (pulled, ended)
}

#[test]
fn the_allocator_never_forks_a_capture_with_its_own_events() {
    let (pulled, ended) = use_on_outside_during_capture(false);
    assert_eq!(pulled, None);
    assert!(ended.is_ok(), "{ended:?}");
}

#[test]
fn an_allocator_that_records_on_capturing_streams_forks_the_capture() {
    let (pulled, ended) = use_on_outside_during_capture(true);
    assert!(pulled.is_some());
    assert!(ended.is_err(), "the stream pulled in was never joined back");
}

#[test]
fn the_sanitizer_sees_branches_of_a_graph_that_are_not_ordered() {
    let Setup { dev, s, t, alloc } = setup();
    alloc.begin_capture(s, None).unwrap();
    let a = alloc.alloc(N, s).unwrap();
    let early = dev.create_event().unwrap();
    dev.record_event(early, s).unwrap(); // before the write
    dev.launch(s, write(&a, 5)).unwrap();
    dev.wait_event(t, early).unwrap(); // t forks off before the write ...
    assert!(dev.violations().is_empty());
    dev.launch(t, read(&a)).unwrap(); // ... so its read races it at every replay
    let v = dev.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!((v[0].ptr, v[0].bytes, v[0].stream, v[0].other), (a.ptr(), N, t, Some(s)));
    assert!(v[0].op.contains("not ordered"), "{v:?}");
    // Ordered after the write, the same read is fine.
    wait(&dev, t, s);
    dev.launch(t, read(&a)).unwrap();
    assert_eq!(dev.violations().len(), 1, "{:?}", dev.violations());
    // Memory handed out on s that t's captured reads (t not joined back) may still touch.
    dev.note_handout(a.ptr(), N, s);
    let v = dev.violations();
    let unordered: Vec<_> = v.iter().filter(|x| x.op.contains("unordered branch")).collect();
    assert_eq!(unordered.len(), 2, "both of t's reads: {v:?}");
    assert!(unordered.iter().all(|x| (x.stream, x.other) == (s, Some(t))), "{v:?}");
    wait(&dev, s, t);
    let graph = alloc.end_capture(s).unwrap();
    drop((a, graph));
}

/// A capture forked into a second stream on one thread while another thread allocates and
/// frees on a third stream outside the capture: the other thread's memory is the general pool's
/// and is reused at once (nothing held by the graph); the capture's two streams get only the
/// graph's pool; nothing the graph uses is handed out elsewhere.
#[test]
fn a_forked_capture_beside_a_thread_working_outside_it() {
    let Setup { dev, s, t, alloc } = setup();
    let u = dev.create_stream().unwrap();
    let warm = alloc.alloc(N, u).unwrap(); // the general pool's segment of `u`
    let general = warm.ptr();
    drop(warm);
    alloc.begin_capture(s, None).unwrap();
    let (go, ready) = std::sync::mpsc::channel::<()>();
    let outside = std::thread::scope(|sc| {
        let (alloc, ready) = (&alloc, ready);
        let worker = sc.spawn(move || {
            ready.recv().unwrap(); // once `t` has joined
            let mut seen = Vec::new();
            for _ in 0..50 {
                let b = alloc.alloc(N, u).unwrap();
                assert!(!alloc.is_capturing(u));
                seen.push(b.ptr());
                drop(b); // reused at once: nothing holds it
            }
            seen
        });
        wait(&dev, t, s);
        go.send(()).unwrap();
        let a = alloc.alloc(N, s).unwrap();
        let b = alloc.alloc(N, t).unwrap();
        dev.launch(s, write(&a, 1)).unwrap();
        dev.launch(t, write(&b, 2)).unwrap();
        let seen = worker.join().unwrap();
        wait(&dev, s, t);
        let graph = alloc.end_capture(s).unwrap();
        let mut mine = graph.pool().snapshot().iter().map(|g| g.stream).collect::<Vec<_>>();
        mine.sort();
        assert_eq!(mine, [s, t]);
        assert_eq!(graph.held_buffers(), 0);
        graph.launch(s).unwrap();
        drop((a, b, graph));
        seen
    });
    assert!(outside.iter().all(|&p| p == general), "{outside:?}");
    dev.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

/// `use_on` of a captured buffer for a stream joined to the same capture (what cudarc's
/// `DevicePtr` asks of a `CudaBuffer` on a side stream): the allocator orders the use inside the
/// capture, with an event recorded on the writer's stream and waited on by the joined one (an
/// edge of the graph; no stream joins). Returns what `use_on` answered, the streams that joined,
/// and the sanitizer's reports over the capture and a replay.
fn use_on_a_joined_stream(broken: bool) -> (Result<(), AllocError>, u64, Vec<String>) {
    let Setup { dev, s, t, alloc } = setup();
    alloc.set_broken(Broken::CaptureUseOnUnordered, broken);
    alloc.begin_capture(s, None).unwrap();
    let b = alloc.alloc(N, s).unwrap();
    dev.launch(s, write(&b, 1)).unwrap();
    wait(&dev, t, s); // t joins
    dev.launch(s, write(&b, 2)).unwrap(); // after the fork: t's read must come after it
    let r = b.use_on(t, AccessKind::Read);
    dev.launch(t, read(&b)).unwrap();
    wait(&dev, s, t); // joined back
    let graph = alloc.end_capture(s).unwrap();
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    let joined = dev.graph_counters().joined_streams;
    drop((graph, b));
    alloc.empty_cache().unwrap();
    (r, joined, dev.violations().iter().map(|v| v.op.to_string()).collect())
}

#[test]
fn use_on_a_joined_stream_is_ordered_inside_the_capture() {
    let (r, joined, v) = use_on_a_joined_stream(false);
    assert_eq!(r, Ok(()));
    assert_eq!(joined, 1, "only t, by the application's fork");
    assert!(v.is_empty(), "{v:?}");
}

#[test]
fn use_on_recorded_without_its_order_inside_a_capture_is_caught() {
    let (r, _, v) = use_on_a_joined_stream(true);
    assert_eq!(r, Ok(()));
    assert!(v.iter().any(|x| x.contains("not ordered")), "{v:?}");
}
