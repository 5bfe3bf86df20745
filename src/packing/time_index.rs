//! Placed rectangles indexed by time as well as by address, so that a buffer's walk meets only
//! the rectangles that may overlap its lifetime — not every buffer of every other step at the
//! addresses below its gap.
//!
//! With [`BY_TIME_FROM`] buffers or more, the time line `[0, horizon]` is cut into buckets of `2^shift` instants, about the median
//! lifetime (at most [`MAX_BUCKETS`]). A rectangle that touches at most [`LONG`] buckets is kept
//! in each bucket it touches, a longer one in one list that every short walk reads; every
//! rectangle is also in one list of all. Each list is address-ordered ([`ByOffset`]). A short
//! lifetime's walk merges, in `(lo, hi)` order, the walls, the long list and the buckets it
//! touches (a rectangle met twice, through two buckets, changes nothing the second time); a
//! long lifetime's walk reads the list of all with the walls. Either stops at the first gap
//! that fits.
//!
//! ```text
//!  time ─▶    bucket 0        bucket 1        bucket 2       …   short rectangles, in each
//!            [(0,64) (96,…)] [(0,32) (64,…)] [(64,96) …]         bucket they touch
//!  long:     [(128,512) (512,900) …]                             touching > LONG buckets
//!  all:      [(0,32) (0,64) (64,96) (96,…) (128,512) …]          every rectangle
//!  walls:    [(4096,8192) …]                                     busy for all time
//!  a walk for a lifetime in buckets 1–2: merge(walls, long, bucket 1, bucket 2) by (lo, hi)
//! ```

use super::by_offset::{ByOffset, Cursor, Rect};

/// Most time buckets.
const MAX_BUCKETS: u64 = 1 << 16;
/// Fewer buffers than this are not indexed by time: every walk reads the list of all. Measured
/// (instructions of `scoped` replays, plan times of `planned`): the buckets cost more than they
/// save on one step of a real trace (gpt2_train's 5 300 buffers: 43 M instructions against
/// 21 M; cs336 41 M against 32 M), and save most on many steps (10^6 events: 15 s against 69 s).
pub(super) const BY_TIME_FROM: usize = 16_384;
/// A rectangle touching more buckets than this goes to the long list (a shorter one is kept
/// once per bucket it touches).
const LONG: usize = 8;

pub(super) struct TimeIndex {
    /// Instants per bucket, as a shift.
    shift: u32,
    buckets: Vec<ByOffset>,
    long: ByOffset,
    all: ByOffset,
    /// A walk's scratch: each source's next `(lo, hi)` and cursor (source 0: the walls, 1:
    /// the long list, 2 + k: the k-th bucket of the lifetime).
    heads: Vec<(u64, u64)>,
    cursors: Vec<Cursor>,
}

/// The last instant `[start, end)` touches: a zero-length lifetime touches its own instant
/// (it overlaps a lifetime that holds it strictly inside).
pub(super) fn last_instant(start: u64, end: u64) -> u64 {
    if end > start { end - 1 } else { start }
}

impl TimeIndex {
    /// An index for `lifetimes` (`(start, end)`, instants in `[0, horizon]`), by time if there
    /// are `by_time_from` of them or more ([`BY_TIME_FROM`] but in tests).
    pub fn new(
        horizon: u64,
        lifetimes: impl Iterator<Item = (u64, u64)>,
        by_time_from: usize,
    ) -> TimeIndex {
        let mut lengths: Vec<u64> = lifetimes.map(|(s, e)| e - s).collect();
        let (mut shift, mut n) = (0, 0);
        if lengths.len() >= by_time_from {
            let median = match lengths.len() {
                0 => 1,
                len => *lengths.select_nth_unstable(len / 2).1,
            };
            shift = median.max(1).next_power_of_two().trailing_zeros();
            while horizon >> shift >= MAX_BUCKETS {
                shift += 1;
            }
            n = (horizon >> shift) as usize + 1;
        }
        TimeIndex {
            shift,
            buckets: (0..n).map(|_| ByOffset::default()).collect(),
            long: ByOffset::default(),
            all: ByOffset::default(),
            heads: Vec::new(),
            cursors: Vec::new(),
        }
    }

    /// The first and last bucket `[start, end)` touches.
    fn span(&self, start: u64, end: u64) -> (usize, usize) {
        let bucket = |t: u64| ((t >> self.shift) as usize).min(self.buckets.len() - 1);
        (bucket(start), bucket(last_instant(start, end)))
    }

    pub fn insert(&mut self, r: Rect) {
        self.all.insert(r);
        if self.buckets.is_empty() {
            return;
        }
        let (first, last) = self.span(r.start, r.end);
        if last - first >= LONG {
            self.long.insert(r);
        } else {
            for b in &mut self.buckets[first..=last] {
                b.insert(r);
            }
        }
    }

    /// The lowest offset where `size` bytes are free of the walls (sorted) and of every placed
    /// rectangle that overlaps `[start, end)` in time: the busy ranges are walked in `(lo, hi)`
    /// order, and the first gap before one of them that fits is taken.
    pub fn lowest_gap(&mut self, walls: &[(u64, u64)], start: u64, end: u64, size: u64) -> u64 {
        // Not indexed by time, or a long lifetime: one walk of the list of all.
        let span = (!self.buckets.is_empty()).then(|| self.span(start, end));
        let Some((first, last)) = span.filter(|(first, last)| last - first < LONG) else {
            return self.all.lowest_gap(walls, start, end, size);
        };
        // Sources: 0 the walls, 1 the long list, 2 + k the lifetime's k-th bucket.
        let (lists, one) = (&self.buckets[first..=last], &self.long);
        let list = |source: usize| if source == 1 { one } else { &lists[source - 2] };
        let heads = &mut self.heads;
        let cursors = &mut self.cursors;
        heads.clear();
        cursors.clear();
        cursors.resize(2 + lists.len(), Cursor::default());
        let mut wall = 0;
        let mut offset = 0u64;
        const DONE: (u64, u64) = (u64::MAX, u64::MAX);
        // The next head of `source`, or DONE (no real range is `(MAX, MAX)`: `lo < hi`).
        let mut advance = |source: usize, offset: u64| {
            if source == 0 {
                wall += 1;
                return walls.get(wall - 1).copied().unwrap_or(DONE);
            }
            let r = list(source).next_busy(&mut cursors[source], offset, start, end, size);
            r.map_or(DONE, |r| (r.lo, r.hi))
        };
        heads.extend((0..2 + lists.len()).map(|source| advance(source, offset)));
        loop {
            // The smallest head: a scan, as a walk merges a handful of sources.
            let (source, &(lo, hi)) =
                heads.iter().enumerate().min_by_key(|(_, h)| **h).expect("two sources at least");
            if (lo, hi) == DONE || lo >= offset && lo - offset >= size {
                break;
            }
            offset = offset.max(hi);
            heads[source] = advance(source, offset);
        }
        offset
    }
}
