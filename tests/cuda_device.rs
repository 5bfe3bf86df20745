//! CudaDevice on a real GPU, and its graceful absence everywhere else (feature `cuda`).
//!
//! - Always run: `CudaDevice::new` is an error with a clear reason where there is no driver or GPU.
//! - GPU tier: each test calls `gpu()`, which prints `skipping: <reason>` and returns `None`
//!   where no GPU can be used (no libcuda, no device). With a GPU they run for real:
//!   reserve/release/mem_info; events around a gated kernel; hold-the-stream (record_stream),
//!   with ordinary and expandable segments; the allocator over CudaDevice with no leaks, across
//!   threads; expandable segments (virtual memory) with data across pages, growth, release after
//!   a running kernel, and no leak; private pools (a guard routing a stream, teardown with a live
//!   buffer) and CUDA-graph capture from the graph's private pool, replayed 100 times; two
//!   allocators over two `CudaDevice::new(0)` returning their caches to each other;
//!   `CudaBuffer::from_buffer` giving a refused buffer back whole.
//!
//! Kernels come as PTX (below), so these tests need only the driver, not NVRTC. "Gated" kernels
//! spin until a flag in device memory is set by a memset on another stream, so "not finished
//! yet" is a fact the test controls, not a timing guess; a cap of `MAX_SPIN_CYCLES` GPU clocks
//! ends the spin anyway (and reports it in `gate[1]`), so a test can fail but never hang.
#![cfg(feature = "cuda")]

mod common;

use std::sync::{Arc, Mutex, MutexGuard};
use tidepool::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg, result};
use tidepool::cudarc::nvrtc::Ptx;
use tidepool::device::{Device, DeviceError, NO_DRIVER};
use tidepool::{AllocError, Allocator, Config, CrossStream, CudaBuffer, CudaDevice, StreamId};

/// PTX of `KERNELS_CU`, produced by NVRTC 12.4 (`--gpu-architecture=compute_70`), comments
/// dropped and `.version` lowered to 7.0 (CUDA 11.0 drivers and later); checked with
/// `ptxas --gpu-name sm_70` and `sm_90`. Regenerate after changing the source.
#[allow(dead_code)]
const KERNELS_CU: &str = r#"
extern "C" __global__ void gated_fill(float *out, unsigned int n, float value,
                                      volatile unsigned int *gate, unsigned long long max_cycles) {
    if (threadIdx.x == 0) {
        long long start = clock64();
        while (gate[0] == 0) {
            if ((unsigned long long)(clock64() - start) > max_cycles) {
                gate[1] = 1;
                break;
            }
        }
    }
    __syncthreads();
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) {
        out[i] = value;
    }
}

extern "C" __global__ void fill(float *out, unsigned int n, float value) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = value;
    }
}
"#;

const KERNELS_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

	// .globl	gated_fill

.visible .entry gated_fill(
	.param .u64 gated_fill_param_0,
	.param .u32 gated_fill_param_1,
	.param .f32 gated_fill_param_2,
	.param .u64 gated_fill_param_3,
	.param .u64 gated_fill_param_4
)
{
	.reg .pred 	%p<6>;
	.reg .f32 	%f<2>;
	.reg .b32 	%r<9>;
	.reg .b64 	%rd<12>;


	ld.param.u64 	%rd4, [gated_fill_param_0];
	ld.param.u32 	%r5, [gated_fill_param_1];
	ld.param.f32 	%f1, [gated_fill_param_2];
	ld.param.u64 	%rd6, [gated_fill_param_3];
	ld.param.u64 	%rd5, [gated_fill_param_4];
	cvta.to.global.u64 	%rd1, %rd6;
	mov.u32 	%r8, %tid.x;
	setp.ne.s32 	%p1, %r8, 0;
	@%p1 bra 	$L__BB0_5;

	mov.u64 	%rd7, %clock64;

$L__BB0_2:
	ld.volatile.global.u32 	%r6, [%rd1];
	setp.ne.s32 	%p2, %r6, 0;
	@%p2 bra 	$L__BB0_5;

	mov.u64 	%rd8, %clock64;
	sub.s64 	%rd9, %rd8, %rd7;
	setp.le.u64 	%p3, %rd9, %rd5;
	@%p3 bra 	$L__BB0_2;

	mov.u32 	%r7, 1;
	st.volatile.global.u32 	[%rd1+4], %r7;

$L__BB0_5:
	bar.sync 	0;
	setp.ge.u32 	%p4, %r8, %r5;
	@%p4 bra 	$L__BB0_8;

	mov.u32 	%r2, %ntid.x;
	cvta.to.global.u64 	%rd3, %rd4;

$L__BB0_7:
	mul.wide.u32 	%rd10, %r8, 4;
	add.s64 	%rd11, %rd3, %rd10;
	st.global.f32 	[%rd11], %f1;
	add.s32 	%r8, %r8, %r2;
	setp.lt.u32 	%p5, %r8, %r5;
	@%p5 bra 	$L__BB0_7;

$L__BB0_8:
	ret;

}
	// .globl	fill
.visible .entry fill(
	.param .u64 fill_param_0,
	.param .u32 fill_param_1,
	.param .f32 fill_param_2
)
{
	.reg .pred 	%p<2>;
	.reg .f32 	%f<2>;
	.reg .b32 	%r<6>;
	.reg .b64 	%rd<5>;


	ld.param.u64 	%rd1, [fill_param_0];
	ld.param.u32 	%r2, [fill_param_1];
	ld.param.f32 	%f1, [fill_param_2];
	mov.u32 	%r3, %ctaid.x;
	mov.u32 	%r4, %ntid.x;
	mov.u32 	%r5, %tid.x;
	mad.lo.s32 	%r1, %r3, %r4, %r5;
	setp.ge.u32 	%p1, %r1, %r2;
	@%p1 bra 	$L__BB1_2;

	cvta.to.global.u64 	%rd2, %rd1;
	mul.wide.u32 	%rd3, %r1, 4;
	add.s64 	%rd4, %rd2, %rd3;
	st.global.f32 	[%rd4], %f1;

$L__BB1_2:
	ret;

}
"#;

/// Spin cap for gated kernels: about 10 s at 2 GHz.
const MAX_SPIN_CYCLES: u64 = 20_000_000_000;

/// Elements written by the gated and plain fills (4 MiB of f32: the large pool).
const N: usize = 1 << 20;

/// The GPU tests run one at a time (whatever `--test-threads` says): they read free-memory
/// figures and synchronise the whole context, which other tests' work would disturb.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The GPU (and the lock that makes this test the only one using it), or `None` after printing
/// why the test is skipped.
fn gpu() -> Option<(MutexGuard<'static, ()>, Arc<CudaDevice>)> {
    if let Some(reason) = CudaDevice::unavailable_reason() {
        println!("skipping: {reason}");
        return None;
    }
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let dev = CudaDevice::new(0).expect("a GPU is present, so CudaDevice::new(0) must succeed");
    Some((guard, dev))
}

struct Kernels {
    gated_fill: CudaFunction,
    fill: CudaFunction,
}

fn kernels(dev: &CudaDevice) -> Kernels {
    let module = dev.context().load_module(Ptx::from_src(KERNELS_PTX)).expect("load PTX");
    Kernels {
        gated_fill: module.load_function("gated_fill").expect("gated_fill"),
        fill: module.load_function("fill").expect("fill"),
    }
}

/// A gate: two u32 in device memory, zeroed and ready before this returns.
/// `gate[0]` opens it; `gate[1]` is set by a kernel whose spin hit the cap.
fn closed_gate(alloc: &Allocator<CudaDevice>, stream: StreamId) -> CudaBuffer<u32> {
    let gate = CudaBuffer::<u32>::alloc_zeros(alloc, 2, stream).unwrap();
    gate.cuda_stream().synchronize().unwrap();
    gate
}

/// Opens the gate from `stream` (a one-byte memset, in that stream's order).
fn open_gate(gate: &CudaBuffer<u32>, stream: &CudaStream) {
    stream.context().bind_to_thread().unwrap();
    // SAFETY: the first byte of the gate's own live memory; the stream is alive.
    unsafe { result::memset_d8_async(gate.cu_device_ptr(), 1, 1, stream.cu_stream()) }.unwrap();
}

/// Asserts no gated kernel ran into the spin cap (which would make its "gate" claims void).
fn assert_no_timeout(gate: &CudaBuffer<u32>) {
    let g = gate.cuda_stream().clone_dtoh(gate).unwrap();
    assert_eq!(g[1], 0, "a gated kernel hit its spin cap: the gate never opened");
}

/// Launches `gated_fill(out, value)` on `stream`: one block, so the memset that opens the gate
/// always finds room to run beside it.
fn launch_gated(
    k: &Kernels,
    stream: &CudaStream,
    out: &CudaBuffer<f32>,
    value: f32,
    gate: &CudaBuffer<u32>,
) {
    let n = out.len() as u32;
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut b = stream.launch_builder(&k.gated_fill);
    b.arg(out).arg(&n).arg(&value).arg(gate).arg(&MAX_SPIN_CYCLES);
    // SAFETY: the argument list matches `gated_fill`'s signature; `out` has `n` elements.
    unsafe { b.launch(cfg) }.unwrap();
}

/// Launches `fill(out, value)` on `stream`.
fn launch_fill(k: &Kernels, stream: &CudaStream, out: &mut CudaBuffer<f32>, value: f32) {
    let n = out.len() as u32;
    let mut b = stream.launch_builder(&k.fill);
    b.arg(&mut *out).arg(&n).arg(&value);
    // SAFETY: the argument list matches `fill`'s signature; `out` has `n` elements.
    unsafe { b.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
}

// ---------------------------------------------------------------- always run (no GPU needed)

#[test]
fn new_errs_cleanly_without_a_driver() {
    if CudaDevice::driver_present() {
        println!("a CUDA driver is present: checking only the missing-ordinal error");
    } else {
        let err = CudaDevice::new(0).expect_err("no driver, so no device");
        assert_eq!(err, DeviceError::Unavailable(NO_DRIVER.into()));
        assert!(err.to_string().contains("no CUDA driver (libcuda not found)"), "{err}");
        assert_eq!(CudaDevice::unavailable_reason().as_deref(), Some(NO_DRIVER));
        assert!(CudaDevice::device_count().is_err());
    }
    // A device that cannot exist is an error on every machine.
    assert!(matches!(CudaDevice::new(1 << 20), Err(DeviceError::Unavailable(_))));
}

// ---------------------------------------------------------------- GPU tier

#[test]
fn reserve_release_mem_info_round_trip() {
    let Some((_gpu, dev)) = gpu() else { return };
    let before = dev.mem_info().unwrap();
    assert!(before.total > 0 && before.free <= before.total, "{before:?}");

    let bytes = 64u64 << 20;
    let p = dev.reserve(bytes).unwrap();
    assert!(p.0 % 512 == 0, "{p} is not 512-byte aligned");
    assert_eq!(dev.live_segments(), vec![(p, bytes)]);
    let during = dev.mem_info().unwrap();
    assert!(before.free.saturating_sub(during.free) >= bytes, "{before:?} -> {during:?}");

    // It is real memory: bytes written come back.
    let data: Vec<u8> = (0..bytes as usize).map(|i| (i % 251) as u8).collect();
    let mut back = vec![0u8; bytes as usize];
    dev.context().bind_to_thread().unwrap();
    // SAFETY: `p` is a live segment of `bytes` bytes; no device work touches it.
    unsafe {
        result::memcpy_htod_sync(p.0, &data).unwrap();
        result::memcpy_dtoh_sync(&mut back, p.0).unwrap();
    }
    assert!(back == data, "device memory did not round-trip");

    dev.release(p).unwrap();
    assert!(dev.live_segments().is_empty());
    assert_eq!(dev.reserved_bytes(), 0);
    let after = dev.mem_info().unwrap();
    assert!(after.free.saturating_sub(during.free) >= bytes, "{during:?} -> {after:?}");
    assert_eq!(dev.release(p), Err(DeviceError::UnknownSegment(p)));

    // The driver's out-of-memory answer is the trait's OutOfMemory.
    let too_big = before.total * 2;
    assert_eq!(dev.reserve(too_big), Err(DeviceError::OutOfMemory { requested: too_big }));
    // A stream the application made with cudarc is adopted once, and let go of on release.
    let own = dev.context().new_stream().unwrap();
    let adopted = dev.adopt_stream(&own).unwrap();
    assert_eq!(dev.adopt_stream(&own), Ok(adopted), "adopting again answers the same id");
    assert!(dev.is_adopted(adopted));
    assert_eq!(dev.stream_id(&own), Some(adopted));
    dev.destroy_stream(adopted).unwrap();
    assert!(!dev.is_adopted(adopted));
    assert_eq!(dev.stream(adopted).err(), Some(DeviceError::UnknownStream(adopted)));
    // Streams: the default one exists, created ones map to cudarc streams, destroyed ones go.
    assert_eq!(dev.stream(StreamId::DEFAULT).unwrap().cu_stream(), std::ptr::null_mut());
    let s = dev.create_stream().unwrap();
    let cs = dev.stream(s).unwrap();
    assert_eq!(dev.stream_id(&cs), Some(s));
    dev.destroy_stream(s).unwrap();
    assert_eq!(dev.stream(s).err(), Some(DeviceError::UnknownStream(s)));
    assert!(dev.destroy_stream(StreamId::DEFAULT).is_err());
}

#[test]
fn events_query_false_then_true_around_a_gated_kernel() {
    let Some((_gpu, dev)) = gpu() else { return };
    let k = kernels(&dev);
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let (a, b, c) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (sa, sb, sc) = (dev.stream(a).unwrap(), dev.stream(b).unwrap(), dev.stream(c).unwrap());
    let gate = closed_gate(&alloc, c);

    // A never-recorded event is complete.
    let ev = dev.create_event().unwrap();
    assert_eq!(dev.query_event(ev), Ok(true));

    // SAFETY: f32 has no invalid bit patterns.
    let mut out = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, a) }.unwrap();
    launch_gated(&k, &sa, &out, 1.0, &gate);
    dev.record_event(ev, a).unwrap();
    // The gate is closed, so A's kernel cannot have finished: NOT_READY is Ok(false).
    assert_eq!(dev.query_event(ev), Ok(false));

    // B waits for the event on the device, then overwrites: B's fill must land after A's.
    dev.wait_event(b, ev).unwrap();
    alloc.record_stream(out.buffer(), b).unwrap();
    launch_fill(&k, &sb, &mut out, 2.0);
    assert_eq!(dev.query_event(ev), Ok(false));

    open_gate(&gate, &sc);
    dev.synchronize_event(ev).unwrap();
    assert_eq!(dev.query_event(ev), Ok(true));
    dev.synchronize().unwrap();
    assert_no_timeout(&gate);
    let host = sa.clone_dtoh(&out).unwrap();
    assert!(host.iter().all(|&v| v == 2.0), "B's fill did not wait for A's event");

    // A destroyed event's handle is pooled; the event that reuses it starts complete.
    dev.destroy_event(ev).unwrap();
    let ev2 = dev.create_event().unwrap();
    assert_eq!(dev.query_event(ev2), Ok(true));
    assert_eq!(dev.query_event(ev), Err(DeviceError::UnknownEvent(ev)));
    dev.destroy_event(ev2).unwrap();
}

/// One run of the hold-the-stream scenario: `x` is owned by stream B; a gated kernel on stream A
/// writes 1.0 into it; `x` is freed while that kernel still waits; `y` (same size) is allocated
/// on B and filled with 2.0 on B; then the gate opens. Returns (y took x's block, y's values).
fn hold_the_stream(dev: &Arc<CudaDevice>, config: Config, record: bool) -> (bool, Vec<f32>) {
    let k = kernels(dev);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    let (a, b, c) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (sa, sb, sc) = (dev.stream(a).unwrap(), dev.stream(b).unwrap(), dev.stream(c).unwrap());
    let gate = closed_gate(&alloc, c);

    // SAFETY: f32 has no invalid bit patterns.
    let x = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, b) }.unwrap();
    let x_ptr = x.cu_device_ptr();
    launch_gated(&k, &sa, &x, 1.0, &gate);
    if record {
        alloc.record_stream(x.buffer(), a).unwrap();
    }
    drop(x);
    // SAFETY: as for x.
    let mut y = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, b) }.unwrap();
    let same_block = y.cu_device_ptr() == x_ptr;
    launch_fill(&k, &sb, &mut y, 2.0);
    sb.synchronize().unwrap(); // B's fill is done before A's gated write can start
    open_gate(&gate, &sc);
    dev.synchronize().unwrap();
    assert_no_timeout(&gate);
    let values = sb.clone_dtoh(&y).unwrap();

    drop((y, gate));
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty(), "leaked: {:?}", dev.live_segments());
    for s in [a, b, c] {
        dev.destroy_stream(s).unwrap();
    }
    (same_block, values)
}

#[test]
fn record_stream_holds_the_block_until_the_other_stream_is_done() {
    let Some((_gpu, dev)) = gpu() else { return };
    let expandable = [false, dev.supports_virtual_memory()];
    for (policy, expandable) in [CrossStream::Strict, CrossStream::WaitEvent]
        .into_iter()
        .flat_map(|p| expandable.into_iter().map(move |e| (p, e)))
    {
        let config =
            Config::default().with_cross_stream(policy).with_expandable_segments(expandable);
        // Control: without record_stream the block is reused at once on B, and A's late write
        // lands in y. This is the hazard, made visible, so the test below can see it.
        let (same, values) = hold_the_stream(&dev, config.clone(), false);
        assert!(same, "{policy:?}: without record_stream y reuses x's block at once");
        assert!(values.iter().all(|&v| v == 1.0), "{policy:?}: A's late write lands in y");
        // With record_stream the block waits for A: y gets other memory and keeps B's values.
        let (same, values) = hold_the_stream(&dev, config, true);
        assert!(!same, "{policy:?}: x's block was handed out while A still used it");
        assert!(values.iter().all(|&v| v == 2.0), "{policy:?}: y was clobbered");
    }
}

/// cudarc's contract through `CudaBuffer`: a copy on another stream (`memcpy_dtod`, via
/// `DevicePtr`) waits for the owner's write, and its read is recorded, so the block is not
/// reused while the copy is pending (issue 14, finding 5).
#[test]
fn cudarc_copies_on_another_stream_wait_for_the_owner_and_hold_the_block() {
    let Some((_gpu, dev)) = gpu() else { return };
    let k = kernels(&dev);
    for policy in [CrossStream::Strict, CrossStream::WaitEvent] {
        let config = Config::default().with_cross_stream(policy);
        let alloc = Allocator::new(dev.clone(), config).unwrap();
        let (a, b, c) = (
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
        );
        let (sa, sb, sc) = (dev.stream(a).unwrap(), dev.stream(b).unwrap(), dev.stream(c).unwrap());
        let gate = closed_gate(&alloc, c);
        // SAFETY: f32 has no invalid bit patterns.
        let x = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, a) }.unwrap();
        let x_ptr = x.cu_device_ptr();
        launch_gated(&k, &sa, &x, 1.0, &gate); // A writes 1.0 once the gate opens
        // SAFETY: as for x; y is written by the copy before it is read.
        let mut y = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, b) }.unwrap();
        sb.memcpy_dtod(&x, &mut y).unwrap(); // B waits for A's write
        drop(x); // B's copy is still pending (it waits for A, which waits for the gate)
        // SAFETY: as for x.
        let z = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, a) }.unwrap();
        assert_ne!(z.cu_device_ptr(), x_ptr, "{policy:?}: x's block reused under B's copy");
        open_gate(&gate, &sc);
        dev.synchronize().unwrap();
        assert_no_timeout(&gate);
        let host = sb.clone_dtoh(&y).unwrap();
        assert!(host.iter().all(|&v| v == 1.0), "{policy:?}: B copied before A's write");
        drop((y, z, gate));
        alloc.empty_cache().unwrap();
        for s in [a, b, c] {
            dev.destroy_stream(s).unwrap();
        }
    }
}

/// A cudarc read on a stream of another GPU's context (`clone_dtoh` on GPU 1 of a buffer on
/// GPU 0) takes the host-wait fallback (this device knows no such stream): it waits for the
/// buffer's pending write on its own GPU. The fallback synchronised the using stream's context,
/// the other GPU's, which has none of the buffer's work: the copy read the buffer before the
/// gated kernel wrote it. (`memcpy_dtod` across contexts does not come here: cudarc asks for
/// the source on its own stream and orders the copy itself.) Needs two GPUs (skips with fewer).
#[test]
fn a_copy_on_another_gpus_stream_waits_for_the_buffers_write() {
    let Some((_gpu, dev)) = gpu() else { return };
    if !CudaDevice::device_count().is_ok_and(|n| n >= 2) {
        println!("skipping: fewer than two GPUs");
        return;
    }
    let peer = CudaDevice::new(1).expect("a second GPU is present");
    let k = kernels(&dev);
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let (a, c) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (sa, sc) = (dev.stream(a).unwrap(), dev.stream(c).unwrap());
    let gate = closed_gate(&alloc, c);
    let x = CudaBuffer::<f32>::alloc_zeros(&alloc, N, a).unwrap();
    launch_gated(&k, &sa, &x, 1.0, &gate); // A writes 1.0 once the gate opens
    let s1 = peer.context().new_stream().unwrap();
    // The gate opens from another thread after the copy was asked for: a copy that does not
    // wait for A's write reads x's zeros (the waiting one blocks until the gate opens).
    let host = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(200));
            open_gate(&gate, &sc);
        });
        s1.clone_dtoh(&x).unwrap()
    });
    dev.synchronize().unwrap();
    assert_no_timeout(&gate);
    assert!(host.iter().all(|&v| v == 1.0), "the copy on GPU 1 read x before A's write");
    peer.context().check_err().unwrap();
    drop((x, gate));
    alloc.empty_cache().unwrap();
    for s in [a, c] {
        dev.destroy_stream(s).unwrap();
    }
    assert!(dev.live_segments().is_empty(), "leaked: {:?}", dev.live_segments());
}

/// Stream ids come from one sequence for every `CudaDevice` of the process: a stream made by
/// another handle (here a second handle of GPU 0; another GPU's alike) is unknown to this
/// device's allocator, an `UnknownStream` error, not this device's stream of the same number.
/// Broken build `stream_ids_per_device`: both handles' first streams are stream 1, and the
/// allocator takes the other's for its own.
#[test]
fn a_stream_of_another_cuda_device_handle_is_unknown_here() {
    let Some((_gpu, dev)) = gpu() else { return };
    let other = CudaDevice::new(0).expect("a second handle of GPU 0");
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let theirs = other.create_stream().unwrap();
    let mine = dev.create_stream().unwrap();
    assert_ne!(mine, theirs);
    assert!(dev.stream(theirs).is_err(), "{theirs:?} is another handle's");
    let e = alloc.alloc(4096, theirs).unwrap_err();
    assert!(matches!(e, AllocError::UnknownStream(s) if s == theirs), "{e}");
    let b = alloc.alloc(4096, mine).unwrap();
    assert!(matches!(b.record_stream(theirs), Err(AllocError::UnknownStream(_))));
    drop(b);
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty(), "leaked: {:?}", dev.live_segments());
    other.destroy_stream(theirs).unwrap();
    dev.destroy_stream(mine).unwrap();
}

#[test]
fn allocator_over_cuda_device_alloc_free_empty_cache_without_leaks() {
    let Some((_gpu, dev)) = gpu() else { return };
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let sizes = [1u64, 512, 4096, 1 << 20, (1 << 20) + 1, 5 << 20, 12 << 20, 64 << 20];
    let mut device_allocs = 0;
    for round in 0..3 {
        let bufs: Vec<_> =
            sizes.iter().map(|&n| alloc.alloc(n, StreamId::DEFAULT).unwrap()).collect();
        for (b, &n) in bufs.iter().zip(&sizes) {
            assert_eq!(b.len(), n);
            assert!(b.ptr().0 % 512 == 0);
        }
        alloc.check_invariants().unwrap();
        drop(bufs);
        let stats = alloc.stats();
        if round == 0 {
            device_allocs = stats.num_device_alloc;
        } else {
            assert_eq!(stats.num_device_alloc, device_allocs, "round {round} missed the cache");
        }
    }

    // Typed data survives a trip through cached memory.
    let stream = dev.stream(StreamId::DEFAULT).unwrap();
    let data: Vec<u32> = (0..(3 << 20)).collect();
    // SAFETY: u32 has no invalid bit patterns (and it is written before it is read).
    let mut t = unsafe { CudaBuffer::<u32>::alloc(&alloc, data.len(), StreamId::DEFAULT) }.unwrap();
    stream.memcpy_htod(&data, &mut t).unwrap();
    assert!(stream.clone_dtoh(&t).unwrap() == data);
    drop(t);

    // Frees and releases from a thread that never bound the context.
    let a2 = alloc.clone();
    std::thread::spawn(move || {
        let b = a2.alloc(8 << 20, StreamId::DEFAULT).unwrap();
        drop(b);
        a2.empty_cache().unwrap();
    })
    .join()
    .unwrap();

    // An impossible request is an OOM report, and the allocator stays usable.
    let total = dev.mem_info().unwrap().total;
    match alloc.alloc(total + (1 << 30), StreamId::DEFAULT) {
        Err(AllocError::OutOfMemory(report)) => assert_eq!(report.requested, total + (1 << 30)),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    drop(alloc.alloc(1 << 20, StreamId::DEFAULT).unwrap());

    alloc.empty_cache().unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.num_device_free, stats.num_device_alloc);
    assert_eq!(alloc.reserved_bytes(), 0);
    assert!(dev.live_segments().is_empty(), "leaked: {:?}", dev.live_segments());
}

#[test]
fn expandable_segments_over_cuda_device() {
    let Some((_gpu, dev)) = gpu() else { return };
    if !dev.supports_virtual_memory() {
        println!("skipping: the device has no virtual memory management");
        return;
    }
    let page = dev.vm_granularity().unwrap();
    let k = kernels(&dev);
    let config = Config::default().with_expandable_segments(true);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    let free_before = dev.mem_info().unwrap().free;

    // Data survives a buffer over five pages, each its own physical allocation.
    let stream = dev.stream(StreamId::DEFAULT).unwrap();
    let data: Vec<u32> = (0..(5 * page / 4) as u32).collect();
    // SAFETY: u32 has no invalid bit patterns (and it is written before it is read).
    let mut t = unsafe { CudaBuffer::<u32>::alloc(&alloc, data.len(), StreamId::DEFAULT) }.unwrap();
    stream.memcpy_htod(&data, &mut t).unwrap();
    assert!(stream.clone_dtoh(&t).unwrap() == data);
    let s = alloc.stats();
    assert!(s.expandable_segments);
    assert_eq!(s.blocks.reserved_bytes.all.current, 5 * page);
    assert_eq!((s.num_device_map, s.num_physical_create, s.num_device_alloc), (5, 5, 0));
    // The next buffer grows the range right after the first.
    let u = alloc.alloc(page, StreamId::DEFAULT).unwrap();
    assert_eq!(u.ptr().0, t.cu_device_ptr() + 5 * page);
    assert!(dev.mem_info().unwrap().free <= free_before - 6 * page);
    alloc.check_invariants().unwrap();

    // A kernel still writing a freed buffer: empty_cache waits for it before unmapping.
    let side = dev.create_stream().unwrap();
    let gate = closed_gate(&alloc, side);
    // SAFETY: f32 has no invalid bit patterns.
    let x = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, StreamId::DEFAULT) }.unwrap();
    launch_gated(&k, &stream, &x, 3.0, &gate);
    drop(x);
    drop((t, u));
    let opener = {
        let sc = dev.stream(side).unwrap();
        let g = gate.cu_device_ptr();
        std::thread::spawn(move || {
            // Only speeds the test up: correctness never depends on when the gate opens.
            std::thread::sleep(std::time::Duration::from_millis(100));
            sc.context().bind_to_thread().unwrap();
            // SAFETY: the first byte of the gate's live memory (freed only after the join).
            unsafe { result::memset_d8_async(g, 1, 1, sc.cu_stream()) }.unwrap();
        })
    };
    alloc.empty_cache().unwrap();
    opener.join().unwrap();
    dev.synchronize().expect("no kernel touched unmapped memory");
    assert_no_timeout(&gate);
    let s = alloc.stats();
    assert!(s.num_device_unmap >= 6, "{s:?}");
    assert!(s.num_host_syncs >= 1);
    drop(gate);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    drop(alloc);
    dev.destroy_stream(side).unwrap();
    assert!(dev.live_segments().is_empty());
}

/// Pinned host memory on the GPU: `cuMemHostAlloc` blocks cached by size class; an upload held
/// behind a gated kernel keeps its block from being reused until its event completed; the bytes
/// arrive in stream order; `empty_cache` returns every block with `cuMemFreeHost`.
#[test]
fn pinned_host_blocks_wait_for_their_copies_before_reuse() {
    let Some((_gpu, dev)) = gpu() else { return };
    let k = kernels(&dev);
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pinned = tidepool::HostAllocator::new(dev.clone());
    let (a, c) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (sa, sc) = (dev.stream(a).unwrap(), dev.stream(c).unwrap());
    let gate = closed_gate(&alloc, c);
    // SAFETY: f32 has no invalid bit patterns.
    let out = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, a) }.unwrap();
    let bytes = (N * 4) as u64;

    launch_gated(&k, &sa, &out, 1.0, &gate);
    let mut up = pinned.alloc(bytes).unwrap();
    for chunk in up.as_mut_slice().unwrap().chunks_exact_mut(4) {
        chunk.copy_from_slice(&2.0f32.to_le_bytes());
    }
    up.upload(out.buffer()).unwrap();
    assert!(!up.is_ready().unwrap(), "the upload waits behind the gated kernel");
    let first = up.host_ptr();
    drop(up);
    let second = pinned.alloc(bytes).unwrap();
    assert_ne!(second.host_ptr(), first, "a pending block is not handed out");
    assert_eq!(pinned.stats().pending_bytes, bytes);

    open_gate(&gate, &sc);
    dev.synchronize().unwrap();
    assert_no_timeout(&gate);
    let host = sa.clone_dtoh(&out).unwrap();
    assert!(host.iter().all(|&v| v == 2.0), "the upload ran after the gated fill");

    drop(second);
    let third = pinned.alloc(bytes).unwrap();
    let fourth = pinned.alloc(bytes).unwrap();
    let mut got = [third.host_ptr().addr(), fourth.host_ptr().addr()];
    got.sort();
    assert!(got.contains(&first.addr()), "the completed block is reused");
    assert_eq!(pinned.stats().num_host_alloc, 2);
    drop((third, fourth));

    let mut back = pinned.alloc(bytes).unwrap();
    back.download(out.buffer()).unwrap();
    assert!(back.as_slice().unwrap().chunks_exact(4).all(|c| c == 2.0f32.to_le_bytes()));
    drop(back);
    pinned.check_invariants().unwrap();
    pinned.empty_cache().unwrap();
    assert_eq!(pinned.stats().reserved_bytes.current, 0);
    assert!(dev.live_host_allocations().is_empty());
}

/// A pinned upload captured into a CUDA graph (`cuMemcpyHtoDAsync` on a capturing stream is a
/// node of the graph): each replay copies the staging buffer again, so the buffer gives no
/// slice afterwards and, dropped, its block is never handed out again nor freed
/// (`captured_bytes`), as PyTorch keeps pinned memory used in a capture.
#[test]
fn a_captured_pinned_upload_keeps_its_block_for_good() {
    let Some((_gpu, dev)) = gpu() else { return };
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pinned = tidepool::HostAllocator::new(dev.clone());
    let s = dev.create_stream().unwrap();
    let ss = dev.stream(s).unwrap();
    // SAFETY: f32 has no invalid bit patterns; the upload writes every element before a read.
    let out = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, s) }.unwrap();
    let bytes = (N * 4) as u64;
    let mut staging = pinned.alloc(bytes).unwrap();
    for chunk in staging.as_mut_slice().unwrap().chunks_exact_mut(4) {
        chunk.copy_from_slice(&5.0f32.to_le_bytes());
    }
    alloc.begin_capture(s, None).unwrap();
    staging.upload(out.buffer()).unwrap();
    assert!(matches!(staging.as_slice(), Err(tidepool::HostAllocError::Captured { .. })));
    let first = staging.host_ptr();
    drop(staging);
    let graph = alloc.end_capture(s).unwrap();
    for _ in 0..3 {
        graph.launch(s).unwrap();
        assert!(ss.clone_dtoh(&out).unwrap().iter().all(|&v| v == 5.0));
    }
    dev.synchronize().unwrap();
    let next = pinned.alloc(bytes).unwrap();
    assert_ne!(next.host_ptr(), first, "the graph's staging block is not handed out again");
    assert_eq!(pinned.stats().captured_bytes, bytes);
    drop((next, graph, out));
    pinned.empty_cache().unwrap();
    assert_eq!(pinned.stats().reserved_bytes.current, bytes, "kept for good");
    pinned.check_invariants().unwrap();
}

/// Private pools on the GPU: a guard routes a stream's allocations (cudarc-visible buffers
/// included) to the pool's own segments, with the pool's own statistics; the pool's memory goes
/// back with its last buffer.
#[test]
fn private_pool_routes_a_stream_and_frees_as_a_whole() {
    let Some((_gpu, dev)) = gpu() else { return };
    let k = kernels(&dev);
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let s = dev.create_stream().unwrap();
    let cs = dev.stream(s).unwrap();
    let pool = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
    let guard = alloc.use_pool(&pool, s).unwrap();
    let mut x = CudaBuffer::<f32>::alloc_zeros(&alloc, N, s).unwrap();
    drop(guard);
    let general = alloc.alloc(4096, s).unwrap();
    assert_eq!(pool.stats().blocks.allocated_bytes.all.current, (N * 4) as u64);
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 4096);
    launch_fill(&k, &cs, &mut x, 5.0);
    assert!(cs.clone_dtoh(&x).unwrap().iter().all(|&v| v == 5.0));
    let segments = dev.live_segments().len();
    drop(pool);
    assert_eq!(dev.live_segments().len(), segments, "a live buffer keeps the pool's segment");
    drop(x);
    assert_eq!(dev.live_segments().len(), segments - 1);
    drop(general);
    alloc.empty_cache().unwrap();
    drop(alloc);
    dev.destroy_stream(s).unwrap();
    assert!(dev.live_segments().is_empty(), "leaked: {:?}", dev.live_segments());
}

/// Two streams of a GPU and an allocator over it, for captures that fork the second stream.
struct TwoStreams {
    dev: Arc<CudaDevice>,
    k: Kernels,
    alloc: Allocator<CudaDevice>,
    s: StreamId,
    t: StreamId,
    cs: Arc<CudaStream>,
    ct: Arc<CudaStream>,
}

impl TwoStreams {
    fn new(dev: Arc<CudaDevice>, config: Config) -> TwoStreams {
        let k = kernels(&dev);
        let alloc = Allocator::new(dev.clone(), config).unwrap();
        let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let (cs, ct) = (dev.stream(s).unwrap(), dev.stream(t).unwrap());
        TwoStreams { dev, k, alloc, s, t, cs, ct }
    }

    /// `to` waits for the work enqueued on `from` so far (inside a capture: a fork or a join).
    fn wait(&self, to: StreamId, from: StreamId) {
        let e = self.dev.create_event().unwrap();
        self.dev.record_event(e, from).unwrap();
        self.dev.wait_event(to, e).unwrap();
        self.dev.destroy_event(e).unwrap();
    }

    /// Gives everything back and checks that nothing is left on the device.
    fn finish(self) {
        self.alloc.empty_cache().unwrap();
        drop(self.alloc);
        self.dev.destroy_stream(self.s).unwrap();
        self.dev.destroy_stream(self.t).unwrap();
        assert!(self.dev.live_segments().is_empty(), "leaked: {:?}", self.dev.live_segments());
    }
}

/// A capture that forks a side stream on the GPU (CUDA's fork and join through events): the
/// side stream joins (`capture_of`), allocates from the graph's pool, fills its buffer, and is
/// joined back; the graph then writes both buffers at each replay.
#[test]
fn graph_capture_forks_a_side_stream() {
    let Some((_gpu, dev)) = gpu() else { return };
    let two = TwoStreams::new(dev, Config::default());
    let TwoStreams { dev, k, alloc, s, t, cs, ct } = &two;
    let (s, t) = (*s, *t);
    alloc.begin_capture(s, None).unwrap();
    // SAFETY: f32 has no invalid bit patterns; the captured fills write them before any read.
    let mut a = unsafe { CudaBuffer::<f32>::alloc(alloc, N, s) }.unwrap();
    launch_fill(k, cs, &mut a, 1.0);
    two.wait(t, s); // the fork
    assert_eq!(dev.capture_of(t), Some(s));
    assert!(alloc.is_capturing(t));
    // SAFETY: as above.
    let mut b = unsafe { CudaBuffer::<f32>::alloc(alloc, N, t) }.unwrap();
    launch_fill(k, ct, &mut b, 2.0);
    two.wait(s, t); // the join
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!(dev.capture_of(t), None);
    assert_eq!(graph.pool().stats().blocks.allocated_bytes.all.current, (2 * N * 4) as u64);
    graph.launch(s).unwrap();
    assert!(cs.clone_dtoh(&a).unwrap().iter().all(|&v| v == 1.0));
    assert!(cs.clone_dtoh(&b).unwrap().iter().all(|&v| v == 2.0));
    drop((graph, a, b));
    two.finish();
}

/// CUDA's global capture mode on the GPU: `end_capture` on another thread than the one that
/// began the capture is refused with `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD` and the capture
/// goes on (what SimDevice models and `end_capture` relies on); the beginning thread then ends
/// it and the graph replays.
#[test]
fn graph_capture_ended_on_another_thread_goes_on() {
    let Some((_gpu, dev)) = gpu() else { return };
    let two = TwoStreams::new(dev, Config::default());
    let TwoStreams { k, alloc, s, cs, .. } = &two;
    let s = *s;
    alloc.begin_capture(s, None).unwrap();
    // SAFETY: f32 has no invalid bit patterns; the captured fill writes them before any read.
    let mut a = unsafe { CudaBuffer::<f32>::alloc(alloc, N, s) }.unwrap();
    launch_fill(k, cs, &mut a, 5.0);
    common::end_capture_elsewhere(alloc, s);
    let graph = alloc.end_capture(s).unwrap();
    graph.launch(s).unwrap();
    assert!(cs.clone_dtoh(&a).unwrap().iter().all(|&v| v == 5.0));
    drop((graph, a));
    two.finish();
}

/// `graph_capture_record_stream_reuse` on the GPU: a buffer of the capture's pool filled on a
/// joined side stream (`record_stream`) and freed waits until the side stream is joined back;
/// the next allocation after the join gets its block, and each replay leaves the new value.
#[test]
fn graph_capture_reuses_a_side_streams_block_after_the_join() {
    let Some((_gpu, dev)) = gpu() else { return };
    let config = Config::parse("graph_capture_record_stream_reuse:true").unwrap();
    let two = TwoStreams::new(dev, config);
    let TwoStreams { k, alloc, s, t, cs, ct, .. } = &two;
    let (s, t) = (*s, *t);
    alloc.begin_capture(s, None).unwrap();
    // SAFETY: f32 has no invalid bit patterns; the captured fills write them before any read.
    let mut x = unsafe { CudaBuffer::<f32>::alloc(alloc, N, s) }.unwrap();
    let x_ptr = x.buffer().ptr();
    two.wait(t, s); // t joins
    launch_fill(k, ct, &mut x, 1.0);
    alloc.record_stream(x.buffer(), t).unwrap();
    drop(x);
    // SAFETY: as above.
    let mut y = unsafe { CudaBuffer::<f32>::alloc(alloc, N, s) }.unwrap();
    assert_ne!(y.buffer().ptr(), x_ptr, "t's fill is not ordered before s's later work yet");
    launch_fill(k, cs, &mut y, 2.0);
    two.wait(s, t); // joined back
    // SAFETY: as above.
    let mut z = unsafe { CudaBuffer::<f32>::alloc(alloc, N, s) }.unwrap();
    assert_eq!(z.buffer().ptr(), x_ptr, "after the join, x's block is reused");
    launch_fill(k, cs, &mut z, 3.0);
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!(graph.held_buffers(), 0);
    for _ in 0..10 {
        graph.launch(s).unwrap();
        assert!(cs.clone_dtoh(&z).unwrap().iter().all(|&v| v == 3.0));
        assert!(cs.clone_dtoh(&y).unwrap().iter().all(|&v| v == 2.0));
    }
    drop((graph, y, z));
    two.finish();
}

/// A cudarc copy on a side stream joined to a capture (`memcpy_dtod` through `CudaBuffer`'s
/// `DevicePtr`, which asks the allocator to order the use): ordered inside the capture by an
/// event edge, with no context synchronisation (which a capture forbids); each replay copies.
#[test]
fn graph_capture_orders_a_cudarc_copy_on_a_joined_stream() {
    let Some((_gpu, dev)) = gpu() else { return };
    let two = TwoStreams::new(dev, Config::default());
    let TwoStreams { k, alloc, s, t, cs, ct, .. } = &two;
    let (s, t) = (*s, *t);
    alloc.begin_capture(s, None).unwrap();
    // SAFETY: f32 has no invalid bit patterns; the captured fill and copy write them first.
    let mut a = unsafe { CudaBuffer::<f32>::alloc(alloc, N, s) }.unwrap();
    // SAFETY: as above.
    let mut b = unsafe { CudaBuffer::<f32>::alloc(alloc, N, s) }.unwrap();
    two.wait(t, s);
    launch_fill(k, cs, &mut a, 7.0); // after the fork: the copy must wait for it
    ct.memcpy_dtod(&a, &mut b).unwrap();
    two.wait(s, t); // joined back
    let graph = alloc.end_capture(s).unwrap();
    graph.launch(s).unwrap();
    assert!(cs.clone_dtoh(&b).unwrap().iter().all(|&v| v == 7.0));
    drop((graph, a, b));
    two.finish();
}

/// CUDA graphs on the GPU: a capture whose allocations come from the graph's private pool (one
/// of them freed and reused during the capture), instantiated and replayed 100 times with the
/// general pool used in between; the output is overwritten by each replay.
#[test]
fn graph_capture_replays_from_its_private_pool() {
    let Some((_gpu, dev)) = gpu() else { return };
    let k = kernels(&dev);
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let s = dev.create_stream().unwrap();
    let cs = dev.stream(s).unwrap();
    alloc.begin_capture(s, None).unwrap();
    // SAFETY: f32 has no invalid bit patterns; the captured fill writes it before any read.
    let mut tmp = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, s) }.unwrap();
    launch_fill(&k, &cs, &mut tmp, 1.0);
    let tmp_ptr = tmp.buffer().ptr();
    drop(tmp); // freed during the capture: reused by the capture only
    // SAFETY: as above.
    let mut out = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, s) }.unwrap();
    assert_eq!(out.buffer().ptr(), tmp_ptr, "the capture reuses its own freed block");
    launch_fill(&k, &cs, &mut out, 3.0);
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!(graph.pool().stats().blocks.allocated_bytes.all.current, (N * 4) as u64);
    for i in 0..100 {
        cs.context().bind_to_thread().unwrap();
        // SAFETY: `out`'s own live memory, on its stream.
        unsafe { result::memset_d8_async(out.cu_device_ptr(), 0, N * 4, cs.cu_stream()) }.unwrap();
        graph.launch(s).unwrap();
        let other = alloc.alloc(1 << 20, s).unwrap();
        assert_ne!(other.ptr(), tmp_ptr);
        drop(other);
        assert!(cs.clone_dtoh(&out).unwrap().iter().all(|&v| v == 3.0), "replay {i}");
    }
    drop(graph);
    drop(out);
    alloc.empty_cache().unwrap();
    drop(alloc);
    dev.destroy_stream(s).unwrap();
    assert!(dev.live_segments().is_empty(), "leaked: {:?}", dev.live_segments());
}

/// New device memory during a capture (CUDA's global mode): the capture's own pool grows
/// (`cuMemAlloc`, or `cuMemCreate` + `cuMemMap` with expandable segments) and another thread
/// allocates a segment of its own meanwhile. CUDA refuses those calls as potentially unsafe
/// in the global mode, from any thread, and invalidates the capture
/// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), unless the calling thread's mode is relaxed for
/// them (what PyTorch's `cudaMallocMaybeCapturing` does).
#[test]
fn graph_capture_survives_new_device_memory_on_any_thread() {
    let Some((_gpu, dev)) = gpu() else { return };
    let k = kernels(&dev);
    for expandable in [false, true] {
        if expandable && !dev.supports_virtual_memory() {
            println!("skipping: the device has no virtual memory management");
            continue;
        }
        let config = Config::default().with_expandable_segments(expandable);
        let alloc = Allocator::new(dev.clone(), config).unwrap();
        let s = dev.create_stream().unwrap();
        let cs = dev.stream(s).unwrap();
        let before = alloc.stats().num_device_alloc;
        alloc.begin_capture(s, None).unwrap();
        // SAFETY: f32 has no invalid bit patterns; the captured fill writes it before any read.
        let mut out = unsafe { CudaBuffer::<f32>::alloc(&alloc, N, s) }.unwrap();
        launch_fill(&k, &cs, &mut out, 2.0);
        let beside = alloc.clone();
        let other = std::thread::spawn(move || beside.alloc(32 << 20, StreamId::DEFAULT).map(drop));
        other.join().unwrap().expect("an allocation beside the capture");
        let graph = alloc.end_capture(s).expect("the capture survived its allocations");
        assert!(alloc.stats().num_device_alloc > before, "{expandable}: no new device memory");
        cs.context().bind_to_thread().unwrap();
        // SAFETY: `out`'s own live memory, on its stream.
        unsafe { result::memset_d8_async(out.cu_device_ptr(), 0, N * 4, cs.cu_stream()) }.unwrap();
        graph.launch(s).unwrap();
        assert!(cs.clone_dtoh(&out).unwrap().iter().all(|&v| v == 2.0), "{expandable}");
        drop((graph, out));
        alloc.empty_cache().unwrap();
        drop(alloc);
        dev.destroy_stream(s).unwrap();
        assert!(dev.live_segments().is_empty(), "leaked: {:?}", dev.live_segments());
    }
}

/// Two `CudaDevice::new(0)` share the device's primary context (`Device::memory_domain`): an
/// allocator over one returns its free cache when an allocator over the other runs out of
/// memory (`src/peers.rs`); without that, the second request would not fit beside the cache.
#[test]
fn allocators_over_two_device_objects_of_one_gpu_help_each_other() {
    let Some((_guard, one)) = gpu() else { return };
    let two = CudaDevice::new(0).expect("a second CudaDevice over GPU 0");
    assert_eq!(one.memory_domain(), two.memory_domain());
    assert!(one.memory_domain().is_some());
    let a = Allocator::new(one.clone(), Config::default()).unwrap();
    let b = Allocator::new(two.clone(), Config::default()).unwrap();
    let free = one.mem_info().unwrap().free;
    let big = (free / 10 * 6) & !((2 << 20) - 1); // 60 % of what is free, in 2 MiB pages
    drop(a.alloc(big, StreamId::DEFAULT).unwrap()); // cached by `a`
    let got = b.alloc(big, StreamId::DEFAULT).unwrap();
    assert_eq!(a.stats().blocks.reserved_bytes.all.current, 0, "`a` returned its cache");
    assert_eq!(b.stats().num_ooms, 0, "rescued: no failure");
    drop(got);
    drop((a, b));
}

/// A zero-sized element type, which `CudaBuffer::from_buffer` refuses.
#[derive(Clone, Copy)]
struct Nothing;
// SAFETY: no bytes, so any (none) are a valid `Nothing`.
unsafe impl tidepool::cudarc::driver::DeviceRepr for Nothing {}

/// `CudaBuffer::alloc` refuses a zero-sized element type, as `from_buffer`
/// refuses to view a buffer as one and cudarc's `alloc` fails for it: nothing is allocated. It
/// used to hand out `len` elements at address 0 with no memory behind them. Broken build
/// `cuda_buffer_zst_accepted` (caught here on a GPU; the size computation's unit test,
/// `interop::elements::tests::alloc_bytes_refuse_zero_sized_elements`, catches it everywhere).
#[test]
fn cuda_buffer_alloc_refuses_a_zero_sized_element_type() {
    let Some((_gpu, dev)) = gpu() else { return };
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let refused = DeviceError::Unsupported("a buffer of zero-sized elements");
    for len in [1000, 0] {
        // SAFETY: refused before any memory is handed out.
        let r = unsafe { CudaBuffer::<Nothing>::alloc(&alloc, len, StreamId::DEFAULT) };
        assert_eq!(r.unwrap_err(), AllocError::Device(refused.clone()), "{len} elements");
    }
    assert_eq!(alloc.reserved_bytes(), 0, "nothing allocated");
    // A sized type of no elements is an empty buffer.
    let empty = CudaBuffer::<f32>::alloc_zeros(&alloc, 0, StreamId::DEFAULT).unwrap();
    assert!(empty.is_empty());
    drop(empty);
    alloc.check_invariants().unwrap();
}

/// `CudaBuffer::from_buffer` refuses a buffer of 10 bytes as `f32`s, and as a zero-sized type,
/// and gives it back whole each time: the same address, length and stream, still a live
/// allocation, which then views as 10 `u8`s, takes a copy there and back, and is freed by its
/// drop. It used to drop the buffer with the error, so a caller who got the element type wrong
/// lost the allocation. Broken build `from_buffer_drops` (caught here on a GPU; the SimDevice
/// catches it in `interop::elements`'s unit test everywhere).
#[test]
fn from_buffer_gives_a_refused_buffer_back_whole() {
    let Some((_gpu, dev)) = gpu() else { return };
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let s = dev.create_stream().unwrap();
    let live = |alloc: &Allocator<CudaDevice>| alloc.stats().blocks.allocated_bytes.all.current;
    let buf = alloc.alloc(10, s).unwrap();
    let (ptr, held) = (buf.ptr(), live(&alloc));
    assert!(held > 0);

    // SAFETY: refused before any element is read.
    let refused = unsafe { CudaBuffer::<f32>::from_buffer(buf) }.unwrap_err();
    assert_eq!(
        *refused.error(),
        DeviceError::Unsupported("a buffer whose length is not a whole number of elements")
    );
    let source = std::error::Error::source(&refused).expect("the reason is the source");
    assert_eq!(source.downcast_ref::<DeviceError>(), Some(refused.error()));
    let text = refused.to_string();
    assert!(text.contains("10 bytes") && text.contains("`f32` (4 bytes each)"), "{text}");
    assert!(!text.contains(&refused.error().to_string()), "the reason is the source's: {text}");
    assert_eq!((refused.buffer().ptr(), refused.buffer().len()), (ptr, 10));
    let buf = refused.into_buffer();
    assert_eq!((buf.ptr(), buf.len(), buf.stream()), (ptr, 10, s), "given back whole");
    assert_eq!(live(&alloc), held, "still live");

    // SAFETY: refused before any element is read.
    let refused = unsafe { CudaBuffer::<Nothing>::from_buffer(buf) }.unwrap_err();
    assert_eq!(*refused.error(), DeviceError::Unsupported("a buffer of zero-sized elements"));
    let (_, buf) = refused.into_parts();
    assert_eq!((buf.ptr(), buf.len(), buf.stream()), (ptr, 10, s));

    // The buffer given back is usable: as bytes, a copy there and back on its stream.
    // SAFETY: u8 has no invalid bit patterns (and it is written before it is read).
    let mut bytes = unsafe { CudaBuffer::<u8>::from_buffer(buf) }.unwrap();
    assert_eq!((bytes.len(), bytes.cu_device_ptr(), bytes.stream_id()), (10, ptr.0, s));
    let stream = bytes.cuda_stream().clone();
    let data: Vec<u8> = (1..=10).collect();
    stream.memcpy_htod(&data, &mut bytes).unwrap();
    assert_eq!(stream.clone_dtoh(&bytes).unwrap(), data);
    drop(bytes);
    assert_eq!(live(&alloc), 0, "freed by its drop");
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    drop(alloc);
    dev.destroy_stream(s).unwrap();
    assert!(dev.live_segments().is_empty(), "leaked: {:?}", dev.live_segments());
}
