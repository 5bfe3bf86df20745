//! A fixed number of hit-path pairs (alloc + free of one size on one stream, sanitizer off),
//! for hardware counters on a busy machine, where wall-clock figures drift with the load:
//!
//! ```text
//! cargo bench --bench hit_cycles --no-run
//! perf stat -e cycles:u,instructions:u target/release/deps/hit_cycles-* small   # or large, small_gl, small_cas
//! ```
//!
//! cycles:u ÷ the pairs printed is the cost of a pair in the allocator's own cycles (the cycles
//! of other processes sharing the cores are not counted). It also prints the wall time per pair.
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;
use tidepool::{Allocator, Config, SimConfig, SimDevice, StreamId};

fn main() {
    let which = std::env::args().nth(1).unwrap_or_else(|| "small".into());
    let pairs: u64 = std::env::args().nth(2).and_then(|n| n.parse().ok()).unwrap_or(20_000_000);
    let (bytes, config) = match which.as_str() {
        "small" => (4096u64, ""),
        "large" => (4 << 20, ""),
        "small_gl" => (4096, "global_lock:true"),
        "small_cas" => (4096, "biased_lanes:false"),
        "large_cas" => (4 << 20, "biased_lanes:false"),
        "large_gl" => (4 << 20, "global_lock:true"),
        // `cargo bench` runs every bench with `--bench`: nothing to do then.
        _ => return,
    };
    let dev = SimDevice::with_config(SimConfig {
        capacity: 1 << 30,
        sanitize: false,
        ..SimConfig::default()
    });
    let alloc = Allocator::new(Arc::new(dev), Config::parse(config).unwrap()).unwrap();
    drop(alloc.alloc(bytes, StreamId::DEFAULT).unwrap());
    let t = Instant::now();
    for _ in 0..pairs {
        drop(black_box(alloc.alloc(black_box(bytes), StreamId::DEFAULT).unwrap()));
    }
    let ns = t.elapsed().as_nanos() as f64 / pairs as f64;
    println!("{which}: {pairs} pairs, {ns:.1} ns per pair (wall)");
}
