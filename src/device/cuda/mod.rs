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
//! `device_impl.rs` holds the [`Device`] trait's methods; this file the handles, streams,
//! events and the device's own API.
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
mod device_impl;
mod graph;
pub(crate) mod result;

#[cfg(doc)]
use super::Device;
use super::{DeviceAddr, DeviceError, HostPtr, StreamId};
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
