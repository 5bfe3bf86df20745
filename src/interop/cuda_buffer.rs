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
//! cudarc's contract for a device slice: [`DevicePtr::device_ptr`]`(&stream)` makes `stream` wait
//! for the slice's last write, [`DevicePtrMut::device_ptr_mut`] for its reads too, and the use is
//! remembered. cudarc's own `CudaSlice` keeps a read and a write event per slice; a `CudaBuffer`
//! asks its allocator instead ([`Buffer::use_on`], tested on the SimDevice): the using stream
//! waits, on the device, for the owner stream's work (or the last write announced on another
//! stream), and the use is recorded like [`crate::Allocator::record_stream`], so the block is not
//! reused before that stream's work is done (on the buffer's own stream too, after a write
//! announced on another one). A kernel argument is not a `DevicePtr` call: announce each launch
//! with [`CudaBuffer::order_for`]. A cudarc stream this device does not know (one it did not create,
//! or one of another GPU's context), or a device error, falls back to host synchronisation: the
//! buffer's context is synchronised before the use and the using stream after it (when cudarc
//! drops the returned [`SyncOnDrop`]), so nothing is left in flight on memory the allocator may
//! reuse.

use crate::allocator::{AllocError, Allocator, Buffer};
use crate::device::cuda::result;
use crate::device::{AccessKind, CudaDevice, DeviceError};
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
    /// `len` elements of uninitialised transient memory on `stream`. A zero-sized `T` is
    /// refused ([`DeviceError::Unsupported`], as [`CudaBuffer::from_buffer`] refuses it, and as
    /// cudarc's `alloc` fails for it); `len` 0 of a sized `T` is an empty buffer.
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
        let bytes = super::elements::alloc_bytes(len, size_of::<T>())?;
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
    /// `size_of::<T>()` (and `T` not zero-sized), and its stream one the device still knows.
    /// A refusal gives the buffer back, untouched, as `String::from_utf8` gives its bytes back:
    /// [`FromBufferError::into_buffer`], with the reason in [`FromBufferError::error`].
    ///
    /// ```no_run
    /// use tidepool::{Allocator, Config, CudaBuffer, CudaDevice, StreamId};
    ///
    /// let device = CudaDevice::new(0)?;
    /// let alloc = Allocator::new(device.clone(), Config::default())?;
    /// let buf = alloc.alloc(10, StreamId::DEFAULT)?;
    /// // 10 bytes are not whole f32s: refused, and the buffer comes back.
    /// let refused = unsafe { CudaBuffer::<f32>::from_buffer(buf) }.unwrap_err();
    /// let buf = refused.into_buffer();
    /// let bytes = unsafe { CudaBuffer::<u8>::from_buffer(buf) }?;
    /// assert_eq!(bytes.len(), 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Safety
    /// As for [`CudaBuffer::alloc`]: the bytes are not known to be valid `T`s.
    pub unsafe fn from_buffer(
        buffer: Buffer<CudaDevice>,
    ) -> Result<CudaBuffer<T>, FromBufferError> {
        let stream = |b: &Buffer<CudaDevice>| b.device().stream(b.stream());
        match super::elements::elements(buffer, size_of::<T>(), stream) {
            Ok((buffer, len, stream)) => {
                Ok(CudaBuffer { ptr: buffer.ptr().0, len, stream, buffer, _elem: PhantomData })
            }
            Err(refusal) => Err(FromBufferError {
                refusal,
                elem: std::any::type_name::<T>(),
                elem_size: size_of::<T>(),
            }),
        }
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

/// Why [`CudaBuffer::from_buffer`] refused a buffer, holding the buffer, untouched: a caller
/// who got the element type wrong keeps the allocation ([`FromBufferError::into_buffer`]), as
/// [`String::from_utf8`]'s error gives its bytes back
/// ([`FromUtf8Error::into_bytes`](std::string::FromUtf8Error::into_bytes)). The buffer used to
/// be dropped with the error, its memory freed.
///
/// Its `Display` says which buffer and which element type; the reason is its
/// [`source`](std::error::Error::source) ([`FromBufferError::error`]).
pub struct FromBufferError {
    /// Why, and the buffer (boxed: a refusal is the cold path, and the `Result` stays small).
    refusal: Box<(DeviceError, Buffer<CudaDevice>)>,
    /// The element type asked for, and its size.
    elem: &'static str,
    elem_size: usize,
}

impl FromBufferError {
    /// Why: [`DeviceError::Unsupported`] for a length that is not a whole number of elements
    /// (or a zero-sized element type), the device's error for a stream it no longer knows
    /// ([`DeviceError::UnknownStream`]).
    pub fn error(&self) -> &DeviceError {
        &self.refusal.0
    }

    /// The buffer refused.
    pub fn buffer(&self) -> &Buffer<CudaDevice> {
        &self.refusal.1
    }

    /// Gives the buffer back, as it was given to [`CudaBuffer::from_buffer`].
    pub fn into_buffer(self) -> Buffer<CudaDevice> {
        self.refusal.1
    }

    /// The reason and the buffer.
    pub fn into_parts(self) -> (DeviceError, Buffer<CudaDevice>) {
        *self.refusal
    }
}

impl fmt::Display for FromBufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot view a buffer of {} bytes on {} as elements of `{}` ({} bytes each)",
            self.buffer().len(),
            self.buffer().stream(),
            self.elem,
            self.elem_size
        )
    }
}

impl fmt::Debug for FromBufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromBufferError")
            .field("error", self.error())
            .field("elem", &self.elem)
            .field("buffer", self.buffer())
            .finish()
    }
}

impl std::error::Error for FromBufferError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.error())
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

impl<T> CudaBuffer<T> {
    /// Announces that work about to be enqueued on `stream` will `access` the buffer (see
    /// [`Buffer::use_on`]): what cudarc's copies do through [`DevicePtr`] on their own. A kernel
    /// launch does not (cudarc keeps a launch builder's stream private), so before a launch
    /// that takes the buffer, call this, as one of the launch's preconditions: on another
    /// stream always, and on the buffer's own stream once the buffer was used on another one
    /// (a cudarc copy there wrote it: the launch must wait for it, as cudarc's `CudaSlice`
    /// argument waits for its write event). While the buffer was never used elsewhere, the
    /// call on its own stream does nothing, so calling it before every launch is the simple
    /// rule.
    /// A cudarc stream this device does not know (neither created nor adopted by it, nor its
    /// null stream; a stream of another GPU's context) is
    /// [`AllocError::UnknownStream`]`(StreamId(u32::MAX))`: it has no id here, and no stream
    /// has that one.
    pub fn order_for(&self, stream: &CudaStream, access: AccessKind) -> Result<(), AllocError> {
        let id = self.buffer.device().stream_id(stream);
        let id = id.ok_or(AllocError::UnknownStream(StreamId(u32::MAX)))?;
        self.buffer.use_on(id, access)
    }

    /// Orders a use on `stream` (see the module docs): what the returned guard does on drop.
    fn use_on<'a>(&self, stream: &'a CudaStream, access: AccessKind) -> SyncOnDrop<'a> {
        if self.len == 0 {
            return SyncOnDrop::Sync(None);
        }
        let ordered = match self.buffer.device().stream_id(stream) {
            Some(id) => self.buffer.use_on(id, access).is_ok(),
            None => false,
        };
        if ordered {
            return SyncOnDrop::Sync(None);
        }
        // Nothing orders this stream in the allocator's terms: every earlier write is done
        // before the use, and the use itself before the guard is dropped. The writes are in
        // the buffer's context, which a stream of another context (another GPU's, copying
        // peer to peer) is not: synchronising that stream's context waited for nothing of
        // the buffer's. An error goes where cudarc keeps the using stream's errors.
        // BROKEN (`fallback_syncs_user_context`): the using stream's context synchronised.
        let owner = if cfg!(tidepool_broken = "fallback_syncs_user_context") {
            stream.context()
        } else {
            self.buffer.device().context()
        };
        let ctx = stream.context();
        ctx.record_err(owner.synchronize());
        // The synchronisation made the buffer's context current on this thread; the cudarc
        // call goes on with the using stream, whose context must be current again.
        ctx.record_err(ctx.bind_to_thread());
        SyncOnDrop::sync_stream(stream)
    }
}

impl<T> DevicePtr<T> for CudaBuffer<T> {
    /// The address, after `stream` was made to wait for the buffer's last write; the read is
    /// recorded so the block is not reused before it completed (see the module docs).
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.use_on(stream, AccessKind::Read))
    }
}

impl<T> DevicePtrMut<T> for CudaBuffer<T> {
    /// The address, after `stream` was made to wait for the buffer's last write and the reads
    /// since; the write is recorded (see [`DevicePtr::device_ptr`]).
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.use_on(stream, AccessKind::Write))
    }
}

// SAFETY: the argument pushed is a reference to the buffer's `CUdeviceptr` field, which lives as
// long as the borrow `'b` of the buffer, itself at least as long as the launch builder `'a`; a
// `CUdeviceptr` is how CUDA passes a `T*` kernel parameter (cudarc does the same for `CudaSlice`).
// The builder does not tell which stream the launch goes to, so stream order is the launching
// code's to announce (`CudaBuffer::order_for`: on another stream, and on the buffer's own once
// it was used elsewhere), with the launch's other unsafe preconditions.
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
