//! `Ctx`: where an op's output comes from and which stream it runs on. Every op is a method of
//! `Ctx` (in `ops/`); it allocates its output, enqueues one kernel on the context's stream and
//! returns at once.
//!
//! ```text
//!   Ctx<'t, B> { eager, scope: Option<&'t Scope>, stream }
//!     scope = Some(s): outputs are ScopedBuffers of the step   → Tensor<'t> cannot outlive it
//!     scope = None   : outputs are Transient allocator Buffers → Tensor<'static> (gradients)
//! ```
//!
//! Inputs must be ready on the context's stream: made on it, or on another stream followed by
//! [`Ctx::wait_for`] (which also records the use, so the input's memory is not reused early).

use super::backend::{Backend, ELEM, KernelOp};
use super::engine::Eager;
use super::error::{EagerError, Result, shape_err};
use super::record::TraceTag;
use super::shape::Shape;
use super::tensor::{Mem, Tensor};
use std::sync::Arc;
use tidepool::DeviceAddr;
use tidepool::Residency;
use tidepool::Scope;
use tidepool::device::StreamId;

/// Where op outputs are allocated and which stream ops run on; see the module docs.
pub struct Ctx<'t, B: Backend> {
    pub(crate) eager: Eager<B>,
    scope: Option<&'t Scope<'t, B::Device>>,
    stream: StreamId,
}

impl<B: Backend> Ctx<'static, B> {
    pub(crate) fn unscoped(eager: Eager<B>, stream: StreamId) -> Ctx<'static, B> {
        Ctx { eager, scope: None, stream }
    }
}

impl<'t, B: Backend> Ctx<'t, B> {
    pub(crate) fn scoped(eager: Eager<B>, scope: &'t Scope<'t, B::Device>) -> Ctx<'t, B> {
        Ctx { stream: scope.stream(), eager, scope: Some(scope) }
    }

    /// The stream ops of this context run on (and their outputs belong to).
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// The eager layer.
    pub fn eager(&self) -> &Eager<B> {
        &self.eager
    }

    /// Whether outputs come from a step's scope.
    pub fn is_scoped(&self) -> bool {
        self.scope.is_some()
    }

    /// A tensor of this context holding `data` (copied to the device on the context's stream).
    pub fn tensor(&self, data: &[f32], dims: &[usize]) -> Result<Tensor<'t, B>> {
        let shape = Shape::new(dims)?;
        if shape.numel() != data.len() {
            return shape_err(format!("{} values for shape {shape}", data.len()));
        }
        let t = self.output(shape)?;
        self.eager.backend().upload(self.stream, t.ptr(), data)?;
        self.eager.count(|c| &c.uploads);
        Ok(t)
    }

    /// A tensor of this context filled with `value`.
    pub fn full(&self, dims: &[usize], value: f32) -> Result<Tensor<'t, B>> {
        let t = self.output(Shape::new(dims)?)?;
        self.launch(&KernelOp::Fill { out: t.ptr(), n: t.numel(), value }, t.numel())?;
        Ok(t)
    }

    /// A tensor of this context filled with zeros.
    pub fn zeros(&self, dims: &[usize]) -> Result<Tensor<'t, B>> {
        self.full(dims, 0.0)
    }

    /// Makes `t` (made on another stream) ready for this context's stream: this stream waits, on
    /// the device, for the work enqueued on `t`'s stream so far, and `t`'s memory is recorded as
    /// used here, so it is not reused before this stream's work on it completes (PyTorch's
    /// `wait_stream` + `record_stream`). Nothing to do on the same stream.
    pub fn wait_for(&self, t: &Tensor<'_, B>) -> Result<()> {
        same_device(&self.eager, t)?;
        if t.stream() == self.stream {
            return Ok(());
        }
        self.eager.wait_stream(self.stream, t.stream())?;
        t.record_stream(self.stream)
    }

    /// The address of `t`, an operand of an op of this context: a tensor of another device
    /// (another engine's, over a device of its own) is refused with
    /// [`AllocError::ForeignBuffer`](tidepool::AllocError::ForeignBuffer) — its address means
    /// nothing here, and a kernel reading it would read whatever this device holds there.
    pub(crate) fn input(&self, t: &Tensor<'_, B>) -> Result<DeviceAddr> {
        same_device(&self.eager, t)?;
        Ok(t.ptr())
    }

    /// [`Ctx::output`] for an op reading `inputs`: they are checked first ([`Ctx::input`]), so
    /// an op refused for an operand allocates nothing. Allocated and dropped, a refused op's
    /// output took a slot of a step's learned plan, and the step's later runs fell back and
    /// learned again (two extra device segments for one refused op).
    pub(crate) fn output_of(
        &self,
        shape: Shape,
        inputs: &[&Tensor<'_, B>],
    ) -> Result<Tensor<'t, B>> {
        // BROKEN (`refused_ops_allocate`): the output is allocated before the operands are
        // checked.
        let late = cfg!(tidepool_broken = "refused_ops_allocate");
        if !late {
            inputs.iter().try_for_each(|t| same_device(&self.eager, t))?;
        }
        let out = self.output(shape)?;
        if late {
            inputs.iter().try_for_each(|t| same_device(&self.eager, t))?;
        }
        Ok(out)
    }

    /// Allocates an uninitialised output of `shape` (through the scope, or the allocator).
    pub(crate) fn output(&self, shape: Shape) -> Result<Tensor<'t, B>> {
        let bytes = shape.numel() as u64 * ELEM;
        let mem = match self.scope {
            Some(scope) => {
                let buf = scope.alloc(bytes).map_err(EagerError::from);
                Mem::Scoped(self.eager.counted(|c| &c.scoped_allocs, buf)?)
            }
            None => {
                let buf = self.eager.allocator().alloc(bytes, self.stream).map_err(Into::into);
                Mem::Owned(self.eager.counted(|c| &c.unscoped_allocs, buf)?)
            }
        };
        Ok(Tensor::from_parts(self.eager.clone(), mem, shape, Residency::Transient, TraceTag::Act))
    }

    /// Enqueues `op` on this context's stream, unless it writes nothing (`work == 0`).
    pub(crate) fn launch(&self, op: &KernelOp, work: usize) -> Result<()> {
        if work == 0 {
            return Ok(());
        }
        self.eager.counted(|c| &c.kernels, self.eager.backend().launch(self.stream, op))
    }
}

/// Tensor constructors that take a context (here, above the tensor type, so that `tensor.rs`
/// needs nothing of `Ctx`).
impl<'t, B: Backend> Tensor<'t, B> {
    /// A tensor made in `ctx` (its scope, or the allocator) holding `data`.
    pub fn from_host(ctx: &Ctx<'t, B>, data: &[f32], dims: &[usize]) -> Result<Tensor<'t, B>> {
        ctx.tensor(data, dims)
    }

    /// A tensor made in `ctx` filled with zeros.
    pub fn zeros(ctx: &Ctx<'t, B>, dims: &[usize]) -> Result<Tensor<'t, B>> {
        ctx.zeros(dims)
    }
}

/// The unscoped context of an engine (here, above the engine, so that `engine.rs` needs nothing
/// of `Ctx`).
impl<B: Backend> Eager<B> {
    /// Ops whose outputs are transient buffers from the allocator, outside any scope, on
    /// `stream`: for values that outlive a step (gradients, prefetched inputs).
    pub fn ctx(&self, stream: StreamId) -> Ctx<'static, B> {
        Ctx::unscoped(self.clone(), stream)
    }
}

/// Refuses `t` when it lives on another device than `eager`'s ([`Ctx::input`]).
pub(crate) fn same_device<B: Backend>(eager: &Eager<B>, t: &Tensor<'_, B>) -> Result<()> {
    // BROKEN (`foreign_tensors`): any tensor's address taken as this device's.
    if !cfg!(tidepool_broken = "foreign_tensors") {
        same_device_ctx(eager, t.eager())?;
    }
    Ok(())
}

/// Refuses `other` (the engine of a tensor or of a context whose outputs an op writes) when
/// its device is not `eager`'s, with [`AllocError::ForeignBuffer`](tidepool::AllocError).
pub(crate) fn same_device_ctx<B: Backend>(eager: &Eager<B>, other: &Eager<B>) -> Result<()> {
    if !Arc::ptr_eq(eager.device(), other.device()) {
        return Err(EagerError::Alloc(tidepool::AllocError::ForeignBuffer));
    }
    Ok(())
}
