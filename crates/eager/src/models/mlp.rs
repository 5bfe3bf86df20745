//! A ReLU MLP with a cross-entropy loss, forward and backward by hand.
//!
//! ```text
//!   x ─▶ [W1,b1] ─▶ z1 ─relu─▶ h1 ─▶ … ─▶ [Wn,bn] ─▶ logits ─▶ cross_entropy(·, y) ─▶ loss
//!   backward: dlogits = ce_backward; per layer (last first):
//!     dW = hᵀ·dz, db = Σ_rows dz  (unscoped: they outlive the step, for the optimizer)
//!     dh = dz·Wᵀ, dz = relu_backward(z, dh)  (scoped activations)
//! ```

use super::data::Rng;
use crate::{Backend, Ctx, Eager, Result, Tensor};
use tidepool::device::StreamId;

/// A fully connected layer: `y = x·W + b`, `W` is `[in, out]`.
pub struct Linear<B: Backend> {
    /// Weights, `[in, out]` (persistent).
    pub w: Tensor<'static, B>,
    /// Bias, `[out]` (persistent).
    pub b: Tensor<'static, B>,
}

/// A ReLU MLP; see the module docs.
pub struct Mlp<B: Backend> {
    /// The layers, input first.
    pub layers: Vec<Linear<B>>,
}

/// What one forward + backward pass gives: the loss (an activation of the step) and the
/// gradients (unscoped), in [`Mlp::params_mut`] order.
pub struct Pass<'s, B: Backend> {
    /// Mean cross-entropy, `[1]`.
    pub loss: Tensor<'s, B>,
    /// `dW1, db1, dW2, db2, …`
    pub grads: Vec<Tensor<'static, B>>,
}

impl<B: Backend> Mlp<B> {
    /// An MLP with layer widths `sizes` (input first, classes last), He-initialised from
    /// `seed`, its parameters persistent on `stream`.
    pub fn new(eager: &Eager<B>, sizes: &[usize], seed: u64, stream: StreamId) -> Result<Mlp<B>> {
        let mut rng = Rng::new(seed);
        let mut layers = Vec::new();
        for w in sizes.windows(2) {
            let (fan_in, fan_out) = (w[0], w[1]);
            let std = (2.0 / fan_in as f32).sqrt();
            let wt = Tensor::parameter(
                eager,
                &rng.normals(fan_in * fan_out, std),
                &[fan_in, fan_out],
                stream,
            )?;
            let b = Tensor::parameter(eager, &vec![0.0; fan_out], &[fan_out], stream)?;
            layers.push(Linear { w: wt, b });
        }
        Ok(Mlp { layers })
    }

    /// Every parameter, `W1, b1, W2, b2, …`.
    pub fn params_mut(&mut self) -> Vec<&mut Tensor<'static, B>> {
        self.layers.iter_mut().flat_map(|l| [&mut l.w, &mut l.b]).collect()
    }

    /// The logits for `x` (`[N, in]` → `[N, classes]`).
    pub fn forward<'s>(&self, cx: &Ctx<'s, B>, x: &Tensor<'_, B>) -> Result<Tensor<'s, B>> {
        let mut h: Option<Tensor<'s, B>> = None;
        for (i, l) in self.layers.iter().enumerate() {
            let input = h.as_ref().unwrap_or(x);
            let z = cx.add(&cx.matmul(input, &l.w)?, &l.b)?;
            h = Some(if i + 1 < self.layers.len() { cx.relu(&z)? } else { z });
        }
        Ok(h.expect("an MLP has at least one layer"))
    }

    /// Forward and backward on `(x, y)`: activations from `cx`, gradients from `gx` (same
    /// stream; unscoped so they outlive the step).
    pub fn forward_backward<'s>(
        &self,
        cx: &Ctx<'s, B>,
        gx: &Ctx<'static, B>,
        x: &Tensor<'_, B>,
        y: &Tensor<'_, B>,
    ) -> Result<Pass<'s, B>> {
        // Forward, keeping each layer's input and pre-activation.
        let mut inputs: Vec<Tensor<'s, B>> = Vec::new();
        let mut pre: Vec<Tensor<'s, B>> = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let input = inputs.last().unwrap_or(x);
            let z = cx.add(&cx.matmul(input, &l.w)?, &l.b)?;
            if i + 1 < self.layers.len() {
                let h = cx.relu(&z)?;
                pre.push(z);
                inputs.push(h);
            } else {
                pre.push(z);
            }
        }
        let logits = pre.last().expect("an MLP has at least one layer");
        let loss = cx.cross_entropy(logits, y)?;
        // Backward, last layer first.
        let mut dz = cx.cross_entropy_backward(logits, y)?;
        let mut grads: Vec<Tensor<'static, B>> = Vec::with_capacity(2 * self.layers.len());
        for i in (0..self.layers.len()).rev() {
            let l = &self.layers[i];
            let input = if i == 0 { x } else { &inputs[i - 1] };
            let db = gx.sum_to(&l.b, &dz)?;
            let dw = gx.matmul_backward_rhs(input, &l.w, &dz)?;
            grads.push(db);
            grads.push(dw);
            if i > 0 {
                let dh = cx.matmul_backward_lhs(&l.w, &dz)?;
                dz = cx.relu_backward(&pre[i - 1], &dh)?;
            }
        }
        grads.reverse();
        Ok(Pass { loss, grads })
    }
}
