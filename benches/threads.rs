//! Throughput of alloc + free pairs from 1 and 2 threads, on separate streams and on one shared
//! stream, with the fast path (per-stream caches, lock-free stats) and under `global_lock:true`
//! (everything through one mutex, PyTorch's design). Sanitizer off, so the device hooks are
//! no-ops and only the allocator is measured. Throughput is pairs per second over all threads.
//!
//! Ratios worth reading: fast 2 threads (separate streams) / fast 1 thread, and fast / global
//! lock at 2 threads. `scripts/bench_ratios.py` prints them from criterion's estimates.
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use tidepool::{Allocator, Config, Device, SimConfig, SimDevice, StreamId};

/// Each thread's share: `iters` pairs of 4 KiB on its stream, started together; the wall time of
/// the slowest thread.
fn run(alloc: &Allocator<SimDevice>, streams: &[StreamId], iters: u64) -> Duration {
    let start = Arc::new(Barrier::new(streams.len() + 1));
    let handles: Vec<_> = streams
        .iter()
        .map(|&s| {
            let (alloc, start) = (alloc.clone(), start.clone());
            std::thread::spawn(move || {
                drop(alloc.alloc(4096, s).unwrap());
                start.wait();
                let t = Instant::now();
                for _ in 0..iters {
                    drop(black_box(alloc.alloc(black_box(4096), s).unwrap()));
                }
                t.elapsed()
            })
        })
        .collect();
    start.wait();
    handles.into_iter().map(|h| h.join().unwrap()).max().unwrap()
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads");
    g.measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    for mode in ["fast", "global_lock"] {
        let dev = Arc::new(SimDevice::with_config(SimConfig {
            capacity: 1 << 30,
            sanitize: false,
            ..SimConfig::default()
        }));
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let config = if mode == "fast" { "" } else { "global_lock:true" };
        let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
        for (name, streams) in [
            ("1_thread", vec![s1]),
            ("2_threads_separate_streams", vec![s1, s2]),
            ("2_threads_same_stream", vec![s1, s1]),
        ] {
            g.throughput(Throughput::Elements(streams.len() as u64));
            g.bench_function(format!("{mode}/{name}"), |b| {
                b.iter_custom(|iters| run(&alloc, &streams, iters))
            });
        }
        alloc.check_invariants().unwrap();
    }
    g.finish();
}

criterion_group!(benches, threads);
criterion_main!(benches);
