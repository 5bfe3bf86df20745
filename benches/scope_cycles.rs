//! A fixed number of planned alloc + free pairs (a named scope following its plan, sanitizer
//! off), for hardware counters on a busy machine, where wall-clock figures drift with the load:
//!
//! ```text
//! cargo bench --bench scope_cycles --no-run
//! perf stat -e instructions:u,cycles:u target/release/deps/scope_cycles-* planned
//! ```
//!
//! instructions:u ÷ the pairs printed is the instructions of a pair (plus one scope open and
//! exit per 256 pairs, as in `benches/scope.rs`'s `planned_alloc_free_pair`). It also prints
//! the wall time per pair. Without hardware counters, count instructions with callgrind for two
//! run counts and take the difference (setup cancels out):
//!
//! ```text
//! valgrind --tool=callgrind target/release/deps/scope_cycles-* planned 2000   # Collected: A
//! valgrind --tool=callgrind target/release/deps/scope_cycles-* planned 4000   # Collected: B
//! (B − A) ÷ (2000 × 256) = instructions per pair
//! ```
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;
use tidepool::{Allocator, Config, SimConfig, SimDevice, StreamId};

const PAIRS: u64 = 256;

fn main() {
    // `cargo bench` runs every bench with `--bench`: nothing to do then.
    if std::env::args().nth(1).as_deref() != Some("planned") {
        return;
    }
    let runs: u64 = std::env::args().nth(2).and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let dev =
        SimDevice::with_config(SimConfig { capacity: 1 << 34, backed: false, sanitize: false });
    let alloc = Allocator::new(Arc::new(dev), Config::default()).unwrap();
    let run = |alloc: &Allocator<SimDevice>| {
        let s = alloc.named_scope("bench", StreamId::DEFAULT);
        for _ in 0..PAIRS {
            drop(black_box(s.alloc(black_box(4096)).unwrap()));
        }
    };
    run(&alloc); // learn
    run(&alloc); // make the region
    let t = Instant::now();
    for _ in 0..runs {
        run(&alloc);
    }
    let pairs = runs * PAIRS;
    let ns = t.elapsed().as_nanos() as f64 / pairs as f64;
    assert_eq!(alloc.stats().plan_hits, (runs + 1) * PAIRS);
    println!("planned: {pairs} pairs, {ns:.1} ns per pair (wall)");
}
