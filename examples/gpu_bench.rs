//! Allocation latency on a real GPU, and a training trace replayed on real device memory.
//!
//! 1. alloc+free pairs, per size: tidepool's cache hit; `cuMemAlloc`/`cuMemFree`;
//!    `cuMemAllocAsync`/`cuMemFreeAsync` on a stream (the driver's own stream-ordered pool).
//! 2. `data/traces/gpt2_train.csv.gz` (gzip CSV `seq,op,id,bytes,stream,tag`, ops
//!    alloc/free/scope_enter/scope_exit) replayed twice through tidepool over `CudaDevice` (cold,
//!    then warm cache), the same again over expandable segments where the device has virtual
//!    memory management, and once through `cuMemAllocAsync`/`cuMemFreeAsync`; figures: ns/op,
//!    peak reserved, peak allocated, fragmentation, device calls (maps and unmaps too), host syncs.
//!
//! Figures go to `$RESULTS_DIR/gpu_bench.json` (default `target/gpu-check/`) and stdout. Without a
//! GPU it prints why it cannot run, writes `{"skipped": reason}` and exits 0.
//!
//! Run: `cargo run --release --example gpu_bench --features cuda [-- TRACE]`.

use flate2::read::GzDecoder;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::time::Instant;
use tidepool::cudarc::driver::{result, sys};
use tidepool::device::Device;
use tidepool::{Allocator, Buffer, Config, CudaDevice, Residency, StreamId};

/// Sizes of the latency loops.
const SIZES: [u64; 3] = [4 << 10, 1 << 20, 16 << 20];
/// Pairs timed for the cached paths (tidepool hit, cuMemAllocAsync).
const CACHED_ITERS: u32 = 100_000;
/// Pairs timed for cuMemAlloc/cuMemFree (each free synchronises the device).
const DRIVER_ITERS: u32 = 1_000;
/// The trace replayed when none is named.
const DEFAULT_TRACE: &str = "data/traces/gpt2_train.csv.gz";

type BoxError = Box<dyn std::error::Error>;

fn main() -> Result<(), BoxError> {
    let dir = PathBuf::from(std::env::var("RESULTS_DIR").unwrap_or("target/gpu-check".into()));
    std::fs::create_dir_all(&dir)?;
    let out = dir.join("gpu_bench.json");
    let results = match CudaDevice::unavailable_reason() {
        Some(reason) => {
            println!("gpu_bench: cannot run here: {reason}");
            json!({ "skipped": reason })
        }
        None => {
            let trace = std::env::args().nth(1).unwrap_or(DEFAULT_TRACE.into());
            run(&trace)?
        }
    };
    std::fs::write(&out, serde_json::to_string_pretty(&results)?)?;
    println!("gpu_bench: results in {}", out.display());
    Ok(())
}

fn run(trace: &str) -> Result<Value, BoxError> {
    let device = CudaDevice::new(0)?;
    println!("gpu_bench on {}", device.name());
    let mut latency = Vec::new();
    for bytes in SIZES {
        let row = json!({
            "bytes": bytes,
            "tidepool_hit_ns": tidepool_hit_ns(&device, bytes)?,
            "cuMemAlloc_cuMemFree_ns": driver_sync_ns(&device, bytes)?,
            "cuMemAllocAsync_cuMemFreeAsync_ns": driver_async_ns(&device, bytes)?,
        });
        println!("alloc+free {row}");
        latency.push(row);
    }
    let ops = read_trace(trace)?;
    let mut replay = json!({ "trace": trace, "events": ops.len() });
    for pass in ["cold", "warm"] {
        // One allocator for both passes: the warm pass starts with the cold pass's cache.
        let r = replay_tidepool(&device, &ops, pass == "warm", false)?;
        println!("replay tidepool {pass}: {r}");
        replay[format!("tidepool_{pass}")] = r;
        if device.supports_virtual_memory() {
            let r = replay_tidepool(&device, &ops, pass == "warm", true)?;
            println!("replay tidepool expandable {pass}: {r}");
            replay[format!("tidepool_expandable_{pass}")] = r;
        }
    }
    let r = replay_async(&device, &ops)?;
    println!("replay cuMemAllocAsync: {r}");
    replay["cuMemAllocAsync"] = r;
    Ok(json!({ "device": device.name(), "alloc_free_latency": latency, "trace_replay": replay }))
}

/// ns per alloc+free pair served from tidepool's cache (after one warm-up pair).
fn tidepool_hit_ns(device: &std::sync::Arc<CudaDevice>, bytes: u64) -> Result<f64, BoxError> {
    let alloc = Allocator::new(device.clone(), Config::default())?;
    drop(alloc.alloc(bytes, StreamId::DEFAULT)?);
    let t = Instant::now();
    for _ in 0..CACHED_ITERS {
        drop(alloc.alloc(bytes, StreamId::DEFAULT)?);
    }
    let ns = t.elapsed().as_nanos() as f64 / f64::from(CACHED_ITERS);
    assert_eq!(alloc.stats().num_device_alloc, 1, "the timed loop must hit the cache");
    alloc.empty_cache()?;
    Ok(ns)
}

/// ns per `cuMemAlloc` + `cuMemFree` pair.
fn driver_sync_ns(device: &CudaDevice, bytes: u64) -> Result<f64, BoxError> {
    device.context().bind_to_thread()?;
    let t = Instant::now();
    for _ in 0..DRIVER_ITERS {
        // SAFETY: a fresh allocation, freed at once, never used.
        unsafe {
            let p = result::malloc_sync(bytes as usize)?;
            result::free_sync(p)?;
        }
    }
    Ok(t.elapsed().as_nanos() as f64 / f64::from(DRIVER_ITERS))
}

/// ns per `cuMemAllocAsync` + `cuMemFreeAsync` pair on a created stream, including the final
/// stream synchronisation.
fn driver_async_ns(device: &CudaDevice, bytes: u64) -> Result<Option<f64>, BoxError> {
    if !device.context().has_async_alloc() {
        return Ok(None);
    }
    let sid = device.create_stream()?;
    let stream = device.stream(sid)?;
    device.context().bind_to_thread()?;
    let s = stream.cu_stream();
    let t = Instant::now();
    for _ in 0..CACHED_ITERS {
        // SAFETY: `s` is a live stream; the memory is allocated and freed on it, never used.
        unsafe {
            let p = result::malloc_async(s, bytes as usize)?;
            result::free_async(p, s)?;
        }
    }
    stream.synchronize()?;
    let ns = t.elapsed().as_nanos() as f64 / f64::from(CACHED_ITERS);
    device.destroy_stream(sid)?;
    Ok(Some(ns))
}

/// One trace event.
enum Op {
    Alloc { id: u64, bytes: u64, stream: u32, persistent: bool },
    Free { id: u64 },
}

/// Reads a (gzip) CSV trace: `seq,op,id,bytes,stream,tag`. Scope markers are skipped (this
/// replay has no scopes); an unknown op is an error.
fn read_trace(path: &str) -> Result<Vec<Op>, BoxError> {
    let file = std::fs::File::open(path).map_err(|e| format!("{path}: {e}"))?;
    let reader: Box<dyn BufRead> = if path.ends_with(".gz") {
        Box::new(BufReader::new(GzDecoder::new(file)))
    } else {
        Box::new(BufReader::new(file))
    };
    let mut ops = Vec::new();
    for (n, line) in reader.lines().enumerate() {
        let line = line?;
        if n == 0 || line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let [_, op, id, bytes, stream, tag] = f[..] else {
            return Err(format!("{path}:{}: expected 6 fields", n + 1).into());
        };
        let id: u64 = id.parse()?;
        match op {
            "alloc" => ops.push(Op::Alloc {
                id,
                bytes: bytes.parse()?,
                stream: stream.parse()?,
                persistent: tag == "param",
            }),
            "free" => ops.push(Op::Free { id }),
            "scope_enter" | "scope_exit" => {}
            other => return Err(format!("{path}:{}: unknown op {other:?}", n + 1).into()),
        }
    }
    Ok(ops)
}

/// Replays `ops` through a tidepool allocator over `device`; with `warm`, a first untimed pass
/// fills the cache; with `expandable`, over expandable segments (virtual memory). Trace stream 0
/// is the default stream, others are created on first use.
fn replay_tidepool(
    device: &std::sync::Arc<CudaDevice>,
    ops: &[Op],
    warm: bool,
    expandable: bool,
) -> Result<Value, BoxError> {
    let config = Config::default().with_expandable_segments(expandable);
    let alloc = Allocator::new(device.clone(), config)?;
    let mut streams: HashMap<u32, StreamId> = HashMap::from([(0, StreamId::DEFAULT)]);
    for s in ops.iter().filter_map(|op| match op {
        Op::Alloc { stream, .. } => Some(*stream),
        Op::Free { .. } => None,
    }) {
        if let std::collections::hash_map::Entry::Vacant(e) = streams.entry(s) {
            e.insert(device.create_stream()?);
        }
    }
    let pass = |alloc: &Allocator<CudaDevice>| -> Result<f64, BoxError> {
        let mut live: HashMap<u64, Buffer<CudaDevice>> = HashMap::new();
        let t = Instant::now();
        for op in ops {
            match *op {
                Op::Alloc { id, bytes, stream, persistent } => {
                    let r = if persistent { Residency::Persistent } else { Residency::Transient };
                    live.insert(id, alloc.alloc_in(bytes, streams[&stream], r)?);
                }
                Op::Free { id } => drop(live.remove(&id)),
            }
        }
        let ns = t.elapsed().as_nanos() as f64 / ops.len().max(1) as f64;
        drop(live);
        Ok(ns)
    };
    if warm {
        pass(&alloc)?;
        alloc.reset_peak_stats();
    }
    let before = alloc.stats();
    let ns = pass(&alloc)?;
    let s = alloc.stats();
    let figures = json!({
        "ns_per_op": ns,
        "peak_reserved_bytes": s.blocks.reserved_bytes.all.peak,
        "peak_allocated_bytes": s.blocks.allocated_bytes.all.peak,
        "fragmentation": s.fragmentation(),
        // Calls made during the timed pass (the counters are cumulative).
        "device_allocs": s.num_device_alloc - before.num_device_alloc,
        "device_frees": s.num_device_free - before.num_device_free,
        "host_syncs": s.num_host_syncs - before.num_host_syncs,
        "device_maps": s.num_device_map - before.num_device_map,
        "device_unmaps": s.num_device_unmap - before.num_device_unmap,
    });
    alloc.synchronize()?;
    alloc.empty_cache()?;
    alloc.release_persistent()?;
    for (&t, &s) in &streams {
        if t != 0 {
            device.destroy_stream(s)?;
        }
    }
    Ok(figures)
}

/// Replays `ops` through the driver's default memory pool (`cuMemAllocAsync`, release threshold
/// raised so the pool caches like tidepool does), all on one created stream.
fn replay_async(device: &CudaDevice, ops: &[Op]) -> Result<Value, BoxError> {
    if !device.context().has_async_alloc() {
        return Ok(json!({ "skipped": "the device has no memory pools" }));
    }
    let sid = device.create_stream()?;
    let stream = device.stream(sid)?;
    device.context().bind_to_thread()?;
    let s = stream.cu_stream();
    // SAFETY: `cu_device` is the context's device; attribute values are the cuuint64_t the
    // driver documents for these two attributes.
    let pool = unsafe { result::device::get_default_mem_pool(device.context().cu_device()) }?;
    let set = |attr, mut v: u64| {
        // SAFETY: see above; `v` lives across the call.
        unsafe { result::mem_pool::set_attribute(pool, attr, (&mut v as *mut u64).cast()) }
    };
    set(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)?;
    set(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
    let mut live: HashMap<u64, sys::CUdeviceptr> = HashMap::new();
    let t = Instant::now();
    for op in ops {
        match *op {
            Op::Alloc { id, bytes, .. } => {
                // SAFETY: `s` is live; the memory is only freed below, on the same stream.
                let p = unsafe { result::malloc_async(s, bytes.max(1) as usize) }?;
                live.insert(id, p);
            }
            Op::Free { id } => {
                if let Some(p) = live.remove(&id) {
                    // SAFETY: allocated on `s` above and freed once.
                    unsafe { result::free_async(p, s) }?;
                }
            }
        }
    }
    stream.synchronize()?;
    let ns = t.elapsed().as_nanos() as f64 / ops.len().max(1) as f64;
    for (_, p) in live.drain() {
        // SAFETY: allocated on `s`, still live, freed once.
        unsafe { result::free_async(p, s) }?;
    }
    stream.synchronize()?;
    let mut high = 0u64;
    // SAFETY: RESERVED_MEM_HIGH is a cuuint64_t; `high` is a valid place for it.
    unsafe {
        result::mem_pool::get_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            (&mut high as *mut u64).cast(),
        )
    }?;
    // Give the pool's memory back and restore the default threshold.
    set(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 0)?;
    // SAFETY: the pool is live; trimming releases only unused memory.
    unsafe { result::mem_pool::trim_to(pool, 0) }?;
    device.destroy_stream(sid)?;
    Ok(json!({ "ns_per_op": ns, "peak_reserved_bytes": high, "note": "one stream for all ops" }))
}
