//! Stress: 4 threads × 50,000 random operations on one allocator over the SimDevice with its
//! stream-order sanitizer on. Half of the operations use one stream shared by all threads, half
//! each thread's private stream. Operations: allocate (small and large sizes), free (own buffers,
//! and buffers other threads handed over), `record_stream`, kernels touching live buffers,
//! statistics reads (checked for consistency) and invariant checks (which take every lock while
//! the others keep going). At the end: no stream-order violation, the invariants hold, and after
//! dropping everything no segment is left on the device.

use std::sync::{Arc, Barrier, Mutex};
use tidepool::MIB;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SimConfig, SimDevice};
use tidepool::{Allocator, Buffer, Config, Device, MemoryStats, StreamId};

mod common;
use common::Rng; // a fixed seed per thread

const THREADS: usize = 4;
const OPS: usize = 50_000;

fn size(rng: &mut Rng) -> u64 {
    match rng.below(20) {
        0..=15 => [512, 1000, 4096, 8192, 65536][rng.below(5) as usize], // hot small classes
        16..=18 => 1 + rng.below(MIB),                                   // any small size
        _ => MIB + 1 + rng.below(6 * MIB),                               // large pool
    }
}

fn consistent(s: &MemoryStats) {
    let b = &s.blocks;
    for g in [b.allocated_bytes, b.active_bytes, b.requested_bytes, b.allocation, b.active] {
        for c in [g.all, g.small_pool, g.large_pool, g.persistent, g.transient] {
            assert!(c.current <= c.peak, "{c:?}");
            assert_eq!(c.allocated - c.freed, c.current);
        }
        assert_eq!(g.all.current, g.small_pool.current + g.large_pool.current);
    }
    assert!(b.active_bytes.all.current >= b.allocated_bytes.all.current);
}

#[allow(clippy::too_many_arguments)]
fn worker(
    t: usize,
    ops: usize,
    alloc: Allocator<SimDevice>,
    dev: Arc<SimDevice>,
    shared: StreamId,
    own: StreamId,
    exchange: Arc<Mutex<Vec<Buffer<SimDevice>>>>,
    start: Arc<Barrier>,
) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
    let mut live: Vec<Buffer<SimDevice>> = Vec::new();
    start.wait();
    for i in 0..ops {
        let stream = if rng.below(2) == 0 { shared } else { own };
        match rng.below(100) {
            0..=44 => live.push(alloc.alloc(size(&mut rng), stream).unwrap()),
            45..=84 if !live.is_empty() => {
                let b = live.swap_remove(rng.below(live.len() as u64) as usize);
                if rng.below(8) == 0 {
                    exchange.lock().unwrap().push(b); // freed later, by whichever thread
                }
            }
            85..=89 => drop(exchange.lock().unwrap().pop()),
            90..=92 if !live.is_empty() => {
                let b = &live[rng.below(live.len() as u64) as usize];
                alloc.record_stream(b, stream).unwrap();
            }
            93..=97 if !live.is_empty() => {
                // Work on a live buffer, on its own stream: it stays pending after a free.
                let b = &live[rng.below(live.len() as u64) as usize];
                let acc = vec![Access { ptr: b.ptr(), bytes: b.len(), kind: AccessKind::Write }];
                dev.launch(
                    b.stream(),
                    Kernel { accesses: acc, ..Kernel::new("w", vec![], |_| {}) },
                )
                .unwrap();
            }
            98 => consistent(&alloc.stats()),
            _ => {}
        }
        if i % 5_000 == 0 {
            alloc.check_invariants().unwrap();
        }
        if live.len() > 64 {
            drop(live.swap_remove(0));
        }
    }
}

#[test]
fn four_threads_half_on_a_shared_stream() {
    let dev = Arc::new(SimDevice::new(64 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let shared = dev.create_stream().unwrap();
    let exchange = Arc::new(Mutex::new(Vec::new()));
    let start = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let own = dev.create_stream().unwrap();
            let (alloc, dev, exchange, start) =
                (alloc.clone(), dev.clone(), exchange.clone(), start.clone());
            std::thread::spawn(move || worker(t, OPS, alloc, dev, shared, own, exchange, start))
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let s = settle(&dev, alloc, &exchange);
    assert!(s.blocks.allocation.all.allocated > (THREADS * OPS / 3) as u64);
}

/// The end of a stress run: the buffers still exchanged freed, no stream-order violation, the
/// invariants and figures consistent with nothing allocated; then, with everything dropped, no
/// segment left and no failed kernel. The statistics before the drop.
fn settle(
    dev: &SimDevice,
    alloc: Allocator<SimDevice>,
    exchange: &Mutex<Vec<Buffer<SimDevice>>>,
) -> MemoryStats {
    exchange.lock().unwrap().clear();
    assert_eq!(dev.violations(), vec![], "stream-order violations");
    alloc.check_invariants().unwrap();
    let s = alloc.stats();
    consistent(&s);
    assert_eq!(s.blocks.allocation.all.current, 0);
    alloc.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty(), "leaked {:?}", dev.live_segments());
    drop(alloc);
    assert_eq!(dev.counters().mallocs, dev.counters().frees);
    assert_eq!(dev.kernel_failures(), vec![]);
    s
}

/// Threads that come and go, as a worker pool's do: 40 generations of 2 threads × 2 000
/// operations on the same allocator and streams, buffers handed from one generation to the
/// next (freed by a later thread than the one that made them). A lane passes to a thread of a
/// later generation once its owner has ended (`thread_token.rs`), while threads of the same
/// generation and buffers of ended ones free into it. On a quiet device (the inlined hit and
/// free, as on a GPU: every check but the sanitizer's) and on a sanitized one.
#[test]
fn generations_of_threads_hand_their_lanes_on() {
    const GENERATIONS: usize = 40;
    const PER: usize = 2;
    for sanitize in [false, true] {
        let dev = Arc::new(SimDevice::with_config(SimConfig {
            capacity: 64 << 30,
            sanitize,
            ..SimConfig::default()
        }));
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let shared = dev.create_stream().unwrap();
        let own: Vec<StreamId> = (0..PER).map(|_| dev.create_stream().unwrap()).collect();
        let exchange = Arc::new(Mutex::new(Vec::new()));
        for g in 0..GENERATIONS {
            let start = Arc::new(Barrier::new(PER));
            let handles: Vec<_> = (0..PER)
                .map(|t| {
                    let (alloc, dev, exchange, start) =
                        (alloc.clone(), dev.clone(), exchange.clone(), start.clone());
                    let own = own[t];
                    let seed = g * PER + t;
                    std::thread::spawn(move || {
                        worker(seed, 2_000, alloc, dev, shared, own, exchange, start)
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            alloc.check_invariants().unwrap();
        }
        let s = settle(&dev, alloc, &exchange);
        assert!(s.blocks.allocation.all.allocated > (GENERATIONS * PER * 2_000 / 3) as u64);
    }
}
