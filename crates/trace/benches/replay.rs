//! Replay of the shipped `gpt2_train` trace under `caching` and the two crate baselines, in one
//! run (issue goal: `caching` ≤ 0.5× offset-allocator's time per operation). Each iteration is a
//! whole replay from a fresh allocator; divide by the event count for ns per operation.
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tidepool_trace::policy::{AllocatorPolicy, Mode, OffsetAllocatorPolicy, RangeAllocPolicy};
use tidepool_trace::{Policy, read_trace};

fn replay(c: &mut Criterion) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/traces/gpt2_train.csv.gz");
    let trace = read_trace(&path).expect("shipped trace");
    let mut g = c.benchmark_group("replay_gpt2_train");
    g.throughput(Throughput::Elements(trace.events.len() as u64));
    g.sample_size(20);
    let caching = AllocatorPolicy::from_config(Mode::Caching, None).unwrap();
    let policies: [&dyn Policy; 3] = [&caching, &OffsetAllocatorPolicy, &RangeAllocPolicy];
    for p in policies {
        g.bench_function(p.name(), |b| b.iter(|| p.replay(&trace, false).unwrap()));
    }
    g.finish();
}

criterion_group!(benches, replay);
criterion_main!(benches);
