//! Normalisations over the last dimension: softmax and layer norm, with their backward ops.

use crate::backend::{Backend, KernelOp};
use crate::ctx::Ctx;
use crate::error::{Result, shape_err};
use crate::tensor::{Tensor, same_shape};

impl<'t, B: Backend> Ctx<'t, B> {
    /// Softmax over the last dimension.
    pub fn softmax(&self, x: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        let s = x.dims();
        let out = self.output_of(s, &[x])?;
        let op =
            KernelOp::Softmax { x: self.input(x)?, out: out.ptr(), rows: s.rows(), cols: s.last() };
        self.launch(&op, out.numel())?;
        Ok(out)
    }

    /// Gradient of [`Ctx::softmax`] from its output `y` and the output gradient `dy`.
    pub fn softmax_backward(&self, y: &Tensor<'_, B>, dy: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        same_shape("softmax backward", y, dy)?;
        let s = y.dims();
        let out = self.output_of(s, &[y, dy])?;
        let op = KernelOp::SoftmaxBackward {
            y: self.input(y)?,
            dy: self.input(dy)?,
            out: out.ptr(),
            rows: s.rows(),
            cols: s.last(),
        };
        self.launch(&op, out.numel())?;
        Ok(out)
    }

    /// Layer norm over the last dimension `C`, with `gamma` and `beta` of shape `[C]`.
    pub fn layer_norm(
        &self,
        x: &Tensor<'_, B>,
        gamma: &Tensor<'_, B>,
        beta: &Tensor<'_, B>,
        eps: f32,
    ) -> Result<Tensor<'t, B>> {
        let s = x.dims();
        let c = s.last();
        if gamma.shape() != [c] || beta.shape() != [c] {
            return shape_err(format!(
                "layer norm of {s} needs gamma and beta of [{c}], got {:?} and {:?}",
                gamma.shape(),
                beta.shape()
            ));
        }
        let out = self.output_of(s, &[x, gamma, beta])?;
        let op = KernelOp::LayerNorm {
            x: self.input(x)?,
            gamma: self.input(gamma)?,
            beta: self.input(beta)?,
            out: out.ptr(),
            rows: s.rows(),
            cols: c,
            eps,
        };
        self.launch(&op, out.numel())?;
        Ok(out)
    }

    /// Gradients of [`Ctx::layer_norm`]: `dx` from this context, `dgamma` and `dbeta` (parameter
    /// gradients) from `grads` (which must run on the same stream). One kernel writes all three.
    pub fn layer_norm_backward<'g>(
        &self,
        grads: &Ctx<'g, B>,
        x: &Tensor<'_, B>,
        gamma: &Tensor<'_, B>,
        dy: &Tensor<'_, B>,
        eps: f32,
    ) -> Result<(Tensor<'t, B>, Tensor<'g, B>, Tensor<'g, B>)> {
        same_shape("layer norm backward", x, dy)?;
        if grads.stream() != self.stream() {
            return shape_err("layer norm backward: the gradient context is on another stream");
        }
        // `dgamma` and `dbeta` are `grads`' outputs, written by this device's kernel: a context
        // of another device (another engine's) gives addresses that mean nothing here.
        // BROKEN (`foreign_grads`): its outputs written as this device's memory.
        if !cfg!(tidepool_broken = "foreign_grads") {
            crate::ctx::same_device_ctx(&self.eager, &grads.eager)?;
        }
        let s = x.dims();
        let c = s.last();
        if gamma.shape() != [c] {
            return shape_err(format!("layer norm of {s} needs gamma of [{c}]"));
        }
        let dx = self.output_of(s, &[x, gamma, dy])?;
        let dgamma = grads.output(gamma.dims())?;
        let dbeta = grads.output(gamma.dims())?;
        let op = KernelOp::LayerNormBackward {
            x: self.input(x)?,
            gamma: self.input(gamma)?,
            dy: self.input(dy)?,
            dx: dx.ptr(),
            dgamma: dgamma.ptr(),
            dbeta: dbeta.ptr(),
            rows: s.rows(),
            cols: c,
            eps,
        };
        // dgamma and dbeta are written (zeros) even when there are no rows.
        let work =
            if cfg!(tidepool_broken = "zero_rows_skipped") { s.numel() } else { s.numel() + c };
        self.launch(&op, work)?;
        Ok((dx, dgamma, dbeta))
    }
}
