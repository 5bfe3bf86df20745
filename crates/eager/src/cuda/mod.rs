//! `CudaBackend` (feature `cuda`): the op interface on a real GPU — the kernels of
//! [`kernels::SOURCE`] compiled once per device with NVRTC (cached per device ordinal for the
//! process), cuBLAS `sgemm` (strided batched) for matmul, and driver copies for upload/download,
//! all on [`CudaDevice::stream`] of the op's stream. Uploads stage through pinned host memory
//! ([`HostAllocator`], `cuMemHostAlloc`), so they are truly asynchronous. Device pointers are the allocator's
//! [`DeviceAddr`]s (`CUdeviceptr`s), passed to kernels as pointer-sized arguments.
//!
//! ```text
//!   launch(stream, op) ── Matmul ──▶ cublasSgemmStridedBatched (row-major via Cᵀ = Bᵀ·Aᵀ),
//!                      │             one cuBLAS handle per stream
//!                      └─ other ───▶ kernels[name] <<<ceil(n/1024), 1024>>> (args…)
//! ```
//!
//! Built and linted here without a GPU; it has not run on one in this repository's CI.

mod kernels;

use super::backend::{Backend, BinaryOp, KernelOp, UnaryOp};
use super::error::{EagerError, Result};
use cudarc::cublas::{CudaBlas, result as blas, sys::cublasOperation_t};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg, result};
use cudarc::nvrtc::compile_ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use tidepool::HostAllocator;
use tidepool::device::{CudaDevice, Device, DeviceAddr, StreamId};

/// Threads per block of the elementwise and per-row kernels.
const BLOCK: u32 = 256;

/// The compiled kernels of one device.
struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
}

/// Compiled kernels per device ordinal: NVRTC runs once per device and process.
static KERNELS: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();

fn backend_err(what: &str, e: impl std::fmt::Debug) -> EagerError {
    EagerError::Backend(format!("{what}: {e:?}"))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One kernel argument.
enum Arg {
    Ptr(u64),
    U32(u32),
    I32(i32),
    F32(f32),
}

fn ptr(p: DeviceAddr) -> Arg {
    Arg::Ptr(p.0)
}

fn u(n: usize) -> Result<Arg> {
    u32::try_from(n).map(Arg::U32).map_err(|_| EagerError::Backend(format!("size {n} above u32")))
}

/// Eager ops as NVRTC kernels and cuBLAS calls on a [`CudaDevice`]; see the module docs.
pub struct CudaBackend {
    device: Arc<CudaDevice>,
    kernels: Arc<Kernels>,
    /// One cuBLAS handle per stream (a handle is bound to its stream).
    blas: Mutex<HashMap<StreamId, Arc<CudaBlas>>>,
    /// Pinned staging buffers for uploads.
    pinned: HostAllocator<CudaDevice>,
}

impl CudaBackend {
    /// The back end on `device`: checks that NVRTC and cuBLAS can be loaded, then compiles the
    /// kernels (once per device ordinal and process).
    pub fn new(device: Arc<CudaDevice>) -> Result<CudaBackend> {
        // SAFETY: loading a CUDA library runs its initialisers only; cudarc panics on a later
        // call when the library is missing, so check first.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(EagerError::Backend("no NVRTC library (libnvrtc not found)".into()));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(EagerError::Backend("no cuBLAS library (libcublas not found)".into()));
        }
        let cache = KERNELS.get_or_init(|| Mutex::new(HashMap::new()));
        let mut cache = lock(cache);
        let kernels = match cache.get(&device.ordinal()) {
            Some(k) => k.clone(),
            None => {
                let ptx = compile_ptx(kernels::SOURCE).map_err(|e| backend_err("NVRTC", e))?;
                let module =
                    device.context().load_module(ptx).map_err(|e| backend_err("load PTX", e))?;
                let mut functions = HashMap::new();
                for name in kernels::NAMES {
                    let f = module.load_function(name).map_err(|e| backend_err(name, e))?;
                    functions.insert(name, f);
                }
                let k = Arc::new(Kernels { functions });
                cache.insert(device.ordinal(), k.clone());
                k
            }
        };
        let pinned = HostAllocator::new(device.clone());
        Ok(CudaBackend { device, kernels, blas: Mutex::new(HashMap::new()), pinned })
    }

    /// The pinned host allocator uploads stage through.
    pub fn host_allocator(&self) -> &HostAllocator<CudaDevice> {
        &self.pinned
    }

    fn stream(&self, id: StreamId) -> Result<Arc<CudaStream>> {
        Ok(self.device.stream(id)?)
    }

    fn blas(&self, id: StreamId) -> Result<Arc<CudaBlas>> {
        let mut map = lock(&self.blas);
        if let Some(b) = map.get(&id) {
            return Ok(b.clone());
        }
        let b = Arc::new(CudaBlas::new(self.stream(id)?).map_err(|e| backend_err("cuBLAS", e))?);
        // A new stream's first product: the handles of streams destroyed since go. Each holds
        // its CUDA stream, which would live on with it, and stream ids are never reused
        // (`CudaDevice`), so a kept one is never used again: code that makes a stream per
        // request would leak a handle and a stream per request.
        // BROKEN (`blas_handles_kept`): kept until the back end goes.
        if !cfg!(tidepool_broken = "blas_handles_kept") {
            map.retain(|s, _| self.device.has_stream(*s));
        }
        map.insert(id, b.clone());
        Ok(b)
    }

    /// How many cuBLAS handles the back end holds (one per stream that ran a product and was
    /// not destroyed before another stream's first product).
    #[doc(hidden)]
    pub fn blas_handles(&self) -> usize {
        lock(&self.blas).len()
    }

    /// Launches kernel `name` with `threads` threads (one per element or row).
    fn run(&self, stream: &CudaStream, name: &str, threads: usize, args: &[Arg]) -> Result<()> {
        let f = &self.kernels.functions[name];
        let threads = u32::try_from(threads)
            .map_err(|_| EagerError::Backend(format!("{threads} threads above u32")))?;
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(BLOCK).max(1), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::U32(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: the arguments match the kernel's signature in `kernels::SOURCE` (pointers are
        // 64-bit device addresses, sizes u32, codes i32, scalars f32), and every pointer is the
        // address of a live allocator buffer at least as large as the kernel indexes (the
        // KernelOp was built from the tensors' shapes by the ops, which hold the tensors alive
        // until the launch is enqueued; their memory is freed in this stream's order).
        unsafe { b.launch(cfg) }.map_err(|e| backend_err(name, e))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        id: StreamId,
        (a, b, out): (DeviceAddr, DeviceAddr, DeviceAddr),
        (batch, m, k, n): (usize, usize, usize, usize),
        (trans_a, trans_b): (bool, bool),
        (stride_a, stride_b): (usize, usize),
    ) -> Result<()> {
        let i = |v: usize| {
            i32::try_from(v).map_err(|_| EagerError::Backend(format!("matmul size {v} above i32")))
        };
        let op = |t: bool| {
            if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N }
        };
        // Row-major C (m×n) is column-major Cᵀ (n×m) = op(B)ᵀ·op(A)ᵀ: B first, then A.
        let ldb = if trans_b { k } else { n };
        let lda = if trans_a { m } else { k };
        // cuBLAS wants every leading dimension ≥ 1: an empty inner dimension (k = 0, where the
        // operands are never read and C is β·C = zeros) gave k = 0 and was refused.
        // BROKEN (`blas_ld_zero`): passed as they are.
        let (ldb, lda) = match cfg!(tidepool_broken = "blas_ld_zero") {
            true => (ldb, lda),
            false => (ldb.max(1), lda.max(1)),
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let blas = self.blas(id)?;
        self.device.context().bind_to_thread().map_err(|e| backend_err("bind", e))?;
        // SAFETY: the handle is bound to stream `id`; `a`, `b` and `out` are live allocator
        // buffers holding `stride_a·(batch−1) + m·k`, `stride_b·(batch−1) + k·n` and
        // `batch·m·n` floats (checked from the tensors' shapes by the op); alpha and beta are
        // host scalars that outlive the call (the default host pointer mode reads them before
        // returning).
        unsafe {
            blas::sgemm_strided_batched(
                *blas.handle(),
                op(trans_b),
                op(trans_a),
                i(n)?,
                i(m)?,
                i(k)?,
                &alpha,
                b.0 as *const f32,
                i(ldb)?,
                stride_b as i64,
                a.0 as *const f32,
                i(lda)?,
                stride_a as i64,
                &beta,
                out.0 as *mut f32,
                i(n)?,
                (m * n) as i64,
                i(batch)?,
            )
        }
        .map_err(|e| backend_err("cublasSgemmStridedBatched", e))
    }
}

impl Backend for CudaBackend {
    type Device = CudaDevice;

    fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    fn name(&self) -> String {
        format!("NVRTC/cuBLAS kernels on {}", self.device.name())
    }

    /// Through a pinned staging buffer (`cuMemcpyHtoDAsync` from page-locked memory, an event
    /// recorded after it); from pageable memory if pinned memory is unsupported or none is left
    /// for the staging block.
    fn upload(&self, stream: StreamId, dst: DeviceAddr, data: &[f32]) -> Result<()> {
        if super::pinned::upload(&self.pinned, stream, dst, data)? {
            return Ok(());
        }
        let s = self.stream(stream)?;
        self.device.context().bind_to_thread().map_err(|e| backend_err("bind", e))?;
        // SAFETY: `dst` is a live allocator buffer of at least `data.len()` floats (the caller's
        // tensor); the copy is ordered on its stream. `data` is pageable host memory, which the
        // driver stages before `cuMemcpyHtoDAsync` returns, so it may be dropped afterwards.
        unsafe { result::memcpy_htod_async(dst.0, data, s.cu_stream()) }
            .map_err(|e| backend_err("cuMemcpyHtoDAsync", e))
    }

    fn download(&self, stream: StreamId, src: DeviceAddr, len: usize) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; len];
        if len == 0 {
            return Ok(out);
        }
        let s = self.stream(stream)?;
        self.device.context().bind_to_thread().map_err(|e| backend_err("bind", e))?;
        // SAFETY: `src` is a live allocator buffer of at least `len` floats; `out` lives until
        // the stream is synchronised just below, so the copy finishes before it is read or freed.
        unsafe { result::memcpy_dtoh_async(&mut out, src.0, s.cu_stream()) }
            .map_err(|e| backend_err("cuMemcpyDtoHAsync", e))?;
        s.synchronize().map_err(|e| backend_err("cuStreamSynchronize", e))?;
        Ok(out)
    }

    fn launch(&self, stream: StreamId, op: &KernelOp) -> Result<()> {
        let s = self.stream(stream)?;
        let s = &*s;
        match *op {
            KernelOp::Fill { out, n, value } => {
                self.run(s, "fill", n, &[ptr(out), u(n)?, Arg::F32(value)])
            }
            KernelOp::Binary { op, a, b, out, n, b_len } => {
                let code = Arg::I32(match op {
                    BinaryOp::Add => 0,
                    BinaryOp::Mul => 1,
                });
                self.run(s, "binary", n, &[code, ptr(a), ptr(b), ptr(out), u(n)?, u(b_len)?])
            }
            KernelOp::Scale { x, out, n, alpha } => {
                self.run(s, "scale", n, &[ptr(x), ptr(out), u(n)?, Arg::F32(alpha)])
            }
            KernelOp::Unary { op, x, out, n } => {
                self.run(s, "unary", n, &[unary_code(op), ptr(x), ptr(out), u(n)?])
            }
            KernelOp::UnaryBackward { op, x, dy, out, n } => self.run(
                s,
                "unary_backward",
                n,
                &[unary_code(op), ptr(x), ptr(dy), ptr(out), u(n)?],
            ),
            KernelOp::Matmul {
                a,
                b,
                out,
                batch,
                m,
                k,
                n,
                trans_a,
                trans_b,
                stride_a,
                stride_b,
            } => self.matmul(
                stream,
                (a, b, out),
                (batch, m, k, n),
                (trans_a, trans_b),
                (stride_a, stride_b),
            ),
            KernelOp::Transpose { x, out, batch, rows, cols } => self.run(
                s,
                "transpose",
                batch * rows * cols,
                &[ptr(x), ptr(out), u(batch)?, u(rows)?, u(cols)?],
            ),
            KernelOp::Softmax { x, out, rows, cols } => {
                self.run(s, "softmax", rows, &[ptr(x), ptr(out), u(rows)?, u(cols)?])
            }
            KernelOp::SoftmaxBackward { y, dy, out, rows, cols } => self.run(
                s,
                "softmax_backward",
                rows,
                &[ptr(y), ptr(dy), ptr(out), u(rows)?, u(cols)?],
            ),
            KernelOp::LayerNorm { x, gamma, beta, out, rows, cols, eps } => self.run(
                s,
                "layer_norm",
                rows,
                &[ptr(x), ptr(gamma), ptr(beta), ptr(out), u(rows)?, u(cols)?, Arg::F32(eps)],
            ),
            KernelOp::LayerNormBackward { x, gamma, dy, dx, dgamma, dbeta, rows, cols, eps } => {
                self.run(
                    s,
                    "layer_norm_backward_dx",
                    rows,
                    &[ptr(x), ptr(gamma), ptr(dy), ptr(dx), u(rows)?, u(cols)?, Arg::F32(eps)],
                )?;
                self.run(
                    s,
                    "layer_norm_backward_params",
                    cols,
                    &[ptr(x), ptr(dy), ptr(dgamma), ptr(dbeta), u(rows)?, u(cols)?, Arg::F32(eps)],
                )
            }
            KernelOp::SumLast { x, out, rows, cols, scale } => self.run(
                s,
                "sum_last",
                rows,
                &[ptr(x), ptr(out), u(rows)?, u(cols)?, Arg::F32(scale)],
            ),
            KernelOp::BroadcastLast { dy, out, rows, cols, scale } => self.run(
                s,
                "broadcast_last",
                rows * cols,
                &[ptr(dy), ptr(out), u(rows)?, u(cols)?, Arg::F32(scale)],
            ),
            KernelOp::SumRows { x, out, rows, cols } => {
                self.run(s, "sum_rows", cols, &[ptr(x), ptr(out), u(rows)?, u(cols)?])
            }
            KernelOp::Embedding { table, ids, out, n_ids, vocab, dim } => self.run(
                s,
                "embedding",
                n_ids * dim,
                &[ptr(table), ptr(ids), ptr(out), u(n_ids)?, u(vocab)?, u(dim)?],
            ),
            KernelOp::EmbeddingBackward { ids, dy, out, n_ids, vocab, dim } => self.run(
                s,
                "embedding_backward",
                vocab * dim,
                &[ptr(ids), ptr(dy), ptr(out), u(n_ids)?, u(vocab)?, u(dim)?],
            ),
            KernelOp::CrossEntropy { logits, targets, out, rows, cols } => self.run(
                s,
                "cross_entropy",
                1,
                &[ptr(logits), ptr(targets), ptr(out), u(rows)?, u(cols)?],
            ),
            KernelOp::CrossEntropyBackward { logits, targets, out, rows, cols, scale } => self.run(
                s,
                "cross_entropy_backward",
                rows,
                &[ptr(logits), ptr(targets), ptr(out), u(rows)?, u(cols)?, Arg::F32(scale)],
            ),
            KernelOp::Sgd { param, grad, n, lr, weight_decay } => self.run(
                s,
                "sgd",
                n,
                &[ptr(param), ptr(grad), u(n)?, Arg::F32(lr), Arg::F32(weight_decay)],
            ),
            KernelOp::AdamW {
                param,
                grad,
                m,
                v,
                n,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                bc1,
                bc2,
            } => self.run(
                s,
                "adamw",
                n,
                &[
                    ptr(param),
                    ptr(grad),
                    ptr(m),
                    ptr(v),
                    u(n)?,
                    Arg::F32(lr),
                    Arg::F32(beta1),
                    Arg::F32(beta2),
                    Arg::F32(eps),
                    Arg::F32(weight_decay),
                    Arg::F32(bc1),
                    Arg::F32(bc2),
                ],
            ),
        }
    }
}

fn unary_code(op: UnaryOp) -> Arg {
    Arg::I32(match op {
        UnaryOp::Relu => 0,
        UnaryOp::Gelu => 1,
    })
}
