//! `SimDevice`: an asynchronous device made of host memory, so that every test and the replayer
//! run anywhere.
//!
//! - [`memory`]: the fake address space (bump addresses from [`SIM_BASE`], never reused, optional
//!   host backing) and the kernels' checked view of it.
//! - [`stream`]: each stream is an in-order queue drained by its own worker thread; `launch`
//!   returns at once, events are positions in a queue, `wait_event` enqueues a device-side wait.
//! - [`sanitizer`]: the stream-order sanitizer (vector clocks over stream positions).
//! - [`vmm`]: virtual memory (address ranges, physical allocations, mappings) for expandable
//!   segments; the device's capacity counts segments and physical allocations together.
//! - `device_impl.rs`: the [`Device`](super::Device) trait over all of these, with the armed
//!   faults; `capture_launch.rs`: [`Capture`](super::Capture) and [`Launch`](super::Launch).
//!
//! ```text
//!   SimDevice ── Arc<Shared> ──┬── worker(stream 0) ─┐
//!                              ├── worker(stream 1) ─┤  all lock Shared::state and wait on
//!                              └── worker(stream …) ─┘  Shared::progress
//!   Shared { state: Mutex<State{mem, streams, events, counters, faults, san, failures}>,
//!            progress: Condvar }
//! ```
//!
//! Dropping the device drains every stream and joins every worker.

mod capture_launch;
mod device_impl;
mod graph;
mod host;
mod memory;
mod sanitizer;
mod stream;
mod vmm;

pub use graph::SimGraphCounters;
pub use host::SimHostCounters;
pub use memory::{SIM_ALIGN, SIM_BASE};
pub use vmm::{SIM_VM_GRANULARITY, VmCounters};

use super::{DeviceAddr, DeviceError, EventId, StreamId};
use crate::sync::{Arc, Condvar, Mutex, MutexGuard, lock, wait};
use memory::Memory;
use sanitizer::Sanitizer;
use std::collections::{BTreeMap, HashMap};
use stream::Stream;
use vmm::Vmm;

/// What a kernel's access to an unbacked device's memory answers ([`SimDevice::new`]: nothing
/// stands behind it), saying how to get a device whose kernels can touch memory.
// BROKEN (`unbacked_kernel_terse`): only that the memory is unbacked.
pub(crate) const UNBACKED_KERNEL: &str = if cfg!(tidepool_broken = "unbacked_kernel_terse") {
    "kernel on unbacked memory"
} else {
    "kernel on unbacked memory: this SimDevice has no bytes behind its memory; make it with \
     SimDevice::backed(capacity) (or SimConfig { backed: true, .. }) to run kernels"
};

/// How a [`SimDevice`] behaves.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Total device memory in bytes.
    pub capacity: u64,
    /// Back segments with host memory (needed by kernels; off for trace replay).
    pub backed: bool,
    /// Run the stream-order sanitizer (on by default; cheap when no kernels run).
    pub sanitize: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig { capacity: 8 << 30, backed: false, sanitize: true }
    }
}

/// Counters of every device call, for tests and reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Successful segment reservations (`cuMemAlloc`).
    pub mallocs: u64,
    /// Refused segment reservations (out of memory or injected).
    pub failed_mallocs: u64,
    /// Segment releases (`cuMemFree`).
    pub frees: u64,
    /// Host synchronisations: event/device synchronise and segment releases.
    pub host_syncs: u64,
    /// Events recorded.
    pub event_records: u64,
    /// Event queries.
    pub event_queries: u64,
    /// Device-side waits on events.
    pub event_waits: u64,
    /// Kernels launched.
    pub launches: u64,
}

/// A stream-order violation found by the sanitizer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// First byte of the offending range.
    pub ptr: DeviceAddr,
    /// Length of the offending range.
    pub bytes: u64,
    /// The stream that received or touched the memory.
    pub stream: StreamId,
    /// The stream whose unfinished work was on it, if any.
    pub other: Option<StreamId>,
    /// What happened (`"handout"`, `"kernel NAME"`, ...).
    pub op: String,
}

/// A kernel whose body panicked; the device caught the panic and carried on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelFailure {
    /// The stream the kernel ran on.
    pub stream: StreamId,
    /// The kernel's name.
    pub kernel: &'static str,
    /// The panic message.
    pub message: String,
}

#[derive(Default)]
struct Faults {
    /// Fail the Nth successful-looking malloc from now (1 = the next one).
    fail_nth_malloc: Option<u64>,
    /// Fail every malloc of more than this many bytes.
    fail_above: Option<u64>,
    /// Fail the Nth `create_event` from now.
    fail_nth_event_create: Option<u64>,
    /// Refuse the worker thread of the Nth stream made from now.
    fail_nth_stream_create: Option<u64>,
    /// Fail every event query.
    fail_event_query: bool,
    /// Event queries left to fail ([`SimDevice::fail_next_event_queries`]).
    fail_next_queries: u64,
    /// Fail every event record.
    fail_event_record: bool,
    /// Fail every device-side wait on an event.
    fail_event_wait: bool,
    /// Fail every host wait (`synchronize`, `synchronize_event`).
    fail_host_sync: bool,
    /// The event faults above panic instead of returning their error.
    panic: bool,
}

/// Everything under the device lock.
pub(super) struct State {
    mem: Memory,
    vm: Vmm,
    streams: BTreeMap<u32, Stream>,
    next_stream: u32,
    /// Event id → the (stream, position) of its latest record, if any.
    events: HashMap<u64, Option<(u32, u64)>>,
    next_event: u64,
    counters: SimCounters,
    faults: Faults,
    san: Sanitizer,
    failures: Vec<KernelFailure>,
    panic_on_violation: bool,
    /// Streams the application made ([`SimDevice::create_app_stream`]), and whether an
    /// allocator adopted them.
    app_streams: BTreeMap<u32, bool>,
    /// Pinned host memory (`host.rs`).
    host: host::HostMem,
    /// Stream captures underway and the graphs they made (`graph.rs`).
    graphs: graph::Graphs,
    /// Host threads waiting now in a synchronisation or a stream's destruction
    /// ([`SimDevice::blocked_host_waits`]).
    pub(super) host_waits: usize,
}

impl State {
    /// Has `stream` passed position `pos`? A destroyed stream was drained, so it has.
    fn reached(&self, stream: u32, pos: u64) -> bool {
        self.streams.get(&stream).is_none_or(|s| s.completed >= pos)
    }

    /// Is an event with this latest record complete?
    fn target_reached(&self, target: Option<(u32, u64)>) -> bool {
        target.is_none_or(|(s, p)| self.reached(s, p))
    }

    fn idle(&self) -> bool {
        self.streams.values().all(Stream::idle)
    }

    /// A stream that accepts work.
    fn open_stream(&mut self, stream: StreamId) -> Result<&mut Stream, DeviceError> {
        self.streams
            .get_mut(&stream.0)
            .filter(|s| !s.closing)
            .ok_or(DeviceError::UnknownStream(stream))
    }

    fn event(&self, event: EventId) -> Result<Option<(u32, u64)>, DeviceError> {
        self.events.get(&event.0).copied().ok_or(DeviceError::UnknownEvent(event))
    }

    /// Bytes the device's capacity is spent on: segments and physical allocations.
    fn used(&self) -> u64 {
        self.mem.reserved + self.vm.physical_bytes
    }
}

/// What the device and its workers share.
pub(super) struct Shared {
    state: Mutex<State>,
    /// Notified whenever work is enqueued or completes, or a stream closes.
    progress: Condvar,
    /// [`SimDevice::before_reclaim`]'s hook.
    reclaim_hook: Mutex<Option<ReclaimHook>>,
}

/// A function [`SimDevice::before_reclaim`] runs as the allocator tells the device it took
/// memory back: the address and bytes.
pub type ReclaimHook = Arc<dyn Fn(DeviceAddr, u64) + Send + Sync>;

/// A simulated asynchronous device. See the module docs.
pub struct SimDevice {
    /// Captures underway (`graph::Graphs::active`'s length, stored under the lock as it
    /// changes): `capture_underway` and `capture_of` answer without the lock while it is 0,
    /// which is what every allocator's hit path and free ask. Here, not in `shared`: one load
    /// from the device's own address (the workers never read it).
    captures: crate::sync::atomic::AtomicUsize,
    config: SimConfig,
    /// [`Device::ordinal`](super::Device::ordinal) ([`SimDevice::with_ordinal`]).
    ordinal: usize,
    shared: Arc<Shared>,
}

impl SimDevice {
    /// A device with `capacity` bytes, unbacked: nothing stands behind its memory, so it costs
    /// nothing (multi-GiB traces replay on a laptop), but kernels cannot touch it and pinned
    /// copies to or from it are refused ([`SimDevice::backed`] makes one that can).
    pub fn new(capacity: u64) -> SimDevice {
        SimDevice::with_config(SimConfig { capacity, ..SimConfig::default() })
    }

    /// A device with `capacity` bytes, backed by host memory so kernels can read and write it.
    pub fn backed(capacity: u64) -> SimDevice {
        SimDevice::with_config(SimConfig { capacity, backed: true, ..SimConfig::default() })
    }

    /// A device from a full configuration. Starts the default stream's worker.
    pub fn with_config(config: SimConfig) -> SimDevice {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                mem: Memory::new(),
                vm: Vmm::new(config.capacity),
                streams: BTreeMap::new(),
                next_stream: 1,
                app_streams: BTreeMap::new(),
                events: HashMap::new(),
                next_event: 1,
                counters: SimCounters::default(),
                faults: Faults::default(),
                san: Sanitizer::new(config.sanitize),
                failures: Vec::new(),
                panic_on_violation: false,
                host: host::HostMem::new(config.capacity),
                graphs: graph::Graphs::default(),
                host_waits: 0,
            }),
            progress: Condvar::new(),
            reclaim_hook: Mutex::new(None),
        });
        let captures = crate::sync::atomic::AtomicUsize::new(0);
        let dev = SimDevice { captures, config, ordinal: 0, shared };
        {
            let mut st = dev.state();
            // No device without its default stream; nothing to refuse yet.
            if let Err(e) = dev.start_stream(&mut st, StreamId::DEFAULT.0) {
                panic!("SimDevice::new: cannot start the default stream's worker thread: {e}");
            }
        }
        dev
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.shared.state)
    }

    /// Starts stream `id`'s worker. A refused thread is `cuStreamCreate`'s
    /// `CUDA_ERROR_OUT_OF_MEMORY` (the driver's answer when it has no room for a stream), and
    /// the stream is not made.
    fn start_stream(&self, st: &mut State, id: u32) -> Result<(), DeviceError> {
        let refuse = vmm::countdown(&mut st.faults.fail_nth_stream_create);
        st.streams.insert(id, Stream::new());
        match stream::spawn(Arc::clone(&self.shared), id, refuse) {
            Ok(handle) => {
                st.streams.get_mut(&id).expect("just inserted").handle = Some(handle);
                Ok(())
            }
            Err(_) => {
                st.streams.remove(&id);
                let code = DeviceError::CUDA_ERROR_OUT_OF_MEMORY;
                Err(DeviceError::Driver { op: "cuStreamCreate", code })
            }
        }
    }

    /// Waits (releasing the lock) until `done` holds.
    fn wait_until<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        done: impl Fn(&State) -> bool,
    ) -> MutexGuard<'a, State> {
        if done(&st) {
            return st;
        }
        st.host_waits += 1;
        while !done(&st) {
            st = wait(&self.shared.progress, st);
        }
        st.host_waits -= 1;
        st
    }

    /// Panics on the first of `found` if [`SimDevice::panic_on_violation`] is on. Call unlocked.
    fn after_check(found: Vec<Violation>, panic: bool) {
        if panic && let Some(v) = found.first() {
            panic!("stream-order violation: {v:?}");
        }
    }

    /// The device as device `ordinal` of its machine ([`Device::ordinal`](super::Device::ordinal):
    /// the `device` of the snapshots of an allocator on it; 0 unless set here).
    ///
    /// ```
    /// use tidepool::{Device, SimDevice};
    ///
    /// assert_eq!(SimDevice::new(1 << 30).with_ordinal(3).ordinal(), 3);
    /// ```
    pub fn with_ordinal(mut self, ordinal: usize) -> SimDevice {
        self.ordinal = ordinal;
        self
    }

    /// The device's configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Every call counted so far.
    pub fn counters(&self) -> SimCounters {
        self.state().counters
    }

    /// Live segments, as (address, bytes), in address order.
    pub fn live_segments(&self) -> Vec<(DeviceAddr, u64)> {
        self.state().mem.segments.iter().map(|(&a, s)| (DeviceAddr(a), s.bytes)).collect()
    }

    /// Bytes currently reserved.
    pub fn reserved_bytes(&self) -> u64 {
        self.state().mem.reserved
    }

    /// Streams that exist now (the default stream included), in id order.
    pub fn live_streams(&self) -> Vec<StreamId> {
        self.state().streams.iter().filter(|(_, s)| !s.closing).map(|(&i, _)| StreamId(i)).collect()
    }

    /// Numbers the next stream `n` ids later, as if `n` streams had been made and destroyed
    /// elsewhere meanwhile (ids are never reused), so tests reach high stream ids without
    /// starting and joining a worker thread for each.
    ///
    /// ```
    /// use tidepool::{Device, SimDevice};
    /// let dev = SimDevice::new(1 << 20);
    /// let a = dev.create_stream().unwrap();
    /// dev.skip_stream_ids(62);
    /// let b = dev.create_stream().unwrap();
    /// assert_eq!(b.0, a.0 + 63);
    /// assert!(!dev.has_stream(tidepool::StreamId(a.0 + 1)));
    /// ```
    pub fn skip_stream_ids(&self, n: u32) {
        let mut st = self.state();
        st.next_stream = st.next_stream.saturating_add(n);
    }

    /// Makes the `n`th malloc from now fail (`n` = 1: the next one). `None` clears it.
    pub fn fail_nth_malloc(&self, n: Option<u64>) {
        self.state().faults.fail_nth_malloc = n.filter(|&n| n > 0);
    }

    /// Makes every malloc of more than `bytes` fail. `None` clears it.
    pub fn fail_mallocs_above(&self, bytes: Option<u64>) {
        self.state().faults.fail_above = bytes;
    }

    /// Makes every event query fail while `on`.
    pub fn fail_event_queries(&self, on: bool) {
        self.state().faults.fail_event_query = on;
    }

    /// Makes the next `n` event queries fail (0: none), then queries answer again: a test
    /// lets an event "complete" between two given queries, in the middle of a lock section.
    pub fn fail_next_event_queries(&self, n: u64) {
        self.state().faults.fail_next_queries = n;
    }

    /// Runs `hook` (or none) at the start of every `note_reclaim`, before the sanitizer takes
    /// the memory back, on the thread that calls it: a test stops the allocator there to see
    /// what another thread can do meanwhile (the order of a reclaim and what makes the memory
    /// reusable).
    pub fn before_reclaim(&self, hook: Option<ReclaimHook>) {
        *lock(&self.shared.reclaim_hook) = hook;
    }

    /// Makes every `record_event` fail while `on` (an injected driver error).
    pub fn fail_event_records(&self, on: bool) {
        self.state().faults.fail_event_record = on;
    }

    /// Makes every `wait_event` fail while `on` (an injected driver error).
    pub fn fail_event_waits(&self, on: bool) {
        self.state().faults.fail_event_wait = on;
    }

    /// Makes every host wait (`synchronize`, `synchronize_event`) fail while `on`, without
    /// waiting (an injected driver error, as a device in trouble answers).
    pub fn fail_host_syncs(&self, on: bool) {
        self.state().faults.fail_host_sync = on;
    }

    /// While `on`, the injected event faults (`fail_event_records`, `fail_event_queries`,
    /// `fail_event_waits`, `fail_host_syncs`) panic instead of returning their error, as a
    /// [`Device`](crate::Device) that panics would (the allocators handle it as that call's
    /// failure: [`DeviceError::Panicked`]).
    pub fn panic_on_faults(&self, on: bool) {
        self.state().faults.panic = on;
    }

    /// An injected event fault of `op`: its error, or a panic (`panic_on_faults`), the device
    /// lock let go of first.
    fn event_fault<T>(st: MutexGuard<'_, State>, op: &'static str) -> Result<T, DeviceError> {
        let panic = st.faults.panic;
        drop(st);
        if panic {
            panic!("SimDevice: injected {op} panic (panic_on_faults)");
        }
        Err(DeviceError::Driver { op, code: DeviceError::CUDA_ERROR_UNKNOWN })
    }

    /// Events that exist now (created and not destroyed).
    pub fn live_events(&self) -> usize {
        self.state().events.len()
    }

    /// Host threads blocked now in a synchronisation (of the device, a stream, an event, a
    /// host copy) or a stream's destruction until work on the device completes: for a harness whose kernels wait on a
    /// gate it holds, to tell a step that waits for a gated kernel (a wait that stays
    /// blocked) from one that is merely slow (none).
    pub fn blocked_host_waits(&self) -> usize {
        self.state().host_waits
    }

    /// Stream-order violations found so far, in the order found.
    pub fn violations(&self) -> Vec<Violation> {
        self.state().san.violations().to_vec()
    }

    /// Makes every violation panic when it is found, on the thread that caused it (for a
    /// backtrace in tests). Off by default.
    pub fn panic_on_violation(&self, on: bool) {
        self.state().panic_on_violation = on;
    }

    /// Turns virtual memory support on (the default) or off; off, the device answers like one
    /// without it, so allocators fall back to ordinary segments. Set it before an allocator
    /// uses the device: an allocator asks once (a real device's answer never changes).
    pub fn set_virtual_memory(&self, on: bool) {
        self.state().vm.supported = on;
    }

    /// Sets the virtual-memory granularity (a power of two, at least [`SIM_ALIGN`]; default
    /// [`SIM_VM_GRANULARITY`], 2 MiB). Set it before anything is reserved or created.
    pub fn set_vm_granularity(&self, bytes: u64) {
        assert!(bytes.is_power_of_two() && bytes >= SIM_ALIGN, "granularity {bytes}");
        self.state().vm.granularity = bytes;
    }

    /// Sets how many bytes of virtual addresses may be reserved in all (default 1024 × the
    /// capacity, at least 1 TiB): virtual ranges cost nothing but are finite.
    pub fn set_virtual_capacity(&self, bytes: u64) {
        self.state().vm.virtual_capacity = bytes;
    }

    /// Every virtual-memory call counted so far.
    pub fn vm_counters(&self) -> VmCounters {
        self.state().vm.counters
    }

    /// Makes the `n`th `vm_create` from now fail with `CUDA_ERROR_OUT_OF_MEMORY`. `None` clears it.
    pub fn fail_nth_vm_create(&self, n: Option<u64>) {
        self.state().vm.faults.fail_nth_create = n.filter(|&n| n > 0);
    }

    /// Makes the `n`th `create_event` from now fail with `CUDA_ERROR_OUT_OF_MEMORY` (the driver
    /// has no room for another event). `None` clears it.
    pub fn fail_nth_event_create(&self, n: Option<u64>) {
        self.state().faults.fail_nth_event_create = n.filter(|&n| n > 0);
    }

    /// Makes the `n`th stream made from now ([`Device::create_stream`](super::Device::create_stream),
    /// [`SimDevice::create_app_stream`]) fail with `CUDA_ERROR_OUT_OF_MEMORY`, as it does when
    /// the system refuses the stream's worker thread. `None` clears it.
    pub fn fail_nth_stream_create(&self, n: Option<u64>) {
        self.state().faults.fail_nth_stream_create = n.filter(|&n| n > 0);
    }

    /// Makes the `n`th `vm_unmap` from now fail with `CUDA_ERROR_UNKNOWN` (the mapping stays).
    /// `None` clears it.
    pub fn fail_nth_vm_unmap(&self, n: Option<u64>) {
        self.state().vm.faults.fail_nth_unmap = n.filter(|&n| n > 0);
    }

    /// Makes the `n`th `vm_map` from now fail with `CUDA_ERROR_OUT_OF_MEMORY`. `None` clears it.
    pub fn fail_nth_vm_map(&self, n: Option<u64>) {
        self.state().vm.faults.fail_nth_map = n.filter(|&n| n > 0);
    }

    /// Bytes of live physical allocations (counted against the capacity with the segments).
    pub fn physical_bytes(&self) -> u64 {
        self.state().vm.physical_bytes
    }

    /// Physical allocations not yet freed.
    pub fn live_physical(&self) -> usize {
        self.state().vm.physical_count()
    }

    /// Bytes of virtual addresses reserved.
    pub fn virtual_bytes(&self) -> u64 {
        self.state().vm.virtual_reserved
    }

    /// Reserved virtual ranges, as (base, bytes), in address order.
    pub fn live_virtual_ranges(&self) -> Vec<(DeviceAddr, u64)> {
        self.state().vm.ranges()
    }

    /// Live mappings, as (address, bytes), in address order.
    pub fn live_mappings(&self) -> Vec<(DeviceAddr, u64)> {
        self.state().vm.mappings()
    }

    /// Live mappings with the physical allocation each maps, as (address, bytes, handle), in
    /// address order: two mappings of one handle are one piece of memory at two addresses (a
    /// stitched block and its home range).
    pub fn live_mappings_with_handles(&self) -> Vec<(DeviceAddr, u64, u64)> {
        self.state().vm.mappings_with_handles()
    }

    /// Counters of stream captures and graph launches.
    pub fn graph_counters(&self) -> SimGraphCounters {
        self.shared.graph_counters()
    }

    /// Kernels whose body panicked, in completion order.
    pub fn kernel_failures(&self) -> Vec<KernelFailure> {
        self.state().failures.clone()
    }
}

/// A stream the application made itself, outside any allocator: the simulator's stand-in for a
/// cudarc user's `Arc<CudaStream>`. Launch on it with [`AppStream::id`]; let an allocator use it
/// with [`SimDevice::adopt_stream`].
#[derive(Debug, PartialEq, Eq)]
pub struct AppStream {
    id: StreamId,
}

impl AppStream {
    /// The device's id of the stream (for launching the application's own kernels on it).
    pub fn id(&self) -> StreamId {
        self.id
    }
}

/// Streams the application owns (the same entry points as `CudaDevice`'s, for tests
/// without a GPU).
impl SimDevice {
    /// Makes a stream the way an application would, outside tidepool. Allocators do not know it
    /// until it is adopted.
    pub fn create_app_stream(&self) -> Result<AppStream, DeviceError> {
        let mut st = self.state();
        let id = st.next_stream;
        st.next_stream += 1;
        self.start_stream(&mut st, id)?;
        st.app_streams.insert(id, false);
        Ok(AppStream { id: StreamId(id) })
    }

    /// Lets allocators on this device use the application's stream: returns its [`StreamId`]
    /// (the same id when adopted again). Before the application destroys it, an allocator lets
    /// go of it with [`crate::Allocator::release_stream`].
    pub fn adopt_stream(&self, stream: &AppStream) -> Result<StreamId, DeviceError> {
        let mut st = self.state();
        match st.app_streams.get_mut(&stream.id.0) {
            Some(adopted) => {
                *adopted = true;
                Ok(stream.id)
            }
            None => Err(DeviceError::UnknownStream(stream.id)),
        }
    }

    /// The application destroys its stream (after draining it). An error, changing nothing,
    /// while an allocator still has it adopted: release it first.
    pub fn destroy_app_stream(&self, stream: AppStream) -> Result<(), DeviceError> {
        let app = self.state().app_streams.get(&stream.id.0).copied();
        match app {
            Some(true) => return Err(DeviceError::StreamAdopted(stream.id)),
            Some(false) => {}
            None => return Err(DeviceError::UnknownStream(stream.id)),
        }
        // Destroyed as a stream of the device's own: marked as such first.
        self.state().app_streams.remove(&stream.id.0);
        let r = super::Device::destroy_stream(self, stream.id);
        if r.is_err() {
            self.state().app_streams.insert(stream.id.0, false);
        }
        r
    }

    /// Drains an adopted stream and forgets the adoption.
    fn release_adopted(&self, stream: StreamId) -> Result<(), DeviceError> {
        let mut st = self.state();
        let target = st.open_stream(stream)?.next_pos() - 1;
        st.counters.host_syncs += 1;
        let mut st = self.wait_until(st, |st| st.reached(stream.0, target));
        st.app_streams.insert(stream.0, false);
        Ok(())
    }
}

impl Drop for SimDevice {
    /// Drains every stream and joins every worker.
    fn drop(&mut self) {
        let handles: Vec<_> = {
            let mut st = self.state();
            st.streams
                .values_mut()
                .filter_map(|s| {
                    s.closing = true;
                    s.handle.take()
                })
                .collect()
        };
        self.shared.progress.notify_all();
        for h in handles {
            // A worker never panics (kernel panics are caught); nothing to report if one did.
            let _ = h.join();
        }
    }
}

impl SimDevice {
    #[inline(never)]
    fn sanitize_handout(&self, ptr: DeviceAddr, bytes: u64, stream: StreamId) {
        let mut guard = self.state();
        let st = &mut *guard;
        let mut found = Vec::new();
        let (lo, hi) = (ptr.0, ptr.0.saturating_add(bytes));
        if bytes > 0 && st.vm.is_virtual(lo) {
            if !st.vm.mapped(lo, hi) {
                found.extend(st.san.flag(lo, hi, stream.0, None, "handout of unmapped memory"));
            }
            let aliases = st.vm.aliases(lo, hi);
            let op = "handout of physical memory also mapped elsewhere";
            found.extend(st.san.check_aliases(stream.0, &aliases, true, op));
            found.extend(st.san.alias_handed(stream.0, &aliases));
        } else if bytes > 0
            && !st.mem.contains(lo, hi)
            && !cfg!(tidepool_broken = "handout_bounds_unchecked")
        {
            // Memory of no live segment (a released one, a wild address) or spanning two
            // segments (adjacent here, as bump addresses make them, but not on a GPU): a block
            // no `cuMemAlloc` gave. BROKEN (`handout_bounds_unchecked`): not checked.
            let op = "handout of memory outside any live segment";
            found.extend(st.san.flag(lo, hi, stream.0, None, op));
        }
        found.extend(st.san.handout(ptr.0, bytes, stream.0));
        if !st.graphs.active.is_empty() && bytes > 0 {
            let op = "handout of memory an unordered branch of a captured graph uses";
            for (a, b, other) in st.graphs.unordered_handout(stream.0, lo, hi) {
                found.extend(st.san.flag(a, b, stream.0, Some(other), op));
            }
        }
        if !st.graphs.is_empty()
            && bytes > 0
            && !st.graphs.note(stream.0, lo, hi)
            && let Some((a, b)) = st.graphs.held(lo, hi)
        {
            // Memory a live graph's replays use, handed to work outside any capture.
            found.extend(st.san.flag(a, b, stream.0, None, "handout of memory a CUDA graph uses"));
        }
        let st = guard;
        let panic = st.panic_on_violation;
        drop(st);
        Self::after_check(found, panic);
    }

    #[inline(never)]
    fn sanitize_reclaim(&self, ptr: DeviceAddr, bytes: u64, stream: StreamId) {
        let mut st = self.state();
        let found = st.san.reclaim(ptr.0, bytes, stream.0);
        if !st.graphs.active.is_empty() {
            st.graphs.note(stream.0, ptr.0, ptr.0.saturating_add(bytes));
        }
        let panic = st.panic_on_violation;
        drop(st);
        Self::after_check(found, panic);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Launch;
    use crate::device::{Access, AccessKind, Device, Kernel};
    use std::time::Duration;

    #[test]
    fn drop_joins_every_worker() {
        let dev = SimDevice::new(1 << 20);
        for _ in 0..3 {
            let s = dev.create_stream().unwrap();
            dev.launch(s, Kernel::sleep(Duration::from_millis(50))).unwrap();
        }
        let weak = Arc::downgrade(&dev.shared);
        drop(dev);
        // Every worker held a strong reference until its thread ended.
        assert!(weak.upgrade().is_none());
    }

    #[test]
    fn destroy_stream_joins_its_worker() {
        let dev = SimDevice::new(1 << 20);
        let s = dev.create_stream().unwrap();
        assert_eq!(Arc::strong_count(&dev.shared), 3);
        dev.destroy_stream(s).unwrap();
        assert_eq!(Arc::strong_count(&dev.shared), 2);
    }

    #[test]
    fn sanitizer_memory_stays_bounded() {
        let dev = SimDevice::backed(1 << 20);
        let s = dev.create_stream().unwrap();
        let p = dev.reserve(1 << 16).unwrap();
        for i in 0..200u64 {
            let ptr = p.offset((i % 16) * 4096);
            dev.note_handout(ptr, 4096, s);
            let acc = vec![Access { ptr, bytes: 4096, kind: AccessKind::Write }];
            dev.launch(s, Kernel::new("w", acc, move |m| m.write(ptr, &[1]).unwrap())).unwrap();
            dev.note_reclaim(ptr, 4096, s);
        }
        dev.synchronize().unwrap();
        let st = dev.state();
        assert_eq!(st.san.pending_len(), 0, "completed work is dropped");
        assert_eq!(st.san.handed_len(), 0, "reclaimed ranges are dropped");
        assert!(st.san.violations().is_empty());
        drop(st);
        // Releasing a segment forgets what was still handed out in it (and reports it).
        dev.note_handout(p, 64, s);
        dev.release(p).unwrap();
        assert_eq!(dev.state().san.handed_len(), 0);
    }
}
