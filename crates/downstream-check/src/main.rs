//! A user's program: depends on `tidepool` with default features only and goes through the
//! public API a library user reaches for. CI builds and runs it (`.ci/run`); if a re-export is
//! lost or a signature changes, it stops compiling. It exits non-zero if a figure is wrong.

use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use tidepool::device::{Access, AppStream, Kernel, Launch};
use tidepool::{
    AccessKind, Action, AllocError, Allocator, Allocators, BlockState, Buffer, Bytes, Config,
    ConfigError, CrossStream, Device, DeviceAddr, DeviceError, Graph, HistoryOptions,
    HostAllocator, HostStats, MIB, MemPool, MemoryStats, OomReport, PinnedBuffer, PoolGuard,
    PoolOptions, Residency, Scope, ScopedBuffer, SegmentInfo, SimConfig, SimDevice, StreamId,
    TraceEntry,
};

fn check(cond: bool, what: &str) -> Result<(), Box<dyn Error>> {
    if cond { Ok(()) } else { Err(format!("downstream check failed: {what}").into()) }
}

fn main() -> Result<(), Box<dyn Error>> {
    // Configuration: the env-var string and the setters.
    let parsed = Config::parse("max_split_size_mb:64,cross_stream:wait_event")?;
    let built =
        Config::default().with_max_split_size_mb(64).with_cross_stream(CrossStream::WaitEvent);
    check(parsed == built, "Config::parse and the setters agree")?;
    let bad: ConfigError = Config::parse("warp_speed:9").unwrap_err();
    check(bad.to_string().contains("unknown key `warp_speed`"), "unknown keys are named")?;

    // A device and an allocator; Debug on the allocator.
    let device =
        Arc::new(SimDevice::with_config(SimConfig { capacity: 256 * MIB, ..SimConfig::default() }));
    let alloc = Allocator::new(device.clone(), built)?;
    println!("{alloc:?}");

    // Buffers: transient and persistent, freed on drop.
    let weights: Buffer<SimDevice> =
        alloc.alloc_in(8 * MIB, StreamId::DEFAULT, Residency::Persistent)?;
    let act = alloc.alloc(1000, StreamId::DEFAULT)?;
    check(act.block_size() == 1024, "1000 B rounds to 1024 B")?;
    let addr: DeviceAddr = act.ptr();
    drop(act);
    let again = alloc.alloc(1000, StreamId::DEFAULT)?;
    check(again.ptr() == addr, "a same-size re-allocation reuses the block")?;

    // Streams: the allocator's own and an adopted application stream.
    let s = device.create_stream()?;
    let app: AppStream = device.create_app_stream()?;
    let adopted = device.adopt_stream(&app)?;
    let on_app = alloc.alloc(4 * MIB, adopted)?;
    device.launch(adopted, tidepool::device::Kernel::sleep(std::time::Duration::from_millis(1)))?;
    alloc.record_stream(&on_app, s)?;
    drop(on_app);
    alloc.synchronize()?;
    alloc.release_stream(adopted)?;
    device.destroy_app_stream(app)?;

    // Scopes.
    for _ in 0..3 {
        let scope: Scope<'_, SimDevice> = alloc.named_scope("step", StreamId::DEFAULT);
        let x: ScopedBuffer<'_, SimDevice> = scope.alloc(64 * 1024)?;
        drop(x);
    }

    // A private pool routed to a stream, and a CUDA graph captured from its own pool.
    let pool: MemPool<SimDevice> = alloc.new_pool(PoolOptions::default().with_use_on_oom(true))?;
    let guard: PoolGuard<'_, SimDevice> = alloc.use_pool(&pool, s)?;
    let pooled = alloc.alloc(4096, s)?;
    drop(guard);
    check(pool.stats().blocks.allocated_bytes.all.current == 4096, "the pool's own figures")?;
    drop(pooled);
    alloc.begin_capture(s, None)?;
    let out = alloc.alloc(4096, s)?;
    let acc = vec![Access { ptr: out.ptr(), bytes: 0, kind: AccessKind::Write }];
    device.launch(s, Kernel::replayable("noop", acc, |_| {}))?;
    let graph: Graph<SimDevice> = alloc.end_capture(s)?;
    graph.launch(s)?;
    drop((graph, out, pool));

    // Errors: sizes, out of memory (with its report), device errors, source chains.
    match alloc.alloc(u64::MAX, StreamId::DEFAULT) {
        Err(AllocError::InvalidSize { requested }) => check(requested == u64::MAX, "size echoed")?,
        other => return Err(format!("u64::MAX bytes: {other:?}").into()),
    }
    match alloc.alloc(1 << 40, StreamId::DEFAULT) {
        Err(AllocError::OutOfMemory(report)) => {
            let report: &OomReport = &report;
            check(report.requested == 1 << 40, "the report names the request")?;
        }
        other => return Err(format!("1 TiB: {other:?}").into()),
    }
    let device_err: DeviceError = device.destroy_stream(StreamId::DEFAULT).unwrap_err();
    let wrapped = AllocError::from(device_err.clone());
    check(wrapped.source().is_some(), "AllocError::Device has a source")?;
    check(
        wrapped.source().and_then(|s| s.downcast_ref::<DeviceError>()) == Some(&device_err),
        "AllocError::Device's source is the device's error",
    )?;
    check(
        !wrapped.to_string().contains(&device_err.to_string()),
        "AllocError::Device's message leaves the device's error to its source",
    )?;

    // Statistics with PyTorch's names, and the summary.
    let stats: MemoryStats = alloc.stats();
    check(
        stats.blocks.allocated_bytes.all.current
            == weights.block_size() + again.block_size() + stats.plan_region_bytes,
        "allocated bytes: live buffers plus the scope's plan region",
    )?;
    println!("{} reserved", Bytes(alloc.reserved_bytes()));
    println!("{}", alloc.memory_summary());
    drop((weights, again));
    alloc.empty_cache()?;
    alloc.release_persistent()?;
    drop(alloc); // learned plans keep their regions until the allocator goes
    check(device.live_segments().is_empty(), "every segment returned")?;
    check(device.violations().is_empty(), "no stream-order violation")?;
    more_paths()?;
    println!("downstream check: ok");
    Ok(())
}

/// The other paths a user takes: the environment's configuration, PyTorch's flat statistics,
/// snapshots and the memory history, cross-stream use, aligned allocations, the closure form
/// of a capture, out-of-memory observers, pinned host memory and one allocator per device.
fn more_paths() -> Result<(), Box<dyn Error>> {
    let _from_env: Config = Config::from_env()?; // TIDEPOOL_ALLOC_CONF (unset in CI: defaults)
    let device = Arc::new(SimDevice::backed(256 * MIB));
    let alloc = Allocator::new(device.clone(), Config::default())?;
    alloc.set_config(Config::default().with_fast_cache(false))?;

    // History and snapshots.
    alloc.record_history(HistoryOptions::new(1000));
    let buf = alloc.alloc(1000, StreamId::DEFAULT)?;
    let m = alloc.memory_stats();
    check(m["allocated_bytes.all.current"] == 1024, "PyTorch's flat statistics")?;
    let segments: Vec<SegmentInfo> = alloc.snapshot();
    check(segments.len() == 1 && segments[0].size == 2 * MIB, "one small segment")?;
    check(segments[0].blocks[0].state == BlockState::Allocated, "the block is live")?;
    let history: Vec<TraceEntry> = alloc.history();
    let actions: Vec<Action> = history.iter().map(|e| e.action).collect();
    check(actions == [Action::SegmentAlloc, Action::Alloc], "the history's entries")?;
    check(alloc.snapshot_pickle().starts_with(&[0x80, 2]), "a protocol-2 pickle")?;

    // A use on another stream: ordered after the buffer's stream, and held until it is done.
    let side = device.create_stream()?;
    buf.use_on(side, AccessKind::Read)?;
    let aligned = alloc.alloc_aligned(1000, 64 * 1024, StreamId::DEFAULT)?;
    check(aligned.ptr().0 % (64 * 1024) == 0, "an aligned allocation")?;

    // The closure form of a capture.
    let (graph, bytes) = alloc.capture(side, None, || alloc.alloc(4096, side).map(|b| b.len()))?;
    check(
        bytes? == 4096 && graph.pool().stats().blocks.segment.all.current == 1,
        "a graph's own pool",
    )?;
    drop(graph);

    // Out of memory: observers, then the failure callback, then the error.
    let seen = Arc::new(AtomicU32::new(0));
    let s = seen.clone();
    alloc.attach_oom_observer(move |r: &OomReport| {
        s.fetch_add(u32::from(r.requested == 1 << 40), Ordering::Relaxed);
    });
    alloc.set_failure_callback(|_, attempt| attempt < 2);
    check(alloc.alloc(1 << 40, StreamId::DEFAULT).is_err(), "1 TiB refused")?;
    check(seen.load(Ordering::Relaxed) >= 1, "the observer saw the request")?;

    // Pinned host memory: staged uploads and downloads (a backed device copies bytes).
    let pinned: HostAllocator<SimDevice> = HostAllocator::new(device.clone());
    let mut up: PinnedBuffer<SimDevice> = pinned.alloc(1000)?;
    up.as_mut_slice()?.fill(7);
    up.upload(&buf)?;
    let mut down = pinned.alloc(1000)?;
    down.download(&buf)?;
    check(down.as_slice()? == [7u8; 1000].as_slice(), "bytes round-trip through the device")?;
    {
        let scope = alloc.named_scope("staging", StreamId::DEFAULT);
        let act = scope.alloc(1000)?;
        up.upload_scoped(&act)?; // a scope's buffer: the checked copy too
        down.download_scoped(&act)?;
        check(down.as_slice()? == [7u8; 1000].as_slice(), "bytes through a scope's buffer")?;
    }
    drop((up, down));
    let again = pinned.alloc(1000)?; // a cached block: its copies are done
    let host: HostStats = pinned.stats();
    check(host.num_host_alloc == 2, "two blocks made, the third request served from cache")?;
    drop(again);
    drop((buf, aligned));
    alloc.synchronize()?;
    alloc.destroy_stream(side)?;

    // One allocator per device.
    let all = Allocators::sim(2, 64 * MIB, Config::default())?;
    let on1 = all.for_device(1)?.alloc(4096, StreamId::DEFAULT)?;
    check(all.total_stats().blocks.allocated_bytes.all.current == 4096, "total statistics")?;
    check(matches!(all.for_device(2), Err(AllocError::UnknownDevice { .. })), "device 2")?;
    drop(on1);
    check(device.violations().is_empty(), "no stream-order violation")?;
    Ok(())
}
