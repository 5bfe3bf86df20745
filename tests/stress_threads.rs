//! Stress: 4 threads × 50,000 random operations on one allocator over the SimDevice with its
//! stream-order sanitizer on. Half of the operations use one stream shared by all threads, half
//! each thread's private stream. Operations: allocate (small and large sizes), free (own buffers,
//! and buffers other threads handed over), `record_stream`, kernels touching live buffers,
//! statistics reads (checked for consistency) and invariant checks (which take every lock while
//! the others keep going). At the end: no stream-order violation, the invariants hold, and after
//! dropping everything no segment is left on the device. Also: threads that come and go; a
//! reader holding every statistics snapshot to every figure's invariants while a controller
//! empties the cache and switches the configuration; allocators sharing one device (peers out
//! of memory, one closed while its buffers are freed), each with exact totals after the join.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use tidepool::MIB;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SimConfig, SimDevice};
use tidepool::{AllocError, Allocator, Buffer, Config, Device, MemoryStats, StreamId};

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

/// Every figure a concurrent reader may rely on, in one snapshot: `current ≤ peak` and
/// `allocated − freed = current` in every group and cell, cells that sum to `all` (by pool and
/// by residency), allocated and active within reserved, requested within active (PyTorch
/// takes a request back with the block's activity, after its events), a segment under every
/// allocation.
fn consistent_all(s: &MemoryStats) {
    let b = &s.blocks;
    for (name, g) in [
        ("allocated_bytes", b.allocated_bytes),
        ("reserved_bytes", b.reserved_bytes),
        ("active_bytes", b.active_bytes),
        ("requested_bytes", b.requested_bytes),
        ("inactive_split_bytes", b.inactive_split_bytes),
        ("allocation", b.allocation),
        ("segment", b.segment),
        ("active", b.active),
        ("inactive_split", b.inactive_split),
    ] {
        for c in [g.all, g.small_pool, g.large_pool, g.persistent, g.transient] {
            assert!(c.current <= c.peak, "{name} {c:?}");
            assert_eq!(c.allocated - c.freed, c.current, "{name} {c:?}");
        }
        assert_eq!(g.all.current, g.small_pool.current + g.large_pool.current, "{name} {g:?}");
        assert_eq!(g.all.current, g.persistent.current + g.transient.current, "{name} {g:?}");
    }
    let (allocated, active) = (b.allocated_bytes.all.current, b.active_bytes.all.current);
    let (reserved, requested) = (b.reserved_bytes.all.current, b.requested_bytes.all.current);
    assert!(allocated <= active && active <= reserved, "{allocated} {active} {reserved}");
    assert!(requested <= active, "requested {requested} > active {active}");
    assert!(b.allocation.all.current == 0 || b.segment.all.current > 0, "{b:?}");
}

/// A kernel writing `byte` over the first (up to) 4 KiB of `b`.
fn write_byte(b: &Buffer<SimDevice>, byte: u8) -> Kernel {
    let (p, n) = (b.ptr(), b.len().min(4096));
    Kernel::new("write", vec![Access { ptr: p, bytes: n, kind: AccessKind::Write }], move |m| {
        m.write(p, &vec![byte; n as usize]).unwrap()
    })
}

/// A kernel reading what [`write_byte`] wrote, counting it in `wrong` if it is not `byte`.
fn read_byte(b: &Buffer<SimDevice>, byte: u8, wrong: Arc<AtomicU64>) -> Kernel {
    let (p, n) = (b.ptr(), b.len().min(4096));
    Kernel::new("read", vec![Access { ptr: p, bytes: n, kind: AccessKind::Read }], move |m| {
        let mut v = vec![0u8; n as usize];
        m.read(p, &mut v).unwrap();
        if v.iter().any(|&x| x != byte) {
            wrong.fetch_add(1, Ordering::Relaxed);
        }
    })
}

/// Ends the controller's loop when the workers are done or one of them panicked.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Three threads allocate, write, read back and free (half on a shared stream, a quarter of
/// their frees by another thread, some buffers used on a second stream, ordered after the
/// write) while a fourth reads the statistics (every figure of [`consistent_all`] in each
/// snapshot), snapshots and the summary, empties the cache and switches the configuration
/// (stream caches on and off, `max_split_size`, a global lock, no caching, `wait_event`,
/// expandable segments). No wrong byte, no violation; after the join the totals are exact
/// (every allocation and every requested byte counted once) and nothing is left on the device.
/// On a sanitized device and on a quiet one (the inlined hit and free).
#[test]
fn readers_and_a_controller_against_three_threads() {
    const WORKERS: u64 = 3;
    for sanitize in [true, false] {
        let dev = Arc::new(SimDevice::with_config(SimConfig {
            capacity: 4 << 30,
            backed: true,
            sanitize,
        }));
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let configs = [
            Config::default().with_fast_cache(false),
            Config::default().with_max_split_size_mb(40),
            Config::default().with_global_lock(true),
            Config::default().with_caching(false),
            Config::default().with_cross_stream(tidepool::CrossStream::WaitEvent),
            Config::default().with_expandable_segments(true),
            Config::default(),
        ];
        let shared = dev.create_stream().unwrap();
        let (stop, wrong) = (AtomicBool::new(false), Arc::new(AtomicU64::new(0)));
        let (made, asked) = (AtomicU64::new(0), AtomicU64::new(0));
        let exchange: Mutex<Vec<Buffer<SimDevice>>> = Mutex::new(Vec::new());
        // The workers go on past their 10 000 operations until the controller has been through
        // every configuration once (its rounds counted here): on a loaded machine it may
        // otherwise be scheduled only after they finished, and test nothing.
        let (rounds, min_rounds) = (AtomicU64::new(0), 8 * configs.len() as u64);
        let reads = std::thread::scope(|sc| {
            let controller = sc.spawn(|| {
                let mut reads = 0;
                while !stop.load(Ordering::Relaxed) {
                    match reads % 8 {
                        0 => alloc.empty_cache().unwrap(),
                        1 => alloc.set_config(configs[reads / 8 % configs.len()].clone()).unwrap(),
                        2 => {
                            // Each segment tiled by its blocks, in address order.
                            for seg in alloc.snapshot() {
                                let mut at = seg.address.0;
                                for b in &seg.blocks {
                                    assert_eq!(b.address.0, at, "{seg:?}");
                                    at += b.size;
                                }
                                assert_eq!(at, seg.address.0 + seg.size, "{seg:?}");
                            }
                        }
                        3 => assert!(!alloc.memory_summary().is_empty()),
                        _ => consistent_all(&alloc.stats()),
                    }
                    reads += 1;
                    rounds.store(reads as u64, Ordering::Relaxed);
                    std::thread::yield_now();
                }
                reads
            });
            let _stop = StopOnDrop(&stop);
            let workers: Vec<_> = (0..WORKERS)
                .map(|t| {
                    let (alloc, dev, wrong, exchange) = (&alloc, &dev, &wrong, &exchange);
                    let (made, asked, rounds) = (&made, &asked, &rounds);
                    let own = dev.create_stream().unwrap();
                    sc.spawn(move || {
                        let mut rng = Rng(0x5eed ^ (t + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                        let mut live: Vec<(Buffer<SimDevice>, u8)> = Vec::new();
                        let more =
                            |i: u64| i < 10_000 || rounds.load(Ordering::Relaxed) < min_rounds;
                        for i in (0..).take_while(|&i| more(i)) {
                            let stream = if rng.below(2) == 0 { shared } else { own };
                            match rng.below(100) {
                                0..=44 => {
                                    let n = size(&mut rng);
                                    let b = alloc.alloc(n, stream).unwrap();
                                    made.fetch_add(1, Ordering::Relaxed);
                                    asked.fetch_add(n, Ordering::Relaxed);
                                    let byte = (i % 251) as u8 + 1;
                                    dev.launch(stream, write_byte(&b, byte)).unwrap();
                                    live.push((b, byte));
                                }
                                45..=84 if !live.is_empty() => {
                                    let at = rng.below(live.len() as u64) as usize;
                                    let (b, byte) = live.swap_remove(at);
                                    dev.launch(b.stream(), read_byte(&b, byte, wrong.clone()))
                                        .unwrap();
                                    if rng.below(4) == 0 {
                                        exchange.lock().unwrap().push(b); // freed by any thread
                                    }
                                }
                                85..=89 => drop(exchange.lock().unwrap().pop()),
                                90..=94 if !live.is_empty() => {
                                    // Read on the other stream, after the write.
                                    let (b, byte) = &live[rng.below(live.len() as u64) as usize];
                                    let other = if b.stream() == own { shared } else { own };
                                    let e = dev.create_event().unwrap();
                                    dev.record_event(e, b.stream()).unwrap();
                                    dev.wait_event(other, e).unwrap();
                                    dev.destroy_event(e).unwrap();
                                    dev.launch(other, read_byte(b, *byte, wrong.clone())).unwrap();
                                    b.record_stream(other).unwrap();
                                }
                                _ => {}
                            }
                            if live.len() > 48 {
                                drop(live.swap_remove(0));
                            }
                        }
                    })
                })
                .collect();
            for w in workers {
                w.join().unwrap();
            }
            stop.store(true, Ordering::Relaxed);
            controller.join().unwrap()
        });
        exchange.lock().unwrap().clear();
        dev.synchronize().unwrap();
        assert!(reads as u64 >= min_rounds, "the controller ran through every configuration");
        assert_eq!(wrong.load(Ordering::Relaxed), 0, "a kernel read another's bytes");
        assert_eq!(dev.violations(), vec![], "stream-order violations");
        assert_eq!(dev.kernel_failures(), vec![]);
        alloc.check_invariants().unwrap();
        alloc.synchronize().unwrap(); // the frees pending on other streams' events settle
        let s = alloc.stats();
        consistent_all(&s);
        let b = &s.blocks;
        assert_eq!(b.allocation.all.allocated, made.load(Ordering::Relaxed));
        assert_eq!(b.requested_bytes.all.allocated, asked.load(Ordering::Relaxed));
        assert_eq!((b.allocation.all.current, b.requested_bytes.all.current), (0, 0));
        assert_eq!(b.reserved_bytes.all.current, dev.reserved_bytes() + dev.physical_bytes());
        assert_eq!(s.num_device_alloc, dev.counters().mallocs);
        assert_eq!(s.num_device_free, dev.counters().frees);
        drop(alloc);
        common::assert_no_leak(&dev);
    }
}

/// Allocators sharing one device, as two libraries' would: two general allocators (one over
/// expandable segments) on a device too small for both, whose out-of-memory asks the other
/// (`peers.rs`), and a third whose last handle goes while other threads still free its
/// buffers. Four threads allocate on their own streams (destroyed and made again while
/// buffers of them are live in the exchange) and the default stream, write, read back and
/// free each other's buffers of every allocator. No wrong byte, no violation; after the join
/// each allocator's totals are exact, their device calls are the device's, what they reserve
/// is what the device holds, and once they are gone nothing is left.
#[test]
fn allocators_of_one_device_under_threads() {
    for sanitize in [true, false] {
        let dev = Arc::new(SimDevice::with_config(SimConfig {
            capacity: 160 * MIB,
            backed: true,
            sanitize,
        }));
        let allocs = [
            Allocator::new(dev.clone(), Config::default()).unwrap(),
            Allocator::new(dev.clone(), Config::default().with_expandable_segments(true)).unwrap(),
        ];
        // The third: buffers on three streams, some used on another, then its handle goes.
        let closing = Allocator::new(dev.clone(), Config::default()).unwrap();
        let wrong = Arc::new(AtomicU64::new(0));
        let exchange: Mutex<Vec<(Buffer<SimDevice>, u8)>> = Mutex::new(Vec::new());
        let mut rng = Rng(42);
        let streams: Vec<StreamId> = (0..3).map(|_| dev.create_stream().unwrap()).collect();
        for i in 0..60 {
            let s = streams[i % 3];
            let b = closing.alloc(size(&mut rng), s).unwrap();
            dev.launch(s, write_byte(&b, 7)).unwrap();
            if i % 4 == 0 {
                let o = streams[(i + 1) % 3];
                let e = dev.create_event().unwrap();
                dev.record_event(e, s).unwrap();
                dev.wait_event(o, e).unwrap();
                dev.destroy_event(e).unwrap();
                dev.launch(o, read_byte(&b, 7, wrong.clone())).unwrap();
                b.record_stream(o).unwrap();
            }
            exchange.lock().unwrap().push((b, 7));
        }
        let closing_mallocs = dev.counters().mallocs; // the other two reserved nothing yet
        // Allocations, requested bytes and out-of-memory failures seen, per allocator.
        let seen: [[AtomicU64; 3]; 2] = Default::default();
        std::thread::scope(|sc| {
            for t in 0..4u64 {
                let (allocs, dev, wrong, exchange, seen) =
                    (&allocs, &dev, &wrong, &exchange, &seen);
                sc.spawn(move || {
                    let k = (t % 2) as usize;
                    let a = &allocs[k];
                    let mut rng = Rng(0x77 ^ (t + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
                    let mut own = dev.create_stream().unwrap();
                    let mut live: Vec<(Buffer<SimDevice>, u8)> = Vec::new();
                    for i in 0..3_000u64 {
                        let stream = if rng.below(2) == 0 { own } else { StreamId::DEFAULT };
                        match rng.below(100) {
                            0..=49 => {
                                let n = size(&mut rng) * (1 + rng.below(3));
                                match a.alloc(n, stream) {
                                    Ok(b) => {
                                        seen[k][0].fetch_add(1, Ordering::Relaxed);
                                        seen[k][1].fetch_add(n, Ordering::Relaxed);
                                        let byte = (i % 251) as u8 + 1;
                                        dev.launch(stream, write_byte(&b, byte)).unwrap();
                                        live.push((b, byte));
                                    }
                                    Err(AllocError::OutOfMemory(_)) => {
                                        seen[k][2].fetch_add(1, Ordering::Relaxed);
                                        live.clear();
                                    }
                                    Err(e) => panic!("{e}"),
                                }
                            }
                            50..=84 if !live.is_empty() => {
                                let at = rng.below(live.len() as u64) as usize;
                                let (b, byte) = live.swap_remove(at);
                                dev.launch(b.stream(), read_byte(&b, byte, wrong.clone())).unwrap();
                                if rng.below(3) == 0 {
                                    exchange.lock().unwrap().push((b, byte));
                                }
                            }
                            85..=91 => drop(exchange.lock().unwrap().pop()),
                            92..=93 => {
                                // A new stream; the old one's live buffers go to the exchange.
                                let (old, keep) =
                                    live.drain(..).partition(|(b, _)| b.stream() == own);
                                live = keep;
                                exchange.lock().unwrap().extend::<Vec<_>>(old);
                                a.destroy_stream(own).unwrap();
                                own = dev.create_stream().unwrap();
                            }
                            _ => {}
                        }
                        if live.len() > 10 {
                            drop(live.swap_remove(0));
                        }
                    }
                });
            }
            drop(closing);
        });
        exchange.lock().unwrap().clear();
        dev.synchronize().unwrap();
        assert_eq!(wrong.load(Ordering::Relaxed), 0, "a kernel read another's bytes");
        assert_eq!(dev.violations(), vec![], "stream-order violations");
        assert_eq!(dev.kernel_failures(), vec![]);
        let (mut mallocs, mut frees, mut reserved) = (0, 0, 0);
        for (a, seen) in allocs.iter().zip(&seen) {
            a.check_invariants().unwrap();
            a.synchronize().unwrap();
            let s = a.stats();
            consistent_all(&s);
            let b = &s.blocks;
            assert_eq!(b.allocation.all.allocated, seen[0].load(Ordering::Relaxed));
            assert_eq!(b.requested_bytes.all.allocated, seen[1].load(Ordering::Relaxed));
            // A request the peers rescued is no failure: exactly the failed ones count.
            assert_eq!(s.num_ooms, seen[2].load(Ordering::Relaxed));
            assert_eq!((b.allocation.all.current, b.requested_bytes.all.current), (0, 0));
            (mallocs, frees) = (mallocs + s.num_device_alloc, frees + s.num_device_free);
            reserved += b.reserved_bytes.all.current;
        }
        assert!(seen.iter().map(|s| s[2].load(Ordering::Relaxed)).sum::<u64>() > 0, "tight");
        let c = dev.counters();
        // The closed allocator reserved nothing after its handle went, and gave all back.
        assert_eq!((c.mallocs, c.frees), (mallocs + closing_mallocs, frees + closing_mallocs));
        assert_eq!(reserved, dev.reserved_bytes() + dev.physical_bytes());
        drop(allocs);
        common::assert_no_leak(&dev);
    }
}
