//! What the allocator needs from a GPU, shaped after the CUDA driver calls an allocator makes.
//!
//! | trait operation            | CUDA driver                     | [`SimDevice`]                        |
//! |----------------------------|---------------------------------|--------------------------------------|
//! | [`Device::reserve`]        | `cuMemAlloc`                    | host allocation (512 B aligned)      |
//! | [`Device::release`]        | `cuMemFree` (syncs the device)  | free; counts as a host sync          |
//! | [`Device::mem_info`]       | `cuMemGetInfo`                  | capacity − reserved                  |
//! | [`Device::record_event`]   | `cuEventRecord`                 | marker in the stream's queue         |
//! | [`Device::query_event`]    | `cuEventQuery`                  | has the stream passed the marker?    |
//! | [`Device::wait_event`]     | `cuStreamWaitEvent`             | later work waits for the marker      |
//! | [`Device::synchronize_event`] / [`Device::synchronize`] | `cuEventSynchronize` / `cuCtxSynchronize` | wait; a host sync |
//! | [`Launch::launch`]         | kernels, memcpy                 | a closure run in stream order        |
//!
//! Virtual memory (CUDA's VMM API), for expandable segments; a device without it keeps the
//! defaults, which answer [`DeviceError::Unsupported`] (see [`Device::supports_virtual_memory`]):
//!
//! | trait operation                  | CUDA driver                        | [`SimDevice`]                  |
//! |----------------------------------|------------------------------------|--------------------------------|
//! | [`Device::vm_granularity`]       | `cuMemGetAllocationGranularity`    | 2 MiB (settable)               |
//! | [`Device::vm_reserve`] / [`Device::vm_free`] | `cuMemAddressReserve` / `cuMemAddressFree` | addresses only, finite |
//! | [`Device::vm_create`] / [`Device::vm_release`] | `cuMemCreate` / `cuMemRelease` | physical bytes, capacity-limited |
//! | [`Device::vm_map`] / [`Device::vm_unmap`] | `cuMemMap` + `cuMemSetAccess` / `cuMemUnmap` | pages become usable / unusable |
//!
//! Streams and events are small copyable ids; [`StreamId::DEFAULT`] exists from the start.
//! The `note_*` hooks let a device with a stream-order sanitizer see what the allocator hands
//! out and takes back; devices without one ignore them.

pub(crate) mod clock;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod guarded;
mod host_ptr;
mod sim;

pub(crate) use guarded::Guarded;

#[cfg(feature = "cuda")]
pub use cuda::{CudaDevice, NO_DRIVER};
pub use host_ptr::HostPtr;
pub use sim::{
    AppStream, KernelFailure, ReclaimHook, SIM_ALIGN, SIM_BASE, SIM_VM_GRANULARITY, SimConfig,
    SimCounters, SimDevice, SimGraphCounters, SimHostCounters, Violation, VmCounters,
};

pub use crate::types::{DeviceAddr, StreamId};
use std::fmt;

/// A physical allocation made by [`Device::vm_create`] (CUDA's `CUmemGenericAllocationHandle`):
/// memory with no address until it is mapped into a reserved range with [`Device::vm_map`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct PhysHandle(pub u64);

/// What a device without virtual memory answers to every virtual-memory call.
pub const NO_VIRTUAL_MEMORY: DeviceError = DeviceError::Unsupported("virtual memory management");

/// An event: a marker recorded on a stream, reusable after it is recorded again.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct EventId(pub u64);

/// Free and total device memory, as `cuMemGetInfo` reports them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MemInfo {
    /// Bytes the device could still hand out.
    pub free: u64,
    /// Bytes the device has in all.
    pub total: u64,
}

/// How a kernel uses a range of memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AccessKind {
    /// The kernel only reads the range.
    Read,
    /// The kernel writes (and may read) the range.
    Write,
}

/// One range of device memory a kernel touches.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Access {
    /// First byte.
    pub ptr: DeviceAddr,
    /// Length in bytes.
    pub bytes: u64,
    /// Read or write.
    pub kind: AccessKind,
}

/// Memory as a host kernel sees it: reads and writes of device ranges, checked against the
/// ranges the kernel declared.
pub trait KernelMemory {
    /// Copies `out.len()` bytes starting at `ptr` into `out`.
    fn read(&self, ptr: DeviceAddr, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Copies `data` to device memory starting at `ptr`.
    fn write(&self, ptr: DeviceAddr, data: &[u8]) -> Result<(), DeviceError>;
}

/// The body of a host kernel, run in stream order on the device.
pub type KernelFn = Box<dyn FnOnce(&dyn KernelMemory) + Send + 'static>;

/// The body of a host kernel that may run many times: what a captured graph replays
/// ([`Kernel::replayable`]).
pub type ReplayFn = std::sync::Arc<dyn Fn(&dyn KernelMemory) + Send + Sync + 'static>;

/// Work enqueued on a stream: the memory it touches and what it does.
///
/// On [`SimDevice`] the body runs on the stream's worker, after all earlier work on that stream.
/// A kernel with an empty body and a `sleep` holds the stream busy, like `torch.cuda._sleep`.
pub struct Kernel {
    /// A short name for reports and sanitizer messages.
    pub name: &'static str,
    /// Every range the body reads or writes.
    pub accesses: Vec<Access>,
    /// How long the kernel keeps its stream busy before its body runs.
    pub sleep: std::time::Duration,
    /// What the kernel does, once.
    pub body: Option<KernelFn>,
    /// What the kernel does, as often as it runs (set by [`Kernel::replayable`]); used when
    /// there is no one-shot `body`. A kernel may be captured into a graph ([`Capture`]) only
    /// if it has no one-shot `body`.
    pub replay: Option<ReplayFn>,
}

impl Kernel {
    /// A kernel that only holds `stream` busy for `duration` (touches no memory).
    pub fn sleep(duration: std::time::Duration) -> Kernel {
        Kernel { name: "sleep", accesses: Vec::new(), sleep: duration, body: None, replay: None }
    }

    /// A kernel named `name` touching `accesses`, running `body`.
    pub fn new(
        name: &'static str,
        accesses: Vec<Access>,
        body: impl FnOnce(&dyn KernelMemory) + Send + 'static,
    ) -> Kernel {
        Kernel {
            name,
            accesses,
            sleep: std::time::Duration::ZERO,
            body: Some(Box::new(body)),
            replay: None,
        }
    }

    /// A kernel named `name` touching `accesses`, whose `body` may run many times: launched on
    /// a stream that is being captured ([`Capture::begin_capture`]), it runs at every launch of
    /// the graph.
    pub fn replayable(
        name: &'static str,
        accesses: Vec<Access>,
        body: impl Fn(&dyn KernelMemory) + Send + Sync + 'static,
    ) -> Kernel {
        Kernel {
            name,
            accesses,
            sleep: std::time::Duration::ZERO,
            body: None,
            replay: Some(std::sync::Arc::new(body)),
        }
    }

    /// Whether a graph can replay it: its body (if any) may run many times.
    pub fn is_replayable(&self) -> bool {
        self.body.is_none()
    }
}

/// A device call that failed.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum DeviceError {
    /// The device has no room for a segment of this many bytes.
    OutOfMemory {
        /// Size of the refused segment.
        requested: u64,
    },
    /// A driver call failed with a CUDA error code (a `CUresult`, e.g. 2 for
    /// `CUDA_ERROR_OUT_OF_MEMORY`). [`SimDevice`]'s injected faults are reported the same way.
    Driver {
        /// The call, e.g. `"cuMemAlloc"`.
        op: &'static str,
        /// The `CUresult` it returned.
        code: u32,
    },
    /// There is no usable device: no driver library, no GPU, or an ordinal out of range.
    Unavailable(String),
    /// The stream does not exist (never created or adopted, or destroyed or released).
    UnknownStream(StreamId),
    /// The event does not exist.
    UnknownEvent(EventId),
    /// The application tried to destroy a stream an allocator still has adopted: release it
    /// first ([`crate::Allocator::release_stream`]).
    StreamAdopted(StreamId),
    /// The pointer is not the start of a live segment.
    UnknownSegment(DeviceAddr),
    /// The device cannot run this kind of work (host kernels on a real GPU, say).
    Unsupported(&'static str),
    /// A method of the [`Device`] implementation panicked. The allocator catches the panic at
    /// the call (the panic hook has printed it) and handles it as this call's failure, so the
    /// operation is rolled back and the allocator works on.
    Panicked {
        /// The [`Device`] method, e.g. `"reserve"`.
        op: &'static str,
        /// The panic's message.
        message: String,
    },
    /// A kernel touched memory outside what it declared or outside any segment.
    BadAccess {
        /// First byte of the access.
        ptr: DeviceAddr,
        /// Length of the access.
        bytes: u64,
    },
}

impl DeviceError {
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;
    /// `CUDA_ERROR_NOT_READY`.
    pub const CUDA_ERROR_NOT_READY: u32 = 600;
    /// `CUDA_ERROR_UNKNOWN`.
    pub const CUDA_ERROR_UNKNOWN: u32 = 999;
    /// `CUDA_ERROR_INVALID_HANDLE` (an unknown graph, say).
    pub const CUDA_ERROR_INVALID_HANDLE: u32 = 400;
    /// `CUDA_ERROR_ILLEGAL_STATE` (beginning a capture on a stream already capturing, ending one
    /// on a stream that is not).
    pub const CUDA_ERROR_ILLEGAL_STATE: u32 = 401;
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: an operation not permitted while a stream capture
    /// is underway (a synchronisation, an event query, `cuMemFree`).
    pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: u32 = 900;
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`: the capture was invalidated by an earlier error
    /// (an operation refused while it was underway, CUDA's global mode): its end makes no graph.
    pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: u32 = 901;
    /// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`: captured work would depend on work outside the
    /// capture (a wait on an event recorded outside it).
    pub const CUDA_ERROR_STREAM_CAPTURE_ISOLATION: u32 = 905;
    /// `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`: a capture ended while a stream that joined it (a
    /// fork) was not joined back into the stream it began on.
    pub const CUDA_ERROR_STREAM_CAPTURE_UNJOINED: u32 = 904;
    /// `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`: a capture of the global (or thread-local)
    /// mode ended on another thread than the one that began it; it goes on.
    pub const CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: u32 = 908;

    /// The error of an operation CUDA refuses while a stream capture is underway
    /// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), as the driver, the simulator and the
    /// allocator's own refusals give it.
    pub(crate) fn capture_unsupported(op: &'static str) -> DeviceError {
        DeviceError::Driver { op, code: DeviceError::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED }
    }

    /// Whether this is the driver's refusal to end a capture on another thread than the one
    /// that began it (`CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`): the capture goes on.
    pub fn is_capture_wrong_thread(&self) -> bool {
        matches!(self, DeviceError::Driver { code, .. }
            if *code == DeviceError::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
    }

    /// The name of a CUDA error code, where it is one of the common ones.
    pub fn code_name(code: u32) -> Option<&'static str> {
        Some(match code {
            1 => "CUDA_ERROR_INVALID_VALUE",
            2 => "CUDA_ERROR_OUT_OF_MEMORY",
            3 => "CUDA_ERROR_NOT_INITIALIZED",
            4 => "CUDA_ERROR_DEINITIALIZED",
            100 => "CUDA_ERROR_NO_DEVICE",
            101 => "CUDA_ERROR_INVALID_DEVICE",
            201 => "CUDA_ERROR_INVALID_CONTEXT",
            400 => "CUDA_ERROR_INVALID_HANDLE",
            401 => "CUDA_ERROR_ILLEGAL_STATE",
            500 => "CUDA_ERROR_NOT_FOUND",
            600 => "CUDA_ERROR_NOT_READY",
            700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
            719 => "CUDA_ERROR_LAUNCH_FAILED",
            801 => "CUDA_ERROR_NOT_SUPPORTED",
            900 => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            901 => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            904 => "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
            905 => "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
            908 => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
            999 => "CUDA_ERROR_UNKNOWN",
            _ => return None,
        })
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::OutOfMemory { requested } => {
                write!(f, "device out of memory reserving a segment of {requested} bytes")
            }
            DeviceError::Driver { op, code } => match DeviceError::code_name(*code) {
                Some(name) => write!(f, "{op} failed: {name} ({code})"),
                None => write!(f, "{op} failed: CUDA error {code}"),
            },
            DeviceError::Unavailable(why) => write!(f, "no usable device: {why}"),
            DeviceError::UnknownStream(s) => write!(f, "unknown {s}"),
            DeviceError::UnknownEvent(e) => write!(f, "unknown event {}", e.0),
            DeviceError::StreamAdopted(s) => write!(
                f,
                "{s} is still adopted by an allocator: call Allocator::release_stream before destroying it"
            ),
            DeviceError::UnknownSegment(p) => write!(f, "{p} is not the start of a live segment"),
            DeviceError::Unsupported(what) => write!(f, "unsupported on this device: {what}"),
            DeviceError::Panicked { op, message } => {
                write!(f, "the device's {op}() panicked: {message}")
            }
            DeviceError::BadAccess { ptr, bytes } => {
                write!(f, "kernel access of {bytes} bytes at {ptr} is outside its declared memory")
            }
        }
    }
}

impl std::error::Error for DeviceError {}

/// What the allocator needs from a GPU. See the module docs for the CUDA mapping.
///
/// Implementations are shared between threads; every method takes `&self`. A method that
/// panics does not unwind through an allocator: the allocators catch the panic at the call and
/// handle it as that call's failure ([`DeviceError::Panicked`]), so they stay consistent and
/// keep working.
pub trait Device: Send + Sync + 'static {
    /// A short description ("SimDevice 8 GiB", "NVIDIA H200").
    fn name(&self) -> String;

    /// The device's ordinal (CUDA's device index): the `device` a snapshot stamps on the
    /// allocator's segments and the index of its `device_traces` list. 0 unless the device
    /// says otherwise.
    fn ordinal(&self) -> usize {
        0
    }

    /// Reserves a segment of `bytes` bytes (`cuMemAlloc`). Addresses are 512-byte aligned.
    fn reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError>;

    /// Releases a segment returned by [`Device::reserve`] (`cuMemFree`, which synchronises).
    fn release(&self, ptr: DeviceAddr) -> Result<(), DeviceError>;

    /// Free and total memory (`cuMemGetInfo`).
    fn mem_info(&self) -> Result<MemInfo, DeviceError>;

    /// Creates a stream.
    fn create_stream(&self) -> Result<StreamId, DeviceError>;

    /// Destroys a stream after draining its work. The default stream cannot be destroyed. An
    /// adopted stream (one the application owns) is drained and forgotten, not destroyed: its
    /// owner destroys it.
    fn destroy_stream(&self, stream: StreamId) -> Result<(), DeviceError>;

    /// Whether `stream` exists now (created, adopted, or the default stream, and not
    /// destroyed). The allocator refuses any other stream id before it touches its tables. The
    /// default asks the device by recording a scratch event on the stream; devices override it
    /// with a lookup.
    fn has_stream(&self, stream: StreamId) -> bool {
        let Ok(event) = self.create_event() else { return false };
        let exists = self.record_event(event, stream).is_ok();
        let _ = self.destroy_event(event);
        exists
    }

    /// Whether `stream` is the application's, adopted (cudarc's `Arc<CudaStream>`, say), rather
    /// than made by [`Device::create_stream`].
    fn is_adopted(&self, _stream: StreamId) -> bool {
        false
    }

    /// Creates an event (timing disabled).
    fn create_event(&self) -> Result<EventId, DeviceError>;

    /// Destroys an event.
    fn destroy_event(&self, event: EventId) -> Result<(), DeviceError>;

    /// Records `event` on `stream`: it completes once the stream's earlier work has finished.
    /// On a capturing stream the record is a node of the capture instead: a stream that waits on
    /// the event joins the capture ([`Capture`]).
    fn record_event(&self, event: EventId, stream: StreamId) -> Result<(), DeviceError>;

    /// Has `event` completed? Never blocks (`cuEventQuery`). An event never recorded is complete.
    fn query_event(&self, event: EventId) -> Result<bool, DeviceError>;

    /// Makes `stream`'s later work wait for `event` on the device, without blocking the host.
    fn wait_event(&self, stream: StreamId, event: EventId) -> Result<(), DeviceError>;

    /// Blocks the host until `event` completes. A host sync.
    fn synchronize_event(&self, event: EventId) -> Result<(), DeviceError>;

    /// Blocks the host until every stream is idle. A host sync.
    fn synchronize(&self) -> Result<(), DeviceError>;

    /// Sanitizer hook: the allocator hands `bytes` at `ptr` to `stream` for new use.
    fn note_handout(&self, _ptr: DeviceAddr, _bytes: u64, _stream: StreamId) {}

    /// Sanitizer hook: the allocator took `bytes` at `ptr` back from its user (freed on `stream`).
    fn note_reclaim(&self, _ptr: DeviceAddr, _bytes: u64, _stream: StreamId) {}

    /// Whether [`Device::note_handout`] and [`Device::note_reclaim`] do anything (a sanitizer
    /// is on). Fixed for the device's life. When they do not, a scope's planned path skips them.
    fn observes_handouts(&self) -> bool {
        false
    }

    /// The memory this device object allocates from, where several objects may share it
    /// (CUDA: the context, as two `CudaDevice::new(0)` share the primary context). Allocators
    /// over objects of one memory help each other out of memory (they return their free caches
    /// before a request gives up); `None` (the default): the object is its own memory, and only
    /// allocators sharing its `Arc` help each other.
    fn memory_domain(&self) -> Option<u64> {
        None
    }

    /// Whether the `vm_*` calls work (CUDA: the device attribute
    /// `VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`). The defaults say no, and every `vm_*` default
    /// answers [`NO_VIRTUAL_MEMORY`]; an allocator asked for expandable segments then falls back
    /// to ordinary segments.
    fn supports_virtual_memory(&self) -> bool {
        false
    }

    /// The page size of physical allocations and mappings (`cuMemGetAllocationGranularity`, the
    /// recommended granularity of pinned device memory): every size and address given to the
    /// other `vm_*` calls is a multiple of it.
    fn vm_granularity(&self) -> Result<u64, DeviceError> {
        Err(NO_VIRTUAL_MEMORY)
    }

    /// Reserves `bytes` of virtual addresses, backed by nothing (`cuMemAddressReserve`). The base
    /// is aligned to the granularity.
    fn vm_reserve(&self, _bytes: u64) -> Result<DeviceAddr, DeviceError> {
        Err(NO_VIRTUAL_MEMORY)
    }

    /// Frees a range from [`Device::vm_reserve`] (`cuMemAddressFree`); nothing may be mapped in it.
    fn vm_free(&self, _base: DeviceAddr, _bytes: u64) -> Result<(), DeviceError> {
        Err(NO_VIRTUAL_MEMORY)
    }

    /// Creates a physical allocation of `bytes` (`cuMemCreate`): this is what counts against the
    /// device's memory.
    fn vm_create(&self, _bytes: u64) -> Result<PhysHandle, DeviceError> {
        Err(NO_VIRTUAL_MEMORY)
    }

    /// Releases a physical allocation (`cuMemRelease`). Its memory goes back to the device once
    /// no mapping of it is left.
    fn vm_release(&self, _handle: PhysHandle) -> Result<(), DeviceError> {
        Err(NO_VIRTUAL_MEMORY)
    }

    /// Maps all of `handle` (`bytes` long) at `va` inside a reserved range and makes it readable
    /// and writable by this device (`cuMemMap` + `cuMemSetAccess`). On an error nothing is mapped.
    fn vm_map(&self, _va: DeviceAddr, _bytes: u64, _handle: PhysHandle) -> Result<(), DeviceError> {
        Err(NO_VIRTUAL_MEMORY)
    }

    /// Unmaps `[va, va + bytes)`, which must be exactly one mapping (`cuMemUnmap`). It does not
    /// wait for device work: the caller makes sure no unfinished work uses those addresses.
    fn vm_unmap(&self, _va: DeviceAddr, _bytes: u64) -> Result<(), DeviceError> {
        Err(NO_VIRTUAL_MEMORY)
    }

    /// Allocates `bytes` of page-locked host memory (`cuMemHostAlloc`), which asynchronous copies
    /// read and write without staging; contents unspecified. [`crate::HostAllocator`] is the
    /// safe, caching way to use it. The default: [`DeviceError::Unsupported`].
    fn host_alloc(&self, _bytes: u64) -> Result<HostPtr, DeviceError> {
        Err(DeviceError::Unsupported("pinned host memory"))
    }

    /// The most page-locked host memory this device object could ever hold at once, where
    /// known (SimDevice: its host capacity; CUDA: the host's physical memory). A pinned request
    /// above it can never succeed, so [`crate::HostAllocator`] frees no cached block for it
    /// (neither its own nor its peers'). `None` (the default): unknown, every request may fit.
    fn host_capacity(&self) -> Option<u64> {
        None
    }

    /// Frees memory from [`Device::host_alloc`] (`cuMemFreeHost`).
    ///
    /// # Safety
    /// `ptr` came from this device's `host_alloc` and is not freed yet, and nothing uses the
    /// memory after this call: no host reference into it and no copy that has not completed.
    unsafe fn host_free(&self, _ptr: HostPtr) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("pinned host memory"))
    }

    /// Enqueues a copy of `bytes` bytes from pinned host memory at `src` to device memory at
    /// `dst` on `stream` (`cuMemcpyHtoDAsync`); returns at once.
    ///
    /// # Safety
    /// `[src, src + bytes)` lies in one live allocation of this device's
    /// [`Device::host_alloc`], which stays allocated and which the host does not write until the
    /// copy completed (an event recorded on `stream` after this call completed);
    /// `[dst, dst + bytes)` is device memory of this device that stays allocated until the copy
    /// has run (work on other streams that uses it unordered gives unspecified bytes, as any race
    /// on device memory does).
    unsafe fn memcpy_htod_async(
        &self,
        _dst: DeviceAddr,
        _src: HostPtr,
        _bytes: u64,
        _stream: StreamId,
    ) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("pinned host memory"))
    }

    /// Enqueues a copy of `bytes` bytes from device memory at `src` to pinned host memory at
    /// `dst` on `stream` (`cuMemcpyDtoHAsync`); returns at once.
    ///
    /// # Safety
    /// As [`Device::memcpy_htod_async`], and the host neither reads nor writes
    /// `[dst, dst + bytes)` until the copy completed.
    unsafe fn memcpy_dtoh_async(
        &self,
        _dst: HostPtr,
        _src: DeviceAddr,
        _bytes: u64,
        _stream: StreamId,
    ) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("pinned host memory"))
    }

    /// Sanitizer hook: host code is about to read (`Read`) or write (`Write`) `bytes` of pinned
    /// memory at `ptr`; a host allocator handing a block out counts as a write. [`SimDevice`]
    /// reports a copy that has not run yet on that memory as a [`Violation`] (`"host write"`,
    /// `"host read"`; `"host free"` from `host_free`) whose `ptr` is the host address and whose
    /// `stream` and `other` both name the copy's stream.
    fn note_host_access(&self, _ptr: HostPtr, _bytes: u64, _kind: AccessKind) {}

    /// Whether a stream capture is underway on this device ([`Capture::begin_capture`]). While
    /// one is, CUDA refuses (in its global capture mode) synchronisations, event queries and
    /// `cuMemFree` from every thread, so the allocator makes none of them: it leaves pending
    /// events unpolled, releases no segment and waits on nothing (PyTorch's
    /// `captures_underway`). The default: never.
    fn capture_underway(&self) -> bool {
        false
    }

    /// The capture `stream` belongs to, named by the stream it began on: `stream` itself while
    /// [`Capture::begin_capture`] captures it, or the origin of the capture it joined by waiting
    /// on an event recorded inside it (CUDA's fork: `cuStreamGetCaptureInfo` says active);
    /// `None` when it is not capturing. The allocator routes a joined stream's allocations to
    /// the capture's pool, holds back what it frees there, and never records an event on it.
    /// The default: never, which is right only for a device whose captures no other stream can
    /// join (one that refuses event records on a capturing stream, as tidepool's devices did
    /// before fork and join); a device that lets streams join must answer it.
    fn capture_of(&self, _stream: StreamId) -> Option<StreamId> {
        None
    }

    /// Where `stream`'s captured work stands now, as a mark that later captured work can be
    /// ordered after (PyTorch's `graph_capture_record_stream_reuse` inserts an empty graph node
    /// for it): everything captured on `stream` so far comes before the mark. `None` when
    /// `stream` is not capturing, or when the device cannot tell (the default). With
    /// [`Device::capture_ordered_after`] it lets the allocator reuse, within a capture, a block
    /// used on a side stream that was joined back since it was freed.
    fn capture_mark(&self, _stream: StreamId) -> Option<CaptureMark> {
        None
    }

    /// Whether the work captured on `stream` from now on is ordered after `mark`, in every
    /// replay of the graph: `stream` is in the capture the mark was taken in, and it is the
    /// mark's stream or it waited (directly or through other streams) on an event recorded on
    /// the mark's stream after the mark. Only ordering the device has seen counts, so `false`
    /// is always safe; the default. A mark of a capture that has ended orders nothing.
    fn capture_ordered_after(&self, _stream: StreamId, _mark: CaptureMark) -> bool {
        false
    }
}

/// A point in a capture underway: the work captured on one stream up to a moment
/// ([`Device::capture_mark`]). Compared only by the device that made it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct CaptureMark {
    /// The capture, as the device numbers them (a new number for every capture begun).
    pub capture: u64,
    /// The stream whose work it marks.
    pub stream: StreamId,
    /// Its position on that stream, in the device's own count (work after it is numbered
    /// higher).
    pub position: u64,
}

/// A graph made by stream capture: on a GPU a `CUgraph` and its instantiation (`CUgraphExec`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct GraphId(pub u64);

/// Stream capture (CUDA graphs): work enqueued on a capturing stream is recorded instead of run,
/// and the graph it makes replays it at each launch. [`crate::Allocator::begin_capture`] is the
/// allocator-aware way to use it: it routes the capture's allocations to a private pool. Other
/// streams join a capture through events, as on CUDA: an event recorded on a capturing stream is
/// a node of the capture, a stream that waits on it is captured too ([`Device::capture_of`]),
/// and the capture ends only once every such stream has been joined back (the stream it began on
/// waited on an event recorded on it), else `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`.
///
/// | operation                   | CUDA driver                                  | [`SimDevice`]                         |
/// |-----------------------------|----------------------------------------------|---------------------------------------|
/// | [`Capture::begin_capture`]  | `cuStreamBeginCapture` (global mode)         | later work on the stream is recorded  |
/// | [`Capture::end_capture`]    | `cuStreamEndCapture` + `cuGraphInstantiate`  | the recording becomes a graph         |
/// | [`Capture::launch_graph`]   | `cuGraphLaunch`                              | the recorded kernels enqueued again, checked by the sanitizer |
/// | [`Capture::destroy_graph`]  | `cuGraphExecDestroy` + `cuGraphDestroy`      | forgotten                             |
pub trait Capture: Device {
    /// Starts capturing `stream`: its later work is recorded, not run, until
    /// [`Capture::end_capture`]. The default stream cannot be captured.
    fn begin_capture(&self, stream: StreamId) -> Result<(), DeviceError>;

    /// Ends the capture of `stream` and returns the graph of what was recorded.
    fn end_capture(&self, stream: StreamId) -> Result<GraphId, DeviceError>;

    /// Enqueues the graph's recorded work on `stream`, in the recorded order; returns at once.
    fn launch_graph(&self, graph: GraphId, stream: StreamId) -> Result<(), DeviceError>;

    /// Destroys a graph. Launches already enqueued still run.
    fn destroy_graph(&self, graph: GraphId) -> Result<(), DeviceError>;
}

/// A device that runs host [`Kernel`]s in stream order: what the simulator and the eager layer's
/// host back end need beyond [`Device`]. An allocator back end implements only [`Device`]
/// (`CudaDevice` does; real kernels go through cudarc on its streams).
pub trait Launch: Device {
    /// Enqueues `kernel` on `stream`; returns at once.
    fn launch(&self, stream: StreamId, kernel: Kernel) -> Result<(), DeviceError>;
}
