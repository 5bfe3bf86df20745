//! tidepool as a cudarc user's allocator: the application's own cudarc stream is adopted,
//! buffers are allocated through tidepool on it, filled with an NVRTC kernel, multiplied with
//! cuBLAS sgemm, copied back and checked element by element against the host.
//!
//! ```text
//!   ctx.new_stream() ─▶ CudaDevice::adopt_stream ─▶ StreamId
//!   CudaDevice ─▶ Allocator ─▶ CudaBuffer<f32> a, b, c ──▶ launch_builder(&fill).arg(&mut a)
//!                                                      └─▶ CudaBlas::gemm(cfg, &a, &b, &mut c)
//!                                                      └─▶ stream.clone_dtoh(&c) → check
//! ```
//!
//! Run: `cargo run --example cudarc_interop --features cuda-12080`. Where no GPU (or no NVRTC/cuBLAS
//! library) can be used it prints why it cannot run and exits 0; a wrong product exits 1.

use std::process::ExitCode;
use tidepool::cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use tidepool::cudarc::driver::{LaunchConfig, PushKernelArg};
use tidepool::cudarc::nvrtc::compile_ptx;
use tidepool::{Allocator, Config, CudaBuffer, CudaDevice, Device};

/// `x[i] = ((i * mul) % modulo) * scale`: small exact values, so the product is exact in f32.
const FILL_CU: &str = r#"
extern "C" __global__ void fill_pattern(float *x, unsigned int len, unsigned int mul,
                                        unsigned int modulo, float scale) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) {
        x[i] = (float)((i * mul) % modulo) * scale;
    }
}
"#;

/// Matrix sizes: A is M×K, B is K×N, C is M×N, all column-major (cuBLAS's layout).
const M: usize = 256;
const K: usize = 128;
const N: usize = 192;

/// (mul, modulo, scale) of A's and B's patterns.
const PATTERN_A: (u32, u32, f32) = (7, 13, 0.25);
const PATTERN_B: (u32, u32, f32) = (5, 11, 0.5);

fn pattern(i: usize, (mul, modulo, scale): (u32, u32, f32)) -> f32 {
    ((i as u32).wrapping_mul(mul) % modulo) as f32 * scale
}

/// Why this machine cannot run the example, if it cannot.
fn cannot_run() -> Option<String> {
    if let Some(reason) = CudaDevice::unavailable_reason() {
        return Some(reason);
    }
    // SAFETY: loading a CUDA library runs its initialisers only (cudarc panics on a later call
    // when the library is missing, so check first).
    if !unsafe { tidepool::cudarc::nvrtc::sys::is_culib_present() } {
        return Some("no NVRTC library (libnvrtc not found)".into());
    }
    // SAFETY: as above.
    if !unsafe { tidepool::cudarc::cublas::sys::is_culib_present() } {
        return Some("no cuBLAS library (libcublas not found)".into());
    }
    None
}

fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    if let Some(reason) = cannot_run() {
        println!("cudarc_interop: cannot run here: {reason}");
        return Ok(ExitCode::SUCCESS);
    }
    let device = CudaDevice::new(0)?;
    println!("cudarc_interop on {}", device.name());
    let alloc = Allocator::new(device.clone(), Config::default())?;
    // The application's own stream, as any cudarc program makes it, adopted by tidepool.
    let stream = device.context().new_stream()?;
    let sid = device.adopt_stream(&stream)?;

    // Was: stream.alloc_zeros::<f32>(n) / unsafe { stream.alloc::<f32>(n) }.
    // SAFETY: a and b are written by `fill_pattern` before anything reads them (and any bit
    // pattern is a valid f32).
    let (mut a, mut b) = unsafe {
        (
            CudaBuffer::<f32>::alloc(&alloc, M * K, sid)?,
            CudaBuffer::<f32>::alloc(&alloc, K * N, sid)?,
        )
    };
    let mut c = CudaBuffer::<f32>::alloc_zeros(&alloc, M * N, sid)?;

    let module = device.context().load_module(compile_ptx(FILL_CU)?)?;
    let fill = module.load_function("fill_pattern")?;
    for (buf, (mul, modulo, scale)) in [(&mut a, PATTERN_A), (&mut b, PATTERN_B)] {
        let len = buf.len() as u32;
        let mut launch = stream.launch_builder(&fill);
        launch.arg(buf).arg(&len).arg(&mul).arg(&modulo).arg(&scale);
        // SAFETY: the arguments match `fill_pattern`'s signature and the buffer has `len` floats.
        unsafe { launch.launch(LaunchConfig::for_num_elems(len)) }?;
    }

    let blas = CudaBlas::new(stream.clone())?;
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: M as i32,
        n: N as i32,
        k: K as i32,
        alpha: 1.0f32,
        lda: M as i32,
        ldb: K as i32,
        beta: 0.0f32,
        ldc: M as i32,
    };
    // SAFETY: a is M×K (lda M), b is K×N (ldb K), c is M×N (ldc M), all on `stream`.
    unsafe { blas.gemm(cfg, &a, &b, &mut c) }?;
    let got: Vec<f32> = stream.clone_dtoh(&c)?;

    let mut worst = 0f32;
    for j in 0..N {
        for i in 0..M {
            let want: f32 =
                (0..K).map(|p| pattern(i + p * M, PATTERN_A) * pattern(p + j * K, PATTERN_B)).sum();
            worst = worst.max((got[i + j * M] - want).abs() / want.abs().max(1.0));
        }
    }
    let before = alloc.stats().num_device_alloc;
    drop((a, b, c));
    // The same shapes again come from tidepool's cache: no new cuMemAlloc.
    // SAFETY: never read.
    let again = unsafe { CudaBuffer::<f32>::alloc(&alloc, M * K, sid)? };
    let hits = alloc.stats().num_device_alloc == before;
    drop(again);
    println!(
        "C = A·B ({M}×{K} · {K}×{N}): max relative error {worst:e}; {} segment(s) reserved; \
         re-allocation served from cache: {hits}",
        before
    );
    alloc.synchronize()?;
    // Let go of the adopted stream before the application drops it.
    alloc.release_stream(sid)?;
    alloc.empty_cache()?;
    drop(stream);
    if worst > 1e-5 || !hits {
        eprintln!("cudarc_interop: FAILED");
        return Ok(ExitCode::FAILURE);
    }
    println!("cudarc_interop: ok");
    Ok(ExitCode::SUCCESS)
}
