//! Exact-address tests of the pool on a fake address space (in the spirit of TensorFlow's BFC
//! allocator tests): every address and size below is computed by hand.

use super::*;
use crate::types::{PoolKind, Residency, StreamId};

const BASE: u64 = 0x1_0000_0000;

fn key(kind: PoolKind) -> PoolKey {
    PoolKey { residency: Residency::Transient, stream: StreamId(0), kind }
}

fn small() -> PoolKey {
    key(PoolKind::Small)
}

fn large() -> PoolKey {
    key(PoolKind::Large)
}

/// Allocates `bytes` from `pool` the way the allocator does, adding a segment at `next_base`
/// when no cached block fits; the pool kind of `k` follows the size. Returns (block, address).
fn alloc(
    pool: &mut Pool,
    sizing: &Sizing,
    k: PoolKey,
    bytes: u64,
    next_base: &mut u64,
) -> (BlockId, u64) {
    let rounded = sizing.round(bytes).unwrap();
    let k = PoolKey { kind: sizing.kind(rounded), ..k };
    let block = match pool.find_free(k, rounded, sizing) {
        Some(b) => b,
        None => {
            let seg = sizing.segment_size(rounded);
            let b = pool.add_segment(k, *next_base, seg);
            *next_base += seg;
            b
        }
    };
    let b = pool.allocate(block, rounded, bytes, sizing);
    pool.check_invariants().unwrap();
    (b, pool.block(b).addr)
}

fn sizes(pool: &Pool, seg: SegmentId) -> Vec<(u64, u64, BlockState)> {
    pool.segment_blocks(seg).map(|(_, b)| (b.addr - BASE, b.size, b.state)).collect()
}

use BlockState::{Allocated as A, Free as F, Pending as P};

#[test]
fn small_requests_split_a_2mib_segment() {
    let (mut pool, s, mut next) = (Pool::new(), Sizing::default(), BASE);
    let (a, addr_a) = alloc(&mut pool, &s, small(), 1, &mut next);
    let (_, addr_b) = alloc(&mut pool, &s, small(), 1000, &mut next);
    assert_eq!(addr_a, BASE);
    assert_eq!(addr_b, BASE + 512);
    let seg = pool.block(a).segment;
    assert_eq!(sizes(&pool, seg), vec![(0, 512, A), (512, 1024, A), (1536, 2 * MIB - 1536, F)]);
    let st = pool.stats();
    assert_eq!(st.reserved_bytes.all.current, 2 * MIB);
    assert_eq!(st.allocated_bytes.all.current, 1536);
    assert_eq!(st.requested_bytes.all.current, 1001);
    assert_eq!(st.inactive_split_bytes.all.current, 2 * MIB - 1536);
    assert_eq!(st.inactive_split.all.current, 1);
    assert_eq!(st.allocation.small_pool.current, 2);
    assert_eq!(st.segment.small_pool.current, 1);
}

#[test]
fn exact_fit_does_not_split() {
    let (mut pool, s, mut next) = (Pool::new(), Sizing::default(), BASE);
    let (a, _) = alloc(&mut pool, &s, small(), 2 * MIB - 512, &mut next);
    // 2 MiB - 512 is above small_size, so it goes to the large pool with a 20 MiB segment,
    // split since the 18 MiB + 512 remainder exceeds 1 MiB.
    let seg_a = pool.block(a).segment;
    assert_eq!(pool.segment(seg_a).key.kind, PoolKind::Large);
    assert_eq!(
        sizes(&pool, seg_a),
        vec![(0, 2 * MIB - 512, A), (2 * MIB - 512, 18 * MIB + 512, F)]
    );
    let (b, _) = alloc(&mut pool, &s, small(), MIB, &mut next);
    let seg = pool.block(b).segment;
    assert_eq!(sizes(&pool, seg), vec![(20 * MIB, MIB, A), (21 * MIB, MIB, F)]);
    let (c, addr_c) = alloc(&mut pool, &s, small(), MIB, &mut next);
    assert_eq!(addr_c, BASE + 21 * MIB);
    assert_eq!(sizes(&pool, seg), vec![(20 * MIB, MIB, A), (21 * MIB, MIB, A)]);
    assert_eq!(pool.stats().inactive_split_bytes.small_pool.current, 0);
    assert_eq!(pool.stats().inactive_split_bytes.large_pool.current, 18 * MIB + 512);
    pool.free(c);
    pool.free(b);
    pool.check_invariants().unwrap();
    assert_eq!(sizes(&pool, seg), vec![(20 * MIB, 2 * MIB, F)]);
}

#[test]
fn coalesce_left_right_and_both() {
    let (mut pool, s, mut next) = (Pool::new(), Sizing::default(), BASE);
    let ids: Vec<BlockId> =
        (0..4).map(|_| alloc(&mut pool, &s, small(), 512, &mut next).0).collect();
    let seg = pool.block(ids[0]).segment;
    let tail = 2 * MIB - 2048;
    // Free the second block: no free neighbour, stays alone.
    pool.free(ids[1]);
    pool.check_invariants().unwrap();
    assert_eq!(
        sizes(&pool, seg),
        vec![(0, 512, A), (512, 512, F), (1024, 512, A), (1536, 512, A), (2048, tail, F)]
    );
    // Free the first: merges right into the second.
    let m = pool.free(ids[0]);
    pool.check_invariants().unwrap();
    assert_eq!(pool.block(m).addr, BASE);
    assert_eq!(
        sizes(&pool, seg),
        vec![(0, 1024, F), (1024, 512, A), (1536, 512, A), (2048, tail, F)]
    );
    // Free the fourth: merges left-to-right with the tail.
    let m = pool.free(ids[3]);
    pool.check_invariants().unwrap();
    assert_eq!(pool.block(m).addr, BASE + 1536);
    assert_eq!(sizes(&pool, seg), vec![(0, 1024, F), (1024, 512, A), (1536, tail + 512, F)]);
    assert_eq!(pool.stats().inactive_split_bytes.all.current, 1024 + tail + 512);
    // Free the third: merges both ways, the segment is whole again.
    let m = pool.free(ids[2]);
    pool.check_invariants().unwrap();
    assert_eq!(pool.block(m).addr, BASE);
    assert_eq!(sizes(&pool, seg), vec![(0, 2 * MIB, F)]);
    assert_eq!(pool.stats().inactive_split_bytes.all.current, 0);
    assert_eq!(pool.stats().inactive_split.all.current, 0);
    assert_eq!(pool.releasable_segments(|_| true), vec![seg]);
    assert_eq!(pool.remove_segment(seg), (BASE, 2 * MIB));
    pool.check_invariants().unwrap();
    assert_eq!(pool.stats().reserved_bytes.all.current, 0);
    assert_eq!(pool.stats().reserved_bytes.all.peak, 2 * MIB);
}

#[test]
fn best_fit_takes_smallest_then_lowest_address() {
    let (mut pool, s, mut next) = (Pool::new(), Sizing::default(), BASE);
    // Carve holes of 1536, 1024 and 1024 bytes, separated by live blocks.
    let sizes_in = [1536, 512, 1024, 512, 1024, 512];
    let ids: Vec<BlockId> =
        sizes_in.iter().map(|&b| alloc(&mut pool, &s, small(), b, &mut next).0).collect();
    pool.free(ids[0]);
    pool.free(ids[2]);
    pool.free(ids[4]);
    pool.check_invariants().unwrap();
    // A 1000-byte request rounds to 1024 and takes the lower of the two 1024 holes.
    let (_, addr) = alloc(&mut pool, &s, small(), 1000, &mut next);
    assert_eq!(addr, BASE + 1536 + 512);
    let (_, addr) = alloc(&mut pool, &s, small(), 1024, &mut next);
    assert_eq!(addr, BASE + 1536 + 512 + 1024 + 512);
    // 1100 bytes → 1536: only the first hole fits exactly.
    let (_, addr) = alloc(&mut pool, &s, small(), 1100, &mut next);
    assert_eq!(addr, BASE);
    assert_eq!(pool.stats().segment.all.current, 1);
}

#[test]
fn large_pool_splits_only_above_1mib_remainder() {
    let (mut pool, s, mut next) = (Pool::new(), Sizing::default(), BASE);
    let (a, _) = alloc(&mut pool, &s, large(), 18 * MIB + 512, &mut next);
    let seg = pool.block(a).segment;
    // 20 MiB - (18 MiB + 512) = 2 MiB - 512 > 1 MiB: split.
    assert_eq!(sizes(&pool, seg), vec![(0, 18 * MIB + 512, A), (18 * MIB + 512, 2 * MIB - 512, F)]);
    let (b, _) = alloc(&mut pool, &s, large(), MIB + 512, &mut next);
    // The 2 MiB - 512 hole serves 1 MiB + 512, leaving 1 MiB - 1024: not split.
    assert_eq!(pool.block(b).addr, BASE + 18 * MIB + 512);
    assert_eq!(pool.block(b).size, 2 * MIB - 512);
    assert_eq!(pool.block(b).requested, MIB + 512);
    assert_eq!(pool.stats().allocated_bytes.large_pool.current, 20 * MIB);
    assert_eq!(pool.stats().requested_bytes.large_pool.current, 19 * MIB + 1024);
}

#[test]
fn huge_requests_get_their_own_rounded_segment() {
    let (mut pool, s, mut next) = (Pool::new(), Sizing::default(), BASE);
    let (a, addr) = alloc(&mut pool, &s, large(), 11 * MIB + 1, &mut next);
    assert_eq!(addr, BASE);
    let seg = pool.block(a).segment;
    assert_eq!(pool.segment(seg).size, 12 * MIB);
    // The 1 MiB - 512 remainder is not > 1 MiB, so no split.
    assert_eq!(sizes(&pool, seg), vec![(0, 12 * MIB, A)]);
    assert_eq!(pool.block(a).requested, 11 * MIB + 1);
}

#[test]
fn max_split_size_keeps_big_blocks_whole_and_reserved_for_big_requests() {
    let s = Sizing { max_split_size: 64 * MIB, ..Sizing::default() };
    let (mut pool, mut next) = (Pool::new(), BASE);
    let (a, _) = alloc(&mut pool, &s, large(), 100 * MIB, &mut next);
    pool.free(a);
    // A small-ish large request may not spend the 100 MiB block: a new segment is made.
    let (b, addr_b) = alloc(&mut pool, &s, large(), 2 * MIB, &mut next);
    assert_eq!(addr_b, BASE + 100 * MIB);
    assert_eq!(pool.segment(pool.block(b).segment).size, 20 * MIB);
    // A 90 MiB request may use it (100 < 90 + 20), unsplit since 90 MiB ≥ max_split_size.
    let (c, addr_c) = alloc(&mut pool, &s, large(), 90 * MIB, &mut next);
    assert_eq!(addr_c, BASE);
    assert_eq!(pool.block(c).size, 100 * MIB);
    pool.free(c);
    // A 70 MiB request may not (100 ≥ 70 + 20).
    let (_, addr_d) = alloc(&mut pool, &s, large(), 70 * MIB, &mut next);
    assert_eq!(addr_d, BASE + 120 * MIB);
}

#[test]
fn pending_blocks_are_not_merged_or_reused() {
    let (mut pool, s, mut next) = (Pool::new(), Sizing::default(), BASE);
    let (a, _) = alloc(&mut pool, &s, small(), 512, &mut next);
    let (b, _) = alloc(&mut pool, &s, small(), 512, &mut next);
    pool.mark_pending(a);
    pool.check_invariants().unwrap();
    assert_eq!(pool.stats().allocated_bytes.all.current, 512);
    assert_eq!(pool.stats().active_bytes.all.current, 1024);
    pool.free(b);
    pool.check_invariants().unwrap();
    let seg = pool.block(a).segment;
    assert_eq!(sizes(&pool, seg), vec![(0, 512, P), (512, 2 * MIB - 512, F)]);
    // A new 512-byte request skips the pending block.
    let (_, addr) = alloc(&mut pool, &s, small(), 512, &mut next);
    assert_eq!(addr, BASE + 512);
    pool.free(a);
    pool.check_invariants().unwrap();
    assert_eq!(pool.stats().active_bytes.all.current, 512);
    assert_eq!(pool.stats().requested_bytes.all.current, 512);
}

#[test]
fn keys_never_share_blocks() {
    let (mut pool, s, mut next) = (Pool::new(), Sizing::default(), BASE);
    let other_stream = PoolKey { stream: StreamId(1), ..small() };
    let persistent = PoolKey { residency: Residency::Persistent, ..small() };
    let (a, _) = alloc(&mut pool, &s, small(), 512, &mut next);
    let (_, addr_b) = alloc(&mut pool, &s, other_stream, 512, &mut next);
    let (_, addr_c) = alloc(&mut pool, &s, persistent, 512, &mut next);
    assert_eq!(addr_b, BASE + 2 * MIB);
    assert_eq!(addr_c, BASE + 4 * MIB);
    assert_eq!(pool.segment(pool.block(a).segment).key, small());
    assert_eq!(pool.stats().reserved_bytes.persistent.current, 2 * MIB);
    assert_eq!(pool.stats().reserved_bytes.transient.current, 4 * MIB);
    assert_eq!(pool.free_of(other_stream).count(), 1);
    assert_eq!(pool.free_bytes_where(|k| k.stream == StreamId(1)), 2 * MIB - 512);
}

#[test]
fn invariant_checker_catches_corruption() {
    let (mut pool, s, mut next) = (Pool::new(), Sizing::default(), BASE);
    let (a, _) = alloc(&mut pool, &s, small(), 512, &mut next);
    pool.blocks[a.0].size = 1024;
    assert!(pool.check_invariants().unwrap_err().contains("tiling"));
    pool.blocks[a.0].size = 512;
    pool.check_invariants().unwrap();
    pool.live[1][0] += 1;
    assert!(pool.check_invariants().unwrap_err().contains("stats drifted"));
}

/// Large pool, default sizing: a 20 MiB segment at `base` with the given blocks allocated in
/// order (sizes already rounded); returns their ids.
fn carve(pool: &mut Pool, s: &Sizing, base: u64, sizes: &[u64]) -> Vec<BlockId> {
    let mut free = pool.add_segment(large(), base, 20 * MIB);
    let mut out = Vec::new();
    for &size in sizes {
        let b = pool.allocate(free, size, size, s);
        out.push(b);
        if let Some(n) = pool.block(b).next {
            free = n;
        }
    }
    pool.check_invariants().unwrap();
    out
}

#[test]
fn reuse_of_a_block_before_its_free_remainder_is_the_best_fit() {
    let (mut pool, s) = (Pool::new(), Sizing::default());
    let a = carve(&mut pool, &s, BASE, &[4 * MIB])[0];
    // [a 4 MiB][free 16 MiB]: freed, the segment is whole; 4 MiB splits off its start again.
    assert!(pool.reuse_is_best_fit(a, 4 * MIB, &s).is_some());
    // Another request of the class would not leave the same split.
    assert!(pool.reuse_is_best_fit(a, 4 * MIB - 512, &s).is_none());
    // A pending block is not reusable.
    pool.mark_pending(a);
    assert!(pool.reuse_is_best_fit(a, 4 * MIB, &s).is_none());
}

#[test]
fn reuse_is_refused_when_another_free_block_fits_better() {
    let (mut pool, s) = (Pool::new(), Sizing::default());
    let a = carve(&mut pool, &s, BASE, &[4 * MIB])[0];
    // A second segment [16 MiB][free 4 MiB]: the 4 MiB hole is the best fit once `a` is freed.
    carve(&mut pool, &s, BASE + 20 * MIB, &[16 * MIB]);
    assert!(pool.reuse_is_best_fit(a, 4 * MIB, &s).is_none());
    // Check by doing it: the search takes the hole at 36 MiB.
    pool.free(a);
    let best = pool.find_free(large(), 4 * MIB, &s).unwrap();
    assert_eq!(pool.block(best).addr, BASE + 36 * MIB);
}

#[test]
fn reuse_is_refused_when_a_whole_segment_at_a_lower_address_ties() {
    let (mut pool, s) = (Pool::new(), Sizing::default());
    // An untouched 20 MiB segment below: freed, `a` merges into 20 MiB at a higher address.
    pool.add_segment(large(), BASE, 20 * MIB);
    let a = carve(&mut pool, &s, BASE + 20 * MIB, &[4 * MIB])[0];
    assert!(pool.reuse_is_best_fit(a, 4 * MIB, &s).is_none());
    // The same with the untouched segment above: `a` wins the tie on its address.
    let (mut pool, s) = (Pool::new(), Sizing::default());
    let a = carve(&mut pool, &s, BASE, &[4 * MIB])[0];
    pool.add_segment(large(), BASE + 20 * MIB, 20 * MIB);
    assert!(pool.reuse_is_best_fit(a, 4 * MIB, &s).is_some());
    // A free block smaller than the merged 20 MiB but too small for the request changes nothing.
    carve(&mut pool, &s, BASE + 40 * MIB, &[16 * MIB + 512]);
    assert!(pool.reuse_is_best_fit(a, 4 * MIB, &s).is_some());
}

#[test]
fn reuse_is_refused_when_the_left_neighbour_is_free() {
    let (mut pool, s) = (Pool::new(), Sizing::default());
    let ids = carve(&mut pool, &s, BASE, &[4 * MIB, 4 * MIB]);
    pool.free(ids[0]);
    // Freed, `ids[1]` would merge into [0, 20 MiB) and the request would start at BASE.
    assert!(pool.reuse_is_best_fit(ids[1], 4 * MIB, &s).is_none());
}

#[test]
fn reuse_between_busy_neighbours_and_of_unsplit_blocks() {
    let (mut pool, s) = (Pool::new(), Sizing::default());
    let ids = carve(&mut pool, &s, BASE, &[4 * MIB, 4 * MIB, 12 * MIB]);
    assert_eq!(pool.block(ids[2]).next, None);
    assert!(pool.reuse_is_best_fit(ids[1], 4 * MIB, &s).is_some());
    // Exactly between busy neighbours, a smaller request of the class would not split it
    // (a 1 MiB - 512 remainder stays), so it is reused whole.
    assert!(pool.reuse_is_best_fit(ids[1], 3 * MIB + 512, &s).is_some());
    // But 2 MiB would split (remainder 2 MiB > 1 MiB): not the same block.
    assert!(pool.reuse_is_best_fit(ids[1], 2 * MIB, &s).is_none());
}

/// Against the real thing: for random pools (small, large and huge blocks), whenever `reuse_is_best_fit` says yes, freeing
/// the block and allocating the best fit gives exactly the same blocks everywhere.
#[test]
fn reuse_agrees_with_free_then_best_fit() {
    for s in [
        Sizing::default(),
        Sizing { max_split_size: 8 * MIB, ..Sizing::default() },
        Sizing {
            roundup_power2_divisions: crate::pool::RoundupDivisions::uniform(4).unwrap(),
            ..Sizing::default()
        },
    ] {
        reuse_agrees_under(s);
    }
}

fn reuse_agrees_under(s: Sizing) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let layout = |p: &Pool| {
        let mut v: Vec<(u64, u64, BlockState)> = p
            .segments()
            .flat_map(|(id, _)| p.segment_blocks(id).map(|(_, b)| (b.addr, b.size, b.state)))
            .collect();
        v.sort_unstable_by_key(|b| b.0);
        v
    };
    let (mut yes, mut checked) = (0, 0);
    for _ in 0..200 {
        let (mut pool, mut next) = (Pool::new(), BASE);
        let mut live: Vec<(BlockId, u64)> = Vec::new();
        for _ in 0..40 {
            if rnd(3) > 0 || live.is_empty() {
                let bytes = match rnd(3) {
                    0 => 512 * (1 + rnd(8192)),
                    1 => MIB * (2 + rnd(6)),
                    _ => 10 * MIB + 512 * rnd(8192),
                };
                let (b, _) = alloc(&mut pool, &s, small(), bytes, &mut next);
                live.push((b, s.round(bytes).unwrap()));
            } else {
                let (b, _) = live.swap_remove(rnd(live.len() as u64) as usize);
                pool.free(b);
            }
        }
        for &(b, rounded) in &live {
            checked += 1;
            let Some(merged) = pool.reuse_is_best_fit(b, rounded, &s) else {
                continue;
            };
            yes += 1;
            let mut freed = pool.clone();
            freed.free(b);
            let key = pool.segment(pool.block(b).segment).key;
            let best = freed.find_free(key, rounded, &s).expect("the freed block fits");
            assert_eq!(freed.block(best).size, merged, "the merged free block's bytes");
            let again = freed.allocate(best, rounded, rounded, &s);
            freed.check_invariants().unwrap();
            assert_eq!(freed.block(again).addr, pool.block(b).addr);
            assert_eq!(layout(&freed), layout(&pool));
        }
    }
    assert!(yes * 4 > checked, "reuse accepted {yes} of {checked}");
}

/// The inactive-split figures, exactly (current, peak and both totals), through a split of a
/// whole segment, a split of its remainder (PyTorch's: only the bytes handed out leave the
/// figures), an allocation of a whole remainder, and frees that merge (the net change only:
/// PyTorch's `free_block`).
#[test]
fn inactive_split_totals_are_exact() {
    let mut pool = Pool::new();
    let sizing = Sizing::default();
    let b0 = pool.add_segment(large(), BASE, 20 * MIB);
    let s = |pool: &Pool| {
        let st = pool.stats();
        let (b, n) = (st.inactive_split_bytes, st.inactive_split);
        assert_eq!(b.all, b.large_pool);
        assert_eq!(b.all, b.transient);
        assert_eq!(n.all, n.transient);
        assert_eq!((b.small_pool, b.persistent), (Stat::default(), Stat::default()));
        let f = |x: Stat| (x.current, x.peak, x.allocated, x.freed);
        (f(b.all), f(n.all))
    };
    let a = pool.allocate(b0, 4 * MIB, 4 * MIB, &sizing); // whole segment: split, 16 MiB left
    assert_eq!(s(&pool), ((16 * MIB, 16 * MIB, 16 * MIB, 0), (1, 1, 1, 0)));
    let rest = pool.find_free(large(), 4 * MIB, &sizing).unwrap();
    let b = pool.allocate(rest, 4 * MIB, 4 * MIB, &sizing); // the split remainder: 12 MiB left
    assert_eq!(s(&pool), ((12 * MIB, 16 * MIB, 16 * MIB, 4 * MIB), (1, 1, 1, 0)));
    let rest = pool.find_free(large(), 12 * MIB, &sizing).unwrap();
    let c = pool.allocate(rest, 12 * MIB, 12 * MIB, &sizing); // all of it: no split
    assert_eq!(s(&pool), ((0, 16 * MIB, 16 * MIB, 16 * MIB), (0, 1, 1, 1)));
    pool.free(b); // between two allocated blocks: 4 MiB in
    assert_eq!(s(&pool), ((4 * MIB, 16 * MIB, 20 * MIB, 16 * MIB), (1, 1, 2, 1)));
    pool.free(c); // merges with b's 4 MiB: 16 MiB (net: one block, 12 MiB more)
    assert_eq!(s(&pool), ((16 * MIB, 16 * MIB, 32 * MIB, 16 * MIB), (1, 1, 2, 1)));
    pool.free(a); // the whole segment again: no split
    assert_eq!(s(&pool), ((0, 16 * MIB, 32 * MIB, 32 * MIB), (0, 1, 2, 2)));
    pool.check_invariants().unwrap();
}

/// A key's free index goes with its last segment (removed, moved to another stream, or carved
/// away whole) and its slot is reused by the next new key, so a program that makes and
/// destroys streams keeps a bounded table, not an index per stream it ever used; a retired
/// key's stream is still reported as changed, once, so its published free bytes drop to 0.
#[test]
fn a_keys_index_goes_with_its_last_segment_and_its_slot_is_reused() {
    let mut pool = Pool::new();
    let on = |s: u32| PoolKey { stream: StreamId(s), ..small() };
    let mut dirty = Vec::new();
    for s in 1..=200u32 {
        let base = BASE + u64::from(s) * 2 * MIB;
        let b = pool.add_segment(on(s), base, 2 * MIB);
        let seg = pool.block(b).segment;
        assert!(pool.has_key(on(s)));
        assert_eq!(pool.free_bytes_of(StreamId(s)), 2 * MIB);
        pool.take_dirty_streams(&mut dirty);
        assert_eq!(dirty, vec![StreamId(s)]);
        assert_eq!(pool.remove_segment(seg), (base, 2 * MIB));
        assert!(!pool.has_key(on(s)), "stream {s}'s key outlives its segments");
        assert_eq!((pool.free.len(), pool.keys.len(), pool.vacant.clone()), (1, 0, vec![0]));
        assert_eq!(pool.dirty_streams(), vec![StreamId(s)], "its free bytes changed to 0");
        pool.take_dirty_streams(&mut dirty);
        assert_eq!((dirty.clone(), pool.free_bytes_of(StreamId(s))), (vec![StreamId(s)], 0));
        pool.check_invariants().unwrap();
    }
    // Two segments of one key: the index stays until the second goes; a move to another
    // stream retires the old key and takes the vacant slot for the new one.
    let a = pool.add_segment(on(7), BASE, 2 * MIB);
    let b = pool.add_segment(on(7), BASE + 2 * MIB, 2 * MIB);
    let (sa, sb) = (pool.block(a).segment, pool.block(b).segment);
    pool.remove_segment(sa);
    assert!(pool.has_key(on(7)));
    pool.rekey_segment(sb, StreamId(8));
    assert!(!pool.has_key(on(7)) && pool.has_key(on(8)));
    assert_eq!((pool.free.len(), pool.keys.clone()), (1, vec![(on(8), 0)]));
    assert_eq!(pool.free_bytes_of(StreamId(8)), 2 * MIB);
    pool.check_invariants().unwrap();
    // Carved away whole (expandable pages released): the key goes too.
    let first = pool.segment(sb).first;
    assert_eq!(pool.carve(first, BASE + 2 * MIB, BASE + 4 * MIB), (None, None));
    assert!(!pool.has_key(on(8)));
    pool.check_invariants().unwrap();
}

/// The statistics' publishing and the trims each take the changes they have not seen: taking
/// one list leaves the other as it was (a `stats()` read once emptied what a later trim was to
/// check), and a retired key leaves the trims' list (nothing of it is left to give back) while
/// the publishing still hears of it once.
#[test]
fn publishing_and_trims_take_the_changed_streams_apart() {
    let mut pool = Pool::new();
    let on = |s: u32| PoolKey { stream: StreamId(s), ..large() };
    let mut dirty = Vec::new();
    let a = pool.add_segment(on(2), BASE, 2 * MIB);
    pool.add_segment(on(1), BASE + 2 * MIB, 2 * MIB);
    pool.take_dirty_streams(&mut dirty);
    assert_eq!(dirty, vec![StreamId(2), StreamId(1)]);
    assert_eq!(pool.dirty_streams(), vec![]);
    assert_eq!(
        pool.take_trim_streams(),
        vec![(StreamId(1), false), (StreamId(2), false)],
        "in stream order"
    );
    assert_eq!(pool.take_trim_streams(), vec![]);
    pool.check_invariants().unwrap();
    let x = pool.allocate(a, MIB, MIB, &Sizing::default()); // stream 2's free bytes change
    assert_eq!(pool.take_trim_streams(), vec![(StreamId(2), false)]);
    assert_eq!(pool.dirty_streams(), vec![StreamId(2)], "still to publish");
    pool.free(x);
    pool.take_dirty_streams(&mut dirty);
    assert_eq!(
        (dirty.clone(), pool.take_trim_streams()),
        (vec![StreamId(2)], vec![(StreamId(2), false)])
    );
    // Changed, then retired before either reader looked.
    let seg = pool.block(a).segment;
    pool.remove_segment(seg);
    assert_eq!(pool.take_trim_streams(), vec![], "nothing of stream 2 is left to trim");
    pool.take_dirty_streams(&mut dirty);
    assert_eq!(dirty, vec![StreamId(2)], "its free bytes, now 0, are published");
    pool.check_invariants().unwrap();
}

/// With a page set, the trims' list says which streams a free left a free block of a page or
/// more on (it may hold a whole page to give back; `Shared::trim`), once per stream whatever
/// its keys, and forgets it once taken.
#[test]
fn trims_hear_of_frees_that_leave_a_page_free() {
    let mut pool = Pool::new();
    pool.set_whole_page(2 * MIB);
    let on = |s: u32| PoolKey { stream: StreamId(s), ..large() };
    let small = |s: u32| PoolKey { stream: StreamId(s), kind: PoolKind::Small, ..large() };
    let a = pool.add_segment(on(3), BASE, 4 * MIB);
    let b = pool.add_segment(small(3), BASE + 4 * MIB, 2 * MIB);
    let sizing = Sizing::default();
    let x = pool.allocate(a, MIB, MIB, &sizing);
    let rest = pool.block(x).next.unwrap();
    let y = pool.allocate(rest, MIB, MIB, &sizing);
    let z = pool.allocate(b, MIB, MIB, &sizing);
    assert_eq!(pool.take_trim_streams(), vec![(StreamId(3), false)]);
    // x alone: 1 MiB free between nothing and y.
    pool.free(x);
    assert_eq!(pool.take_trim_streams(), vec![(StreamId(3), false)]);
    // y joins x and the 2 MiB tail: 4 MiB free together.
    pool.free(y);
    pool.check_invariants().unwrap();
    assert_eq!(pool.take_trim_streams(), vec![(StreamId(3), true)]);
    assert_eq!(pool.take_trim_streams(), vec![]);
    // The small key's free leaves 2 MiB together (a page), the large key's allocation changes
    // nothing whole: one entry for the stream, whole.
    let x = pool.allocate(pool.segment(pool.block(a).segment).first, MIB, MIB, &sizing);
    pool.free(z);
    pool.check_invariants().unwrap();
    assert_eq!(pool.take_trim_streams(), vec![(StreamId(3), true)]);
    // A page freed alone (no free neighbour) counts too.
    let p = pool.allocate(pool.segment(pool.block(b).segment).first, 2 * MIB, 2 * MIB, &sizing);
    assert_eq!(pool.take_trim_streams(), vec![(StreamId(3), false)]);
    pool.free(p);
    assert_eq!(pool.take_trim_streams(), vec![(StreamId(3), true)]);
    pool.free(x);
    pool.check_invariants().unwrap();
}
