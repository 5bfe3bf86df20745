//! Matrix products and transposes over the last two dimensions.
//!
//! ```text
//!   a [.., m, k] · b [k, n]        → [.., m, n]   (b repeated over a's batch: stride 0)
//!   a [m, k]     · b [.., k, n]    → [.., m, n]
//!   a [P.., m, k] · b [P.., k, n]  → [P.., m, n]  (batched; same batch dimensions)
//!   with trans_a / trans_b the operand is stored transposed ([.., k, m] / [.., n, k]).
//! ```

use crate::backend::{Backend, KernelOp};
use crate::ctx::Ctx;
use crate::error::{Result, shape_err};
use crate::shape::Shape;
use crate::tensor::Tensor;

/// (batch dimensions, rows, cols) of a rank ≥ 2 tensor.
fn split(t: &Shape) -> (&[usize], usize, usize) {
    let d = t.dims();
    let r = d.len();
    (&d[..r - 2], d[r - 2], d[r - 1])
}

impl<'t, B: Backend> Ctx<'t, B> {
    /// `a · b` over the last two dimensions; see the module docs for batching.
    pub fn matmul(&self, a: &Tensor<'_, B>, b: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        self.matmul_t(a, b, false, false)
    }

    /// `op(a) · op(b)`, where `op` transposes the last two dimensions of an operand whose flag
    /// is set.
    pub fn matmul_t(
        &self,
        a: &Tensor<'_, B>,
        b: &Tensor<'_, B>,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<Tensor<'t, B>> {
        let (sa, sb) = (a.dims(), b.dims());
        if sa.rank() < 2 || sb.rank() < 2 {
            return shape_err(format!("matmul needs rank ≥ 2 operands, got {sa} and {sb}"));
        }
        let (ba, ra, ca) = split(&sa);
        let (bb, rb, cb) = split(&sb);
        let (m, k) = if trans_a { (ca, ra) } else { (ra, ca) };
        let (k2, n) = if trans_b { (cb, rb) } else { (rb, cb) };
        if k != k2 {
            return shape_err(format!(
                "matmul: inner dimensions differ ({sa}{} · {sb}{})",
                if trans_a { "ᵀ" } else { "" },
                if trans_b { "ᵀ" } else { "" }
            ));
        }
        let (batch_dims, stride_a, stride_b) = match (ba.is_empty(), bb.is_empty()) {
            (_, true) => (ba, m * k, 0),
            (true, false) => (bb, 0, k * n),
            (false, false) if ba == bb => (ba, m * k, k * n),
            _ => return shape_err(format!("matmul: batch dimensions of {sa} and {sb} differ")),
        };
        let batch: usize = batch_dims.iter().product();
        let mut dims = batch_dims.to_vec();
        dims.extend([m, n]);
        let out = self.output_of(Shape::new(&dims)?, &[a, b])?;
        let op = KernelOp::Matmul {
            a: self.input(a)?,
            b: self.input(b)?,
            out: out.ptr(),
            batch,
            m,
            k,
            n,
            trans_a,
            trans_b,
            stride_a,
            stride_b,
        };
        self.launch(&op, out.numel())?;
        Ok(out)
    }

    /// Gradient of the left operand of `matmul(a, b)` (no transposes): `dy · bᵀ`, shaped as `a`
    /// when `a` was not repeated over `b`'s batch; where it was (`a` 2-D, `b` batched), this is
    /// the per-batch gradient `[.., m, k]`: use [`Ctx::matmul_backward_lhs_of`].
    pub fn matmul_backward_lhs(
        &self,
        b: &Tensor<'_, B>,
        dy: &Tensor<'_, B>,
    ) -> Result<Tensor<'t, B>> {
        self.matmul_t(dy, b, false, true)
    }

    /// Gradient of the left operand `a` of `matmul(a, b)` (no transposes), shaped as `a`: when
    /// `a` was repeated over `b`'s batch, the per-batch gradients are summed.
    pub fn matmul_backward_lhs_of(
        &self,
        a: &Tensor<'_, B>,
        b: &Tensor<'_, B>,
        dy: &Tensor<'_, B>,
    ) -> Result<Tensor<'t, B>> {
        let per_batch = self.matmul_t(dy, b, false, true)?;
        if per_batch.dims() == a.dims() {
            return Ok(per_batch);
        }
        self.sum_to(a, &per_batch)
    }

    /// Gradient of the right operand `b` of `matmul(a, b)` (no transposes): `aᵀ · dy`, shaped as
    /// `b`. When `b` was repeated over `a`'s batch, the batches are summed (one product over all
    /// rows of `a`).
    pub fn matmul_backward_rhs(
        &self,
        a: &Tensor<'_, B>,
        b: &Tensor<'_, B>,
        dy: &Tensor<'_, B>,
    ) -> Result<Tensor<'t, B>> {
        if b.dims().rank() == 2 && a.dims().rank() > 2 {
            // a [.., m, k] seen as [rows, k]; dy as [rows, n]: one product sums the batches.
            let (k, n) = (a.dims().last(), dy.dims().last());
            let rows = a.dims().rows();
            if dy.dims().rows() != rows || b.shape() != [k, n] {
                return shape_err(format!(
                    "matmul backward: {:?} · {:?} cannot give {:?}",
                    a.shape(),
                    dy.shape(),
                    b.shape()
                ));
            }
            let out = self.output_of(b.dims(), &[a, dy])?;
            let op = KernelOp::Matmul {
                a: self.input(a)?,
                b: self.input(dy)?,
                out: out.ptr(),
                batch: 1,
                m: k,
                k: rows,
                n,
                trans_a: true,
                trans_b: false,
                stride_a: 0,
                stride_b: 0,
            };
            self.launch(&op, out.numel())?;
            return Ok(out);
        }
        self.matmul_t(a, dy, true, false)
    }

    /// Swaps the last two dimensions (a copy). Its backward is the transpose of the gradient.
    pub fn transpose(&self, x: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        let s = x.dims();
        let out = self.output_of(s.transposed()?, &[x])?;
        let (_, rows, cols) = split(&s);
        let batch = s.numel() / (rows * cols).max(1);
        let op = KernelOp::Transpose { x: self.input(x)?, out: out.ptr(), batch, rows, cols };
        self.launch(&op, out.numel())?;
        Ok(out)
    }
}
