//! Cross-stream reuse: a buffer freed on stream A, the same size allocated on stream B, and back,
//! under both policies (`strict` polls an event on the owner; `wait_event` makes B wait on it).
use criterion::{Criterion, criterion_group, criterion_main};
use std::sync::Arc;
use tidepool::{Allocator, Config, Device, SimConfig, SimDevice};

fn cross_stream(c: &mut Criterion) {
    let mut g = c.benchmark_group("cross_stream");
    for policy in ["strict", "wait_event"] {
        let dev = Arc::new(SimDevice::with_config(SimConfig {
            capacity: 1 << 30,
            ..SimConfig::default()
        }));
        let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let alloc =
            Allocator::new(dev.clone(), Config::parse(&format!("cross_stream:{policy}")).unwrap())
                .unwrap();
        g.bench_function(format!("{policy}/free_on_a_alloc_on_b"), |bench| {
            bench.iter(|| {
                drop(alloc.alloc(4096, a).unwrap());
                drop(alloc.alloc(4096, b).unwrap());
            })
        });
        assert_eq!(dev.counters().mallocs, 1, "every iteration reuses the one segment");
    }
    g.finish();
}

criterion_group!(benches, cross_stream);
criterion_main!(benches);
