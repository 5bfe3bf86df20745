//! Throughput of alloc + free pairs from 1 and 2 threads, on separate streams and on one shared
//! stream, with the fast path (per-stream caches, lock-free stats) and under `global_lock:true`
//! (everything through one mutex, PyTorch's design). Sanitizer off, so the device hooks are
//! no-ops and only the allocator is measured. Throughput is pairs per second over all threads.
//!
//! Ratios worth reading: fast 2 threads (separate streams) / fast 1 thread, and fast / global
//! lock at 2 threads. `scripts/bench_ratios.py` prints them from criterion's estimates.
//!
//! `reference/2_threads_2_allocators` is the machine's own ceiling for the first ratio: two
//! threads, each on an allocator and a device of its own, so they share nothing that tidepool
//! writes. Where two threads on separate streams of one allocator scale less than this, the
//! allocator shares something; where both fall short of 2 ×, the machine does (a second core
//! that is busy or a hyperthread sibling).
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use tidepool::{Allocator, Config, Device, SimConfig, SimDevice, StreamId};

/// Each thread's share: `iters` pairs of 4 KiB on its stream of its allocator, started together;
/// the wall time of the slowest thread.
fn run(work: &[(Allocator<SimDevice>, StreamId)], iters: u64) -> Duration {
    let start = Arc::new(Barrier::new(work.len() + 1));
    let handles: Vec<_> = work
        .iter()
        .map(|(alloc, s)| {
            let (alloc, s, start) = (alloc.clone(), *s, start.clone());
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

fn sim_device() -> Arc<SimDevice> {
    Arc::new(SimDevice::with_config(SimConfig {
        capacity: 1 << 30,
        sanitize: false,
        ..SimConfig::default()
    }))
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads");
    g.measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    for mode in ["fast", "global_lock"] {
        let dev = sim_device();
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let config = if mode == "fast" { "" } else { "global_lock:true" };
        let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
        for (name, streams) in [
            ("1_thread", vec![s1]),
            ("2_threads_separate_streams", vec![s1, s2]),
            ("2_threads_same_stream", vec![s1, s1]),
        ] {
            let work: Vec<_> = streams.iter().map(|&s| (alloc.clone(), s)).collect();
            g.throughput(Throughput::Elements(work.len() as u64));
            g.bench_function(format!("{mode}/{name}"), |b| {
                b.iter_custom(|iters| run(&work, iters))
            });
        }
        alloc.check_invariants().unwrap();
    }
    // The machine's ceiling: nothing of tidepool's shared between the two threads.
    let work: Vec<_> = (0..2)
        .map(|_| {
            let dev = sim_device();
            let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
            (alloc, dev.create_stream().unwrap())
        })
        .collect();
    g.throughput(Throughput::Elements(2));
    g.bench_function("reference/2_threads_2_allocators", |b| {
        b.iter_custom(|iters| run(&work, iters))
    });
    for (alloc, _) in &work {
        alloc.check_invariants().unwrap();
    }
    g.finish();
}

criterion_group!(benches, threads);
criterion_main!(benches);
