//! Scoped allocation costs: an alloc + free pair inside a planned run of a named scope (served
//! from the learned region), and inside an anonymous scope (served from the scope's local cache),
//! against the allocator's ordinary cache hit. Each measured run repeats the learned sequence.
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tidepool::{Allocator, Config, SimConfig, SimDevice, StreamId};

const PAIRS: u64 = 256;

fn scope(c: &mut Criterion) {
    let dev =
        SimDevice::with_config(SimConfig { capacity: 1 << 34, backed: false, sanitize: false });
    let alloc = Allocator::new(Arc::new(dev), Config::default()).unwrap();
    let run = |alloc: &Allocator<SimDevice>| {
        let s = alloc.named_scope("bench", StreamId::DEFAULT);
        for _ in 0..PAIRS {
            drop(s.alloc(4096).unwrap());
        }
    };
    run(&alloc); // learn
    run(&alloc); // make the region
    let mut g = c.benchmark_group("scope");
    g.bench_function("planned_alloc_free_pair", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters.div_ceil(PAIRS) {
                let s = alloc.named_scope("bench", StreamId::DEFAULT);
                let t = Instant::now();
                for _ in 0..PAIRS {
                    drop(black_box(s.alloc(black_box(4096)).unwrap()));
                }
                total += t.elapsed();
                drop(s);
            }
            total.mul_f64(iters as f64 / (iters.div_ceil(PAIRS) * PAIRS) as f64)
        })
    });
    g.bench_function("anonymous_scope_alloc_free_pair", |b| {
        let s = alloc.scope(StreamId::DEFAULT);
        b.iter(|| drop(black_box(s.alloc(black_box(4096)).unwrap())))
    });
    g.bench_function("unscoped_cache_hit_pair", |b| {
        b.iter(|| drop(black_box(alloc.alloc(black_box(4096), StreamId::DEFAULT).unwrap())))
    });
    g.finish();
    assert!(alloc.stats().plan_hits > 0);
}

criterion_group!(benches, scope);
criterion_main!(benches);
