//! Reductions: sum and mean over the last dimension (and their backward, a broadcast), and the
//! sum over leading dimensions that gives the gradient of a repeated operand (a bias).

use crate::backend::{Backend, KernelOp};
use crate::ctx::Ctx;
use crate::error::{Result, shape_err};
use crate::tensor::Tensor;

impl<'t, B: Backend> Ctx<'t, B> {
    fn reduce_last(&self, x: &Tensor<'_, B>, mean: bool) -> Result<Tensor<'t, B>> {
        let s = x.dims();
        if s.rank() == 0 {
            return shape_err("reduction over the last dimension of a scalar");
        }
        let (rows, cols) = (s.rows(), s.last());
        let scale = if mean { 1.0 / cols.max(1) as f32 } else { 1.0 };
        let out = self.output_of(s.drop_last(), &[x])?;
        let op = KernelOp::SumLast { x: self.input(x)?, out: out.ptr(), rows, cols, scale };
        self.launch(&op, rows)?;
        Ok(out)
    }

    fn reduce_last_backward(
        &self,
        x: &Tensor<'_, B>,
        dy: &Tensor<'_, B>,
        mean: bool,
    ) -> Result<Tensor<'t, B>> {
        let s = x.dims();
        if s.rank() == 0 || dy.dims() != s.drop_last() {
            return shape_err(format!("reduction backward: {:?} for {s}", dy.shape()));
        }
        let (rows, cols) = (s.rows(), s.last());
        let scale = if mean { 1.0 / cols.max(1) as f32 } else { 1.0 };
        let out = self.output_of(s, &[dy])?;
        let op = KernelOp::BroadcastLast { dy: self.input(dy)?, out: out.ptr(), rows, cols, scale };
        self.launch(&op, out.numel())?;
        Ok(out)
    }

    /// Sum over the last dimension (`[.., C]` → `[..]`).
    pub fn sum(&self, x: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.reduce_last(x, false)
    }

    /// Mean over the last dimension (`[.., C]` → `[..]`).
    pub fn mean(&self, x: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.reduce_last(x, true)
    }

    /// Gradient of [`Ctx::sum`] of `x`: `dy` repeated along the last dimension.
    pub fn sum_backward(&self, x: &Tensor<'_, B>, dy: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.reduce_last_backward(x, dy, false)
    }

    /// Gradient of [`Ctx::mean`] of `x`: `dy / C` repeated along the last dimension.
    pub fn mean_backward(&self, x: &Tensor<'_, B>, dy: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.reduce_last_backward(x, dy, true)
    }

    /// `dy` summed over the leading dimensions down to `like`'s shape (its trailing dimensions):
    /// the gradient of an operand that was repeated over rows.
    pub fn sum_to(&self, like: &Tensor<'_, B>, dy: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        let (ld, dd) = (like.shape(), dy.shape());
        if ld.len() > dd.len() || dd[dd.len() - ld.len()..] != *ld {
            return shape_err(format!("cannot sum {dd:?} down to {ld:?}"));
        }
        let cols = like.numel();
        let rows = dy.numel().checked_div(cols).unwrap_or(0);
        let out = self.output_of(like.dims(), &[dy])?;
        let op = KernelOp::SumRows { x: self.input(dy)?, out: out.ptr(), rows, cols };
        self.launch(&op, cols)?;
        Ok(out)
    }
}
