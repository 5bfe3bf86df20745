//! The MLP training loop shared by `examples/mlp_train.rs`, `tidepool demo`, the tests and the
//! benchmarks, with the allocator's statistics measured around every step.
//!
//! ```text
//!   per step i:  x, y = batch i          (unscoped, on the copy stream when two_streams:
//!                                         prefetched during step i−1, then wait_for + record_stream)
//!                step = eager.step("step", compute)   (or plain allocator when !scoped)
//!                  forward + backward (activations scoped, gradients unscoped); loss.to_host()
//!                drop(step); optimizer.step(params, grads); drop(grads, x, y)
//!                StepReport = stats after − stats before
//! ```

use super::data::Clusters;
use super::mlp::Mlp;
use crate::{AdamW, Backend, Ctx, Eager, Optimizer, Result, Sgd, Tensor};
use tidepool::device::{Device, StreamId};

/// Which optimizer trains the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerKind {
    /// [`Sgd`] with this learning rate.
    Sgd(f32),
    /// [`AdamW`] with this learning rate (other settings PyTorch's defaults).
    AdamW(f32),
}

/// What to train and how.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    /// Layer widths, input first, classes last.
    pub sizes: Vec<usize>,
    /// Samples per batch.
    pub batch: usize,
    /// Steps to run.
    pub steps: usize,
    /// Seed of the data set and of the initial weights.
    pub seed: u64,
    /// Samples in the data set.
    pub samples: usize,
    /// Noise around the cluster centres.
    pub noise: f32,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// Activations from a named scope per step (`true`) or from the plain allocator.
    pub scoped: bool,
    /// Load batches on a second (copy) stream, one step ahead.
    pub two_streams: bool,
}

impl Default for TrainConfig {
    /// A small MLP (16 → 32 → 32 → 4) on 256 samples, batches of 32, SGD at 0.2, 20 steps.
    fn default() -> Self {
        TrainConfig {
            sizes: vec![16, 32, 32, 4],
            batch: 32,
            steps: 20,
            seed: 42,
            samples: 256,
            noise: 0.5,
            optimizer: OptimizerKind::Sgd(0.2),
            scoped: true,
            two_streams: false,
        }
    }
}

/// What one step did (differences of the counters over the step, memory at its end).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    /// Step index.
    pub step: usize,
    /// The step's loss (before the update).
    pub loss: f32,
    /// Device mallocs (`num_device_alloc` delta).
    pub device_mallocs: u64,
    /// Device frees (`num_device_free` delta).
    pub device_frees: u64,
    /// Host syncs caused by the allocator.
    pub alloc_host_syncs: u64,
    /// Allocations served from a learned plan.
    pub plan_hits: u64,
    /// Planned allocations that could not be served from the plan.
    pub plan_misses: u64,
    /// Runs that left their plan.
    pub plan_fallbacks: u64,
    /// Tensors allocated through the step's scope.
    pub scoped_allocs: u64,
    /// Transient tensors allocated outside the scope (batch, gradients).
    pub unscoped_allocs: u64,
    /// Persistent tensors allocated (optimizer state on the first step).
    pub persistent_allocs: u64,
    /// Kernels launched.
    pub kernels: u64,
    /// Copies to and from the host.
    pub copies: u64,
    /// Peak allocated bytes during the step.
    pub peak_allocated_bytes: u64,
    /// Reserved bytes at the end of the step.
    pub reserved_bytes: u64,
}

struct Snapshot {
    alloc: tidepool::MemoryStats,
    eager: crate::EagerStats,
}

fn snapshot<B: Backend>(eager: &Eager<B>) -> Snapshot {
    Snapshot { alloc: eager.allocator().stats(), eager: eager.stats() }
}

fn report(step: usize, loss: f32, a: &Snapshot, b: &Snapshot) -> StepReport {
    StepReport {
        step,
        loss,
        device_mallocs: b.alloc.num_device_alloc - a.alloc.num_device_alloc,
        device_frees: b.alloc.num_device_free - a.alloc.num_device_free,
        alloc_host_syncs: b.alloc.num_host_syncs - a.alloc.num_host_syncs,
        plan_hits: b.alloc.plan_hits - a.alloc.plan_hits,
        plan_misses: b.alloc.plan_misses - a.alloc.plan_misses,
        plan_fallbacks: b.alloc.plan_fallbacks - a.alloc.plan_fallbacks,
        scoped_allocs: b.eager.scoped_allocs - a.eager.scoped_allocs,
        unscoped_allocs: b.eager.unscoped_allocs - a.eager.unscoped_allocs,
        persistent_allocs: b.eager.persistent_allocs - a.eager.persistent_allocs,
        kernels: b.eager.kernels - a.eager.kernels,
        copies: (b.eager.uploads + b.eager.downloads) - (a.eager.uploads + a.eager.downloads),
        peak_allocated_bytes: b.alloc.blocks.allocated_bytes.all.peak,
        reserved_bytes: b.alloc.blocks.reserved_bytes.all.current,
    }
}

type Batch<B> = (Tensor<'static, B>, Tensor<'static, B>);

/// One forward + backward in `cx`: waits for the batch, starts the next batch's load, reads the
/// loss back. Returns the loss and the gradients.
fn pass<'s, B: Backend>(
    model: &Mlp<B>,
    cx: &Ctx<'s, B>,
    gx: &Ctx<'static, B>,
    batch: &Batch<B>,
    prefetch: &mut dyn FnMut() -> Result<()>,
) -> Result<(f32, Vec<Tensor<'static, B>>)> {
    cx.wait_for(&batch.0)?;
    cx.wait_for(&batch.1)?;
    let p = model.forward_backward(cx, gx, &batch.0, &batch.1)?;
    prefetch()?;
    let loss = p.loss.to_host()?[0];
    Ok((loss, p.grads))
}

/// Trains an MLP on a [`Clusters`] data set as `cfg` says; calls `on_step` after every step.
/// With `two_streams`, a stream is created for the loads and destroyed at the end — after an
/// error too (the error is returned, not the cleanup's).
pub fn train_mlp<B: Backend>(
    eager: &Eager<B>,
    cfg: &TrainConfig,
    on_step: impl FnMut(&StepReport),
) -> Result<Vec<StepReport>> {
    let copy = if cfg.two_streams { Some(eager.device().create_stream()?) } else { None };
    // Every tensor of the run (model, optimizer state, batches) is gone when `train` returns,
    // so the stream has no live buffer left to refuse its destruction.
    let trained = train(eager, cfg, copy, on_step);
    // BROKEN (`copy_stream_leaks`): the stream is destroyed only after a run that succeeded.
    let leak = cfg!(tidepool_broken = "copy_stream_leaks") && trained.is_err();
    if let Some(s) = copy.filter(|_| !leak) {
        // Batches freed after a use on the compute stream wait for it: settle them first.
        let alloc = eager.allocator();
        let destroyed = alloc.synchronize().and_then(|()| alloc.destroy_stream(s));
        if trained.is_ok() {
            destroyed?;
        }
    }
    trained
}

/// [`train_mlp`]'s steps, loading batches on `copy` when given.
fn train<B: Backend>(
    eager: &Eager<B>,
    cfg: &TrainConfig,
    copy: Option<StreamId>,
    mut on_step: impl FnMut(&StepReport),
) -> Result<Vec<StepReport>> {
    let compute = StreamId::DEFAULT;
    let dim = cfg.sizes[0];
    let classes = *cfg.sizes.last().expect("sizes has input and output widths");
    let data = Clusters::new(cfg.samples, dim, classes, cfg.noise, cfg.seed);
    let mut model = Mlp::new(eager, &cfg.sizes, cfg.seed.wrapping_add(1), compute)?;
    let mut opt: Box<dyn Optimizer<B>> = match cfg.optimizer {
        OptimizerKind::Sgd(lr) => Box::new(Sgd::new(lr)),
        OptimizerKind::AdamW(lr) => Box::new(AdamW::new(lr)),
    };
    let load = |i: usize| -> Result<Batch<B>> {
        let (x, y) = data.batch(i, cfg.batch);
        let lx = eager.ctx(copy.unwrap_or(compute));
        Ok((lx.tensor(&x, &[cfg.batch, dim])?, lx.tensor(&y, &[cfg.batch])?))
    };
    let mut next: Option<Batch<B>> = match copy {
        Some(_) if cfg.steps > 0 => Some(load(0)?),
        _ => None,
    };
    // Grown as the steps run: a step count is no size to reserve up front (`tidepool demo
    // --steps 4294967295` asked for 480 GiB before the first step; `usize::MAX` overflows).
    // BROKEN (`steps_preallocated`): reserved up front.
    let reserve = match cfg!(tidepool_broken = "steps_preallocated") {
        true => cfg.steps,
        false => cfg.steps.min(1024),
    };
    let mut reports = Vec::with_capacity(reserve);
    for step in 0..cfg.steps {
        eager.allocator().reset_peak_stats();
        let before = snapshot(eager);
        let batch = match next.take() {
            Some(b) => b,
            None => load(step)?,
        };
        let mut prefetch = || -> Result<()> {
            if copy.is_some() && step + 1 < cfg.steps {
                next = Some(load(step + 1)?);
            }
            Ok(())
        };
        let (loss, grads) = if cfg.scoped {
            let s = eager.step("step", compute);
            pass(&model, &s.ctx(), &s.unscoped(), &batch, &mut prefetch)?
        } else {
            let cx = eager.ctx(compute);
            pass(&model, &cx, &cx, &batch, &mut prefetch)?
        };
        let grad_refs: Vec<&Tensor<'static, B>> = grads.iter().collect();
        opt.step(&mut model.params_mut(), &grad_refs)?;
        drop(grad_refs);
        drop(grads);
        drop(batch);
        let r = report(step, loss, &before, &snapshot(eager));
        on_step(&r);
        reports.push(r);
    }
    Ok(reports)
}
