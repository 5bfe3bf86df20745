//! Loom models, one per lock-free protocol of the allocator front. Each drives the real code
//! (`tidepool::hooks`, or the whole `Allocator` over a `LoomDevice`) and fails
//! when its protocol is deliberately broken with `--cfg tidepool_broken="…"` (see
//! `scripts/loom.sh`, which lists the command for each).
//!
//! | model                                        | protocol                                  | broken variant |
//! |----------------------------------------------|-------------------------------------------|----------------|
//! | `fast_cache_push_pop_against_flush`          | stream cache vs flush into the pool       | `fast_cache`   |
//! | `fast_pop_against_coalesce_of_neighbour`     | cached blocks stay allocated in the pool  | `coalesce`     |
//! | `event_completion_against_same_stream_alloc` | `record_stream` keeps a block out of the cache | `events`  |
//! | `stats_current_never_exceeds_peak`           | credit and revocation keep peaks exact    | `stats`        |
//! | `stats_top_up_against_a_slow_path_increase`  | a locked pop tops a lane's credit up within the headroom | `top_up_past_headroom` |
//! | `stats_snapshot_is_never_torn`               | seqlock publication, double collect       | `stats_reader` |
//! | `stats_published_on_read_are_never_stale`    | slow path leaves its write open, a reader publishes | `stats_open` |
//! | `config_swap_during_allocation`              | one config load per allocation            | `config`       |
//! | `batch_return_against_fast_free` (scope exit)| batch return under the lock vs fast free  | `scope_batch`  |
//! | `escape_free_against_scope_exit`             | exit adopts escapes under the run's lock  | `adopt`        |
//! | `unbound_free_against_next_planned_handout`  | a free is ordered before the scope sees it | `unbound_free` |
//! | `large_free_against_flush_of_the_large_block`| a stream's one cached large block vs a large-pool search | `large_drain` |
//! | `fast_cache_push_pop_against_flush` (again)  | a lane's lock excludes (CAS in, store out)| `lane_lock`    |
//! | `owner_hold_kept_in_a_lane_against_the_last_handle` | holds kept in lanes are released when the last handle goes | `owner_stash` |
//! | `large_hit_against_a_pool_change_and_drain`  | a checked large block handed out without the global lock vs a section that drains it | `fast_cache` |
//! | `idle_region_release_against_a_run_of_its_scope` | `empty_cache` takes a plan's region only where the plan's is its one hold (counted under the plans' lock) | `region_idle` |
//! | `a_pool_and_the_general_allocator_reserving_at_once_under_a_cap` | the family's reserved total is charged with a CAS, so a cap holds for allocators that reserve at once | `cap_check` |
//! | `a_block_moved_to_another_lane_against_the_last_handle` | a block taken from another lane lets that lane's kept hold go and holds the taker's lane | `moved_hold` |
//! | `a_lane_retagged_for_a_new_stream_against_a_stale_free_and_hits` | a lane re-tagged for a new stream takes no block of the old one and serves no hit for it | `retag_free`, `retag_hit` |
//! | `a_biased_lane_against_another_threads_take` | a lane's owner takes it with no RMW; another thread's take revokes the bias first (fence pair) | `lane_bias` |
//!
//! The allocator runs with its real configuration (two cache lanes per stream, 64 fast streams):
//! threads take lanes round-robin as under `std`.
#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;
use tidepool::Sizing;
use tidepool::hooks::{
    ArcCell, BYTES, CACHED_BYTES, COUNT, CachedBlock, ClassKey, LaneLock, Limits, Pop, REQ,
    RequestPlan, SeqBlock, StreamCache, collect, fast_cur, flush_into, quadrant, retire,
};
use tidepool::hooks::{BlockId, Pool, PoolKey};
use tidepool::{Allocator, Config, DeviceAddr, StreamId};
use tidepool::{BlockState, MIB};
use tidepool::{BlockStats, PoolKind, Residency};
use tidepool_loom_tests::LoomDevice;

const S0: StreamId = StreamId::DEFAULT;
const BASE: u64 = 0x1000_0000;
const LIMITS: Limits =
    Limits { enabled: true, entries: 8, bytes: 1 << 20, biased: true, lowest_first: 0 };
const CLASS: ClassKey = ClassKey { residency: Residency::Transient, rounded: 4096 };

fn model(bound: usize, f: impl Fn() + Sync + Send + 'static) {
    model_branches(bound, 10_000, f)
}

/// [`model`] with room for `branches` branches in one execution (a model that runs more of
/// the whole allocator than the others).
fn model_branches(bound: usize, branches: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    // The bound asked for (LOOM_MAX_PREEMPTIONS, default 3 in scripts/loom.sh), capped at `bound`.
    b.preemption_bound = Some(b.preemption_bound.map_or(bound, |p| p.min(bound)));
    // The whole allocator's teardown (the last handle closes every lane, then `Shared` flushes
    // and releases) and lane-lock waits (a CAS retried after each yield) run past loom's default
    // of 1000 branches in one execution.
    b.max_branches = branches;
    // The body runs on a thread of its own, with a 1 MiB stack (`spawn`).
    let f = std::sync::Arc::new(f);
    b.check(move || {
        let f = f.clone();
        spawn(move || f()).join().unwrap();
    });
}

/// A model thread on a 1 MiB stack: loom runs its threads on coroutines whose default stack
/// (the `generator` crate's, 32 KiB) the whole allocator's deeper paths outgrow as inlining
/// shifts from build to build.
fn spawn<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> thread::JoinHandle<T> {
    thread::Builder::new().stack_size(1 << 20).spawn(f).unwrap()
}

fn small_key() -> PoolKey {
    PoolKey { residency: Residency::Transient, stream: S0, kind: PoolKind::Small }
}

/// A pool with one 2 MiB segment and `n` allocated 4 KiB blocks at its start.
fn pool_with_blocks(n: usize) -> (Pool, Vec<BlockId>) {
    let mut pool = Pool::new();
    let sizing = Sizing::default();
    pool.add_segment(small_key(), BASE, 2 * MIB);
    let blocks = (0..n)
        .map(|_| {
            let free = pool.find_free(small_key(), 4096, &sizing).unwrap();
            pool.allocate(free, 4096, 4096, &sizing)
        })
        .collect();
    (pool, blocks)
}

fn cached(pool: &Pool, id: BlockId) -> CachedBlock {
    let b = pool.block(id);
    CachedBlock {
        block: id,
        ptr: DeviceAddr(b.addr),
        size: b.size,
        requested: b.requested,
        quadrant: quadrant(PoolKind::Small, Residency::Transient),
    }
}

/// A block a user holds is allocated in the pool, whole, and no free block overlaps it.
fn held_intact(pool: &Pool, b: &CachedBlock) {
    let blk = pool.block(b.block);
    assert_eq!(blk.state, BlockState::Allocated, "a handed-out block is not allocated in the pool");
    assert_eq!((blk.addr, blk.size), (b.ptr.0, b.size));
    // The tiling check proves no free block overlaps it.
    pool.check_invariants().unwrap();
}

/// The state of the block covering `ptr` (blocks merge, so ids of freed blocks may be gone).
fn state_at(pool: &Pool, ptr: DeviceAddr) -> BlockState {
    for (id, seg) in pool.segments() {
        for (_, blk) in pool.segment_blocks(id) {
            if blk.addr <= ptr.0 && ptr.0 < blk.addr + blk.size {
                return blk.state;
            }
        }
        let _ = seg;
    }
    panic!("{ptr:?} is in no segment")
}

/// Fast free then re-allocation on a user thread, while the slow path flushes the stream cache
/// into the pool. Every block ends in exactly one place: with the user, cached, or free.
#[test]
fn fast_cache_push_pop_against_flush() {
    model(3, || {
        let (pool, blocks) = pool_with_blocks(2);
        let (a, b) = (cached(&pool, blocks[0]), cached(&pool, blocks[1]));
        let cache = Arc::new(StreamCache::new(S0, LIMITS));
        cache.push(CLASS, a).unwrap();
        let pool = Arc::new(Mutex::new(pool));

        let user = {
            let cache = cache.clone();
            spawn(move || {
                let got = match cache.pop(CLASS, 4096) {
                    Pop::Hit(x) => Some(x),
                    _ => None,
                };
                let _ = cache.push(CLASS, b); // the user frees b
                got
            })
        };
        let flushed = {
            let mut pool = pool.lock().unwrap();
            flush_into(&cache, &mut pool)
        };
        let got = user.join().unwrap();

        let pool = pool.lock().unwrap();
        let still: Vec<CachedBlock> = cache.peek().into_iter().map(|(_, x)| x).collect();
        for x in [a, b] {
            let places = usize::from(got == Some(x))
                + usize::from(flushed.contains(&x))
                + usize::from(still.contains(&x));
            assert_eq!(places, 1, "block {:?} is in {places} places", x.ptr);
        }
        if let Some(x) = got {
            held_intact(&pool, &x);
        }
        for x in &still {
            assert_eq!(pool.block(x.block).state, BlockState::Allocated);
        }
        for x in &flushed {
            assert_eq!(state_at(&pool, x.ptr), BlockState::Free);
        }
        assert_eq!(cache.cached_blocks(), still.len() as u64);
        pool.check_invariants().unwrap();
    });
}

/// A fast pop of block `a` races the slow path, which flushes the cache and then frees `a`'s
/// neighbour `b` (coalescing it with free neighbours). `a`, once handed out, is never merged.
#[test]
fn fast_pop_against_coalesce_of_neighbour() {
    model(3, || {
        let (pool, blocks) = pool_with_blocks(2);
        let a = cached(&pool, blocks[0]);
        let b = blocks[1];
        let cache = Arc::new(StreamCache::new(S0, LIMITS));
        cache.push(CLASS, a).unwrap();
        let pool = Arc::new(Mutex::new(pool));

        let user = {
            let cache = cache.clone();
            spawn(move || match cache.pop(CLASS, 4096) {
                Pop::Hit(x) => Some(x),
                _ => None,
            })
        };
        {
            let mut pool = pool.lock().unwrap();
            flush_into(&cache, &mut pool);
            pool.free(b);
        }
        let got = user.join().unwrap();
        let pool = pool.lock().unwrap();
        if let Some(x) = got {
            held_intact(&pool, &x);
        }
        pool.check_invariants().unwrap();
    });
}

/// The real allocator over a `LoomDevice`: a buffer used on stream 1 (`record_stream`) is freed
/// on stream 0 while stream 1's work completes concurrently with a new allocation on stream 0.
/// The block must not be handed out before stream 1's work completed (the device panics if so).
#[test]
fn event_completion_against_same_stream_alloc() {
    model(3, || {
        let s1 = StreamId(1);
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let a = alloc.alloc(4096, S0).unwrap();
        let pa = a.ptr();
        dev.use_on(pa, 4096, s1);
        alloc.record_stream(&a, s1).unwrap();
        drop(a);
        let worker = {
            let dev = dev.clone();
            spawn(move || dev.complete(s1))
        };
        let b = alloc.alloc(4096, S0).unwrap();
        worker.join().unwrap();
        drop(b);
        alloc.check_invariants().unwrap();
        drop(alloc);
        assert_eq!(dev.live_segments(), 0);
        let _ = pa;
    });
}

/// Statistics, credit, through the real allocator: block X is live; a user thread frees X into
/// its stream cache and allocates the same size again (fast, spending the credit the free gave,
/// or under the lock once the credit was revoked), while this thread allocates Y of another
/// size (the slow path, which raises the live total and revokes credit). The peak ends exact
/// (X and Y were live together), and no published state has current above peak.
#[test]
fn stats_current_never_exceeds_peak() {
    model(3, || {
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let x = alloc.alloc(4096, S0).unwrap();
        let user = {
            let alloc = alloc.clone();
            spawn(move || {
                drop(x);
                alloc.alloc(4096, S0).unwrap()
            })
        };
        let y = alloc.alloc(8192, S0).unwrap();
        let x2 = user.join().unwrap();
        let s = alloc.stats().blocks;
        check_snapshot(&s);
        let a = s.allocated_bytes.all;
        assert_eq!((a.current, a.peak), (12288, 12288), "peak must be exact");
        alloc.check_invariants().unwrap();
        drop((x2, y));
        drop(alloc);
        assert_eq!(dev.live_segments(), 0);
    });
}

/// Statistics, lane marks: a user thread frees X into its stream cache (credit, and the lane's
/// mark) and signals, while this thread allocates Y past the peak: a revocation, which locks
/// the lanes only if one is marked. Where this thread saw the signal before allocating, X was
/// freed before Y was made: the peak is Y alone, never X + Y (otherwise either is exact).
/// (Broken `credit_mark`: a free grants credit without marking its lane; the revocation skips
/// it and raises the peak from the credit X's free left.)
#[test]
fn stats_revocation_sees_credit_granted_before_it() {
    model(3, || {
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let x = alloc.alloc(4096, S0).unwrap();
        let freed = Arc::new(AtomicBool::new(false));
        let user = {
            let freed = freed.clone();
            spawn(move || {
                drop(x);
                freed.store(true, Ordering::Release);
            })
        };
        let saw_free = freed.load(Ordering::Acquire);
        let y = alloc.alloc(8192, S0).unwrap();
        user.join().unwrap();
        let a = alloc.stats().blocks.allocated_bytes.all;
        assert_eq!(a.current, 8192);
        if saw_free {
            assert_eq!(a.peak, 8192, "X was freed before Y: the peak is Y alone");
        } else {
            assert!(a.peak == 8192 || a.peak == 12288, "peak {}", a.peak);
        }
        alloc.check_invariants().unwrap();
        drop(y);
        drop(alloc);
        assert_eq!(dev.live_segments(), 0);
    });
}

/// Statistics, top-up: a lane whose credit was revoked holds three cached 4 KiB blocks, with
/// 11 776 bytes of headroom under the peak (16 KiB) that no lane holds. A user thread allocates
/// 4 KiB three times: the first pop takes the global lock and tops the lane up out of that
/// headroom (room for one more block after its own), the second may hit on it, the third goes
/// past the peak; it then reads the statistics. Meanwhile this thread allocates 1 KiB through
/// the slow path, which may revoke the topped-up credit. No snapshot has current above peak,
/// and the peak ends exact (everything is live together at the end).
/// (Broken `top_up_past_headroom`: the top-up ignores the peaks and grants both blocks; the
/// user's last two pops may then hit past the peak, which its read shows below the current.)
#[test]
fn stats_top_up_against_a_slow_path_increase() {
    // Eleven allocations, three frees and two reads: past the 10 000 branches of the others.
    model_branches(3, 40_000, || {
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let a: Vec<_> = (0..3).map(|_| alloc.alloc(4096, S0).unwrap()).collect();
        let b = alloc.alloc(4096, S0).unwrap();
        drop(a); // cached: 12 KiB of credit
        let e = alloc.alloc(512, S0).unwrap(); // past the peak with it: revoked
        let user = {
            let alloc = alloc.clone();
            spawn(move || {
                let p: Vec<_> = (0..3).map(|_| alloc.alloc(4096, S0).unwrap()).collect();
                check_snapshot(&alloc.stats().blocks);
                p
            })
        };
        let f = alloc.alloc(1024, S0).unwrap();
        let p = user.join().unwrap();
        let s = alloc.stats().blocks;
        check_snapshot(&s);
        let a = s.allocated_bytes.all;
        let live = 4096 + 512 + 3 * 4096 + 1024;
        assert_eq!((a.current, a.peak), (live, live), "peak must be exact");
        alloc.check_invariants().unwrap();
        drop((p, b, e, f));
        drop(alloc);
        assert_eq!(dev.live_segments(), 0);
    });
}

/// The setting of the statistics models: the quadrant of small transient blocks, one such block
/// `x` ready to be cached, stream S0's cache (the only one a reader collects) and an empty base
/// block.
#[allow(clippy::type_complexity)]
fn stats_setting()
-> (usize, CachedBlock, Arc<StreamCache>, Arc<Vec<Arc<StreamCache>>>, Arc<SeqBlock<1>>) {
    let (pool, blocks) = pool_with_blocks(1);
    let cache = Arc::new(StreamCache::new(S0, LIMITS));
    (
        quadrant(PoolKind::Small, Residency::Transient),
        cached(&pool, blocks[0]),
        cache.clone(),
        Arc::new(vec![cache]),
        Arc::new(SeqBlock::<1>::new()),
    )
}

/// Statistics, snapshots: a user thread frees a block into its stream cache and allocates it
/// again (each only marks the lane's words stale) and after each publishes the lane as another
/// reader would (`close_stats`, under the lane's lock), while a reader takes a double collect. Every snapshot it accepts is one real state: live + cached stays constant,
/// and bytes, count and requested bytes agree.
#[test]
fn stats_snapshot_is_never_torn() {
    model(2, || {
        let (q, x, cache, caches, base) = stats_setting();
        let user = {
            let cache = cache.clone();
            spawn(move || {
                cache.push(CLASS, x).unwrap();
                cache.close_stats();
                assert!(matches!(cache.pop(CLASS, 4096), Pop::Hit(_)));
                cache.close_stats();
            })
        };
        if let Some(snap) = collect(&*base, || caches.clone(), 1) {
            let w = &snap.fast[0];
            let live_bytes = w[fast_cur(BYTES, q)] as i64; // 0 before the free, -4096 after
            let live_count = w[fast_cur(COUNT, q)] as i64;
            let live_req = w[fast_cur(REQ, q)] as i64;
            assert_eq!(live_bytes + w[CACHED_BYTES] as i64, 0, "torn: bytes");
            assert_eq!(live_bytes, live_req, "torn: requested");
            assert_eq!(live_bytes, 4096 * live_count, "torn: bytes vs count");
        }
        user.join().unwrap();
    });
}

/// Statistics published when read: the slow path counts a hand-out under the lock and only
/// opens the base block's write (`SeqBlock::open`); the user then frees the block into its
/// stream cache (which only opens the lane's write too). A reader does what `Allocator::stats`
/// does: if the base is open, it publishes under the lock, then takes a double collect, which
/// publishes each open lane under the lane's lock first. A snapshot it accepts never combines
/// the stale base with the cache's newer free (live bytes would go below zero), and once the
/// reader has seen the free, its snapshot shows it (nothing stale on either side).
#[test]
fn stats_published_on_read_are_never_stale() {
    model(3, || {
        let (q, x, cache, caches, base) = stats_setting();
        let kept = Arc::new(Mutex::new(0u64)); // the base figure, kept under the global lock
        let user = {
            let (cache, base, kept) = (cache.clone(), base.clone(), kept.clone());
            spawn(move || {
                {
                    let mut k = kept.lock().unwrap(); // the slow path hands `x` out
                    *k += 4096;
                    base.open();
                }
                cache.push(CLASS, x).unwrap(); // the user frees it into the stream cache
            })
        };
        // The reader may have seen the free (here: through the cache's lock), as a thread that
        // synchronised with the user would; its read must then account for the hand-out too.
        let seen = !cache.peek().is_empty();
        if base.is_open() {
            let k = kept.lock().unwrap();
            base.write(|w| w.set(0, *k));
        }
        if let Some(snap) = collect(&*base, || caches.clone(), 1) {
            let live = snap.base[0].wrapping_add(snap.fast[0][fast_cur(BYTES, q)]) as i64;
            let cached = snap.fast[0][CACHED_BYTES] as i64;
            assert!(live >= 0, "stale base with a newer free: live bytes {live}");
            assert!(live + cached <= 4096, "live {live} + cached {cached}");
            if seen {
                assert_eq!((live, cached), (0, 4096), "stale: the free the reader saw is missing");
            }
        }
        user.join().unwrap();
    });
}

fn check_snapshot(s: &BlockStats) {
    for g in [s.allocated_bytes, s.active_bytes, s.requested_bytes, s.allocation, s.active] {
        for c in [g.all, g.small_pool, g.transient] {
            assert!(c.current <= c.peak, "current {} above peak {}", c.current, c.peak);
            assert_eq!(c.allocated.wrapping_sub(c.freed), c.current);
        }
    }
    assert_eq!(s.requested_bytes.all.current, s.allocated_bytes.all.current, "torn snapshot");
}

/// `set_config` swaps the configuration while an allocation plans its request: the plan follows
/// the old configuration or the new one, never a mix (1.5 MiB: large pool, or 2 MiB small).
#[test]
fn config_swap_during_allocation() {
    model(3, || {
        let a = Config::default();
        let b = Config::parse("min_block_size:1048576,small_size_mb:2").unwrap();
        let cell = Arc::new(ArcCell::new(a));
        let swapper = {
            let cell = cell.clone();
            spawn(move || cell.store(Arc::new(b)))
        };
        let plan = RequestPlan::new(&cell, 3 * MIB / 2).unwrap();
        swapper.join().unwrap();
        let got = (plan.rounded, plan.kind);
        assert!(
            got == (3 * MIB / 2, PoolKind::Large) || got == (2 * MIB, PoolKind::Small),
            "mixed plan {got:?}"
        );
    });
}

/// Scope exit through the real allocator: a scope on another thread returns its locally cached
/// blocks `a` and `c` in one batch under the global lock (which also flushes every cache lane of
/// the stream), racing a fast-path free of buffer `b` on this thread into its own cache lane
/// (lane 0: this thread allocated first). `b` ends cached or free in the pool — never lost —
/// and the statistics say nothing is live.
#[test]
fn batch_return_against_fast_free() {
    model(2, || {
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let b = alloc.alloc(4096, S0).unwrap();
        let exit = {
            let alloc = alloc.clone();
            spawn(move || {
                let scope = alloc.scope(S0);
                let (a, c) = (scope.alloc(4096).unwrap(), scope.alloc(4096).unwrap());
                drop((a, c)); // into the scope's local cache
                drop(scope); // the batch return
            })
        };
        drop(b);
        exit.join().unwrap();
        alloc.check_invariants().unwrap();
        assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 0);
        alloc.empty_cache().unwrap();
        assert_eq!(dev.live_segments(), 0, "a block was lost: its segment cannot be released");
    });
}

/// Finding 4 of issue 14: an unbound planned buffer, used on stream 1, is freed on another
/// thread while its scope's thread makes its next allocation, which the plan serves from the
/// same slice once it sees the free. The free must order stream 0 after stream 1 *before* the
/// scope can see it; the device panics on a hand-out of memory stream 1 still uses to a stream
/// that did not wait for it.
#[test]
fn unbound_free_against_next_planned_handout() {
    model(2, || {
        let s1 = StreamId(1);
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        {
            let scope = alloc.named_scope("step", S0);
            drop(scope.alloc_unbound(4096).unwrap());
            drop(scope.alloc_unbound(4096).unwrap()); // the plan: the second reuses the slice
        }
        let scope = alloc.named_scope("step", S0);
        let u = scope.alloc_unbound(4096).unwrap();
        assert!(u.is_planned());
        dev.use_on(u.ptr(), 4096, s1);
        alloc.record_stream(&u, s1).unwrap();
        let freer = spawn(move || drop(u));
        let v = scope.alloc_unbound(4096).unwrap();
        freer.join().unwrap();
        drop(v);
        drop(scope);
        dev.complete(s1);
        alloc.check_invariants().unwrap();
        drop(alloc);
        assert_eq!(dev.live_segments(), 0);
    });
}

/// A 20 MiB large-pool segment with `n` allocated 4 MiB blocks at its start.
fn large_pool_with_blocks(n: usize) -> (Pool, Vec<CachedBlock>) {
    let key = PoolKey { kind: PoolKind::Large, ..small_key() };
    let (mut pool, sizing) = (Pool::new(), Sizing::default());
    pool.add_segment(key, BASE, 20 * MIB);
    let blocks = (0..n)
        .map(|_| {
            let free = pool.find_free(key, 4 * MIB, &sizing).unwrap();
            let id = pool.allocate(free, 4 * MIB, 4 * MIB, &sizing);
            let quadrant = quadrant(PoolKind::Large, Residency::Transient);
            CachedBlock {
                block: id,
                ptr: DeviceAddr(pool.block(id).addr),
                size: 4 * MIB,
                requested: 4 * MIB,
                quadrant,
            }
        })
        .collect();
    (pool, blocks)
}

/// A stream caches one large block (`a`); a user frees another (`b`) while the slow path, under
/// the global lock, searches the large pool: it first frees the cached large block into the pool
/// (`drain_large`), then tries to reuse what is cached for the class (`pop_checked` with the
/// pool's best-fit check). The user's free goes to the cache if it holds no large block, else
/// into the pool under the global lock (`Shared::free`). Every block ends in exactly one place,
/// and the cache's large-block count is exact.
#[test]
fn large_free_against_flush_of_the_large_block() {
    model(3, || {
        let (pool, blocks) = large_pool_with_blocks(2);
        let (a, b) = (blocks[0], blocks[1]);
        let class = ClassKey { residency: Residency::Transient, rounded: 4 * MIB };
        let limits =
            Limits { enabled: true, entries: 8, bytes: 64 * MIB, biased: true, lowest_first: 0 };
        let cache = Arc::new(StreamCache::new(S0, limits));
        cache.push(class, a).unwrap();
        assert_eq!(cache.large_blocks(), 1);
        let global = Arc::new(Mutex::new(pool));

        let user = {
            let (cache, global) = (cache.clone(), global.clone());
            spawn(move || {
                if cache.push(class, b).is_err() {
                    global.lock().unwrap().free(b.block);
                }
            })
        };
        let (drained, reused) = {
            let mut pool = global.lock().unwrap();
            let drained = if cache.large_blocks() > 0 { cache.drain_large() } else { None };
            if let Some(x) = drained {
                pool.free(x.block);
            }
            let sizing = Sizing::default();
            let reused = match cache.pop_checked(class, 4 * MIB, |x| {
                pool.reuse_is_best_fit(x.block, 4 * MIB, &sizing).is_some()
            }) {
                Pop::Hit(x) => Some(x),
                _ => None,
            };
            (drained, reused)
        };
        user.join().unwrap();

        let pool = global.lock().unwrap();
        pool.check_invariants().unwrap();
        let still: Vec<CachedBlock> = cache.peek().into_iter().map(|(_, x)| x).collect();
        assert_eq!(cache.large_blocks(), still.len() as u64, "the large-block count drifted");
        assert!(still.len() <= 1, "a stream caches one large block at most");
        for x in [a, b] {
            let is_cached = still.contains(&x);
            let handed_out = reused == Some(x);
            let free = state_at(&pool, x.ptr) == BlockState::Free;
            let places = usize::from(is_cached) + usize::from(handed_out) + usize::from(free);
            assert_eq!(
                places, 1,
                "block at {:?}: cached {is_cached}, reused {handed_out}, free {free}",
                x.ptr
            );
            if is_cached || handed_out {
                held_intact(&pool, &x);
            }
        }
        assert!(drained.is_none_or(|x| x == a), "only the block cached first is drained");
    });
}

/// A stream's first lane holds a large block `a` that a global-lock section checked
/// (`pop_checked_at`: the pool's best fit, handed out, freed back). A user's lock-free large hit
/// (`pop_large`, trusting that check while the epoch reads its section) races the global-lock
/// side, which begins a section (advancing the epoch, as `lock_state` does), frees `b` into the
/// pool and drains the lane's large block into the pool. Every block ends in exactly one place,
/// and a block handed out is intact in the pool.
#[test]
fn large_hit_against_a_pool_change_and_drain() {
    model(3, || {
        let (pool, blocks) = large_pool_with_blocks(2);
        let (a, b) = (blocks[0], blocks[1]);
        let class = ClassKey { residency: Residency::Transient, rounded: 4 * MIB };
        let limits =
            Limits { enabled: true, entries: 8, bytes: 64 * MIB, biased: true, lowest_first: 0 };
        let cache = Arc::new(StreamCache::new(S0, limits));
        let epoch = Arc::new(AtomicU64::new(1));
        cache.push(class, a).unwrap();
        let sizing = Sizing::default();
        let fits = |x: &CachedBlock| pool.reuse_is_best_fit(x.block, 4 * MIB, &sizing).is_some();
        let Pop::Hit(x) = cache.pop_checked_at(class, 4 * MIB, fits, 1) else {
            panic!("section 1 reuses `a`")
        };
        cache.push(class, x).unwrap();
        let global = Arc::new(Mutex::new(pool));

        let user = {
            let (cache, epoch) = (cache.clone(), epoch.clone());
            spawn(move || match cache.pop_large(class.residency, 4 * MIB, S0, &epoch, false) {
                (Pop::Hit(x), rounded, _) => {
                    assert_eq!(rounded, 4 * MIB);
                    Some(x)
                }
                _ => None,
            })
        };
        let drained = {
            let mut pool = global.lock().unwrap();
            epoch.store(2, Ordering::Release);
            pool.free(b.block);
            let drained = cache.drain_large();
            if let Some(x) = drained {
                pool.free(x.block);
            }
            drained
        };
        let got = user.join().unwrap();

        let pool = global.lock().unwrap();
        pool.check_invariants().unwrap();
        let still: Vec<CachedBlock> = cache.peek().into_iter().map(|(_, x)| x).collect();
        assert!(still.is_empty(), "the drain empties the lane, a hit takes nothing back");
        assert_eq!(cache.large_blocks(), 0, "the large-block count drifted");
        let places = usize::from(got == Some(a)) + usize::from(drained == Some(a));
        assert_eq!(places, 1, "block `a` handed out {:?}, drained {:?}", got, drained);
        assert!(got.is_none_or(|x| x == a), "only the checked block is handed out");
        if let Some(x) = got {
            held_intact(&pool, &x);
        } else {
            assert_eq!(state_at(&pool, a.ptr), BlockState::Free);
        }
    });
}

/// Scope exit against the free of an escaped buffer on another thread: the exit closes the run
/// and makes the plan's region, adopting the escape's segment, under the run's lock. Whether
/// the escape is freed before (a recorded free), during or after the exit (its block joins the
/// region), every byte ends up either free in the pool or in the region, and all of it goes
/// back to the device with the allocator.
#[test]
fn escape_free_against_scope_exit() {
    model(2, || {
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let scope = alloc.named_scope("step", S0);
        let grad = scope.alloc_unbound(8192).unwrap();
        let freer = spawn(move || drop(grad));
        drop(scope);
        freer.join().unwrap();
        alloc.check_invariants().unwrap();
        let s = alloc.stats();
        assert_eq!(
            s.blocks.allocated_bytes.all.current, s.plan_region_bytes,
            "the escape's block is in the region or free, never stranded"
        );
        drop(alloc);
        assert_eq!(dev.live_segments(), 0);
    });
}

/// A buffer freed on another thread (its hold on the allocator kept in its stream's lane, see
/// `owner.rs`) races the last handle going, which closes every lane's stash and releases what
/// it kept. Whatever the order, once the buffer is gone the allocator is dropped and its
/// segment is back on the device. A second buffer freed later, after the close, must keep its
/// hold out of the lane too.
#[test]
fn owner_hold_kept_in_a_lane_against_the_last_handle() {
    model(3, || {
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let a = alloc.alloc(4096, S0).unwrap();
        let b = alloc.alloc(4096, S0).unwrap();
        let user = spawn(move || drop(a));
        drop(alloc);
        user.join().unwrap();
        assert_eq!(dev.live_segments(), 1, "a live buffer keeps the allocator");
        drop(b);
        assert_eq!(dev.live_segments(), 0, "the allocator outlived its last handle and buffer");
    });
}

/// A thread on the stream's second lane takes the block the first lane caches (with the hold
/// its last buffer kept there): its buffer holds the second lane's owner instead, and the kept
/// hold is let go. Its free (into the second lane) and its handle race the main thread's handle
/// going (the last one closes every lane's stash and releases what it kept). Whatever the
/// order, once both handles and the buffer are gone the allocator is dropped and its segment is
/// back on the device. With the kept hold taken and never let go (broken variant `moved_hold`)
/// the allocator outlives everything that holds it.
#[test]
fn a_block_moved_to_another_lane_against_the_last_handle() {
    model(2, || {
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let a = alloc.alloc(4096, S0).unwrap(); // this thread: the stream's lane 0
        let p = a.ptr();
        drop(a); // cached in lane 0, its hold kept there
        let other = alloc.clone();
        let user = spawn(move || {
            let b = other.alloc(4096, S0).unwrap(); // lane 1 is empty: taken from lane 0
            assert_eq!(b.ptr(), p);
            drop(other);
            drop(b);
        });
        drop(alloc);
        user.join().unwrap();
        assert_eq!(dev.live_segments(), 0, "the allocator outlived its handles and buffer");
    });
}

/// `empty_cache` lets a plan's region go only where the plan holds it alone: a run of the scope
/// on another thread takes its hold (a clone, under the plans' lock) before it claims the region.
/// With the count unchecked (broken variant `region_idle`) the region can be taken from its
/// plan between the run's hold and its claim, and the model ends with a device segment that
/// was never released.
#[test]
fn idle_region_release_against_a_run_of_its_scope() {
    model(2, || {
        let dev = Arc::new(LoomDevice::new());
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        for _ in 0..2 {
            let scope = alloc.named_scope("step", S0);
            drop(scope.alloc(8192).unwrap());
        }
        assert!(alloc.stats().plan_region_bytes > 0, "learned and planned: a region");
        let runner = {
            let alloc = alloc.clone();
            spawn(move || {
                let scope = alloc.named_scope("step", S0);
                drop(scope.alloc(8192).unwrap());
            })
        };
        alloc.empty_cache().unwrap();
        runner.join().unwrap();
        alloc.check_invariants().unwrap();
        drop(alloc);
        assert_eq!(dev.live_segments(), 0);
    });
}

/// The caps on reserved memory, family-wide: the general allocator (on the default stream) and
/// a private pool (routed stream 1) each need a new 2 MiB small segment at once, under a 3 MiB
/// cap: exactly one gets it, the other is out of memory, and the device holds one segment.
/// (Broken `cap_check`: a check of the family's total, then an add — both pass on the same
/// room, and 4 MiB are reserved under the 3 MiB cap.)
#[test]
fn a_pool_and_the_general_allocator_reserving_at_once_under_a_cap() {
    model(2, || {
        let dev = Arc::new(LoomDevice::new());
        let alloc =
            Allocator::new(dev.clone(), Config::parse("memory_limit_mb:3").unwrap()).unwrap();
        let pool = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
        let s1 = StreamId(1);
        let guard = alloc.use_pool(&pool, s1).unwrap();
        let other = {
            let alloc = alloc.clone();
            spawn(move || alloc.alloc(4096, S0).ok())
        };
        let mine = alloc.alloc(4096, s1).ok();
        let theirs = other.join().unwrap();
        assert_eq!(
            mine.is_some() as u32 + theirs.is_some() as u32,
            1,
            "one 2 MiB segment fits under the 3 MiB cap"
        );
        assert_eq!(dev.live_segments(), 1);
        drop((mine, theirs, guard));
        alloc.check_invariants().unwrap();
        pool.check_invariants().unwrap();
    });
}

/// A lane whose stream (`T`) was destroyed (closed and flushed, under the global lock) is
/// re-tagged for a new stream `S` of its slot on the global-lock side, which then frees `new`
/// into it and asks for memory on `S`. Meanwhile a user frees `old`, a buffer of `T` that
/// outlived it and still holds the lane (`push_stash` for `T`), then asks for memory on `T` (a
/// stale hit), under the lane's lock only. Every block ends in exactly one place; the lane
/// never holds a block of `T` once it serves `S`, and no hit serves `T` from it.
#[test]
fn a_lane_retagged_for_a_new_stream_against_a_stale_free_and_hits() {
    const T: StreamId = StreamId(6);
    const S: StreamId = StreamId(70);
    model(3, || {
        let (pool, blocks) = pool_with_blocks(2);
        let (old, new) = (cached(&pool, blocks[0]), cached(&pool, blocks[1]));
        let cache = Arc::new(StreamCache::new(T, LIMITS));
        cache.close(); // `T` was destroyed
        let stale = {
            let cache = cache.clone();
            spawn(move || {
                let refused = cache.push_stash(CLASS, old, T, false).is_err();
                let hit = match cache.pop_request(Residency::Transient, 4096, T) {
                    (Pop::Hit(x), ..) => Some(x),
                    _ => None,
                };
                (refused, hit)
            })
        };
        let left = cache.retag(S, LIMITS, Sizing::default());
        let pushed = cache.push_stash(CLASS, new, S, false).is_ok();
        let got = match cache.pop_request(Residency::Transient, 4096, S) {
            (Pop::Hit(x), ..) => Some(x),
            _ => None,
        };
        let (refused, stale_hit) = stale.join().unwrap();

        assert_eq!(stale_hit, None, "a hit for the destroyed stream was served");
        assert_ne!(got, Some(old), "stream S was handed a block of stream T");
        assert_eq!(cache.stream(), S);
        let still: Vec<CachedBlock> = cache.peek().into_iter().map(|(_, x)| x).collect();
        let places = usize::from(refused) + usize::from(left.contains(&old));
        assert_eq!(
            places, 1,
            "old: refused {refused}, left at the re-tag {left:?}, cached {still:?}"
        );
        assert!(!still.contains(&old), "the lane serving S holds a block of T");
        assert!(pushed, "the free on S is cached");
        assert_eq!(got, Some(new), "the hit on S takes the block freed on S");
    });
}

/// A lane whose owner thread ended passes to the next user (`thread_token.rs`, `lane_lock.rs`):
/// the owner claims the lane and takes it biased, ends its token (`retire`, what its
/// thread-local destructor does at thread exit) and takes the lane once more, as a later
/// destructor of that thread freeing a buffer would; another thread's claiming takes meanwhile
/// find the owner alive (the CAS, revoking the bias) or ended (the bias revoked, the lane theirs
/// and biased for them). Loom's cell tracking fails the model on two holders at once, the sum
/// on a lost update. Broken variant `token_ends_early`: the ended thread goes on using its old
/// token, and takes the lane through a bias that now belongs to the next user.
#[test]
fn a_lane_whose_owner_ended_against_the_next_users_claim() {
    model(3, || {
        let lock = Arc::new(LaneLock::new(true, 0u64));
        *lock.lock_claiming() += 1; // the owner: the first user
        let l2 = lock.clone();
        let next = spawn(move || {
            for _ in 0..2 {
                let mut g = l2.lock_claiming();
                let v = *g;
                *g = v + 10;
            }
        });
        {
            let mut g = lock.lock_claiming();
            let v = *g;
            *g = v + 1;
        }
        retire();
        {
            let mut g = lock.lock_claiming();
            let v = *g;
            *g = v + 1;
        }
        next.join().unwrap();
        assert_eq!(*lock.lock(), 23);
    });
}

/// A lane's lock biased towards its owner (`lane_lock.rs`): the owner takes it with a store, the
/// light fence and a load; another thread's `lock` clears the bias, passes the heavy fence and
/// waits for the owner to be out; its `try_lock` gives the bias back instead of waiting; and the
/// owner biases the lane again after its next take through the CAS (`REBIAS` is 1 under loom).
/// Loom's cell tracking fails the model on any two holders at once, and the sum on any lost
/// update. Broken variant `lane_bias`: the heavy fence left out.
#[test]
fn a_biased_lane_against_another_threads_take() {
    model(3, || {
        let lock = Arc::new(LaneLock::new(true, 0u64));
        // The owner: the first user to take it.
        *lock.lock_claiming() += 1;
        let l2 = lock.clone();
        let other = spawn(move || {
            {
                let mut g = l2.lock();
                let v = *g;
                *g = v + 10;
            }
            let mut took = false;
            if let Some(mut g) = l2.try_lock() {
                let v = *g;
                *g = v + 100;
                took = true;
            }
            took
        });
        for _ in 0..2 {
            let mut g = lock.lock_claiming();
            let v = *g;
            *g = v + 1;
        }
        let took = other.join().unwrap();
        assert_eq!(*lock.lock(), if took { 113 } else { 13 });
    });
}
