//! The host kernels' arithmetic: one function per [`KernelOp`], on plain slices, single-threaded
//! and in a fixed order (so results are deterministic, run after run and stream layout after
//! stream layout). Reductions accumulate in `f32`, as a simple GPU kernel would.
//!
//! ```text
//!   execute(op, mem):  read every input range ─▶ compute on Vec<f32> ─▶ write every output range
//! ```

use crate::backend::{BinaryOp, KernelOp, UnaryOp};
use tidepool::device::{DeviceAddr, DeviceError, KernelMemory};

/// √(2/π), of the tanh approximation of GELU.
const GELU_C: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh approximation of GELU.
const GELU_A: f32 = 0.044_715;

/// Reads `n` floats at `ptr`. A failed read (an undeclared range, an unbacked device) panics
/// with the device's reason: the device records the kernel as failed.
pub(super) fn read(mem: &dyn KernelMemory, ptr: DeviceAddr, n: usize) -> Vec<f32> {
    try_read(mem, ptr, n).unwrap_or_else(|e| panic!("host kernel read failed: {e}"))
}

/// [`read`], answering the device's error instead of panicking.
pub(super) fn try_read(
    mem: &dyn KernelMemory,
    ptr: DeviceAddr,
    n: usize,
) -> Result<Vec<f32>, DeviceError> {
    let mut bytes = vec![0u8; n * 4];
    if n > 0 {
        mem.read(ptr, &mut bytes).map_err(|e| unbacked_terse(e, "read"))?;
    }
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// Writes `data` at `ptr` (panics like [`read`]).
pub(super) fn write(mem: &dyn KernelMemory, ptr: DeviceAddr, data: &[f32]) {
    if data.is_empty() {
        return;
    }
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    if let Err(e) = mem.write(ptr, &bytes) {
        panic!("host kernel write failed: {}", unbacked_terse(e, "write"));
    }
}

/// The device's error as it is. BROKEN (`unbacked_kernel_terse`): replaced by the old message,
/// which blamed an undeclared range whatever the cause (an unbacked device, say).
fn unbacked_terse(e: DeviceError, what: &'static str) -> DeviceError {
    match cfg!(tidepool_broken = "unbacked_kernel_terse") {
        true => DeviceError::Unsupported(match what {
            "read" => "host kernel read outside its declared memory",
            _ => "host kernel write outside its declared memory",
        }),
        false => e,
    }
}

/// GELU (tanh approximation).
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (GELU_C * (x + GELU_A * x * x * x)).tanh())
}

/// Derivative of [`gelu`].
pub fn gelu_grad(x: f32) -> f32 {
    let u = GELU_C * (x + GELU_A * x * x * x);
    let t = u.tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * x * x)
}

fn softmax_row(x: &[f32], out: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v - max).exp();
        sum += *o;
    }
    for o in out.iter_mut() {
        *o /= sum;
    }
}

/// Mean and 1/√(var + eps) of one row.
fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// The row or class an id names, `None` when out of range (negative, NaN, `≥ n`): as the CUDA
/// kernels, the outputs it feeds are written NaN; the kernel then fails (see `fail_on`).
fn index(id: f32, n: usize) -> Option<usize> {
    // BROKEN (`ids_unchecked`): a negative or NaN id is 0, one past the end panics unwritten.
    if cfg!(tidepool_broken = "ids_unchecked") {
        return Some(id as usize);
    }
    (id >= 0.0 && id < n as f32 && (id as usize) < n).then_some(id as usize)
}

/// Panics (the device records the kernel as failed) after the outputs were written, NaN where
/// an id was out of range, so a later read sees NaN rather than stale memory.
fn fail_on(bad: Option<f32>, what: &str, n: usize) {
    if let Some(id) = bad {
        panic!("{what} {id} out of range ({n})");
    }
}

/// Element (r, c) of a row-major `rows×cols` matrix, or of its transpose when `t`.
fn at(m: &[f32], t: bool, r: usize, c: usize, rows: usize, cols: usize) -> f32 {
    if t { m[c * rows + r] } else { m[r * cols + c] }
}

/// Runs `op` against device memory: reads its inputs, computes, writes its outputs.
pub(super) fn execute(op: &KernelOp, mem: &dyn KernelMemory) {
    match *op {
        KernelOp::Fill { out, n, value } => write(mem, out, &vec![value; n]),
        KernelOp::Binary { op, a, b, out, n, b_len } => {
            let (a, b) = (read(mem, a, n), read(mem, b, b_len));
            let y: Vec<f32> = match op {
                BinaryOp::Add => a.iter().enumerate().map(|(i, &x)| x + b[i % b_len]).collect(),
                BinaryOp::Mul => a.iter().enumerate().map(|(i, &x)| x * b[i % b_len]).collect(),
            };
            write(mem, out, &y);
        }
        KernelOp::Scale { x, out, n, alpha } => {
            let y: Vec<f32> = read(mem, x, n).iter().map(|&v| alpha * v).collect();
            write(mem, out, &y);
        }
        KernelOp::Unary { op, x, out, n } => {
            let x = read(mem, x, n);
            let y: Vec<f32> = match op {
                UnaryOp::Relu => x.iter().map(|&v| v.max(0.0)).collect(),
                UnaryOp::Gelu => x.iter().map(|&v| gelu(v)).collect(),
            };
            write(mem, out, &y);
        }
        KernelOp::UnaryBackward { op, x, dy, out, n } => {
            let (x, dy) = (read(mem, x, n), read(mem, dy, n));
            let y: Vec<f32> = x
                .iter()
                .zip(&dy)
                .map(|(&v, &g)| match op {
                    UnaryOp::Relu if v > 0.0 => g,
                    UnaryOp::Relu => 0.0,
                    UnaryOp::Gelu => gelu_grad(v) * g,
                })
                .collect();
            write(mem, out, &y);
        }
        KernelOp::Matmul { a, b, out, batch, m, k, n, trans_a, trans_b, stride_a, stride_b } => {
            let span = |stride: usize, one: usize| stride * batch.saturating_sub(1) + one;
            let (av, bv) =
                (read(mem, a, span(stride_a, m * k)), read(mem, b, span(stride_b, k * n)));
            let mut y = vec![0.0f32; batch * m * n];
            for p in 0..batch {
                let am = &av[p * stride_a..p * stride_a + m * k];
                let bm = &bv[p * stride_b..p * stride_b + k * n];
                let ym = &mut y[p * m * n..(p + 1) * m * n];
                for i in 0..m {
                    for j in 0..n {
                        let mut s = 0.0f32;
                        for q in 0..k {
                            s += at(am, trans_a, i, q, m, k) * at(bm, trans_b, q, j, k, n);
                        }
                        ym[i * n + j] = s;
                    }
                }
            }
            write(mem, out, &y);
        }
        KernelOp::Transpose { x, out, batch, rows, cols } => {
            let x = read(mem, x, batch * rows * cols);
            let mut y = vec![0.0f32; x.len()];
            for p in 0..batch {
                let base = p * rows * cols;
                for r in 0..rows {
                    for c in 0..cols {
                        y[base + c * rows + r] = x[base + r * cols + c];
                    }
                }
            }
            write(mem, out, &y);
        }
        KernelOp::Softmax { x, out, rows, cols } => {
            let x = read(mem, x, rows * cols);
            let mut y = vec![0.0f32; x.len()];
            for (xr, yr) in x.chunks_exact(cols).zip(y.chunks_exact_mut(cols)) {
                softmax_row(xr, yr);
            }
            write(mem, out, &y);
        }
        KernelOp::SoftmaxBackward { y, dy, out, rows, cols } => {
            let (y, dy) = (read(mem, y, rows * cols), read(mem, dy, rows * cols));
            let mut dx = vec![0.0f32; y.len()];
            for r in 0..rows {
                let s = r * cols..(r + 1) * cols;
                let dot: f32 = y[s.clone()].iter().zip(&dy[s.clone()]).map(|(a, b)| a * b).sum();
                for i in s {
                    dx[i] = y[i] * (dy[i] - dot);
                }
            }
            write(mem, out, &dx);
        }
        KernelOp::LayerNorm { x, gamma, beta, out, rows, cols, eps } => {
            let x = read(mem, x, rows * cols);
            let (g, b) = (read(mem, gamma, cols), read(mem, beta, cols));
            let mut y = vec![0.0f32; x.len()];
            for (xr, yr) in x.chunks_exact(cols).zip(y.chunks_exact_mut(cols)) {
                let (mean, rstd) = row_stats(xr, eps);
                for c in 0..cols {
                    yr[c] = (xr[c] - mean) * rstd * g[c] + b[c];
                }
            }
            write(mem, out, &y);
        }
        KernelOp::LayerNormBackward { x, gamma, dy, dx, dgamma, dbeta, rows, cols, eps } => {
            let (x, dy) = (read(mem, x, rows * cols), read(mem, dy, rows * cols));
            let g = read(mem, gamma, cols);
            let (mut dxv, mut dg, mut db) =
                (vec![0.0f32; x.len()], vec![0.0f32; cols], vec![0.0f32; cols]);
            let n = cols as f32;
            for r in 0..rows {
                let (xr, dyr) = (&x[r * cols..(r + 1) * cols], &dy[r * cols..(r + 1) * cols]);
                let (mean, rstd) = row_stats(xr, eps);
                let (mut s1, mut s2) = (0.0f32, 0.0f32);
                for c in 0..cols {
                    let xhat = (xr[c] - mean) * rstd;
                    let gy = dyr[c] * g[c];
                    s1 += gy;
                    s2 += gy * xhat;
                    dg[c] += dyr[c] * xhat;
                    db[c] += dyr[c];
                }
                for c in 0..cols {
                    let xhat = (xr[c] - mean) * rstd;
                    dxv[r * cols + c] = rstd * (dyr[c] * g[c] - s1 / n - xhat * s2 / n);
                }
            }
            write(mem, dx, &dxv);
            write(mem, dgamma, &dg);
            write(mem, dbeta, &db);
        }
        KernelOp::SumLast { x, out, rows, cols, scale } => {
            let x = read(mem, x, rows * cols);
            let y: Vec<f32> = (0..rows)
                .map(|r| scale * x[r * cols..(r + 1) * cols].iter().sum::<f32>())
                .collect();
            write(mem, out, &y);
        }
        KernelOp::BroadcastLast { dy, out, rows, cols, scale } => {
            let dy = read(mem, dy, rows);
            let y: Vec<f32> = (0..rows * cols).map(|i| scale * dy[i / cols]).collect();
            write(mem, out, &y);
        }
        KernelOp::SumRows { x, out, rows, cols } => {
            let x = read(mem, x, rows * cols);
            let mut y = vec![0.0f32; cols];
            for r in 0..rows {
                for c in 0..cols {
                    y[c] += x[r * cols + c];
                }
            }
            write(mem, out, &y);
        }
        KernelOp::Embedding { table, ids, out, n_ids, vocab, dim } => {
            let (t, ids) = (read(mem, table, vocab * dim), read(mem, ids, n_ids));
            let mut y = vec![0.0f32; n_ids * dim];
            let mut bad = None;
            for (i, &id) in ids.iter().enumerate() {
                match index(id, vocab) {
                    Some(v) => {
                        y[i * dim..(i + 1) * dim].copy_from_slice(&t[v * dim..(v + 1) * dim])
                    }
                    None => {
                        y[i * dim..(i + 1) * dim].fill(f32::NAN);
                        bad = Some(id);
                    }
                }
            }
            write(mem, out, &y);
            fail_on(bad, "embedding id", vocab);
        }
        KernelOp::EmbeddingBackward { ids, dy, out, n_ids, vocab, dim } => {
            let (ids, dy) = (read(mem, ids, n_ids), read(mem, dy, n_ids * dim));
            let mut y = vec![0.0f32; vocab * dim];
            let mut bad = None;
            for (i, &id) in ids.iter().enumerate() {
                let Some(v) = index(id, vocab) else {
                    bad = Some(id);
                    continue;
                };
                for c in 0..dim {
                    y[v * dim + c] += dy[i * dim + c];
                }
            }
            if bad.is_some() {
                y.fill(f32::NAN);
            }
            write(mem, out, &y);
            fail_on(bad, "embedding id", vocab);
        }
        KernelOp::CrossEntropy { logits, targets, out, rows, cols } => {
            let (l, t) = (read(mem, logits, rows * cols), read(mem, targets, rows));
            let mut total = 0.0f32;
            let mut bad = None;
            for r in 0..rows {
                let row = &l[r * cols..(r + 1) * cols];
                let Some(target) = index(t[r], cols) else {
                    bad = Some(t[r]);
                    break;
                };
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let lse = max + row.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
                total += lse - row[target];
            }
            // The mean over no rows is NaN (0/0), as the CUDA kernel's.
            let loss = if bad.is_some() { f32::NAN } else { total / rows as f32 };
            write(mem, out, &[loss]);
            fail_on(bad, "class", cols);
        }
        KernelOp::CrossEntropyBackward { logits, targets, out, rows, cols, scale } => {
            let (l, t) = (read(mem, logits, rows * cols), read(mem, targets, rows));
            let mut y = vec![0.0f32; rows * cols];
            let mut bad = None;
            for r in 0..rows {
                let yr = &mut y[r * cols..(r + 1) * cols];
                softmax_row(&l[r * cols..(r + 1) * cols], yr);
                match index(t[r], cols) {
                    Some(target) => yr[target] -= 1.0,
                    None => {
                        yr.fill(f32::NAN);
                        bad = Some(t[r]);
                    }
                }
                for v in yr.iter_mut() {
                    *v *= scale;
                }
            }
            write(mem, out, &y);
            fail_on(bad, "class", cols);
        }
        KernelOp::Sgd { param, grad, n, lr, weight_decay } => {
            let (mut p, g) = (read(mem, param, n), read(mem, grad, n));
            for (p, g) in p.iter_mut().zip(&g) {
                *p -= lr * (g + weight_decay * *p);
            }
            write(mem, param, &p);
        }
        KernelOp::AdamW { param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2 } => {
            let (mut p, g) = (read(mem, param, n), read(mem, grad, n));
            let (mut mv, mut vv) = (read(mem, m, n), read(mem, v, n));
            for i in 0..n {
                mv[i] = beta1 * mv[i] + (1.0 - beta1) * g[i];
                vv[i] = beta2 * vv[i] + (1.0 - beta2) * g[i] * g[i];
                let update = (mv[i] / bc1) / ((vv[i] / bc2).sqrt() + eps);
                p[i] -= lr * (update + weight_decay * p[i]);
            }
            write(mem, param, &p);
            write(mem, m, &mv);
            write(mem, v, &vv);
        }
    }
}
