//! A `Device` that panics in the middle of an allocator operation.
//!
//! `Device` is a public trait: an application may plug in its own, and its calls may panic (a
//! driver binding that `unwrap`s, an assertion in a wrapper). The allocator holds its lock
//! around most device calls, so a panic unwinds out of a half-done operation. What must hold
//! afterwards, at every point a panic can strike:
//! - the allocator's invariants (`check_invariants`), and it keeps serving requests;
//! - nothing leaks: once every buffer is dropped and the allocator with them, the device has no
//!   segment, physical allocation, mapping, virtual range or event left.
//!
//! The panic is injected *before* the wrapped call reaches the SimDevice (the driver call never
//! happened), at the n-th device call of a fixed workload, for every n the workload makes.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use tidepool::device::{Access, AccessKind, EventId, HostPtr, Kernel, Launch, MemInfo, PhysHandle};
use tidepool::hooks::Broken;
use tidepool::{
    Allocator, Buffer, Capture, Config, Device, DeviceAddr, DeviceError, GraphId, HostAllocError,
    HostAllocator, PinnedBuffer, PoolOptions, SimConfig, SimDevice, StreamId,
};

const MIB: u64 = 1 << 20;

/// A SimDevice whose calls count down to an injected panic.
struct PanicDev {
    sim: SimDevice,
    /// Calls left before the panic; `u64::MAX`: never.
    left: AtomicU64,
    /// Device calls made (to size the sweep).
    calls: AtomicU64,
    /// The method of each call, in order.
    ops: Mutex<Vec<&'static str>>,
    /// Counts only the calls of this method down to the panic, where set.
    only: Mutex<Option<&'static str>>,
    /// Panics in every call of this method, where set (a device that keeps refusing).
    always: Mutex<Option<&'static str>>,
}

impl PanicDev {
    fn tick(&self, op: &'static str) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.ops.lock().unwrap().push(op);
        if *self.always.lock().unwrap() == Some(op) {
            panic!("injected device panic (every {op})");
        }
        if self.only.lock().unwrap().is_some_and(|only| only != op) {
            return;
        }
        // One panic at most: the countdown stops at 0.
        let left = self.left.load(Ordering::Relaxed);
        if left != u64::MAX && left != 0 {
            self.left.store(left - 1, Ordering::Relaxed);
            if left == 1 {
                panic!("injected device panic");
            }
        }
    }
}

impl Device for PanicDev {
    fn name(&self) -> String {
        self.sim.name()
    }
    fn reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError> {
        self.tick("reserve");
        self.sim.reserve(bytes)
    }
    fn release(&self, ptr: DeviceAddr) -> Result<(), DeviceError> {
        self.tick("release");
        self.sim.release(ptr)
    }
    fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        self.sim.mem_info()
    }
    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        self.sim.create_stream()
    }
    fn destroy_stream(&self, stream: StreamId) -> Result<(), DeviceError> {
        self.sim.destroy_stream(stream)
    }
    fn has_stream(&self, stream: StreamId) -> bool {
        self.sim.has_stream(stream)
    }
    fn create_event(&self) -> Result<EventId, DeviceError> {
        self.tick("create_event");
        self.sim.create_event()
    }
    fn destroy_event(&self, event: EventId) -> Result<(), DeviceError> {
        self.tick("destroy_event");
        self.sim.destroy_event(event)
    }
    fn record_event(&self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        self.tick("record_event");
        self.sim.record_event(event, stream)
    }
    fn query_event(&self, event: EventId) -> Result<bool, DeviceError> {
        self.tick("query_event");
        self.sim.query_event(event)
    }
    fn wait_event(&self, stream: StreamId, event: EventId) -> Result<(), DeviceError> {
        self.tick("wait_event");
        self.sim.wait_event(stream, event)
    }
    fn synchronize_event(&self, event: EventId) -> Result<(), DeviceError> {
        self.tick("synchronize_event");
        self.sim.synchronize_event(event)
    }
    fn synchronize(&self) -> Result<(), DeviceError> {
        self.tick("synchronize");
        self.sim.synchronize()
    }
    fn supports_virtual_memory(&self) -> bool {
        self.sim.supports_virtual_memory()
    }
    fn vm_granularity(&self) -> Result<u64, DeviceError> {
        self.sim.vm_granularity()
    }
    fn vm_reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError> {
        self.tick("vm_reserve");
        self.sim.vm_reserve(bytes)
    }
    fn vm_free(&self, base: DeviceAddr, bytes: u64) -> Result<(), DeviceError> {
        self.tick("vm_free");
        self.sim.vm_free(base, bytes)
    }
    fn vm_create(&self, bytes: u64) -> Result<PhysHandle, DeviceError> {
        self.tick("vm_create");
        self.sim.vm_create(bytes)
    }
    fn vm_release(&self, handle: PhysHandle) -> Result<(), DeviceError> {
        self.tick("vm_release");
        self.sim.vm_release(handle)
    }
    fn vm_map(&self, va: DeviceAddr, bytes: u64, handle: PhysHandle) -> Result<(), DeviceError> {
        self.tick("vm_map");
        self.sim.vm_map(va, bytes, handle)
    }
    fn vm_unmap(&self, va: DeviceAddr, bytes: u64) -> Result<(), DeviceError> {
        self.tick("vm_unmap");
        self.sim.vm_unmap(va, bytes)
    }
    fn capture_underway(&self) -> bool {
        self.sim.capture_underway()
    }
    fn capture_of(&self, stream: StreamId) -> Option<StreamId> {
        self.sim.capture_of(stream)
    }
    fn capture_mark(&self, stream: StreamId) -> Option<tidepool::CaptureMark> {
        self.sim.capture_mark(stream)
    }
    fn capture_ordered_after(&self, stream: StreamId, mark: tidepool::CaptureMark) -> bool {
        self.sim.capture_ordered_after(stream, mark)
    }
    fn observes_handouts(&self) -> bool {
        self.sim.observes_handouts()
    }
    fn note_handout(&self, ptr: DeviceAddr, bytes: u64, stream: StreamId) {
        self.sim.note_handout(ptr, bytes, stream)
    }
    fn note_reclaim(&self, ptr: DeviceAddr, bytes: u64, stream: StreamId) {
        self.sim.note_reclaim(ptr, bytes, stream)
    }
    fn host_alloc(&self, bytes: u64) -> Result<HostPtr, DeviceError> {
        self.tick("host_alloc");
        self.sim.host_alloc(bytes)
    }
    unsafe fn host_free(&self, ptr: HostPtr) -> Result<(), DeviceError> {
        self.tick("host_free");
        // SAFETY: the caller's promise, passed on.
        unsafe { self.sim.host_free(ptr) }
    }
    unsafe fn memcpy_htod_async(
        &self,
        dst: DeviceAddr,
        src: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        self.tick("memcpy_htod_async");
        // SAFETY: the caller's promise, passed on.
        unsafe { self.sim.memcpy_htod_async(dst, src, bytes, stream) }
    }
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: HostPtr,
        src: DeviceAddr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        self.tick("memcpy_dtoh_async");
        // SAFETY: the caller's promise, passed on.
        unsafe { self.sim.memcpy_dtoh_async(dst, src, bytes, stream) }
    }
    fn note_host_access(&self, ptr: HostPtr, bytes: u64, kind: AccessKind) {
        self.sim.note_host_access(ptr, bytes, kind)
    }
}

impl Capture for PanicDev {
    fn begin_capture(&self, stream: StreamId) -> Result<(), DeviceError> {
        self.tick("begin_capture");
        self.sim.begin_capture(stream)
    }
    fn end_capture(&self, stream: StreamId) -> Result<GraphId, DeviceError> {
        self.tick("end_capture");
        self.sim.end_capture(stream)
    }
    fn launch_graph(&self, graph: GraphId, stream: StreamId) -> Result<(), DeviceError> {
        self.tick("launch_graph");
        self.sim.launch_graph(graph, stream)
    }
    fn destroy_graph(&self, graph: GraphId) -> Result<(), DeviceError> {
        self.tick("destroy_graph");
        self.sim.destroy_graph(graph)
    }
}

/// The workload: allocations of both pools on two streams, a cross-stream use, frees, a cache
/// release, growth of an expandable range. Buffers it still holds stay in `held`.
fn workload(alloc: &Allocator<PanicDev>, s1: StreamId, held: &mut Vec<Buffer<PanicDev>>) {
    let d = StreamId::DEFAULT;
    held.push(alloc.alloc(MIB, d).unwrap());
    held.push(alloc.alloc(3 * MIB, s1).unwrap());
    held.push(alloc.alloc(30 * MIB, d).unwrap());
    alloc.record_stream(&held[0], s1).unwrap();
    drop(held.swap_remove(0)); // the 1 MiB block, used on s1: freed behind an event
    drop(held.swap_remove(0)); // the 30 MiB block
    held.push(alloc.alloc(512 * 1024, s1).unwrap());
    held.push(alloc.alloc(25 * MIB, d).unwrap());
    alloc.empty_cache().unwrap();
    held.push(alloc.alloc(2 * MIB, d).unwrap());
    held.push(alloc.alloc(60 * MIB, s1).unwrap());
    alloc.record_stream(&held[0], d).unwrap();
    held.clear();
    alloc.empty_cache().unwrap();
}

impl PanicDev {
    /// After the workload: whether the panic at call `at` struck as it should (a run whose
    /// event polls went otherwise may make fewer calls than the sweep's first run), the
    /// countdown disarmed; returns the methods of the calls made so far.
    fn finish_workload(&self, at: Option<u64>, what: &str) -> Vec<&'static str> {
        let injected = self.left.swap(u64::MAX, Ordering::Relaxed) == 0;
        let reached = at.is_some_and(|n| n <= self.calls.load(Ordering::Relaxed));
        assert_eq!(injected, reached, "{what}: the panic at call {at:?} was injected");
        std::mem::take(&mut *self.ops.lock().unwrap())
    }

    /// Asserts that the device holds nothing: segments, physical memory, mappings, virtual
    /// ranges, events.
    fn assert_empty(&self, what: &str, at: Option<u64>) {
        let sim = &self.sim;
        sim.synchronize().unwrap();
        let left = (
            sim.live_segments(),
            sim.physical_bytes(),
            sim.live_mappings(),
            sim.live_virtual_ranges(),
            sim.live_events(),
        );
        let empty = (vec![], 0, vec![], vec![], 0);
        assert_eq!(left, empty, "{what}: left on the device, panic at {at:?}");
    }
}

/// Runs `run(at)` for every call `at` of `ops` (the calls of a run without a panic); fails
/// with every panic point that failed, its method and its message.
fn sweep_points(what: &str, ops: &[&'static str], run: impl Fn(u64) + std::panic::RefUnwindSafe) {
    let mut bad = Vec::new();
    for (at, op) in (1..).zip(ops) {
        if let Err(e) = catch_unwind(|| run(at)) {
            bad.push((at, op, message(e)));
        }
    }
    assert!(bad.is_empty(), "{what}: {} of {} panic points fail: {bad:#?}", bad.len(), ops.len());
}

/// The message of a panic payload (empty where it is not a formatted string).
fn message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload.downcast_ref::<String>().cloned().unwrap_or_default()
}

/// A deliberate bug caught at a chosen panic point: with a panic at the first call of `op` in
/// `ops` (a run without a panic), `run(at, None)` passes and `run(at, Some(mode))` fails;
/// returns the failure's message.
fn caught_at<T>(
    ops: &[&'static str],
    op: &str,
    mode: Broken,
    run: impl Fn(u64, Option<Broken>) -> T + std::panic::RefUnwindSafe,
) -> String {
    let at = 1 + ops.iter().position(|&o| o == op).expect("the workload makes the call") as u64;
    run(at, None);
    message(catch_unwind(|| run(at, Some(mode))).err().expect("the deliberate bug is caught"))
}

/// Runs the workload with a panic at device call `at` (`None`: no panic); returns the device
/// calls it made. Asserts the invariants after the panic, that the allocator still serves, and
/// that nothing is left on the device at the end.
/// A 1 GiB SimDevice with virtual memory, behind a `PanicDev` that panics at call `at`.
fn panic_dev(at: Option<u64>) -> Arc<PanicDev> {
    panic_dev_over(SimConfig { capacity: 1 << 30, ..SimConfig::default() }, at)
}

/// `config`'s SimDevice with virtual memory behind a `PanicDev` that panics at call `at`.
fn panic_dev_over(config: SimConfig, at: Option<u64>) -> Arc<PanicDev> {
    let sim = SimDevice::with_config(config);
    sim.set_virtual_memory(true);
    Arc::new(PanicDev {
        sim,
        left: AtomicU64::new(at.unwrap_or(u64::MAX)),
        calls: AtomicU64::new(0),
        ops: Mutex::new(Vec::new()),
        only: Mutex::new(None),
        always: Mutex::new(None),
    })
}

/// Runs the workload with a panic at device call `at` (`None`: no panic) and the deliberate
/// bug `broken` on meanwhile; returns the methods of the calls it made. Asserts the invariants
/// after the panic, that the allocator still serves, and that nothing is left on the device.
fn run(config: &str, at: Option<u64>, broken: Option<Broken>) -> Vec<&'static str> {
    let dev = panic_dev(at);
    let s1 = dev.sim.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    let mut held = Vec::new();
    broken.inspect(|&mode| alloc.set_broken(mode, true));
    // The workload may fail where the panic struck (an `unwrap` of the error it became) or
    // absorb it (a failed event record falls back to a host sync, say).
    let _ = catch_unwind(AssertUnwindSafe(|| workload(&alloc, s1, &mut held)));
    broken.inspect(|&mode| alloc.set_broken(mode, false));
    let ops = dev.finish_workload(at, config);
    alloc.check_invariants().unwrap_or_else(|e| panic!("{config}, panic at {at:?}: {e}"));
    // It serves on: a fresh block of each pool, then the workload once more, whole.
    drop(alloc.alloc(4096, s1).unwrap());
    drop(alloc.alloc(40 * MIB, StreamId::DEFAULT).unwrap());
    workload(&alloc, s1, &mut held);
    alloc.check_invariants().unwrap_or_else(|e| panic!("{config}, panic at {at:?}: {e}"));
    drop(held);
    let st = alloc.stats();
    assert_eq!(st.blocks.allocated_bytes.all.current, 0, "{config}, panic at {at:?}");
    drop(alloc);
    dev.assert_empty(config, at);
    ops
}

fn sweep(config: &str) {
    let ops = run(config, None, None);
    assert!(ops.len() > 10, "{config}: the workload makes device calls ({ops:?})");
    sweep_points(config, &ops, |at| drop(run(config, Some(at), None)));
}

#[test]
fn a_panicking_device_leaves_segments_consistent_and_nothing_behind() {
    sweep("");
}

#[test]
fn a_panicking_device_leaves_expandable_ranges_consistent_and_nothing_behind() {
    sweep("expandable_segments:true");
}

/// The deliberate bug: a panic in the first event creation (the free of a block used on
/// another stream) unwinds through the free, which leaves the block counted as allocated with
/// no buffer to free it. The sweep's checks catch it; with the fix the same point passes.
#[test]
fn the_checks_catch_a_panic_unwinding_through_the_allocator() {
    let ops = run("", None, None);
    let unwind = Broken::DevicePanicsUnwind;
    let msg = caught_at(&ops, "create_event", unwind, |at, b| run("", Some(at), b));
    assert!(msg.contains("left: 1048576"), "the lost 1 MiB block: {msg}");
}

/// A physical allocation the device refuses to release (here: its `vm_release` panics) is kept
/// and released at the next `empty_cache`; with the deliberate bug it stays taken for good.
#[test]
fn a_refused_physical_release_is_tried_again() {
    for broken in [false, true] {
        let dev = panic_dev(None);
        let alloc = Allocator::new(dev.clone(), Config::parse("expandable_segments:true").unwrap())
            .unwrap();
        alloc.set_broken(Broken::LostReleases, broken);
        drop(alloc.alloc(60 * MIB, StreamId::DEFAULT).unwrap());
        let sim = &dev.sim;
        // One physical allocation of 60 MiB, mapped at the range's base.
        let base = sim.live_mappings()[0].0;
        assert_eq!(sim.live_mappings(), vec![(base, 60 * MIB)]);
        assert_eq!(sim.physical_bytes(), 60 * MIB);
        // Its release panics: unmapped (the range holds nothing), the memory still taken.
        *dev.only.lock().unwrap() = Some("vm_release");
        dev.left.store(1, Ordering::Relaxed);
        alloc.empty_cache().unwrap();
        assert_eq!(dev.left.load(Ordering::Relaxed), 0, "the release panicked");
        assert_eq!(sim.live_mappings(), vec![]);
        assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 0);
        assert_eq!(sim.physical_bytes(), 60 * MIB);
        alloc.check_invariants().unwrap();
        // The next release point tries again.
        alloc.empty_cache().unwrap();
        let left = if broken { 60 * MIB } else { 0 };
        assert_eq!(sim.physical_bytes(), left, "broken: {broken}");
        drop(alloc);
        assert_eq!(sim.physical_bytes(), left, "broken: {broken}");
    }
}

/// Pinned host memory: two buffers copied to and from a device buffer on two streams, a cache
/// release, a reuse. Buffers it still holds stay in `held`.
fn host_workload(
    host: &HostAllocator<PanicDev>,
    alloc: &Allocator<PanicDev>,
    s1: StreamId,
    held: &mut Vec<PinnedBuffer<PanicDev>>,
) {
    let on_s1 = alloc.alloc(8192, s1).unwrap();
    let on_default = alloc.alloc(8192, StreamId::DEFAULT).unwrap();
    let mut up = host.alloc(5000).unwrap();
    up.as_mut_slice().unwrap().fill(7);
    up.upload(&on_s1).unwrap();
    up.upload(&on_default).unwrap();
    held.push(up);
    let mut down = host.alloc(100).unwrap();
    down.download(&on_s1).unwrap();
    assert_eq!(down.as_slice().unwrap(), &[7; 100][..]);
    drop(down);
    host.empty_cache().unwrap();
    let mut again = host.alloc(4000).unwrap();
    again.download(&on_default).unwrap();
    held.push(again);
    held.remove(0);
    host.empty_cache().unwrap();
}

/// As `run`, for the pinned host allocator.
fn run_host(at: Option<u64>) -> Vec<&'static str> {
    let sim = SimConfig { capacity: 64 << 20, backed: true, ..SimConfig::default() };
    let dev = panic_dev_over(sim, at);
    let s1 = dev.sim.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let host = HostAllocator::new(dev.clone());
    let mut held = Vec::new();
    let _ = catch_unwind(AssertUnwindSafe(|| host_workload(&host, &alloc, s1, &mut held)));
    let ops = dev.finish_workload(at, "pinned");
    host.check_invariants().unwrap_or_else(|e| panic!("panic at {at:?}: {e}"));
    host_workload(&host, &alloc, s1, &mut held);
    host.check_invariants().unwrap_or_else(|e| panic!("panic at {at:?}: {e}"));
    drop(held);
    dev.sim.synchronize().unwrap(); // the last copies done: their blocks may go
    host.empty_cache().unwrap();
    assert_eq!(host.stats().reserved_bytes.current, 0, "panic at {at:?}");
    drop((host, alloc));
    let sim = &dev.sim;
    sim.synchronize().unwrap();
    assert_eq!(sim.live_host_allocations(), vec![], "panic at {at:?}");
    assert_eq!(sim.violations(), vec![], "panic at {at:?}");
    ops
}

#[test]
fn a_panicking_device_leaves_pinned_host_memory_consistent_and_nothing_behind() {
    let ops = run_host(None);
    assert!(ops.contains(&"host_free") && ops.contains(&"memcpy_dtoh_async"), "{ops:?}");
    sweep_points("pinned", &ops, |at| drop(run_host(Some(at))));
}

#[test]
fn a_panic_after_a_copy_does_not_free_its_pinned_block_early() {
    for broken in [false, true] {
        let dev = panic_dev_over(
            SimConfig { capacity: 64 << 20, backed: true, ..SimConfig::default() },
            None,
        );
        let s1 = dev.sim.create_stream().unwrap();
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let host = HostAllocator::new(dev.clone());
        let dst = alloc.alloc(8192, s1).unwrap();
        let (open, gate) = mpsc::channel::<()>();
        let wait = Kernel::new("gate", vec![], move |_| {
            let _ = gate.recv();
        });
        dev.sim.launch(s1, wait).unwrap();
        let mut up = host.alloc(5000).unwrap();
        let first = up.host_ptr();
        *dev.only.lock().unwrap() = Some("record_event");
        dev.left.store(1, Ordering::Relaxed);
        host.set_broken_unwind(broken);
        let r = catch_unwind(AssertUnwindSafe(|| up.upload(&dst)));
        host.set_broken_unwind(false);
        assert_eq!(dev.left.load(Ordering::Relaxed), 0, "the record panicked");
        match r {
            Ok(result) => assert!(matches!(
                result,
                Err(HostAllocError::Device(DeviceError::Panicked { op: "record_event", .. }))
            )),
            Err(_) => assert!(broken, "the panic unwound out of upload"),
        }
        drop(up);
        let mut next = host.alloc(5000).unwrap();
        assert_eq!(next.host_ptr() == first, broken, "broken: {broken}");
        next.as_mut_slice().unwrap().fill(1);
        let reported = dev.sim.violations().iter().any(|v| v.op == "host write");
        assert_eq!(reported, broken, "broken: {broken}");
        open.send(()).unwrap();
        dev.sim.synchronize().unwrap();
        drop(next);
        host.check_invariants().unwrap();
    }
}

/// Memory pressure and the other features on a 48 MiB device: two runs of a named scope, a
/// stream's freed pages or segment taken by another stream (after a kernel on them), an
/// out-of-memory ladder, a private pool routed on a stream, a stream released. Buffers it still
/// holds stay in `held`.
fn pressure_workload(
    dev: &PanicDev,
    alloc: &Allocator<PanicDev>,
    (s1, s2, s3): (StreamId, StreamId, StreamId),
    held: &mut Vec<Buffer<PanicDev>>,
) {
    // (Its own stream: the plan's region stays in the segment or pages it adopts.)
    for _ in 0..2 {
        let scope = alloc.named_scope("step", s3);
        let x = scope.alloc(MIB).unwrap();
        let y = scope.alloc(2 * MIB).unwrap();
        drop((x, y));
    }
    // All the device has but 4 MiB (a named scope's region may stay from an earlier run).
    let big = (dev.sim.mem_info().unwrap().free.saturating_sub(4 * MIB) & !(2 * MIB - 1)).max(MIB);
    let a = alloc.alloc(big, s1).unwrap();
    let (ptr, bytes) = (a.ptr(), a.len());
    let write = Kernel::new("w", vec![Access { ptr, bytes, kind: AccessKind::Write }], |_| {});
    dev.sim.launch(s1, write).unwrap();
    drop(a);
    held.push(alloc.alloc(6 * MIB, s2).unwrap());
    assert!(alloc.alloc(64 * MIB, StreamId::DEFAULT).is_err());
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    {
        let _route = alloc.use_pool(&pool, s1).unwrap();
        held.push(alloc.alloc(512 * 1024, s1).unwrap());
    }
    held.pop();
    pool.empty_cache().unwrap();
    drop(pool);
    held.clear();
    alloc.release_stream(s1).unwrap();
    alloc.empty_cache().unwrap();
}

/// As `run`, for `pressure_workload`.
fn run_pressure(config: &str, at: Option<u64>) -> Vec<&'static str> {
    let dev = panic_dev_over(SimConfig { capacity: 48 * MIB, ..SimConfig::default() }, at);
    let sim = &dev.sim;
    let streams =
        (sim.create_stream().unwrap(), sim.create_stream().unwrap(), sim.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    let mut held = Vec::new();
    let _ = catch_unwind(AssertUnwindSafe(|| pressure_workload(&dev, &alloc, streams, &mut held)));
    let ops = dev.finish_workload(at, config);
    alloc.check_invariants().unwrap_or_else(|e| panic!("{config}, panic at {at:?}: {e}"));
    dev.sim.synchronize().unwrap();
    held.clear();
    alloc.empty_cache().unwrap();
    pressure_workload(&dev, &alloc, streams, &mut held);
    alloc.check_invariants().unwrap_or_else(|e| panic!("{config}, panic at {at:?}: {e}"));
    drop(held);
    // What stays allocated is the named scope's planned region.
    let st = alloc.stats();
    let region = st.plan_region_bytes;
    assert_eq!(st.blocks.allocated_bytes.all.current, region, "{config}, panic at {at:?}");
    drop(alloc);
    dev.assert_empty(config, at);
    assert_eq!(dev.sim.violations(), vec![], "{config}, panic at {at:?}");
    ops
}

fn sweep_pressure(config: &str) {
    let ops = run_pressure(config, None);
    sweep_points(config, &ops, |at| drop(run_pressure(config, Some(at))));
}

#[test]
fn a_panicking_device_under_memory_pressure_leaves_nothing_behind() {
    sweep_pressure("");
    sweep_pressure("cross_stream:wait_event");
}

#[test]
fn a_panicking_device_under_memory_pressure_over_expandable_ranges_leaves_nothing_behind() {
    sweep_pressure("expandable_segments:true");
    sweep_pressure("expandable_segments:true,cross_stream:wait_event");
}

/// A private pool goes while the device refuses to free its virtual range (every `vm_free`
/// panics): the range is left to the family, and the general allocator's next `empty_cache`
/// frees it once the device takes it. With the deliberate bug it is lost with the pool.
#[test]
fn what_a_dropped_pool_could_not_free_is_freed_by_the_family_later() {
    for broken in [false, true] {
        let dev = panic_dev(None);
        let s1 = dev.sim.create_stream().unwrap();
        let config = Config::parse("expandable_segments:true").unwrap();
        let alloc = Allocator::new(dev.clone(), config).unwrap();
        alloc.set_broken(Broken::LostLeftovers, broken); // (the pool has it too)
        let pool = alloc.new_pool(PoolOptions::default()).unwrap();
        {
            let _route = alloc.use_pool(&pool, s1).unwrap();
            drop(alloc.alloc(4 * MIB, s1).unwrap());
        }
        let sim = &dev.sim;
        let range = sim.live_virtual_ranges();
        assert_eq!(range.len(), 1, "the pool's range (the general allocator has none)");
        *dev.always.lock().unwrap() = Some("vm_free");
        drop(pool);
        assert_eq!(sim.live_virtual_ranges(), range, "refused");
        assert_eq!((sim.physical_bytes(), sim.live_mappings()), (0, vec![]), "pages went");
        alloc.empty_cache().unwrap();
        assert_eq!(sim.live_virtual_ranges(), range, "still refused");
        *dev.always.lock().unwrap() = None;
        alloc.empty_cache().unwrap();
        let left = if broken { range } else { vec![] };
        assert_eq!(sim.live_virtual_ranges(), left, "broken: {broken}");
        drop(alloc);
        assert_eq!(sim.live_virtual_ranges(), left, "broken: {broken}");
    }
}

/// A CUDA graph capture: a buffer of the general pool freed during the capture (the graph holds
/// it), a captured allocation with a replayable kernel on it, two launches, the graph dropped.
fn capture_workload(dev: &PanicDev, alloc: &Allocator<PanicDev>, s1: StreamId) {
    let before = alloc.alloc(MIB, s1).unwrap();
    alloc.begin_capture(s1, None).unwrap();
    let x = alloc.alloc(2 * MIB, s1).unwrap();
    let (ptr, bytes) = (x.ptr(), x.len());
    let access = vec![Access { ptr, bytes, kind: AccessKind::Write }];
    dev.sim.launch(s1, Kernel::replayable("w", access, |_| {})).unwrap();
    drop(before);
    drop(x);
    let graph = alloc.end_capture(s1).unwrap();
    graph.launch(s1).unwrap();
    graph.launch(s1).unwrap();
    drop(graph);
    alloc.empty_cache().unwrap();
}

/// As `run`, for `capture_workload` (`broken`: that deliberate bug on, in its pools too). A
/// graph the device refused to destroy keeps its memory for good (sound, if wasteful); every
/// other panic point leaves nothing on the device. What a graph holds when the wait for its
/// launches panicked is let go of by the next `empty_cache` (the second workload's).
fn run_capture(at: Option<u64>, broken: Option<Broken>) -> Vec<&'static str> {
    let dev = panic_dev(at);
    let s1 = dev.sim.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    broken.inspect(|&mode| alloc.set_broken(mode, true));
    let _ = catch_unwind(AssertUnwindSafe(|| capture_workload(&dev, &alloc, s1)));
    let ops = dev.finish_workload(at, "capture");
    let panicked = at.and_then(|n| ops.get(n as usize - 1).copied());
    if alloc.is_capturing(s1) {
        drop(alloc.end_capture(s1)); // the capture the panic interrupted
    }
    if dev.sim.capture_underway() {
        // `end_capture` panicked before the device ended it: the test ends it.
        dev.sim.destroy_graph(dev.sim.end_capture(s1).unwrap()).unwrap();
    }
    alloc.check_invariants().unwrap_or_else(|e| panic!("panic at {at:?}: {e}"));
    dev.sim.synchronize().unwrap();
    capture_workload(&dev, &alloc, s1);
    alloc.check_invariants().unwrap_or_else(|e| panic!("panic at {at:?}: {e}"));
    assert_eq!(dev.sim.violations(), vec![], "panic at {at:?}");
    assert_eq!(dev.sim.kernel_failures(), vec![], "panic at {at:?}");
    drop(alloc);
    dev.sim.synchronize().unwrap();
    if panicked != Some("destroy_graph") {
        assert_eq!(dev.sim.live_segments(), vec![], "panic at {at:?} ({panicked:?})");
        assert_eq!(dev.sim.live_events(), 0, "panic at {at:?} ({panicked:?})");
    }
    ops
}

#[test]
fn a_panicking_device_during_a_graph_capture_leaves_no_reuse_unordered() {
    let ops = run_capture(None, None);
    assert!(ops.contains(&"destroy_graph") && ops.contains(&"launch_graph"), "{ops:?}");
    sweep_points("capture", &ops, |at| drop(run_capture(Some(at), None)));
}

#[test]
fn the_checks_catch_memory_freed_under_an_undestroyed_graph() {
    let ops = run_capture(None, None);
    let freed = Broken::UndestroyedGraphFreed;
    let msg = caught_at(&ops, "destroy_graph", freed, |at, b| run_capture(Some(at), b));
    assert!(msg.contains("release of memory a CUDA graph uses"), "{msg}");
}

/// The deliberate bug: what a graph holds is leaked for good when the wait for its launches
/// panicked (the general pool's 1 MiB buffer freed during the capture keeps its segment).
#[test]
fn the_checks_catch_graph_holds_leaked_after_a_failed_wait() {
    let ops = run_capture(None, None);
    let leaked = Broken::GraphHoldsLeaked;
    let msg = caught_at(&ops, "synchronize", leaked, |at, b| run_capture(Some(at), b));
    assert!(msg.contains("left: [(0x7f0000000000, 2097152)]"), "{msg}");
}

/// The pinned allocator goes while the wait for a freed block's copy fails (every event query
/// panics): a device synchronisation waits for the copy instead and the block is freed. With
/// the deliberate bug the block is leaked.
#[test]
fn a_pinned_block_whose_wait_fails_is_freed_after_a_device_sync_as_the_allocator_goes() {
    for broken in [false, true] {
        let sim = SimConfig { capacity: 64 << 20, backed: true, ..SimConfig::default() };
        let dev = panic_dev_over(sim, None);
        let s1 = dev.sim.create_stream().unwrap();
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let host = HostAllocator::new(dev.clone());
        host.set_broken_drop_waits(broken);
        let dst = alloc.alloc(8192, s1).unwrap();
        let (open, gate) = mpsc::channel::<()>();
        dev.sim
            .launch(
                s1,
                Kernel::new("gate", vec![], move |_| {
                    let _ = gate.recv();
                }),
            )
            .unwrap();
        let mut up = host.alloc(5000).unwrap();
        up.upload(&dst).unwrap();
        drop(up); // pending behind its copy
        open.send(()).unwrap();
        *dev.always.lock().unwrap() = Some("query_event");
        drop(host);
        *dev.always.lock().unwrap() = None;
        let left = dev.sim.live_host_allocations().len();
        assert_eq!(left, usize::from(broken), "broken: {broken}");
        assert_eq!(dev.sim.violations(), vec![]);
    }
}
