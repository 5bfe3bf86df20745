//! The fast path: `LANES` [`StreamCache`]s per stream hold small-pool blocks freed on that
//! stream, by class (residency, rounded size), so a free and a re-allocation of the same class on
//! the same stream never take the allocator's global lock. A thread always uses the same lane of
//! a stream, so two threads on one stream rarely share a cache (or its lock).
//!
//! ```text
//!  Shared ─ caches: CacheTable ── slots: [s0 lane0][s0 lane1][s1 lane0] …   (fast lookup)
//!                               │        each an Arc<StreamCache>, 128-byte aligned
//!                               └─ all: ArcCell<[cache, cache, …]>   (stream order, slow side)
//!                                              │
//!   StreamCache ── inner: Mutex (this lane only) ─── classes: (residency, rounded) → [blocks]
//!               │                                  ├─ ceiling[quadrant] (credit = ceiling − Δcur)
//!               │                                  └─ limits, closed, mirror of `fast`
//!               ├─ fast: SeqBlock  ── stats deltas per quadrant, cached bytes   (inner lock)
//!               └─ slow: SeqBlock  ── the pool's free bytes of the stream (lane 0; global lock)
//! ```
//!
//! A cached block stays *allocated* in the pool (so coalescing never touches it) but counts as
//! freed in the statistics (and in `cached_fast_bytes`, not in the pool's inactive splits). Only a flush ([`StreamCache::drain`], under the global lock) turns
//! it into a free pool block. Lock order: global lock, then stream caches in stream order; the
//! fast path takes one stream's lock and never the global one while holding it. Which lanes
//! serve which stream, and which lane a thread uses, is `lane_table.rs`.
//!
//! Large-pool blocks are cached too, one at most per stream (in its lane 0):
//! [`StreamCache::pop_checked_at`], under the global lock, hands one out again only where the
//! pool confirms that freeing it and taking the best fit would give exactly that block
//! (`Pool::reuse_is_best_fit`), and any other search of the large pool first frees it into the
//! pool (`drain_large`). The lane remembers that check ([`LargeVerdict`]: block, request, the
//! global-lock section's epoch); until another section begins, the pool cannot change, so a hit
//! ([`StreamCache::pop_large`]) hands the same block out again for the same request with no
//! global lock. So the cache skips the split, the coalesce and (mostly) the lock of a
//! same-stream reuse, but never changes where a large block is placed. A lane's byte bound
//! (`fast_cache_bytes_mb`) holds for its small blocks and for its large block apart (`room`
//! grows by the large block's bytes while it waits): counted together, lane 0 took fewer small
//! blocks than lane 1, and a thread's placement depended on the lane it drew.
//!
//! *Credit* keeps peaks exact without a shared counter (see `counters.rs`): a fast free lowers
//! the live total by the block and grants its stream that much headroom under the peak; a fast pop
//! may only spend headroom it holds, so it can never create a new peak. When it has too little,
//! the pop returns [`Pop::NeedsLock`] and the caller accounts it under the global lock
//! ([`StreamCache::pop_locked_topped`]), which also grants the lane, out of the headroom under
//! the peaks that no lane holds, the credit its class's next blocks need (a *top-up*): in a
//! training step that climbs back to the last step's peak, the pops after a revocation would
//! otherwise each take the lock.
//!
//! Here: the lanes' types, pushes and pops (the hot path), credit and the large block; a lane's
//! administration off the hot path (drain, configure, close, re-tag, statistics) is in
//! `fast_cache/admin.rs`.

mod admin;

use super::class_table::ClassTable;
use super::counters::BaseStats;
use super::lane_lock::{LaneGuard, LaneLock};
use super::seqlock::SeqBlock;
use super::stats_layout::CACHED_BYTES;
use super::stats_layout::{BYTES, COUNT, FAST_WORDS, QUADRANTS, REQ, fast_cur, fast_tot, is_small};
use crate::device::{DeviceAddr, StreamId};
use crate::pool::{BlockId, Pool, Sizing};
use crate::stats::Residency;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crossbeam_utils::CachePadded;

/// Most distinct classes one stream caches at once; a free of a new class beyond it goes to the
/// pool.
pub const MAX_CLASSES: usize = 128;

/// Streams with an id below this have a fast path; others always take the slow path. (The
/// same under loom: the models run the real configuration.)
pub const FAST_STREAMS: usize = 64;

/// What a stream may cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Cache at all.
    pub enabled: bool,
    /// Blocks per class.
    pub entries: usize,
    /// Bytes of small blocks per lane; a lane's large block may have as many besides.
    pub bytes: u64,
    /// The lane's lock may be biased towards its owner thread (`biased_lanes`, `lane_lock.rs`).
    pub biased: bool,
    /// The rounded size of the class whose blocks a lane hands out lowest address first, not
    /// last freed first (0: none): the small pool's largest class over expandable segments
    /// (see `lowest_last`).
    pub lowest_first: u64,
}

/// The key of a class: blocks of one residency handed out for one rounded size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClassKey {
    /// Persistent or transient.
    pub residency: Residency,
    /// The rounded request the block served.
    pub rounded: u64,
}

/// A block waiting in a stream cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedBlock {
    /// The pool's block (allocated in the pool).
    pub block: BlockId,
    /// Its address.
    pub ptr: DeviceAddr,
    /// Its size.
    pub size: u64,
    /// The request it last served (equal to the pool's record of it).
    pub requested: u64,
    /// Its statistics quadrant (pool kind × residency), see `counters::quadrant`.
    pub quadrant: usize,
}

/// The outcome of [`StreamCache::pop`].
#[derive(Debug, PartialEq, Eq)]
pub enum Pop {
    /// A block, handed out without the global lock.
    Hit(CachedBlock),
    /// A block of the class is cached, but serving it needs the global lock (a different request
    /// size, or too little credit); call [`StreamCache::pop_locked`] under it.
    NeedsLock,
    /// Nothing cached for the class.
    Miss,
}

/// Everything under a stream cache's lock.
pub struct CacheInner {
    /// The stream the lane serves now (its *tag*; see `CacheTable`(crate::allocator::lane_table::CacheTable)): a hit or a free for
    /// another stream is refused here, under this lock.
    stream: StreamId,
    classes: ClassTable,
    /// The bytes of the large-pool block among `blocks` (a lane holds one at most, see
    /// [`StreamCache::push`]), 0 without one. `room` includes them while it is open: the byte
    /// bound holds for the small blocks and for the large block apart, so that what a lane
    /// takes does not depend on whether it is its stream's first lane (where the large block
    /// waits); a thread's placement would otherwise depend on the lane it drew
    /// (`lane_table.rs`: t5_train's peak came out 2 MiB apart).
    large: u64,
    /// The class of the large-pool block, while `large` is 1: [`StreamCache::drain_large`]
    /// takes it out with one lookup instead of a scan of the class table.
    large_class: ClassKey,
    /// The *ceiling* of this lane's current deltas, per quadrant: (bytes, count, requested).
    /// Its headroom under the peaks ("credit", see `counters.rs`) is `ceiling − Δcur`
    /// (wrapping): a free lowers `Δcur` and so grants credit with no store of its own, a hit
    /// may raise `Δcur` up to the ceiling, and a revocation sets the ceiling to `Δcur`.
    ceiling: [[u64; 3]; QUADRANTS],
    /// The lane's statistics words (see `counters.rs`), published into `fast` by readers.
    pub(crate) words: [u64; FAST_WORDS],
    /// `words` as last published into `fast` (this lock makes us its only writer).
    published: [u64; FAST_WORDS],
    limits: Limits,
    /// The size rules of the configuration in force (set with the limits), so that a hit
    /// rounds its request here, under this lock, without loading the configuration.
    sizing: Sizing,
    closed: bool,
    /// The bytes this lane may hold: `limits.bytes`, 0 while caching is off or once closed.
    room: u64,
    /// Strong references to the stream's owner handle that buffers freed into this lane left
    /// here, for later hits to take over (see `owner.rs`): the hit path touches no reference count.
    owner_refs: u64,
    /// The stash is closed: the allocator's last handle is gone, no reference may be left here
    /// any more, and the lane takes no block (`room` 0: a later free keeps its reference).
    stash_closed: bool,
    /// The largest rounded request a hit serves: the small pool's bound, 0 while caching is off
    /// (one compare covers both).
    small_max: u64,
    /// `min_block_size − 1` where rounding every small request is `(bytes + mask) & !mask`
    /// (a power-of-two granule, no power-of-two divisions below the small bound), else
    /// `u64::MAX`: round by `sizing`.
    round_mask: u64,
    /// The large block this lane holds, as last checked under the global lock
    /// ([`StreamCache::pop_large`]): a hit may hand it out again without that lock while no
    /// global-lock section began since (see [`LargeVerdict`]).
    verdict: Option<LargeVerdict>,
    /// Credit was granted (a free) since the last revocation: [`CacheCells::credited`], as
    /// this lock's holder knows it (so a free stores that flag once per revocation, not each
    /// time).
    credited: bool,
    /// Deliberately broken (`Broken::HotCreditKept`): a revocation keeps the hot block.
    #[cfg(feature = "test-hooks")]
    keep_hot: bool,
    /// Deliberately broken (`Broken::UnmarkedCredit`): a free grants credit without marking
    /// the lane.
    #[cfg(feature = "test-hooks")]
    unmarked: bool,
    /// Deliberately broken tag checks ([`TAG_FREES`]: `Broken::RetaggedLaneTakesStaleFrees`,
    /// [`TAG_HITS`]: `Broken::RetaggedLaneServesAnyStream`): the check passes whatever the
    /// stream.
    #[cfg(feature = "test-hooks")]
    broken_tags: u8,
}

/// A deliberately broken tag check (`CacheInner::broken_tags`): frees of any stream are taken.
pub const TAG_FREES: u8 = 1;
/// A deliberately broken tag check (`CacheInner::broken_tags`): hits for any stream are served.
pub const TAG_HITS: u8 = 2;

/// A large block found, under the global lock, to be exactly what freeing it and taking the
/// pool's best fit would give for `requested` (`Shared::reuse_fits`), at global-lock section
/// `epoch`. Every section that may change the pool begins by advancing the allocator's epoch
/// (`Shared::lock_state`), and the section that checked changes nothing placement depends on
/// after the check; so while the epoch still reads `epoch`, the pool is as it was checked, and
/// handing the block out (for the same request) places it exactly where the pool would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LargeVerdict {
    /// The block checked.
    pub block: BlockId,
    /// Its class.
    pub class: ClassKey,
    /// The request it was checked for (a hit must ask for exactly this: same rounding).
    pub requested: u64,
    /// The global-lock section that checked it.
    pub epoch: u64,
}

impl CacheInner {
    /// Adds `b` to its class's list, kept lowest address last for the class
    /// `Limits::lowest_first` names ([`lowest_last`]); false where the class table has no room
    /// for a new class or the class holds `limits.entries` blocks already.
    #[inline(always)]
    fn push_to_class(&mut self, class: ClassKey, b: CachedBlock) -> bool {
        let (entries, lowest_first) = (self.limits.entries, self.limits.lowest_first);
        let Some(list) = self.classes.get_or_add(class) else { return false };
        if list.len() >= entries {
            return false;
        }
        list.push(b);
        if class.rounded == lowest_first {
            lowest_last(list);
        }
        true
    }

    /// Whether a block freed on `stream` may be cached here: the lane serves that stream now.
    /// A buffer keeps its lane's owner for life, and the lane may be re-tagged for a new
    /// stream once its old one is destroyed (`CacheTable`); a block of the old stream cached
    /// here would be handed out on the new one, and it belongs to the old stream's segments.
    #[inline(always)]
    fn serves(&self, stream: StreamId) -> bool {
        self.stream == stream || self.broken_tag_check(TAG_FREES)
    }

    /// Whether a hit for `stream` may take a block here: the lane serves that stream now (a
    /// thread may look the lane up for a stream destroyed meanwhile, whose lane now serves
    /// another stream: its blocks are that stream's).
    #[inline(always)]
    fn takes_for(&self, stream: StreamId) -> bool {
        self.stream == stream || self.broken_tag_check(TAG_HITS)
    }

    /// Whether a tag check that failed passes anyway (a deliberate bug, `which` of
    /// [`TAG_FREES`] and [`TAG_HITS`]; out of line, so the checks cost one compare).
    #[cold]
    #[inline(never)]
    fn broken_tag_check(&self, which: u8) -> bool {
        #[cfg(tidepool_broken = "retag_free")]
        if which == TAG_FREES {
            return true; // BROKEN: a free of any stream is cached.
        }
        #[cfg(tidepool_broken = "retag_hit")]
        if which == TAG_HITS {
            return true; // BROKEN: a hit for any stream is served.
        }
        // BROKEN (`Broken::RetaggedLaneTakesStaleFrees`, `Broken::RetaggedLaneServesAnyStream`)
        #[cfg(feature = "test-hooks")]
        return self.broken_tags & which != 0;
        #[cfg(not(feature = "test-hooks"))]
        {
            let _ = which;
            false
        }
    }

    /// Takes all of the lane's credit back (a revocation, see `counters.rs`): its ceiling
    /// becomes its `Δcur`. The hot block moves into its list, so that a hot block's credit is
    /// always held (it was granted by its own free, and nothing else spent it since: the block
    /// was the lane's only one), and its hit checks none (`class_table.rs`).
    pub(crate) fn revoke_credit(&mut self) {
        for q in 0..QUADRANTS {
            for qty in [BYTES, COUNT, REQ] {
                self.ceiling[q][qty] = self.words[fast_cur(qty, q)];
            }
        }
        #[cfg(feature = "test-hooks")]
        if self.keep_hot {
            return; // BROKEN (`Broken::HotCreditKept`): it keeps credit it no longer holds.
        }
        self.classes.spill();
    }

    /// The blocks cached, in no particular order.
    pub fn entries(&self) -> Vec<(ClassKey, CachedBlock)> {
        self.classes.iter().collect()
    }
}

/// One stream's cache. See the module docs. Padded (crossbeam's `CachePadded`) so that two
/// streams' caches never share a cache line (threads on different streams touch disjoint lines).
pub struct StreamCache(CachePadded<CacheCells>);

/// What a [`StreamCache`] holds.
pub struct CacheCells {
    /// `inner.stream`, stored under `inner`'s lock and the global lock (a re-tag), read without
    /// `inner`'s lock on the global-lock side and by statistics readers (within their collect).
    tag: AtomicU64,
    inner: LaneLock<CacheInner>,
    fast: SeqBlock<FAST_WORDS>,
    slow: SeqBlock<1>,
    /// The class of the large block the lane holds as [`large_key`] (0: none, as `inner.large`),
    /// stored under `inner`'s lock and read without it as a hint.
    large: AtomicU64,
    /// Largest request [`StreamCache::pop_request`] may serve (0: none), stored under `inner`'s
    /// lock and read without it as a hint.
    fast_max: AtomicU64,
    /// The lane may hold credit: a free granted some since the last revocation. Set under
    /// `inner`'s lock by that free before the grant, cleared by a revocation that holds `inner`
    /// and the global lock; read without `inner`'s lock by a revocation (`counters.rs`): only
    /// revocations clear it, so when every lane reads clear, none held credit at the first read
    /// and the revocation locks none.
    credited: AtomicBool,
    /// A block was freed into the lane, ever (never cleared; set with the credit mark, so the
    /// free path stores it once per revocation). A block freed here and taken again by a hit
    /// never reaches the pool, so the pool's count of frees misses it: the slow path reads
    /// this too (`Shared::freed_any`: a range's build-up ends at the first free).
    freed: AtomicBool,
    /// Its stream's first lane (lane 0 of its slot, the one that holds a large block).
    first: bool,
}

impl std::ops::Deref for StreamCache {
    type Target = CacheCells;
    fn deref(&self) -> &CacheCells {
        &self.0
    }
}

impl StreamCache {
    /// An empty cache for `stream`, its first lane. (The allocator makes its lanes with
    /// [`StreamCache::new_lane`]; the loom models drive this one.)
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn new(stream: StreamId, limits: Limits) -> StreamCache {
        Self::new_lane(stream, limits, 0)
    }

    /// An empty cache for `stream`, its lane `lane`.
    pub fn new_lane(stream: StreamId, limits: Limits, lane: usize) -> StreamCache {
        StreamCache(CachePadded::new(CacheCells {
            tag: AtomicU64::new(u64::from(stream.0)),
            inner: LaneLock::new(
                limits.biased,
                CacheInner {
                    stream,
                    classes: ClassTable::default(),
                    large: 0,
                    large_class: ClassKey { residency: Residency::Transient, rounded: 0 },
                    ceiling: [[0; 3]; QUADRANTS],
                    words: [0; FAST_WORDS],
                    published: [0; FAST_WORDS],
                    limits,
                    sizing: Sizing::default(),
                    closed: false,
                    room: Self::room_of(limits, false),
                    owner_refs: 0,
                    stash_closed: false,
                    small_max: Self::small_max_of(limits, &Sizing::default()),
                    round_mask: Self::round_mask_of(&Sizing::default()),
                    verdict: None,
                    credited: false,
                    #[cfg(feature = "test-hooks")]
                    keep_hot: false,
                    #[cfg(feature = "test-hooks")]
                    unmarked: false,
                    #[cfg(feature = "test-hooks")]
                    broken_tags: 0,
                },
            ),
            fast: SeqBlock::new(),
            slow: SeqBlock::new(),
            large: AtomicU64::new(0),
            fast_max: AtomicU64::new(Self::fast_max_of(limits, &Sizing::default())),
            credited: AtomicBool::new(false),
            freed: AtomicBool::new(false),
            first: lane == 0,
        }))
    }

    /// Whether it is its stream's first lane (the one a large block waits in) while it serves
    /// `stream` (a relaxed read of its tag: a hint, the push compares it under the lock).
    #[inline(always)]
    pub fn is_first_of(&self, stream: StreamId) -> bool {
        self.first && self.stream() == stream
    }

    /// The stream it caches for now (a relaxed read: exact under the global lock, which every
    /// re-tag holds, or under this lane's lock).
    #[inline(always)]
    pub fn stream(&self) -> StreamId {
        StreamId(self.tag.load(Ordering::Relaxed) as u32)
    }

    #[inline(always)]
    pub(crate) fn lock_inner(&self) -> LaneGuard<'_, CacheInner> {
        self.inner.lock()
    }

    /// [`StreamCache::lock_inner`] by a user of the lane (a hit or a cached free): the first
    /// thread to take it so becomes its owner, which takes it with no atomic read-modify-write
    /// while no other thread does (`lane_lock.rs`).
    #[inline(always)]
    fn lock_claiming(&self) -> LaneGuard<'_, CacheInner> {
        self.inner.lock_claiming()
    }

    /// Whether the lane's lock is biased towards its owner thread now (tests).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn is_biased(&self) -> bool {
        self.inner.is_biased()
    }

    /// The published statistics deltas (see `counters.rs` for the layout).
    pub fn fast_block(&self) -> &SeqBlock<FAST_WORDS> {
        &self.fast
    }

    /// The published free bytes of this stream in the pool.
    pub fn slow_block(&self) -> &SeqBlock<1> {
        &self.slow
    }

    /// Caches a block freed on this stream: the user's block becomes cached, its statistics
    /// move from live to cached, and the stream gains its size as credit. Gives the block back if
    /// the cache is disabled, closed or full, or if it is a large-pool block and the cache holds
    /// one already (a large block is reused only where that is exactly the pool's best fit,
    /// checked against the pool with no other large block of the stream held back from it).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn push(&self, class: ClassKey, b: CachedBlock) -> Result<(), CachedBlock> {
        self.push_stash(class, b, self.stream(), false).map(|_| ())
    }

    /// [`StreamCache::push`] of a block freed on `stream` (refused unless the lane serves it
    /// now: a buffer may outlive its stream and the lane's re-tag), from a buffer's drop: with
    /// `stash`, the buffer's strong reference to the stream's owner handle stays here (returns
    /// `Ok(true)`: the caller forgets it) unless the stash is closed
    /// ([`StreamCache::close_stash`]) or full.
    #[inline(always)]
    pub fn push_stash(
        &self,
        class: ClassKey,
        b: CachedBlock,
        stream: StreamId,
        stash: bool,
    ) -> Result<bool, CachedBlock> {
        let mut g = self.lock_claiming();
        let inner = &mut *g;
        let large = !is_small(b.quadrant);
        // The bytes `room` bounds: the small blocks' (with the large block's, which `room`
        // includes) for a small block, none but its own for the large one (see `large`).
        // BROKEN (`lane_room_shared`): the large block counts against the small blocks' bound.
        let used = match large && !cfg!(tidepool_broken = "lane_room_shared") {
            true => 0,
            false => inner.words[CACHED_BYTES],
        };
        // Disabled, closed or full: one compare (`room` is 0 in the first two cases).
        if used + b.size > inner.room || large && inner.large > 0 || !inner.serves(stream) {
            return Err(b);
        }
        // A large block whose class a small request now rounds to (a `set_config` raised
        // `small_size` since it was handed out) goes to the pool: in the lane a small hit of
        // that class would hand the large-pool block out (the hit looks at the class only).
        // BROKEN (`large_in_small_class`): cached, and handed out for a small request.
        if large
            && class.rounded <= inner.small_max
            && !cfg!(tidepool_broken = "large_in_small_class")
        {
            return Err(b);
        }
        if !inner.push_to_class(class, b) {
            return Err(b);
        }
        if large {
            inner.large_class = class;
            self.set_large(inner, Some(class));
            inner.large = b.size;
            if !cfg!(tidepool_broken = "lane_room_shared") {
                inner.room += b.size; // (open: the push passed)
            }
        }
        self.grant(inner, &b);
        self.fast.open();
        // (A closed stash takes no block at all: `room` is 0.)
        inner.owner_refs += u64::from(stash);
        Ok(stash)
    }

    /// Counts pushed block `b` as cached: lowering `Δcur` grants it as credit (the ceiling
    /// stays). The lane is marked as holding credit, and as having taken a free, first (once
    /// per revocation).
    #[inline(always)]
    fn grant(&self, inner: &mut CacheInner, b: &CachedBlock) {
        if !inner.credited {
            self.mark_freed(inner);
        }
        let q = b.quadrant & (QUADRANTS - 1);
        let w = &mut inner.words;
        w[fast_cur(BYTES, q)] = w[fast_cur(BYTES, q)].wrapping_sub(b.size);
        w[fast_cur(COUNT, q)] = w[fast_cur(COUNT, q)].wrapping_sub(1);
        w[fast_cur(REQ, q)] = w[fast_cur(REQ, q)].wrapping_sub(b.requested);
        w[CACHED_BYTES] += b.size;
    }

    /// [`StreamCache::push_stash`] of a small-pool block from a buffer's drop (stash asked), the
    /// common free: `true`, the buffer's hold on the allocator stays here; `false` when the lane
    /// refuses the block (the caller frees it into the pool).
    #[inline(always)]
    pub fn push_small(&self, class: ClassKey, b: CachedBlock, stream: StreamId) -> bool {
        debug_assert!(is_small(b.quadrant));
        let mut g = self.lock_claiming();
        let inner = &mut *g;
        let cached = inner.words[CACHED_BYTES];
        // Disabled, closed or full: one compare (`room` is 0 in the first two cases, and with
        // no entries allowed; it includes a large block's bytes, as `cached` does); and a block
        // of a stream the lane no longer serves.
        if cached + b.size > inner.room || !inner.serves(stream) {
            return false;
        }
        // The lane's only block: the hot entry, no list (`class_table.rs`). A class of one
        // block is within every `entries` bound (`room` is 0 where none is allowed).
        let kept = cached == 0 && inner.classes.set_hot(class, b) || inner.push_to_class(class, b);
        if !kept {
            return false;
        }
        self.grant(inner, &b);
        self.fast.open();
        // The buffer's hold stays here (a closed stash takes no block at all: `room` is 0).
        inner.owner_refs += 1;
        true
    }

    /// Takes a block of `class` for a request of `requested` bytes. See [`Pop`]. (The allocator
    /// pops with [`StreamCache::pop_request`]; the loom models drive this one.)
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn pop(&self, class: ClassKey, requested: u64) -> Pop {
        self.pop_checked(class, requested, |_| true)
    }

    /// Whether a hit may serve `bytes` at all (a relaxed hint: the limits may have changed, the
    /// slow path decides): every lane of a stream is configured alike, so a request one lane
    /// refuses for its size skips the others. A zero-byte request wraps around and is refused.
    #[inline]
    pub fn may_serve(&self, bytes: u64) -> bool {
        bytes.wrapping_sub(1) < self.fast_max.load(Ordering::Relaxed)
    }

    /// The hit path: a request of `bytes` with `residency`, rounded here by the size rules of
    /// the configuration in force (set under this lock with [`StreamCache::configure`]), so the
    /// whole decision follows one configuration without loading it. [`Pop::Miss`] when the
    /// stream caches may not serve it (disabled, or not a small-pool request). On a hit, the
    /// rounded request comes with the block. The caller checked that `bytes` is not 0 and at
    /// most a small-pool bound (`Shared::small_hint`: the hit and the whole path's lane loop),
    /// so rounding it cannot overflow; the lane's own bound is checked here.
    ///
    /// The third value says whether the hit took over a stashed reference to the stream's owner
    /// handle ([`StreamCache::push_stash`]); the caller must then adopt it (`owner.rs`).
    #[inline(always)]
    pub fn pop_request(
        &self,
        residency: Residency,
        bytes: u64,
        stream: StreamId,
    ) -> (Pop, u64, bool) {
        debug_assert!(bytes > 0);
        let g = self.lock_claiming();
        if !g.takes_for(stream) {
            return (Pop::Miss, 0, false);
        }
        let mask = g.round_mask;
        let rounded = match mask {
            u64::MAX => match round_cold(&g.sizing, bytes) {
                Some(r) => r,
                None => return (Pop::Miss, 0, false),
            },
            // `bytes` ≤ the small bound here, so no overflow.
            _ => (bytes + mask) & !mask,
        };
        // Caching off, or not a small-pool request: one compare.
        if rounded > g.small_max {
            return (Pop::Miss, 0, false);
        }
        // A small request takes small-pool blocks only. A large block sits under a small
        // class for a moment only: a `set_config` that raised the bound past its class flushes
        // it in the same lock section, but after the lanes took the new bound (`push_stash`
        // refuses it from then on).
        // BROKEN (`small_hit_takes_large`): handed out, a large-pool block for a small request.
        let (pop, stashed) = self.pop_locked_inner::<true>(
            g,
            ClassKey { residency, rounded },
            bytes,
            |b| is_small(b.quadrant) || cfg!(tidepool_broken = "small_hit_takes_large"),
            true,
            None,
        );
        (pop, rounded, stashed)
    }

    /// The large-block hit: the block this lane (a stream's first) holds, handed out without
    /// the global lock where it is the one checked under that lock for exactly this request
    /// and no global-lock section began since (`LargeVerdict`). The pop spends credit as a
    /// small hit does; [`Pop::Miss`] in every other case (the slow path decides). Returns the
    /// rounded request with the block, and whether a kept owner reference came with it.
    ///
    /// The epoch is read under this lane's lock: a global-lock section that took this lane
    /// (a flush, a credit revocation) advanced it before, so the hit sees the new value.
    /// `broken_stale` (a deliberate bug, `Broken::StaleLargeVerdict`) trusts any verdict.
    #[inline]
    pub fn pop_large(
        &self,
        residency: Residency,
        bytes: u64,
        stream: StreamId,
        epoch: &AtomicU64,
        broken_stale: bool,
    ) -> (Pop, u64, bool) {
        if self.large.load(Ordering::Relaxed) == 0 {
            return (Pop::Miss, 0, false);
        }
        let g = self.lock_claiming();
        if !g.takes_for(stream) {
            return (Pop::Miss, 0, false);
        }
        let Some(v) = g.verdict else { return (Pop::Miss, 0, false) };
        let current = v.epoch == epoch.load(Ordering::Acquire) || broken_stale;
        // `limits.enabled`: pushes stop when caching is turned off, but blocks cached before
        // stay until the flush.
        if !current || v.requested != bytes || v.class.residency != residency || !g.limits.enabled {
            return (Pop::Miss, 0, false);
        }
        let (pop, stashed) =
            self.pop_locked_inner::<false>(g, v.class, bytes, |b| b.block == v.block, true, None);
        (pop, v.class.rounded, stashed)
    }

    /// Closes the stash of owner references and returns how many it held, for the caller to
    /// release (the allocator's last handle is going: later frees keep their references, and
    /// go to the pool: the lane takes no more blocks, so a push never has to ask whether it may
    /// keep a reference).
    pub fn close_stash(&self) -> u64 {
        let mut g = self.lock_inner();
        g.stash_closed = true;
        // BROKEN: the lane stays open, so a later free leaves its reference here (a leak).
        #[cfg(not(tidepool_broken = "owner_stash"))]
        {
            g.room = 0;
        }
        std::mem::take(&mut g.owner_refs)
    }

    /// Like [`StreamCache::pop`], when `accept` takes the block that would be popped (checked
    /// under this cache's lock); [`Pop::Miss`] when it refuses it.
    pub fn pop_checked(
        &self,
        class: ClassKey,
        requested: u64,
        accept: impl FnOnce(&CachedBlock) -> bool,
    ) -> Pop {
        let mut g = self.lock_inner();
        g.classes.spill();
        self.pop_locked_inner::<false>(g, class, requested, accept, false, None).0
    }

    /// [`StreamCache::pop_checked`] by the global-lock side in section `epoch`: a block
    /// `accept` takes is remembered as checked (`LargeVerdict`), so that while no other
    /// global-lock section begins, a hit ([`StreamCache::pop_large`]) may hand it out again
    /// for the same request without the global lock.
    #[inline]
    pub fn pop_checked_at(
        &self,
        class: ClassKey,
        requested: u64,
        accept: impl FnOnce(&CachedBlock) -> bool,
        epoch: u64,
    ) -> Pop {
        let mut g = self.lock_inner();
        g.classes.spill();
        self.pop_locked_inner::<false>(g, class, requested, accept, false, Some(epoch)).0
    }

    /// [`StreamCache::pop_checked`] with this cache's lock already held. `HOT`: the block may
    /// be the hot one (`class_table.rs`); callers without it hold a large block's class (never
    /// hot: only small frees make one) or moved the hot block into its list first.
    #[inline(always)]
    fn pop_locked_inner<'a, const HOT: bool>(
        &'a self,
        mut g: LaneGuard<'a, CacheInner>,
        class: ClassKey,
        requested: u64,
        accept: impl FnOnce(&CachedBlock) -> bool,
        take_ref: bool,
        checked_at: Option<u64>,
    ) -> (Pop, bool) {
        let inner = &mut *g;
        // The hot block first (then it is the lane's only one): its own straight line.
        if HOT && let Some(&b) = inner.classes.hot(class) {
            if !accept(&b) {
                return (Pop::Miss, false);
            }
            if let Some(epoch) = checked_at {
                inner.verdict = Some(LargeVerdict { block: b.block, class, requested, epoch });
            }
            // Its credit is held (see `CacheInner::revoke_credit`): the request alone decides.
            if b.requested != requested {
                return (Pop::NeedsLock, false);
            }
            inner.classes.take_hot();
            return self.spend::<true>(inner, b, requested, take_ref);
        }
        let Some(list) = inner.classes.get_mut(class) else { return (Pop::Miss, false) };
        let Some(&b) = list.last() else { return (Pop::Miss, false) };
        if !accept(&b) {
            return (Pop::Miss, false);
        }
        if let Some(epoch) = checked_at {
            inner.verdict = Some(LargeVerdict { block: b.block, class, requested, epoch });
        }
        if !Self::covers(&inner.words, &inner.ceiling, &b, requested) {
            return (Pop::NeedsLock, false);
        }
        #[cfg(tidepool_broken = "fast_cache")]
        let inner = {
            // BROKEN: looks the block up, lets go of the lock, then takes "the" last entry.
            drop(g);
            g = self.lock_inner();
            let inner = &mut *g;
            let _ = inner.classes.pop(class);
            inner
        };
        #[cfg(not(tidepool_broken = "fast_cache"))]
        list.pop();
        self.spend::<false>(inner, b, requested, take_ref)
    }

    /// Whether the lane (its words `w` and `ceiling`) may hand `b` out for `requested` bytes
    /// without the global lock: the same request, and the credit held (`ceiling − Δcur`) covers
    /// the block — exactly, so no peak can pass.
    #[inline(always)]
    fn covers(
        w: &[u64; FAST_WORDS],
        ceiling: &[[u64; 3]; QUADRANTS],
        b: &CachedBlock,
        requested: u64,
    ) -> bool {
        let q = b.quadrant & (QUADRANTS - 1);
        let k = &ceiling[q];
        let covered = k[BYTES].wrapping_sub(w[fast_cur(BYTES, q)]) >= b.size
            && k[COUNT].wrapping_sub(w[fast_cur(COUNT, q)]) >= 1
            && k[REQ].wrapping_sub(w[fast_cur(REQ, q)]) >= requested;
        #[cfg(tidepool_broken = "stats")]
        let covered = true; // BROKEN: spends headroom the stream does not hold.
        b.requested == requested && covered
    }

    /// Counts popped block `b` (taken out of its list or, with `HOT`, the hot entry) as handed
    /// out for `requested` bytes: credit spent, the lane's words, and the owner hold it takes
    /// over (`take_ref`).
    ///
    /// A hot block is small and came with its buffer's hold (only [`StreamCache::push_small`]
    /// makes one, and it keeps the hold), so the lane holds one for it: every small block that
    /// enters a lane leaves one, and only pops that take its block out take one. (Once the
    /// stash is closed, the allocator's last handle is gone and nobody pops with `take_ref`.)
    #[inline(always)]
    fn spend<const HOT: bool>(
        &self,
        inner: &mut CacheInner,
        b: CachedBlock,
        requested: u64,
        take_ref: bool,
    ) -> (Pop, bool) {
        let q = b.quadrant & (QUADRANTS - 1);
        #[cfg(tidepool_broken = "stats")]
        {
            // (Deliberately broken: what it spent past the ceiling is forgotten, so the credit
            // reads zero instead of negative.)
            let (w, k) = (&inner.words, &mut inner.ceiling[q]);
            for (qty, v) in [(BYTES, b.size), (COUNT, 1), (REQ, requested)] {
                let cur = w[fast_cur(qty, q)].wrapping_add(v);
                if (k[qty].wrapping_sub(cur) as i64) < 0 {
                    k[qty] = cur;
                }
            }
        }
        if !HOT && !is_small(b.quadrant) {
            self.set_large(inner, None);
        }
        let w = &mut inner.words;
        for (qty, v) in [(BYTES, b.size), (COUNT, 1), (REQ, requested)] {
            w[fast_cur(qty, q)] = w[fast_cur(qty, q)].wrapping_add(v);
            w[fast_tot(qty, q)] = w[fast_tot(qty, q)].wrapping_add(v);
        }
        w[CACHED_BYTES] -= b.size;
        self.fast.open();
        let stashed = if HOT {
            debug_assert!(is_small(b.quadrant) && (!take_ref || inner.owner_refs > 0));
            take_ref
        } else {
            take_ref && inner.owner_refs > 0
        };
        inner.owner_refs -= u64::from(stashed);
        (Pop::Hit(b), stashed)
    }

    /// Takes a block of `class` whatever its request and the credit; the caller holds the global
    /// lock and accounts the hand-out there (it is a live block again, and no longer cached).
    pub fn pop_locked(&self, class: ClassKey, stream: StreamId) -> Option<CachedBlock> {
        self.take_locked(&mut self.lock_inner(), class, stream)
    }

    /// The pop of [`StreamCache::pop_locked`], under the lane's lock (`inner`).
    #[inline]
    fn take_locked(
        &self,
        inner: &mut CacheInner,
        class: ClassKey,
        stream: StreamId,
    ) -> Option<CachedBlock> {
        if inner.stream != stream {
            return None;
        }
        let b = inner.classes.pop(class)?;
        if !is_small(b.quadrant) {
            self.set_large(inner, None);
        }
        inner.words[CACHED_BYTES] -= b.size;
        // Left stale for the next reader to publish, as a hit leaves it (`close_stats`).
        self.fast.open();
        Some(b)
    }

    /// [`StreamCache::pop_locked`] of a block for `requested` bytes, accounted in `base` in the
    /// same lane section where it stays under the peaks, and then a *top-up*: the lane is
    /// granted, out of the headroom under the peaks that no lane holds
    /// ([`BaseStats::headroom`]), the credit its class's next blocks need, so that the pops
    /// that follow hit without the global lock. Returns the block and whether it was
    /// accounted; where it was not (it may pass a peak), the caller accounts it with
    /// [`BaseStats::live_up`], which revokes credit, and no top-up is made.
    pub fn pop_locked_topped(
        &self,
        class: ClassKey,
        stream: StreamId,
        requested: u64,
        base: &mut BaseStats,
    ) -> Option<(CachedBlock, bool)> {
        let mut g = self.lock_inner();
        let inner = &mut *g;
        let b = self.take_locked(inner, class, stream)?;
        if !base.try_live_up(b.quadrant, b.size, requested) {
            return Some((b, false));
        }
        if is_small(b.quadrant) {
            self.top_up(inner, class, b.quadrant, base);
        }
        Some((b, true))
    }

    /// The top-up of [`StreamCache::pop_locked_topped`], with the lane's lock and the global
    /// lock held: the lane's next pops of `class` (its list from the last block down, as they
    /// will pop), as many whole blocks of quadrant `q` as the credit the lane holds there and
    /// the headroom no lane holds cover together, are granted what they need beyond the credit
    /// held. Nothing where the list is empty, or no next block fits.
    #[inline]
    fn top_up(&self, inner: &mut CacheInner, class: ClassKey, q: usize, base: &mut BaseStats) {
        let q = q & (QUADRANTS - 1);
        let Some(list) = inner.classes.get_mut(class) else { return };
        if list.is_empty() {
            return;
        }
        let held: [u64; 3] =
            std::array::from_fn(|k| inner.ceiling[q][k].wrapping_sub(inner.words[fast_cur(k, q)]));
        let room = base.headroom(q);
        #[cfg(tidepool_broken = "top_up_past_headroom")]
        let room = [u64::MAX / 4; 3]; // BROKEN: grants what the blocks need, whatever the peaks.
        let mut need = [0u64; 3];
        for b in list.iter().rev() {
            let next = [need[BYTES] + b.size, need[COUNT] + 1, need[REQ] + b.requested];
            if b.quadrant & (QUADRANTS - 1) != q
                || (0..3).any(|k| next[k] > held[k].saturating_add(room[k]))
            {
                break;
            }
            need = next;
        }
        let grant: [u64; 3] = std::array::from_fn(|k| need[k].saturating_sub(held[k]));
        if grant == [0; 3] {
            return;
        }
        if !inner.credited {
            self.mark_credited(inner);
        }
        for (c, g) in inner.ceiling[q].iter_mut().zip(grant) {
            *c = c.wrapping_add(g);
        }
        base.assign(q, grant);
    }

    /// Takes the cache's large-pool block, if any (a flush of it alone); the caller holds the
    /// global lock and frees it into the pool.
    pub fn drain_large(&self) -> Option<CachedBlock> {
        let mut g = self.lock_inner();
        let inner = &mut *g;
        if inner.large == 0 {
            return None;
        }
        #[cfg(tidepool_broken = "large_drain")]
        {
            // BROKEN: marks the cache free of large blocks first and lets go of the lock before
            // taking its block out: a large block pushed meanwhile is swept out with it, and only
            // the first one found is returned to be freed (the other is lost).
            self.set_large(inner, None);
            drop(g);
            let mut g = self.lock_inner();
            let inner = &mut *g;
            let mut taken = Vec::new();
            for list in inner.classes.lists_mut() {
                if list.first().is_some_and(|b| !is_small(b.quadrant)) {
                    taken.append(list);
                }
            }
            for b in &taken {
                inner.words[CACHED_BYTES] -= b.size;
            }
            self.publish(inner);
            return taken.first().copied();
        }
        // A class holds blocks of one pool only (its rounded size decides), and the cache holds
        // one large block: the last of its class's list.
        let b = inner
            .classes
            .get_mut(inner.large_class)
            .and_then(|list| list.pop())
            .expect("a large block is counted");
        debug_assert!(!is_small(b.quadrant));
        self.set_large(inner, None);
        inner.words[CACHED_BYTES] -= b.size;
        // Left stale for the next reader to publish, as a hit leaves it (`close_stats`): a
        // publish here compared all the lane's words on every large search that drained it.
        self.fast.open();
        Some(b)
    }

    /// Large-pool blocks cached now, 0 or 1 (a relaxed read: exact under this cache's lock, a
    /// hint without it).
    #[inline]
    pub fn large_blocks(&self) -> u64 {
        u64::from(self.large.load(Ordering::Relaxed) != 0)
    }

    /// Whether the large block cached now may be of `class`: of its rounded size (a relaxed
    /// read, as [`StreamCache::large_blocks`]). Where it is not, a pop of `class` finds nothing,
    /// since a lane holds one large block at most.
    #[inline]
    pub fn holds_large_of(&self, class: ClassKey) -> bool {
        self.large.load(Ordering::Relaxed) == large_key(class)
    }

    /// Records the large block the lane holds now (`None`: none), under its lock: `inner.large`
    /// and the hint `CacheCells::large` (its class's key).
    fn set_large(&self, inner: &mut CacheInner, class: Option<ClassKey>) {
        // The bytes are set by the push that caches one (here 1 meanwhile); the room they
        // added goes with them.
        if class.is_none() && !cfg!(tidepool_broken = "lane_room_shared") {
            inner.room = inner.room.saturating_sub(inner.large);
        }
        inner.large = u64::from(class.is_some());
        self.large.store(class.map_or(0, large_key), Ordering::Relaxed);
    }

    /// Marks the lane as having taken a free ([`CacheCells::freed`]) and as holding credit; the
    /// caller holds its lock and frees a block into it.
    #[cold]
    fn mark_freed(&self, inner: &mut CacheInner) {
        self.freed.store(true, Ordering::Relaxed);
        self.mark_credited(inner);
    }

    /// Whether a block was ever freed into the lane ([`CacheCells::freed`]). Read without the
    /// lane's lock.
    #[inline]
    pub(crate) fn took_a_free(&self) -> bool {
        self.freed.load(Ordering::Relaxed)
    }

    /// Marks the lane as holding credit (see [`CacheCells::credited`]); the caller holds its
    /// lock and grants the credit after.
    #[cold]
    fn mark_credited(&self, inner: &mut CacheInner) {
        #[cfg(feature = "test-hooks")]
        if inner.unmarked {
            return; // BROKEN (`Broken::UnmarkedCredit`): a revocation will not see this credit.
        }
        #[cfg(tidepool_broken = "credit_mark")]
        return; // BROKEN: a revocation will not see this credit.
        #[allow(unreachable_code)]
        {
            inner.credited = true;
            self.credited.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the lane may hold credit (see [`CacheCells::credited`]). Read without the lane's
    /// lock, under the global lock.
    #[inline]
    pub(crate) fn may_hold_credit(&self) -> bool {
        self.credited.load(Ordering::Relaxed)
    }

    /// Takes all of the lane's credit back ([`CacheInner::revoke_credit`]) and clears its mark.
    /// The caller holds the lane's lock (`inner`) and the global lock.
    #[inline]
    pub(crate) fn revoke(&self, inner: &mut CacheInner) {
        inner.revoke_credit();
        inner.credited = false;
        self.credited.store(false, Ordering::Relaxed);
    }

    /// Publishes the pool's free bytes of this stream. The caller holds the global lock.
    pub fn publish_pool_free(&self, bytes: u64) {
        if self.slow.get(0) != bytes {
            self.slow.write(|w| w.set(0, bytes));
        }
    }

    /// Publishes into `fast` the words that differ from what it last published (closing a write
    /// left open). The caller holds this lane's lock.
    fn publish(&self, inner: &mut CacheInner) {
        let (words, published) = (&inner.words, &mut inner.published);
        self.fast.write(|w| {
            for (i, (&v, p)) in words.iter().zip(published.iter_mut()).enumerate() {
                if v != *p {
                    w.set(i, v);
                    *p = v;
                }
            }
        });
    }
}

/// Keeps `list`, whose last entry was just pushed, in falling address order, so that the next
/// pop (its last entry) takes the lowest address: the lanes hand out the last freed block first
/// (LIFO), but the class `Limits::lowest_first` names lowest address first, as the pool's best
/// fit picks among blocks of one size. Over expandable segments that is the small pool's
/// largest class (blocks of half a page): handed out LIFO, t5_train's exactly-1 MiB blocks left
/// the small range's free space in pieces, the largest 16 896 B short of 1 MiB, and it grew by
/// a page in the third step; lowest first, no map after the second (design notes,
/// "Placement-driven maps after the first step"). The smaller classes stay LIFO (lowest first
/// there gave mobilenetv2_train a map in its third step). Swaps in place, no call: a call on
/// the free path cost every free a few instructions in saved registers.
/// (`cfg(tidepool_broken = "lanes_lifo_largest_small")`: LIFO.)
#[inline(always)]
fn lowest_last(list: &mut [CachedBlock]) {
    #[cfg(tidepool_broken = "lanes_lifo_largest_small")]
    if !list.is_empty() {
        return; // BROKEN: the largest small class handed out last freed first
    }
    let mut i = list.len().saturating_sub(1);
    while i > 0 && list[i - 1].ptr.0 < list[i].ptr.0 {
        list.swap(i - 1, i);
        i -= 1;
    }
}

/// The key of a large block's class in [`CacheCells::large`]: its rounded size, never 0. (Its
/// residency is left out: a class of the other residency is rare, and its pop finds nothing.)
#[inline]
fn large_key(class: ClassKey) -> u64 {
    class.rounded
}

/// `Sizing::round` out of line: the hit path rounds with one mask where it can.
#[cold]
#[inline(never)]
fn round_cold(sizing: &Sizing, bytes: u64) -> Option<u64> {
    sizing.round(bytes)
}

/// Frees every block cached by `cache` into `pool` (a flush). The caller holds the global lock.
/// Returns the blocks, for the caller's bookkeeping.
pub fn flush_into(cache: &StreamCache, pool: &mut Pool) -> Vec<CachedBlock> {
    #[cfg(tidepool_broken = "coalesce")]
    {
        // BROKEN: returns the blocks to the pool first and forgets them afterwards, with the
        // stream's lock let go in between: a fast pop can take a block that is already free.
        let blocks: Vec<CachedBlock> = cache.peek().into_iter().map(|(_, b)| b).collect();
        for b in &blocks {
            pool.free(b.block);
        }
        cache.remove(&blocks);
        blocks
    }
    #[cfg(not(tidepool_broken = "coalesce"))]
    {
        let blocks = cache.drain();
        for b in &blocks {
            pool.free(b.block);
        }
        blocks
    }
}
