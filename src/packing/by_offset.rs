//! Placed rectangles (a buffer's addresses × its lifetime) in address order, in chunks of at
//! most [`CHUNK`] — a B-tree's leaves without its inner nodes: a walk reads each chunk
//! contiguously, an insertion moves the entries of one chunk only. Each chunk knows the highest
//! end address and the time span of its entries, so a walk skips a chunk whose entries all lie
//! below the address reached so far or all live outside the lifetime asked about.
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
const CHUNK: usize = 128;

struct Chunk {
    rects: Vec<Rect>,
    /// The highest `hi` of `rects`.
    max_hi: u64,
    /// The earliest `start` and the latest `end` of `rects`.
    min_start: u64,
    max_end: u64,
}

impl Chunk {
    fn new(rects: Vec<Rect>) -> Chunk {
        let mut c = Chunk { rects: Vec::new(), max_hi: 0, min_start: u64::MAX, max_end: 0 };
        rects.iter().for_each(|r| c.widen(r));
        c.rects = rects;
        c
    }

    fn widen(&mut self, r: &Rect) {
        self.max_hi = self.max_hi.max(r.hi);
        self.min_start = self.min_start.min(r.start);
        self.max_end = self.max_end.max(r.end);
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
            for r in &chunk.rects {
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
    /// past it. `offset` may only grow between calls with one cursor.
    pub fn next_busy(
        &self,
        cursor: &mut Cursor,
        offset: u64,
        start: u64,
        end: u64,
    ) -> Option<Rect> {
        while let Some(chunk) = self.chunks.get(cursor.chunk) {
            if chunk.skippable(offset, start, end) {
                cursor.chunk += 1;
                cursor.at = 0;
                continue;
            }
            while let Some(r) = chunk.rects.get(cursor.at) {
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
