//! SimDevice as an asynchronous device: stream order, events, waits, destroy, drop, counters,
//! fault injection, kernel panics. No wall-clock asserts: work is made provably unfinished with
//! gates (a kernel blocks on a channel until the test opens it) or long sleeps used only as setup.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tidepool::device::{
    Access, AccessKind, Device, DeviceAddr, DeviceError, EventId, Kernel, KernelFailure, Launch,
    SimCounters, SimDevice, StreamId,
};

fn acc(ptr: DeviceAddr, bytes: u64, kind: AccessKind) -> Access {
    Access { ptr, bytes, kind }
}

/// A kernel writing `byte` over `[ptr, ptr + bytes)` once the returned sender sends (or drops).
fn gated_write(ptr: DeviceAddr, bytes: u64, byte: u8) -> (Kernel, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel::<()>();
    let k = Kernel::new("gated_write", vec![acc(ptr, bytes, AccessKind::Write)], move |m| {
        let _ = gate.recv();
        m.write(ptr, &vec![byte; bytes as usize]).unwrap();
    });
    (k, open)
}

/// A kernel reading `[ptr, ptr + bytes)` into the returned slot.
fn reader(ptr: DeviceAddr, bytes: u64) -> (Kernel, Arc<Mutex<Vec<u8>>>) {
    let slot = Arc::new(Mutex::new(Vec::new()));
    let out = Arc::clone(&slot);
    let k = Kernel::new("reader", vec![acc(ptr, bytes, AccessKind::Read)], move |m| {
        let mut buf = vec![0u8; bytes as usize];
        m.read(ptr, &mut buf).unwrap();
        *out.lock().unwrap() = buf;
    });
    (k, slot)
}

/// A backed device with one segment of 4 KiB handed out to `stream`.
fn device_with_buffer(stream: StreamId) -> (SimDevice, DeviceAddr) {
    let dev = SimDevice::backed(1 << 20);
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 4096, stream);
    (dev, p)
}

#[test]
fn work_on_one_stream_runs_in_order() {
    let dev = SimDevice::backed(1 << 20);
    let s = dev.create_stream().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    for i in 0..20u64 {
        let log = Arc::clone(&log);
        // Earlier kernels sleep longer: only stream order keeps the log sorted.
        let k = Kernel {
            sleep: Duration::from_millis(20 - i),
            ..Kernel::new("append", Vec::new(), move |_| log.lock().unwrap().push(i))
        };
        dev.launch(s, k).unwrap();
    }
    dev.synchronize().unwrap();
    assert_eq!(*log.lock().unwrap(), (0..20).collect::<Vec<_>>());
    assert!(dev.violations().is_empty());
}

#[test]
fn launch_returns_before_a_long_sleep_kernel_finishes() {
    let dev = SimDevice::new(1 << 20);
    let s = dev.create_stream().unwrap();
    let e = dev.create_event().unwrap();
    assert!(dev.query_event(e).unwrap(), "an event never recorded is complete");
    dev.launch(s, Kernel::sleep(Duration::from_millis(300))).unwrap();
    dev.record_event(e, s).unwrap();
    assert!(!dev.query_event(e).unwrap());
    dev.synchronize_event(e).unwrap();
    assert!(dev.query_event(e).unwrap());
    // Re-recording re-arms the event.
    dev.launch(s, Kernel::sleep(Duration::from_millis(300))).unwrap();
    assert!(dev.query_event(e).unwrap(), "old marker still passed");
    dev.record_event(e, s).unwrap();
    assert!(!dev.query_event(e).unwrap());
    dev.synchronize().unwrap();
    assert!(dev.query_event(e).unwrap());
}

#[test]
fn gated_kernel_keeps_its_event_pending_until_it_runs() {
    let (dev, p) = device_with_buffer(StreamId::DEFAULT);
    let e = dev.create_event().unwrap();
    let (k, open) = gated_write(p, 16, 7);
    dev.launch(StreamId::DEFAULT, k).unwrap(); // would deadlock if launch ran the body
    dev.record_event(e, StreamId::DEFAULT).unwrap();
    for _ in 0..3 {
        assert!(!dev.query_event(e).unwrap());
    }
    open.send(()).unwrap();
    dev.synchronize_event(e).unwrap();
    assert!(dev.query_event(e).unwrap());
}

/// `blocked_host_waits` counts the host threads blocked now on unfinished work: an event's
/// synchronisation and a stream's destruction behind a gated kernel, each until the gate
/// opens; a synchronisation of completed work never counts.
#[test]
fn blocked_host_waits_count_the_threads_waiting_on_unfinished_work() {
    let dev = Arc::new(SimDevice::backed(1 << 20));
    let s = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 4096, s);
    dev.synchronize().unwrap();
    assert_eq!(dev.blocked_host_waits(), 0, "nothing to wait for: no wait counted");
    let (k, open) = gated_write(p, 16, 7);
    dev.launch(s, k).unwrap();
    let e = dev.create_event().unwrap();
    dev.record_event(e, s).unwrap();
    let (d, d2) = (dev.clone(), dev.clone());
    let waiter = std::thread::spawn(move || d.synchronize_event(e));
    let destroyer = std::thread::spawn(move || d2.destroy_stream(s));
    // Both threads block until the gate opens (polled: no timing assumed).
    let start = std::time::Instant::now();
    while dev.blocked_host_waits() < 2 {
        assert!(start.elapsed() < Duration::from_secs(60), "the two waits were never counted");
        std::thread::yield_now();
    }
    assert!(!dev.query_event(e).unwrap());
    open.send(()).unwrap();
    waiter.join().unwrap().unwrap();
    destroyer.join().unwrap().unwrap();
    assert_eq!(dev.blocked_host_waits(), 0);
    assert!(dev.query_event(e).unwrap());
}

#[test]
fn wait_event_orders_stream_b_after_stream_a() {
    let dev = SimDevice::backed(1 << 20);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 64, a);
    let pattern: Vec<u8> = (1..=64).collect();
    let data = pattern.clone();
    let write = Kernel {
        sleep: Duration::from_millis(200),
        ..Kernel::new("write", vec![acc(p, 64, AccessKind::Write)], move |m| {
            m.write(p, &data).unwrap()
        })
    };
    dev.launch(a, write).unwrap();
    let e = dev.create_event().unwrap();
    dev.record_event(e, a).unwrap();
    dev.wait_event(b, e).unwrap();
    let (read, slot) = reader(p, 64);
    dev.launch(b, read).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(*slot.lock().unwrap(), pattern);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn wait_event_does_not_block_the_host_and_chains() {
    let (dev, p) = device_with_buffer(StreamId::DEFAULT);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let (k, open) = gated_write(p, 32, 9);
    dev.launch(a, k).unwrap();
    let ea = dev.create_event().unwrap();
    dev.record_event(ea, a).unwrap();
    dev.wait_event(b, ea).unwrap(); // returns although A is blocked
    let eb = dev.create_event().unwrap();
    dev.record_event(eb, b).unwrap();
    assert!(!dev.query_event(eb).unwrap(), "B's marker sits behind the wait");
    open.send(()).unwrap();
    dev.synchronize_event(eb).unwrap();
    assert!(dev.query_event(ea).unwrap());
}

/// Stream A writes the buffer (unfinished, gated), frees it; the allocator hands it to B.
#[test]
fn sanitizer_handout_to_unordered_stream_is_one_violation() {
    let dev = SimDevice::backed(1 << 20);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 1024, a);
    let (k, open) = gated_write(p, 1024, 1);
    dev.launch(a, k).unwrap();
    dev.note_reclaim(p, 1024, a);
    dev.note_handout(p, 1024, b);
    let v = dev.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].ptr, p);
    assert_eq!(v[0].bytes, 1024);
    assert_eq!(v[0].stream, b);
    assert_eq!(v[0].other, Some(a));
    assert_eq!(v[0].op, "handout");
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations().len(), 1);
}

#[test]
fn sanitizer_handout_reports_only_the_overlap() {
    let dev = SimDevice::backed(1 << 20);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 1024, a);
    let (k, open) = gated_write(p.offset(512), 512, 1);
    dev.launch(a, k).unwrap();
    dev.note_reclaim(p, 1024, a);
    dev.note_handout(p.offset(256), 512, b);
    let v = dev.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!((v[0].ptr, v[0].bytes), (p.offset(512), 256));
    drop(open);
}

#[test]
fn sanitizer_handout_after_wait_on_event_is_clean() {
    let dev = SimDevice::backed(1 << 20);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 1024, a);
    let (k, open) = gated_write(p, 1024, 1);
    dev.launch(a, k).unwrap();
    let e = dev.create_event().unwrap();
    dev.record_event(e, a).unwrap();
    dev.note_reclaim(p, 1024, a);
    dev.wait_event(b, e).unwrap();
    dev.note_handout(p, 1024, b);
    assert!(!dev.query_event(e).unwrap(), "A's write is still unfinished");
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    // B's work on it is ordered after A's write too.
    let (read, slot) = reader(p, 1024);
    dev.launch(b, read).unwrap();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(*slot.lock().unwrap(), vec![1u8; 1024]);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn sanitizer_event_recorded_before_the_kernel_does_not_order() {
    let dev = SimDevice::backed(1 << 20);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 1024, a);
    let e = dev.create_event().unwrap();
    dev.record_event(e, a).unwrap();
    let (k, open) = gated_write(p, 1024, 1);
    dev.launch(a, k).unwrap();
    dev.wait_event(b, e).unwrap();
    dev.note_reclaim(p, 1024, a);
    dev.note_handout(p, 1024, b);
    assert_eq!(dev.violations().len(), 1);
    drop(open);
}

#[test]
fn sanitizer_order_is_transitive_through_a_third_stream() {
    let dev = SimDevice::backed(1 << 20);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let c = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 1024, a);
    let (k, open) = gated_write(p, 1024, 1);
    dev.launch(a, k).unwrap();
    let ea = dev.create_event().unwrap();
    dev.record_event(ea, a).unwrap();
    dev.wait_event(c, ea).unwrap();
    let ec = dev.create_event().unwrap();
    dev.record_event(ec, c).unwrap();
    dev.wait_event(b, ec).unwrap();
    dev.note_reclaim(p, 1024, a);
    dev.note_handout(p, 1024, b);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    drop(open);
}

#[test]
fn sanitizer_handout_after_synchronize_is_clean() {
    let dev = SimDevice::backed(1 << 20);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 1024, a);
    let write = Kernel {
        sleep: Duration::from_millis(200),
        ..Kernel::new("write", vec![acc(p, 1024, AccessKind::Write)], move |m| {
            m.write(p, &[5; 1024]).unwrap()
        })
    };
    dev.launch(a, write).unwrap();
    dev.note_reclaim(p, 1024, a);
    dev.synchronize().unwrap();
    dev.note_handout(p, 1024, b);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn sanitizer_same_stream_reuse_is_clean() {
    let (dev, p) = device_with_buffer(StreamId::DEFAULT);
    let (k, open) = gated_write(p, 1024, 1);
    dev.launch(StreamId::DEFAULT, k).unwrap();
    dev.note_reclaim(p, 4096, StreamId::DEFAULT);
    dev.note_handout(p, 4096, StreamId::DEFAULT);
    let (k2, open2) = gated_write(p, 1024, 2);
    dev.launch(StreamId::DEFAULT, k2).unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    drop((open, open2));
}

#[test]
fn sanitizer_kernel_on_b_touching_a_in_flight_range() {
    let dev = SimDevice::backed(1 << 20);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 4096, a);
    let (k, open) = gated_write(p, 1024, 1);
    dev.launch(a, k).unwrap();
    let (read, _slot) = reader(p.offset(1000), 100);
    dev.launch(b, read).unwrap();
    let v = dev.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!((v[0].ptr, v[0].bytes), (p.offset(1000), 24));
    assert_eq!((v[0].stream, v[0].other), (b, Some(a)));
    assert_eq!(v[0].op, "kernel reader");
    drop(open);
}

#[test]
fn sanitizer_read_read_overlap_is_clean() {
    let (dev, p) = device_with_buffer(StreamId::DEFAULT);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let (open, gate) = mpsc::channel::<()>();
    let slow_read = Kernel::new("slow_read", vec![acc(p, 512, AccessKind::Read)], move |m| {
        let _ = gate.recv();
        m.read(p, &mut [0u8; 512]).unwrap();
    });
    dev.launch(a, slow_read).unwrap();
    let (read, _slot) = reader(p, 512);
    dev.launch(b, read).unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    // A write on a third stream over the pending reads is not.
    let (w, open2) = gated_write(p, 8, 3);
    dev.launch(StreamId::DEFAULT, w).unwrap();
    let v = dev.violations();
    assert!(!v.is_empty());
    assert!(v.iter().all(|v| v.stream == StreamId::DEFAULT && v.op == "kernel gated_write"));
    assert!(v.iter().any(|v| v.other == Some(a)));
    drop((open, open2));
}

#[test]
fn sanitizer_use_after_free_and_unallocated_memory() {
    let (dev, p) = device_with_buffer(StreamId::DEFAULT);
    let s = StreamId::DEFAULT;
    // Work enqueued before the reclaim is legal (stream-ordered free).
    let (k, open) = gated_write(p, 64, 1);
    dev.launch(s, k).unwrap();
    dev.note_reclaim(p, 4096, s);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    // A launch after the reclaim is a use after free.
    let (read, _slot) = reader(p.offset(8), 8);
    dev.launch(s, read).unwrap();
    let v = dev.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!((v[0].ptr, v[0].bytes, v[0].stream, v[0].other), (p.offset(8), 8, s, None));
    assert_eq!(v[0].op, "kernel reader touches unallocated memory");
    // Memory of a live segment that was never handed out.
    let q = dev.reserve(512).unwrap();
    let (read, _slot) = reader(q, 16);
    dev.launch(s, read).unwrap();
    assert_eq!(dev.violations().len(), 2);
    assert_eq!(dev.violations()[1].ptr, q);
    open.send(()).unwrap();
    dev.synchronize().unwrap();
}

#[test]
fn kernel_outside_any_segment_is_reported_and_gets_bad_access() {
    let dev = SimDevice::backed(1 << 20);
    let wild = DeviceAddr(0x1000);
    let result = Arc::new(Mutex::new(None));
    let out = Arc::clone(&result);
    let k = Kernel::new("wild", vec![acc(wild, 8, AccessKind::Write)], move |m| {
        *out.lock().unwrap() = Some(m.write(wild, &[0; 8]));
    });
    dev.launch(StreamId::DEFAULT, k).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(*result.lock().unwrap(), Some(Err(DeviceError::BadAccess { ptr: wild, bytes: 8 })));
    let v = dev.violations();
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].op, "kernel wild touches unallocated memory");
}

#[test]
fn undeclared_access_gets_bad_access() {
    let (dev, p) = device_with_buffer(StreamId::DEFAULT);
    let result = Arc::new(Mutex::new(Vec::new()));
    let out = Arc::clone(&result);
    let k = Kernel::new("sneaky", vec![acc(p, 8, AccessKind::Read)], move |m| {
        let mut r = out.lock().unwrap();
        r.push(m.write(p, &[1; 8])); // declared read only
        r.push(m.read(p.offset(4), &mut [0; 8])); // past the declared range
        r.push(m.read(p, &mut [0; 8]));
    });
    dev.launch(StreamId::DEFAULT, k).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(
        *result.lock().unwrap(),
        vec![
            Err(DeviceError::BadAccess { ptr: p, bytes: 8 }),
            Err(DeviceError::BadAccess { ptr: p.offset(4), bytes: 8 }),
            Ok(())
        ]
    );
}

#[test]
fn panic_on_violation_panics_at_the_call() {
    let dev = SimDevice::backed(1 << 20);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p, 1024, a);
    let (k, open) = gated_write(p, 1024, 1);
    dev.launch(a, k).unwrap();
    dev.note_reclaim(p, 1024, a);
    dev.panic_on_violation(true);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        dev.note_handout(p, 1024, b);
    }));
    assert!(r.is_err());
    assert_eq!(dev.violations().len(), 1);
    // The device still works after the panic.
    open.send(()).unwrap();
    dev.synchronize().unwrap();
}

#[test]
fn sanitizer_can_be_switched_off() {
    let dev = SimDevice::with_config(tidepool::device::SimConfig {
        capacity: 1 << 20,
        backed: true,
        sanitize: false,
    });
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    let (k, open) = gated_write(p, 1024, 1);
    dev.launch(a, k).unwrap();
    dev.note_handout(p, 1024, b);
    let (read, _slot) = reader(p, 8);
    dev.launch(b, read).unwrap();
    assert!(dev.violations().is_empty());
    drop(open);
}

#[test]
fn destroy_stream_drains_its_work() {
    let (dev, p) = device_with_buffer(StreamId::DEFAULT);
    let s = dev.create_stream().unwrap();
    assert_eq!(dev.live_streams(), vec![StreamId::DEFAULT, s]);
    let done = Arc::new(Mutex::new(false));
    let flag = Arc::clone(&done);
    let k = Kernel {
        sleep: Duration::from_millis(200),
        ..Kernel::new("write", vec![acc(p, 4, AccessKind::Write)], move |m| {
            m.write(p, &[4, 3, 2, 1]).unwrap();
            *flag.lock().unwrap() = true;
        })
    };
    dev.launch(s, k).unwrap();
    let e = dev.create_event().unwrap();
    dev.record_event(e, s).unwrap();
    dev.destroy_stream(s).unwrap();
    assert!(*done.lock().unwrap());
    assert!(dev.query_event(e).unwrap(), "events of a destroyed stream are complete");
    assert_eq!(dev.live_streams(), vec![StreamId::DEFAULT]);
    let (read, slot) = reader(p, 4);
    dev.launch(StreamId::DEFAULT, read).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(*slot.lock().unwrap(), vec![4, 3, 2, 1]);
    // The stream is gone.
    assert_eq!(dev.launch(s, Kernel::sleep(Duration::ZERO)), Err(DeviceError::UnknownStream(s)));
    assert_eq!(dev.destroy_stream(s), Err(DeviceError::UnknownStream(s)));
}

#[test]
fn waits_on_a_destroyed_stream_are_satisfied() {
    let (dev, p) = device_with_buffer(StreamId::DEFAULT);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let (k, open) = gated_write(p, 8, 6);
    dev.launch(a, k).unwrap();
    let e = dev.create_event().unwrap();
    dev.record_event(e, a).unwrap();
    dev.wait_event(b, e).unwrap();
    let (read, slot) = reader(p, 8);
    dev.launch(b, read).unwrap();
    open.send(()).unwrap();
    dev.destroy_stream(a).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(*slot.lock().unwrap(), vec![6; 8]);
}

#[test]
fn unknown_ids_and_the_default_stream() {
    let dev = SimDevice::new(1 << 20);
    let ghost = StreamId(99);
    let nope = EventId(1234);
    let e = dev.create_event().unwrap();
    assert_eq!(
        dev.destroy_stream(StreamId::DEFAULT),
        Err(DeviceError::Unsupported("destroying the default stream"))
    );
    assert_eq!(dev.destroy_stream(ghost), Err(DeviceError::UnknownStream(ghost)));
    assert_eq!(
        dev.launch(ghost, Kernel::sleep(Duration::ZERO)),
        Err(DeviceError::UnknownStream(ghost))
    );
    assert_eq!(dev.record_event(e, ghost), Err(DeviceError::UnknownStream(ghost)));
    assert_eq!(dev.wait_event(ghost, e), Err(DeviceError::UnknownStream(ghost)));
    assert_eq!(dev.record_event(nope, StreamId::DEFAULT), Err(DeviceError::UnknownEvent(nope)));
    assert_eq!(dev.query_event(nope), Err(DeviceError::UnknownEvent(nope)));
    assert_eq!(dev.wait_event(StreamId::DEFAULT, nope), Err(DeviceError::UnknownEvent(nope)));
    assert_eq!(dev.synchronize_event(nope), Err(DeviceError::UnknownEvent(nope)));
    assert_eq!(dev.destroy_event(nope), Err(DeviceError::UnknownEvent(nope)));
    dev.destroy_event(e).unwrap();
    assert_eq!(dev.query_event(e), Err(DeviceError::UnknownEvent(e)));
    assert_eq!(
        dev.release(DeviceAddr(0x1234)),
        Err(DeviceError::UnknownSegment(DeviceAddr(0x1234)))
    );
    // Nothing above was counted.
    assert_eq!(dev.counters(), SimCounters::default());
    // The default stream still works.
    dev.launch(StreamId::DEFAULT, Kernel::sleep(Duration::ZERO)).unwrap();
    dev.synchronize().unwrap();
}

#[test]
fn counters_are_exact_after_a_fixed_sequence() {
    let dev = SimDevice::new(1 << 20);
    let s = dev.create_stream().unwrap();
    let e = dev.create_event().unwrap();
    let p = dev.reserve(1000).unwrap();
    let q = dev.reserve(2000).unwrap();
    assert!(dev.reserve(1 << 21).is_err());
    dev.launch(s, Kernel::sleep(Duration::from_millis(1))).unwrap();
    dev.launch(StreamId::DEFAULT, Kernel::sleep(Duration::ZERO)).unwrap();
    dev.record_event(e, s).unwrap();
    dev.query_event(e).unwrap();
    dev.wait_event(StreamId::DEFAULT, e).unwrap();
    dev.synchronize_event(e).unwrap();
    dev.query_event(e).unwrap();
    dev.record_event(e, StreamId::DEFAULT).unwrap();
    dev.synchronize().unwrap();
    dev.release(p).unwrap();
    dev.release(q).unwrap();
    assert_eq!(
        dev.counters(),
        SimCounters {
            mallocs: 2,
            failed_mallocs: 1,
            frees: 2,
            host_syncs: 4,
            event_records: 2,
            event_queries: 2,
            event_waits: 1,
            launches: 2,
        }
    );
    assert!(dev.live_segments().is_empty());
    assert_eq!(dev.reserved_bytes(), 0);
}

#[test]
fn release_synchronises_the_device() {
    let dev = SimDevice::backed(1 << 20);
    let s = dev.create_stream().unwrap();
    let p = dev.reserve(4096).unwrap();
    let q = dev.reserve(4096).unwrap();
    dev.note_handout(q, 8, s);
    let done = Arc::new(Mutex::new(false));
    let flag = Arc::clone(&done);
    let k = Kernel {
        sleep: Duration::from_millis(200),
        ..Kernel::new("write", vec![acc(q, 8, AccessKind::Write)], move |m| {
            m.write(q, &[1; 8]).unwrap();
            *flag.lock().unwrap() = true;
        })
    };
    dev.launch(s, k).unwrap();
    dev.release(p).unwrap();
    assert!(*done.lock().unwrap(), "cuMemFree waited for the device");
    assert_eq!(dev.counters().host_syncs, 1);
    assert_eq!(dev.live_segments(), vec![(q, 4096)]);
}

#[test]
fn fault_injection_still_works() {
    let dev = SimDevice::new(1 << 20);
    dev.fail_nth_malloc(Some(2));
    assert!(dev.reserve(512).is_ok());
    assert_eq!(
        dev.reserve(512),
        Err(DeviceError::Driver { op: "reserve", code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY })
    );
    assert!(dev.reserve(512).is_ok());
    dev.fail_mallocs_above(Some(4096));
    assert_eq!(
        dev.reserve(4097),
        Err(DeviceError::Driver { op: "reserve", code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY })
    );
    assert!(dev.reserve(4096).is_ok());
    dev.fail_mallocs_above(None);
    assert_eq!(dev.reserve(1 << 21), Err(DeviceError::OutOfMemory { requested: 1 << 21 }));
    let e = dev.create_event().unwrap();
    dev.fail_event_queries(true);
    assert_eq!(
        dev.query_event(e),
        Err(DeviceError::Driver { op: "query_event", code: DeviceError::CUDA_ERROR_UNKNOWN })
    );
    dev.fail_event_queries(false);
    assert_eq!(dev.query_event(e), Ok(true));
    let c = dev.counters();
    assert_eq!((c.mallocs, c.failed_mallocs, c.event_queries), (3, 3, 2));
    assert_eq!(dev.reserved_bytes(), 512 + 512 + 4096);
    assert_eq!(dev.mem_info().unwrap().free, (1 << 20) - 5120);
}

#[test]
fn a_panicking_kernel_is_recorded_and_later_work_runs() {
    let dev = SimDevice::backed(1 << 20);
    let s = dev.create_stream().unwrap();
    dev.launch(s, Kernel::new("boom", Vec::new(), |_| panic!("boom!"))).unwrap();
    let ran = Arc::new(Mutex::new(false));
    let flag = Arc::clone(&ran);
    dev.launch(s, Kernel::new("after", Vec::new(), move |_| *flag.lock().unwrap() = true)).unwrap();
    dev.synchronize().unwrap();
    assert!(*ran.lock().unwrap());
    assert_eq!(
        dev.kernel_failures(),
        vec![KernelFailure { stream: s, kernel: "boom", message: "boom!".to_string() }]
    );
    // Formatted panic messages are kept too.
    let n = 7;
    dev.launch(s, Kernel::new("boom2", Vec::new(), move |_| panic!("boom {n}"))).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.kernel_failures()[1].message, "boom 7");
}

#[test]
fn dropping_a_device_with_busy_streams_drains_and_joins() {
    let log = Arc::new(Mutex::new(Vec::new()));
    {
        let dev = SimDevice::backed(1 << 20);
        let p = dev.reserve(4096).unwrap();
        dev.note_handout(p, 4096, StreamId::DEFAULT);
        let mut streams = vec![StreamId::DEFAULT];
        for _ in 0..3 {
            streams.push(dev.create_stream().unwrap());
        }
        for (i, &s) in streams.iter().enumerate() {
            for j in 0..3 {
                let log = Arc::clone(&log);
                let k = Kernel {
                    sleep: Duration::from_millis(30),
                    ..Kernel::new("log", Vec::new(), move |_| log.lock().unwrap().push((i, j)))
                };
                dev.launch(s, k).unwrap();
            }
        }
        // A stream blocked on a gate that opens only when the test's sender drops (before dev).
        let (k, _open) = gated_write(p, 8, 1);
        dev.launch(streams[1], k).unwrap();
    }
    let mut log = log.lock().unwrap().clone();
    assert_eq!(log.len(), 12);
    log.sort();
    assert_eq!(log, (0..4).flat_map(|i| (0..3).map(move |j| (i, j))).collect::<Vec<_>>());
}

#[test]
fn many_handouts_and_reclaims_without_kernels() {
    // The trace replayer's pattern: an unbacked device, no kernels, lots of hooks.
    let dev = SimDevice::new(1 << 30);
    let p = dev.reserve(1 << 20).unwrap();
    let streams = [StreamId::DEFAULT, dev.create_stream().unwrap()];
    for i in 0..100_000u64 {
        let off = (i * 4096) % (1 << 20);
        let s = streams[(i % 2) as usize];
        dev.note_handout(p.offset(off), 4096, s);
        dev.note_reclaim(p.offset(off), 4096, s);
    }
    assert!(dev.violations().is_empty());
    dev.release(p).unwrap();
}

#[test]
fn injected_event_faults_panic_when_asked_and_the_device_works_on() {
    let dev = SimDevice::new(1 << 20);
    let e = dev.create_event().unwrap();
    dev.fail_event_records(true);
    assert!(matches!(
        dev.record_event(e, StreamId::DEFAULT),
        Err(DeviceError::Driver { op: "record_event", .. })
    ));
    dev.panic_on_faults(true);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        dev.record_event(e, StreamId::DEFAULT)
    }));
    assert!(r.is_err(), "the fault panicked");
    dev.fail_event_records(false);
    dev.panic_on_faults(false);
    dev.record_event(e, StreamId::DEFAULT).unwrap();
    dev.synchronize_event(e).unwrap();
    assert!(dev.query_event(e).unwrap());
    dev.destroy_event(e).unwrap();
}

/// Injected refusals of `create_event` and `vm_unmap`: the `n`th call from now fails with the
/// driver's error and changes nothing (the unmap's mapping stays, to be unmapped later); the
/// calls around it succeed.
#[test]
fn the_nth_event_creation_and_unmap_can_be_refused() {
    use tidepool::DeviceError;
    let dev = SimDevice::new(64 << 20);
    dev.fail_nth_event_create(Some(2));
    let e1 = dev.create_event().unwrap();
    let refused = DeviceError::Driver { op: "cuEventCreate", code: 2 };
    assert_eq!(dev.create_event(), Err(refused));
    let e3 = dev.create_event().unwrap();
    assert_ne!(e1, e3);
    let base = dev.vm_reserve(8 << 20).unwrap();
    let h = dev.vm_create(2 << 20).unwrap();
    dev.vm_map(base, 2 << 20, h).unwrap();
    dev.fail_nth_vm_unmap(Some(1));
    let refused = DeviceError::Driver { op: "cuMemUnmap", code: DeviceError::CUDA_ERROR_UNKNOWN };
    assert_eq!(dev.vm_unmap(base, 2 << 20), Err(refused));
    assert_eq!(dev.live_mappings(), vec![(base, 2 << 20)]);
    let unmaps = dev.vm_counters().unmaps;
    dev.vm_unmap(base, 2 << 20).unwrap();
    assert_eq!(dev.vm_counters().unmaps, unmaps + 1);
    dev.vm_release(h).unwrap();
    dev.vm_free(base, 8 << 20).unwrap();
    assert_eq!((dev.live_physical(), dev.virtual_bytes()), (0, 0));
}

/// A mapping asked for at an address whose end is past the address space (a bogus address
/// from a caller of the `Device` trait) is `cuMemMap`'s invalid-value error, as any address
/// outside a reservation: the end was computed unchecked, a panic in debug builds. Nothing is
/// mapped, and the handle maps where it belongs afterwards.
#[test]
fn a_mapping_whose_end_overflows_is_an_error() {
    let dev = SimDevice::backed(64 << 20);
    let page = dev.vm_granularity().unwrap();
    let base = dev.vm_reserve(4 * page).unwrap();
    let h = dev.vm_create(page).unwrap();
    let invalid = DeviceError::Driver { op: "cuMemMap", code: 1 };
    for va in [u64::MAX - (page - 1), u64::MAX - (2 * page - 1)] {
        assert_eq!(dev.vm_map(DeviceAddr(va), page, h), Err(invalid.clone()), "{va:#x}");
    }
    assert_eq!(dev.vm_counters().maps, 0);
    dev.vm_map(base, page, h).unwrap();
    dev.vm_unmap(base, page).unwrap();
    dev.vm_release(h).unwrap();
    dev.vm_free(base, 4 * page).unwrap();
    assert_eq!((dev.live_physical(), dev.virtual_bytes()), (0, 0));
}

/// A stream whose worker thread the system refuses (a replayed trace with tens of thousands of
/// streams reaches the thread limit) is `cuStreamCreate`'s out-of-memory error, not a panic:
/// the stream is not made (its id is unknown), and the streams made before and after work.
/// Injected with `fail_nth_stream_create`, for `create_stream` and `create_app_stream` alike.
#[test]
fn a_refused_stream_thread_is_an_error_and_the_device_works_on() {
    let dev = SimDevice::backed(1 << 20);
    let refused = Err(DeviceError::Driver {
        op: "cuStreamCreate",
        code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
    });
    dev.fail_nth_stream_create(Some(2));
    let a = dev.create_stream().unwrap();
    assert_eq!(dev.create_stream(), refused);
    let lost = StreamId(a.0 + 1);
    let k = Kernel::new("noop", Vec::new(), |_| {});
    assert_eq!(dev.launch(lost, k).unwrap_err(), DeviceError::UnknownStream(lost));
    let c = dev.create_stream().unwrap();
    assert_eq!(c, StreamId(a.0 + 2));
    dev.fail_nth_stream_create(Some(1));
    assert_eq!(dev.create_app_stream().map(|s| s.id()), refused);
    let ran = Arc::new(Mutex::new(Vec::new()));
    for s in [StreamId::DEFAULT, a, c] {
        let ran = Arc::clone(&ran);
        dev.launch(s, Kernel::new("log", Vec::new(), move |_| ran.lock().unwrap().push(s)))
            .unwrap();
    }
    dev.synchronize().unwrap();
    assert_eq!(ran.lock().unwrap().len(), 3);
    dev.destroy_stream(a).unwrap();
    dev.destroy_stream(c).unwrap();
    assert!(dev.violations().is_empty());
}

/// A hand-out must lie inside one live segment: memory of a released segment, a range across
/// two segments (adjacent here, as the bump addresses place them, but two `cuMemAlloc`s on a
/// GPU) and a wild address are no block any allocator may give. The sanitizer missed all three
/// unless a kernel later touched them.
#[test]
fn a_handout_outside_one_live_segment_is_reported() {
    let dev = SimDevice::new(1 << 20);
    let s = StreamId::DEFAULT;
    let gone = dev.reserve(4096).unwrap();
    dev.release(gone).unwrap();
    let q = dev.reserve(4096).unwrap();
    let r = dev.reserve(4096).unwrap();
    assert_eq!(r, q.offset(4096), "segments placed side by side");
    // Clean: a whole segment, and a segment's last byte.
    dev.note_handout(r, 4096, s);
    dev.note_handout(q.offset(4095), 1, s);
    assert_eq!(dev.violations(), vec![]);
    dev.note_reclaim(r, 4096, s);
    dev.note_reclaim(q.offset(4095), 1, s);
    dev.note_handout(gone, 4096, s);
    dev.note_handout(q.offset(2048), 4096, s);
    dev.note_handout(DeviceAddr(0x1000), 8, s);
    let op = "handout of memory outside any live segment";
    let v = |ptr: DeviceAddr, bytes: u64| tidepool::device::Violation {
        ptr,
        bytes,
        stream: s,
        other: None,
        op: op.into(),
    };
    assert_eq!(
        dev.violations(),
        vec![v(gone, 4096), v(q.offset(2048), 4096), v(DeviceAddr(0x1000), 8)]
    );
}

/// `cuMemFree` of a segment with memory still handed out leaves a live buffer over freed
/// memory; the sanitizer forgot the hand-outs without a word (an unmap under a hand-out was
/// reported, a release was not).
#[test]
fn releasing_a_segment_under_a_live_handout_is_reported() {
    let dev = SimDevice::new(1 << 20);
    let s = dev.create_stream().unwrap();
    // Clean: everything handed out was taken back first.
    let q = dev.reserve(4096).unwrap();
    dev.note_handout(q, 4096, s);
    dev.note_reclaim(q, 4096, s);
    dev.release(q).unwrap();
    assert_eq!(dev.violations(), vec![]);
    // Two blocks still out: one report, from the first byte out to the last.
    let p = dev.reserve(4096).unwrap();
    dev.note_handout(p.offset(512), 1024, s);
    dev.note_handout(p.offset(2048), 512, StreamId::DEFAULT);
    dev.release(p).unwrap();
    let v = tidepool::device::Violation {
        ptr: p.offset(512),
        bytes: 2048,
        stream: s,
        other: None,
        op: "release of memory handed out".into(),
    };
    assert_eq!(dev.violations(), vec![v]);
    assert_eq!(dev.live_segments(), vec![]);
}

/// A pinned copy is checked as any kernel: into mapped pages of a virtual range (an expandable
/// segment's) it is clean, and through a second mapping of physical pages that another stream's
/// unfinished kernel writes at the first it is a race. The copy was checked against live
/// segments only: the first was reported as touching unallocated memory and the second was
/// not reported at all.
#[test]
fn a_pinned_copy_into_mapped_pages_is_checked_as_a_kernel() {
    let dev = SimDevice::backed(64 << 20);
    let g = tidepool::device::SIM_VM_GRANULARITY;
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let va = dev.vm_reserve(2 * g).unwrap();
    let h = dev.vm_create(g).unwrap();
    dev.vm_map(va, g, h).unwrap();
    let host = dev.host_alloc(4096).unwrap();
    // Clean: an upload and a download of a block in a mapped page, in stream order.
    dev.note_handout(va, 4096, a);
    // SAFETY: `host` is live pinned memory of this device, no other reference touches it, and
    // the copies are waited for (the synchronisation below) before it is freed.
    unsafe {
        dev.memcpy_htod_async(va, host, 4096, a).unwrap();
        dev.memcpy_dtoh_async(host, va, 4096, a).unwrap();
    }
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
    // A's unfinished write at `va`; the page mapped again at `vb` and a block there handed to B.
    let (k, open) = gated_write(va, 4096, 1);
    dev.launch(a, k).unwrap();
    dev.note_reclaim(va, 4096, a);
    let vb = va.offset(g);
    dev.vm_map(vb, g, h).unwrap();
    dev.note_handout(vb, 4096, b);
    // SAFETY: as above.
    unsafe { dev.memcpy_htod_async(vb, host, 4096, b).unwrap() };
    let v = |op: &str| tidepool::device::Violation {
        ptr: va,
        bytes: 4096,
        stream: b,
        other: Some(a),
        op: op.into(),
    };
    assert_eq!(
        dev.violations(),
        vec![
            v("handout of physical memory also mapped elsewhere"),
            v("kernel copy_htod (physical memory also mapped elsewhere)"),
        ]
    );
    drop(open);
    dev.synchronize().unwrap();
    // SAFETY: every copy has run (synchronised); nothing refers to `host` any more.
    unsafe { dev.host_free(host).unwrap() };
}

/// CUDA's event rules, as the sanitizer sees them: a wait orders after the record the event had
/// when the wait was made (`cuStreamWaitEvent`), not after a later re-record, nor after a record
/// made after the wait; an event never recorded is complete (`cuEventQuery` answers success) and
/// a wait on it orders nothing. Each unordered hand-out is reported once, exactly.
#[test]
fn waits_order_after_the_record_the_event_had_when_they_were_made() {
    let dev = SimDevice::backed(1 << 20);
    let (a, b, c) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let p = dev.reserve(4096).unwrap();
    let (x, y) = (p, p.offset(1024));
    dev.note_handout(p, 2048, a);
    let e = dev.create_event().unwrap();
    assert!(dev.query_event(e).unwrap(), "never recorded: complete");
    dev.wait_event(c, e).unwrap(); // orders nothing
    let (k1, open1) = gated_write(x, 1024, 1);
    dev.launch(a, k1).unwrap();
    dev.record_event(e, a).unwrap(); // after k1
    dev.wait_event(b, e).unwrap(); // b after k1
    let (k2, open2) = gated_write(y, 1024, 2);
    dev.launch(a, k2).unwrap();
    dev.record_event(e, a).unwrap(); // re-recorded after k2: b's wait is unchanged
    dev.note_reclaim(p, 2048, a);
    dev.note_handout(x, 1024, b); // clean: b waited for k1
    dev.note_handout(y, 1024, b); // k2 unordered
    dev.note_handout(DeviceAddr(p.0 + 2048), 1024, c); // nothing pending there: clean
    let v = tidepool::device::Violation {
        ptr: y,
        bytes: 1024,
        stream: b,
        other: Some(a),
        op: "handout".into(),
    };
    assert_eq!(dev.violations(), vec![v.clone()]);
    // C waited before any record: not ordered after k1.
    dev.note_reclaim(x, 1024, b);
    dev.note_handout(x, 1024, c);
    let w = tidepool::device::Violation { ptr: x, stream: c, ..v.clone() };
    assert_eq!(dev.violations(), vec![v.clone(), w.clone()]);
    assert!(!dev.query_event(e).unwrap());
    drop((open1, open2));
    dev.synchronize_event(e).unwrap();
    // Everything finished: a hand-out anywhere is clean now.
    dev.note_reclaim(y, 1024, b);
    dev.note_handout(y, 1024, c);
    assert_eq!(dev.violations(), vec![v, w]);
}
