//! Kernels and checks shared by the whole-allocator tests (a module, not a test target).

#![allow(dead_code)] // each test target uses part of it

pub mod pickle;

use std::sync::{Arc, Mutex, mpsc};
use tidepool::device::{Access, AccessKind, Capture, Kernel, Launch, SimDevice};
use tidepool::{AllocError, Allocator, Buffer, Device, DeviceAddr, StreamId};

/// A backed 256 MiB device with two streams made on it, `s` and `t`, and an allocator of the
/// default configuration.
pub struct Setup {
    pub dev: Arc<SimDevice>,
    pub s: StreamId,
    pub t: StreamId,
    pub alloc: Allocator<SimDevice>,
}

/// [`Setup`].
pub fn setup() -> Setup {
    let dev = Arc::new(SimDevice::backed(256 * tidepool::MIB));
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), tidepool::Config::default()).unwrap();
    Setup { dev, s, t, alloc }
}

/// A backed device of `capacity` bytes and an allocator with expandable segments on over
/// `config` (a `TIDEPOOL_ALLOC_CONF`-style string).
pub fn expandable_setup(config: &str, capacity: u64) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::backed(capacity));
    let config = tidepool::Config::parse(config).unwrap().with_expandable_segments(true);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    (dev, alloc)
}

/// Opens `gate` once the device has counted a host synchronisation beyond those it has now: the
/// moment the allocator (or the test) starts waiting for the gated kernel. No timing involved.
pub fn open_on_next_sync(
    dev: &Arc<SimDevice>,
    gate: mpsc::Sender<()>,
) -> std::thread::JoinHandle<()> {
    let dev = dev.clone();
    let before = dev.counters().host_syncs;
    std::thread::spawn(move || {
        while dev.counters().host_syncs == before {
            std::thread::yield_now();
        }
        let _ = gate.send(());
    })
}

/// Nothing is left on the device once the allocator is gone: no mapping, physical memory,
/// virtual range or segment, and no stream-order violation.
pub fn assert_no_leak(dev: &SimDevice) {
    assert_eq!(dev.live_mappings(), vec![]);
    assert_eq!(dev.live_physical(), 0);
    assert_eq!(dev.physical_bytes(), 0);
    assert_eq!(dev.virtual_bytes(), 0);
    assert_eq!(dev.live_virtual_ranges(), vec![]);
    assert!(dev.live_segments().is_empty());
    assert_eq!(dev.violations(), vec![]);
}

/// `reserved_bytes` is what the device has mapped, and the invariants hold.
pub fn consistent(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    let mapped: u64 = dev.live_mappings().iter().map(|&(_, n)| n).sum();
    assert_eq!(alloc.reserved_bytes(), mapped);
    assert_eq!(dev.physical_bytes(), mapped);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// Launches graph `g` on `t`, then drops it while a capture of `alloc` on `u` is underway (its
/// drop cannot synchronise, so what it held waits in the family), and ends that capture.
pub fn drop_graph_during_capture(
    alloc: &Allocator<SimDevice>,
    g: tidepool::Graph<SimDevice>,
    t: StreamId,
    u: StreamId,
) {
    g.launch(t).unwrap();
    alloc.begin_capture(u, None).unwrap();
    drop(g); // cannot synchronise: a capture is underway
    drop(alloc.end_capture(u).unwrap());
}

/// A kernel that waits for the returned gate, then writes `byte` over `[ptr, ptr + bytes)`.
pub fn gated_write_bytes(ptr: DeviceAddr, bytes: u64, byte: u8) -> (Kernel, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel::<()>();
    let k = Kernel::new(
        "gated_write",
        vec![Access { ptr, bytes, kind: AccessKind::Write }],
        move |m| {
            let _ = gate.recv();
            m.write(ptr, &vec![byte; bytes as usize]).unwrap();
        },
    );
    (k, open)
}

/// Bytes the shared kernels touch.
pub const N: u64 = 4096;

/// A kernel that waits for the returned gate, then writes `byte` over `[ptr, ptr + N)`: work
/// that is unfinished until the test says so, so nothing depends on timing.
pub fn gated_write(ptr: DeviceAddr, byte: u8) -> (Kernel, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel::<()>();
    let k = Kernel::new(
        "gated_write",
        vec![Access { ptr, bytes: N, kind: AccessKind::Write }],
        move |m| {
            let _ = gate.recv();
            m.write(ptr, &[byte; N as usize]).unwrap();
        },
    );
    (k, open)
}

/// A kernel that accesses `[ptr, ptr + bytes)` as `kind` and ends when the returned gate opens
/// (or is dropped): unfinished work until the test says so, on memory that need not be backed.
pub fn gated(ptr: DeviceAddr, bytes: u64, kind: AccessKind) -> (Kernel, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel::<()>();
    let k = Kernel::new("gated", vec![Access { ptr, bytes, kind }], move |_| {
        let _ = gate.recv();
    });
    (k, open)
}

/// xorshift64*: a seeded generator for test sequences (a seed always gives the same sequence).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform enough in `[0, n)`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The device bytes of `buf`, read by a kernel on its stream after everything enqueued before.
pub fn device_bytes(dev: &SimDevice, buf: &Buffer<SimDevice>) -> Vec<u8> {
    let (ptr, n) = (buf.ptr(), buf.len());
    let slot = Arc::new(Mutex::new(Vec::new()));
    let out = slot.clone();
    let read =
        Kernel::new("read", vec![Access { ptr, bytes: n, kind: AccessKind::Read }], move |m| {
            let mut v = vec![0u8; n as usize];
            m.read(ptr, &mut v).unwrap();
            *out.lock().unwrap() = v;
        });
    dev.launch(buf.stream(), read).unwrap();
    dev.synchronize().unwrap();
    slot.lock().unwrap().clone()
}

/// A replayable kernel (one a CUDA graph may capture) writing `byte` over the first N bytes of
/// `b`.
pub fn replayable_write(b: &Buffer<SimDevice>, byte: u8) -> Kernel {
    let p = b.ptr();
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
    Kernel::replayable("write", acc, move |m| m.write(p, &[byte; N as usize]).unwrap())
}

/// A replayable kernel reading the first N bytes of `b`.
pub fn replayable_read(b: &Buffer<SimDevice>) -> Kernel {
    let p = b.ptr();
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Read }];
    Kernel::replayable("read", acc, move |m| m.read(p, &mut [0u8; N as usize]).unwrap())
}

/// `to` waits for the work enqueued on `from` so far (`to.wait_stream(from)`), through a new
/// event, returned: inside a capture a stream outside it joins it, and a captured stream is
/// ordered after the other's captured work.
pub fn wait_stream(dev: &SimDevice, to: StreamId, from: StreamId) -> tidepool::device::EventId {
    let e = dev.create_event().unwrap();
    dev.record_event(e, from).unwrap();
    dev.wait_event(to, e).unwrap();
    e
}

/// Ends `stream`'s capture from another thread, which CUDA's global capture mode refuses
/// (`CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`, SimDevice alike): asserts that refusal, and that
/// the capture goes on, for the allocator and for the device.
pub fn end_capture_elsewhere<D: Capture>(alloc: &Allocator<D>, stream: StreamId) {
    let refused =
        std::thread::scope(|t| t.spawn(|| alloc.end_capture(stream).map(drop)).join().unwrap());
    assert!(
        matches!(&refused, Err(AllocError::Device(e)) if e.is_capture_wrong_thread()),
        "{refused:?}"
    );
    assert!(alloc.is_capturing(stream) && alloc.device().capture_underway());
}
