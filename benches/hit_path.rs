//! The cache hit: alloc + free of the same size on the same stream (issue goal ≤ 50 ns a pair).
//! `sanitized/…` runs with the SimDevice's stream-order sanitizer on (its hooks take the device
//! lock on every hand-out and free); `allocator/…` with it off, measuring the allocator alone;
//! `unbiased/…` with `biased_lanes:false` (every lane take a compare-and-swap: the lane lock
//! before its bias, `lane_lock.rs`); `global_lock/…` is the same under `global_lock:true` (no
//! fast path). `late_stream/…` runs
//! the pairs on a stream made after 140 others were made, used and destroyed (a stream per
//! request): its lanes are a destroyed stream's, re-tagged (before they were, every stream past
//! the 64th took the global lock). `beside_live_stream/…` runs them on stream 64, made after
//! 63 streams were made, used and destroyed while the default stream kept its lanes: its first
//! slot serves the live default stream, so its lanes are its second choice's (before, such a
//! stream took the global lock). `third_choice/…` runs them on stream 128, whose first two
//! slots (0 and 3) serve the live default stream and stream 3: its lanes are its third
//! choice's (slot 6), found out of line after the first choice's tag compare.
//! `owner_ended/…` runs them on the default stream of an allocator whose lanes threads that
//! have ended used first: the lane passes to the bench's thread at its first take, so the pairs
//! should cost what `allocator/…`'s do (before the hand-over, `unbiased/…`'s).
//!
//! `history/…` is the cost of the memory history (issue 18): `history_off` is the default hit
//! path (the hook is one relaxed load), `history_on` records every allocation and free (which
//! then take the slow path), `history_on_stacks` also captures a Rust backtrace for each.
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::sync::Arc;
use tidepool::{Allocator, Config, Device, HistoryOptions, SimConfig, SimDevice, StreamId};

/// An allocator on a 1 GiB SimDevice (sanitizer on or off) configured by `config`.
fn allocator(sanitize: bool, config: &str) -> Allocator<SimDevice> {
    let dev =
        SimDevice::with_config(SimConfig { capacity: 1 << 30, sanitize, ..SimConfig::default() });
    Allocator::new(Arc::new(dev), Config::parse(config).unwrap()).unwrap()
}

/// `{prefix}/small_4KiB` and `{prefix}/large_4MiB`: alloc + free pairs of one size on the
/// default stream, after one warm-up pair (the block is cached from then on).
fn bench_pairs(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    prefix: &str,
    alloc: &Allocator<SimDevice>,
) {
    bench_pairs_on(g, prefix, alloc, StreamId::DEFAULT);
}

/// [`bench_pairs`] on `stream`.
fn bench_pairs_on(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    prefix: &str,
    alloc: &Allocator<SimDevice>,
    stream: StreamId,
) {
    for (name, bytes) in [("small_4KiB", 4096u64), ("large_4MiB", 4 << 20)] {
        drop(alloc.alloc(bytes, stream).unwrap());
        g.bench_function(format!("{prefix}/{name}"), |b| {
            b.iter(|| drop(black_box(alloc.alloc(black_box(bytes), stream).unwrap())))
        });
    }
}

fn hit_path(c: &mut Criterion) {
    let mut g = c.benchmark_group("hit_path");
    for (prefix, sanitize, config) in [
        ("sanitized", true, ""),
        ("allocator", false, ""),
        ("unbiased", false, "biased_lanes:false"),
        ("global_lock", false, "global_lock:true"),
    ] {
        bench_pairs(&mut g, prefix, &allocator(sanitize, config));
    }
    // The 141st stream, after 140 made, used and destroyed.
    let (dev, alloc) = sim_allocator();
    let late = streams_until(&dev, 141, |s| {
        drop(alloc.alloc(4096, s).unwrap());
        alloc.destroy_stream(s).unwrap();
    });
    bench_pairs_on(&mut g, "late_stream", &alloc, late);
    // Stream 64, its first slot the live default stream's, after 63 made, used and destroyed.
    let (dev, alloc) = sim_allocator();
    drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap()); // the default stream's lanes, in slot 0
    let beside = streams_until(&dev, 64, |s| {
        drop(alloc.alloc(4096, s).unwrap());
        alloc.destroy_stream(s).unwrap();
    });
    bench_pairs_on(&mut g, "beside_live_stream", &alloc, beside);
    // Stream 128, its slots 0 and 3 the live default stream's and stream 3's.
    let (dev, alloc) = sim_allocator();
    drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap());
    let third = streams_until(&dev, 128, |s| {
        if s.0 == 3 {
            drop(alloc.alloc(4096, s).unwrap()); // stream 3's lanes, in slot 3
        }
    });
    bench_pairs_on(&mut g, "third_choice", &alloc, third);
    // The default stream's lanes, each first used by a thread that has ended since: this
    // thread's lane passes to it at its first take (before, it stayed on the CAS for good).
    let (_dev, alloc) = sim_allocator();
    std::thread::scope(|s| {
        // Threads take lanes round-robin: of 2 × LANES threads, some had each lane first.
        for _ in 0..4 {
            s.spawn(|| drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap())).join().unwrap();
        }
    });
    bench_pairs(&mut g, "owner_ended", &alloc);
    g.finish();
}

/// A SimDevice of 1 GiB without the sanitizer, and a default allocator over it.
fn sim_allocator() -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::with_config(SimConfig {
        capacity: 1 << 30,
        sanitize: false,
        ..SimConfig::default()
    }));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, alloc)
}

/// Makes streams, passing each to `each`, up to the one with id `last`, which it returns.
fn streams_until(dev: &SimDevice, last: u32, mut each: impl FnMut(StreamId)) -> StreamId {
    loop {
        let s = dev.create_stream().unwrap();
        if s.0 >= last {
            return s;
        }
        each(s);
    }
}

fn history(c: &mut Criterion) {
    let mut g = c.benchmark_group("history");
    let options = [
        ("history_off", None),
        ("history_on", Some(HistoryOptions::new(1 << 16))),
        ("history_on_stacks", Some(HistoryOptions::new(1 << 16).with_stacks(true))),
    ];
    for (prefix, options) in options {
        let alloc = allocator(false, "");
        if let Some(o) = options {
            alloc.record_history(o);
        }
        bench_pairs(&mut g, prefix, &alloc);
    }
    g.finish();
}

criterion_group!(benches, hit_path, history);
criterion_main!(benches);
