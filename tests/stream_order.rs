//! Stream-ordered frees on the asynchronous SimDevice, checked by its stream-order sanitizer.
//!
//! Unfinished work is made with gates (a kernel blocks until the test opens it), so nothing here
//! depends on timing; the one sleep kernel is only setup for a host synchronisation.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tidepool::MIB;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SIM_BASE, SimDevice};
use tidepool::{AllocError, Allocator, Config, Device, DeviceAddr, Residency, StreamId};

mod common;
use common::{N, gated_write};

fn setup(
    config: &str,
    capacity: u64,
) -> (Arc<SimDevice>, Allocator<SimDevice>, StreamId, StreamId) {
    let dev = Arc::new(SimDevice::backed(capacity));
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    (dev, alloc, a, b)
}

fn write(ptr: DeviceAddr, byte: u8) -> Kernel {
    Kernel::new("write", vec![Access { ptr, bytes: N, kind: AccessKind::Write }], move |m| {
        m.write(ptr, &[byte; N as usize]).unwrap();
    })
}

/// A kernel reading `[ptr, ptr + N)` into the returned slot, after an optional gate.
fn read(ptr: DeviceAddr, gate: Option<mpsc::Receiver<()>>) -> (Kernel, Arc<Mutex<Vec<u8>>>) {
    let slot = Arc::new(Mutex::new(Vec::new()));
    let out = slot.clone();
    let k = Kernel::new("read", vec![Access { ptr, bytes: N, kind: AccessKind::Read }], move |m| {
        if let Some(g) = gate {
            let _ = g.recv();
        }
        let mut v = vec![0u8; N as usize];
        m.read(ptr, &mut v).unwrap();
        *out.lock().unwrap() = v;
    });
    (k, slot)
}

/// The classic: a buffer written on A (still running) is used on B, freed, and B allocates.
/// Returns (address B got, address A's buffer had, bytes A read back).
fn classic(broken: bool) -> (Arc<SimDevice>, DeviceAddr, DeviceAddr, Vec<u8>) {
    let (dev, alloc, a, b) = setup("", 64 * MIB);
    alloc.set_broken_skip_events(broken);
    let buf = alloc.alloc(N, a).unwrap();
    let p = buf.ptr();
    let (k, open) = gated_write(p, 0xAB);
    dev.launch(a, k).unwrap();
    let (k, got_a) = read(p, None);
    dev.launch(a, k).unwrap();
    alloc.record_stream(&buf, b).unwrap();
    drop(buf);
    let buf_b = alloc.alloc(N, b).unwrap();
    dev.launch(b, write(buf_b.ptr(), 0xCD)).unwrap();
    let q = buf_b.ptr();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    let bytes = got_a.lock().unwrap().clone();
    drop(buf_b);
    alloc.check_invariants().unwrap();
    (dev, q, p, bytes)
}

#[test]
fn strict_never_hands_unfinished_memory_to_another_stream() {
    let (dev, q, p, bytes) = classic(false);
    assert_eq!(p, DeviceAddr(SIM_BASE));
    assert_eq!(q, DeviceAddr(SIM_BASE + 2 * MIB), "B gets fresh memory while A still runs");
    assert_eq!(bytes, vec![0xAB; N as usize], "A's bytes are intact");
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn the_sanitizer_catches_the_deliberately_broken_mode() {
    let (dev, q, p, _) = classic(true);
    assert_eq!(q, p, "the broken allocator hands A's busy block to B");
    let v = dev.violations();
    assert!(!v.is_empty());
    assert_eq!((v[0].ptr, v[0].op.as_str()), (p, "handout"));
    assert_eq!(v[0].other, Some(StreamId(1)));
    assert_eq!(v[0].stream, StreamId(2));
}

/// A buffer of A is read on B (which waited for A); `record_stream(B)` must hold it until B's
/// read completed. Returns (address A got next, old address, violations).
fn used_on_other_stream(broken: bool) -> (DeviceAddr, DeviceAddr, usize, u64) {
    let (dev, alloc, a, b) = setup("", 64 * MIB);
    alloc.set_broken_skip_events(broken);
    let buf = alloc.alloc(N, a).unwrap();
    let p = buf.ptr();
    dev.launch(a, write(p, 0x11)).unwrap();
    let e = dev.create_event().unwrap();
    dev.record_event(e, a).unwrap();
    dev.wait_event(b, e).unwrap();
    let (open, gate) = mpsc::channel();
    let (k, got_b) = read(p, Some(gate));
    dev.launch(b, k).unwrap();
    alloc.record_stream(&buf, b).unwrap();
    drop(buf);
    let next = alloc.alloc(N, a).unwrap();
    let q = next.ptr();
    dev.launch(a, write(q, 0x22)).unwrap();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    if !broken {
        assert_eq!(
            *got_b.lock().unwrap(),
            vec![0x11; N as usize],
            "B read A's bytes, not the new owner's"
        );
    }
    let records = dev.counters().event_records;
    drop(next);
    (q, p, dev.violations().len(), records)
}

#[test]
fn record_stream_holds_the_block_until_the_other_stream_is_done() {
    let (q, p, violations, records) = used_on_other_stream(false);
    assert_eq!(q, p.offset(N), "the held block is skipped, its neighbour is used");
    assert_eq!(violations, 0);
    assert_eq!(records, 2, "the test's own event and one for the use on B");
    let (q, p, violations, _) = used_on_other_stream(true);
    assert_eq!(q, p, "without events the block is reused at once");
    assert!(violations > 0, "and the sanitizer sees it");
}

#[test]
fn wait_event_reuses_across_streams_without_a_host_sync() {
    let (dev, alloc, a, b) = setup("cross_stream:wait_event", 64 * MIB);
    let buf = alloc.alloc(N, a).unwrap();
    let p = buf.ptr();
    let (k, open) = gated_write(p, 0xAB);
    dev.launch(a, k).unwrap();
    drop(buf);
    let before = (alloc.stats().num_host_syncs, dev.counters().host_syncs, dev.counters().mallocs);
    let buf_b = alloc.alloc(N, b).unwrap();
    assert_eq!(buf_b.ptr(), p, "B takes A's free segment at once");
    dev.launch(b, write(p, 0xCD)).unwrap();
    assert_eq!(
        (alloc.stats().num_host_syncs, dev.counters().host_syncs, dev.counters().mallocs),
        before
    );
    assert_eq!(dev.counters().event_waits, 1);
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    let (k, got) = read(p, None);
    dev.launch(b, k).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(*got.lock().unwrap(), vec![0xCD; N as usize], "B's write came after A's");
    assert_eq!(dev.violations(), vec![]);
    drop(buf_b);
    alloc.check_invariants().unwrap();
}

#[test]
fn strict_reuses_across_streams_once_the_owner_is_idle() {
    let (dev, alloc, a, b) = setup("", 64 * MIB);
    let buf = alloc.alloc(N, a).unwrap();
    let p = buf.ptr();
    dev.launch(a, write(p, 1)).unwrap();
    drop(buf);
    dev.synchronize().unwrap();
    let buf_b = alloc.alloc(N, b).unwrap();
    assert_eq!(buf_b.ptr(), p);
    assert_eq!(dev.counters().mallocs, 1);
    assert_eq!(alloc.stats().num_host_syncs, 0);
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn same_stream_hot_loop_with_work_in_flight_records_no_event() {
    let (dev, alloc, a, _) = setup("", 64 * MIB);
    let buf = alloc.alloc(N, a).unwrap();
    let p = buf.ptr();
    let (k, open) = gated_write(p, 7);
    dev.launch(a, k).unwrap();
    drop(buf);
    let before = dev.counters();
    for i in 0..200u8 {
        let b = alloc.alloc(N, a).unwrap();
        assert_eq!(b.ptr(), p);
        dev.launch(a, write(p, i)).unwrap();
    }
    let after = dev.counters();
    assert_eq!(
        (after.event_records, after.host_syncs, after.mallocs),
        (before.event_records, before.host_syncs, before.mallocs)
    );
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(alloc.stats().num_host_syncs, 0);
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn out_of_memory_waits_for_events_and_searches_again() {
    // Room for exactly one small segment.
    let (dev, alloc, a, b) = setup("", 2 * MIB);
    let x = alloc.alloc(MIB, a).unwrap();
    let y = alloc.alloc(MIB, a).unwrap();
    let e = dev.create_event().unwrap();
    dev.record_event(e, a).unwrap();
    dev.wait_event(b, e).unwrap();
    // A read on B that takes a while: x stays pending after its free.
    let k = Kernel {
        sleep: Duration::from_millis(100),
        ..Kernel::new(
            "slow_read",
            vec![Access { ptr: x.ptr(), bytes: MIB, kind: AccessKind::Read }],
            |_| {},
        )
    };
    dev.launch(b, k).unwrap();
    alloc.record_stream(&x, b).unwrap();
    let px = x.ptr();
    drop(x);
    let z = alloc.alloc(MIB, a).unwrap();
    assert_eq!(z.ptr(), px, "found again after waiting for B's event");
    let s = alloc.stats();
    assert_eq!(
        (s.num_alloc_retries, s.num_ooms, s.num_host_syncs, s.num_device_alloc),
        (1, 0, 1, 1)
    );
    assert_eq!(dev.violations(), vec![]);
    drop((y, z));
}

#[test]
fn out_of_memory_report_counts_memory_cached_for_other_streams() {
    // (A large weight: small blocks of both residencies count as transient.)
    let (dev, alloc, a, b) = setup("", 24 * MIB);
    drop(alloc.alloc_in(2 * MIB, b, Residency::Persistent).unwrap());
    let e = alloc.alloc(5 * MIB, a).unwrap_err();
    let AllocError::OutOfMemory(r) = e else { panic!() };
    assert_eq!(
        (r.free_on_other_streams, r.waiting_on_events, r.persistent_reserved),
        (20 * MIB, 0, 20 * MIB)
    );
    assert_eq!(r.device_free, 4 * MIB);
    assert_eq!(dev.live_segments().len(), 1, "persistent memory is never released by the ladder");
}

#[test]
fn destroying_a_stream_returns_its_stranded_memory() {
    let (dev, alloc, a, b) = setup("", 64 * MIB);
    drop(alloc.alloc(N, a).unwrap());
    drop(alloc.alloc(3 * MIB, b).unwrap());
    assert_eq!(alloc.stats().cached_free_bytes_per_stream, vec![(1, 2 * MIB), (2, 20 * MIB)]);
    alloc.destroy_stream(b).unwrap();
    assert_eq!(alloc.stats().cached_free_bytes_per_stream, vec![(1, 2 * MIB)]);
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(SIM_BASE), 2 * MIB)]);
    assert!(!dev.live_streams().contains(&b));
    alloc.release_stream(a).unwrap();
    assert!(dev.live_segments().is_empty());
    alloc.check_invariants().unwrap();
}

/// What `CudaBuffer::order_for` on the buffer's own stream does (a kernel argument is no
/// `DevicePtr` call, so a launch is announced): after a write announced on another stream (a
/// cudarc copy there), a use announced on the owner stream makes it wait for that write, as
/// cudarc's `CudaSlice` argument waits for its write event. Unannounced, the owner's kernel
/// reads while the other stream still writes, and the sanitizer says so (found in review:
/// the docs had said the own stream needed nothing).
#[test]
fn a_use_announced_on_the_owner_stream_waits_for_a_write_announced_elsewhere() {
    for announce in [true, false] {
        let dev = Arc::new(SimDevice::backed(64 * MIB));
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let other = dev.create_stream().unwrap();
        let buf = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
        buf.use_on(other, AccessKind::Write).unwrap(); // the copy on `other` writes it
        let (k, open) = common::gated(buf.ptr(), 4096, AccessKind::Write);
        dev.launch(other, k).unwrap();
        if announce {
            buf.use_on(StreamId::DEFAULT, AccessKind::Read).unwrap();
        }
        let read = vec![Access { ptr: buf.ptr(), bytes: 4096, kind: AccessKind::Read }];
        dev.launch(StreamId::DEFAULT, Kernel::new("read", read, |_| {})).unwrap();
        open.send(()).unwrap();
        dev.synchronize().unwrap();
        let seen: Vec<_> =
            dev.violations().iter().map(|v| (v.stream, v.other, v.op.clone())).collect();
        match announce {
            true => assert_eq!(seen, vec![]),
            false => assert_eq!(seen, vec![(StreamId::DEFAULT, Some(other), "kernel read".into())]),
        }
        drop(buf);
    }
}
