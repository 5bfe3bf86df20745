//! The op interface every back end implements: [`Backend`] (upload, download, launch) and
//! [`KernelOp`], one variant per kernel, naming the device memory it reads and writes.
//!
//! ```text
//!   Ctx::matmul(a, b) ── allocates the output ──▶ KernelOp::Matmul { a, b, out, … }
//!                                                    │ Backend::launch(stream, &op)
//!                         ┌──────────────────────────┴───────────────────────────┐
//!                HostBackend (any Device with host kernels;          CudaBackend (feature `cuda`):
//!                SimDevice: a Kernel with op.accesses(), run         NVRTC kernels + cuBLAS sgemm
//!                by the stream's worker, checked by the sanitizer)   on CudaDevice::stream(id)
//! ```
//!
//! Every pointer is an array of `f32` in device memory; sizes are element counts. Class ids and
//! token ids are stored as `f32` (exact below 2²⁴). A launch returns at once; the kernel runs in
//! the stream's order.

use super::error::Result;
use std::sync::Arc;
use tidepool::device::{Access, AccessKind, Device, DeviceAddr, StreamId};

/// Bytes of one element.
pub const ELEM: u64 = 4;

/// An elementwise binary operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a · b`
    Mul,
}

/// An elementwise unary operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    /// `max(x, 0)`
    Relu,
    /// GELU, tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    Gelu,
}

/// One kernel: what to compute and on which memory. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelOp {
    /// `out[i] = value` for `i < n`.
    Fill {
        /// Output.
        out: DeviceAddr,
        /// Elements.
        n: usize,
        /// The value.
        value: f32,
    },
    /// `out[i] = a[i] op b[i % b_len]` for `i < n` (`b` repeats over leading dimensions).
    Binary {
        /// Which operation.
        op: BinaryOp,
        /// Left operand, `n` elements.
        a: DeviceAddr,
        /// Right operand, `b_len` elements (`b_len` divides `n`).
        b: DeviceAddr,
        /// Output, `n` elements.
        out: DeviceAddr,
        /// Elements of `a` and `out`.
        n: usize,
        /// Elements of `b`.
        b_len: usize,
    },
    /// `out[i] = alpha · x[i]`.
    Scale {
        /// Input.
        x: DeviceAddr,
        /// Output.
        out: DeviceAddr,
        /// Elements.
        n: usize,
        /// Factor.
        alpha: f32,
    },
    /// `out[i] = f(x[i])`.
    Unary {
        /// Which function.
        op: UnaryOp,
        /// Input.
        x: DeviceAddr,
        /// Output.
        out: DeviceAddr,
        /// Elements.
        n: usize,
    },
    /// `out[i] = f'(x[i]) · dy[i]`.
    UnaryBackward {
        /// Which function.
        op: UnaryOp,
        /// The forward input.
        x: DeviceAddr,
        /// Gradient of the output.
        dy: DeviceAddr,
        /// Gradient of the input.
        out: DeviceAddr,
        /// Elements.
        n: usize,
    },
    /// For each of `batch` problems: `out = op(a) · op(b)`, `op(a)` is `m×k`, `op(b)` is `k×n`,
    /// all row-major; `op` transposes when the flag is set (`a` is then stored `k×m`). Batch `i`
    /// reads `a + i·stride_a`, `b + i·stride_b` (a stride of 0 repeats the operand) and writes
    /// `out + i·m·n`.
    Matmul {
        /// Left operand.
        a: DeviceAddr,
        /// Right operand.
        b: DeviceAddr,
        /// Output.
        out: DeviceAddr,
        /// Number of problems.
        batch: usize,
        /// Rows of the output.
        m: usize,
        /// Inner dimension.
        k: usize,
        /// Columns of the output.
        n: usize,
        /// `a` is stored transposed (`k×m`).
        trans_a: bool,
        /// `b` is stored transposed (`n×k`).
        trans_b: bool,
        /// Elements between batches of `a` (0: the same matrix for every batch).
        stride_a: usize,
        /// Elements between batches of `b` (0: the same matrix for every batch).
        stride_b: usize,
    },
    /// `out[b, c, r] = x[b, r, c]` for `batch` matrices of `rows×cols`.
    Transpose {
        /// Input.
        x: DeviceAddr,
        /// Output.
        out: DeviceAddr,
        /// Number of matrices.
        batch: usize,
        /// Rows of the input.
        rows: usize,
        /// Columns of the input.
        cols: usize,
    },
    /// Softmax of each row of `rows×cols`.
    Softmax {
        /// Input.
        x: DeviceAddr,
        /// Output.
        out: DeviceAddr,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// `out = y ⊙ (dy − Σ_c dy·y)` per row, where `y` is the softmax output.
    SoftmaxBackward {
        /// Softmax output.
        y: DeviceAddr,
        /// Gradient of the output.
        dy: DeviceAddr,
        /// Gradient of the input.
        out: DeviceAddr,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// Layer norm of each row: `(x − mean)/√(var + eps) · gamma + beta` (biased variance).
    LayerNorm {
        /// Input, `rows×cols`.
        x: DeviceAddr,
        /// Scale, `cols`.
        gamma: DeviceAddr,
        /// Shift, `cols`.
        beta: DeviceAddr,
        /// Output, `rows×cols`.
        out: DeviceAddr,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Added to the variance.
        eps: f32,
    },
    /// Gradients of [`KernelOp::LayerNorm`]: `dx` (`rows×cols`), `dgamma` and `dbeta` (`cols`);
    /// the row statistics are recomputed from `x`.
    LayerNormBackward {
        /// Forward input.
        x: DeviceAddr,
        /// Forward scale.
        gamma: DeviceAddr,
        /// Gradient of the output.
        dy: DeviceAddr,
        /// Gradient of `x`.
        dx: DeviceAddr,
        /// Gradient of `gamma`.
        dgamma: DeviceAddr,
        /// Gradient of `beta`.
        dbeta: DeviceAddr,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// As in the forward.
        eps: f32,
    },
    /// `out[r] = scale · Σ_c x[r, c]` (sum: `scale` 1, mean: `1/cols`).
    SumLast {
        /// Input.
        x: DeviceAddr,
        /// Output, `rows`.
        out: DeviceAddr,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Factor.
        scale: f32,
    },
    /// `out[r, c] = scale · dy[r]`: the backward of [`KernelOp::SumLast`].
    BroadcastLast {
        /// Gradient of the reduced output, `rows`.
        dy: DeviceAddr,
        /// Output, `rows×cols`.
        out: DeviceAddr,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Factor.
        scale: f32,
    },
    /// `out[c] = Σ_r x[r, c]`: the gradient of an operand broadcast over rows (a bias).
    SumRows {
        /// Input.
        x: DeviceAddr,
        /// Output, `cols`.
        out: DeviceAddr,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// `out[i, :] = table[ids[i], :]`.
    Embedding {
        /// Table, `vocab×dim`.
        table: DeviceAddr,
        /// Ids, `n_ids` (as f32).
        ids: DeviceAddr,
        /// Output, `n_ids×dim`.
        out: DeviceAddr,
        /// Number of ids.
        n_ids: usize,
        /// Rows of the table.
        vocab: usize,
        /// Columns of the table.
        dim: usize,
    },
    /// `out[v, :] = Σ_{i: ids[i] = v} dy[i, :]`: the gradient of the table.
    EmbeddingBackward {
        /// Ids, `n_ids`.
        ids: DeviceAddr,
        /// Gradient of the output, `n_ids×dim`.
        dy: DeviceAddr,
        /// Gradient of the table, `vocab×dim`.
        out: DeviceAddr,
        /// Number of ids.
        n_ids: usize,
        /// Rows of the table.
        vocab: usize,
        /// Columns of the table.
        dim: usize,
    },
    /// `out[0] = mean_r (logsumexp(logits[r, :]) − logits[r, targets[r]])`.
    CrossEntropy {
        /// Logits, `rows×cols`.
        logits: DeviceAddr,
        /// Class ids, `rows` (as f32).
        targets: DeviceAddr,
        /// Output, one element.
        out: DeviceAddr,
        /// Rows.
        rows: usize,
        /// Classes.
        cols: usize,
    },
    /// `out[r, c] = scale · (softmax(logits[r, :])[c] − [c = targets[r]])`; `scale = 1/rows`
    /// gives the gradient of the mean loss.
    CrossEntropyBackward {
        /// Logits.
        logits: DeviceAddr,
        /// Class ids.
        targets: DeviceAddr,
        /// Gradient of the logits.
        out: DeviceAddr,
        /// Rows.
        rows: usize,
        /// Classes.
        cols: usize,
        /// Factor.
        scale: f32,
    },
    /// In place: `param −= lr · (grad + weight_decay · param)`.
    Sgd {
        /// Parameter, updated.
        param: DeviceAddr,
        /// Gradient.
        grad: DeviceAddr,
        /// Elements.
        n: usize,
        /// Learning rate.
        lr: f32,
        /// L2 penalty folded into the gradient.
        weight_decay: f32,
    },
    /// In place AdamW (decoupled weight decay): `m = β1·m + (1−β1)·g`, `v = β2·v + (1−β2)·g²`,
    /// `param −= lr · (m/bc1 / (√(v/bc2) + eps) + weight_decay · param)`.
    AdamW {
        /// Parameter, updated.
        param: DeviceAddr,
        /// Gradient.
        grad: DeviceAddr,
        /// First moment, updated.
        m: DeviceAddr,
        /// Second moment, updated.
        v: DeviceAddr,
        /// Elements.
        n: usize,
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the denominator.
        eps: f32,
        /// Decoupled weight decay.
        weight_decay: f32,
        /// Bias correction of the first moment, `1 − β1^t`.
        bc1: f32,
        /// Bias correction of the second moment, `1 − β2^t`.
        bc2: f32,
    },
}

fn acc(ptr: DeviceAddr, elems: usize, kind: AccessKind) -> Access {
    Access { ptr, bytes: elems as u64 * ELEM, kind }
}

impl KernelOp {
    /// A short name for reports and sanitizer messages.
    pub fn name(&self) -> &'static str {
        match self {
            KernelOp::Fill { .. } => "fill",
            KernelOp::Binary { op: BinaryOp::Add, .. } => "add",
            KernelOp::Binary { op: BinaryOp::Mul, .. } => "mul",
            KernelOp::Scale { .. } => "scale",
            KernelOp::Unary { op: UnaryOp::Relu, .. } => "relu",
            KernelOp::Unary { op: UnaryOp::Gelu, .. } => "gelu",
            KernelOp::UnaryBackward { op: UnaryOp::Relu, .. } => "relu_backward",
            KernelOp::UnaryBackward { op: UnaryOp::Gelu, .. } => "gelu_backward",
            KernelOp::Matmul { .. } => "matmul",
            KernelOp::Transpose { .. } => "transpose",
            KernelOp::Softmax { .. } => "softmax",
            KernelOp::SoftmaxBackward { .. } => "softmax_backward",
            KernelOp::LayerNorm { .. } => "layer_norm",
            KernelOp::LayerNormBackward { .. } => "layer_norm_backward",
            KernelOp::SumLast { .. } => "sum_last",
            KernelOp::BroadcastLast { .. } => "broadcast_last",
            KernelOp::SumRows { .. } => "sum_rows",
            KernelOp::Embedding { .. } => "embedding",
            KernelOp::EmbeddingBackward { .. } => "embedding_backward",
            KernelOp::CrossEntropy { .. } => "cross_entropy",
            KernelOp::CrossEntropyBackward { .. } => "cross_entropy_backward",
            KernelOp::Sgd { .. } => "sgd",
            KernelOp::AdamW { .. } => "adamw",
        }
    }

    /// Every range the kernel touches: inputs `Read`, outputs (and in-place state) `Write`.
    pub fn accesses(&self) -> Vec<Access> {
        use AccessKind::{Read as R, Write as W};
        match *self {
            KernelOp::Fill { out, n, .. } => vec![acc(out, n, W)],
            KernelOp::Binary { a, b, out, n, b_len, .. } => {
                vec![acc(a, n, R), acc(b, b_len, R), acc(out, n, W)]
            }
            KernelOp::Scale { x, out, n, .. } | KernelOp::Unary { x, out, n, .. } => {
                vec![acc(x, n, R), acc(out, n, W)]
            }
            KernelOp::UnaryBackward { x, dy, out, n, .. } => {
                vec![acc(x, n, R), acc(dy, n, R), acc(out, n, W)]
            }
            KernelOp::Matmul { a, b, out, batch, m, k, n, stride_a, stride_b, .. } => {
                let span = |stride: usize, one: usize| stride * batch.saturating_sub(1) + one;
                vec![
                    acc(a, span(stride_a, m * k), R),
                    acc(b, span(stride_b, k * n), R),
                    acc(out, batch * m * n, W),
                ]
            }
            KernelOp::Transpose { x, out, batch, rows, cols } => {
                vec![acc(x, batch * rows * cols, R), acc(out, batch * rows * cols, W)]
            }
            KernelOp::Softmax { x, out, rows, cols } => {
                vec![acc(x, rows * cols, R), acc(out, rows * cols, W)]
            }
            KernelOp::SoftmaxBackward { y, dy, out, rows, cols } => {
                vec![acc(y, rows * cols, R), acc(dy, rows * cols, R), acc(out, rows * cols, W)]
            }
            KernelOp::LayerNorm { x, gamma, beta, out, rows, cols, .. } => vec![
                acc(x, rows * cols, R),
                acc(gamma, cols, R),
                acc(beta, cols, R),
                acc(out, rows * cols, W),
            ],
            KernelOp::LayerNormBackward { x, gamma, dy, dx, dgamma, dbeta, rows, cols, .. } => {
                vec![
                    acc(x, rows * cols, R),
                    acc(gamma, cols, R),
                    acc(dy, rows * cols, R),
                    acc(dx, rows * cols, W),
                    acc(dgamma, cols, W),
                    acc(dbeta, cols, W),
                ]
            }
            KernelOp::SumLast { x, out, rows, cols, .. } => {
                vec![acc(x, rows * cols, R), acc(out, rows, W)]
            }
            KernelOp::BroadcastLast { dy, out, rows, cols, .. } => {
                vec![acc(dy, rows, R), acc(out, rows * cols, W)]
            }
            KernelOp::SumRows { x, out, rows, cols } => {
                vec![acc(x, rows * cols, R), acc(out, cols, W)]
            }
            KernelOp::Embedding { table, ids, out, n_ids, vocab, dim } => {
                vec![acc(table, vocab * dim, R), acc(ids, n_ids, R), acc(out, n_ids * dim, W)]
            }
            KernelOp::EmbeddingBackward { ids, dy, out, n_ids, vocab, dim } => {
                vec![acc(ids, n_ids, R), acc(dy, n_ids * dim, R), acc(out, vocab * dim, W)]
            }
            KernelOp::CrossEntropy { logits, targets, out, rows, cols } => {
                vec![acc(logits, rows * cols, R), acc(targets, rows, R), acc(out, 1, W)]
            }
            KernelOp::CrossEntropyBackward { logits, targets, out, rows, cols, .. } => {
                vec![acc(logits, rows * cols, R), acc(targets, rows, R), acc(out, rows * cols, W)]
            }
            KernelOp::Sgd { param, grad, n, .. } => vec![acc(param, n, W), acc(grad, n, R)],
            KernelOp::AdamW { param, grad, m, v, n, .. } => {
                vec![acc(param, n, W), acc(grad, n, R), acc(m, n, W), acc(v, n, W)]
            }
        }
    }
}

/// What the eager layer needs from a back end: copies in and out, and one launch per
/// [`KernelOp`]. Implementations are shared between threads.
pub trait Backend: Send + Sync + 'static {
    /// The device whose memory the tensors live in (what the allocator allocates from).
    type Device: Device;

    /// The device.
    fn device(&self) -> &Arc<Self::Device>;

    /// A short description ("host kernels on SimDevice 64 MiB").
    fn name(&self) -> String;

    /// Enqueues a copy of `data` to `dst` on `stream`; returns at once (`data` may be dropped).
    fn upload(&self, stream: StreamId, dst: DeviceAddr, data: &[f32]) -> Result<()>;

    /// Enqueues a copy of `len` elements at `src` on `stream` and waits for it: a host sync.
    fn download(&self, stream: StreamId, src: DeviceAddr, len: usize) -> Result<Vec<f32>>;

    /// Enqueues `op` on `stream`; returns at once.
    fn launch(&self, stream: StreamId, op: &KernelOp) -> Result<()>;
}
