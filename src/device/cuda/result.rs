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

use crate::device::{DeviceError, MemInfo};
use cudarc::driver::sys;
use std::ffi::c_uint;

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
