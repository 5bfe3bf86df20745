//! Embedding lookup and cross-entropy loss, with their backward ops. Ids and class labels are
//! f32 tensors holding whole numbers (exact below 2²⁴).

use crate::backend::{Backend, KernelOp};
use crate::ctx::Ctx;
use crate::error::{Result, shape_err};
use crate::shape::Shape;
use crate::tensor::Tensor;

impl<'t, B: Backend> Ctx<'t, B> {
    /// Rows of `table` (`[V, D]`) picked by `ids` (`[..]`): `[.., D]`.
    pub fn embedding(&self, table: &Tensor<'_, B>, ids: &Tensor<'_, B>) -> Result<Tensor<'t, B>> {
        let ts = table.dims();
        if ts.rank() != 2 {
            return shape_err(format!("embedding table must be [V, D], got {ts}"));
        }
        let (vocab, dim) = (ts.dims()[0], ts.dims()[1]);
        let mut dims = ids.shape().to_vec();
        dims.push(dim);
        let out = self.output_of(Shape::new(&dims)?, &[table, ids])?;
        let n_ids = ids.numel();
        let op = KernelOp::Embedding {
            table: self.input(table)?,
            ids: self.input(ids)?,
            out: out.ptr(),
            n_ids,
            vocab,
            dim,
        };
        self.launch(&op, out.numel())?;
        Ok(out)
    }

    /// Gradient of the table of [`Ctx::embedding`] (shaped as `table`): the rows of `dy`
    /// added up per id.
    pub fn embedding_backward(
        &self,
        table: &Tensor<'_, B>,
        ids: &Tensor<'_, B>,
        dy: &Tensor<'_, B>,
    ) -> Result<Tensor<'t, B>> {
        let ts = table.dims();
        // Checked: a table of no rows may be as wide as a shape allows, times many ids.
        // BROKEN (`embedding_overflow`): the product unchecked (a panic in debug builds).
        let expected = if cfg!(tidepool_broken = "embedding_overflow") {
            Some(ids.numel() * ts.last())
        } else {
            ids.numel().checked_mul(ts.last())
        };
        if ts.rank() != 2 || expected != Some(dy.numel()) {
            return shape_err(format!(
                "embedding backward: {:?} for ids {:?} and table {ts}",
                dy.shape(),
                ids.shape()
            ));
        }
        let (vocab, dim) = (ts.dims()[0], ts.dims()[1]);
        let out = self.output_of(ts, &[ids, dy])?;
        let op = KernelOp::EmbeddingBackward {
            ids: self.input(ids)?,
            dy: self.input(dy)?,
            out: out.ptr(),
            n_ids: ids.numel(),
            vocab,
            dim,
        };
        self.launch(&op, out.numel())?;
        Ok(out)
    }

    fn check_ce(logits: &Tensor<'_, B>, targets: &Tensor<'_, B>) -> Result<(usize, usize)> {
        let s = logits.dims();
        if s.rank() == 0 || targets.numel() != s.rows() {
            return shape_err(format!(
                "cross-entropy: {:?} targets for logits {s}",
                targets.shape()
            ));
        }
        Ok((s.rows(), s.last()))
    }

    /// Mean cross-entropy of `logits` (`[.., C]`) against class ids `targets` (`[..]`): `[1]`.
    pub fn cross_entropy(
        &self,
        logits: &Tensor<'_, B>,
        targets: &Tensor<'_, B>,
    ) -> Result<Tensor<'t, B>> {
        let (rows, cols) = Self::check_ce(logits, targets)?;
        let out = self.output_of(Shape::new(&[1])?, &[logits, targets])?;
        let op = KernelOp::CrossEntropy {
            logits: self.input(logits)?,
            targets: self.input(targets)?,
            out: out.ptr(),
            rows,
            cols,
        };
        // Always: the output is written even over no rows (NaN, the mean of nothing).
        // BROKEN (`zero_rows_skipped`): no kernel over no rows.
        self.launch(&op, if cfg!(tidepool_broken = "zero_rows_skipped") { rows } else { 1 })?;
        Ok(out)
    }

    /// Gradient of the mean loss of [`Ctx::cross_entropy`] with respect to the logits
    /// (`(softmax − one_hot) / rows`).
    pub fn cross_entropy_backward(
        &self,
        logits: &Tensor<'_, B>,
        targets: &Tensor<'_, B>,
    ) -> Result<Tensor<'t, B>> {
        let (rows, cols) = Self::check_ce(logits, targets)?;
        let out = self.output_of(logits.dims(), &[logits, targets])?;
        let op = KernelOp::CrossEntropyBackward {
            logits: self.input(logits)?,
            targets: self.input(targets)?,
            out: out.ptr(),
            rows,
            cols,
            scale: 1.0 / rows.max(1) as f32,
        };
        self.launch(&op, out.numel())?;
        Ok(out)
    }
}
