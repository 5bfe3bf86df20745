//! The controls PyTorch and RMM users reach for (issue 18), on SimDevice with exact figures:
//! garbage_collection_threshold, initial and maximum pool size, alloc_aligned, caching:false
//! (pass-through), and the statistics num_sync_all_streams, oversize_* and
//! reset_accumulated_stats. Each control's deliberate bug (`Broken`) is shown to be caught.

use std::collections::BTreeSet;
use std::sync::Arc;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SimDevice};
use tidepool::hooks::Broken;
use tidepool::{
    AllocError, Allocator, Buffer, Config, ConfigError, Device, DeviceAddr, MIB, Residency, Stat,
    StreamId,
};

mod common;
use common::N;

const S: StreamId = StreamId::DEFAULT;

fn setup(config: &str, capacity: u64) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::new(capacity));
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    (dev, alloc)
}

fn live_bases(dev: &SimDevice) -> BTreeSet<u64> {
    dev.live_segments().iter().map(|(p, _)| p.0).collect()
}

// ---------------------------------------------------------------- garbage_collection_threshold

/// Five 12 MiB segments (own-segment requests): P persistent, then B, A, C, D transient, freed
/// in that order, then B reused and freed again: idle ages (pool clock − last use) A 4, C 3,
/// D 2, B 0 (P never). 60 MiB reserved is past the 50 MiB threshold (0.5 × 100 MiB), so a
/// 22 MiB request that no free block holds first runs PyTorch's collection: 10 MiB to reclaim,
/// the average age 9/4, so A and C (at least that old) go in one pass, and D stays though the
/// new segment then passes the threshold.
/// Returns (bases of P, B, A, C, D, the new block's base), the device's live bases after, and
/// the reserved bytes after.
fn gc_scenario(broken: Option<Broken>) -> ([u64; 6], BTreeSet<u64>, u64) {
    let (dev, alloc) =
        setup("memory_limit_mb:100,garbage_collection_threshold:0.5,fast_cache:false", 1 << 30);
    if let Some(mode) = broken {
        alloc.set_broken(mode, true);
    }
    let p = alloc.alloc_in(12 * MIB, S, Residency::Persistent).unwrap();
    let b = alloc.alloc(12 * MIB, S).unwrap();
    let a = alloc.alloc(12 * MIB, S).unwrap();
    let c = alloc.alloc(12 * MIB, S).unwrap();
    let d = alloc.alloc(12 * MIB, S).unwrap();
    let bases = [p.ptr().0, b.ptr().0, a.ptr().0, c.ptr().0, d.ptr().0];
    assert_eq!(alloc.reserved_bytes(), 60 * MIB);
    for buf in [p, b, a, c, d] {
        drop(buf);
        alloc.check_invariants().unwrap();
    }
    // A request a free block holds collects nothing, past the threshold or not.
    let reuse = alloc.alloc(12 * MIB, S).unwrap();
    assert_eq!(reuse.ptr().0, bases[1], "best fit: the lowest of the equal free segments");
    drop(reuse);
    assert_eq!(alloc.stats().num_device_free, 0);
    // B was reused last now: the idle order is P, A, C, D, B.
    let big = alloc.alloc(22 * MIB, S).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(dev.counters().failed_mallocs, 0, "collected before asking the device");
    assert_eq!(alloc.stats().num_alloc_retries, 0);
    let out = (
        [bases[0], bases[1], bases[2], bases[3], bases[4], big.ptr().0],
        live_bases(&dev),
        alloc.reserved_bytes(),
    );
    drop(big);
    out
}

#[test]
fn gc_releases_idle_transient_segments_oldest_first_before_reserving() {
    let ([p, b, a, c, d, big], live, reserved) = gc_scenario(None);
    // A and C go (24 MiB ≥ the 10 MiB excess); D, younger than the average, stays.
    // (`tidepool_broken = "gc_before_threshold"` releases D too, to fit the new segment.)
    assert_eq!(live, BTreeSet::from([p, b, d, big]));
    assert!(!live.contains(&a) && !live.contains(&c));
    assert_eq!(reserved, 36 * MIB + 22 * MIB);
}

/// Reserved memory at the threshold is not past it: PyTorch's `total_allocated_memory <=
/// gc_threshold` collects nothing, though the new segment then goes past it.
#[test]
fn gc_waits_until_reserved_memory_is_past_the_threshold() {
    let (dev, alloc) =
        setup("memory_limit_mb:100,garbage_collection_threshold:0.5,fast_cache:false", 1 << 30);
    let held = alloc.alloc(38 * MIB, S).unwrap();
    drop(alloc.alloc(12 * MIB, S).unwrap());
    assert_eq!(alloc.reserved_bytes(), 50 * MIB);
    let b = alloc.alloc(14 * MIB, S).unwrap();
    assert_eq!((alloc.reserved_bytes(), alloc.stats().num_device_free), (64 * MIB, 0));
    // Now 64 > 50: the idle 12 MiB segment goes before the next reservation.
    let c = alloc.alloc(16 * MIB, S).unwrap();
    assert_eq!((alloc.reserved_bytes(), alloc.stats().num_device_free), (68 * MIB, 1));
    assert_eq!(dev.counters().failed_mallocs, 0);
    drop((held, b, c));
    alloc.check_invariants().unwrap();
}

#[test]
fn gc_broken_modes_are_caught() {
    // Youngest first: B (just reused) and D go instead of A and C.
    let ([p, b, a, c, d, big], live, _) = gc_scenario(Some(Broken::GcYoungestFirst));
    assert_eq!(live, BTreeSet::from([p, a, c, big]), "youngest first releases B and D");
    assert!(!live.contains(&b) && !live.contains(&d));
    // Persistent too: P, idle longest, goes with A and C (ages 6, 4, 3 ≥ 15/5).
    let ([p, b, _a, c, d, big], live, _) = gc_scenario(Some(Broken::GcPersistent));
    assert!(!live.contains(&p), "the broken collection released the persistent segment");
    assert!(!live.contains(&c));
    assert_eq!(live, BTreeSet::from([b, d, big]));
}

/// The threshold counts what the family's private pools reserve, as PyTorch's counts every
/// pool of the device (`total_allocated_memory`): with a pool holding 40 MiB, the general
/// allocator's idle 12 MiB segment goes before it reserves 14 MiB (40 + 12 + 14 > 50 MiB, the
/// threshold of a 100 MiB cap at 0.5), though its own 12 + 14 MiB are under it; the pool's
/// memory is never collected by the general allocator. (`Broken::GcPerPool`: the idle segment
/// stays.)
fn gc_with_a_pool(broken: bool) -> (u64, u64) {
    let (dev, alloc) =
        setup("memory_limit_mb:100,garbage_collection_threshold:0.5,fast_cache:false", 1 << 30);
    alloc.set_broken(Broken::GcPerPool, broken);
    let pool = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
    let guard = alloc.use_pool(&pool, S).unwrap();
    let held = alloc.alloc(40 * MIB, S).unwrap();
    drop(guard);
    drop(alloc.alloc(12 * MIB, S).unwrap());
    let b = alloc.alloc(14 * MIB, S).unwrap();
    let general = alloc.reserved_bytes();
    let used = dev.reserved_bytes();
    assert_eq!(pool.stats().blocks.reserved_bytes.all.current, 40 * MIB);
    drop((b, held));
    alloc.check_invariants().unwrap();
    (general, used)
}

#[test]
fn gc_counts_the_private_pools_memory() {
    assert_eq!(gc_with_a_pool(false), (14 * MIB, 54 * MIB));
    assert_eq!(gc_with_a_pool(true), (26 * MIB, 66 * MIB));
}

#[test]
fn gc_never_touches_the_initial_pool_and_stops_when_nothing_is_idle() {
    let (dev, alloc) = setup(
        "max_pool_size_mb:64,garbage_collection_threshold:0.25,initial_pool_size_mb:20,fast_cache:false",
        1 << 30,
    );
    let initial = live_bases(&dev);
    assert_eq!(alloc.reserved_bytes(), 20 * MIB);
    // 20 + 12 > 16: over the threshold, but the initial pool is not collected (and it is free).
    let x = alloc.alloc(12 * MIB, S).unwrap();
    assert!(initial.contains(&x.ptr().0), "served from the initial pool");
    let y = alloc.alloc(12 * MIB, S).unwrap();
    assert_eq!(alloc.reserved_bytes(), 32 * MIB);
    assert_eq!(alloc.stats().num_device_free, 0);
    drop((x, y));
    alloc.check_invariants().unwrap();
    assert!(live_bases(&dev).is_superset(&initial));
}

/// A small segment, then five 12 MiB segments A..E (own-segment requests, 62 MiB past the
/// 50 MiB threshold); A, B, C
/// freed in that order, with `small` pairs of 4 KiB requests between A's free and B's; then a
/// 22 MiB request collects 12 MiB: idle ages A 2, B 1, C 0 in large-pool events, so A and B (at
/// least the average, 1) go in one pass and C stays. Returns the bases of A..E and the new
/// block's, and the device's live bases after.
fn gc_idle_from_the_free(config: &str, small: usize) -> ([u64; 6], BTreeSet<u64>) {
    let (dev, alloc) =
        setup(&format!("memory_limit_mb:100,garbage_collection_threshold:0.5,{config}"), 1 << 30);
    // A small segment first, so that the small requests below reserve nothing (a reservation
    // past the threshold would collect A there).
    let first = alloc.alloc(4096, S).unwrap();
    let held: Vec<_> = (0..5).map(|_| alloc.alloc(12 * MIB, S).unwrap()).collect();
    let b: Vec<u64> = held.iter().map(|h| h.ptr().0).collect();
    let mut held = held.into_iter();
    let (a, bb, c, d, e) = (
        held.next().unwrap(),
        held.next().unwrap(),
        held.next().unwrap(),
        held.next().unwrap(),
        held.next().unwrap(),
    );
    drop(a);
    for _ in 0..small {
        drop(alloc.alloc(4096, S).unwrap());
    }
    drop(bb);
    drop(c);
    let big = alloc.alloc(22 * MIB, S).unwrap();
    let big_base = big.ptr().0;
    alloc.check_invariants().unwrap();
    assert_eq!(dev.counters().failed_mallocs, 0);
    let mut live = live_bases(&dev);
    assert!(live.remove(&(first.ptr().0 & !(2 * MIB - 1))), "the small segment");
    drop((first, d, e, big));
    ([b[0], b[1], b[2], b[3], b[4], big_base], live)
}

/// The idle age counts from the free, as PyTorch's (`gc_count_base` is set as a block is
/// inserted into the free set): a large block freed into its stream's cache would count as
/// used when the cache is flushed, at the 22 MiB request (then B and C went, and A stayed).
/// So under a threshold freed large blocks go to the pool at once; the locked path agrees.
#[test]
fn gc_counts_a_freed_large_block_idle_from_its_free() {
    for config in ["", "global_lock:true"] {
        let ([_, _, c, d, e, big], live) = gc_idle_from_the_free(config, 0);
        assert_eq!(live, BTreeSet::from([c, d, e, big]), "A and B go under {config:?}");
    }
}

/// Small requests do not age the large segments: the stream caches serve most of them without
/// the pool, so counting them (as the pool's clock did at every allocation and free) made the
/// idle ages, and what the collection releases, depend on the caches. With 10 small pairs
/// between A's free and B's, under `global_lock:true` A alone went (ages 22, 1, 0).
#[test]
fn gc_idle_ages_count_large_pool_events_only() {
    for config in ["", "global_lock:true", "fast_cache:false"] {
        let ([_, _, c, d, e, big], live) = gc_idle_from_the_free(config, 10);
        assert_eq!(live, BTreeSet::from([c, d, e, big]), "A and B go under {config:?}");
    }
}

/// Idle ages count only while a threshold is in force, as PyTorch's (`get_free_blocks_call_count`
/// advances only then): segments cached before a `set_config` sets one are equally idle. Five
/// 12 MiB segments A..E; A, B, C freed in that order with no threshold, then one set
/// (50 MiB of 100, 60 reserved): a 22 MiB request collects, and A, B and C (ages 0, 0, 0) go
/// in one pass, on every path. With the clock running before the switch (broken build
/// `gc_clock_always`), `global_lock:true` kept C (ages 2, 1, 0), and the fast path kept A: A
/// waited in the stream's cache until the switch's flush, which counted as its free.
#[test]
fn gc_ages_count_from_the_threshold_being_set() {
    for config in ["", "global_lock:true", "fast_cache:false"] {
        let (dev, alloc) = setup(config, 1 << 30);
        let held: Vec<_> = (0..5).map(|_| alloc.alloc(12 * MIB, S).unwrap()).collect();
        let bases: Vec<u64> = held.iter().map(|h| h.ptr().0).collect();
        let mut held = held.into_iter();
        let (a, b, c) = (held.next().unwrap(), held.next().unwrap(), held.next().unwrap());
        let (d, e) = (held.next().unwrap(), held.next().unwrap());
        drop(a);
        drop(b);
        drop(c);
        let gc = format!("memory_limit_mb:100,garbage_collection_threshold:0.5,{config}");
        alloc.set_config(Config::parse(&gc).unwrap()).unwrap();
        let big = alloc.alloc(22 * MIB, S).unwrap();
        alloc.check_invariants().unwrap();
        assert_eq!(
            live_bases(&dev),
            BTreeSet::from([bases[3], bases[4], big.ptr().0]),
            "A, B and C go under {config:?}"
        );
        let s = alloc.stats();
        assert_eq!((s.num_device_free, s.blocks.reserved_bytes.all.current), (3, 46 * MIB));
        drop((d, e, big));
    }
}

// ---------------------------------------------------------------- initial and maximum pool size

#[test]
fn initial_pool_is_reserved_up_front_served_from_and_kept() {
    let (dev, alloc) = setup("initial_pool_size_mb:64", 1 << 30);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.all.current, 64 * MIB);
    assert_eq!(s.blocks.reserved_bytes.large_pool.current, 64 * MIB);
    assert_eq!(s.num_device_alloc, 1);
    let base = dev.live_segments()[0].0.0;
    // Large requests on the default stream are served from it, split as usual.
    let a = alloc.alloc(4 * MIB, S).unwrap();
    let b = alloc.alloc(12 * MIB, S).unwrap();
    assert_eq!((a.ptr().0, b.ptr().0), (base, base + 4 * MIB));
    assert_eq!(alloc.stats().num_device_alloc, 1);
    alloc.check_invariants().unwrap();
    drop((a, b));
    alloc.empty_cache().unwrap();
    assert_eq!(live_bases(&dev), BTreeSet::from([base]), "empty_cache keeps the initial pool");
    assert_eq!(alloc.reserved_bytes(), 64 * MIB);
    // Small requests have their own pool.
    let small = alloc.alloc(4096, S).unwrap();
    assert_eq!(alloc.reserved_bytes(), 66 * MIB);
    drop(small);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 64 * MIB);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert!(dev.live_segments().is_empty(), "released when the allocator goes");
}

#[test]
fn initial_pool_errors() {
    let dev = Arc::new(SimDevice::new(32 * MIB));
    match Allocator::new(dev.clone(), Config::parse("initial_pool_size_mb:64").unwrap()) {
        Err(AllocError::OutOfMemory(r)) => {
            assert_eq!((r.requested, r.segment, r.reserved), (64 * MIB, 64 * MIB, 0));
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(dev.live_segments().is_empty());
    let bad = Config::default().with_initial_pool_size(64 * MIB).with_max_pool_size(32 * MIB);
    match Allocator::new(dev.clone(), bad) {
        Err(AllocError::Config(ConfigError::Inconsistent(m))) => {
            assert!(
                m.contains("initial_pool_size_mb (64 MiB) exceeds max_pool_size_mb (32 MiB)"),
                "{m}"
            )
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

/// An initial pool of at least `max_split_size` is one oversize block: never split, and never
/// spent on a smaller request (PyTorch's rules for oversize blocks), and kept for good. It was
/// accepted and then stood idle: under `initial_pool_size_mb:1024,max_split_size_mb:256` a
/// 30 MiB request reserved a 30 MiB segment of its own next to the idle 1 GiB pool, and a
/// 1100 MiB request then ran out of memory with that 1 GiB cached (the ladder never releases
/// the initial pool). Such a configuration is refused now: by `validate` (the string and the
/// builders alike), and by `set_config` where the allocator keeps an initial pool that large.
#[test]
fn an_initial_pool_of_at_least_max_split_size_is_refused() {
    let dev = Arc::new(SimDevice::new(2048 * MIB));
    let why = |pool: u64, split: u64| {
        format!(
            "initial_pool_size_mb ({pool} MiB) must be below max_split_size_mb ({split} MiB): a \
             block of at least max_split_size is never split, so the initial pool would serve \
             no smaller request"
        )
    };
    for (pool, split) in [(1024, 256), (1024, 1024)] {
        let text = format!("initial_pool_size_mb:{pool},max_split_size_mb:{split}");
        assert_eq!(Config::parse(&text), Err(ConfigError::Inconsistent(why(pool, split))));
        let built =
            Config::default().with_initial_pool_size(pool * MIB).with_max_split_size_mb(split);
        match Allocator::new(dev.clone(), built) {
            Err(AllocError::Config(ConfigError::Inconsistent(m))) => {
                assert_eq!(m, why(pool, split))
            }
            other => panic!("expected a configuration error, got {:?}", other.map(|_| ())),
        }
        assert!(dev.live_segments().is_empty());
    }
    // Just above the pool, the limit leaves it a block like any other: split, and served from.
    let (dev, alloc) = setup("initial_pool_size_mb:1024,max_split_size_mb:1025", 2048 * MIB);
    let base = dev.live_segments()[0].0.0;
    let a = alloc.alloc(30 * MIB, S).unwrap();
    assert_eq!((a.ptr().0, alloc.stats().num_device_alloc), (base, 1));
    drop(a);
    // A later limit at or below the pool the allocator keeps is refused, nothing changed.
    let before = alloc.config();
    let lower = Config::parse("max_split_size_mb:256").unwrap();
    assert_eq!(
        alloc.set_config(lower),
        Err(ConfigError::Inconsistent(
            "max_split_size_mb (256 MiB) must exceed the initial pool this allocator keeps \
             (1024 MiB): a block of at least max_split_size is never split, so the initial \
             pool would serve no smaller request"
                .into()
        ))
    );
    assert_eq!(alloc.config(), before);
    let b = alloc.alloc(30 * MIB, S).unwrap();
    assert_eq!((b.ptr().0, alloc.stats().num_device_alloc), (base, 1));
    let c = alloc.alloc(900 * MIB, S).unwrap();
    assert_eq!((c.ptr().0, alloc.stats().num_device_alloc), (base + 30 * MIB, 1));
    drop((b, c));
    // A limit above it is taken.
    alloc.set_config(Config::parse("max_split_size_mb:2048").unwrap()).unwrap();
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(live_bases(&dev), BTreeSet::from([base]));
    drop(alloc);
    assert!(dev.live_segments().is_empty());
}

#[test]
fn max_pool_size_caps_reserved_then_reports() {
    let (dev, alloc) = setup("max_pool_size_mb:32", 1 << 30);
    let a = alloc.alloc(12 * MIB, S).unwrap();
    let b = alloc.alloc(12 * MIB, S).unwrap();
    assert_eq!(alloc.reserved_bytes(), 24 * MIB);
    let err = alloc.alloc(12 * MIB, S).unwrap_err();
    let AllocError::OutOfMemory(r) = err else { panic!("expected OutOfMemory, got {err:?}") };
    assert_eq!(r.limit, Some(32 * MIB));
    assert_eq!((r.requested, r.segment, r.reserved), (12 * MIB, 12 * MIB, 24 * MIB));
    assert!(r.to_string().contains("limited to 32.00 MiB"), "{r}");
    let s = alloc.stats();
    assert_eq!((s.num_ooms, s.blocks.reserved_bytes.all.peak), (1, 24 * MIB));
    // The ladder released nothing it could not (both segments are live); the allocator works on.
    drop(a);
    let c = alloc.alloc(12 * MIB, S).unwrap();
    alloc.check_invariants().unwrap();
    drop((b, c));
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
}

// ---------------------------------------------------------------- alloc_aligned

fn assert_aligned(b: &Buffer<SimDevice>, align: u64) {
    assert_eq!(b.ptr().0 % align, 0, "{:#x} is not {align}-aligned", b.ptr().0);
}

#[test]
fn alloc_aligned_refuses_bad_alignments() {
    let (_dev, alloc) = setup("", 1 << 30);
    for (bytes, align, max) in [
        (1000, 0, 2 * MIB),
        (1000, 3000, 2 * MIB),
        (1000, 4 * MIB, 2 * MIB),
        (4 * MIB, 32 * MIB, 20 * MIB),
    ] {
        match alloc.alloc_aligned(bytes, align, S) {
            Err(AllocError::InvalidAlignment { align: a, max: m }) => {
                assert_eq!((a, m), (align, max))
            }
            other => panic!("{bytes} at {align}: expected InvalidAlignment, got {other:?}"),
        }
    }
    let msg = alloc.alloc_aligned(1000, 3000, S).unwrap_err().to_string();
    assert_eq!(
        msg,
        "invalid alignment 3000: expected a power of two no larger than 2097152 bytes (the segment size of the request's pool)"
    );
    assert_eq!(alloc.stats().num_device_alloc, 0, "nothing reserved for a refused request");
    // The largest alignments allowed work (a new segment big enough for any padding).
    let a = alloc.alloc_aligned(1000, 2 * MIB, S).unwrap();
    assert_aligned(&a, 2 * MIB);
    let b = alloc.alloc_aligned(4 * MIB, 16 * MIB, S).unwrap();
    assert_aligned(&b, 16 * MIB);
    alloc.check_invariants().unwrap();
}

/// Pool path: the padding in front of the aligned block is split off as a free block; the
/// statistics stay exact and freeing coalesces everything back.
#[test]
fn alloc_aligned_from_the_pool_splits_the_padding_off_exactly() {
    // No stream cache: freed blocks go straight back to the pool and coalesce.
    let (dev, alloc) = setup("fast_cache:false", 1 << 30);
    let first = alloc.alloc(512, S).unwrap();
    let base = first.ptr().0;
    let mut bufs = vec![first];
    let mut allocated = 512;
    for (bytes, align) in [(1000, 64 << 10), (3000, 4096), (512, 1 << 20), (2048, 512)] {
        let b = alloc.alloc_aligned(bytes, align, S).unwrap();
        assert_aligned(&b, align);
        assert!(b.ptr().0 >= base && b.ptr().0 < base + 2 * MIB, "from the same segment");
        allocated += b.block_size();
        bufs.push(b);
        alloc.check_invariants().unwrap();
        let s = alloc.stats();
        assert_eq!(s.blocks.allocated_bytes.all.current, allocated);
        assert_eq!(s.blocks.reserved_bytes.all.current, 2 * MIB);
        assert_eq!(s.num_device_alloc, 1);
        // Everything reserved is allocated or a free block of the split segment: no byte lost.
        assert_eq!(s.blocks.inactive_split_bytes.all.current, 2 * MIB - allocated);
    }
    drop(bufs);
    alloc.check_invariants().unwrap();
    let s = alloc.stats();
    assert_eq!(
        (s.blocks.allocated_bytes.all.current, s.blocks.inactive_split_bytes.all.current),
        (0, 0)
    );
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());
}

/// Stream-cache path: a block of the same class waits in the stream cache at a misaligned
/// address; the aligned request must not take it. With the deliberate bug it does.
fn aligned_after_cached(broken: bool) -> (u64, u64) {
    let (_dev, alloc) = setup("", 1 << 30);
    alloc.set_broken(Broken::AlignedFromCache, broken);
    let _x = alloc.alloc(512, S).unwrap();
    let y = alloc.alloc(N, S).unwrap();
    let cached = y.ptr().0;
    drop(y); // into the stream cache
    assert_eq!(alloc.stats().cached_fast_bytes, N);
    let a = alloc.alloc_aligned(N, N, S).unwrap();
    alloc.check_invariants().unwrap();
    (a.ptr().0, cached)
}

#[test]
fn alloc_aligned_skips_the_stream_cache_and_the_bug_is_caught() {
    let (got, cached) = aligned_after_cached(false);
    assert_eq!(got % N, 0);
    assert_ne!(cached % N, 0, "the cached block is misaligned");
    let (got, cached) = aligned_after_cached(true);
    assert_eq!(got, cached, "the broken mode hands out the cached block");
    assert_ne!(got % N, 0, "…which the alignment check catches");
}

#[test]
fn alloc_aligned_skips_the_large_block_cache() {
    let (_dev, alloc) = setup("", 1 << 30);
    let _x = alloc.alloc(2 * MIB + 512, S).unwrap();
    let y = alloc.alloc(4 * MIB, S).unwrap();
    let cached = y.ptr().0;
    drop(y); // the stream's large-block cache
    let a = alloc.alloc_aligned(4 * MIB, 4 * MIB, S).unwrap();
    assert_aligned(&a, 4 * MIB);
    assert_ne!(cached % (4 * MIB), 0);
    // A plain request of the same size is served as usual (after the aligned block).
    let b = alloc.alloc(4 * MIB, S).unwrap();
    assert_eq!(b.ptr().0, a.ptr().0 + 4 * MIB);
    alloc.check_invariants().unwrap();
    let s = alloc.stats();
    assert_eq!(s.blocks.allocated_bytes.all.current, 2 * MIB + 512 + 8 * MIB);
    drop((a, b));
}

#[test]
fn alloc_aligned_on_new_segments_other_streams_and_expandable_ranges() {
    // A new segment: big enough for the worst padding.
    let (dev, alloc) = setup("", 1 << 30);
    let s2 = dev.create_stream().unwrap();
    let a = alloc.alloc_aligned(MIB, 2 * MIB, S).unwrap();
    assert_aligned(&a, 2 * MIB);
    // Another stream's free segment, taken whole (its work is done): 24 MiB holds 8 MiB at
    // any 8 MiB boundary.
    let b = alloc.alloc(24 * MIB, s2).unwrap();
    let theirs = b.ptr().0;
    drop(b);
    alloc.synchronize().unwrap();
    let before = alloc.stats().num_device_alloc;
    let c = alloc.alloc_aligned(8 * MIB, 8 * MIB, S).unwrap();
    assert_aligned(&c, 8 * MIB);
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().num_device_alloc, before, "no new segment");
    assert!(c.ptr().0 >= theirs && c.ptr().0 + 8 * MIB <= theirs + 24 * MIB);
    drop((a, c));
    alloc.empty_cache().unwrap();
    assert!(dev.live_segments().is_empty());

    // Expandable segments: blocks of the ranges, grown where needed.
    let (dev, alloc) = setup("expandable_segments:true", 1 << 30);
    let mut bufs = vec![alloc.alloc(512, S).unwrap(), alloc.alloc(3 * MIB, S).unwrap()];
    for (bytes, align) in [(1000, 64 << 10), (3 * MIB, MIB), (5 * MIB, 4 * MIB), (512, 2 * MIB)] {
        let b = alloc.alloc_aligned(bytes, align, S).unwrap();
        assert_aligned(&b, align);
        bufs.push(b);
        alloc.check_invariants().unwrap();
    }
    let allocated: u64 = bufs.iter().map(|b| b.block_size()).sum();
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, allocated);
    drop(bufs);
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    assert!(dev.live_mappings().is_empty() && dev.live_segments().is_empty());
}

// ---------------------------------------------------------------- caching:false

#[test]
fn pass_through_makes_one_device_call_per_alloc_and_per_free() {
    let (dev, alloc) = setup("caching:false", 1 << 30);
    let s2 = dev.create_stream().unwrap();
    let mut live = Vec::new();
    for (i, bytes) in [512u64, 4096, 4096, 3 * MIB, 12 * MIB, 700].into_iter().enumerate() {
        let before = dev.counters();
        let stream = if i % 2 == 0 { S } else { s2 };
        let b = alloc.alloc(bytes, stream).unwrap();
        let after = dev.counters();
        assert_eq!(after.mallocs, before.mallocs + 1, "one reserve per allocation");
        assert_eq!(
            (
                after.frees,
                after.event_records,
                after.event_queries,
                after.event_waits,
                after.host_syncs
            ),
            (
                before.frees,
                before.event_records,
                before.event_queries,
                before.event_waits,
                before.host_syncs
            ),
            "and nothing else"
        );
        assert_eq!(
            dev.live_segments().iter().find(|(p, _)| *p == b.ptr()).unwrap().1,
            b.block_size()
        );
        live.push(b);
    }
    assert_eq!(alloc.reserved_bytes(), alloc.allocated_bytes(), "nothing cached");
    for b in live {
        let before = dev.counters();
        let n = dev.live_segments().len();
        drop(b);
        let after = dev.counters();
        assert_eq!(after.frees, before.frees + 1, "one release per free");
        assert_eq!((after.mallocs, after.event_records), (before.mallocs, before.event_records));
        assert_eq!(dev.live_segments().len(), n - 1);
        alloc.check_invariants().unwrap();
    }
    let s = alloc.stats();
    assert_eq!((s.num_device_alloc, s.num_device_free, alloc.reserved_bytes()), (6, 6, 0));
    // Scopes neither learn plans nor keep blocks.
    for _ in 0..2 {
        let scope = alloc.named_scope("step", S);
        let x = scope.alloc(4096).unwrap();
        drop(x);
        let _y = scope.alloc(4096).unwrap();
    }
    let s = alloc.stats();
    assert_eq!((s.num_device_alloc, s.num_device_free, s.plan_hits), (10, 10, 0));
    assert!(dev.live_segments().is_empty());
}

#[test]
fn pass_through_frees_after_other_streams_uses_with_counted_syncs() {
    let dev = Arc::new(SimDevice::backed(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::parse("caching:false").unwrap()).unwrap();
    let s2 = dev.create_stream().unwrap();
    let b = alloc.alloc(N, S).unwrap();
    let p = b.ptr();
    dev.launch(s2, write_kernel(p, 7)).unwrap();
    alloc.record_stream(&b, s2).unwrap();
    let before = (alloc.stats().num_host_syncs, dev.counters());
    drop(b);
    let (syncs, c) = (alloc.stats().num_host_syncs, dev.counters());
    // One event recorded and waited for, then one release (itself a sync).
    assert_eq!(syncs, before.0 + 2);
    assert_eq!((c.event_records, c.frees), (before.1.event_records + 1, before.1.frees + 1));
    assert!(dev.live_segments().is_empty());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

fn write_kernel(ptr: DeviceAddr, byte: u8) -> Kernel {
    Kernel::new("write", vec![Access { ptr, bytes: N, kind: AccessKind::Write }], move |m| {
        let _ = m.write(ptr, &[byte; N as usize]);
    })
}

/// A use after free: a kernel writes through a stale pointer after the memory was freed and
/// allocated again. Cached, the new buffer has the same address and the sanitizer sees a
/// handed-out range; pass-through, the memory is gone and the access is flagged.
fn use_after_free(config: &str) -> (bool, Vec<String>) {
    let dev = Arc::new(SimDevice::backed(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::parse(config).unwrap()).unwrap();
    let a = alloc.alloc(N, S).unwrap();
    let stale = a.ptr();
    drop(a);
    let b = alloc.alloc(N, S).unwrap();
    dev.launch(S, write_kernel(stale, 1)).unwrap();
    dev.synchronize().unwrap();
    let same = b.ptr() == stale;
    drop(b);
    (same, dev.violations().into_iter().map(|v| v.op).collect())
}

#[test]
fn pass_through_lets_the_sanitizer_see_a_use_after_free_that_caching_hides() {
    let (same, violations) = use_after_free("");
    assert!(same, "cached: the freed block is handed out again");
    assert!(violations.is_empty(), "cached: hidden ({violations:?})");
    let (same, violations) = use_after_free("caching:false");
    assert!(!same, "pass-through: a new device allocation");
    assert_eq!(violations, vec!["kernel write touches unallocated memory".to_string()]);
}

// ---------------------------------------------------------------- statistics

#[test]
fn oversize_statistics_count_blocks_and_segments_above_max_split_size() {
    let (_dev, alloc) = setup("max_split_size_mb:40", 1 << 30);
    let big = alloc.alloc(50 * MIB, S).unwrap();
    let mid = alloc.alloc(30 * MIB, S).unwrap();
    let s = alloc.stats();
    assert_eq!(s.oversize_allocations, Stat { current: 1, peak: 1, allocated: 1, freed: 0 });
    assert_eq!(s.oversize_segments, Stat { current: 1, peak: 1, allocated: 1, freed: 0 });
    drop(big);
    let s = alloc.stats();
    assert_eq!(s.oversize_allocations, Stat { current: 0, peak: 1, allocated: 1, freed: 1 });
    assert_eq!(s.oversize_segments.current, 1, "still cached");
    // Reused by an oversize request it may serve (≤ 50 + 20 MiB): counted again.
    let again = alloc.alloc(45 * MIB, S).unwrap();
    assert_eq!(alloc.stats().oversize_allocations.allocated, 2);
    drop((again, mid));
    alloc.empty_cache().unwrap();
    let s = alloc.stats();
    assert_eq!(s.oversize_allocations, Stat { current: 0, peak: 1, allocated: 2, freed: 2 });
    assert_eq!(s.oversize_segments, Stat { current: 0, peak: 1, allocated: 1, freed: 1 });
    alloc.check_invariants().unwrap();
    alloc.reset_peak_stats();
    assert_eq!(alloc.stats().oversize_segments.peak, 0);
    // Without max_split_size nothing is oversize.
    let (_dev, plain) = setup("", 1 << 30);
    drop(plain.alloc(50 * MIB, S).unwrap());
    assert_eq!(plain.stats().oversize_allocations, Stat::default());
}

/// A block handed out as oversize stays out of the stream caches after `set_config` unset
/// `max_split_size`: freed into the pool, it leaves `oversize_allocations` at once, and its
/// reuse (the pool's, under the new limit) is no oversize allocation. In a lane it stayed
/// counted as live, and its lane hit counted it again.
#[test]
fn an_oversize_block_freed_after_the_limit_is_unset_leaves_the_oversize_count() {
    for lock in [false, true] {
        let config = |c: &str| Config::parse(c).unwrap().with_global_lock(lock);
        let dev = Arc::new(SimDevice::new(1 << 30));
        let alloc = Allocator::new(dev, config("max_split_size_mb:20")).unwrap();
        let big = alloc.alloc(30 * MIB, S).unwrap();
        let at = big.ptr().0;
        assert_eq!(
            alloc.stats().oversize_allocations,
            Stat { current: 1, peak: 1, allocated: 1, freed: 0 }
        );
        alloc.set_config(config("")).unwrap();
        drop(big);
        let s = alloc.stats();
        assert_eq!(
            s.oversize_allocations,
            Stat { current: 0, peak: 1, allocated: 1, freed: 1 },
            "lock {lock}"
        );
        assert_eq!(s.cached_fast_bytes, 0, "lock {lock}: not in a lane");
        let again = alloc.alloc(30 * MIB, S).unwrap();
        assert_eq!(again.ptr().0, at);
        let s = alloc.stats();
        assert_eq!(
            s.oversize_allocations,
            Stat { current: 0, peak: 1, allocated: 1, freed: 1 },
            "lock {lock}"
        );
        alloc.check_invariants().unwrap();
        drop(again);
        // Not oversize now: it may wait in its stream's lane.
        assert_eq!(alloc.stats().cached_fast_bytes, if lock { 0 } else { 30 * MIB }, "lock {lock}");
        alloc.check_invariants().unwrap();
    }
}

#[test]
fn num_sync_all_streams_counts_waits_for_every_pending_event() {
    let (dev, alloc) = setup("", 1 << 30);
    let s2 = dev.create_stream().unwrap();
    assert_eq!(alloc.stats().num_sync_all_streams, 0);
    alloc.synchronize().unwrap();
    let b = alloc.alloc(4096, S).unwrap();
    alloc.record_stream(&b, s2).unwrap();
    drop(b);
    alloc.synchronize().unwrap();
    let s = alloc.stats();
    assert_eq!(s.num_sync_all_streams, 2);
    assert_eq!(s.blocks.active_bytes.all.current, 0);
}

#[test]
fn reset_accumulated_stats_zeroes_totals_and_counters_and_keeps_current_and_peak() {
    let (_dev, alloc) = setup("max_split_size_mb:40,memory_limit_mb:64", 1 << 30);
    let keep = alloc.alloc(4096, S).unwrap();
    drop(alloc.alloc(50 * MIB, S).unwrap());
    assert!(alloc.alloc(63 * MIB, S).is_err());
    alloc.synchronize().unwrap();
    let before = alloc.stats();
    assert_eq!(before.num_ooms, 1);
    alloc.reset_accumulated_stats();
    let s = alloc.stats();
    let b = &s.blocks;
    for (name, g) in [
        ("allocated", &b.allocated_bytes),
        ("reserved", &b.reserved_bytes),
        ("active", &b.active_bytes),
        ("requested", &b.requested_bytes),
        ("allocation", &b.allocation),
        ("segment", &b.segment),
    ] {
        assert_eq!((g.all.allocated, g.all.freed), (0, 0), "{name}");
        assert_eq!((g.small_pool.allocated, g.large_pool.freed), (0, 0), "{name}");
    }
    assert_eq!(b.allocated_bytes.all.current, 4096);
    assert_eq!(b.allocated_bytes.all.peak, before.blocks.allocated_bytes.all.peak);
    assert_eq!(
        (s.num_ooms, s.num_alloc_retries, s.num_device_alloc, s.num_device_free),
        (0, 0, 0, 0)
    );
    assert_eq!((s.num_host_syncs, s.num_sync_all_streams), (0, 0));
    assert_eq!((s.oversize_allocations.allocated, s.oversize_allocations.peak), (0, 1));
    // Counting goes on from zero, exactly.
    let x = alloc.alloc(8192, S).unwrap();
    let s = alloc.stats();
    assert_eq!(s.blocks.allocated_bytes.all.allocated, 8192);
    assert_eq!(s.blocks.allocation.all.allocated, 1);
    drop(x);
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.freed, 8192);
    drop(keep);
    alloc.check_invariants().unwrap();
}

#[test]
fn memory_summary_shows_how_to_turn_each_control_on() {
    let (_dev, alloc) = setup("", 1 << 30);
    let text = alloc.memory_summary();
    for key in [
        "garbage_collection_threshold",
        "initial_pool_size_mb",
        "max_pool_size_mb",
        "caching:false",
        "alloc_aligned",
        "record_history",
        "reset_accumulated_stats",
    ] {
        assert!(text.contains(key), "{key} missing from\n{text}");
    }
    let (_dev, on) = setup("caching:false,max_pool_size_mb:512", 1 << 30);
    let text = on.memory_summary();
    assert!(text.lines().all(|l| l.chars().count() == 89), "every line is 89 columns:\n{text}");
    assert!(text.contains("caching: off"), "{text}");
    assert!(text.contains("max pool size: 512.00 MiB"), "{text}");
}

#[test]
fn set_config_to_pass_through_keeps_the_initial_pool_and_releases_the_rest() {
    let (dev, alloc) = setup("initial_pool_size_mb:32", 1 << 30);
    let initial = live_bases(&dev);
    let small = alloc.alloc(4096, S).unwrap();
    drop(small); // cached in a 2 MiB segment
    assert_eq!(alloc.reserved_bytes(), 34 * MIB);
    alloc.set_config(Config::parse("caching:false").unwrap()).unwrap();
    assert_eq!(live_bases(&dev), initial, "the cached segment went back, the initial pool stays");
    // Served from the initial pool still (a free block fits), else one segment per request.
    let a = alloc.alloc(4 * MIB, S).unwrap();
    assert!(initial.contains(&a.ptr().0));
    let b = alloc.alloc(4096, S).unwrap();
    assert_eq!(dev.live_segments().len(), 2);
    drop((a, b));
    assert_eq!(live_bases(&dev), initial);
    alloc.check_invariants().unwrap();
}

/// Sizes past the largest request are refused through the builders too, as the string form
/// refuses them (it takes MiB up to 256 TiB): a `Sizing` of 2^63-byte blocks passed every rule
/// (powers of two, multiples, order) and an aligned request of 2^63 bytes' alignment then
/// overflowed the rounded size plus the alignment (found by the pool and configuration review;
/// a panic in debug builds). Broken build `sizing_unbounded`: accepted.
#[test]
fn sizes_past_the_largest_request_are_refused_through_the_builders() {
    let sizing = |fields: [u64; 6]| {
        let mut z = tidepool::Sizing::default();
        [z.min_block_size, z.small_size, z.small_segment] = [fields[0], fields[1], fields[2]];
        [z.min_large_alloc, z.large_segment, z.round_large] = [fields[3], fields[4], fields[5]];
        Config::default().with_sizing(z)
    };
    let huge = 1u64 << 63;
    let dev = Arc::new(SimDevice::new(64 * MIB));
    let big = sizing([huge, huge, huge, huge + (1 << 62), huge + (1 << 62), huge]);
    match Allocator::new(dev.clone(), big) {
        Err(AllocError::Config(ConfigError::Inconsistent(m))) => assert_eq!(
            m,
            format!(
                "min_block_size ({huge} bytes) exceeds the largest request ({} bytes)",
                1u64 << 48
            )
        ),
        other => panic!("expected a configuration error, got {:?}", other.map(|_| ())),
    }
    // At the cap, accepted; one field past it, refused by name.
    let cap = tidepool::MAX_REQUEST;
    assert_eq!(sizing([MIB, cap / 2, cap / 2, cap, cap, cap]).validate(), Ok(()));
    assert_eq!(
        sizing([MIB, cap / 2, cap / 2, cap, cap + MIB, cap]).validate(),
        Err(ConfigError::Inconsistent(format!(
            "large_segment_mb ({} bytes) exceeds the largest request ({cap} bytes)",
            cap + MIB
        )))
    );
    assert!(dev.live_segments().is_empty());
}
