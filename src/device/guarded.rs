//! A [`Device`] whose calls cannot unwind into the allocator.
//!
//! [`Device`] is a public trait: an application may plug in its own, and any of its methods may
//! panic (a binding that `unwrap`s, an assertion in a wrapper). The allocator makes most device
//! calls in the middle of an operation (a block taken from the free index, a page about to be
//! mapped, an event about to be recorded) and often under its lock; a panic unwinding from there
//! would leave a half-done operation behind: a leaked segment, a page the page table thinks
//! mapped, a block counted as allocated that no buffer holds.
//!
//! So every call goes through [`Guarded`], which catches a panic at the call and answers it as
//! that call's failure, [`DeviceError::Panicked`] (the panic hook has already printed the
//! message): the allocator's error paths, which fault injection tests at every call, roll the
//! operation back and the error reaches the caller.
//!
//! ```text
//!  allocator ──▶ Guarded::reserve ──catch_unwind──▶ D::reserve
//!      ▲                 │ panicked
//!      └── Err(DeviceError::Panicked { op: "reserve", message }) ◀┘
//! ```
//!
//! The sanitizer hooks (`note_*`, which return nothing) are guarded too: a panic there is
//! dropped after the hook has printed it, as the hook could not have failed the operation.

use super::{
    AccessKind, Capture, Device, DeviceAddr, DeviceError, EventId, GraphId, HostPtr, MemInfo,
    PhysHandle, StreamId,
};
use crate::sync::Arc;
use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// The allocator's hold on its device: every call guarded against panics (module docs).
pub(crate) struct Guarded<D> {
    device: Arc<D>,
    /// [`Device::observes_handouts`], fixed for the device's life: the hooks are not called
    /// (nor guarded, which costs a few instructions per hand-out) where it is off.
    observes: bool,
    /// [`Device::ordinal`], fixed for the device's life (0 where it panicked).
    ordinal: usize,
    /// The deliberate bug `Broken::DevicePanicsUnwind` (feature `test-hooks`): panics unwind.
    #[cfg(feature = "test-hooks")]
    unwind: std::sync::atomic::AtomicBool,
    /// The deliberate bug `Broken::CaptureForks` (feature `test-hooks`): events are recorded
    /// on capturing streams too.
    #[cfg(feature = "test-hooks")]
    records_in_captures: std::sync::atomic::AtomicBool,
    /// The device's capture gate (see `capture_gate`).
    gate: std::sync::Arc<capture_gate::Gate>,
}

/// The text of a panic's payload (`panic!` with a literal or a formatted message).
fn message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

impl<D> Guarded<D> {
    /// Runs `f`, answering a panic as `DeviceError::Panicked` for `op`.
    #[inline]
    fn guard<T>(
        &self,
        op: &'static str,
        f: impl FnOnce() -> Result<T, DeviceError>,
    ) -> Result<T, DeviceError> {
        #[cfg(feature = "test-hooks")]
        if self.unwind.load(std::sync::atomic::Ordering::Relaxed) {
            return f(); // BROKEN: the panic unwinds through the allocator
        }
        // AssertUnwindSafe: after a panic only the device's own state may be inconsistent, and
        // the device is the panicking party; the allocator's state is not touched inside `f`.
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(r) => r,
            Err(payload) => Err(DeviceError::Panicked { op, message: message(&*payload) }),
        }
    }

    /// Runs `f` for a query with no error channel; a panic answers `fallback`.
    #[inline]
    fn guard_or<T>(&self, fallback: T, f: impl FnOnce() -> T) -> T {
        #[cfg(feature = "test-hooks")]
        if self.unwind.load(std::sync::atomic::Ordering::Relaxed) {
            return f(); // BROKEN: as in `guard`
        }
        catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
    }

    /// Turns the deliberate bug `Broken::DevicePanicsUnwind` on or off.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn set_unwind(&self, on: bool) {
        self.unwind.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Turns the deliberate bug `Broken::CaptureForks` on or off.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn set_records_in_captures(&self, on: bool) {
        self.records_in_captures.store(on, std::sync::atomic::Ordering::Relaxed);
    }
}

/// `Guarded` methods of the same names and signatures as [`Device`]'s fallible ones.
macro_rules! guarded {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        impl<D: Device> Guarded<D> {
            $(
                #[doc = concat!("[`Device::", stringify!($name), "`], guarded.")]
                #[inline]
                pub(crate) fn $name(&self, $($arg: $ty),*) -> Result<$ret, DeviceError> {
                    self.guard(stringify!($name), || self.device.$name($($arg),*))
                }
            )*
        }
    };
}

guarded! {
    reserve(bytes: u64) -> DeviceAddr;
    mem_info() -> MemInfo;
    create_event() -> EventId;
    destroy_event(event: EventId) -> ();
    wait_event(stream: StreamId, event: EventId) -> ();
    vm_granularity() -> u64;
    vm_reserve(bytes: u64) -> DeviceAddr;
    vm_free(base: DeviceAddr, bytes: u64) -> ();
    vm_create(bytes: u64) -> PhysHandle;
    vm_release(handle: PhysHandle) -> ();
    vm_map(va: DeviceAddr, bytes: u64, handle: PhysHandle) -> ();
    vm_unmap(va: DeviceAddr, bytes: u64) -> ();
    destroy_stream(stream: StreamId) -> ();
}

/// `Guarded` methods for the calls CUDA's global capture mode forbids while any capture is
/// underway on the device: refused here, before the device sees them, with the error CUDA
/// gives (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`). A forbidden call that reaches the driver
/// also *invalidates* every capture underway (the application's capture then fails to end,
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`), so the allocator must never make one, on any
/// path: an error path that "only tries" a host wait would break the capture.
macro_rules! refused_in_captures {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty, $op:literal;)*) => {
        impl<D: Device> Guarded<D> {
            $(
                #[doc = concat!("[`Device::", stringify!($name), "`], guarded, and refused while a capture is underway (`", $op, "`).")]
                #[inline]
                pub(crate) fn $name(&self, $($arg: $ty),*) -> Result<$ret, DeviceError> {
                    // A capture beginning counts as underway.
                    let Some(_inside) = self.gate.enter() else { return Err(DeviceError::capture_unsupported($op)) };
                    self.refuse_in_capture($op)?;
                    self.guard(stringify!($name), || self.device.$name($($arg),*))
                }
            )*
        }
    };
}

refused_in_captures! {
    release(ptr: DeviceAddr) -> (), "cuMemFree";
    query_event(event: EventId) -> bool, "cuEventQuery";
    synchronize_event(event: EventId) -> (), "cuEventSynchronize";
    synchronize() -> (), "cuCtxSynchronize";
}

/// Closes the race between a forbidden call and a capture that begins meanwhile, per device:
/// a forbidden call enters the device's gate before its check (`capture_underway`) and leaves
/// it after the call; a capture begins (through `Guarded::begin_capture`) only once no call is
/// inside, and while one is beginning, new forbidden calls are refused at once, as during the
/// capture (they never wait, so a thread that would let the calls inside finish, opening a
/// kernel's gate say, is not held up). Without it, one thread's event query that passed the
/// check reached the device just after another thread began a capture, which CUDA's global
/// mode answers by invalidating that capture (`two_captures_at_once_reuse_only_their_own_blocks`
/// failed in 16 of 60 release runs without a gate). A first, process-wide `RwLock` made every
/// device's calls wait behind a capture beginning on any device, and a call waiting there
/// could hold up the thread that was to end the wait it was in. Not under loom, whose models
/// make no such call. A capture the application begins on the device directly, not through an
/// allocator, is not covered: nothing tells the allocator it is about to begin.
mod capture_gate {
    #[cfg(not(loom))]
    use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};

    /// One device's gate.
    #[cfg(not(loom))]
    #[derive(Default)]
    pub(super) struct Gate {
        /// (forbidden calls inside, captures beginning)
        state: Mutex<(usize, usize)>,
        left: Condvar,
    }

    #[cfg(not(loom))]
    impl Gate {
        /// The gate of the device at `addr` (one per live device, shared by every `Guarded`
        /// of it).
        pub(super) fn of(addr: usize) -> Arc<Gate> {
            static GATES: Mutex<Vec<(usize, Weak<Gate>)>> = Mutex::new(Vec::new());
            let mut gates = GATES.lock().unwrap_or_else(PoisonError::into_inner);
            gates.retain(|(_, g)| g.strong_count() > 0);
            if let Some(g) = gates.iter().find(|(a, _)| *a == addr).and_then(|(_, g)| g.upgrade()) {
                return g;
            }
            let g = Arc::new(Gate::default());
            gates.push((addr, Arc::downgrade(&g)));
            g
        }

        /// A forbidden call enters: `None` while a capture is beginning (refuse the call).
        pub(super) fn enter(&self) -> Option<Inside<'_>> {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            // BROKEN (`capture_gate_open`): calls go in whatever begins.
            if st.1 > 0 && !cfg!(tidepool_broken = "capture_gate_open") {
                return None;
            }
            st.0 += 1;
            Some(Inside(self))
        }

        /// A capture begins once no forbidden call is inside (new ones are refused meanwhile).
        pub(super) fn begin(&self) -> Beginning<'_> {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.1 += 1;
            // BROKEN (`capture_gate_open`): the capture begins at once.
            while st.0 > 0 && !cfg!(tidepool_broken = "capture_gate_open") {
                st = self.left.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
            Beginning(self)
        }
    }

    /// A forbidden call inside the gate.
    #[cfg(not(loom))]
    pub(super) struct Inside<'a>(&'a Gate);

    #[cfg(not(loom))]
    impl Drop for Inside<'_> {
        fn drop(&mut self) {
            let mut st = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.0 -= 1;
            if st.0 == 0 {
                self.0.left.notify_all();
            }
        }
    }

    /// A capture beginning.
    #[cfg(not(loom))]
    pub(super) struct Beginning<'a>(&'a Gate);

    #[cfg(not(loom))]
    impl Drop for Beginning<'_> {
        fn drop(&mut self) {
            self.0.state.lock().unwrap_or_else(PoisonError::into_inner).1 -= 1;
        }
    }

    #[cfg(loom)]
    #[derive(Default)]
    pub(super) struct Gate;

    #[cfg(loom)]
    impl Gate {
        pub(super) fn of(_addr: usize) -> std::sync::Arc<Gate> {
            std::sync::Arc::new(Gate)
        }

        pub(super) fn enter(&self) -> Option<()> {
            Some(())
        }

        pub(super) fn begin(&self) {}
    }
}

impl<D: Device> Guarded<D> {
    /// `Err` for `op` while a capture is underway on the device (see `refused_in_captures!`).
    /// BROKEN (`capture_calls_unguarded`): the call goes to the device, which invalidates the
    /// captures underway.
    #[inline]
    fn refuse_in_capture(&self, op: &'static str) -> Result<(), DeviceError> {
        if !cfg!(tidepool_broken = "capture_calls_unguarded") && self.capture_underway() {
            return Err(DeviceError::capture_unsupported(op));
        }
        Ok(())
    }
}

impl<D: Capture> Guarded<D> {
    /// [`Capture::begin_capture`], guarded.
    pub(crate) fn begin_capture(&self, stream: StreamId) -> Result<(), DeviceError> {
        let _beginning = self.gate.begin();
        self.guard("begin_capture", || self.device.begin_capture(stream))
    }

    /// [`Capture::end_capture`], guarded.
    pub(crate) fn end_capture(&self, stream: StreamId) -> Result<GraphId, DeviceError> {
        self.guard("end_capture", || self.device.end_capture(stream))
    }

    /// [`Capture::launch_graph`], guarded.
    pub(crate) fn launch_graph(&self, graph: GraphId, stream: StreamId) -> Result<(), DeviceError> {
        self.guard("launch_graph", || self.device.launch_graph(graph, stream))
    }

    /// [`Capture::destroy_graph`], guarded.
    pub(crate) fn destroy_graph(&self, graph: GraphId) -> Result<(), DeviceError> {
        self.guard("destroy_graph", || self.device.destroy_graph(graph))
    }
}

impl<D: Device> Guarded<D> {
    /// Guards `device`.
    pub(crate) fn new(device: Arc<D>) -> Self {
        let observes =
            catch_unwind(AssertUnwindSafe(|| device.observes_handouts())).unwrap_or(true);
        let ordinal = catch_unwind(AssertUnwindSafe(|| device.ordinal())).unwrap_or(0);
        let gate = capture_gate::Gate::of(Arc::as_ptr(&device) as *const () as usize);
        Guarded {
            device,
            observes,
            ordinal,
            gate,
            #[cfg(feature = "test-hooks")]
            unwind: std::sync::atomic::AtomicBool::new(false),
            #[cfg(feature = "test-hooks")]
            records_in_captures: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The device itself, for the application ([`crate::Allocator::device`]) and for calls
    /// the allocator makes outside any operation of its own.
    pub(crate) fn arc(&self) -> &Arc<D> {
        &self.device
    }

    /// [`Device::ordinal`], as read when the allocator was made.
    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// [`Device::name`]; a panic names it so.
    pub(crate) fn name(&self) -> String {
        self.guard_or("a device whose name() panicked".to_string(), || self.device.name())
    }

    /// [`Device::has_stream`]; a panic answers no (the stream is refused).
    pub(crate) fn has_stream(&self, stream: StreamId) -> bool {
        self.guard_or(false, || self.device.has_stream(stream))
    }

    /// [`Device::is_adopted`]; a panic answers no.
    pub(crate) fn is_adopted(&self, stream: StreamId) -> bool {
        self.guard_or(false, || self.device.is_adopted(stream))
    }

    /// [`Device::capture_underway`]; a panic answers yes, the answer under which the allocator
    /// makes no call a capture forbids (no sync, no query, no release).
    pub(crate) fn capture_underway(&self) -> bool {
        self.guard_or(true, || self.device.capture_underway())
    }

    /// [`Device::capture_of`]; a panic answers the stream itself (captured: nothing CUDA
    /// forbids in a capture is done there).
    pub(crate) fn capture_of(&self, stream: StreamId) -> Option<StreamId> {
        self.guard_or(Some(stream), || self.device.capture_of(stream))
    }

    /// [`Device::capture_mark`]; a panic answers `None` (no mark: nothing is reused early).
    pub(crate) fn capture_mark(&self, stream: StreamId) -> Option<super::CaptureMark> {
        self.guard_or(None, || self.device.capture_mark(stream))
    }

    /// [`Device::capture_ordered_after`]; a panic answers no (the block stays held).
    pub(crate) fn capture_ordered_after(&self, stream: StreamId, mark: super::CaptureMark) -> bool {
        self.guard_or(false, || self.device.capture_ordered_after(stream, mark))
    }

    /// [`Device::record_event`], guarded, and refused on a capturing stream
    /// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, as before CUDA 11's fork and join): there the
    /// record would be a node of the graph and a wait on it would pull the waiting stream into
    /// the capture. The allocator records events only to order memory reuse, which a capture
    /// orders by itself (its frees are held back until the graph goes).
    pub(crate) fn record_event(&self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        #[cfg(feature = "test-hooks")]
        let forks = self.records_in_captures.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(feature = "test-hooks"))]
        let forks = false;
        if !forks && self.capture_of(stream).is_some() {
            return Err(DeviceError::capture_unsupported("cuEventRecord"));
        }
        self.guard("record_event", || self.device.record_event(event, stream))
    }

    /// [`Device::record_event`] on a capturing stream, for a wait by another stream of the
    /// same capture only (an edge within the graph: no stream outside it waits on the event,
    /// so none is pulled into the capture). [`Guarded::record_event`] refuses the rest.
    pub(crate) fn record_event_in_capture(
        &self,
        event: EventId,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        self.guard("record_event", || self.device.record_event(event, stream))
    }

    /// [`Device::memory_domain`]; a panic answers `None` (the object is its own memory).
    #[cfg_attr(loom, allow(dead_code))] // (no peers list under loom)
    pub(crate) fn memory_domain(&self) -> Option<u64> {
        self.guard_or(None, || self.device.memory_domain())
    }

    /// [`Device::supports_virtual_memory`]; a panic answers no (ordinary segments).
    pub(crate) fn supports_virtual_memory(&self) -> bool {
        self.guard_or(false, || self.device.supports_virtual_memory())
    }

    /// [`Device::observes_handouts`], as asked once (a panic answered yes).
    pub(crate) fn observes_handouts(&self) -> bool {
        self.observes
    }

    /// [`Device::note_handout`], where the device observes hand-outs; a panic is dropped.
    #[inline]
    pub(crate) fn note_handout(&self, ptr: DeviceAddr, bytes: u64, stream: StreamId) {
        if self.observes {
            self.guard_or((), || self.device.note_handout(ptr, bytes, stream))
        }
    }

    /// [`Device::host_alloc`], guarded.
    pub(crate) fn host_alloc(&self, bytes: u64) -> Result<HostPtr, DeviceError> {
        self.guard("host_alloc", || self.device.host_alloc(bytes))
    }

    /// [`Device::host_capacity`]; a panic answers `None` (unknown: every request may fit).
    pub(crate) fn host_capacity(&self) -> Option<u64> {
        self.guard_or(None, || self.device.host_capacity())
    }

    /// [`Device::host_free`], guarded.
    ///
    /// # Safety
    /// As [`Device::host_free`].
    pub(crate) unsafe fn host_free(&self, ptr: HostPtr) -> Result<(), DeviceError> {
        // SAFETY: the caller keeps `Device::host_free`'s contract, forwarded unchanged.
        self.guard("host_free", || unsafe { self.device.host_free(ptr) })
    }

    /// [`Device::memcpy_htod_async`], guarded.
    ///
    /// # Safety
    /// As [`Device::memcpy_htod_async`].
    pub(crate) unsafe fn memcpy_htod_async(
        &self,
        dst: DeviceAddr,
        src: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller keeps `Device::memcpy_htod_async`'s contract, forwarded unchanged.
        self.guard("memcpy_htod_async", || unsafe {
            self.device.memcpy_htod_async(dst, src, bytes, stream)
        })
    }

    /// [`Device::memcpy_dtoh_async`], guarded.
    ///
    /// # Safety
    /// As [`Device::memcpy_dtoh_async`].
    pub(crate) unsafe fn memcpy_dtoh_async(
        &self,
        dst: HostPtr,
        src: DeviceAddr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller keeps `Device::memcpy_dtoh_async`'s contract, forwarded unchanged.
        self.guard("memcpy_dtoh_async", || unsafe {
            self.device.memcpy_dtoh_async(dst, src, bytes, stream)
        })
    }

    /// [`Device::note_host_access`]; a panic is dropped (module docs).
    pub(crate) fn note_host_access(&self, ptr: HostPtr, bytes: u64, kind: AccessKind) {
        self.guard_or((), || self.device.note_host_access(ptr, bytes, kind))
    }

    /// [`Device::note_reclaim`], where the device observes hand-outs; a panic is dropped.
    #[inline]
    pub(crate) fn note_reclaim(&self, ptr: DeviceAddr, bytes: u64, stream: StreamId) {
        if self.observes {
            self.guard_or((), || self.device.note_reclaim(ptr, bytes, stream))
        }
    }
}
