//! Statistics against PyTorch's definitions, every key after every step: each scenario keeps
//! the dictionary `torch.cuda.memory_stats()` would show, updated by hand with the rules of
//! `c10/cuda/CUDACachingAllocator.cpp` (`alloc_found_block`, `free`, `free_block`,
//! `alloc_block`, `release_block`, `synchronize_and_free_events`, `resetAccumulatedStats`,
//! `resetPeakStats`), and compares it with `Allocator::memory_stats()` whole.
//!
//! PyTorch's inactive-split figures move by the *net* change of an operation: a split of an
//! already-split free block lowers `inactive_split_bytes` by the bytes handed out (its count
//! does not move), and a free that merges with free neighbours adds the difference only
//! (`free_block`'s `net_change_inactive_split_blocks` / `_size`), so their `allocated` and
//! `freed` totals count no block that left the figures and came back in the same operation.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use tidepool::device::{AccessKind, Launch, SimDevice};
use tidepool::{Allocator, Config, Device, MIB, StreamId};

const S0: StreamId = StreamId::DEFAULT;

fn allocator_on(capacity: u64, conf: &str) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::new(capacity));
    let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
    (dev, alloc)
}

/// The pool a figure moves in (PyTorch's `StatType`, besides `all`).
#[derive(Clone, Copy)]
enum P {
    Small,
    Large,
}

/// `torch.cuda.memory_stats()` as PyTorch's rules give it, kept by hand: every block figure of
/// the `all` and pool cells (and tidepool's residency cells: every block here is transient),
/// the oversize figures and the counters.
struct Py {
    m: BTreeMap<String, i64>,
}

impl Py {
    /// The figures of a new allocator (every one 0; `max_split_size` as configured).
    fn new(alloc: &Allocator<SimDevice>) -> Py {
        let m = alloc.memory_stats();
        assert!(
            m.iter().all(|(k, &v)| k == "max_split_size" || v == 0),
            "a new allocator counts nothing: {m:?}"
        );
        Py { m }
    }

    /// The figures of `alloc` as they are now, taken as PyTorch's (the steps after are checked).
    fn new_after(alloc: &Allocator<SimDevice>) -> Py {
        Py { m: alloc.memory_stats() }
    }

    fn cells(stat: &str, p: Option<P>) -> Vec<String> {
        match p {
            Some(p) => {
                let pool = match p {
                    P::Small => "small_pool",
                    P::Large => "large_pool",
                };
                ["all", pool, "transient"].iter().map(|c| format!("{stat}.{c}")).collect()
            }
            None => vec![stat.to_string()],
        }
    }

    /// PyTorch's `increase_stat`.
    fn up(&mut self, stat: &str, p: P, n: i64) {
        self.up_in(stat, Some(p), n)
    }

    /// PyTorch's `decrease_stat`.
    fn down(&mut self, stat: &str, p: P, n: i64) {
        self.down_in(stat, Some(p), n)
    }

    fn up_in(&mut self, stat: &str, p: Option<P>, n: i64) {
        for c in Self::cells(stat, p) {
            let cur = self.m[&format!("{c}.current")] + n;
            self.m.insert(format!("{c}.current"), cur);
            *self.m.get_mut(&format!("{c}.allocated")).unwrap() += n;
            let peak = self.m.get_mut(&format!("{c}.peak")).unwrap();
            *peak = (*peak).max(cur);
        }
    }

    fn down_in(&mut self, stat: &str, p: Option<P>, n: i64) {
        for c in Self::cells(stat, p) {
            *self.m.get_mut(&format!("{c}.current")).unwrap() -= n;
            *self.m.get_mut(&format!("{c}.freed")).unwrap() += n;
        }
    }

    fn count(&mut self, key: &str, n: i64) {
        *self.m.get_mut(key).unwrap() += n;
    }

    /// A block of `size` bytes serving `requested` handed out (`alloc_found_block`'s last part).
    fn hand_out(&mut self, p: P, size: i64, requested: i64) {
        for (s, n) in [
            ("allocation", 1),
            ("allocated_bytes", size),
            ("active", 1),
            ("active_bytes", size),
            ("requested_bytes", requested),
        ] {
            self.up(s, p, n);
        }
    }

    /// A user's free (`free`): no longer allocated; still active until `free_block`.
    fn free_requested(&mut self, p: P, size: i64) {
        self.down("allocation", p, 1);
        self.down("allocated_bytes", p, size);
    }

    /// `free_block`'s active and requested figures.
    fn free_completed(&mut self, p: P, size: i64, requested: i64) {
        self.down("active", p, 1);
        self.down("active_bytes", p, size);
        self.down("requested_bytes", p, requested);
    }

    /// A net change of the inactive splits: `blocks` in count, `bytes` in bytes.
    fn split_net(&mut self, p: P, blocks: i64, bytes: i64) {
        for (s, n) in [("inactive_split", blocks), ("inactive_split_bytes", bytes)] {
            match n.signum() {
                1 => self.up(s, p, n),
                -1 => self.down(s, p, -n),
                _ => {}
            }
        }
    }

    /// A segment reserved (`alloc_block`).
    fn segment_up(&mut self, p: P, size: i64) {
        self.up("segment", p, 1);
        self.up("reserved_bytes", p, size);
        self.count("num_device_alloc", 1);
    }

    /// A segment released (`release_block`).
    fn segment_down(&mut self, p: P, size: i64) {
        self.down("segment", p, 1);
        self.down("reserved_bytes", p, size);
        self.count("num_device_free", 1);
    }

    /// `resetPeakStats`.
    fn reset_peak(&mut self) {
        let keys: Vec<String> = self.m.keys().filter(|k| k.ends_with(".peak")).cloned().collect();
        for k in keys {
            let cur = self.m[&k.replace(".peak", ".current")];
            self.m.insert(k, cur);
        }
    }

    /// `resetAccumulatedStats`.
    fn reset_accumulated(&mut self) {
        for (k, v) in self.m.iter_mut() {
            let counter = [
                "num_alloc_retries",
                "num_ooms",
                "num_sync_all_streams",
                "num_device_alloc",
                "num_device_free",
                "num_oom_rejections",
            ]
            .contains(&k.as_str());
            if counter || k.ends_with(".allocated") || k.ends_with(".freed") {
                *v = 0;
            }
        }
    }

    /// Every key of `alloc.memory_stats()` equals the model's.
    #[track_caller]
    fn check(&self, alloc: &Allocator<SimDevice>, at: &str) {
        let got = alloc.memory_stats();
        let bad: Vec<String> = self
            .m
            .iter()
            .filter(|(k, v)| got.get(*k) != Some(v))
            .map(|(k, v)| format!("{k}: PyTorch {v}, tidepool {:?}", got.get(k)))
            .collect();
        assert!(bad.is_empty(), "{at}:\n{}", bad.join("\n"));
        assert_eq!(got.len(), self.m.len(), "{at}: the same keys");
        alloc.check_invariants().unwrap();
    }
}

/// Splits and merges in the large pool, PyTorch's placement (`fast_cache:false`): a 20 MiB
/// segment split for 4 MiB, its remainder split again for 4 MiB (an already-split block shrinks:
/// only its bytes move), the last 12 MiB taken whole, then frees that merge with one neighbour
/// and then with the rest of the segment, and `empty_cache`.
#[test]
fn inactive_splits_move_by_the_net_change_of_each_operation() {
    for conf in ["fast_cache:false", "global_lock:true,fast_cache:false", "global_lock:true"] {
        inactive_splits_under(conf);
    }
}

fn inactive_splits_under(conf: &str) {
    let (_dev, alloc) = allocator_on(1 << 30, conf);
    let mut py = Py::new(&alloc);
    let (l, mib) = (P::Large, MIB as i64);

    let a = alloc.alloc(4 * MIB, S0).unwrap();
    py.segment_up(l, 20 * mib);
    py.split_net(l, 1, 16 * mib); // a new split: its 16 MiB remainder
    py.hand_out(l, 4 * mib, 4 * mib);
    py.check(&alloc, "a: a new segment split");

    let b = alloc.alloc(4 * MIB, S0).unwrap();
    assert_eq!(b.ptr().0, a.ptr().0 + 4 * MIB);
    py.split_net(l, 0, -4 * mib); // an already-split block shrinks by what is handed out
    py.hand_out(l, 4 * mib, 4 * mib);
    py.check(&alloc, "b: the split remainder split again");

    let c = alloc.alloc(12 * MIB, S0).unwrap();
    assert_eq!(c.ptr().0, a.ptr().0 + 8 * MIB);
    py.split_net(l, -1, -12 * mib); // the whole remainder: it leaves the inactive splits
    py.hand_out(l, 12 * mib, 12 * mib);
    py.check(&alloc, "c: the whole remainder");

    drop(b);
    py.free_requested(l, 4 * mib);
    py.split_net(l, 1, 4 * mib); // between two allocated blocks
    py.free_completed(l, 4 * mib, 4 * mib);
    py.check(&alloc, "free b");

    drop(c);
    py.free_requested(l, 12 * mib);
    py.split_net(l, 0, 12 * mib); // merges with b's 4 MiB: -1 block -4 MiB, +1 block +16 MiB
    py.free_completed(l, 12 * mib, 12 * mib);
    py.check(&alloc, "free c: merged with one free neighbour");

    drop(a);
    py.free_requested(l, 4 * mib);
    py.split_net(l, -1, -16 * mib); // the whole segment again: no longer split
    py.free_completed(l, 4 * mib, 4 * mib);
    py.check(&alloc, "free a: the segment whole");

    alloc.empty_cache().unwrap();
    py.count("num_sync_all_streams", 1);
    py.segment_down(l, 20 * mib);
    py.check(&alloc, "empty_cache");
}

/// The same in the small pool, with a free between two free neighbours (both merge and the
/// segment stays split): five 512 B blocks from a 2 MiB segment, the first kept to the end.
#[test]
fn a_free_between_two_free_neighbours_counts_one_inactive_split_less() {
    let (_dev, alloc) = allocator_on(1 << 30, "fast_cache:false");
    let mut py = Py::new(&alloc);
    let (s, seg) = (P::Small, 2 * MIB as i64);
    let mut x: Vec<_> = (0..5).map(|_| Some(alloc.alloc(512, S0).unwrap())).collect();
    py.segment_up(s, seg);
    py.split_net(s, 1, seg - 512);
    for _ in 1..5 {
        py.split_net(s, 0, -512);
    }
    for _ in 0..5 {
        py.hand_out(s, 512, 512);
    }
    py.check(&alloc, "five 512 B blocks");
    // (block freed, net inactive-split change in blocks and bytes)
    for (i, blocks, bytes, what) in [
        (1, 1, 512, "a free block of its own"),
        (4, 0, 512, "merged with the tail"),
        (2, 0, 512, "merged with its left neighbour"),
        (3, -1, 512, "both neighbours merged into it"),
        (0, -1, -(seg - 512), "the segment whole"),
    ] {
        drop(x[i].take());
        py.free_requested(s, 512);
        py.split_net(s, blocks, bytes);
        py.free_completed(s, 512, 512);
        py.check(&alloc, &format!("x{i}: {what}"));
    }
    alloc.reset_accumulated_stats();
    py.reset_accumulated();
    py.check(&alloc, "reset_accumulated_stats");
    alloc.reset_peak_stats();
    py.reset_peak();
    py.check(&alloc, "reset_peak_stats");
}

/// A block freed after `record_stream` (or `use_on`) on a busy stream: PyTorch's `free` takes it out of
/// `allocation` and `allocated_bytes` at once; it stays active (and requested) until its event
/// completed and `free_block` returned it (here: the next allocation's `process_events`).
#[test]
fn a_recorded_free_is_active_not_allocated_until_its_event_completes() {
    for (conf, use_on) in [("fast_cache:false", false), ("", false), ("", true)] {
        let (dev, alloc) = allocator_on(1 << 30, conf);
        let t = dev.create_stream().unwrap();
        let mut py = Py::new(&alloc);
        let (s, seg) = (P::Small, 2 * MIB as i64);
        let x = alloc.alloc(1000, S0).unwrap();
        py.segment_up(s, seg);
        py.split_net(s, 1, seg - 1024);
        py.hand_out(s, 1024, 1000);
        py.check(&alloc, &format!("{conf}: x"));
        let (k, open) = common::gated(x.ptr(), 1024, AccessKind::Read);
        dev.launch(t, k).unwrap();
        match use_on {
            true => x.use_on(t, AccessKind::Read).unwrap(),
            false => x.record_stream(t).unwrap(),
        }
        drop(x);
        py.free_requested(s, 1024);
        py.check(&alloc, &format!("{conf}: x freed, its event pending"));
        open.send(()).unwrap();
        dev.synchronize().unwrap();
        // The next allocation processes the completed event first, then takes the block back.
        let y = alloc.alloc(1000, S0).unwrap();
        py.free_completed(s, 1024, 1000);
        py.split_net(s, -1, -(seg - 1024)); // merged: the segment whole
        py.split_net(s, 1, seg - 1024); // and split again for y
        py.hand_out(s, 1024, 1000);
        py.check(&alloc, &format!("{conf}: y after the event completed"));
        drop(y);
        py.free_requested(s, 1024);
        py.free_completed(s, 1024, 1000);
        if !conf.is_empty() {
            py.split_net(s, -1, -(seg - 1024));
        } // else the stream cache keeps y out of the pool: freed, the segment still split
        py.check(&alloc, &format!("{conf}: y freed"));
        drop(alloc);
        common::assert_no_leak(&dev);
    }
}

/// Out of memory, PyTorch's ladder (`malloc`): no cached block fits, `cudaMalloc` fails, the
/// cached blocks are released after a wait for every event (`release_cached_blocks`:
/// `num_sync_all_streams` + 1, each segment `num_device_free` + 1), the last `alloc_block` is a
/// retry (`num_alloc_retries` + 1 whether it succeeds or not), and a failure is one
/// `num_ooms`. A 64 MiB device, a live 40 MiB segment, a cached 12 MiB one.
#[test]
fn out_of_memory_retries_and_failures_count_as_pytorchs() {
    for conf in ["fast_cache:false", ""] {
        let (dev, alloc) = allocator_on(64 * MIB, conf);
        let mut py = Py::new(&alloc);
        let (l, mib) = (P::Large, MIB as i64);
        let big = alloc.alloc(40 * MIB, S0).unwrap();
        py.segment_up(l, 40 * mib);
        py.hand_out(l, 40 * mib, 40 * mib);
        let cached = alloc.alloc(12 * MIB, S0).unwrap();
        py.segment_up(l, 12 * mib);
        py.hand_out(l, 12 * mib, 12 * mib);
        drop(cached);
        py.free_requested(l, 12 * mib);
        py.free_completed(l, 12 * mib, 12 * mib);
        py.check(&alloc, &format!("{conf}: 40 MiB live, 12 MiB cached"));

        // 30 MiB: 12 MiB of the device free; released, 24 MiB: still out of memory.
        assert!(alloc.alloc(30 * MIB, S0).is_err());
        py.count("num_sync_all_streams", 1);
        py.segment_down(l, 12 * mib);
        py.count("num_alloc_retries", 1);
        py.count("num_ooms", 1);
        py.check(&alloc, &format!("{conf}: 30 MiB refused"));
        assert_eq!(dev.reserved_bytes(), 40 * MIB);

        // 12 MiB cached again, then 20 MiB: fits once the cached segment is released.
        let again = alloc.alloc(12 * MIB, S0).unwrap();
        py.segment_up(l, 12 * mib);
        py.hand_out(l, 12 * mib, 12 * mib);
        drop(again);
        py.free_requested(l, 12 * mib);
        py.free_completed(l, 12 * mib, 12 * mib);
        let fits = alloc.alloc(20 * MIB, S0).unwrap();
        py.count("num_sync_all_streams", 1);
        py.segment_down(l, 12 * mib);
        py.count("num_alloc_retries", 1);
        py.segment_up(l, 20 * mib);
        py.hand_out(l, 20 * mib, 20 * mib);
        py.check(&alloc, &format!("{conf}: 20 MiB after a release"));
        for (b, size) in [(fits, 20 * mib), (big, 40 * mib)] {
            drop(b);
            py.free_requested(l, size);
            py.free_completed(l, size, size);
        }
        py.check(&alloc, &format!("{conf}: both freed"));
    }
}

/// `max_split_size_mb:40`: a 50 MiB segment is an oversize segment, its block an oversize
/// allocation while live, never split; a 45 MiB request takes it whole (within 20 MiB of it:
/// `max_non_split_rounding`), a 30 MiB request may not (a new segment). Peaks and totals of
/// the oversize figures through `reset_peak_stats` and `reset_accumulated_stats`.
#[test]
fn oversize_figures_follow_pytorchs_rules() {
    for conf in ["max_split_size_mb:40,fast_cache:false", "max_split_size_mb:40"] {
        let (_dev, alloc) = allocator_on(1 << 30, conf);
        let mut py = Py::new(&alloc);
        assert_eq!(py.m["max_split_size"], 40 << 20);
        let (l, mib) = (P::Large, MIB as i64);
        let a = alloc.alloc(50 * MIB, S0).unwrap();
        py.segment_up(l, 50 * mib);
        py.up_in("oversize_segments", None, 1);
        py.hand_out(l, 50 * mib, 50 * mib);
        py.up_in("oversize_allocations", None, 1);
        py.check(&alloc, &format!("{conf}: 50 MiB"));
        let ptr = a.ptr();
        drop(a);
        py.free_requested(l, 50 * mib);
        py.down_in("oversize_allocations", None, 1);
        py.free_completed(l, 50 * mib, 50 * mib);
        py.check(&alloc, &format!("{conf}: 50 MiB freed"));
        let b = alloc.alloc(45 * MIB, S0).unwrap();
        assert_eq!(b.ptr(), ptr);
        py.hand_out(l, 50 * mib, 45 * mib);
        py.up_in("oversize_allocations", None, 1);
        py.check(&alloc, &format!("{conf}: 45 MiB in the 50 MiB block"));
        let c = alloc.alloc(30 * MIB, S0).unwrap();
        py.segment_up(l, 30 * mib);
        py.hand_out(l, 30 * mib, 30 * mib);
        py.check(&alloc, &format!("{conf}: 30 MiB in a segment of its own"));
        alloc.reset_peak_stats();
        py.reset_peak();
        drop(b);
        py.free_requested(l, 50 * mib);
        py.down_in("oversize_allocations", None, 1);
        py.free_completed(l, 50 * mib, 45 * mib);
        py.check(&alloc, &format!("{conf}: peaks reset, 45 MiB freed"));
        alloc.reset_accumulated_stats();
        py.reset_accumulated();
        py.check(&alloc, &format!("{conf}: totals reset"));
        alloc.empty_cache().unwrap();
        py.count("num_sync_all_streams", 1);
        py.segment_down(l, 50 * mib);
        py.down_in("oversize_segments", None, 1);
        py.check(&alloc, &format!("{conf}: empty_cache"));
        drop(c);
        py.free_requested(l, 30 * mib);
        py.free_completed(l, 30 * mib, 30 * mib);
        if conf.contains("fast_cache:false") {
            py.check(&alloc, &format!("{conf}: all freed"));
        }
    }
}

/// `reset_peak_stats` while a stream cache holds a freed block (credit under the old peak):
/// the next hit passes the new peak and must raise it exactly, as PyTorch's would (its pool
/// hands the same block back; the stream cache keeps it out of the inactive splits meanwhile,
/// the documented difference, so those figures do not move here).
#[test]
fn a_peak_reset_while_a_lane_holds_credit_keeps_peaks_exact() {
    let (_dev, alloc) = allocator_on(1 << 30, "");
    let mut py = Py::new(&alloc);
    let (s, seg) = (P::Small, 2 * MIB as i64);
    let x = alloc.alloc(4000, S0).unwrap();
    py.segment_up(s, seg);
    py.split_net(s, 1, seg - 4096);
    py.hand_out(s, 4096, 4000);
    let y = alloc.alloc(4096, S0).unwrap();
    py.split_net(s, 0, -4096);
    py.hand_out(s, 4096, 4096);
    py.check(&alloc, "x and y");
    let xp = x.ptr();
    drop(x); // into the stream's cache
    py.free_requested(s, 4096);
    py.free_completed(s, 4096, 4000);
    py.check(&alloc, "x cached");
    alloc.reset_peak_stats();
    py.reset_peak();
    py.check(&alloc, "peaks reset");
    let x2 = alloc.alloc(3900, S0).unwrap(); // the cached block again
    assert_eq!(x2.ptr(), xp);
    py.hand_out(s, 4096, 3900);
    py.check(&alloc, "x2: past the reset peak");
    drop(x2);
    py.free_requested(s, 4096);
    py.free_completed(s, 4096, 3900);
    drop(y);
    py.free_requested(s, 4096);
    py.free_completed(s, 4096, 4096);
    py.check(&alloc, "both freed");
    alloc.reset_peak_stats();
    py.reset_peak();
    // Twice the same request: the first a hit, the second from the pool.
    let a = alloc.alloc(4096, S0).unwrap();
    let b = alloc.alloc(4096, S0).unwrap();
    assert_ne!(a.ptr(), b.ptr());
    let s2 = alloc.stats();
    assert_eq!(s2.blocks.allocated_bytes.all.peak, 8192);
    assert_eq!(s2.blocks.allocation.small_pool.peak, 2);
    assert_eq!(s2.blocks.requested_bytes.transient.peak, 8192);
    drop((a, b));
    alloc.empty_cache().unwrap();
    let m = alloc.memory_stats();
    for (k, v) in &m {
        if k.ends_with(".current") {
            assert_eq!(*v, 0, "{k} after empty_cache");
        }
    }
}

/// Four threads on streams of their own: cycles of lock-free hits, a peak reset between two
/// barriers, each thread then holding three blocks (the main thread reads the exact current
/// and peak), then more cycles with the main thread reading all along (`current ≤ peak`, the
/// cells summing to `all`); once quiet, the exact totals.
#[test]
fn threads_on_streams_of_their_own_leave_exact_totals() {
    use std::sync::Barrier;
    use std::sync::atomic::{AtomicBool, Ordering};
    const T: u64 = 4;
    const N: u64 = 500;
    const H: u64 = 3;
    let (dev, alloc) = allocator_on(1 << 30, "");
    let streams: Vec<StreamId> = (0..T).map(|_| dev.create_stream().unwrap()).collect();
    let barrier = Barrier::new(T as usize + 1);
    let done = AtomicBool::new(false);
    // The main thread's reads are checked once every thread has ended (a failed check in
    // the middle would leave the workers waiting at a barrier).
    let (s1, s2, reads) = std::thread::scope(|sc| {
        let mut workers = Vec::new();
        for &s in &streams {
            let (alloc, barrier) = (&alloc, &barrier);
            workers.push(sc.spawn(move || {
                for i in 0..N {
                    drop(alloc.alloc(4000 + i % 96, s).unwrap());
                }
                barrier.wait(); // phase 1 done
                barrier.wait(); // peaks reset
                let held: Vec<_> = (0..H).map(|_| alloc.alloc(4096, s).unwrap()).collect();
                barrier.wait(); // the main thread reads
                barrier.wait();
                drop(held);
                for i in 0..N {
                    drop(alloc.alloc(4000 + i % 96, s).unwrap());
                }
            }));
        }
        barrier.wait();
        let s1 = alloc.stats();
        alloc.reset_peak_stats();
        barrier.wait();
        barrier.wait();
        let s2 = alloc.stats();
        barrier.wait();
        let reader = sc.spawn(|| {
            let mut reads = 0u64;
            while !done.load(Ordering::Relaxed) || reads == 0 {
                let s = alloc.stats();
                for g in [&s.blocks.allocated_bytes, &s.blocks.allocation, &s.blocks.active_bytes] {
                    for c in [g.all, g.small_pool, g.large_pool, g.persistent, g.transient] {
                        assert!(c.current <= c.peak, "{c:?}");
                        assert_eq!(c.allocated - c.freed, c.current, "{c:?}");
                    }
                    assert_eq!(g.all.current, g.small_pool.current + g.large_pool.current);
                    assert!(g.all.peak <= T * H * 4096, "{:?}", g.all);
                }
                reads += 1;
            }
            reads
        });
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        (s1, s2, reader.join().unwrap())
    });
    assert!(reads > 0);
    assert_eq!(s1.blocks.allocation.all.allocated, T * N);
    assert_eq!(s1.blocks.allocated_bytes.all.current, 0);
    // (`cross_stream:strict` may hand a stream's whole free segment to another stream: at
    // most a segment per stream, each 2 MiB.)
    let segs = s1.blocks.segment.all.current;
    assert!((1..=T).contains(&segs), "{segs}");
    assert_eq!(s1.blocks.reserved_bytes.all.current, segs * 2 * MIB);
    let b = &s2.blocks;
    assert_eq!(b.allocated_bytes.all.current, T * H * 4096);
    assert_eq!(b.allocated_bytes.all.peak, T * H * 4096);
    assert_eq!(b.allocation.small_pool.peak, T * H);
    assert_eq!(b.active_bytes.transient.peak, T * H * 4096);
    assert_eq!(b.requested_bytes.all.current, T * H * 4096);
    assert_eq!(b.requested_bytes.all.peak, T * H * 4096);
    let segs = b.segment.all.current;
    assert!(segs >= T, "each stream holds live blocks: {segs}");
    assert_eq!(b.reserved_bytes.all.current, segs * 2 * MIB);
    let s = alloc.stats();
    let b = &s.blocks;
    let count = T * (2 * N + H);
    let bytes_of_cycles: u64 = (0..N).map(|i| 4000 + i % 96).sum();
    let rounded_cycles: u64 = (0..N).map(|i| (4000 + i % 96u64).div_ceil(512) * 512).sum();
    assert_eq!(b.allocation.all.allocated, count);
    assert_eq!(b.allocation.all.freed, count);
    assert_eq!(b.allocated_bytes.all.allocated, T * (2 * rounded_cycles + H * 4096));
    assert_eq!(b.requested_bytes.all.allocated, T * (2 * bytes_of_cycles + H * 4096));
    assert_eq!(b.requested_bytes.all.freed, b.requested_bytes.all.allocated);
    assert_eq!(b.allocated_bytes.all.peak, T * H * 4096, "no thread held more after the reset");
    assert_eq!((b.allocated_bytes.all.current, b.active_bytes.all.current), (0, 0));
    assert_eq!(s.lock_free_allocations() + s.locked_allocations, count);
    alloc.check_invariants().unwrap();
}

/// What the device says the allocator holds, against what its statistics say: reserved bytes
/// (segments plus mapped pages of distinct physical memory), device calls, and allocated bytes
/// against the live buffers.
#[track_caller]
fn device_agrees(
    dev: &SimDevice,
    alloc: &Allocator<SimDevice>,
    live: &[tidepool::Buffer<SimDevice>],
    at: &str,
) {
    let s = alloc.stats();
    let b = &s.blocks;
    // A stitched chunk is mapped twice (its home and the stitched block): counted once.
    let mapped: u64 = {
        let mut seen = std::collections::BTreeMap::new();
        for (_, bytes, h) in dev.live_mappings_with_handles() {
            seen.entry(h).or_insert(bytes);
        }
        seen.values().sum()
    };
    assert_eq!(b.reserved_bytes.all.current, dev.reserved_bytes() + mapped, "{at}: reserved");
    assert_eq!(dev.physical_bytes(), mapped, "{at}: every physical chunk mapped");
    let (c, vm) = (dev.counters(), dev.vm_counters());
    assert_eq!((s.num_device_alloc, s.num_device_free), (c.mallocs, c.frees), "{at}: segments");
    assert_eq!((s.num_device_map, s.num_device_unmap), (vm.maps, vm.unmaps), "{at}: maps");
    assert_eq!(
        (s.num_physical_create, s.num_physical_release),
        (vm.creates, vm.releases),
        "{at}: physical"
    );
    let m = alloc.memory_stats();
    assert_eq!(m["num_device_alloc"] as u64, c.mallocs + vm.maps, "{at}");
    assert_eq!(m["num_device_free"] as u64, c.frees + vm.unmaps, "{at}");
    let rounded: u64 = live.iter().map(|x| x.len().div_ceil(512) * 512).sum();
    let live_bytes: u64 = live.iter().map(|x| x.len()).sum();
    assert!(b.allocated_bytes.all.current >= rounded, "{at}: allocated");
    assert_eq!(b.requested_bytes.all.current, live_bytes, "{at}: requested");
    assert_eq!(b.allocation.all.current, live.len() as u64, "{at}: allocations");
    alloc.check_invariants().unwrap();
}

/// A device call that fails in the middle of an operation (a segment reservation, a physical
/// allocation, a mapping, an unmapping) leaves statistics that agree with the device to the
/// byte and with the live buffers, after every step: a program of allocations, frees and
/// `empty_cache`, run once per fault point of every kind, with and without expandable segments.
#[test]
fn injected_device_faults_leave_no_drift_in_the_statistics() {
    type Fault = fn(&SimDevice, u64);
    let faults: [(&str, Fault); 4] = [
        ("malloc", |d, n| d.fail_nth_malloc(Some(n))),
        ("vm_create", |d, n| d.fail_nth_vm_create(Some(n))),
        ("vm_map", |d, n| d.fail_nth_vm_map(Some(n))),
        ("vm_unmap", |d, n| d.fail_nth_vm_unmap(Some(n))),
    ];
    for conf in ["expandable_segments:true", "", "expandable_segments:true,fast_cache:false"] {
        for (name, fault) in faults {
            for n in 1..=8 {
                let (dev, alloc) = allocator_on(256 * MIB, conf);
                let t = dev.create_stream().unwrap();
                fault(&dev, n);
                let at = |i: usize| format!("{conf} {name} #{n}, step {i}");
                let mut live: Vec<tidepool::Buffer<SimDevice>> = Vec::new();
                let sizes = [3 * MIB, 700 << 10, 25 * MIB, 5 * MIB, 1000, 12 * MIB, 40 * MIB];
                for (i, &size) in sizes.iter().enumerate() {
                    let stream = if i % 3 == 2 { t } else { S0 };
                    if let Ok(x) = alloc.alloc(size, stream) {
                        live.push(x);
                    }
                    device_agrees(&dev, &alloc, &live, &at(i));
                    if i % 2 == 1 {
                        drop(live.remove(0));
                        device_agrees(&dev, &alloc, &live, &at(i));
                    }
                    if i == 4 {
                        let _ = alloc.empty_cache();
                        device_agrees(&dev, &alloc, &live, &at(i));
                    }
                }
                live.clear();
                let _ = alloc.empty_cache();
                device_agrees(&dev, &alloc, &live, &format!("{conf} {name} #{n}: all freed"));
                let _ = alloc.empty_cache();
                let s = alloc.stats();
                assert_eq!(s.blocks.allocated_bytes.all.current, 0);
                assert_eq!(s.blocks.active_bytes.all.current, 0);
            }
        }
    }
}

/// PyTorch's `reset_peak_memory_stats` and `reset_accumulated_memory_stats` reset the device's
/// figures, every pool's memory included (private pools count in the same `DeviceStats`):
/// the general allocator's resets reach its private pools' figures (a `MemPool`'s, a CUDA
/// graph's pool's), and a pool's own resets reach the pool alone.
#[test]
fn the_general_allocators_resets_reach_its_private_pools() {
    let (dev, alloc) = allocator_on(1 << 30, "");
    let s = dev.create_stream().unwrap();
    let pool = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
    let (a, b) = {
        let _guard = alloc.use_pool(&pool, s).unwrap();
        (alloc.alloc(8 * MIB, s).unwrap(), alloc.alloc(4096, s).unwrap())
    };
    let (graph, out) = alloc.capture(s, None, || alloc.alloc(3 * MIB, s).unwrap()).unwrap();
    let general = alloc.alloc(4096, S0).unwrap();
    drop(a);
    let peak = |m: &BTreeMap<String, i64>| m["allocated_bytes.all.peak"];
    let (p, g) = (pool.memory_stats(), graph.pool().memory_stats());
    assert_eq!((p["allocated_bytes.all.current"], peak(&p)), (4096, 8 * MIB as i64 + 4096));
    assert_eq!((g["allocated_bytes.all.current"], peak(&g)), (3 * MIB as i64, 3 * MIB as i64));
    assert_eq!(p["allocation.all.allocated"], 2);

    // A pool's own reset: that pool alone.
    pool.reset_peak_stats();
    assert_eq!(peak(&pool.memory_stats()), 4096);
    pool.reset_accumulated_stats();
    assert_eq!(pool.memory_stats()["allocation.all.allocated"], 0);
    let g = graph.pool().memory_stats();
    assert_eq!((peak(&g), g["allocation.all.allocated"]), (3 * MIB as i64, 1));
    assert_eq!(alloc.memory_stats()["allocation.all.allocated"], 1);

    // The general allocator's: every pool of the family with it.
    let more = {
        let _guard = alloc.use_pool(&pool, s).unwrap();
        alloc.alloc(MIB, s).unwrap()
    };
    drop((more, out));
    alloc.reset_peak_stats();
    alloc.reset_accumulated_stats();
    for (who, m) in [
        ("general", alloc.memory_stats()),
        ("pool", pool.memory_stats()),
        ("graph pool", graph.pool().memory_stats()),
    ] {
        for (k, v) in &m {
            if k.ends_with(".peak") {
                let cur = m[&k.replace(".peak", ".current")];
                assert_eq!(*v, cur, "{who}: {k} after the general allocator's reset");
            }
            if k.ends_with(".allocated") || k.ends_with(".freed") || k.starts_with("num_") {
                assert_eq!(*v, 0, "{who}: {k} after the general allocator's reset");
            }
        }
    }
    assert_eq!(peak(&pool.memory_stats()), 4096);
    assert_eq!(peak(&graph.pool().memory_stats()), 0);
    drop((b, general, graph, pool));
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 0);
}

/// `memory_summary()` ends its table with PyTorch's last two rows, "Oversize allocations" and
/// "Oversize GPU segments", with all four figures (current, peak, total allocated, total freed)
/// as `memory_stats()` has them.
#[test]
fn memory_summary_shows_the_oversize_rows_with_all_four_figures() {
    let (_dev, alloc) = allocator_on(1 << 30, "max_split_size_mb:40");
    let a = alloc.alloc(50 * MIB, S0).unwrap();
    let b = alloc.alloc(60 * MIB, S0).unwrap();
    drop(a);
    let m = alloc.memory_stats();
    let row = |name: &str, key: &str| {
        let f = |field: &str| m[&format!("{key}.{field}")];
        format!(
            "| {:<26}| {:>12} | {:>12} | {:>12} | {:>12} |",
            name,
            f("current"),
            f("peak"),
            f("allocated"),
            f("freed")
        )
    };
    let (allocs, segs) = (
        row("Oversize allocations", "oversize_allocations"),
        row("Oversize GPU segments", "oversize_segments"),
    );
    assert_eq!(
        allocs,
        format!(
            "| {:<26}| {:>12} | {:>12} | {:>12} | {:>12} |",
            "Oversize allocations", 1, 2, 2, 1
        )
    );
    assert_eq!(
        segs,
        format!(
            "| {:<26}| {:>12} | {:>12} | {:>12} | {:>12} |",
            "Oversize GPU segments", 2, 2, 2, 0
        )
    );
    let summary = alloc.memory_summary();
    let lines: Vec<&str> = summary.lines().collect();
    let at = |r: &str| {
        lines.iter().position(|l| *l == r).unwrap_or_else(|| panic!("no row {r:?} in\n{summary}"))
    };
    assert_eq!(at(&segs), at(&allocs) + 2, "one rule between them:\n{summary}");
    assert!(
        at(&allocs) > lines.iter().position(|l| l.starts_with("| Non-releasable allocs")).unwrap()
    );
    drop(b);
}

/// Requests PyTorch counts nowhere: a zero-byte request (an empty buffer, no block), one
/// above the largest request (`InvalidSize`, not out of memory), a bad alignment, a stream the
/// device does not have. No figure of `memory_stats()` moves.
#[test]
fn refused_and_empty_requests_count_nowhere() {
    let (dev, alloc) = allocator_on(1 << 30, "");
    let keep = alloc.alloc(4096, S0).unwrap();
    let py = Py::new_after(&alloc);
    let empty = alloc.alloc(0, S0).unwrap();
    assert_eq!(empty.len(), 0);
    py.check(&alloc, "a zero-byte request");
    drop(empty);
    py.check(&alloc, "its free");
    assert!(alloc.alloc(1 << 60, S0).is_err());
    py.check(&alloc, "a request above the largest");
    assert!(alloc.alloc_aligned(4096, 3000, S0).is_err());
    py.check(&alloc, "a bad alignment");
    assert!(alloc.alloc(4096, StreamId(4242)).is_err());
    py.check(&alloc, "an unknown stream");
    drop(keep);
    drop(alloc);
    common::assert_no_leak(&dev);
}

/// A stream cache's hit for more requested bytes than the block it reuses was freed with
/// (the same 3 KiB size class, 3000 B freed, 3072 B asked): `requested_bytes` passes its peak
/// by the difference, which the lane holds no credit for; the peak must follow exactly.
#[test]
fn a_hit_asking_more_than_the_freed_request_raises_the_requested_peak() {
    let (_dev, alloc) = allocator_on(1 << 30, "");
    let mut py = Py::new(&alloc);
    let (s, seg) = (P::Small, 2 * MIB as i64);
    let y = alloc.alloc(4096, S0).unwrap();
    py.segment_up(s, seg);
    py.split_net(s, 1, seg - 4096);
    py.hand_out(s, 4096, 4096);
    let x = alloc.alloc(3000, S0).unwrap();
    py.split_net(s, 0, -3072);
    py.hand_out(s, 3072, 3000);
    py.check(&alloc, "y and x");
    let xp = x.ptr();
    drop(x);
    py.free_requested(s, 3072);
    py.free_completed(s, 3072, 3000);
    for (i, asked) in [3072, 2600, 3071, 3072].into_iter().enumerate() {
        let again = alloc.alloc(asked, S0).unwrap();
        assert_eq!(again.ptr(), xp, "a hit of the stream's cache");
        py.hand_out(s, 3072, asked as i64);
        py.check(&alloc, &format!("hit {i}: {asked} B asked"));
        drop(again);
        py.free_requested(s, 3072);
        py.free_completed(s, 3072, asked as i64);
        py.check(&alloc, &format!("hit {i} freed"));
    }
    drop(y);
}

/// The same through a stream's large block (lane 0 keeps one freed large block and hands it
/// back lock-free once checked): 4 MiB blocks of a 20 MiB segment reused for requests of
/// 4 MiB − 400 B and 4 MiB, back and forth; requested bytes and their peak follow exactly.
/// (The cached block stays out of the pool, so the inactive splits do not move: the
/// documented difference.)
#[test]
fn a_large_hit_asking_more_than_the_freed_request_raises_the_requested_peak() {
    let (_dev, alloc) = allocator_on(1 << 30, "");
    let mut py = Py::new(&alloc);
    let (l, mib) = (P::Large, MIB as i64);
    let x = alloc.alloc(4 * MIB - 400, S0).unwrap();
    py.segment_up(l, 20 * mib);
    py.split_net(l, 1, 16 * mib);
    py.hand_out(l, 4 * mib, 4 * mib - 400);
    py.check(&alloc, "x");
    let (xp, mut asked) = (x.ptr(), 4 * MIB - 400);
    drop(x);
    py.free_requested(l, 4 * mib);
    py.free_completed(l, 4 * mib, asked as i64);
    for (i, next) in [4 * MIB, 4 * MIB - 400, 4 * MIB, 4 * MIB].into_iter().enumerate() {
        let again = alloc.alloc(next, S0).unwrap();
        assert_eq!(again.ptr(), xp);
        py.hand_out(l, 4 * mib, next as i64);
        py.check(&alloc, &format!("large hit {i}: {next} B asked after {asked} B"));
        asked = next;
        drop(again);
        py.free_requested(l, 4 * mib);
        py.free_completed(l, 4 * mib, asked as i64);
        py.check(&alloc, &format!("large hit {i} freed"));
    }
}

/// Streams made and destroyed without end, each leaving freed blocks in its stream caches
/// (whose lanes the next streams take over): after every `destroy_stream` the statistics agree
/// with the device and the live buffers, no figure keeps a gone stream's blocks, and the
/// per-stream cached bytes name only streams that exist.
#[test]
fn destroyed_streams_leave_no_figures_behind() {
    let (dev, alloc) = allocator_on(1 << 30, "");
    let keep = alloc.alloc(4096, S0).unwrap();
    let live = vec![keep];
    for round in 0..80u64 {
        let s = dev.create_stream().unwrap();
        let small = alloc.alloc(4096 + 512 * (round % 4), s).unwrap();
        let large = alloc.alloc(3 * MIB, s).unwrap();
        drop((small, large)); // into the stream's caches
        let st = alloc.stats();
        assert!(st.cached_free_bytes_per_stream.iter().any(|&(id, _)| id == s.0), "{round}");
        alloc.destroy_stream(s).unwrap();
        device_agrees(&dev, &alloc, &live, &format!("round {round}"));
        let st = alloc.stats();
        for &(id, bytes) in &st.cached_free_bytes_per_stream {
            assert!(id == S0.0, "round {round}: stream {id} is gone, {bytes} B cached for it");
        }
        let b = &st.blocks;
        assert_eq!((b.allocation.all.current, b.active.all.current), (1, 1), "round {round}");
        assert_eq!(b.allocated_bytes.all.current, 4096, "round {round}");
    }
    alloc.empty_cache().unwrap();
    let m = alloc.memory_stats();
    assert_eq!(m["segment.all.current"], 1);
    assert_eq!(m["reserved_bytes.all.current"], 2 * MIB as i64);
    assert_eq!(m["allocation.all.allocated"], 1 + 2 * 80);
    drop(live);
}

/// Four threads on one stream (sharing its lanes) each hold at most one 4 KiB block at a time,
/// while another thread resets the peaks and reads the statistics without pause: no peak may
/// ever show more than was live at once (four blocks), none may fall below its current, and
/// once quiet the totals are exact.
#[test]
fn peaks_never_pass_what_was_live_under_concurrent_resets() {
    use std::sync::atomic::{AtomicBool, Ordering};
    const T: u64 = 4;
    const N: u64 = 2000;
    let (dev, alloc) = allocator_on(1 << 30, "");
    let s = dev.create_stream().unwrap();
    let done = AtomicBool::new(false);
    let reads = std::thread::scope(|sc| {
        let workers: Vec<_> = (0..T)
            .map(|k| {
                let alloc = &alloc;
                sc.spawn(move || {
                    for i in 0..N {
                        // Requests of 3585..=4096 B: one size class, requests that differ.
                        drop(alloc.alloc(4096 - (i * 7 + k * 131) % 512, s).unwrap());
                    }
                })
            })
            .collect();
        let reader = sc.spawn(|| {
            let mut reads = 0u64;
            let mut bad = Vec::new();
            while !done.load(Ordering::Relaxed) || reads == 0 {
                if reads.is_multiple_of(3) {
                    alloc.reset_peak_stats();
                }
                let b = alloc.stats().blocks;
                for (name, g, most) in [
                    ("allocated_bytes", b.allocated_bytes, T * 4096),
                    ("active_bytes", b.active_bytes, T * 4096),
                    ("requested_bytes", b.requested_bytes, T * 4096),
                    ("allocation", b.allocation, T),
                    ("active", b.active, T),
                ] {
                    for c in [g.all, g.small_pool, g.transient] {
                        if c.current > c.peak || c.peak > most {
                            bad.push(format!("read {reads}: {name} {c:?} (at most {most})"));
                        }
                    }
                }
                reads += 1;
            }
            (reads, bad)
        });
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        reader.join().unwrap()
    });
    assert!(reads.1.is_empty(), "{:#?}", &reads.1[..reads.1.len().min(10)]);
    let b = alloc.stats().blocks;
    assert_eq!(b.allocation.all.allocated, T * N);
    assert_eq!((b.allocated_bytes.all.current, b.requested_bytes.all.current), (0, 0));
    let asked: u64 = (0..T).flat_map(|k| (0..N).map(move |i| 4096 - (i * 7 + k * 131) % 512)).sum();
    assert_eq!(b.requested_bytes.all.allocated, asked);
    assert_eq!(b.allocated_bytes.all.allocated, T * N * 4096);
    alloc.check_invariants().unwrap();
}

/// The figures a read takes besides the block figures — the oversize ones, the waits for every
/// event, best-fit searches, locked allocations, the plans' region bytes — are in the same
/// copy as the block figures: work done between a read's copy and the rest of that read
/// (`after_next_collect`, a stand-in for another thread's lock section there) shows in none
/// of its figures. Before, they were read after the copy, apart from it, and that read showed
/// oversize blocks and segments, a wait, searches, locked allocations and a region against
/// 0 bytes allocated and reserved.
#[test]
fn a_read_takes_the_figures_beside_the_blocks_in_the_same_copy() {
    use std::sync::Mutex;
    let conf = "max_split_size_mb:20";
    // An oversize block (its own 40 MiB segment), a wait for every event, and a named scope's
    // first run, whose end adopts its segment as the plan's region.
    let work = |a: &Allocator<SimDevice>| {
        let keep = a.alloc(40 * MIB, S0).unwrap();
        a.synchronize().unwrap();
        let scope = a.named_scope("step", S0);
        drop(scope.alloc(4 * MIB).unwrap());
        drop(scope);
        keep
    };
    // (allocated, reserved, oversize allocations and segments, sync-alls, searches, locked
    // allocations, region bytes)
    let figures = |s: &tidepool::MemoryStats| {
        (
            s.blocks.allocated_bytes.all.current,
            s.blocks.reserved_bytes.all.current,
            s.oversize_allocations.current,
            s.oversize_segments.current,
            s.num_sync_all_streams,
            s.best_fit_searches,
            s.locked_allocations,
            s.plan_region_bytes,
        )
    };
    // The same work on another allocator, read after it: what the figures must be.
    let (_, other) = allocator_on(1 << 30, conf);
    let kept = work(&other);
    let expected = figures(&other.stats());
    assert_eq!(expected, (44 * MIB, 60 * MIB, 1, 2, 1, 3, 2, 4 * MIB));
    let (_dev, alloc) = allocator_on(1 << 30, conf);
    let before = alloc.stats();
    assert_eq!(figures(&before), (0, 0, 0, 0, 0, 0, 0, 0));
    let held = Arc::new(Mutex::new(Vec::new()));
    let (a, h) = (alloc.clone(), held.clone());
    alloc.after_next_collect(move || h.lock().unwrap().push(work(&a)));
    let seen = alloc.stats();
    assert_eq!(held.lock().unwrap().len(), 1, "the work ran inside the read");
    assert_eq!(figures(&seen), figures(&before), "a torn read");
    assert_eq!(figures(&alloc.stats()), expected, "all of the work, read again");
    alloc.check_invariants().unwrap();
    drop((held, kept));
}

/// A stream cache's block accounted under the lock (here: asked for more bytes than its freed
/// request, past the requested bytes' credit) comes after the completed pending frees joined
/// the pool, as in PyTorch's `malloc`, so no peak rises by bytes PyTorch had freed. `x` (1000 B,
/// used on `t`) is pending, `z` (600 B) waits in the lane; once `t`'s work completed, `y`
/// (1000 B) takes `z`'s block: PyTorch's figures are `y`'s alone and the peaks stay those of
/// `x` and `z` live together (active 2048, requested 1600). Before, `x` was still counted
/// active and requested as `y` was accounted: the requested peak rose to 2000, for good (and
/// active bytes read 2048 until a later allocation polled).
#[test]
fn a_locked_pop_counts_after_the_completed_pending_frees() {
    let (dev, alloc) = allocator_on(1 << 30, "");
    let t = dev.create_stream().unwrap();
    let x = alloc.alloc(1000, S0).unwrap();
    let z = alloc.alloc(600, S0).unwrap();
    let (k, open) = common::gated(x.ptr(), 1024, AccessKind::Read);
    dev.launch(t, k).unwrap();
    x.record_stream(t).unwrap();
    drop(x); // pending on t's event
    let z_ptr = z.ptr();
    drop(z); // into the stream's cache
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    let y = alloc.alloc(1000, S0).unwrap();
    assert_eq!(y.ptr(), z_ptr, "the cached block");
    let m = alloc.memory_stats();
    let fig = |k: &str| m[k];
    assert_eq!(
        (fig("requested_bytes.all.current"), fig("requested_bytes.all.peak")),
        (1000, 1600),
        "requested bytes: y's; the peak of x and z"
    );
    assert_eq!(
        (fig("active_bytes.all.current"), fig("active_bytes.all.peak")),
        (1024, 2048),
        "active bytes: y's; the peak of x and z"
    );
    assert_eq!((fig("active.all.current"), fig("active.all.peak")), (1, 2));
    drop(y);
    alloc.check_invariants().unwrap();
}

/// The second column (after the name) of every row of `summary` whose name starts with `name`.
fn summary_cells(summary: &str, name: &str) -> Vec<String> {
    summary
        .lines()
        .filter_map(|l| l.strip_prefix("| ")?.strip_prefix(name).map(|_| l))
        .map(|l| l.split('|').nth(2).unwrap().trim().to_string())
        .collect()
}

/// `memory_summary()` is one moment's table: the expandable ranges' rows and the statistics
/// beside them are read in one lock section, so the ranges' mapped bytes add up to the
/// reserved memory it prints. (The ranges were read in a lock section of their own and the
/// statistics after it: another thread's growth in between showed in the reserved row and the
/// map count with no range of its own.) `after_next_view` runs its window right after the
/// summary's read (between the two reads in the broken build `summary_apart`).
#[test]
fn memory_summary_reads_its_ranges_and_figures_in_one_moment() {
    let (dev, alloc) = allocator_on(1 << 30, "expandable_segments:true");
    let s = dev.create_stream().unwrap();
    let a = alloc.alloc(3 * MIB, S0).unwrap();
    let before = alloc.stats();
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (other, held2) = (alloc.clone(), held.clone());
    alloc.after_next_view(move || {
        // Another thread grows a range of its own stream meanwhile.
        held2.lock().unwrap().push(other.alloc(3 * MIB, s).unwrap());
    });
    let summary = alloc.memory_summary();
    let reserved = before.blocks.reserved_bytes.all.current;
    let shown = |b: u64| tidepool::Bytes(b).to_string();
    assert_eq!(summary_cells(&summary, "Range "), vec![shown(reserved)], "{summary}");
    assert_eq!(summary_cells(&summary, "Reserved memory"), vec![shown(reserved)], "{summary}");
    let maps = format!("{} maps", before.num_device_map);
    assert!(summary.contains(&maps), "{maps}: {summary}");
    // The other thread's growth is in the next one.
    let after = alloc.stats().blocks.reserved_bytes.all.current;
    assert!(after > reserved);
    let summary = alloc.memory_summary();
    assert_eq!(summary_cells(&summary, "Range ").len(), 2, "{summary}");
    assert_eq!(summary_cells(&summary, "Reserved memory"), vec![shown(after)], "{summary}");
    drop((a, held));
}
