//! `SeqBlock`: a fixed array of `u64` published by one writer at a time (the caller holds a lock)
//! and read by anyone without a lock, as a consistent whole (a sequence lock).
//!
//! ```text
//!   writer (holds its lock):  seq = s+1 ─ fence(Release) ─ data[i] = … ─ seq = s+2 (Release)
//!   lazy writer:  open: seq = s+1 ─ fence(Release) … (lock let go, taken again, maybe by another
//!                 thread) … write: fence(Release) ─ data[i] = … ─ seq = s+2 (Release)
//!   reader (no lock):         s1 = seq (Acquire) ─ copy data ─ fence(Acquire) ─ s2 = seq
//!                             valid iff s1 == s2 and s1 is even
//! ```
//!
//! Several blocks can be read as one snapshot by *double collect*: read every sequence number,
//! copy every block, then re-read every sequence number; if none changed (and all were even), no
//! writer touched any block in between, so the copies existed together at one instant (see
//! [`Collect`]). Data words are atomics written and read `Relaxed`; the fences order them against
//! the sequence number exactly as in crossbeam's `AtomicCell` fallback and Boehm's seqlock paper.

use crate::sync::atomic::{AtomicU64, Ordering, fence};

/// `N` words published together. See the module docs.
pub struct SeqBlock<const N: usize> {
    seq: AtomicU64,
    data: [AtomicU64; N],
}

impl<const N: usize> Default for SeqBlock<N> {
    fn default() -> Self {
        SeqBlock::new()
    }
}

impl<const N: usize> SeqBlock<N> {
    /// A block of zeros.
    pub fn new() -> SeqBlock<N> {
        SeqBlock { seq: AtomicU64::new(0), data: std::array::from_fn(|_| AtomicU64::new(0)) }
    }

    /// Publishes new values. **The caller must hold the lock that makes it the only writer.**
    /// `f` gets a [`SeqWriter`] to store words with; readers see all of them or none.
    /// A write already [opened](SeqBlock::open) (by this or an earlier holder of the lock) is
    /// closed by this one.
    pub fn write<R>(&self, f: impl FnOnce(&SeqWriter<'_, N>) -> R) -> R {
        let s = self.seq.load(Ordering::Relaxed) | 1;
        self.seq.store(s, Ordering::Relaxed);
        // Also when the write was opened earlier (by another thread, which let go of the lock
        // since): the words stored below must not be seen before the odd number.
        fence(Ordering::Release);
        let r = f(&SeqWriter { block: self });
        self.seq.store(s.wrapping_add(1), Ordering::Release);
        r
    }

    /// Opens a write and leaves it open: from now on readers see a write in progress (and fail)
    /// until a later [`SeqBlock::write`] (under the same lock) closes it. Marks the words as
    /// *stale*, for a writer that publishes only when a reader asks. **The caller must hold the
    /// lock that makes it the only writer.**
    pub fn open(&self) {
        #[cfg(tidepool_broken = "stats_open")]
        return; // BROKEN: the words go stale without readers seeing it.
        #[cfg(not(tidepool_broken = "stats_open"))]
        {
            let s = self.seq.load(Ordering::Relaxed);
            if s & 1 == 0 {
                self.seq.store(s.wrapping_add(1), Ordering::Relaxed);
                fence(Ordering::Release);
            }
        }
    }

    /// Whether a write is open now (a relaxed hint; exact for the lock holder).
    pub fn is_open(&self) -> bool {
        self.seq.load(Ordering::Relaxed) & 1 == 1
    }

    /// The sequence number before a read: `None` while a write is in progress.
    pub fn begin(&self) -> Option<u64> {
        let s = self.seq.load(Ordering::Acquire);
        (s & 1 == 0).then_some(s)
    }

    /// Copies the words (`Relaxed`); meaningful only once [`SeqBlock::unchanged`] confirms it.
    pub fn copy(&self) -> [u64; N] {
        std::array::from_fn(|i| self.data[i].load(Ordering::Relaxed))
    }

    /// After [`fence`]`(Acquire)`: has no write started since `begin` returned `s`?
    pub fn unchanged(&self, s: u64) -> bool {
        self.seq.load(Ordering::Relaxed) == s
    }

    /// One consistent copy, retrying while writers interfere (at most `tries` times).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn read(&self, tries: usize) -> Option<[u64; N]> {
        for _ in 0..tries {
            let Some(s) = self.begin() else {
                crate::sync::thread::yield_now();
                continue;
            };
            let v = self.copy();
            fence(Ordering::Acquire);
            if self.unchanged(s) {
                return Some(v);
            }
        }
        None
    }

    /// The words as the single writer last stored them. **Caller must be the writer.**
    pub fn get(&self, i: usize) -> u64 {
        self.data[i].load(Ordering::Relaxed)
    }
}

/// Stores words inside [`SeqBlock::write`].
pub struct SeqWriter<'a, const N: usize> {
    block: &'a SeqBlock<N>,
}

impl<const N: usize> SeqWriter<'_, N> {
    /// Stores word `i`.
    pub fn set(&self, i: usize, v: u64) {
        self.block.data[i].store(v, Ordering::Relaxed);
    }
}

/// The sequence number of a [`SeqBlock`] of any size, for [`Collect`].
pub trait Versioned {
    /// See [`SeqBlock::begin`].
    fn version(&self) -> Option<u64>;
    /// See [`SeqBlock::unchanged`].
    fn same_version(&self, s: u64) -> bool;
}

impl<const N: usize> Versioned for SeqBlock<N> {
    fn version(&self) -> Option<u64> {
        self.begin()
    }
    fn same_version(&self, s: u64) -> bool {
        self.unchanged(s)
    }
}

/// A double collect over several blocks: [`Collect::begin`] each, copy each, then
/// [`Collect::finish`].
///
/// ```text
///   begin(A) begin(B) … │ copy(A) copy(B) … │ fence(Acquire) │ unchanged(A) unchanged(B) …
///                       └──── if every block is unchanged, all copies hold at one instant
/// ```
#[derive(Default)]
pub struct Collect<'a> {
    seen: Vec<(&'a dyn Versioned, u64)>,
    ok: bool,
}

impl<'a> Collect<'a> {
    /// A collect with no block yet.
    pub fn new() -> Collect<'a> {
        Collect { seen: Vec::new(), ok: true }
    }

    /// Notes the sequence number of `b`; the collect fails if a write is in progress.
    pub fn begin(&mut self, b: &'a dyn Versioned) {
        match b.version() {
            Some(s) => self.seen.push((b, s)),
            None => self.ok = false,
        }
    }

    /// Were all blocks quiet since their `begin`? Then every copy made in between is one
    /// consistent snapshot.
    pub fn finish(&self) -> bool {
        if !self.ok {
            return false;
        }
        fence(Ordering::Acquire);
        self.seen.iter().all(|&(b, s)| b.same_version(s))
    }
}
