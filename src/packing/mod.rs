//! Memory planning: "greedy by size" interval packing (as in TFLite's arena planner and graph
//! compilers' static memory planners). Used offline by the replayer's `planned` baseline and
//! online by learned scope plans. Pure arithmetic: no device, no allocator.
//!
//! Each buffer is a rectangle: a time interval `[start, end)` (event indices) by a size.
//! Buffers are placed one at a time, largest first (ties: earlier start, then input order),
//! at the lowest aligned offset where the rectangle overlaps no placed rectangle:
//!
//! ```text
//!  offset ▲   ┌────────┐
//!         │   │   C    │      C is placed above A and B because it overlaps both in time;
//!         │ ┌─┴──┐ ┌───┴─┐    B reuses A's addresses because their lifetimes are disjoint.
//!         │ │ A  │ │  B  │
//!         └─┴────┴─┴─────┴──► time
//! ```
//!
//! Placed buffers are kept in address order, indexed by time (`time_index.rs`: buckets of
//! time, each an address-ordered list in chunks, `by_offset.rs`), so a buffer walks only those
//! that may overlap it in time, merged with the walls, and takes the first gap that fits; no
//! sort per buffer. (Collecting the time-overlapping ones out of all placed buffers and sorting
//! them per buffer, as before, made the sort 75 % of a scope's end on gpt2_train and 95 % of a
//! replay of the cs336 snapshot under `scoped`; walking all placed buffers in address order took
//! 69 s for the 500 000 buffers of a 20-step trace of 10^6 events.)

use std::fmt;

mod by_offset;
mod time_index;

use by_offset::Rect;
use time_index::TimeIndex;

/// Result of packing: an offset per input interval (same order) and the region size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Offset of each interval, in input order; each a multiple of `align`.
    pub offsets: Vec<u64>,
    /// Bytes needed: the highest `offset + aligned size`.
    pub total_size: u64,
}

/// Why a plan could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// `align` is zero or not a power of two.
    BadAlign(u64),
    /// An interval ends before it starts.
    BadInterval {
        /// Input index of the interval.
        index: usize,
    },
    /// Sizes or offsets do not fit in 64 bits.
    Overflow,
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::BadAlign(a) => write!(f, "alignment {a} is not a power of two"),
            PlanError::BadInterval { index } => write!(f, "interval {index} ends before it starts"),
            PlanError::Overflow => f.write_str("plan does not fit in a 64-bit address space"),
        }
    }
}

impl std::error::Error for PlanError {}

/// `size` rounded up to a multiple of `align` (a power of two), or `None` on overflow.
pub fn align_up(size: u64, align: u64) -> Option<u64> {
    Some(size.checked_add(align - 1)? & !(align - 1))
}

/// Packs `intervals` — `(size, start, end)` with lifetime `[start, end)` — into one region.
/// Two intervals may share addresses only if their lifetimes are disjoint
/// (`a.end <= b.start || b.end <= a.start`). Sizes are rounded up to `align`, offsets are
/// multiples of `align`. Zero-size intervals get offset 0 and take no space.
pub fn pack_greedy_by_size(intervals: &[(u64, u64, u64)], align: u64) -> Result<Plan, PlanError> {
    pack_around(intervals, align, &[])
}

/// [`pack_greedy_by_size`] around `walls`: address ranges `[lo, hi)` that are busy for all
/// time, so no interval overlaps them. Walls cut the address line into separate bins (the
/// free space of existing segments, say) with the space above the last wall open-ended.
pub(crate) fn pack_around(
    intervals: &[(u64, u64, u64)],
    align: u64,
    walls: &[(u64, u64)],
) -> Result<Plan, PlanError> {
    pack(intervals, align, walls, time_index::BY_TIME_FROM)
}

/// [`pack_around`], indexing by time from `by_time_from` buffers on.
fn pack(
    intervals: &[(u64, u64, u64)],
    align: u64,
    walls: &[(u64, u64)],
    by_time_from: usize,
) -> Result<Plan, PlanError> {
    if align == 0 || !align.is_power_of_two() {
        return Err(PlanError::BadAlign(align));
    }
    let mut sizes = Vec::with_capacity(intervals.len());
    for (index, &(size, start, end)) in intervals.iter().enumerate() {
        if end < start {
            return Err(PlanError::BadInterval { index });
        }
        sizes.push(align_up(size, align).ok_or(PlanError::Overflow)?);
    }
    let mut order: Vec<usize> = (0..intervals.len()).collect();
    order.sort_by(|&a, &b| {
        sizes[b].cmp(&sizes[a]).then(intervals[a].1.cmp(&intervals[b].1)).then(a.cmp(&b))
    });
    let mut walls = walls.to_vec();
    walls.sort_unstable();

    let mut offsets = vec![0u64; intervals.len()];
    let horizon = intervals.iter().map(|&(_, s, e)| time_index::last_instant(s, e)).max();
    let lifetimes = intervals.iter().zip(&sizes).filter(|(_, s)| **s > 0).map(|(v, _)| (v.1, v.2));
    let mut placed = TimeIndex::new(horizon.unwrap_or(0), lifetimes, by_time_from);
    let mut total = 0u64;
    for &i in &order {
        let size = sizes[i];
        if size == 0 {
            continue;
        }
        let (_, start, end) = intervals[i];
        let offset = placed.lowest_gap(&walls, start, end, size);
        let top = offset.checked_add(size).ok_or(PlanError::Overflow)?;
        offsets[i] = offset;
        total = total.max(top);
        placed.insert(Rect { lo: offset, hi: top, start, end });
    }
    Ok(Plan { offsets, total_size: total })
}

#[cfg(test)]
mod tests {
    /// Buffers all live at once, placed largest first: each lies above every buffer placed
    /// before it, with no gap between them. A walk takes a chunk of such buffers whole (no gap
    /// in it fits, all meet the lifetime), so packing `n` of them looks at each entry only in
    /// the chunk being filled: at most `CHUNK` entries per buffer, where walking every entry
    /// looked at n²/2 in all (the `planned` baseline on a snapshot's static picture of 40 000
    /// blocks: 19 s). Counted, not timed. Broken build `plan_walk_per_entry` (7 998 000 here).
    #[test]
    fn buffers_live_together_are_walked_a_chunk_at_a_time() {
        const N: u64 = 4_000;
        let iv: Vec<_> = (0..N).map(|i| (512 * (N - i), 0, 10)).collect();
        super::by_offset::WALKED.with(|w| w.set(0));
        let p = super::pack_greedy_by_size(&iv, 512).unwrap();
        let walked = super::by_offset::WALKED.with(|w| w.get());
        // Packed end to end, largest lowest.
        assert_eq!(p.total_size, 512 * N * (N + 1) / 2);
        assert_eq!(p.offsets[1], 512 * N);
        assert!(walked <= N * super::by_offset::CHUNK as u64, "{walked} entries walked");
    }

    #[test]
    fn walls_split_the_line_into_bins() {
        // Bins [0, 128) and [256, 320), open space from 384. Aligned to 16.
        let walls = [(128, 256), (320, 384)];
        // A (96, all time), B (64, all time), C (64, early), D (48, late: disjoint from C).
        let iv = [(96, 0, 10), (64, 0, 10), (64, 0, 5), (48, 5, 10)];
        let p = super::pack_around(&iv, 16, &walls).unwrap();
        // A takes bin 0 (32 bytes left); B fits bin 1 exactly; C fits no bin and goes above
        // the walls; D is too big for bin 0's rest and reuses C's place once C is dead.
        assert_eq!(p.offsets, vec![0, 256, 384, 384]);
        assert_eq!(p.total_size, 448);
        assert_eq!(
            super::pack_around(&iv, 16, &[]).unwrap(),
            super::pack_greedy_by_size(&iv, 16).unwrap()
        );
    }

    use super::*;

    /// Checks that no two time-overlapping intervals overlap in address.
    fn assert_valid(iv: &[(u64, u64, u64)], plan: &Plan, align: u64) {
        for i in 0..iv.len() {
            assert_eq!(plan.offsets[i] % align, 0);
            let si = align_up(iv[i].0, align).unwrap();
            assert!(plan.offsets[i] + si <= plan.total_size);
            for j in i + 1..iv.len() {
                let sj = align_up(iv[j].0, align).unwrap();
                let time = iv[i].1 < iv[j].2 && iv[j].1 < iv[i].2;
                let addr = plan.offsets[i] < plan.offsets[j] + sj
                    && plan.offsets[j] < plan.offsets[i] + si;
                assert!(!(time && addr && si > 0 && sj > 0), "{i} and {j} collide");
            }
        }
    }

    /// The first implementation, kept as the oracle: per buffer, the time-overlapping placed
    /// ones and the walls are collected and sorted, then walked.
    fn sorted_per_buffer(iv: &[(u64, u64, u64)], align: u64, walls: &[(u64, u64)]) -> Plan {
        let sizes: Vec<u64> = iv.iter().map(|v| align_up(v.0, align).unwrap()).collect();
        let mut order: Vec<usize> = (0..iv.len()).collect();
        order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(iv[a].1.cmp(&iv[b].1)).then(a.cmp(&b)));
        let (mut offsets, mut placed, mut total) = (vec![0u64; iv.len()], Vec::new(), 0);
        for &i in &order {
            if sizes[i] == 0 {
                continue;
            }
            let (_, start, end) = iv[i];
            let mut busy: Vec<(u64, u64)> = placed
                .iter()
                .filter(|&&j: &&usize| iv[j].1 < end && start < iv[j].2)
                .map(|&j| (offsets[j], offsets[j] + sizes[j]))
                .collect();
            busy.extend_from_slice(walls);
            busy.sort_unstable();
            let mut offset = 0u64;
            for &(lo, hi) in &busy {
                if lo >= offset && lo - offset >= sizes[i] {
                    break;
                }
                offset = offset.max(hi);
            }
            offsets[i] = offset;
            total = total.max(offset + sizes[i]);
            placed.push(i);
        }
        Plan { offsets, total_size: total }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        /// The address-ordered walk gives exactly the plan of sorting per buffer, walls or
        /// none (zero sizes, ties in size and start, walls unsorted and overlapping included; walls
        /// aligned, as the callers' are). Up to 400 buffers: the placed lists split their chunks;
        /// time scaled so that buckets hold one instant or many; a quarter of the lifetimes
        /// long (many buckets), so both walks and the long list are used.
        #[test]
        fn the_walk_is_the_sorted_oracle(
            iv in proptest::collection::vec(
                (0u64..40, 0u64..30, proptest::prop_oneof![3 => 0u64..12, 1 => 12u64..300]),
                0..400,
            ),
            scale in proptest::sample::select(vec![1u64, 7, 1000]),
            walls in proptest::collection::vec((0u64..200, 0u64..40), 0..6),
            align_log in 0u32..4,
        ) {
            let iv: Vec<_> =
                iv.into_iter().map(|(s, t, d)| (s * 8, t * scale, (t + d) * scale)).collect();
            let walls: Vec<_> = walls.into_iter().map(|(lo, len)| (lo * 8, (lo + len) * 8)).collect();
            let align = 1 << align_log;
            let plan = pack_around(&iv, align, &walls).unwrap();
            proptest::prop_assert_eq!(&plan, &sorted_per_buffer(&iv, align, &walls));
            // The same indexed by time (as from BY_TIME_FROM buffers on).
            proptest::prop_assert_eq!(&pack(&iv, align, &walls, 0).unwrap(), &plan);
            assert_valid(&iv, &plan, align);
            for (i, &o) in plan.offsets.iter().enumerate() {
                let s = align_up(iv[i].0, align).unwrap();
                let hits = walls.iter().any(|&(lo, hi)| o < hi && lo < o + s && s > 0);
                proptest::prop_assert!(!hits, "{} lies on a wall", i);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// The same where most buffers overlap most others (lifetimes from near the start to
        /// near the end), so that chunks of placed buffers all meet a lifetime and are walked
        /// as one range when they leave no gap that fits (`Chunk::solid`), some do not: up to
        /// 600 buffers, several chunks of 64–128.
        #[test]
        fn chunks_walked_whole_give_the_sorted_oracle(
            iv in proptest::collection::vec(
                (1u64..40, 0u64..4, 0u64..4, proptest::bool::weighted(0.1)),
                0..600,
            ),
            walls in proptest::collection::vec((0u64..2000, 0u64..40), 0..4),
        ) {
            let iv: Vec<_> = iv
                .into_iter()
                .map(|(s, a, b, short)| if short { (s * 8, 10 + a, 14 + b) } else { (s * 8, a, 30 - b) })
                .collect();
            let walls: Vec<_> = walls.into_iter().map(|(lo, len)| (lo * 8, (lo + len) * 8)).collect();
            let plan = pack_around(&iv, 8, &walls).unwrap();
            proptest::prop_assert_eq!(&plan, &sorted_per_buffer(&iv, 8, &walls));
            proptest::prop_assert_eq!(&pack(&iv, 8, &walls, 0).unwrap(), &plan);
        }
    }

    #[test]
    fn disjoint_lifetimes_share_offset_zero() {
        let iv = [(100, 0, 2), (100, 2, 4), (100, 4, 6)];
        let p = pack_greedy_by_size(&iv, 1).unwrap();
        assert_eq!(p.offsets, vec![0, 0, 0]);
        assert_eq!(p.total_size, 100);
    }

    #[test]
    fn exact_offsets_largest_first() {
        // A [0,2) 1024, B [1,5) 512, C [3,6) 256, D [4,7) 1024.
        let iv = [(1024, 0, 2), (512, 1, 5), (256, 3, 6), (1024, 4, 7)];
        let p = pack_greedy_by_size(&iv, 256).unwrap();
        assert_eq!(p.offsets, vec![0, 1024, 1536, 0]);
        assert_eq!(p.total_size, 1792);
        assert_valid(&iv, &p, 256);
    }

    #[test]
    fn fills_a_gap_between_placed_buffers() {
        // X [0,10) 300 at 0; Y [0,10) 200 at 300; Z [5,6) 100: overlaps both -> 500.
        // W [0,3) 100 overlaps X and Y -> 500 as well (Z is disjoint in time).
        // V [6,10) 50: overlaps X, Y, W? no (W ends at 3) -> 500.
        let iv = [(300, 0, 10), (200, 0, 10), (100, 5, 6), (100, 0, 3), (50, 6, 10)];
        let p = pack_greedy_by_size(&iv, 1).unwrap();
        assert_eq!(p.offsets, vec![0, 300, 500, 500, 500]);
        assert_eq!(p.total_size, 600);
        assert_valid(&iv, &p, 1);
    }

    #[test]
    fn uses_hole_below_the_top() {
        // Big1 [0,4) 400 at 0, Big2 [2,8) 400 at 400. Small [5,8) 300: Big1 is dead by
        // then, so it takes offset 0 (a hole below Big2).
        let iv = [(400, 0, 4), (400, 2, 8), (300, 5, 8)];
        let p = pack_greedy_by_size(&iv, 1).unwrap();
        assert_eq!(p.offsets, vec![0, 400, 0]);
        assert_eq!(p.total_size, 800);
    }

    #[test]
    fn alignment_rounds_sizes_and_offsets() {
        let iv = [(1, 0, 2), (1, 0, 2), (513, 0, 2)];
        let p = pack_greedy_by_size(&iv, 512).unwrap();
        assert_eq!(p.offsets, vec![1024, 1536, 0]);
        assert_eq!(p.total_size, 2048);
    }

    #[test]
    fn zero_sizes_and_errors() {
        let p = pack_greedy_by_size(&[(0, 0, 5), (8, 0, 5)], 8).unwrap();
        assert_eq!(p.offsets, vec![0, 0]);
        assert_eq!(p.total_size, 8);
        assert_eq!(pack_greedy_by_size(&[], 3), Err(PlanError::BadAlign(3)));
        assert_eq!(pack_greedy_by_size(&[(1, 5, 4)], 1), Err(PlanError::BadInterval { index: 0 }));
        assert_eq!(pack_greedy_by_size(&[(u64::MAX, 0, 1)], 2), Err(PlanError::Overflow));
        assert_eq!(
            pack_greedy_by_size(&[(1 << 63, 0, 1), (1 << 63, 0, 1)], 1),
            Err(PlanError::Overflow)
        );
    }
}
