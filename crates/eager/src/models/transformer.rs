//! One pre-norm transformer block (single-head attention + GELU MLP, layer norms, residuals)
//! between a token embedding and an output projection, trained on next-token prediction;
//! forward and backward by hand.
//!
//! ```text
//!   ids ─emb─▶ x0 ─ln1─▶ h1 ─▶ q,k,v = h1·Wq, h1·Wk, h1·Wv          [N=B·T, D] → [B, T, D]
//!              │          p = softmax(q·kᵀ/√D + causal mask)         [B, T, T]
//!              │          o = (p·v)·Wo
//!              └──(+)──▶ x1 ─ln2─▶ h2 ─▶ gelu(h2·W1 + b1)·W2 + b2 ─(+ x1)─▶ x2 ─▶ x2·Wout
//!                                                                    ─▶ cross_entropy(·, targets)
//! ```
//!
//! Activations come from the step's context, parameter gradients from the unscoped one.

use super::data::Rng;
use crate::{Backend, Ctx, Eager, Result, Tensor};
use tidepool::device::StreamId;

/// Sizes of the block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Model width `D`.
    pub dim: usize,
    /// Hidden width of the MLP.
    pub hidden: usize,
    /// Sequences per batch `B`.
    pub batch: usize,
    /// Tokens per sequence `T`.
    pub seq: usize,
    /// Layer norm epsilon.
    pub eps: f32,
}

impl Default for BlockConfig {
    /// vocab 32, D 16, hidden 64, 2 sequences of 8 tokens.
    fn default() -> Self {
        BlockConfig { vocab: 32, dim: 16, hidden: 64, batch: 2, seq: 8, eps: 1e-5 }
    }
}

/// The parameters; see the module docs.
pub struct TransformerBlock<B: Backend> {
    /// Sizes.
    pub cfg: BlockConfig,
    /// Token embedding `[V, D]`.
    pub emb: Tensor<'static, B>,
    /// First layer norm scale `[D]`.
    pub ln1_g: Tensor<'static, B>,
    /// First layer norm shift `[D]`.
    pub ln1_b: Tensor<'static, B>,
    /// Query projection `[D, D]`.
    pub wq: Tensor<'static, B>,
    /// Key projection `[D, D]`.
    pub wk: Tensor<'static, B>,
    /// Value projection `[D, D]`.
    pub wv: Tensor<'static, B>,
    /// Output projection of attention `[D, D]`.
    pub wo: Tensor<'static, B>,
    /// Second layer norm scale `[D]`.
    pub ln2_g: Tensor<'static, B>,
    /// Second layer norm shift `[D]`.
    pub ln2_b: Tensor<'static, B>,
    /// MLP up projection `[D, H]`.
    pub w1: Tensor<'static, B>,
    /// MLP up bias `[H]`.
    pub b1: Tensor<'static, B>,
    /// MLP down projection `[H, D]`.
    pub w2: Tensor<'static, B>,
    /// MLP down bias `[D]`.
    pub b2: Tensor<'static, B>,
    /// Output projection to the vocabulary `[D, V]`.
    pub wout: Tensor<'static, B>,
    /// Causal mask `[T, T]` added to the attention scores: 0 on and below the diagonal, a large
    /// negative number above it, so position `t` attends to positions `≤ t` only (not a
    /// parameter).
    pub mask: Tensor<'static, B>,
}

/// The loss of a pass (an activation of the step) and the gradients (unscoped), in
/// [`TransformerBlock::params_mut`] order.
pub struct BlockPass<'s, B: Backend> {
    /// Mean cross-entropy, `[1]`.
    pub loss: Tensor<'s, B>,
    /// One gradient per parameter.
    pub grads: Vec<Tensor<'static, B>>,
}

impl<B: Backend> TransformerBlock<B> {
    /// A block with random weights from `seed` (std 0.02·√(64/D)-ish scaled inits, layer norms
    /// at identity), its parameters persistent on `stream`.
    pub fn new(
        eager: &Eager<B>,
        cfg: BlockConfig,
        seed: u64,
        stream: StreamId,
    ) -> Result<TransformerBlock<B>> {
        let mut rng = Rng::new(seed);
        let (v, d, h) = (cfg.vocab, cfg.dim, cfg.hidden);
        let mut p = |rows: usize, cols: usize, std: f32| {
            let data = rng.normals(rows * cols, std);
            let dims: &[usize] = if rows == 1 { &[cols] } else { &[rows, cols] };
            Tensor::parameter(eager, &data, dims, stream)
        };
        let sd = 1.0 / (d as f32).sqrt();
        let sh = 1.0 / (h as f32).sqrt();
        let emb = p(v, d, 1.0)?;
        let (wq, wk, wv, wo) = (p(d, d, sd)?, p(d, d, sd)?, p(d, d, sd)?, p(d, d, sd)?);
        let (w1, w2, wout) = (p(d, h, sd)?, p(h, d, sh)?, p(d, v, sd)?);
        let ones = vec![1.0; d];
        let zeros = vec![0.0; d];
        let par = |data: &[f32], n: usize| Tensor::parameter(eager, data, &[n], stream);
        let t = cfg.seq;
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
        Ok(TransformerBlock {
            cfg,
            emb,
            ln1_g: par(&ones, d)?,
            ln1_b: par(&zeros, d)?,
            wq,
            wk,
            wv,
            wo,
            ln2_g: par(&ones, d)?,
            ln2_b: par(&zeros, d)?,
            w1,
            b1: par(&vec![0.0; h], h)?,
            w2,
            b2: par(&zeros, d)?,
            wout,
            mask: Tensor::parameter(eager, &mask, &[t, t], stream)?,
        })
    }

    /// Every parameter, in a fixed order (the order of [`BlockPass::grads`]).
    pub fn params_mut(&mut self) -> Vec<&mut Tensor<'static, B>> {
        vec![
            &mut self.emb,
            &mut self.ln1_g,
            &mut self.ln1_b,
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.ln2_g,
            &mut self.ln2_b,
            &mut self.w1,
            &mut self.b1,
            &mut self.w2,
            &mut self.b2,
            &mut self.wout,
        ]
    }

    /// The loss of the block on `ids` predicting `targets` (both `[B·T]`, as f32).
    pub fn loss<'s>(
        &self,
        cx: &Ctx<'s, B>,
        ids: &Tensor<'_, B>,
        targets: &Tensor<'_, B>,
    ) -> Result<Tensor<'s, B>> {
        Ok(self.forward_backward_inner(cx, None, ids, targets)?.loss)
    }

    /// Forward and backward: activations from `cx`, parameter gradients from `gx`.
    pub fn forward_backward<'s>(
        &self,
        cx: &Ctx<'s, B>,
        gx: &Ctx<'static, B>,
        ids: &Tensor<'_, B>,
        targets: &Tensor<'_, B>,
    ) -> Result<BlockPass<'s, B>> {
        self.forward_backward_inner(cx, Some(gx), ids, targets)
    }

    fn forward_backward_inner<'s>(
        &self,
        cx: &Ctx<'s, B>,
        gx: Option<&Ctx<'static, B>>,
        ids: &Tensor<'_, B>,
        targets: &Tensor<'_, B>,
    ) -> Result<BlockPass<'s, B>> {
        let BlockConfig { dim: d, batch: bt, seq: t, eps, .. } = self.cfg;
        let n = bt * t;
        let att_scale = 1.0 / (d as f32).sqrt();
        // Forward.
        let x0 = cx.embedding(&self.emb, ids)?;
        let h1 = cx.layer_norm(&x0, &self.ln1_g, &self.ln1_b, eps)?;
        let q = cx.matmul(&h1, &self.wq)?.reshape(&[bt, t, d])?;
        let k = cx.matmul(&h1, &self.wk)?.reshape(&[bt, t, d])?;
        let v = cx.matmul(&h1, &self.wv)?.reshape(&[bt, t, d])?;
        let kt = cx.transpose(&k)?;
        drop(k);
        // Causal: the target of position t is the token at t + 1, which must not be seen.
        let s = cx.scale(&cx.matmul(&q, &kt)?, att_scale)?;
        // BROKEN (`acausal`): every position sees every other.
        let s = match cfg!(tidepool_broken = "acausal") {
            false => cx.add(&s, &self.mask)?,
            true => s,
        };
        let p = cx.softmax(&s)?;
        drop(s);
        let a = cx.matmul(&p, &v)?.reshape(&[n, d])?;
        let x1 = cx.add(&x0, &cx.matmul(&a, &self.wo)?)?;
        let h2 = cx.layer_norm(&x1, &self.ln2_g, &self.ln2_b, eps)?;
        let f1 = cx.add(&cx.matmul(&h2, &self.w1)?, &self.b1)?;
        let g = cx.gelu(&f1)?;
        let x2 = cx.add(&x1, &cx.add(&cx.matmul(&g, &self.w2)?, &self.b2)?)?;
        let logits = cx.matmul(&x2, &self.wout)?;
        let loss = cx.cross_entropy(&logits, targets)?;
        let Some(gx) = gx else { return Ok(BlockPass { loss, grads: Vec::new() }) };

        // Backward, in reverse.
        let dlogits = cx.cross_entropy_backward(&logits, targets)?;
        let d_wout = gx.matmul_backward_rhs(&x2, &self.wout, &dlogits)?;
        let dx2 = cx.matmul_backward_lhs(&self.wout, &dlogits)?;
        drop((dlogits, logits, x2));
        // x2 = x1 + g·W2 + b2
        let d_b2 = gx.sum_to(&self.b2, &dx2)?;
        let d_w2 = gx.matmul_backward_rhs(&g, &self.w2, &dx2)?;
        let dg = cx.matmul_backward_lhs(&self.w2, &dx2)?;
        let df1 = cx.gelu_backward(&f1, &dg)?;
        drop((dg, g, f1));
        let d_b1 = gx.sum_to(&self.b1, &df1)?;
        let d_w1 = gx.matmul_backward_rhs(&h2, &self.w1, &df1)?;
        let dh2 = cx.matmul_backward_lhs(&self.w1, &df1)?;
        drop((df1, h2));
        let (dx1_ln, d_ln2_g, d_ln2_b) = cx.layer_norm_backward(gx, &x1, &self.ln2_g, &dh2, eps)?;
        let dx1 = cx.add(&dx2, &dx1_ln)?;
        drop((dx1_ln, dh2, dx2, x1));
        // x1 = x0 + a·Wo
        let d_wo = gx.matmul_backward_rhs(&a, &self.wo, &dx1)?;
        let da = cx.matmul_backward_lhs(&self.wo, &dx1)?.reshape(&[bt, t, d])?;
        drop(a);
        // a = p·v
        let dp = cx.matmul_backward_lhs(&v, &da)?;
        let dv = cx.matmul_backward_rhs(&p, &v, &da)?.reshape(&[n, d])?;
        drop((da, v));
        let ds = cx.scale(&cx.softmax_backward(&p, &dp)?, att_scale)?;
        drop((dp, p));
        // s = q·kᵀ
        let dq = cx.matmul_backward_lhs(&kt, &ds)?.reshape(&[n, d])?;
        let dk = cx.transpose(&cx.matmul_backward_rhs(&q, &kt, &ds)?)?.reshape(&[n, d])?;
        drop((ds, q, kt));
        let d_wq = gx.matmul_backward_rhs(&h1, &self.wq, &dq)?;
        let d_wk = gx.matmul_backward_rhs(&h1, &self.wk, &dk)?;
        let d_wv = gx.matmul_backward_rhs(&h1, &self.wv, &dv)?;
        let dh1 = cx.add(
            &cx.add(
                &cx.matmul_backward_lhs(&self.wq, &dq)?,
                &cx.matmul_backward_lhs(&self.wk, &dk)?,
            )?,
            &cx.matmul_backward_lhs(&self.wv, &dv)?,
        )?;
        drop((dq, dk, dv, h1));
        let (dx0_ln, d_ln1_g, d_ln1_b) = cx.layer_norm_backward(gx, &x0, &self.ln1_g, &dh1, eps)?;
        let dx0 = cx.add(&dx1, &dx0_ln)?;
        let d_emb = gx.embedding_backward(&self.emb, ids, &dx0)?;
        let grads = vec![
            d_emb, d_ln1_g, d_ln1_b, d_wq, d_wk, d_wv, d_wo, d_ln2_g, d_ln2_b, d_w1, d_b1, d_w2,
            d_b2, d_wout,
        ];
        Ok(BlockPass { loss, grads })
    }
}

/// A batch of random token sequences and their next-token targets for a toy language: each
/// sequence counts up by a random stride modulo the vocabulary, so the next token is
/// predictable from the previous two.
pub fn token_batch(cfg: &BlockConfig, rng: &mut Rng) -> (Vec<f32>, Vec<f32>) {
    let mut ids = Vec::with_capacity(cfg.batch * cfg.seq);
    let mut targets = Vec::with_capacity(cfg.batch * cfg.seq);
    for _ in 0..cfg.batch {
        let start = rng.below(cfg.vocab);
        let stride = 1 + rng.below(3);
        for i in 0..cfg.seq {
            ids.push(((start + i * stride) % cfg.vocab) as f32);
            targets.push(((start + (i + 1) * stride) % cfg.vocab) as f32);
        }
    }
    (ids, targets)
}
