//! `CudaBuffer<T>`: a tidepool [`Buffer`] seen by cudarc as a device slice of `len` elements of
//! `T`, so it goes wherever cudarc takes a `CudaSlice<T>`: kernel arguments
//! (`stream.launch_builder(&f).arg(&buf)`), copies (`memcpy_htod`, `clone_dtoh`), cuBLAS `gemm`.
//!
//! ```text
//!   CudaBuffer<T> { buffer: Buffer<CudaDevice>  ── frees itself, stream-ordered, on drop
//!                   ptr: CUdeviceptr            ── what kernels get
//!                   len: elements of T
//!                   stream: Arc<CudaStream> }   ── the cudarc stream of buffer.stream()
//! ```
//!
//! cudarc's own `CudaSlice` orders its uses across streams with a read and a write event per
//! slice. A `CudaBuffer` carries none ([`DevicePtr::device_ptr`] returns `SyncOnDrop::Sync(None)`):
//! tidepool orders memory by stream like PyTorch. Use a buffer on its own stream, or, when another
//! stream uses it, order that stream yourself and call [`crate::Allocator::record_stream`] so the
//! block is not reused before that stream's work is done.

use crate::allocator::{AllocError, Allocator, Buffer};
use crate::device::cuda::result;
use crate::device::{CudaDevice, DeviceError};
use crate::types::{Residency, StreamId};
use cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop, ValidAsZeroBits, sys,
};
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

/// A tidepool buffer typed as `len` elements of `T`, usable wherever cudarc takes a device slice.
/// Dropping it frees the memory back to the allocator, in its stream's order.
///
/// ```no_run
/// use tidepool::{Allocator, Config, CudaBuffer, CudaDevice, StreamId};
///
/// let device = CudaDevice::new(0)?;
/// let alloc = Allocator::new(device.clone(), Config::default())?;
/// let stream = device.stream(StreamId::DEFAULT)?;
/// // was: let mut x = stream.alloc_zeros::<f32>(1024)?;
/// let mut x = CudaBuffer::<f32>::alloc_zeros(&alloc, 1024, StreamId::DEFAULT)?;
/// stream.memcpy_htod(&vec![1.0f32; 1024], &mut x)?;
/// let host: Vec<f32> = stream.clone_dtoh(&x)?;
/// // was: let y = unsafe { stream.alloc::<f32>(1024) }?;
/// let y = unsafe { CudaBuffer::<f32>::alloc(&alloc, 1024, StreamId::DEFAULT) }?;
/// assert_eq!(host, vec![1.0; 1024]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CudaBuffer<T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    buffer: Buffer<CudaDevice>,
    /// The memory is on the device; no `T` lives on the host, so `T` does not affect `Send`.
    _elem: PhantomData<fn() -> T>,
}

impl<T: DeviceRepr> CudaBuffer<T> {
    /// `len` elements of uninitialised transient memory on `stream`.
    ///
    /// # Safety
    /// The memory is not initialised as `T`s: it holds whatever it held (a previous buffer's
    /// bytes, say). Write it before reading it back as a `T` that has invalid bit patterns
    /// (`bool`, say), as with cudarc's `CudaStream::alloc`.
    pub unsafe fn alloc(
        alloc: &Allocator<CudaDevice>,
        len: usize,
        stream: StreamId,
    ) -> Result<CudaBuffer<T>, AllocError> {
        // SAFETY: the caller takes on `alloc_in`'s contract.
        unsafe { Self::alloc_in(alloc, len, stream, Residency::Transient) }
    }

    /// `len` elements of uninitialised memory on `stream` with the given residency (weights
    /// [`Residency::Persistent`], activations [`Residency::Transient`]).
    ///
    /// # Safety
    /// The memory is not initialised as `T`s: it holds whatever it held (a previous buffer's
    /// bytes, say). Write it before reading it back as a `T` that has invalid bit patterns
    /// (`bool`, say), as with cudarc's `CudaStream::alloc`.
    pub unsafe fn alloc_in(
        alloc: &Allocator<CudaDevice>,
        len: usize,
        stream: StreamId,
        residency: Residency,
    ) -> Result<CudaBuffer<T>, AllocError> {
        let bytes = (len as u64)
            .checked_mul(size_of::<T>() as u64)
            .ok_or(AllocError::InvalidSize { requested: u64::MAX })?;
        // Look the stream up first: an unknown stream allocates nothing.
        let cu_stream = alloc.device().stream(stream)?;
        let buffer = alloc.alloc_in(bytes, stream, residency)?;
        Ok(CudaBuffer { ptr: buffer.ptr().0, len, stream: cu_stream, buffer, _elem: PhantomData })
    }

    /// `len` zeroed elements on `stream` (an asynchronous memset in the stream's order): the
    /// tidepool form of cudarc's `stream.alloc_zeros::<T>(len)`.
    pub fn alloc_zeros(
        alloc: &Allocator<CudaDevice>,
        len: usize,
        stream: StreamId,
    ) -> Result<CudaBuffer<T>, AllocError>
    where
        T: ValidAsZeroBits,
    {
        // SAFETY: the memory is zeroed below, in its stream's order, before any use can read it;
        // `ValidAsZeroBits` makes all-zero bytes a valid `T`.
        let buf = unsafe { Self::alloc(alloc, len, stream) }?;
        let bytes = buf.num_bytes();
        if bytes > 0 {
            alloc.device().bind()?;
            // SAFETY: the range is the buffer's own memory, just handed out to this stream, and
            // the memset runs in that stream's order; the stream is alive (we hold its `Arc`).
            unsafe { result::memset_d8_async(buf.ptr, 0, bytes, buf.stream.cu_stream()) }?;
        }
        Ok(buf)
    }

    /// Views an untyped buffer as elements of `T`. Its length in bytes must be a multiple of
    /// `size_of::<T>()` (and `T` not zero-sized).
    ///
    /// # Safety
    /// As for [`CudaBuffer::alloc`]: the bytes are not known to be valid `T`s.
    pub unsafe fn from_buffer(buffer: Buffer<CudaDevice>) -> Result<CudaBuffer<T>, DeviceError> {
        let elem = size_of::<T>() as u64;
        if elem == 0 || !buffer.len().is_multiple_of(elem) {
            return Err(DeviceError::Unsupported(
                "a buffer whose length is not a whole number of elements",
            ));
        }
        let len = usize::try_from(buffer.len() / elem)
            .map_err(|_| DeviceError::Unsupported("a buffer longer than usize::MAX elements"))?;
        let stream = buffer.device().stream(buffer.stream())?;
        Ok(CudaBuffer { ptr: buffer.ptr().0, len, stream, buffer, _elem: PhantomData })
    }
}

impl<T> CudaBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The raw device address (`CUdeviceptr`); 0 for an empty buffer.
    pub fn cu_device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The tidepool stream that owns the memory.
    pub fn stream_id(&self) -> StreamId {
        self.buffer.stream()
    }

    /// The cudarc stream that owns the memory (the same as [`DeviceSlice::stream`]).
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The untyped tidepool buffer (for [`crate::Allocator::record_stream`], say).
    pub fn buffer(&self) -> &Buffer<CudaDevice> {
        &self.buffer
    }

    /// Gives the untyped buffer back.
    pub fn into_buffer(self) -> Buffer<CudaDevice> {
        self.buffer
    }
}

impl<T> fmt::Debug for CudaBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("elem", &std::any::type_name::<T>())
            .field("len", &self.len)
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl<T> DeviceSlice<T> for CudaBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for CudaBuffer<T> {
    /// The address, with nothing to do on drop: tidepool orders memory by stream, not by
    /// per-buffer events (see the module docs).
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for CudaBuffer<T> {
    /// The address, with nothing to do on drop (see [`DevicePtr::device_ptr`]).
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

// SAFETY: the argument pushed is a reference to the buffer's `CUdeviceptr` field, which lives as
// long as the borrow `'b` of the buffer, itself at least as long as the launch builder `'a`; a
// `CUdeviceptr` is how CUDA passes a `T*` kernel parameter (cudarc does the same for `CudaSlice`).
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CudaBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CudaBuffer<T>) -> &mut Self {
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
    }
}

// SAFETY: as for `&CudaBuffer<T>` above; the exclusive borrow only says the kernel may write.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CudaBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CudaBuffer<T>) -> &mut Self {
        let ptr: &'b sys::CUdeviceptr = &arg.ptr;
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, ptr)
    }
}
