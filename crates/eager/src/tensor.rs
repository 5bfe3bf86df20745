//! `Tensor`: an f32, contiguous, row-major array in device memory with a shape and a stream.
//!
//! ```text
//!   Tensor<'t, B> { shape, storage: Storage { mem, eager, trace_id, residency, tag } }
//!     mem = Owned(Buffer)              parameters (Persistent), unscoped results (Transient)
//!         | Scoped(ScopedBuffer<'t>)   results of ops in a step: borrow the step's scope, so
//!                                      they cannot outlive it (checked by the compiler)
//! ```
//!
//! The residency of the storage is chosen by how the tensor is made: [`Tensor::parameter`] is
//! Persistent; outputs of a step's [`crate::Ctx`] come from its scope; outputs of an unscoped
//! `Ctx` ([`Eager::ctx`], [`crate::Step::unscoped`]) are Transient buffers of the allocator.
//! Dropping a tensor frees its memory in its stream's order (and records the free in the trace).

use super::backend::{Backend, ELEM, KernelOp};
use super::engine::Eager;
use super::error::{Result, shape_err};
use super::record::TraceTag;
use super::shape::Shape;
use std::fmt;
use tidepool::Residency;
use tidepool::device::{Device, DeviceAddr, StreamId};
use tidepool::{Buffer, ScopedBuffer};

/// The memory of a tensor.
pub(crate) enum Mem<'t, D: Device> {
    /// An ordinary buffer (persistent, or transient outside any scope).
    Owned(Buffer<D>),
    /// A buffer of a step's scope.
    Scoped(ScopedBuffer<'t, D>),
}

impl<D: Device> Mem<'_, D> {
    fn ptr(&self) -> DeviceAddr {
        match self {
            Mem::Owned(b) => b.ptr(),
            Mem::Scoped(b) => b.ptr(),
        }
    }

    fn len(&self) -> u64 {
        match self {
            Mem::Owned(b) => b.len(),
            Mem::Scoped(b) => b.len(),
        }
    }

    fn stream(&self) -> StreamId {
        match self {
            Mem::Owned(b) => b.stream(),
            Mem::Scoped(b) => b.stream(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tensor's memory plus what its free must report.
struct Storage<'t, B: Backend> {
    mem: Mem<'t, B::Device>,
    eager: Eager<B>,
    /// Id in the trace (0: not recorded).
    trace_id: u64,
    residency: Residency,
    tag: TraceTag,
}

impl<B: Backend> Drop for Storage<'_, B> {
    fn drop(&mut self) {
        if self.trace_id != 0
            && let Some(r) = self.eager.recorder()
        {
            let m = &self.mem;
            r.free(self.trace_id, m.len(), m.stream(), self.tag);
        }
    }
}

/// An f32 tensor in device memory; see the module docs.
pub struct Tensor<'t, B: Backend> {
    shape: Shape,
    storage: Storage<'t, B>,
}

impl<'t, B: Backend> Tensor<'t, B> {
    pub(crate) fn from_parts(
        eager: Eager<B>,
        mem: Mem<'t, B::Device>,
        shape: Shape,
        residency: Residency,
        tag: TraceTag,
    ) -> Tensor<'t, B> {
        let b = &mem;
        let trace_id = match eager.recorder() {
            Some(r) if !b.is_empty() => r.alloc(b.len(), b.stream(), tag),
            _ => 0,
        };
        Tensor { shape, storage: Storage { mem, eager, trace_id, residency, tag } }
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        self.shape.dims()
    }

    /// The shape as a value.
    pub fn dims(&self) -> Shape {
        self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// The stream that owns its memory (where ops producing it ran).
    pub fn stream(&self) -> StreamId {
        self.storage.mem.stream()
    }

    /// The device address of element 0.
    pub fn ptr(&self) -> DeviceAddr {
        self.storage.mem.ptr()
    }

    /// Bytes of device memory asked for it.
    pub fn bytes(&self) -> u64 {
        self.storage.mem.len()
    }

    /// Persistent (parameters, optimizer state) or transient.
    pub fn residency(&self) -> Residency {
        self.storage.residency
    }

    /// Whether its memory comes from a step's scope.
    pub fn is_scoped(&self) -> bool {
        matches!(self.storage.mem, Mem::Scoped(_))
    }

    /// The eager layer it belongs to.
    pub fn eager(&self) -> &Eager<B> {
        &self.storage.eager
    }

    /// Copies it to the host: enqueues a read on its stream and waits for it (a host sync, so
    /// every earlier op on the stream has completed when it returns).
    pub fn to_host(&self) -> Result<Vec<f32>> {
        let eager = &self.storage.eager;
        eager.counted(
            |c| &c.downloads,
            eager.backend().download(self.stream(), self.ptr(), self.numel()),
        )
    }

    /// The same memory seen with another shape of as many elements.
    pub fn reshape(mut self, dims: &[usize]) -> Result<Tensor<'t, B>> {
        let shape = Shape::new(dims)?;
        if shape.numel() != self.numel() {
            return shape_err(format!("cannot reshape {} into {shape}", self.shape));
        }
        self.shape = shape;
        Ok(self)
    }

    /// Marks its memory as used on `stream` too (see [`tidepool::Allocator::record_stream`]).
    pub fn record_stream(&self, stream: StreamId) -> Result<()> {
        match &self.storage.mem {
            Mem::Owned(b) => b.record_stream(stream)?,
            Mem::Scoped(b) => b.record_stream(stream)?,
        }
        Ok(())
    }

    /// Overwrites it in place with `data`, in its stream's order.
    pub fn copy_from_host(&mut self, data: &[f32]) -> Result<()> {
        if data.len() != self.numel() {
            return shape_err(format!("{} values for shape {}", data.len(), self.shape));
        }
        let eager = &self.storage.eager;
        eager.counted(|c| &c.uploads, eager.backend().upload(self.stream(), self.ptr(), data))
    }
}

impl<B: Backend> Tensor<'static, B> {
    /// A persistent tensor (a weight) holding `data`, on `stream`.
    pub fn parameter(
        eager: &Eager<B>,
        data: &[f32],
        dims: &[usize],
        stream: StreamId,
    ) -> Result<Tensor<'static, B>> {
        let shape = Shape::new(dims)?;
        if shape.numel() != data.len() {
            return shape_err(format!("{} values for shape {shape}", data.len()));
        }
        let t = Self::persistent(eager, shape, stream)?;
        eager.backend().upload(stream, t.ptr(), data)?;
        eager.count(|c| &c.uploads);
        Ok(t)
    }

    /// A persistent tensor of zeros (optimizer state), on `stream`.
    pub fn persistent_zeros(
        eager: &Eager<B>,
        dims: &[usize],
        stream: StreamId,
    ) -> Result<Tensor<'static, B>> {
        let t = Self::persistent(eager, Shape::new(dims)?, stream)?;
        if t.numel() > 0 {
            let fill = KernelOp::Fill { out: t.ptr(), n: t.numel(), value: 0.0 };
            eager.counted(|c| &c.kernels, eager.backend().launch(stream, &fill))?;
        }
        Ok(t)
    }

    fn persistent(eager: &Eager<B>, shape: Shape, stream: StreamId) -> Result<Tensor<'static, B>> {
        let bytes = shape.numel() as u64 * ELEM;
        let buf = eager.allocator().alloc_in(bytes, stream, Residency::Persistent)?;
        eager.count(|c| &c.persistent_allocs);
        Ok(Tensor::from_parts(
            eager.clone(),
            Mem::Owned(buf),
            shape,
            Residency::Persistent,
            TraceTag::Param,
        ))
    }
}

impl<B: Backend> fmt::Debug for Tensor<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &self.shape)
            .field("stream", &self.stream())
            .field("residency", &self.storage.residency)
            .field("scoped", &self.is_scoped())
            .field("ptr", &self.ptr())
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// Checks that two tensors have the same shape.
pub(crate) fn same_shape<B: Backend>(op: &str, a: &Tensor<'_, B>, b: &Tensor<'_, B>) -> Result<()> {
    if a.dims() != b.dims() {
        return shape_err(format!("{op}: shapes {:?} and {:?} differ", a.shape(), b.shape()));
    }
    Ok(())
}
