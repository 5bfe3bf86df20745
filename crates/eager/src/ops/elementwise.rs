//! Elementwise ops: add and mul (the right operand may repeat over leading dimensions, like a
//! bias), scale, relu, gelu, and their backward ops.

use crate::backend::{Backend, BinaryOp, KernelOp, UnaryOp};
use crate::ctx::Ctx;
use crate::error::{Result, shape_err};
use crate::tensor::{Tensor, same_shape};

impl<'t, B: Backend> Ctx<'t, B> {
    fn binary(&self, op: BinaryOp, a: &Tensor<'_, B>, b: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        let (ad, bd) = (a.shape(), b.shape());
        if bd.len() > ad.len() || ad[ad.len() - bd.len()..] != *bd {
            return shape_err(format!(
                "{op:?}: {bd:?} is neither {ad:?} nor its trailing dimensions"
            ));
        }
        let n = a.numel();
        let b_len = b.numel();
        if b_len == 0 && n > 0 {
            return shape_err(format!("{op:?}: empty right operand"));
        }
        let out = self.output_of(a.dims(), &[a, b])?;
        self.launch(
            &KernelOp::Binary {
                op,
                a: self.input(a)?,
                b: self.input(b)?,
                out: out.ptr(),
                n,
                b_len,
            },
            n,
        )?;
        Ok(out)
    }

    /// `a + b`; `b` has `a`'s shape or its trailing dimensions (a bias of `[C]` for `[N, C]`).
    pub fn add(&self, a: &Tensor<'_, B>, b: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.binary(BinaryOp::Add, a, b)
    }

    /// `a ⊙ b`, broadcast as [`Ctx::add`].
    pub fn mul(&self, a: &Tensor<'_, B>, b: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.binary(BinaryOp::Mul, a, b)
    }

    /// `alpha · x`.
    pub fn scale(&self, x: &Tensor<'_, B>, alpha: f32) -> Result<Tensor<'t, B>> {
        let out = self.output_of(x.dims(), &[x])?;
        let n = x.numel();
        self.launch(&KernelOp::Scale { x: self.input(x)?, out: out.ptr(), n, alpha }, n)?;
        Ok(out)
    }

    fn unary(&self, op: UnaryOp, x: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        let out = self.output_of(x.dims(), &[x])?;
        let n = x.numel();
        self.launch(&KernelOp::Unary { op, x: self.input(x)?, out: out.ptr(), n }, n)?;
        Ok(out)
    }

    fn unary_backward(
        &self,
        op: UnaryOp,
        x: &Tensor<'_, B>,
        dy: &Tensor<'_, B>,
    ) -> Result<Tensor<'t, B>> {
        same_shape("unary backward", x, dy)?;
        let out = self.output_of(x.dims(), &[x, dy])?;
        let n = x.numel();
        let k = KernelOp::UnaryBackward {
            op,
            x: self.input(x)?,
            dy: self.input(dy)?,
            out: out.ptr(),
            n,
        };
        self.launch(&k, n)?;
        Ok(out)
    }

    /// `max(x, 0)`.
    pub fn relu(&self, x: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.unary(UnaryOp::Relu, x)
    }

    /// GELU, tanh approximation (as GPT-2).
    pub fn gelu(&self, x: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.unary(UnaryOp::Gelu, x)
    }

    /// Gradient of [`Ctx::relu`] at `x` given the output gradient `dy` (0 where `x ≤ 0`).
    pub fn relu_backward(&self, x: &Tensor<'_, B>, dy: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.unary_backward(UnaryOp::Relu, x, dy)
    }

    /// Gradient of [`Ctx::gelu`] at `x` given the output gradient `dy`.
    pub fn gelu_backward(&self, x: &Tensor<'_, B>, dy: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.unary_backward(UnaryOp::Gelu, x, dy)
    }

    /// Gradient of [`Ctx::scale`]: `alpha · dy`.
    pub fn scale_backward(&self, dy: &Tensor<'_, B>, alpha: f32) -> Result<Tensor<'t, B>> {
        self.scale(dy, alpha)
    }

    /// Gradient of the right operand of [`Ctx::add`] with shape `b`: `dy` summed over the
    /// leading dimensions it was repeated over (the left operand's gradient is `dy` itself).
    pub fn add_backward_rhs(&self, b: &Tensor<'_, B>, dy: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.sum_to(b, dy)
    }

    /// Gradients of [`Ctx::mul`]: `(dy ⊙ b, Σ_leading dy ⊙ a)`.
    pub fn mul_backward(
        &self,
        a: &Tensor<'_, B>,
        b: &Tensor<'_, B>,
        dy: &Tensor<'_, B>,
    ) -> Result<(Tensor<'t, B>, Tensor<'t, B>)> {
        same_shape("mul backward", a, dy)?;
        let da = self.mul(dy, b)?;
        let prod = self.mul(dy, a)?;
        let db = if b.dims() == a.dims() { prod } else { self.sum_to(b, &prod)? };
        Ok((da, db))
    }
}
