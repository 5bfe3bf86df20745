//! The cache hit: alloc + free of the same size on the same stream (issue goal ≤ 50 ns a pair).
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::sync::Arc;
use tidepool::{Allocator, Config, SimDevice, StreamId};

fn hit_path(c: &mut Criterion) {
    let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    let mut g = c.benchmark_group("hit_path");
    for (name, bytes) in [("small_4KiB", 4096u64), ("large_4MiB", 4 << 20)] {
        drop(alloc.alloc(bytes, StreamId::DEFAULT).unwrap());
        g.bench_function(name, |b| {
            b.iter(|| drop(black_box(alloc.alloc(black_box(bytes), StreamId::DEFAULT).unwrap())))
        });
    }
    g.finish();
}

criterion_group!(benches, hit_path);
criterion_main!(benches);
