//! Optimizers updating persistent parameters in place, one kernel per parameter, on the
//! parameter's stream: [`Sgd`] and [`AdamW`] (whose moments are persistent tensors too, made on
//! the first step).
//!
//! ```text
//!   opt.step(&mut [&mut w1, &mut b1, …], &[&dw1, &db1, …])
//!     └─ per pair: KernelOp::Sgd / KernelOp::AdamW { param (Write), grad (Read), m, v (Write) }
//! ```
//!
//! A gradient made on another stream must be ready on the parameter's stream (see
//! [`crate::Ctx::wait_for`]).

use super::backend::{Backend, KernelOp};
use super::error::{Result, shape_err};
use super::tensor::Tensor;

/// Updates parameters from their gradients.
pub trait Optimizer<B: Backend> {
    /// One update of every parameter from the gradient at the same position.
    fn step(
        &mut self,
        params: &mut [&mut Tensor<'static, B>],
        grads: &[&Tensor<'_, B>],
    ) -> Result<()>;
}

fn check<B: Backend>(params: &[&mut Tensor<'static, B>], grads: &[&Tensor<'_, B>]) -> Result<()> {
    if params.len() != grads.len() {
        return shape_err(format!("{} parameters but {} gradients", params.len(), grads.len()));
    }
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        // A gradient of another device: its address means nothing to the parameter's.
        crate::ctx::same_device(p.eager(), g)?;
        if p.dims() != g.dims() {
            return shape_err(format!(
                "parameter {i} is {:?} but its gradient is {:?}",
                p.shape(),
                g.shape()
            ));
        }
    }
    Ok(())
}

/// Refuses parameter `i` when its moments (made on the first step, with the parameter then at
/// that position) live on another device or stream: the update kernel runs on the parameter's
/// stream and writes the moments there. Another device's moments are addresses that mean
/// nothing here (the kernel wrote this device's memory at them: another tensor's); moments of
/// another stream were written with no order against it, so their memory, freed in that
/// stream's order, was reused while the update still ran.
fn check_moments<B: Backend>(
    i: usize,
    p: &Tensor<'static, B>,
    m: &Tensor<'static, B>,
) -> Result<()> {
    // BROKEN (`adamw_foreign_moments`): any moments taken, wherever they live.
    if cfg!(tidepool_broken = "adamw_foreign_moments") {
        return Ok(());
    }
    crate::ctx::same_device(p.eager(), m)?;
    if m.stream() != p.stream() {
        return shape_err(format!(
            "AdamW: parameter {i} is on {}, its moments on {}",
            p.stream(),
            m.stream()
        ));
    }
    Ok(())
}

fn launch<B: Backend>(p: &Tensor<'static, B>, op: &KernelOp) -> Result<()> {
    if p.numel() == 0 {
        return Ok(());
    }
    let eager = p.eager();
    eager.counted(|c| &c.kernels, eager.backend().launch(p.stream(), op))
}

/// Stochastic gradient descent: `p −= lr · (g + weight_decay · p)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
}

impl Sgd {
    /// SGD with learning rate `lr` and no weight decay.
    pub fn new(lr: f32) -> Sgd {
        Sgd { lr, weight_decay: 0.0 }
    }
}

impl<B: Backend> Optimizer<B> for Sgd {
    fn step(
        &mut self,
        params: &mut [&mut Tensor<'static, B>],
        grads: &[&Tensor<'_, B>],
    ) -> Result<()> {
        check(params, grads)?;
        for (p, g) in params.iter_mut().zip(grads) {
            let op = KernelOp::Sgd {
                param: p.ptr(),
                grad: g.ptr(),
                n: p.numel(),
                lr: self.lr,
                weight_decay: self.weight_decay,
            };
            launch(p, &op)?;
        }
        Ok(())
    }
}

/// AdamW (Loshchilov & Hutter): Adam with decoupled weight decay. Its first and second moments
/// are persistent tensors, one pair per parameter position, made (zeroed) on the first step on
/// that parameter's device and stream; a later step refuses a parameter of another shape,
/// device or stream than its moments, before updating any.
pub struct AdamW<B: Backend> {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    t: u32,
    state: Vec<(Tensor<'static, B>, Tensor<'static, B>)>,
}

impl<B: Backend> AdamW<B> {
    /// AdamW with learning rate `lr` and PyTorch's defaults otherwise (β = (0.9, 0.999),
    /// eps = 1e-8, weight decay 0.01).
    pub fn new(lr: f32) -> AdamW<B> {
        AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            t: 0,
            state: Vec::new(),
        }
    }

    /// Updates done so far.
    pub fn steps(&self) -> u32 {
        self.t
    }

    /// The (first, second) moments of parameter `i`, once made.
    pub fn moments(&self, i: usize) -> Option<(&Tensor<'static, B>, &Tensor<'static, B>)> {
        self.state.get(i).map(|(m, v)| (m, v))
    }
}

impl<B: Backend> Optimizer<B> for AdamW<B> {
    fn step(
        &mut self,
        params: &mut [&mut Tensor<'static, B>],
        grads: &[&Tensor<'_, B>],
    ) -> Result<()> {
        check(params, grads)?;
        if self.state.is_empty() {
            // All or nothing: moments made before a failure (out of memory) are freed with
            // `state`, so the next step makes them all again.
            // BROKEN (`adamw_partial`): made in place, what was made before a failure stays.
            let partial = cfg!(tidepool_broken = "adamw_partial");
            let mut fresh = Vec::with_capacity(params.len());
            let state = if partial { &mut self.state } else { &mut fresh };
            for p in params.iter() {
                let m = Tensor::persistent_zeros(p.eager(), p.shape(), p.stream())?;
                let v = Tensor::persistent_zeros(p.eager(), p.shape(), p.stream())?;
                state.push((m, v));
            }
            if !partial {
                self.state = fresh;
            }
        }
        if self.state.len() != params.len() {
            return shape_err(format!(
                "AdamW was set up for {} parameters, got {}",
                self.state.len(),
                params.len()
            ));
        }
        // Every pair is checked before any update: a mismatch found half way left the
        // parameters before it updated (and the step counted) and those after it not.
        // BROKEN (`adamw_checks_late`): checked as each parameter is updated.
        let late = cfg!(tidepool_broken = "adamw_checks_late");
        if !late {
            for (i, (p, (m, _))) in params.iter().zip(&self.state).enumerate() {
                if m.dims() != p.dims() {
                    return shape_err(format!(
                        "AdamW: parameter {i} is {:?}, its moments {:?}",
                        p.shape(),
                        m.shape()
                    ));
                }
                check_moments(i, p, m)?;
            }
        }
        self.t += 1;
        let bc1 = 1.0 - self.beta1.powi(self.t as i32);
        let bc2 = 1.0 - self.beta2.powi(self.t as i32);
        for ((p, g), (m, v)) in params.iter_mut().zip(grads).zip(&self.state) {
            if late && m.dims() != p.dims() {
                return shape_err("AdamW: a parameter changed shape between steps");
            }
            let op = KernelOp::AdamW {
                param: p.ptr(),
                grad: g.ptr(),
                m: m.ptr(),
                v: v.ptr(),
                n: p.numel(),
                lr: self.lr,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: self.weight_decay,
                bc1,
                bc2,
            };
            launch(p, &op)?;
        }
        Ok(())
    }
}
