//! Churn: random sizes from a fixed seed over a working set of 64 live buffers.
use criterion::{Criterion, criterion_group, criterion_main};
use std::sync::Arc;
use tidepool::{Allocator, Buffer, Config, SimDevice, StreamId};

/// xorshift64*: a fixed-seed generator, so every run sees the same sizes.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn size(&mut self) -> u64 {
        match self.next() % 10 {
            0..=5 => 1 + self.next() % 65536,             // small activations
            6..=8 => (1 << 20) + self.next() % (8 << 20), // large pool
            _ => (10 << 20) + self.next() % (40 << 20),   // own segments
        }
    }
}

fn churn(c: &mut Criterion) {
    let alloc = Allocator::new(Arc::new(SimDevice::new(64 << 30)), Config::default()).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut live: Vec<Buffer<SimDevice>> = Vec::new();
    c.bench_function("churn/alloc_free_pair", |b| {
        b.iter(|| {
            if live.len() >= 64 {
                let i = (rng.next() % live.len() as u64) as usize;
                drop(live.swap_remove(i));
            }
            live.push(alloc.alloc(rng.size(), StreamId::DEFAULT).unwrap());
        })
    });
}

criterion_group!(benches, churn);
criterion_main!(benches);
