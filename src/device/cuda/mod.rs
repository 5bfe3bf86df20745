//! `CudaDevice`: the [`Device`] trait over a real GPU, through cudarc's driver API (feature
//! `cuda`). cudarc is built with `dynamic-loading`, so this compiles with no CUDA installed and
//! [`CudaDevice::new`] answers an error — never a panic — where there is no driver or no GPU.
//!
//! Layers, as in cudarc (`sys` → `result` → safe):
//!
//! ```text
//!   cudarc::driver::sys ── raw FFI
//!        │
//!   result.rs ─────────── one thin fn per driver call → Result<_, DeviceError>
//!        │
//!   CudaDevice ────────── ids → handles: StreamId → Arc<CudaStream>, EventId → pooled CUevent,
//!        │                live segments (ptr → bytes); binds its context before every call
//!   interop/cuda_buffer.rs  CudaBuffer<T> (above the allocator): a tidepool Buffer as a cudarc slice
//! ```
//!
//! Choices:
//! - [`StreamId::DEFAULT`] is the context's null stream (cudarc's `CudaContext::default_stream`),
//!   as PyTorch's default stream is; so work a cudarc user puts on `ctx.default_stream()` and
//!   tidepool's default stream share one queue. Streams from [`Device::create_stream`] are
//!   non-blocking (`CU_STREAM_NON_BLOCKING`): they never synchronise implicitly with the null
//!   stream, so the only cross-stream ordering is the events the allocator records.
//! - Events are created with `CU_EVENT_DISABLE_TIMING` and pooled: [`Device::destroy_event`]
//!   returns the handle to the pool and the next [`Device::create_event`] reuses it; handles are
//!   destroyed when the device is dropped.
//! - [`Device::release`] synchronises the context before `cuMemFree`, so a segment is never freed
//!   under unfinished work (the trait promises the synchronisation `cuMemFree` may do anyway).
//! - Captures begin in CUDA's global mode, which refuses `cuMemAlloc` (and the virtual-memory
//!   calls that grow an expandable segment) from every thread while they last: those run with
//!   the thread's capture mode relaxed (`result::relaxed_capture_mode`, PyTorch's
//!   `cudaMallocMaybeCapturing`), so a graph's private pool can grow during its capture and
//!   other threads can allocate beside it. Frees, unmaps and synchronisations stay refused; the
//!   allocator makes none during a capture.
//! - It implements [`Device`] only, not [`super::Launch`] (host kernel closures): real kernels are
//!   launched through cudarc on [`CudaDevice::stream`], with `CudaBuffer` arguments.
//! - `cuMemAlloc` guarantees 256-byte alignment; the trait promises 512. Segments the allocator
//!   reserves are ≥ 2 MiB and land on the driver's 2 MiB pages, and a pointer that is not 512-byte
//!   aligned is freed again and reported as an error rather than handed on.
//! - Virtual memory (expandable segments): `cuMemGetAllocationGranularity` (recommended, pinned
//!   device memory), `cuMemAddressReserve`/`cuMemAddressFree`, `cuMemCreate`/`cuMemRelease`,
//!   `cuMemMap` + `cuMemSetAccess`/`cuMemUnmap`, one call per trait method; supported where the
//!   device reports `VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`. Ranges, allocations and mappings are
//!   tracked, so a dropped device returns what an allocator left.
//! - Locks are `std::sync`, not the `crate::sync` shim: driver calls cannot run under loom, so this
//!   device is never modelled (and the `cuda` feature is not combined with `--cfg loom`).

mod capture_order;
mod graph;
pub(crate) mod result;

use super::{Device, DeviceAddr, DeviceError, EventId, HostPtr, MemInfo, PhysHandle, StreamId};
use cudarc::driver::{CudaContext, CudaStream, DriverError, sys};
use result::RawEvent;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// What [`CudaDevice::new`] says where the driver library cannot be loaded.
pub const NO_DRIVER: &str = "no CUDA driver (libcuda not found)";

/// Alignment the [`Device`] trait promises for segment addresses.
const SEGMENT_ALIGN: u64 = 512;

/// A GPU as a tidepool [`Device`]: `cuMemAlloc`/`cuMemFree` segments, non-blocking streams and
/// pooled events on one device's primary context. `Send + Sync`; share it by `Arc`.
///
/// ```no_run
/// use tidepool::{Allocator, Config, CudaDevice, StreamId};
///
/// let device = CudaDevice::new(0)?; // Err (with the reason) where there is no driver or GPU
/// let alloc = Allocator::new(device, Config::default())?;
/// let buf = alloc.alloc(1 << 20, StreamId::DEFAULT)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    name: String,
    streams: Mutex<Streams>,
    events: Mutex<Events>,
    /// Live segments: address → bytes.
    segments: Mutex<HashMap<u64, u64>>,
    /// Live pinned host allocations (`cuMemHostAlloc`): address → (pointer, bytes).
    host: Mutex<HashMap<usize, (HostPtr, u64)>>,
    /// Virtual memory: support and granularity (asked once), live ranges, allocations, mappings.
    vm_support: OnceLock<Option<u64>>,
    vm: Mutex<CudaVm>,
    /// Stream captures underway and live graphs (`graph.rs`).
    graphs: Mutex<graph::CudaGraphs>,
    /// Whether `graphs` has a capture underway, stored under its lock as captures begin and
    /// end: [`Device::capture_underway`] is one load (every allocator's hit path asks it).
    capturing: std::sync::atomic::AtomicBool,
}

/// What the virtual-memory calls made and have not undone.
#[derive(Default)]
struct CudaVm {
    /// Reserved ranges: base → bytes.
    ranges: HashMap<u64, u64>,
    /// Physical allocations not released: handle → bytes.
    handles: HashMap<u64, u64>,
    /// Mappings: address → (bytes, handle).
    mappings: HashMap<u64, (u64, u64)>,
}

/// The next stream id of any [`CudaDevice`] in the process (0 is every device's default
/// stream). One sequence for all: a stream of one GPU, or of one `CudaDevice` handle, is unknown
/// to every other ([`DeviceError::UnknownStream`]) rather than that device's stream of the same
/// number, on which an allocator would then order the work instead.
static NEXT_STREAM_ID: AtomicU32 = AtomicU32::new(1);

struct Streams {
    /// The device's own count of the streams it made (the id under broken build
    /// `stream_ids_per_device`).
    made: u32,
    live: HashMap<u32, Arc<CudaStream>>,
    /// Ids of streams the application owns (adopted, not created here).
    adopted: HashSet<u32>,
}

impl Streams {
    /// An id for a stream this device makes or adopts: the next of [`NEXT_STREAM_ID`].
    fn new_id(&mut self) -> Result<u32, DeviceError> {
        self.made = self.made.saturating_add(1);
        // BROKEN (`stream_ids_per_device`): each device numbered its streams from 1, and
        // another device's stream id named one of its own.
        if cfg!(tidepool_broken = "stream_ids_per_device") {
            return Ok(self.made);
        }
        NEXT_STREAM_ID
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_add(1))
            .map_err(|_| DeviceError::Unsupported("more than 2^32 - 1 streams in this process"))
    }
}

struct Events {
    next: u64,
    live: HashMap<u64, EventSlot>,
    /// Destroyed events' handles, ready for reuse.
    pool: Vec<RawEvent>,
}

struct EventSlot {
    raw: RawEvent,
    /// Recorded (outside a capture) since it was created; a never-recorded event is complete.
    recorded: bool,
    /// Last recorded on a capturing stream: a node of that capture, which a wait on it joins
    /// (fork); complete once that capture is over.
    captured: Option<capture_order::CapturedEvent>,
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<CudaDevice>();
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock carries no broken invariant here: no user code runs under these locks.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn driver_error(op: &'static str, e: DriverError) -> DeviceError {
    DeviceError::Driver { op, code: e.0 as u32 }
}

impl CudaDevice {
    /// Whether the CUDA driver library (`libcuda`) can be loaded. Checked once per process,
    /// before any driver call (cudarc panics when a call finds no library).
    pub fn driver_present() -> bool {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        // SAFETY: loading the driver library runs its initialisers and nothing else; libcuda is
        // the system's NVIDIA driver, meant to be loaded into any process.
        *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
    }

    /// Number of CUDA devices. An error (no panic) without a driver library ([`NO_DRIVER`]) or
    /// when the driver does not initialise (`cuInit` fails, e.g. `CUDA_ERROR_NO_DEVICE`).
    pub fn device_count() -> Result<usize, DeviceError> {
        if !Self::driver_present() {
            return Err(DeviceError::Unavailable(NO_DRIVER.into()));
        }
        let n = CudaContext::device_count().map_err(|e| {
            DeviceError::Unavailable(format!(
                "no usable CUDA device: cuInit/cuDeviceGetCount failed ({})",
                driver_error("cuDeviceGetCount", e)
            ))
        })?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Why no GPU can be used here (`None` when device 0 exists). Tests and examples print it
    /// when they skip.
    pub fn unavailable_reason() -> Option<String> {
        match Self::device_count() {
            Ok(0) => Some("no CUDA device (the driver reports 0 devices)".into()),
            Ok(_) => None,
            Err(DeviceError::Unavailable(msg)) => Some(msg),
            Err(e) => Some(e.to_string()),
        }
    }

    /// The device with this ordinal, on its primary context. Errors, never panics, where the
    /// driver library is missing ([`NO_DRIVER`]), the driver does not initialise, or `ordinal`
    /// does not exist.
    pub fn new(ordinal: usize) -> Result<Arc<CudaDevice>, DeviceError> {
        let count = Self::device_count()?;
        if ordinal >= count {
            return Err(DeviceError::Unavailable(format!(
                "no CUDA device {ordinal} (the driver reports {count} device(s))"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("CudaContext::new", e))?;
        let name = ctx.name().map_err(|e| driver_error("cuDeviceGetName", e))?;
        let default = ctx.default_stream();
        Ok(Arc::new(CudaDevice {
            ctx,
            name,
            streams: Mutex::new(Streams {
                made: 0,
                live: HashMap::from([(0, default)]),
                adopted: HashSet::new(),
            }),
            events: Mutex::new(Events { next: 0, live: HashMap::new(), pool: Vec::new() }),
            segments: Mutex::new(HashMap::new()),
            host: Mutex::new(HashMap::new()),
            vm_support: OnceLock::new(),
            vm: Mutex::new(CudaVm::default()),
            graphs: Mutex::new(graph::CudaGraphs::default()),
            capturing: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// The cudarc context (the device's primary context) this device works in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The cudarc stream behind a tidepool stream id, to launch kernels, copies and cuBLAS calls
    /// on. [`StreamId::DEFAULT`] is the null stream. The `Arc` keeps the stream alive even after
    /// [`Device::destroy_stream`].
    pub fn stream(&self, id: StreamId) -> Result<Arc<CudaStream>, DeviceError> {
        lock(&self.streams).live.get(&id.0).cloned().ok_or(DeviceError::UnknownStream(id))
    }

    /// Lets tidepool use a stream the application made with cudarc: returns its [`StreamId`]
    /// (the same id when adopted again, or the id tidepool already uses for it). Allocation,
    /// freeing, `record_stream` and cross-stream reuse then work on it as on tidepool's own.
    /// The device holds an `Arc` to it until an allocator lets go of it with
    /// [`crate::Allocator::release_stream`] (which drains it); the application destroys it after.
    ///
    /// An error where the stream belongs to another context (device).
    ///
    /// ```no_run
    /// use tidepool::{Allocator, Config, CudaBuffer, CudaDevice};
    ///
    /// let device = CudaDevice::new(0)?;
    /// let alloc = Allocator::new(device.clone(), Config::default())?;
    /// let stream = device.context().new_stream()?;       // the application's own stream
    /// let id = device.adopt_stream(&stream)?;
    /// let x = CudaBuffer::<f32>::alloc_zeros(&alloc, 1024, id)?;
    /// let host = stream.clone_dtoh(&x)?;                   // any cudarc call on `stream`
    /// assert_eq!(host, vec![0.0; 1024]);
    /// drop(x);
    /// alloc.release_stream(id)?;                           // before the application drops it
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn adopt_stream(&self, stream: &Arc<CudaStream>) -> Result<StreamId, DeviceError> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(DeviceError::Unsupported("adopting a stream of another CUDA context"));
        }
        let mut streams = lock(&self.streams);
        if let Some((&id, _)) =
            streams.live.iter().find(|(_, s)| s.cu_stream() == stream.cu_stream())
        {
            return Ok(StreamId(id));
        }
        let id = streams.new_id()?;
        streams.live.insert(id, stream.clone());
        streams.adopted.insert(id);
        Ok(StreamId(id))
    }

    /// [`CudaDevice::adopt_stream`] for a raw `CUstream` owned by another library.
    ///
    /// # Safety
    /// `cu_stream` must be a valid stream of this device's primary context, and its owner must
    /// keep it alive until an allocator has let go of it ([`crate::Allocator::release_stream`]).
    pub unsafe fn adopt_raw_stream(
        &self,
        cu_stream: sys::CUstream,
    ) -> Result<StreamId, DeviceError> {
        // SAFETY: the caller guarantees the stream is valid in this context and outlives its use
        // here; the wrapper does not destroy the stream when dropped.
        let wrapped = unsafe { self.ctx.wrap_borrowed_stream(cu_stream) };
        self.adopt_stream(&wrapped)
    }

    /// The tidepool id of a cudarc stream this device created or adopted (or of the null stream).
    /// A stream of another context is none of them, whatever its handle (every context's
    /// legacy default stream is the null handle).
    pub fn stream_id(&self, stream: &CudaStream) -> Option<StreamId> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return None;
        }
        let streams = lock(&self.streams);
        streams
            .live
            .iter()
            .find(|(_, s)| s.cu_stream() == stream.cu_stream())
            .map(|(&id, _)| StreamId(id))
    }

    /// Segments reserved and not released, by address: what tests check for leaks.
    pub fn live_segments(&self) -> Vec<(DeviceAddr, u64)> {
        let mut v: Vec<_> =
            lock(&self.segments).iter().map(|(&p, &b)| (DeviceAddr(p), b)).collect();
        v.sort();
        v
    }

    /// Bytes in live segments.
    pub fn reserved_bytes(&self) -> u64 {
        lock(&self.segments).values().sum()
    }

    /// The device ordinal as the driver's `int`.
    fn ordinal_c(&self) -> std::ffi::c_int {
        std::ffi::c_int::try_from(self.ordinal()).unwrap_or(std::ffi::c_int::MAX)
    }

    /// The virtual-memory granularity, where the device supports virtual memory management
    /// (asked once).
    fn vm_page(&self) -> Option<u64> {
        *self.vm_support.get_or_init(|| {
            let attr =
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
            let supported = self.ctx.attribute(attr).is_ok_and(|v| v != 0);
            if !supported || self.bind().is_err() {
                return None;
            }
            result::mem_granularity(self.ordinal_c()).ok().filter(|&g| g > 0)
        })
    }

    /// Makes this device's context current on the calling thread (the driver's per-thread state).
    pub(crate) fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("ordinal", &self.ordinal())
            .field("streams", &lock(&self.streams).live.len())
            .field("live_segments", &lock(&self.segments).len())
            .finish()
    }
}

impl Drop for CudaDevice {
    /// Waits for the device, frees segments still reserved and destroys every event. Errors are
    /// ignored: there is no one to report them to, and the context outlives this call.
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        let _ = result::ctx_synchronize();
        self.destroy_graphs();
        let mut vm = lock(&self.vm);
        for (va, (bytes, _)) in vm.mappings.drain() {
            // SAFETY: a mapping made by `vm_map` in this context; the device is idle and nothing
            // can use it any more (buffers hold the allocator, which holds the device).
            let _ = unsafe { result::mem_unmap(va, bytes) };
        }
        for (h, _) in vm.handles.drain() {
            // SAFETY: a live allocation from `vm_create`, released once here, now unmapped.
            let _ = unsafe { result::mem_release(h) };
        }
        for (base, bytes) in vm.ranges.drain() {
            // SAFETY: a whole reservation from `vm_reserve` with nothing mapped in it any more.
            let _ = unsafe { result::mem_address_free(base, bytes) };
        }
        drop(vm);
        for (ptr, _) in lock(&self.segments).drain() {
            // SAFETY: `ptr` came from `mem_alloc` in this context; the device is idle and no
            // buffer can outlive the device (buffers hold the allocator, which holds the device).
            let _ = unsafe { result::mem_free(ptr) };
        }
        for (_, (ptr, _)) in lock(&self.host).drain() {
            // SAFETY: `ptr` came from `mem_host_alloc`; the device is idle, and no pinned buffer
            // outlives the device (buffers hold their allocator, which holds the device).
            let _ = unsafe { result::mem_free_host(ptr) };
        }
        let mut events = lock(&self.events);
        let live: Vec<RawEvent> = events.live.drain().map(|(_, s)| s.raw).collect();
        for raw in live.into_iter().chain(events.pool.drain(..)) {
            // SAFETY: each handle was created in this context, is held once, and is dropped here.
            let _ = unsafe { result::event_destroy(raw) };
        }
        // Streams drop with `self.streams`: cudarc destroys each one it created once the last
        // `Arc` to it goes.
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn ordinal(&self) -> usize {
        CudaDevice::ordinal(self)
    }

    /// Whether a capture `begin_capture` started has not ended (no driver call, no lock).
    #[inline]
    fn capture_underway(&self) -> bool {
        self.capturing_any()
    }

    /// From the streams `begin_capture` started capturing and those that joined them through
    /// [`Device::wait_event`] here (no driver call).
    fn capture_of(&self, stream: StreamId) -> Option<StreamId> {
        self.capture_origin(stream)
    }

    /// From the capture order: the next event recorded on `stream` covers the mark (no driver
    /// call). Work launched through cudarc on a captured stream is covered too: the mark stands
    /// for everything enqueued on the stream before it.
    fn capture_mark(&self, stream: StreamId) -> Option<crate::device::CaptureMark> {
        self.mark_of(stream)
    }

    /// From the capture order (the waits made through [`Device::wait_event`] here).
    fn capture_ordered_after(&self, stream: StreamId, mark: crate::device::CaptureMark) -> bool {
        self.ordered_after(stream, mark)
    }

    /// `cuMemAlloc`; the driver's out-of-memory answer is [`DeviceError::OutOfMemory`].
    fn reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError> {
        if bytes == 0 {
            return Err(DeviceError::Unsupported("reserving a segment of 0 bytes"));
        }
        self.bind()?;
        let ptr = result::relaxed_capture_mode(|| result::mem_alloc(bytes))?;
        if !ptr.is_multiple_of(SEGMENT_ALIGN) {
            // SAFETY: just allocated in the current context; never handed out.
            unsafe { result::mem_free(ptr) }?;
            return Err(DeviceError::Unsupported(
                "cuMemAlloc returned a pointer that is not 512-byte aligned",
            ));
        }
        lock(&self.segments).insert(ptr, bytes);
        Ok(DeviceAddr(ptr))
    }

    /// Synchronises the context (a host sync), then `cuMemFree`.
    fn release(&self, ptr: DeviceAddr) -> Result<(), DeviceError> {
        let bytes = lock(&self.segments).remove(&ptr.0).ok_or(DeviceError::UnknownSegment(ptr))?;
        let freed = self.bind().and_then(|()| result::ctx_synchronize()).and_then(|()| {
            // SAFETY: `ptr` is a live segment of this context (just taken out of `segments`, so
            // no other release frees it), and the context is idle, so no device work uses it.
            unsafe { result::mem_free(ptr.0) }
        });
        if freed.is_err() {
            lock(&self.segments).insert(ptr.0, bytes);
        }
        freed
    }

    fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        self.bind()?;
        result::mem_get_info()
    }

    /// A new non-blocking stream (cudarc's `CudaContext::new_stream`).
    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        let stream = self.ctx.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?;
        let mut streams = lock(&self.streams);
        let id = streams.new_id()?;
        streams.live.insert(id, stream);
        Ok(StreamId(id))
    }

    /// Forgets the stream, then waits for its work. cudarc destroys it when the last `Arc` from
    /// [`CudaDevice::stream`] goes.
    /// An adopted stream is drained and forgotten the same way; its owner destroys it.
    fn destroy_stream(&self, stream: StreamId) -> Result<(), DeviceError> {
        if stream == StreamId::DEFAULT {
            return Err(DeviceError::Unsupported("destroying the default stream"));
        }
        let s = {
            let mut streams = lock(&self.streams);
            streams.adopted.remove(&stream.0);
            streams.live.remove(&stream.0).ok_or(DeviceError::UnknownStream(stream))?
        };
        self.bind()?;
        // SAFETY: `s` is a live stream of this context, kept alive by the `Arc` we hold.
        unsafe { result::stream_synchronize(s.cu_stream()) }
    }

    fn is_adopted(&self, stream: StreamId) -> bool {
        lock(&self.streams).adopted.contains(&stream.0)
    }

    fn has_stream(&self, stream: StreamId) -> bool {
        lock(&self.streams).live.contains_key(&stream.0)
    }

    /// A pooled `CU_EVENT_DISABLE_TIMING` event, or a new one.
    fn create_event(&self) -> Result<EventId, DeviceError> {
        let mut events = lock(&self.events);
        let raw = match events.pool.pop() {
            Some(raw) => raw,
            None => {
                self.bind()?;
                result::event_create()?
            }
        };
        let id = events.next;
        events.next += 1;
        events.live.insert(id, EventSlot { raw, recorded: false, captured: None });
        Ok(EventId(id))
    }

    /// Returns the handle to the pool (it stays valid until the device is dropped).
    fn destroy_event(&self, event: EventId) -> Result<(), DeviceError> {
        let mut events = lock(&self.events);
        let slot = events.live.remove(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
        events.pool.push(slot.raw);
        Ok(())
    }

    /// `cuEventRecord`. On a capturing stream the record is a node of the capture (CUDA's
    /// fork): a stream outside any capture that waits on the event joins it.
    fn record_event(&self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        let s = self.stream(stream)?;
        let mut events = lock(&self.events);
        let slot = events.live.get_mut(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
        self.bind()?;
        // SAFETY: the event handle is live (pooled handles live as long as the device) and `s`
        // is a live stream of this context, kept alive by the `Arc` we hold.
        unsafe { result::event_record(slot.raw, s.cu_stream()) }?;
        // Numbered after the driver took it (a failed record orders nothing).
        let captured = self.capture_record(stream);
        slot.recorded = captured.is_none();
        slot.captured = captured;
        Ok(())
    }

    /// `cuEventQuery`: `CUDA_ERROR_NOT_READY` is `Ok(false)`; a never-recorded event is
    /// complete, and so is one recorded in a capture that is over (refused while it is not).
    fn query_event(&self, event: EventId) -> Result<bool, DeviceError> {
        let events = lock(&self.events);
        let slot = events.live.get(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
        if slot.captured.as_ref().is_some_and(|c| self.capture_live(c)) {
            return Err(DeviceError::capture_unsupported("cuEventQuery"));
        }
        if !slot.recorded {
            return Ok(true);
        }
        self.bind()?;
        // SAFETY: the handle is live for as long as the device.
        unsafe { result::event_query(slot.raw) }
    }

    /// `cuStreamWaitEvent`; nothing to wait for when the event was never recorded (or in a
    /// capture that is over). On an event recorded in a capture underway, a stream outside any
    /// capture joins it (CUDA's fork) and one inside it orders its branch; a capturing stream
    /// waiting on any other event is CUDA's `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`.
    fn wait_event(&self, stream: StreamId, event: EventId) -> Result<(), DeviceError> {
        let isolation = DeviceError::Driver {
            op: "cuStreamWaitEvent",
            code: DeviceError::CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
        };
        let s = self.stream(stream)?;
        let (raw, recorded, captured) = {
            let events = lock(&self.events);
            let slot = events.live.get(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
            (slot.raw, slot.recorded, slot.captured.clone())
        };
        let live = captured.filter(|c| self.capture_live(c));
        match (&live, self.capture_origin(stream)) {
            (Some(c), Some(mine)) if mine.0 != c.origin => return Err(isolation),
            (Some(_), None) if stream == StreamId::DEFAULT => {
                return Err(DeviceError::Unsupported("capturing the default (legacy null) stream"));
            }
            (None, Some(_)) => return Err(isolation),
            (None, None) if !recorded => return Ok(()),
            _ => {}
        }
        self.bind()?;
        // SAFETY: both handles are live: the event as long as the device (pooled handles are
        // never destroyed before it), `s` through its `Arc`.
        unsafe { result::stream_wait_event(s.cu_stream(), raw) }?;
        // A stream outside the capture joins it; one inside is ordered after the event.
        if let Some(c) = &live {
            self.capture_wait(stream, c);
        }
        Ok(())
    }

    /// `cuEventSynchronize`, without holding the event table's lock while blocked.
    fn synchronize_event(&self, event: EventId) -> Result<(), DeviceError> {
        let raw = {
            let events = lock(&self.events);
            let slot = events.live.get(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
            if !slot.recorded {
                return Ok(());
            }
            slot.raw
        };
        self.bind()?;
        // SAFETY: the handle stays live until the device is dropped, even if the event is
        // destroyed (pooled) meanwhile.
        unsafe { result::event_synchronize(raw) }
    }

    /// `cuCtxSynchronize`.
    fn synchronize(&self) -> Result<(), DeviceError> {
        self.bind()?;
        result::ctx_synchronize()
    }

    /// The device attribute `VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` (and a granularity query that
    /// works).
    /// The context: two `CudaDevice::new(0)` share the device's primary context, so
    /// allocators over either help each other out of memory.
    fn memory_domain(&self) -> Option<u64> {
        Some(self.ctx.cu_ctx() as usize as u64)
    }

    fn supports_virtual_memory(&self) -> bool {
        self.vm_page().is_some()
    }

    fn vm_granularity(&self) -> Result<u64, DeviceError> {
        self.vm_page().ok_or(super::NO_VIRTUAL_MEMORY)
    }

    /// `cuMemAddressReserve`, aligned to the granularity.
    fn vm_reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError> {
        let page = self.vm_granularity()?;
        self.bind()?;
        let ptr = result::relaxed_capture_mode(|| result::mem_address_reserve(bytes, page))?;
        lock(&self.vm).ranges.insert(ptr, bytes);
        Ok(DeviceAddr(ptr))
    }

    /// `cuMemAddressFree` of a whole range with nothing mapped in it.
    fn vm_free(&self, base: DeviceAddr, bytes: u64) -> Result<(), DeviceError> {
        let mut vm = lock(&self.vm);
        // Saturating: a range whose end is past the address space is no reservation anyway.
        let end = base.0.saturating_add(bytes);
        let mapped = vm.mappings.keys().any(|&va| base.0 <= va && va < end);
        if vm.ranges.get(&base.0) != Some(&bytes) || mapped {
            return Err(DeviceError::Driver { op: "cuMemAddressFree", code: 1 });
        }
        self.bind()?;
        // SAFETY: `base` is a whole live reservation of this context (checked in `ranges`) with
        // nothing mapped in it (checked in `mappings`); it leaves the table, so it is freed once.
        unsafe { result::mem_address_free(base.0, bytes) }?;
        vm.ranges.remove(&base.0);
        Ok(())
    }

    /// `cuMemCreate` of pinned memory on this device.
    fn vm_create(&self, bytes: u64) -> Result<PhysHandle, DeviceError> {
        self.vm_granularity()?;
        self.bind()?;
        let h = result::relaxed_capture_mode(|| result::mem_create(bytes, self.ordinal_c()))?;
        lock(&self.vm).handles.insert(h, bytes);
        Ok(PhysHandle(h))
    }

    /// `cuMemRelease`; the memory goes once its mappings are gone.
    fn vm_release(&self, handle: PhysHandle) -> Result<(), DeviceError> {
        let mut vm = lock(&self.vm);
        if !vm.handles.contains_key(&handle.0) {
            return Err(DeviceError::Driver { op: "cuMemRelease", code: 400 });
        }
        self.bind()?;
        // SAFETY: a live handle of this device (checked in `handles`), released once: it leaves
        // the table. Mappings of it keep its memory alive until they are unmapped.
        unsafe { result::mem_release(handle.0) }?;
        vm.handles.remove(&handle.0);
        Ok(())
    }

    /// `cuMemMap` + `cuMemSetAccess` (read/write from this device).
    fn vm_map(&self, va: DeviceAddr, bytes: u64, handle: PhysHandle) -> Result<(), DeviceError> {
        let mut vm = lock(&self.vm);
        // An end past the address space lies in no reservation: an error, not an overflow.
        let end = va.0.checked_add(bytes);
        let end_in = |b: u64, n: u64| end.is_some_and(|e| e <= b + n);
        let in_range = vm.ranges.iter().any(|(&b, &n)| b <= va.0 && end_in(b, n));
        let e = end.unwrap_or(u64::MAX);
        let overlaps = vm.mappings.iter().any(|(&a, &(n, _))| a < e && va.0 < a + n);
        let sized = vm.handles.get(&handle.0) == Some(&bytes);
        if !in_range || overlaps || !sized {
            return Err(DeviceError::Driver { op: "cuMemMap", code: 1 });
        }
        self.bind()?;
        result::relaxed_capture_mode(|| {
            // SAFETY: `[va, va + bytes)` lies in a live reservation of this context with nothing
            // mapped there (both checked above, under the table's lock), and `handle` is a live
            // allocation of exactly `bytes` (checked in `handles`).
            unsafe { result::mem_map(va.0, bytes, handle.0, self.ordinal_c()) }
        })?;
        vm.mappings.insert(va.0, (bytes, handle.0));
        Ok(())
    }

    /// `cuMemUnmap` of one whole mapping; the caller made sure no unfinished work uses it.
    fn vm_unmap(&self, va: DeviceAddr, bytes: u64) -> Result<(), DeviceError> {
        let mut vm = lock(&self.vm);
        if vm.mappings.get(&va.0).map(|m| m.0) != Some(bytes) {
            return Err(DeviceError::Driver { op: "cuMemUnmap", code: 1 });
        }
        self.bind()?;
        // SAFETY: `[va, va + bytes)` is exactly one live mapping of this context (checked in
        // `mappings`), unmapped once (it leaves the table); the trait's contract makes the caller
        // order it after every use (the allocator waits for the stream's events first).
        unsafe { result::mem_unmap(va.0, bytes) }?;
        vm.mappings.remove(&va.0);
        Ok(())
    }

    /// `cuMemHostAlloc` (default flags).
    fn host_alloc(&self, bytes: u64) -> Result<HostPtr, DeviceError> {
        if bytes == 0 {
            return Err(DeviceError::Unsupported("allocating 0 bytes of pinned host memory"));
        }
        self.bind()?;
        let ptr = result::mem_host_alloc(bytes)?;
        lock(&self.host).insert(ptr.addr(), (ptr, bytes));
        Ok(ptr)
    }

    /// Synchronises the context (as [`Device::release`] does), then `cuMemFreeHost`. An error for
    /// a pointer this device did not allocate.
    unsafe fn host_free(&self, ptr: HostPtr) -> Result<(), DeviceError> {
        let unknown = DeviceError::UnknownSegment(DeviceAddr(ptr.addr() as u64));
        let entry = lock(&self.host).remove(&ptr.addr()).ok_or(unknown)?;
        let freed = self.bind().and_then(|()| result::ctx_synchronize()).and_then(|()| {
            // SAFETY: a live pinned allocation of this device (just taken out of the table, so
            // freed once); the context is idle, and the caller promised no host use remains.
            unsafe { result::mem_free_host(ptr) }
        });
        if freed.is_err() {
            lock(&self.host).insert(ptr.addr(), entry);
        }
        freed
    }

    /// `cuMemcpyHtoDAsync` on the stream's cudarc stream.
    unsafe fn memcpy_htod_async(
        &self,
        dst: DeviceAddr,
        src: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let (s, n) = self.copy_args(src, bytes, stream)?;
        // SAFETY: the caller guarantees the host range is pinned memory of this device kept
        // valid and unwritten until the copy completed, and the device range is live memory of
        // this context; `s` is a live stream of this context, kept alive by the `Arc` we hold.
        unsafe { result::memcpy_htod_async(dst.0, src, n, s.cu_stream()) }
    }

    /// `cuMemcpyDtoHAsync` on the stream's cudarc stream.
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: HostPtr,
        src: DeviceAddr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let (s, n) = self.copy_args(dst, bytes, stream)?;
        // SAFETY: as in `memcpy_htod_async`, and the host leaves the range alone until then.
        unsafe { result::memcpy_dtoh_async(dst, src.0, n, s.cu_stream()) }
    }
}

impl CudaDevice {
    /// Checks that `[host, host + bytes)` lies in one live pinned allocation of this device and
    /// binds the context: the stream and the length for a copy.
    fn copy_args(
        &self,
        host: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(Arc<CudaStream>, usize), DeviceError> {
        let s = self.stream(stream)?;
        let bad = DeviceError::BadAccess { ptr: DeviceAddr(host.addr() as u64), bytes };
        let n = usize::try_from(bytes).map_err(|_| bad.clone())?;
        let inside = lock(&self.host).values().any(|&(base, len)| {
            base.addr() <= host.addr()
                && (host.addr() - base.addr()).checked_add(n).is_some_and(|end| end as u64 <= len)
        });
        if !inside {
            return Err(bad);
        }
        self.bind()?;
        Ok((s, n))
    }

    /// Live pinned host allocations, as (address, bytes), in address order: what tests check for
    /// leaks.
    pub fn live_host_allocations(&self) -> Vec<(HostPtr, u64)> {
        let mut v: Vec<_> = lock(&self.host).values().copied().collect();
        v.sort_by_key(|(p, _)| p.addr());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streams() -> Streams {
        Streams { made: 0, live: HashMap::new(), adopted: HashSet::new() }
    }

    /// Two devices (or two handles of one) never give out the same stream id, nor the default
    /// stream's 0: a stream of one is unknown to the other. Broken build
    /// `stream_ids_per_device`: both number theirs 1, 2, … (runs without a GPU: no driver call).
    #[test]
    fn stream_ids_are_unique_across_devices() {
        let (mut a, mut b) = (streams(), streams());
        let mut ids = Vec::new();
        for _ in 0..2 {
            ids.push(a.new_id().unwrap());
            ids.push(b.new_id().unwrap());
        }
        let distinct: HashSet<u32> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), 4, "{ids:?}");
        assert!(!ids.contains(&0), "{ids:?}");
        assert!(ids[0] < ids[2] && ids[1] < ids[3], "{ids:?}"); // each device's in order
        assert_eq!((a.made, b.made), (2, 2));
    }

    /// On a machine without a driver (CI, developers), construction is an error with the reason.
    #[test]
    fn new_is_an_error_or_a_device_never_a_panic() {
        match (CudaDevice::new(0), CudaDevice::unavailable_reason()) {
            (Err(e), Some(reason)) => assert_eq!(e, DeviceError::Unavailable(reason)),
            (Ok(dev), None) => assert_eq!(dev.ordinal(), 0),
            (a, b) => panic!("new(0) and unavailable_reason disagree: {:?} / {b:?}", a.err()),
        }
        if !CudaDevice::driver_present() {
            let unavailable = DeviceError::Unavailable(NO_DRIVER.into());
            assert_eq!(CudaDevice::device_count(), Err(unavailable.clone()));
            assert_eq!(CudaDevice::new(0).err(), Some(unavailable));
        }
    }

    #[test]
    fn a_missing_ordinal_is_an_error() {
        let err = CudaDevice::new(usize::MAX).expect_err("no machine has usize::MAX GPUs");
        let DeviceError::Unavailable(msg) = err else { panic!("unexpected error kind") };
        assert!(msg == NO_DRIVER || msg.starts_with("no "), "{msg}");
    }
}
