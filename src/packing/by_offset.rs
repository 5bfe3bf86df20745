//! Placed rectangles (a buffer's addresses × its lifetime) in address order, in chunks of at
//! most [`CHUNK`] — a B-tree's leaves without its inner nodes: a walk reads each chunk
//! contiguously, an insertion moves the entries of one chunk only. Each chunk knows the highest
//! end address and the time span of its entries, so a walk skips a chunk whose entries all lie
//! below the address reached so far or all live outside the lifetime asked about. It knows too
//! its widest gap between entries, so a walk takes a chunk whose entries all live during the
//! lifetime and leave no gap that fits as one busy range, from its first entry to its highest
//! end: when every placed buffer overlaps every other (a snapshot's static picture, blocks
//! allocated before its window), each walk read every entry placed so far, and 40 000 blocks took
//! 19 s to plan, 100 000 three minutes; a walk reads a chunk's summary then.
//!
//! ```text
//!  chunks: [ (0,64) (0,96) (64,128) … ] [ (512,600) … ] [ … ]   each sorted by (lo, hi), ≤ CHUNK
//!           max_hi, min_start, max_end   max_hi, …
//!          └──────────── first keys ascending across chunks ────────────┘
//! ```

/// A placed buffer: addresses `[lo, hi)` during `[start, end)`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rect {
    pub lo: u64,
    pub hi: u64,
    pub start: u64,
    pub end: u64,
}

impl Rect {
    /// Whether `self` overlaps `[start, end)` in time, as the packing defines it
    /// (`a.start < b.end && b.start < a.end`).
    pub fn meets(&self, start: u64, end: u64) -> bool {
        self.start < end && start < self.end
    }
}

/// Entries per chunk before it splits: an insertion moves at most this many 32-byte entries.
pub(super) const CHUNK: usize = 128;

#[cfg(test)]
thread_local! {
    /// Entries the walks of this thread looked at one by one: what a walk costs, counted for
    /// the unit tests (a chunk taken whole counts nothing).
    pub(super) static WALKED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts one entry looked at (tests only; nothing otherwise).
#[inline(always)]
fn walked_one() {
    #[cfg(test)]
    WALKED.with(|w| w.set(w.get() + 1));
}

struct Chunk {
    rects: Vec<Rect>,
    /// The highest `hi` of `rects`.
    max_hi: u64,
    /// The earliest `start` and the latest `end` of `rects`.
    min_start: u64,
    max_end: u64,
    /// The latest `start` and the earliest `end` of `rects`: all of them meet a lifetime that
    /// starts before the one and ends after the other.
    max_start: u64,
    min_end: u64,
    /// The widest gap between entries: the most by which an entry's `lo` passes the highest
    /// `hi` of the entries before it (0 when they leave none).
    max_gap: u64,
}

impl Chunk {
    fn new(rects: Vec<Rect>) -> Chunk {
        let mut c = Chunk {
            rects: Vec::new(),
            max_hi: 0,
            min_start: u64::MAX,
            max_end: 0,
            max_start: 0,
            min_end: u64::MAX,
            max_gap: 0,
        };
        rects.iter().for_each(|r| c.widen(r));
        c.rects = rects;
        c.measure_gaps();
        c
    }

    fn widen(&mut self, r: &Rect) {
        self.max_hi = self.max_hi.max(r.hi);
        self.min_start = self.min_start.min(r.start);
        self.max_end = self.max_end.max(r.end);
        self.max_start = self.max_start.max(r.start);
        self.min_end = self.min_end.min(r.end);
    }

    /// Raises `max_gap` for the entry just inserted at `at`, in O(1): to at least its true
    /// value (a bound above it may stay until the chunk splits and is measured again: it only
    /// keeps a walk from taking the chunk whole). The gap below the new entry is at most its
    /// `lo` less its predecessor's `hi`; the gap below its successor only shrinks (the highest
    /// `hi` below it can only grow), unless the new entry is the first, when the successor's
    /// gap is new. (Measuring the chunk at every insertion cost a `scoped` replay of gpt2_train
    /// 1 % more instructions, in its plans' learning.)
    fn widen_gap(&mut self, at: usize) {
        let r = self.rects[at];
        let below = match at.checked_sub(1) {
            Some(p) => r.lo.saturating_sub(self.rects[p].hi),
            None => self.rects.get(1).map_or(0, |next| next.lo.saturating_sub(r.hi)),
        };
        self.max_gap = self.max_gap.max(below);
    }

    /// Sets `max_gap` from `rects`, exactly (one pass).
    fn measure_gaps(&mut self) {
        let (mut top, mut gap): (Option<u64>, u64) = (None, 0);
        for r in &self.rects {
            if let Some(t) = top {
                gap = gap.max(r.lo.saturating_sub(t));
            }
            top = Some(top.map_or(r.hi, |t| t.max(r.hi)));
        }
        self.max_gap = gap;
    }

    /// The chunk as one busy range `[first lo, max_hi)` for a walk of `size` bytes over
    /// `[start, end)`, when that changes nothing: every entry meets the lifetime and no gap
    /// between them fits `size` (a free range inside the span lies between two entries).
    fn solid(&self, start: u64, end: u64, size: u64) -> Option<(u64, u64)> {
        // BROKEN (`plan_walk_per_entry`): every entry walked, as before.
        if cfg!(tidepool_broken = "plan_walk_per_entry") {
            return None;
        }
        let all_meet = self.max_start < end && start < self.min_end;
        let first = self.rects.first()?;
        (all_meet && self.max_gap < size).then_some((first.lo, first.hi))
    }

    /// Whether no entry can matter to a walk at `offset` for `[start, end)`: all lie wholly
    /// below `offset` (`lo < hi <= offset` changes nothing) or none meets the lifetime.
    fn skippable(&self, offset: u64, start: u64, end: u64) -> bool {
        self.max_hi <= offset || self.min_start >= end || self.max_end <= start
    }
}

#[derive(Default)]
pub(super) struct ByOffset {
    chunks: Vec<Chunk>,
}

/// Where a walk over a [`ByOffset`] stands: a chunk and an entry in it.
#[derive(Clone, Copy, Default)]
pub(super) struct Cursor {
    chunk: usize,
    at: usize,
}

impl ByOffset {
    pub fn insert(&mut self, r: Rect) {
        let key = (r.lo, r.hi);
        let first = |c: &Chunk| (c.rects[0].lo, c.rects[0].hi);
        let c = self.chunks.partition_point(|c| first(c) <= key).saturating_sub(1);
        let Some(chunk) = self.chunks.get_mut(c) else {
            self.chunks.push(Chunk::new(vec![r]));
            return;
        };
        let at = chunk.rects.partition_point(|q| (q.lo, q.hi) <= key);
        chunk.rects.insert(at, r);
        chunk.widen(&r);
        chunk.widen_gap(at);
        if chunk.rects.len() > CHUNK {
            let upper = chunk.rects.split_off(CHUNK / 2);
            *chunk = Chunk::new(std::mem::take(&mut chunk.rects));
            self.chunks.insert(c + 1, Chunk::new(upper));
        }
    }

    /// The lowest offset where `size` bytes are free of the walls (sorted) and of every placed
    /// rectangle that overlaps `[start, end)` in time: the busy ranges are walked in `(lo, hi)`
    /// order, and the first gap before one of them that fits is taken. (The walk over one list
    /// written out: through [`ByOffset::next_busy`] and the time index's merge it took 1.7 ×
    /// the instructions of a `scoped` replay of gpt2_train.)
    pub fn lowest_gap(&self, walls: &[(u64, u64)], start: u64, end: u64, size: u64) -> u64 {
        let mut offset = 0u64;
        let mut w = 0;
        let mut next_wall = walls.first().copied().unwrap_or((u64::MAX, u64::MAX));
        // One busy range: true when the gap below it fits.
        let fits_below = |lo: u64, hi: u64, offset: &mut u64| {
            if lo >= *offset && lo - *offset >= size {
                return true;
            }
            *offset = (*offset).max(hi);
            false
        };
        for chunk in &self.chunks {
            if chunk.skippable(offset, start, end) {
                continue;
            }
            if let Some(key) = chunk.solid(start, end, size) {
                while next_wall < key && w < walls.len() {
                    w += 1;
                    if fits_below(next_wall.0, next_wall.1, &mut offset) {
                        return offset;
                    }
                    next_wall = walls.get(w).copied().unwrap_or((u64::MAX, u64::MAX));
                }
                if fits_below(key.0, chunk.max_hi, &mut offset) {
                    return offset;
                }
                continue;
            }
            for r in &chunk.rects {
                walked_one();
                if !r.meets(start, end) {
                    continue;
                }
                while next_wall < (r.lo, r.hi) && w < walls.len() {
                    w += 1;
                    if fits_below(next_wall.0, next_wall.1, &mut offset) {
                        return offset;
                    }
                    next_wall = walls.get(w).copied().unwrap_or((u64::MAX, u64::MAX));
                }
                if fits_below(r.lo, r.hi, &mut offset) {
                    return offset;
                }
            }
        }
        for &(lo, hi) in &walls[w..] {
            if fits_below(lo, hi, &mut offset) {
                break;
            }
        }
        offset
    }

    /// The next entry from `cursor` on that meets `[start, end)` and does not lie wholly below
    /// `offset` chunk-wise (see [`Chunk::skippable`]), in `(lo, hi)` order; the cursor moves
    /// past it. A chunk met at its start that a walk of `size` bytes may take whole (see
    /// [`Chunk::solid`]) is one range, its first entry's `lo` to its highest `hi`. `offset` may
    /// only grow between calls with one cursor.
    pub fn next_busy(
        &self,
        cursor: &mut Cursor,
        offset: u64,
        start: u64,
        end: u64,
        size: u64,
    ) -> Option<Rect> {
        while let Some(chunk) = self.chunks.get(cursor.chunk) {
            if chunk.skippable(offset, start, end) {
                cursor.chunk += 1;
                cursor.at = 0;
                continue;
            }
            if cursor.at == 0
                && let Some((lo, _)) = chunk.solid(start, end, size)
            {
                cursor.chunk += 1;
                return Some(Rect { lo, hi: chunk.max_hi, start, end });
            }
            while let Some(r) = chunk.rects.get(cursor.at) {
                walked_one();
                cursor.at += 1;
                if r.meets(start, end) {
                    return Some(*r);
                }
            }
            cursor.chunk += 1;
            cursor.at = 0;
        }
        None
    }
}
