//! Statistics without a lock for readers: the exact [`BlockStats`] of the allocator, split into a
//! part written under the global lock and one part per stream cache, all published through
//! [`SeqBlock`]s and read by double collect.
//!
//! ```text
//!  BaseStats (global lock) ──publish (when read)──▶ base: SeqBlock<BASE_WORDS>
//!     live groups per quadrant: cur, tot      peaks per cell      pool-only groups      counters
//!  StreamCache (its lock)   ──publish──▶ fast: SeqBlock<FAST_WORDS>
//!     per quadrant: Δcur, Δtot of (bytes, count, requested); cached bytes and blocks
//!
//!  quadrant q = (pool kind, residency) ∈ {small, large} × {persistent, transient}
//!  cell c     = all │ small │ large │ persistent │ transient      (a cell is a sum of quadrants)
//!  current[c] = Σ_{q∈c} (base.cur[q] + Σ_streams Δcur[q])        (wrapping; the sum is exact)
//! ```
//!
//! The five *live* groups (allocated, active, requested bytes; allocation and active counts)
//! change on the fast path; the other four (reserved, segments, inactive splits) only under the
//! global lock and are mirrored from the pool.
//!
//! **Peaks stay exact, and a snapshot never shows current > peak**, by *credit*: for every live
//! group and cell, `upper[c] = current[c] + Σ credit[q∈c] ≤ peak[c]` holds at every instant.
//! - A fast free lowers current by a block and raises its stream's credit by as much: `upper`
//!   is unchanged. A fast pop spends credit it holds (else it needs the lock): unchanged again.
//!   So `upper` moves only under the global lock, where it is kept. (A lane stores no credit:
//!   it keeps a *ceiling* per quadrant and quantity, and its credit is `ceiling − Δcur`, so the
//!   free's grant and the pop's spend are the `Δcur` updates themselves.)
//! - A locked increase of `n` that fits (`upper + n ≤ peak`) cannot pass the peak. One that does
//!   not fit *revokes* all credit (locks every stream cache, zeroes credit, recomputes `upper` =
//!   the exact current) and raises the peak to the new exact value, still holding those locks.
//! - A locked pop of a lane's block that fits may *top the lane up*: under the global lock and
//!   the lane's, the lane is granted credit out of `peak − upper` (the headroom no lane holds,
//!   [`BaseStats::headroom`]) and `upper` rises by as much ([`BaseStats::assign`]), so it stays
//!   `≤ peak` (`StreamCache::pop_locked_topped`).
//!
//! A reader takes one double collect over the base and every stream cache (all sequence numbers,
//! all copies, all sequence numbers again): the copies existed together at one instant, where the
//! invariant held, so `current ≤ upper ≤ peak` in the snapshot. `freed` is `tot − current`, so
//! (current, allocated, freed) are never torn either.

use super::fast_cache::{CacheInner, StreamCache};
use super::lane_lock::LaneGuard;
use super::seqlock::{Collect, SeqBlock};
pub use super::stats_layout::*;
use crate::pool::Pool;
use crate::sync::Arc;
use crate::types::{BlockStats, Stat, StatGroup};

/// The statistics kept under the global lock. See the module docs.
///
/// Plain words: an update is a few additions, and nothing is published as it goes.
/// [`BaseStats::publish`] (a reader publishes, see `publish.rs`) stores the words that differ
/// from a copy of what it last published, so the slow path keeps no per-word change marks.
pub struct BaseStats {
    words: [u64; BASE_WORDS],
    /// The words as last published.
    published: [u64; BASE_WORDS],
    /// A word may have changed since the last publish.
    stale: bool,
    /// `upper` per live group and cell.
    upper: [[u64; CELLS]; 5],
}

impl Default for BaseStats {
    fn default() -> Self {
        BaseStats {
            words: [0; BASE_WORDS],
            published: [0; BASE_WORDS],
            stale: false,
            upper: [[0; CELLS]; 5],
        }
    }
}

/// The amounts one block adds to or removes from the live groups, in [`LIVE`] order.
#[inline]
fn live_amounts(bytes: u64, count: u64, requested: u64) -> [u64; 5] {
    [bytes, bytes, requested, count, count]
}

impl BaseStats {
    /// A block of `bytes` serving `requested` was handed out (slow path or locked pop).
    /// `caches` gives every stream cache; it is called only if credit must be revoked.
    #[inline]
    pub fn live_up<C: CacheList>(
        &mut self,
        q: usize,
        bytes: u64,
        requested: u64,
        caches: impl FnOnce() -> C,
    ) {
        self.increase(q, live_amounts(bytes, 1, requested), caches);
    }

    /// A live block went back to the pool.
    #[inline]
    pub fn live_down(&mut self, q: usize, bytes: u64, requested: u64) {
        self.decrease(q, live_amounts(bytes, 1, requested));
    }

    /// A live block was freed but waits on events: no longer allocated, still active.
    pub fn move_to_pending(&mut self, q: usize, bytes: u64) {
        self.decrease(q, [bytes, 0, 0, 1, 0]);
    }

    /// A pending block's events completed: it is free in the pool.
    pub fn pending_done(&mut self, q: usize, bytes: u64, requested: u64) {
        self.decrease(q, [0, bytes, requested, 0, 1]);
    }

    #[inline]
    fn set(&mut self, i: usize, v: u64) {
        self.words[i] = v;
        self.stale = true;
    }

    #[inline]
    fn decrease(&mut self, q: usize, n: [u64; 5]) {
        let q = q & (QUADRANTS - 1);
        let cells = cells_of(q);
        for (g, &v) in n.iter().enumerate() {
            let cur = &mut self.words[b_cur(g, q)];
            *cur = cur.wrapping_sub(v);
            for c in cells {
                self.upper[g][c] -= v;
            }
        }
        self.stale = true;
    }

    /// Adds `n` to the live groups of quadrant `q`: when it stays under every peak of its cells
    /// (`upper + n ≤ peak`), a few additions; else [`BaseStats::increase_past_peak`].
    #[inline]
    fn increase<C: CacheList>(&mut self, q: usize, n: [u64; 5], caches: impl FnOnce() -> C) {
        let q = q & (QUADRANTS - 1);
        let cells = cells_of(q);
        // `upper ≤ peak` always holds, so a zero amount always fits: no test for it.
        let mut fits = true;
        for (g, &v) in n.iter().enumerate() {
            for c in cells {
                fits &= self.upper[g][c] + v <= self.words[b_peak(g, c)];
            }
        }
        if !fits {
            return self.increase_past_peak(q, n, caches());
        }
        self.add(q, n);
    }

    /// [`BaseStats::live_up`] where it stays under every peak (`upper + n ≤ peak`): true, and
    /// the block is accounted. False (nothing changed) where it may pass a peak: the caller
    /// then calls [`BaseStats::live_up`], which revokes credit.
    #[inline]
    pub fn try_live_up(&mut self, q: usize, bytes: u64, requested: u64) -> bool {
        let q = q & (QUADRANTS - 1);
        let n = live_amounts(bytes, 1, requested);
        let mut fits = true;
        for (g, &v) in n.iter().enumerate() {
            for c in cells_of(q) {
                fits &= self.upper[g][c] + v <= self.words[b_peak(g, c)];
            }
        }
        if fits {
            self.add(q, n);
        }
        fits
    }

    /// The headroom under the peaks not yet assigned as credit, for a lane's credit in quadrant
    /// `q`, per lane quantity (bytes, count, requested): the least `peak − upper` over the
    /// live groups that quantity feeds and the cells that contain `q`.
    #[inline]
    pub fn headroom(&self, q: usize) -> [u64; 3] {
        let q = q & (QUADRANTS - 1);
        let mut room = [u64::MAX; 3];
        for (g, &(_, qty)) in LIVE.iter().enumerate() {
            for c in cells_of(q) {
                room[qty] = room[qty].min(self.words[b_peak(g, c)] - self.upper[g][c]);
            }
        }
        room
    }

    /// Counts `n` (bytes, count, requested) of quadrant `q` as credit a lane was just granted
    /// (a *top-up*, `StreamCache::pop_locked_topped`): `upper` rises by it in every live group
    /// and every cell containing `q`, so `upper = current + Σ credit` holds; `n` is at most
    /// [`BaseStats::headroom`], so `upper ≤ peak` holds too.
    #[inline]
    pub fn assign(&mut self, q: usize, n: [u64; 3]) {
        let q = q & (QUADRANTS - 1);
        for (g, &(_, qty)) in LIVE.iter().enumerate() {
            for c in cells_of(q) {
                self.upper[g][c] += n[qty];
            }
        }
    }

    /// Adds `n` to the live groups of quadrant `q` (currents, totals and `upper`).
    #[inline(always)]
    fn add(&mut self, q: usize, n: [u64; 5]) {
        for (g, &v) in n.iter().enumerate() {
            let cur = &mut self.words[b_cur(g, q)];
            *cur = cur.wrapping_add(v);
            let tot = &mut self.words[b_tot(g, q)];
            *tot = tot.wrapping_add(v);
            for c in cells_of(q) {
                self.upper[g][c] += v;
            }
        }
        self.stale = true;
    }

    /// [`BaseStats::increase`] of an amount that may pass a peak: revokes all credit (so that
    /// `upper` is the exact current), applies it and raises the peaks of quadrant `q`'s cells
    /// to `upper`, the new exact values, all with every stream cache locked.
    #[cold]
    #[inline(never)]
    fn increase_past_peak<C: CacheList>(&mut self, q: usize, n: [u64; 5], held: C) {
        self.revoke_then(held.list(), |b| {
            b.add(q, n);
            for g in 0..n.len() {
                for c in cells_of(q) {
                    // `upper` is the exact current now: a new peak is exact.
                    let p = b_peak(g, c);
                    b.words[p] = b.words[p].max(b.upper[g][c]);
                }
            }
        });
    }

    fn peak(&self, g: usize, c: usize) -> u64 {
        self.words[b_peak(g, c)]
    }

    /// Locks every stream cache, zeroes its credit (its ceiling becomes its `Δcur`), recomputes
    /// `upper` as the exact current, and runs `apply` before letting the caches go.
    ///
    /// The lanes' current deltas are summed per quantity and quadrant (three quantities feed
    /// the five live groups), and up to [`HELD_INLINE`] lanes are held on the stack
    /// ([`hold_revoked`]).
    fn revoke_then(&mut self, caches: &[Arc<StreamCache>], apply: impl FnOnce(&mut Self)) {
        // No lane marked: none was granted credit since its last revocation, so none holds
        // any and `upper` is the exact current already. (Marks are set only under the lanes'
        // locks and cleared only here, under the global lock: all read clear means all were
        // clear at the first read, an instant where `upper` was exact.)
        if !caches.iter().any(|c| c.may_hold_credit()) {
            return apply(self);
        }
        let mut apply = Some(apply);
        let mut then = |lanes: &[u64; LANE_CURS]| {
            for (g, &(_, qty)) in LIVE.iter().enumerate() {
                let cur: [u64; QUADRANTS] = std::array::from_fn(|q| {
                    self.words[b_cur(g, q)].wrapping_add(lanes[fast_cur(qty, q)])
                });
                self.upper[g] = cell_sums(&cur);
            }
            if let Some(apply) = apply.take() {
                apply(self);
            }
        };
        let mut lanes = [0u64; LANE_CURS];
        if caches.len() > HELD_INLINE {
            let mut guards: Vec<_> = caches.iter().map(|c| (c, c.lock_inner())).collect();
            guards.iter_mut().for_each(|(c, g)| revoke_lane(c, g, &mut lanes));
            then(&lanes);
        } else {
            hold_revoked(caches, &mut lanes, &mut then);
        }
    }

    /// Sets every peak to its current value (the pool's own peaks are reset by the caller).
    pub fn reset_peaks(&mut self, caches: &[Arc<StreamCache>]) {
        self.revoke_then(caches, |b| {
            for g in 0..5 {
                for c in 0..CELLS {
                    b.set(b_peak(g, c), b.upper[g][c]);
                }
            }
        });
    }

    /// Copies the pool-only groups from the pool and the plain counters.
    pub fn mirror(&mut self, pool: &BlockStats, counters: [u64; COUNTERS]) {
        self.mirror_changed(pool, counters, Pool::SEGMENTS_CHANGED | Pool::SPLITS_CHANGED);
    }

    /// Like [`BaseStats::mirror`], copying only the cells of the pool-only groups that `changed`
    /// (from [`Pool::take_changed`]) names: the quadrants whose reserved bytes and segments, or
    /// inactive splits, changed.
    pub fn mirror_changed(&mut self, pool: &BlockStats, counters: [u64; COUNTERS], changed: u8) {
        if changed != 0 {
            // A bit per cell, for the segment groups and for the split groups.
            let (mut segments, mut splits) = (0u8, 0u8);
            for q in 0..QUADRANTS {
                let cells = cells_of(q).iter().fold(0u8, |m, &c| m | 1 << c);
                if changed & (1 << q) != 0 {
                    segments |= cells;
                }
                if changed & (0x10 << q) != 0 {
                    splits |= cells;
                }
            }
            // POOL_ONLY: reserved bytes, inactive split bytes, segments, inactive splits.
            let groups = [
                (&pool.reserved_bytes, segments),
                (&pool.inactive_split_bytes, splits),
                (&pool.segment, segments),
                (&pool.inactive_split, splits),
            ];
            for (i, (group, bits)) in groups.into_iter().enumerate() {
                let mut bits = bits;
                while bits != 0 {
                    let c = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let s = cell(group, c);
                    self.set(b_pool(i, c, 0), s.current);
                    self.set(b_pool(i, c, 1), s.peak);
                    self.set(b_pool(i, c, 2), s.allocated);
                }
            }
        }
        for (i, v) in counters.into_iter().enumerate() {
            self.set(B_COUNTERS + i, v);
        }
    }

    /// Publishes what changed since the last call, closing a write left open. The caller holds
    /// the global lock.
    pub fn publish(&mut self, block: &SeqBlock<BASE_WORDS>) {
        if !self.stale && !block.is_open() {
            return;
        }
        block.write(|w| {
            for (i, (&v, p)) in self.words.iter().zip(self.published.iter_mut()).enumerate() {
                if v != *p {
                    w.set(i, v);
                    *p = v;
                }
            }
        });
        self.stale = false;
    }

    /// The words as they are (published or not).
    pub fn words(&self) -> &[u64; BASE_WORDS] {
        &self.words
    }

    /// Marks the base as changed, so that readers retry (a new stream cache appeared).
    pub fn touch(&mut self, block: &SeqBlock<BASE_WORDS>) {
        block.open();
    }

    /// The exact statistics now. The caller holds the global lock and every stream cache's lock
    /// (`inners`), so nothing moves.
    pub fn exact(&self, inners: &[&CacheInner]) -> BlockStats {
        let fast: Vec<[u64; FAST_WORDS]> = inners.iter().map(|i| i.words).collect();
        assemble(&self.words, &fast)
    }

    /// Checks `current ≤ upper ≤ peak` for every live group and cell, given the exact stats.
    pub fn check(&self, exact: &BlockStats) -> Result<(), String> {
        for (g, &(gi, _)) in LIVE.iter().enumerate() {
            for (c, s) in cells(group(exact, gi)).into_iter().enumerate() {
                let (u, p) = (self.upper[g][c], self.peak(g, c));
                if !(s.current <= u && u <= p) {
                    return Err(format!(
                        "group {gi} cell {c}: current {} upper {u} peak {p}",
                        s.current
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The five cells of one group from its four quadrants (wrapping sums, as the words are):
/// all, small pool (0 + 1), large pool (2 + 3), persistent (0 + 2), transient (1 + 3).
#[inline]
fn cell_sums(q: &[u64; QUADRANTS]) -> [u64; CELLS] {
    let (small, large) = (q[0].wrapping_add(q[1]), q[2].wrapping_add(q[3]));
    [small.wrapping_add(large), small, large, q[0].wrapping_add(q[2]), q[1].wrapping_add(q[3])]
}

fn group(s: &BlockStats, g: usize) -> &StatGroup {
    [
        &s.allocated_bytes,
        &s.reserved_bytes,
        &s.active_bytes,
        &s.inactive_split_bytes,
        &s.requested_bytes,
        &s.allocation,
        &s.segment,
        &s.active,
        &s.inactive_split,
    ][g]
}

fn group_mut(s: &mut BlockStats, g: usize) -> &mut StatGroup {
    match g {
        0 => &mut s.allocated_bytes,
        1 => &mut s.reserved_bytes,
        2 => &mut s.active_bytes,
        3 => &mut s.inactive_split_bytes,
        4 => &mut s.requested_bytes,
        5 => &mut s.allocation,
        6 => &mut s.segment,
        7 => &mut s.active,
        _ => &mut s.inactive_split,
    }
}

/// Cell `c` of a group (see [`cells`]).
fn cell(g: &StatGroup, c: usize) -> &Stat {
    match c {
        0 => &g.all,
        1 => &g.small_pool,
        2 => &g.large_pool,
        3 => &g.persistent,
        _ => &g.transient,
    }
}

fn cells(g: &StatGroup) -> [Stat; CELLS] {
    [g.all, g.small_pool, g.large_pool, g.persistent, g.transient]
}

fn cells_mut(g: &mut StatGroup) -> [&mut Stat; CELLS] {
    [&mut g.all, &mut g.small_pool, &mut g.large_pool, &mut g.persistent, &mut g.transient]
}

/// Builds [`BlockStats`] from a base copy and the stream caches' copies.
pub fn assemble(base: &[u64; BASE_WORDS], fast: &[[u64; FAST_WORDS]]) -> BlockStats {
    let mut out = BlockStats::default();
    for (g, &(gi, qty)) in LIVE.iter().enumerate() {
        let mut cur = [0u64; QUADRANTS];
        let mut tot = [0u64; QUADRANTS];
        for q in 0..QUADRANTS {
            cur[q] = base[b_cur(g, q)];
            tot[q] = base[b_tot(g, q)];
            for f in fast {
                cur[q] = cur[q].wrapping_add(f[fast_cur(qty, q)]);
                tot[q] = tot[q].wrapping_add(f[fast_tot(qty, q)]);
            }
        }
        for (c, s) in cells_mut(group_mut(&mut out, gi)).into_iter().enumerate() {
            let sum = |v: &[u64; QUADRANTS]| {
                (0..QUADRANTS).filter(|&q| in_cell(c, q)).fold(0u64, |a, q| a.wrapping_add(v[q]))
            };
            let (current, allocated) = (sum(&cur), sum(&tot));
            *s = Stat {
                current,
                peak: base[b_peak(g, c)],
                allocated,
                freed: allocated.wrapping_sub(current),
            };
        }
    }
    for (i, &gi) in POOL_ONLY.iter().enumerate() {
        for (c, s) in cells_mut(group_mut(&mut out, gi)).into_iter().enumerate() {
            let (current, peak, allocated) =
                (base[b_pool(i, c, 0)], base[b_pool(i, c, 1)], base[b_pool(i, c, 2)]);
            *s = Stat { current, peak, allocated, freed: allocated.wrapping_sub(current) };
        }
    }
    out
}

/// The plain counters of a base copy.
pub fn counters(base: &[u64; BASE_WORDS]) -> [u64; COUNTERS] {
    let mut out = [0; COUNTERS];
    out.copy_from_slice(&base[B_COUNTERS..]);
    out
}

/// Lanes a revocation holds on the stack (more are held in a `Vec`).
const HELD_INLINE: usize = 16;

/// A lane's current-delta words: three quantities by quadrant (`fast_cur`).
const LANE_CURS: usize = 3 * QUADRANTS;

/// Zeroes a locked lane's credit (its ceiling becomes its current delta; its mark is cleared)
/// and adds its current deltas to `sums`.
#[inline]
fn revoke_lane(cache: &StreamCache, inner: &mut CacheInner, sums: &mut [u64; LANE_CURS]) {
    cache.revoke(inner);
    for (sum, &w) in sums.iter_mut().zip(&inner.words[..LANE_CURS]) {
        *sum = sum.wrapping_add(w);
    }
}

/// Locks `caches` in order, revoking each one's credit into `sums` ([`revoke_lane`]), then
/// runs `then` with all of them held; lets them go on the way back. One stack frame per lane
/// (at most [`HELD_INLINE`]): no guard array is built, moved or dropped slot by slot.
fn hold_revoked(
    caches: &[Arc<StreamCache>],
    sums: &mut [u64; LANE_CURS],
    then: &mut dyn FnMut(&[u64; LANE_CURS]),
) {
    match caches.split_first() {
        None => then(sums),
        Some((c, rest)) => {
            let mut guard: LaneGuard<'_, CacheInner> = c.lock_inner();
            revoke_lane(c, &mut guard, sums);
            hold_revoked(rest, sums, then);
        }
    }
}

/// A held list of stream caches (an `Arc`, or an `ArcCell` load guard of one).
pub trait CacheList {
    /// The caches.
    fn list(&self) -> &[Arc<StreamCache>];
}

impl CacheList for &[Arc<StreamCache>] {
    fn list(&self) -> &[Arc<StreamCache>] {
        self
    }
}

impl CacheList for Arc<Vec<Arc<StreamCache>>> {
    fn list(&self) -> &[Arc<StreamCache>] {
        self
    }
}

#[cfg(not(loom))]
impl CacheList for crate::sync::ArcRef<Vec<Arc<StreamCache>>> {
    fn list(&self) -> &[Arc<StreamCache>] {
        self
    }
}

/// One consistent copy of the statistics: the base, and every stream cache's two blocks.
pub struct Snapshot<const N: usize = BASE_WORDS> {
    /// The base words.
    pub base: [u64; N],
    /// Each stream cache's fast words, in table order.
    pub fast: Vec<[u64; FAST_WORDS]>,
    /// Each stream cache's pool free bytes, in table order.
    pub pool_free: Vec<u64>,
    /// The stream each cache served at the copy, in table order (a re-tag changes it, and
    /// makes the collect fail, see `Shared::ensure_cache`).
    pub streams: Vec<crate::device::StreamId>,
}

/// One double collect over the base and every stream cache of the list `tables()` returns
/// (loaded *after* the base's sequence number is read, so a list replaced meanwhile — which
/// touches the base — fails the collect). `None` if writers interfered `tries` times in a row.
/// (The snapshot carries each lane's stream, so the list itself is not returned.)
pub fn collect<const N: usize, C: CacheList>(
    base: &SeqBlock<N>,
    tables: impl Fn() -> C,
    tries: usize,
) -> Option<Snapshot<N>> {
    for _ in 0..tries {
        let mut col = Collect::new();
        col.begin(base);
        let held = tables();
        let list = held.list();
        // Lanes publish when read: a hit only marks its lane's words stale.
        list.iter().for_each(|c| c.close_stats());
        for c in list {
            col.begin(c.fast_block());
            col.begin(c.slow_block());
        }
        let snap = Snapshot {
            base: base.copy(),
            fast: list.iter().map(|c| c.fast_block().copy()).collect(),
            pool_free: list.iter().map(|c| c.slow_block().copy()[0]).collect(),
            streams: list.iter().map(|c| c.stream()).collect(),
        };
        #[cfg(tidepool_broken = "stats_reader")]
        return Some(snap); // BROKEN: trusts the copies without checking the versions.
        #[cfg(not(tidepool_broken = "stats_reader"))]
        if col.finish() {
            return Some(snap);
        }
        crate::sync::thread::yield_now();
    }
    None
}

/// The pool-side statistics of cached blocks: what the pool counts as allocated but the
/// allocator counts as freed. Used by the invariant check.
pub fn cached_in_pool(pool: &Pool, blocks: &[super::fast_cache::CachedBlock]) -> BlockStats {
    let mut s = BlockStats::default();
    for b in blocks {
        let seg = pool.segment(pool.block(b.block).segment);
        let (k, r) = (seg.key.kind, seg.key.residency);
        s.allocated_bytes.increase(k, r, b.size);
        s.active_bytes.increase(k, r, b.size);
        s.requested_bytes.increase(k, r, b.requested);
        s.allocation.increase(k, r, 1);
        s.active.increase(k, r, 1);
    }
    s
}

/// The current values of every group and cell, for comparisons.
pub fn currents(s: &BlockStats) -> [[u64; CELLS]; 9] {
    std::array::from_fn(|g| cells(group(s, g)).map(|c| c.current))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{PoolKind, Residency};

    #[test]
    fn layout_is_dense_and_cells_cover_quadrants() {
        // 5 plain counters, 7 of the ranges, 10 extra figures, 3 scope counters
        assert_eq!(BASE_WORDS, 20 + 20 + 25 + 60 + 25);
        assert_eq!(FAST_WORDS, 25); // Δcur and Δtot of three quantities × 4 quadrants, cached bytes
        for q in 0..QUADRANTS {
            assert!(in_cell(0, q));
            assert_eq!((1..3).filter(|&c| in_cell(c, q)).count(), 1);
            assert_eq!((3..5).filter(|&c| in_cell(c, q)).count(), 1);
        }
        assert_eq!(quadrant(PoolKind::Large, Residency::Persistent), 2);
        // The pool numbers the quadrants of its change bits the same way.
        for kind in [PoolKind::Small, PoolKind::Large] {
            for res in [Residency::Persistent, Residency::Transient] {
                assert_eq!(Pool::quadrant(kind, res), quadrant(kind, res));
            }
        }
        assert_eq!(cells_of(2), [0, 2, 3]);
        let q = [1, 20, 300, 4000];
        let by_membership: [u64; CELLS] =
            std::array::from_fn(|c| (0..QUADRANTS).filter(|&i| in_cell(c, i)).map(|i| q[i]).sum());
        assert_eq!(cell_sums(&q), by_membership);
        assert_eq!(cell_sums(&q), [4321, 21, 4300, 301, 4020]);
    }

    /// Mirroring only the changed cells of the pool-only groups keeps every field of them
    /// (current, peak, allocated, freed) equal to the pool's.
    #[test]
    fn mirroring_the_changed_cells_keeps_pool_groups_exact() {
        use crate::pool::{PoolKey, Sizing};
        use crate::types::{MIB, StreamId};
        let (mut pool, sizing, mut b) = (Pool::new(), Sizing::default(), BaseStats::default());
        let key = |kind, residency| PoolKey { residency, stream: StreamId(0), kind };
        let same = |b: &BaseStats, pool: &Pool| {
            let s = assemble(&b.words, &[]);
            POOL_ONLY.iter().all(|&g| group(&s, g) == group(&pool.stats(), g))
        };
        let publish = |b: &mut BaseStats, pool: &mut Pool| {
            let changed = pool.take_changed();
            b.mirror_changed(&pool.stats(), [0; COUNTERS], changed);
        };
        let small =
            pool.add_segment(key(PoolKind::Small, Residency::Transient), 0x1000_0000, 2 * MIB);
        publish(&mut b, &mut pool);
        assert!(same(&b, &pool));
        let a = pool.allocate(small, 512, 500, &sizing);
        assert_eq!(pool.take_changed(), Pool::SPLITS_CHANGED & 0x20);
        pool.free(a);
        publish(&mut b, &mut pool);
        assert!(same(&b, &pool), "inactive split peak and totals follow");
        let large =
            pool.add_segment(key(PoolKind::Large, Residency::Persistent), 0x2000_0000, 20 * MIB);
        let c = pool.allocate(large, 8 * MIB, 8 * MIB, &sizing);
        publish(&mut b, &mut pool);
        assert!(same(&b, &pool));
        pool.free(c);
        let seg = pool.block(large).segment;
        pool.remove_segment(seg);
        assert_eq!(pool.take_changed(), 0x04 | 0x40);
        b.mirror_changed(&pool.stats(), [0; COUNTERS], 0x04 | 0x40);
        assert!(same(&b, &pool));
        pool.reset_peak_stats();
        publish(&mut b, &mut pool);
        assert!(same(&b, &pool), "a peak reset republishes every cell");
    }

    /// A lane's top-up is bounded by every cell of its quadrant: the large pool's room under
    /// the "all" and "transient" peaks is no room for a small block while the small pool sits at
    /// its peak. What is assigned raises `upper` to the peak, and no further.
    #[test]
    fn the_headroom_is_the_least_over_the_quadrants_cells() {
        let mut b = BaseStats::default();
        let (small, large) = (
            quadrant(PoolKind::Small, Residency::Transient),
            quadrant(PoolKind::Large, Residency::Transient),
        );
        let none = || Arc::new(Vec::new());
        b.live_up(small, 4096, 4000, none);
        b.live_up(large, 8 << 20, 8 << 20, none);
        b.live_down(large, 8 << 20, 8 << 20);
        assert_eq!(b.headroom(small), [0, 0, 0], "the small pool is at its peak");
        assert_eq!(b.headroom(large), [8 << 20, 1, 8 << 20]);
        b.live_down(small, 4096, 4000);
        assert_eq!(b.headroom(small), [4096, 1, 4000]);
        assert!(b.try_live_up(small, 512, 512), "under the peaks");
        assert_eq!(b.headroom(small), [3584, 0, 3488]);
        assert!(!b.try_live_up(small, 512, 512), "a second block passes the count's peak");
        b.assign(small, [3584, 0, 3488]);
        assert_eq!(b.headroom(small), [0, 0, 0]);
        // The cells it shares with the small quadrant peaked with both pools' blocks live.
        assert_eq!(b.headroom(large), [8 << 20, 1, 8 << 20]);
        let s = assemble(&b.words, &[]);
        // `upper` counts the assigned credit: here no lane holds it, so current < upper = peak.
        b.check(&s).unwrap();
        assert_eq!(
            s.allocated_bytes.small_pool,
            Stat { current: 512, peak: 4096, allocated: 4608, freed: 4096 }
        );
        b.upper[0][1] += 1; // one byte more than the headroom
        assert!(b.check(&s).is_err());
    }

    #[test]
    fn increases_past_the_peak_raise_it_exactly() {
        let mut b = BaseStats::default();
        let q = quadrant(PoolKind::Small, Residency::Transient);
        let none = || Arc::new(Vec::new());
        b.live_up(q, 512, 100, none);
        b.live_up(q, 1024, 1000, none);
        b.live_down(q, 512, 100);
        b.live_up(q, 512, 10, none);
        let s = assemble(&b.words, &[]);
        assert_eq!(
            s.allocated_bytes.all,
            Stat { current: 1536, peak: 1536, allocated: 2048, freed: 512 }
        );
        assert_eq!(s.requested_bytes.transient.peak, 1100);
        assert_eq!(s.requested_bytes.transient.current, 1010);
        assert_eq!(s.allocation.small_pool.current, 2);
        assert_eq!(s.allocation.large_pool, Stat::default());
        b.check(&s).unwrap();
    }
}
