//! Where each statistic lives in the published word blocks (see `counters.rs` for the protocol):
//! quadrants (pool kind × residency), cells (sums of quadrants), and word indices of the base
//! block (written under the global lock) and of a stream cache's block.
//!
//! ```text
//!  base  words: cur[group][quadrant] │ tot[group][quadrant] │ peak[group][cell] │ pool-only │ counters
//!  cache words: Δcur[qty][quadrant] │ Δtot[qty][quadrant] │ cached bytes
//! ```

use crate::types::{PoolKind, Residency};

/// Quadrants: pool kind × residency.
pub const QUADRANTS: usize = 4;
/// Cells: all, small pool, large pool, persistent, transient.
pub const CELLS: usize = 5;

/// The quadrant of a block.
pub fn quadrant(kind: PoolKind, residency: Residency) -> usize {
    let k = match kind {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    };
    let r = match residency {
        Residency::Persistent => 0,
        Residency::Transient => 1,
    };
    k * 2 + r
}

/// The residency of a quadrant's blocks (their segment's).
pub fn residency_of(q: usize) -> Residency {
    match q % 2 {
        0 => Residency::Persistent,
        _ => Residency::Transient,
    }
}

/// Is the quadrant one of the small pool?
pub fn is_small(q: usize) -> bool {
    q / 2 == 0
}

/// The cells a quadrant counts in: all, its pool, its residency.
pub(super) fn cells_of(q: usize) -> [usize; 3] {
    [0, 1 + q / 2, 3 + q % 2]
}

/// Does cell `c` include quadrant `q`?
pub(super) fn in_cell(c: usize, q: usize) -> bool {
    cells_of(q).contains(&c)
}

/// Stream-cache quantities: block bytes, block count, requested bytes.
pub const BYTES: usize = 0;
/// See [`BYTES`].
pub const COUNT: usize = 1;
/// See [`BYTES`].
pub const REQ: usize = 2;

/// The live groups (index into [`BlockStats`](crate::BlockStats) order) with the quantity each follows.
pub(super) const LIVE: [(usize, usize); 5] =
    [(0, BYTES), (2, BYTES), (4, REQ), (5, COUNT), (7, COUNT)];
/// The groups only the pool changes (reserved bytes, inactive split bytes, segments, splits).
pub(super) const POOL_ONLY: [usize; 4] = [1, 3, 6, 8];
/// The plain counters: retries, OOMs, device allocs, device frees, host syncs, then the
/// expandable segments' (whether a range exists, virtual bytes, maps, unmaps, creates,
/// releases, pages moved), the extra figures (`extra_stats.rs`: the two oversize `Stat`s,
/// sync-alls, rejections) and the scope counters written under the global lock (best-fit
/// searches, locked allocations, plan region bytes), published with the rest so that a read
/// sees them with the reserved bytes of the same moment.
pub const COUNTERS: usize = 12 + 10 + 3;

// Base layout.
pub(super) const B_CUR: usize = 0;
pub(super) const B_TOT: usize = B_CUR + 5 * QUADRANTS;
pub(super) const B_PEAK: usize = B_TOT + 5 * QUADRANTS;
pub(super) const B_POOL: usize = B_PEAK + 5 * CELLS;
pub(super) const B_COUNTERS: usize = B_POOL + 4 * CELLS * 3;
/// Words in the base block.
pub const BASE_WORDS: usize = B_COUNTERS + COUNTERS;

pub(super) fn b_cur(g: usize, q: usize) -> usize {
    B_CUR + g * QUADRANTS + q
}
pub(super) fn b_tot(g: usize, q: usize) -> usize {
    B_TOT + g * QUADRANTS + q
}
pub(super) fn b_peak(g: usize, c: usize) -> usize {
    B_PEAK + g * CELLS + c
}
pub(super) fn b_pool(g: usize, c: usize, field: usize) -> usize {
    B_POOL + (g * CELLS + c) * 3 + field
}

// Stream-cache layout.
/// Word of a stream cache's current delta of quantity `qty` in quadrant `q`.
pub fn fast_cur(qty: usize, q: usize) -> usize {
    qty * QUADRANTS + q
}
/// Word of a stream cache's cumulative (allocated) delta of `qty` in quadrant `q`.
pub fn fast_tot(qty: usize, q: usize) -> usize {
    3 * QUADRANTS + qty * QUADRANTS + q
}
/// Word of a stream cache's cached bytes.
pub const CACHED_BYTES: usize = 6 * QUADRANTS;
/// Words in a stream cache's block. (Its cached blocks are counted by scanning its classes
/// where needed: the hit path keeps no count of them.)
pub const FAST_WORDS: usize = CACHED_BYTES + 1;
