//! The `result` layer: one thin function per CUDA driver call [`super::CudaDevice`] makes, over
//! `cudarc::driver::sys`, turning a `CUresult` into `Result<_, DeviceError>`.
//!
//! ```text
//!   cudarc::driver::sys (raw FFI, CUresult)  →  result.rs (this file)  →  CudaDevice (safe, RAII)
//! ```
//!
//! Every call here acts on the context current on the calling thread: the caller binds the
//! device's context first (`CudaContext::bind_to_thread`). Without a current context the driver
//! answers `CUDA_ERROR_INVALID_CONTEXT`, which is an error, not undefined behaviour, so such calls
//! are safe functions. Calls that take a raw handle (event, stream, device pointer) are `unsafe`:
//! the handle must be live and belong to the current context.

use crate::device::{DeviceError, HostPtr, MemInfo};
use cudarc::driver::sys;
use std::ffi::{c_int, c_uint, c_void};

/// A raw CUDA event handle (`CUevent`), owned by [`super::CudaDevice`]'s event pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RawEvent(pub(super) sys::CUevent);

// SAFETY: a CUevent is an opaque driver handle, valid on any thread of the process (the driver API
// is thread-safe); the device only uses it with its context bound and destroys it once.
unsafe impl Send for RawEvent {}

/// `CUresult` → `DeviceError::Driver { op, code }` keeping CUDA's code; success → `Ok(())`.
pub(super) fn check(op: &'static str, code: sys::CUresult) -> Result<(), DeviceError> {
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(DeviceError::Driver { op, code: other as u32 }),
    }
}

/// `cuMemAlloc`: a segment of `bytes` bytes. The driver's out-of-memory answer becomes
/// [`DeviceError::OutOfMemory`], so the allocator's out-of-memory ladder sees it as such.
pub(super) fn mem_alloc(bytes: u64) -> Result<sys::CUdeviceptr, DeviceError> {
    let size = usize::try_from(bytes).map_err(|_| DeviceError::OutOfMemory { requested: bytes })?;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid place for the driver to write the new address.
    let code = unsafe { sys::cuMemAlloc_v2(&mut ptr, size) };
    if code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Err(DeviceError::OutOfMemory { requested: bytes });
    }
    check("cuMemAlloc", code)?;
    Ok(ptr)
}

/// Runs `f` (allocation calls: `cuMemAlloc`, `cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`)
/// with the calling thread's stream-capture interaction mode relaxed, then restores it
/// (`cuThreadExchangeStreamCaptureMode`, push-pop as CUDA recommends). While any capture begun
/// in the global mode (`stream_begin_capture`) is underway, CUDA refuses such calls from every
/// thread as potentially unsafe (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`) and invalidates the
/// capture; they are safe here because a capture's memory is never freed or unmapped before its
/// graph is gone (the allocator's rule). PyTorch relaxes `cudaMalloc` during captures the same
/// way (`cudaMallocMaybeCapturing`). A failure to restore the mode is ignored: what `f` made
/// must reach its caller, not leak.
pub(super) fn relaxed_capture_mode<T>(
    f: impl FnOnce() -> Result<T, DeviceError>,
) -> Result<T, DeviceError> {
    // BROKEN (`capture_mode_global`): called in the thread's mode (global: refused in a capture).
    if cfg!(tidepool_broken = "capture_mode_global") {
        return f();
    }
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid place to read the new mode from and write the old one to.
    let code = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    check("cuThreadExchangeStreamCaptureMode", code)?;
    let out = f();
    // SAFETY: as above; `mode` now holds the thread's previous mode, which goes back.
    let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    out
}

/// `cuMemFree`.
///
/// # Safety
/// `ptr` came from [`mem_alloc`] in the current context and is not used (by the host or by
/// unfinished device work) after this call.
pub(super) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees `ptr` is a live allocation no longer in use.
    check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })
}

/// `cuMemGetInfo`: free and total memory of the current context's device.
pub(super) fn mem_get_info() -> Result<MemInfo, DeviceError> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both pointers are valid places for the driver to write.
    check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
    Ok(MemInfo { free: free as u64, total: total as u64 })
}

/// `cuCtxSynchronize`: blocks until all work of the current context has completed.
pub(super) fn ctx_synchronize() -> Result<(), DeviceError> {
    // SAFETY: takes no arguments; acts on the current context.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// `cuEventCreate(CU_EVENT_DISABLE_TIMING)`: an event that only orders work (cheapest kind).
pub(super) fn event_create() -> Result<RawEvent, DeviceError> {
    let mut event: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    // SAFETY: `event` is a valid place for the driver to write the new handle.
    check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
    Ok(RawEvent(event))
}

/// `cuEventDestroy`.
///
/// # Safety
/// `event` is live, belongs to the current context and is not used after this call.
pub(super) unsafe fn event_destroy(event: RawEvent) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees the handle is live and never used again.
    check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event.0) })
}

/// `cuEventRecord`: the event completes once `stream`'s work enqueued so far has completed.
///
/// # Safety
/// `event` and `stream` are live handles of the current context (`stream` may be the null
/// stream).
pub(super) unsafe fn event_record(
    event: RawEvent,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees both handles are live in the current context.
    check("cuEventRecord", unsafe { sys::cuEventRecord(event.0, stream) })
}

/// `cuEventQuery`: `Ok(true)` when complete, `Ok(false)` for `CUDA_ERROR_NOT_READY`.
///
/// # Safety
/// `event` is a live handle of the current context.
pub(super) unsafe fn event_query(event: RawEvent) -> Result<bool, DeviceError> {
    // SAFETY: the caller guarantees the handle is live.
    match unsafe { sys::cuEventQuery(event.0) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => check("cuEventQuery", other).map(|()| false),
    }
}

/// `cuEventSynchronize`: blocks the host until the event completes.
///
/// # Safety
/// `event` is a live handle of the current context.
pub(super) unsafe fn event_synchronize(event: RawEvent) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees the handle is live.
    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event.0) })
}

/// `cuStreamWaitEvent`: `stream`'s later work waits on the device for `event`.
///
/// # Safety
/// `stream` and `event` are live handles of the current context.
pub(super) unsafe fn stream_wait_event(
    stream: sys::CUstream,
    event: RawEvent,
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees both handles are live; flags 0 is CU_EVENT_WAIT_DEFAULT.
    check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream, event.0, 0) })
}

/// `cuStreamSynchronize`: blocks the host until `stream`'s work has completed.
///
/// # Safety
/// `stream` is a live handle of the current context (or the null stream).
pub(super) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees the handle is live.
    check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) })
}

/// `cuMemsetD8Async`: sets `bytes` bytes at `ptr` to `value`, in `stream`'s order.
///
/// # Safety
/// `[ptr, ptr + bytes)` is device memory of the current context that nothing else uses
/// concurrently, and `stream` is a live handle of the current context.
pub(crate) unsafe fn memset_d8_async(
    ptr: sys::CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees the range and the stream are valid.
    check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(ptr, value, bytes, stream) })
}

// Stream capture (CUDA graphs).

/// A captured graph and its instantiation (`CUgraph`, `CUgraphExec`), owned by
/// [`super::CudaDevice`]'s graph table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RawGraph {
    pub(super) graph: sys::CUgraph,
    pub(super) exec: sys::CUgraphExec,
}

// SAFETY: both are opaque driver handles, valid on any thread of the process (the driver API is
// thread-safe); the device only uses them with its context bound and destroys them once.
unsafe impl Send for RawGraph {}

/// `cuStreamBeginCapture` in the global mode (PyTorch's default): while the capture lasts, the
/// driver refuses unsafe calls (synchronisations, event queries, `cuMemFree`) from every thread.
///
/// # Safety
/// `stream` is a live handle of the current context, not the legacy null stream.
pub(super) unsafe fn stream_begin_capture(stream: sys::CUstream) -> Result<(), DeviceError> {
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: the caller guarantees the stream handle is live.
    check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(stream, mode) })
}

/// `cuStreamEndCapture` then `cuGraphInstantiateWithFlags`: the captured graph, ready to launch.
/// If instantiation fails the graph is destroyed and the error returned.
///
/// # Safety
/// `stream` is a live handle of the current context that is being captured.
pub(super) unsafe fn stream_end_capture(stream: sys::CUstream) -> Result<RawGraph, DeviceError> {
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the caller guarantees the stream handle is live; `graph` is a valid out-pointer.
    check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream, &mut graph) })?;
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` was just made by the driver; `exec` is a valid out-pointer; flags 0.
    let made = check("cuGraphInstantiate", unsafe {
        sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
    });
    if let Err(e) = made {
        // SAFETY: the graph is live and owned here; nothing else refers to it.
        let _ = unsafe { sys::cuGraphDestroy(graph) };
        return Err(e);
    }
    Ok(RawGraph { graph, exec })
}

/// `cuGraphLaunch`: enqueues the graph's work on `stream`.
///
/// # Safety
/// `graph` is live (not destroyed) in the current context and `stream` is a live handle of it.
pub(super) unsafe fn graph_launch(
    graph: RawGraph,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees both handles are live.
    check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(graph.exec, stream) })
}

/// `cuGraphExecDestroy` then `cuGraphDestroy`. Launches already enqueued still complete.
///
/// # Safety
/// `graph` is live in the current context and is not used after this call.
pub(super) unsafe fn graph_destroy(graph: RawGraph) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees the handles are live and never used again.
    let exec = check("cuGraphExecDestroy", unsafe { sys::cuGraphExecDestroy(graph.exec) });
    // SAFETY: as above.
    let g = check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph.graph) });
    exec.and(g)
}

// Virtual memory management (expandable segments).

// The device id sits right after the location type in every CUDA version's `CUmemLocation` (a
// plain `id` before 13.2, the first member of an anonymous union since): see `device_location`.
const _: () = assert!(std::mem::size_of::<sys::CUmemLocation>() >= 8);

/// `CUmemLocation` of device `ordinal`.
fn device_location(ordinal: c_int) -> sys::CUmemLocation {
    // SAFETY: `CUmemLocation` is a plain C struct; all-zero bytes are a valid value of it (0 is
    // `CU_MEM_LOCATION_TYPE_INVALID`, and the id/union is an integer).
    let mut loc: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    loc.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    // SAFETY: offset 4 is inside the struct (asserted above: at least 8 bytes) and is where every
    // CUDA version keeps the `int` device id; an unaligned write needs no alignment.
    unsafe { (&raw mut loc).cast::<u8>().add(4).cast::<c_int>().write_unaligned(ordinal) };
    loc
}

/// The properties of pinned device memory on device `ordinal` (what `cuMemCreate` makes).
fn pinned_prop(ordinal: c_int) -> sys::CUmemAllocationProp {
    // SAFETY: `CUmemAllocationProp` is a plain C struct; all-zero bytes are a valid value of it
    // (the zero of each enum field is one of its variants, the pointer is null, the flags 0).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = device_location(ordinal);
    prop
}

/// `cuMemGetAllocationGranularity` (recommended) of pinned memory on device `ordinal`.
pub(super) fn mem_granularity(ordinal: c_int) -> Result<u64, DeviceError> {
    let prop = pinned_prop(ordinal);
    let mut granularity = 0usize;
    let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED;
    // SAFETY: both pointers are valid for the call: `granularity` to write, `prop` to read.
    let code = unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, flag) };
    check("cuMemGetAllocationGranularity", code)?;
    Ok(granularity as u64)
}

/// `cuMemAddressReserve`: `bytes` of virtual addresses, aligned to `align`, anywhere.
pub(super) fn mem_address_reserve(bytes: u64, align: u64) -> Result<sys::CUdeviceptr, DeviceError> {
    let too_big = DeviceError::Driver {
        op: "cuMemAddressReserve",
        code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
    };
    let size = usize::try_from(bytes).map_err(|_| too_big.clone())?;
    let align = usize::try_from(align).map_err(|_| too_big)?;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid place to write; address hint 0 and flags 0 as documented.
    let code = unsafe { sys::cuMemAddressReserve(&mut ptr, size, align, 0, 0) };
    check("cuMemAddressReserve", code)?;
    Ok(ptr)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// `[ptr, ptr + bytes)` is exactly a range from [`mem_address_reserve`] in the current context,
/// with nothing mapped in it, and it is not used after this call.
pub(super) unsafe fn mem_address_free(
    ptr: sys::CUdeviceptr,
    bytes: u64,
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees the range is a whole, unmapped reservation.
    check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(ptr, bytes as usize) })
}

/// `cuMemCreate`: a physical allocation of `bytes` (a multiple of the granularity) of pinned
/// memory on device `ordinal`.
pub(super) fn mem_create(
    bytes: u64,
    ordinal: c_int,
) -> Result<sys::CUmemGenericAllocationHandle, DeviceError> {
    let size = usize::try_from(bytes).map_err(|_| DeviceError::OutOfMemory { requested: bytes })?;
    let prop = pinned_prop(ordinal);
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a valid place to write and `prop` a valid description to read; flags 0.
    let code = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
    check("cuMemCreate", code)?;
    Ok(handle)
}

/// `cuMemRelease`.
///
/// # Safety
/// `handle` came from [`mem_create`] and is released once; its memory lives on until its last
/// mapping is unmapped (the driver's rule), so releasing a mapped one is no use after free.
pub(super) unsafe fn mem_release(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees a live handle released once.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

/// `cuMemMap` of all of `handle` at `ptr`, then `cuMemSetAccess` (read and write from device
/// `ordinal`); if the access cannot be set, the mapping is undone.
///
/// # Safety
/// `[ptr, ptr + bytes)` lies in a reservation of the current context and nothing is mapped there;
/// `handle` is a live allocation of exactly `bytes`.
pub(super) unsafe fn mem_map(
    ptr: sys::CUdeviceptr,
    bytes: u64,
    handle: sys::CUmemGenericAllocationHandle,
    ordinal: c_int,
) -> Result<(), DeviceError> {
    let size = bytes as usize;
    // SAFETY: the caller guarantees a free, reserved range and a live handle of this size; offset
    // and flags 0 as documented.
    check("cuMemMap", unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) })?;
    let desc = sys::CUmemAccessDesc {
        location: device_location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: `[ptr, ptr + size)` is mapped (just above) and `desc` is one valid descriptor.
    let access = check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(ptr, size, &desc, 1) });
    if access.is_err() {
        // SAFETY: the range was mapped just above and nothing has used it.
        let _ = unsafe { sys::cuMemUnmap(ptr, size) };
    }
    access
}

/// `cuMemUnmap`.
///
/// # Safety
/// `[ptr, ptr + bytes)` is exactly one mapping made by [`mem_map`], and no unfinished device work
/// and no later use touches it (the driver does not wait for the streams).
pub(super) unsafe fn mem_unmap(ptr: sys::CUdeviceptr, bytes: u64) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees a whole mapping nothing uses any more.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, bytes as usize) })
}

/// `cuMemHostAlloc` (flags 0, as `cudaHostAllocDefault`): `bytes` of page-locked host memory.
/// The driver's out-of-memory answer becomes [`DeviceError::OutOfMemory`].
pub(super) fn mem_host_alloc(bytes: u64) -> Result<HostPtr, DeviceError> {
    let size = usize::try_from(bytes).map_err(|_| DeviceError::OutOfMemory { requested: bytes })?;
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // SAFETY: `ptr` is a valid place for the driver to write the new address.
    let code = unsafe { sys::cuMemHostAlloc(&mut ptr, size, 0) };
    if code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Err(DeviceError::OutOfMemory { requested: bytes });
    }
    check("cuMemHostAlloc", code)?;
    HostPtr::new(ptr.cast())
        .ok_or(DeviceError::Driver { op: "cuMemHostAlloc", code: DeviceError::CUDA_ERROR_UNKNOWN })
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `ptr` came from [`mem_host_alloc`] and is not used (by the host or by unfinished copies)
/// after this call.
pub(super) unsafe fn mem_free_host(ptr: HostPtr) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees `ptr` is a live pinned allocation no longer in use.
    check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr.as_ptr().cast()) })
}

/// `cuMemcpyHtoDAsync`: copies `bytes` bytes from host `src` to device `dst` in `stream`'s order.
///
/// # Safety
/// `[src, src + bytes)` is host memory that stays valid and unwritten until the copy completed
/// (pinned, or the driver stages it), `[dst, dst + bytes)` is device memory of the current
/// context, and `stream` is a live handle of the current context.
pub(super) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: HostPtr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees both ranges and the stream are valid.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast_const().cast(), bytes, stream)
    })
}

/// `cuMemcpyDtoHAsync`: copies `bytes` bytes from device `src` to host `dst` in `stream`'s order.
///
/// # Safety
/// `[dst, dst + bytes)` is host memory that stays valid and untouched by the host until the copy
/// completed, `[src, src + bytes)` is device memory of the current context, and `stream` is a
/// live handle of the current context.
pub(super) unsafe fn memcpy_dtoh_async(
    dst: HostPtr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees both ranges and the stream are valid.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.as_ptr().cast(), src, bytes, stream)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_maps_success_and_names_the_error() {
        assert_eq!(check("op", sys::CUresult::CUDA_SUCCESS), Ok(()));
        let err = check("cuMemAlloc", sys::CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert_eq!(err, DeviceError::Driver { op: "cuMemAlloc", code: 1 });
        assert_eq!(err.to_string(), "cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE (1)");
    }
}
