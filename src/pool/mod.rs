//! Single-threaded block bookkeeping over address ranges: segments, blocks, best fit, split,
//! coalesce. No device calls, no locks, no threads: a pure data structure, tested on a fake
//! address space.
//!
//! ```text
//!  blocks:   Slab<Block>      segment = address-ordered doubly linked list of blocks
//!  segments: Slab<Segment>    each knows the slot of its key's free index
//!  keys:     [(PoolKey, slot)] sorted          free: [FreeIndex; slot]   (see free_index.rs)
//!            best fit of (key, size) = the key's index: smallest block ≥ size, lowest address
//!
//!  seg 0x1000_0000 [alloc 512][free 1536][alloc 1024][free 2 MiB - 3 KiB]
//! ```
//!
//! A freed block merges at once with free neighbours of its segment. Pending blocks (waiting on
//! events) are neither free nor merged. [`BlockStats`] are kept exact after every operation, and
//! [`Pool::check_invariants`] recomputes them from scratch to prove it: the segment and split
//! groups whole (current, peak, totals: the allocator publishes them from here), the five live
//! groups (allocated, active, requested bytes; allocation and active counts) as one current per
//! quadrant and group — the allocator keeps their peaks and totals itself (`counters.rs`), so
//! an allocation or free here adds five words instead of updating fifteen cells.

mod align;
mod block;
mod divisions;
mod free_index;
mod invariants;
mod pages;
mod sizing;

pub use align::padding;
pub use block::{Block, BlockId, BlockState, PoolKey, Segment, SegmentId};
pub use divisions::{INTERVALS as ROUNDUP_INTERVALS, RoundupDivisions};
pub use sizing::{DEFAULT_MAX_NON_SPLIT_ROUNDING, MIB, Sizing};

use crate::types::{BlockStats, Stat, StreamId};
use free_index::{Entry, FreeIndex};
use slab::Slab;

/// The live groups whose currents the pool keeps per quadrant, in the order of `Pool::live`.
#[derive(Clone, Copy)]
enum Live {
    AllocatedBytes,
    Allocation,
    ActiveBytes,
    Active,
    RequestedBytes,
}

const LIVE_GROUPS: usize = 5;

/// Streams whose keys' slots [`Pool`] also keeps in a table indexed by stream.
const DIRECT_STREAMS: usize = 64;
/// No slot (in `Pool::direct`).
const NO_SLOT: u32 = u32::MAX;

/// The free blocks of one pool key.
#[derive(Clone)]
struct Keyed {
    key: PoolKey,
    index: FreeIndex,
    /// Its free bytes changed since the last [`Pool::take_dirty_streams`] ([`PUBLISH`]), and
    /// since the last [`Pool::take_trim_streams`] ([`TRIM`]): the publishing of statistics and
    /// the trims of expandable ranges each take the changes they have not seen, so reading the
    /// statistics never hides a change from a later trim.
    dirty: u8,
    /// Since the last [`Pool::take_trim_streams`], a free left a free block of at least
    /// [`Pool::set_whole_page`] bytes here, which may hold a whole page to give back (set
    /// with [`TRIM`] only).
    whole: bool,
    /// Segments of the key. When the last goes, the slot is retired (`Pool::segment_gone`):
    /// a program that makes and destroys streams would otherwise keep an index (and its
    /// octaves' bins) per key of every stream it ever used.
    segments: u32,
}

/// [`Keyed::dirty`]: a change the statistics have not published yet.
const PUBLISH: u8 = 1;
/// [`Keyed::dirty`]: a change no trim has checked yet.
const TRIM: u8 = 2;

/// Block records a device's own pool ([`Pool::with_room`]) has room for from the start (~80 KiB):
/// the real traces reach 200–1000 blocks at once, and a slab growing to that took 8
/// reallocations (the last ones copying tens of KiB) during a fresh allocator's first step.
const BLOCKS_AHEAD: usize = 1024;
/// Segment records a device's own pool has room for from the start.
const SEGMENTS_AHEAD: usize = 64;

/// Segments and blocks of every pool of one device. See the module docs.
#[derive(Clone, Default)]
pub struct Pool {
    blocks: Slab<Block>,
    segments: Slab<Segment>,
    /// Every key that has a segment, sorted, with the slot of its index in `free`.
    keys: Vec<(PoolKey, usize)>,
    /// The same for streams below [`DIRECT_STREAMS`], by stream and quadrant
    /// ([`Pool::quadrant`]; `NO_SLOT`: none): a key's slot without the binary search.
    direct: Vec<[u32; 4]>,
    /// Free index per slot; a retired slot (its key's last segment gone) waits in `vacant`
    /// for the next new key.
    free: Vec<Keyed>,
    /// Retired slots of `free` (not dirty: their streams moved to `dirty_gone`).
    vacant: Vec<usize>,
    /// Streams of retired slots that were dirty, for [`Pool::take_dirty_streams`] (each once).
    dirty_gone: Vec<StreamId>,
    stats: BlockStats,
    /// Current of each live group ([`Live`]) per quadrant ([`Pool::quadrant`]).
    live: [[u64; LIVE_GROUPS]; 4],
    /// Slots whose [`PUBLISH`] flag is set (each once).
    dirty: Vec<usize>,
    /// Slots whose [`TRIM`] flag is set (each once).
    trim_dirty: Vec<usize>,
    /// Which of the statistics only the pool changes changed since [`Pool::take_changed`].
    changed: u8,
    /// Ticks at every allocation and free of the large pool ([`Ticks`]): segments remember
    /// when they were last used.
    clock: u64,
    /// How far each pool kind's events move the clock (none while it is stopped:
    /// [`Pool::run_clock`]).
    ticks: Ticks,
    /// Blocks freed so far ([`Pool::frees`]).
    frees: u64,
    /// Blocks of at least this size are oversize allocations (`max_split_size`; 0: unset).
    oversize_at: u64,
    /// Live oversize allocations (PyTorch's `oversize_allocations`).
    oversize: Stat,
    /// Blocks are never split (a `no_split` private pool): a request takes a free block whole.
    no_split: bool,
    /// Bytes per quadrant ([`Pool::quadrant`]) carved out of their segments but still held on
    /// the device, counted in `reserved_bytes` until they go ([`Pool::hold`]).
    held: [u64; 4],
    /// A free leaving a free block of at least this many bytes marks its key `whole`
    /// ([`Pool::set_whole_page`]; never by default).
    whole_page: AtLeast,
}

/// A size bound that no block reaches unless set (the default is `u64::MAX`).
#[derive(Clone, Copy)]
struct AtLeast(u64);

impl Default for AtLeast {
    fn default() -> AtLeast {
        AtLeast(u64::MAX)
    }
}

/// How far an allocation, free or new segment of each pool kind (`PoolKind as usize`) moves
/// the pool's clock while it runs: only the large pool's traffic counts (PyTorch's age counts
/// searches of the large pool, which alone the collection walks). Small requests the stream
/// caches serve never reach the pool, so counting the small pool's would make the large
/// segments' idle ages depend on the caches. (A table: one load where the clock ticks, on
/// every allocation and free.)
/// BROKEN (`gc_small_ticks`): every pool event ticked.
#[derive(Clone, Copy)]
struct Ticks([u64; 2]);

impl Ticks {
    const RUNNING: Ticks = Ticks([cfg!(tidepool_broken = "gc_small_ticks") as u64, 1]);
    const STOPPED: Ticks = Ticks([0, 0]);

    #[inline(always)]
    fn of(self, kind: crate::types::PoolKind) -> u64 {
        self.0[kind as usize]
    }
}

impl Default for Ticks {
    fn default() -> Ticks {
        Ticks::RUNNING
    }
}

impl Pool {
    /// [`Pool::take_changed`]: reserved bytes and segment counts changed, one bit per
    /// quadrant (see [`Pool::quadrant`]).
    pub const SEGMENTS_CHANGED: u8 = 0x0f;
    /// [`Pool::take_changed`]: inactive split bytes and counts changed, one bit per quadrant.
    pub const SPLITS_CHANGED: u8 = 0xf0;

    /// The quadrant of a pool key's statistics: small persistent 0, small transient 1, large
    /// persistent 2, large transient 3.
    pub fn quadrant(kind: crate::types::PoolKind, residency: crate::types::Residency) -> usize {
        use crate::types::{PoolKind, Residency};
        let k = usize::from(kind == PoolKind::Large);
        let r = usize::from(residency == Residency::Transient);
        k * 2 + r
    }

    /// An empty pool.
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn new() -> Pool {
        Pool::default()
    }

    /// An empty pool with room for `BLOCKS_AHEAD` blocks and `SEGMENTS_AHEAD` segments: a
    /// device's own allocator's (private pools start empty: a program may make many).
    pub fn with_room() -> Pool {
        Pool {
            blocks: Slab::with_capacity(BLOCKS_AHEAD),
            segments: Slab::with_capacity(SEGMENTS_AHEAD),
            ..Pool::default()
        }
    }

    /// The exact block statistics. The live groups (allocated, active and requested bytes,
    /// allocation and active counts) carry their currents only: peak = current, no totals (the
    /// allocator keeps those, see the module docs).
    pub fn stats(&self) -> BlockStats {
        let mut s = self.stats;
        let groups = [
            (Live::AllocatedBytes, &mut s.allocated_bytes),
            (Live::Allocation, &mut s.allocation),
            (Live::ActiveBytes, &mut s.active_bytes),
            (Live::Active, &mut s.active),
            (Live::RequestedBytes, &mut s.requested_bytes),
        ];
        for (g, group) in groups {
            let q = |i: usize| self.live[i][g as usize];
            let cells = [
                (&mut group.all, q(0) + q(1) + q(2) + q(3)),
                (&mut group.small_pool, q(0) + q(1)),
                (&mut group.large_pool, q(2) + q(3)),
                (&mut group.persistent, q(0) + q(2)),
                (&mut group.transient, q(1) + q(3)),
            ];
            for (cell, v) in cells {
                *cell = Stat { current: v, peak: v, ..Stat::default() };
            }
        }
        s
    }

    /// The pool's clock now: it ticks at every allocation and free of the large pool while it
    /// runs ([`Pool::run_clock`]), and a segment's `last_use` is its reading then (the garbage
    /// collection's idle age is the difference).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Runs the clock (`true`) or stops it: it runs only while a garbage-collection threshold
    /// is in force, as PyTorch's `get_free_blocks_call_count` counts only then. Stopped, every
    /// segment used meanwhile reads the same time, so when a threshold is set later the
    /// segments cached before count as equally idle, and the stream caches' large traffic
    /// before it (blocks freed into a cache and handed out again, which the pool never sees and
    /// `global_lock`'s pool sees all of) makes no age differ.
    /// BROKEN (`gc_clock_always`): it ran whatever the configuration.
    pub fn run_clock(&mut self, run: bool) {
        let run = run || cfg!(tidepool_broken = "gc_clock_always");
        self.ticks = if run { Ticks::RUNNING } else { Ticks::STOPPED };
    }

    /// How many times a block was freed ([`Pool::free`]) since the pool was made.
    pub fn frees(&self) -> u64 {
        self.frees
    }

    /// Bytes of segments reserved (`stats().reserved_bytes.all.current`, without the copy).
    #[inline]
    pub fn reserved_bytes(&self) -> u64 {
        self.stats.reserved_bytes.all.current
    }

    /// Adds `n` to the live group `g` of quadrant `q` (`up`), or subtracts it.
    #[inline]
    fn live(&mut self, q: usize, g: Live, n: u64, up: bool) {
        let v = &mut self.live[q][g as usize];
        *v = if up { *v + n } else { *v - n };
    }

    /// Live allocations of blocks of at least the oversize size (PyTorch's
    /// `oversize_allocations`: blocks never split, of `max_split_size` or more).
    #[inline]
    pub fn oversize_allocations(&self) -> &Stat {
        &self.oversize
    }

    /// Never split a block from now on (PyTorch's `MemPool(no_split=True)`): each allocation
    /// takes a free block whole, so a new segment holds one block.
    pub fn set_no_split(&mut self, on: bool) {
        self.no_split = on;
    }

    /// Whether a free block of `block` bytes serving `rounded` bytes is split
    /// ([`Sizing::should_split`], never in a `no_split` pool).
    #[inline]
    fn splits(
        &self,
        sizing: &Sizing,
        kind: crate::types::PoolKind,
        block: u64,
        rounded: u64,
    ) -> bool {
        // BROKEN (`no_split_splits`): the pool's rule ignored.
        (!self.no_split || cfg!(tidepool_broken = "no_split_splits"))
            && sizing.should_split(kind, block, rounded)
    }

    /// Blocks of at least `bytes` count as oversize allocations from now on (`u64::MAX`: none).
    pub fn set_oversize_size(&mut self, bytes: u64) {
        self.oversize_at = bytes;
    }

    /// Resets every peak statistic to its current value.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
        self.oversize.reset_peak();
        self.changed = Self::SEGMENTS_CHANGED | Self::SPLITS_CHANGED;
    }

    /// Which of the statistics that only the pool changes (reserved bytes and segments,
    /// inactive splits) changed since the last call, and in which quadrants: bit `q` of
    /// [`Pool::SEGMENTS_CHANGED`] and of [`Pool::SPLITS_CHANGED`] for quadrant `q`, so that
    /// publishing copies only those cells.
    pub fn take_changed(&mut self) -> u8 {
        std::mem::take(&mut self.changed)
    }

    /// Counts a segment of `size` bytes in (`up`) or out.
    fn count_segment(&mut self, key: PoolKey, size: u64, up: bool) {
        let (k, r, st) = (key.kind, key.residency, &mut self.stats);
        if up {
            st.reserved_bytes.increase(k, r, size);
            st.segment.increase(k, r, 1);
        } else {
            st.reserved_bytes.decrease(k, r, size);
            st.segment.decrease(k, r, 1);
        }
        self.changed |= 1 << Self::quadrant(k, r);
    }

    /// The key whose inactive-split figures count the free blocks of segment `seg`: none for a
    /// run of an expandable range ([`Segment::expandable`]).
    #[inline]
    fn split_counted(&self, seg: SegmentId) -> Option<PoolKey> {
        let s = &self.segments[seg.0];
        // BROKEN (`expandable_inactive_split`): runs count as device segments do.
        let skip = s.expandable && !cfg!(tidepool_broken = "expandable_inactive_split");
        (!skip).then_some(s.key)
    }

    /// Counts a free block of split segment `seg`, of `size` bytes, in (`up`) or out; nothing
    /// for a run of an expandable range ([`Segment::expandable`]).
    #[inline]
    fn count_split(&mut self, seg: SegmentId, size: u64, up: bool) {
        let Some(key) = self.split_counted(seg) else { return };
        let (k, r, st) = (key.kind, key.residency, &mut self.stats);
        if up {
            st.inactive_split_bytes.increase(k, r, size);
            st.inactive_split.increase(k, r, 1);
        } else {
            st.inactive_split_bytes.decrease(k, r, size);
            st.inactive_split.decrease(k, r, 1);
        }
        self.changed |= 0x10 << Self::quadrant(k, r);
    }

    /// Counts the net change of the inactive splits of segment `seg`, as PyTorch's `free_block`
    /// does: `blocks` free blocks and `bytes` bytes in (positive) or out (negative), so that a
    /// block that left the figures and came back in the same operation (a merged neighbour, the
    /// block it merged into) counts in no total. Nothing for a run of an expandable range.
    fn count_split_net(&mut self, seg: SegmentId, (blocks, bytes): (i64, i64)) {
        if blocks == 0 && bytes == 0 {
            return;
        }
        let Some(key) = self.split_counted(seg) else { return };
        let (k, r, st) = (key.kind, key.residency, &mut self.stats);
        for (g, n) in [(&mut st.inactive_split, blocks), (&mut st.inactive_split_bytes, bytes)] {
            match n.signum() {
                1 => g.increase(k, r, n.unsigned_abs()),
                -1 => g.decrease(k, r, n.unsigned_abs()),
                _ => {}
            }
        }
        self.changed |= 0x10 << Self::quadrant(k, r);
    }

    /// A free block of `size` bytes of split segment `seg` leaves the inactive splits (`up`:
    /// enters them) as part of an operation whose net change `net` (blocks, bytes) collects, for
    /// [`Pool::count_split_net`] to count once the operation is done.
    #[inline]
    fn split_change(&mut self, seg: SegmentId, net: &mut (i64, i64), size: u64, up: bool) {
        // BROKEN (`inactive_split_gross`): every block counted out and in on its own, so the
        // totals count a merged neighbour out and the merged block in (PyTorch: the net change).
        if cfg!(tidepool_broken = "inactive_split_gross") {
            return self.count_split(seg, size, up);
        }
        let sign = if up { 1 } else { -1 };
        net.0 += sign;
        net.1 += sign * size as i64;
    }

    /// Counts a free block of a split segment, of `old` bytes, shrunk to its remainder of `new`
    /// bytes (≤ `old`): PyTorch's split of an already-split block, which lowers the inactive
    /// split bytes by what is handed out (`old − new` freed) and leaves the count as it is. (The
    /// current falls or stays, so no peak moves.)
    fn count_split_shrunk(&mut self, seg: SegmentId, old: u64, new: u64) {
        debug_assert!(new <= old);
        let Some(key) = self.split_counted(seg) else { return };
        let (k, r) = (key.kind, key.residency);
        let shrink = |g: &mut crate::types::StatGroup, old: u64, new: u64| {
            // BROKEN (`inactive_split_gross`): the block counted out and its remainder in.
            #[cfg(tidepool_broken = "inactive_split_gross")]
            let cell = |s: &mut Stat| {
                s.current = s.current - old + new;
                s.freed += old;
                s.allocated += new;
            };
            #[cfg(not(tidepool_broken = "inactive_split_gross"))]
            let cell = |s: &mut Stat| {
                s.current -= old - new;
                s.freed += old - new;
            };
            cell(&mut g.all);
            cell(match k {
                crate::types::PoolKind::Small => &mut g.small_pool,
                crate::types::PoolKind::Large => &mut g.large_pool,
            });
            cell(match r {
                crate::types::Residency::Persistent => &mut g.persistent,
                crate::types::Residency::Transient => &mut g.transient,
            });
        };
        shrink(&mut self.stats.inactive_split_bytes, old, new);
        shrink(&mut self.stats.inactive_split, 1, 1);
        self.changed |= 0x10 << Self::quadrant(k, r);
    }

    /// The block record of `id`. Panics on an id that is not a live block (a caller bug).
    #[inline]
    pub fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id.0]
    }

    /// The segment record of `id`.
    #[inline]
    pub fn segment(&self, id: SegmentId) -> &Segment {
        &self.segments[id.0]
    }

    /// Every segment, in no particular order.
    pub fn segments(&self) -> impl Iterator<Item = (SegmentId, &Segment)> {
        self.segments.iter().map(|(i, s)| (SegmentId(i), s))
    }

    /// The blocks of a segment in address order.
    pub fn segment_blocks(&self, id: SegmentId) -> impl Iterator<Item = (BlockId, &Block)> {
        let mut cur = Some(self.segments[id.0].first);
        std::iter::from_fn(move || {
            let id = cur?;
            let b = &self.blocks[id.0];
            cur = b.next;
            Some((id, b))
        })
    }

    /// Number of free blocks cached.
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn free_blocks(&self) -> usize {
        self.free.iter().map(|k| k.index.len()).sum()
    }

    /// The best-fit free block of `key` for a rounded request: the smallest block ≥ `rounded`
    /// (lowest address among equals), unless the size rules forbid spending it on this request.
    #[inline]
    pub fn find_free(&self, key: PoolKey, rounded: u64, sizing: &Sizing) -> Option<BlockId> {
        let e = self.free[self.slot_of(key)?].index.best_fit(rounded)?;
        sizing.may_serve(e.size, rounded).then_some(BlockId(e.id))
    }

    /// [`Pool::find_free`], and whether `key` has a free block larger than the one found
    /// (where it has none, no search above that size can succeed).
    #[inline]
    pub fn find_free_and_larger(
        &self,
        key: PoolKey,
        rounded: u64,
        sizing: &Sizing,
    ) -> Option<(BlockId, bool)> {
        let (e, larger) = self.free[self.slot_of(key)?].index.best_fit_and_larger(rounded)?;
        sizing.may_serve(e.size, rounded).then_some((BlockId(e.id), larger))
    }

    /// Whether `key` has a free block larger than `size` bytes (its largest, from the index's
    /// bitmaps: no search). Where it has none, no `find_free` above `size` can succeed.
    #[inline]
    pub fn has_free_above(&self, key: PoolKey, size: u64) -> bool {
        let largest = self.slot_of(key).and_then(|s| self.free[s].index.largest());
        largest.is_some_and(|e| e.size > size)
    }

    /// Free-index slots held (in use or retired, waiting for a new key).
    #[cfg(feature = "test-hooks")]
    pub fn index_slots(&self) -> usize {
        self.free.len()
    }

    /// Whether `key` has a segment (so it may have free blocks).
    #[inline]
    pub fn has_key(&self, key: PoolKey) -> bool {
        self.slot_of(key).is_some()
    }

    /// Free blocks of `key` in (size, address) order.
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn free_of(&self, key: PoolKey) -> impl Iterator<Item = BlockId> + '_ {
        let index = self.slot_of(key).map(|s| &self.free[s].index);
        index.into_iter().flat_map(|i| i.iter().map(|e| BlockId(e.id)))
    }

    /// The slot of `key`'s free index, if it has one (while it has segments).
    #[inline]
    fn slot_of(&self, key: PoolKey) -> Option<usize> {
        if let Some(row) = self.direct.get(key.stream.0 as usize) {
            let slot = row[Self::quadrant(key.kind, key.residency)];
            return (slot != NO_SLOT).then_some(slot as usize);
        }
        let i = self.keys.binary_search_by_key(&key, |k| k.0).ok()?;
        Some(self.keys[i].1)
    }

    /// The slot of `key`'s free index, made on first use (a retired slot if there is one).
    fn slot_for(&mut self, key: PoolKey) -> usize {
        match self.keys.binary_search_by_key(&key, |k| k.0) {
            Ok(i) => self.keys[i].1,
            Err(i) => {
                let keyed =
                    Keyed { key, index: FreeIndex::default(), dirty: 0, whole: false, segments: 0 };
                let slot = match self.vacant.pop() {
                    Some(slot) => {
                        self.free[slot] = keyed;
                        slot
                    }
                    None => {
                        self.free.push(keyed);
                        self.free.len() - 1
                    }
                };
                self.keys.insert(i, (key, slot));
                let s = key.stream.0 as usize;
                if s < DIRECT_STREAMS {
                    if self.direct.len() <= s {
                        self.direct.resize(s + 1, [NO_SLOT; 4]);
                    }
                    self.direct[s][Self::quadrant(key.kind, key.residency)] = slot as u32;
                }
                slot
            }
        }
    }

    /// One segment of slot `slot`'s key went (removed, merged or moved to another key); the
    /// last retires the slot: its key leaves `keys` (and `direct`), its index is dropped, and
    /// the slot waits in `vacant` for the next new key. A dirty slot's stream moves to
    /// `dirty_gone`, so its free bytes (now none) are still published.
    fn segment_gone(&mut self, slot: usize) {
        let k = &mut self.free[slot];
        k.segments -= 1;
        if k.segments > 0 {
            return;
        }
        debug_assert_eq!(k.index.len(), 0, "a key with no segment has free blocks");
        let key = k.key;
        k.index = FreeIndex::default();
        let dirty = std::mem::take(&mut k.dirty);
        k.whole = false;
        if dirty & PUBLISH != 0 {
            self.dirty.retain(|&s| s != slot);
            if !self.dirty_gone.contains(&key.stream) {
                self.dirty_gone.push(key.stream);
            }
        }
        if dirty & TRIM != 0 {
            // (A trim has nothing to give back of a key with no segment left.)
            self.trim_dirty.retain(|&s| s != slot);
        }
        if let Ok(i) = self.keys.binary_search_by_key(&key, |k| k.0) {
            self.keys.remove(i);
        }
        if let Some(row) = self.direct.get_mut(key.stream.0 as usize) {
            row[Self::quadrant(key.kind, key.residency)] = NO_SLOT;
        }
        self.vacant.push(slot);
    }

    /// Adds a segment of `size` bytes at `base` for `key`, as one free block; returns that block.
    pub fn add_segment(&mut self, key: PoolKey, base: u64, size: u64) -> BlockId {
        let seg = SegmentId(self.segments.vacant_key());
        let slot = self.slot_for(key);
        self.free[slot].segments += 1;
        let block = BlockId(self.blocks.insert(Block {
            segment: seg,
            addr: base,
            size,
            requested: 0,
            prev: None,
            next: None,
            state: BlockState::Free,
            oversize: false,
        }));
        self.clock += self.ticks.of(key.kind);
        let last_use = self.clock;
        self.segments.insert(Segment {
            base,
            size,
            key,
            first: block,
            last: block,
            busy_blocks: 0,
            slot,
            last_use,
            expandable: false,
        });
        self.index_insert(slot, Entry { size, addr: base, id: block.0 });
        self.count_segment(key, size, true);
        block
    }

    /// Hands out the free block `id` for a request of `requested` bytes rounded to `rounded`,
    /// splitting off the remainder when `sizing` says so. Returns the allocated block (at the
    /// same address as `id`). Inline (three callers: the slow path's, a scope's region and an
    /// adopted block's): a call fewer per slow-path allocation (2026-12-06, −0.3 %).
    #[inline(always)]
    pub fn allocate(
        &mut self,
        id: BlockId,
        rounded: u64,
        requested: u64,
        sizing: &Sizing,
    ) -> BlockId {
        // The block's record is read once; the segment's once (its key, slot and use mark).
        let b = &self.blocks[id.0];
        assert_eq!(b.state, BlockState::Free, "allocate of a block that is not free");
        assert!(b.size >= rounded, "allocate of a block smaller than the request");
        let (seg, addr, whole, next, split) = (b.segment, b.addr, b.size, b.next, b.is_split());
        let s = &mut self.segments[seg.0];
        s.busy_blocks += 1;
        self.clock += self.ticks.of(s.key.kind);
        s.last_use = self.clock;
        let (key, slot) = (s.key, s.slot);
        let (kind, res) = (key.kind, key.residency);
        let taken = Entry { size: whole, addr, id: id.0 };
        let (size, next) = match self.splits(sizing, kind, whole, rounded) {
            true => {
                let rest = Block {
                    segment: seg,
                    addr: addr + rounded,
                    size: whole - rounded,
                    requested: 0,
                    prev: Some(id),
                    next,
                    state: BlockState::Free,
                    oversize: false,
                };
                let rest_id = self.blocks.insert(rest);
                match next {
                    Some(n) => self.blocks[n.0].prev = Some(BlockId(rest_id)),
                    None => self.segments[seg.0].last = BlockId(rest_id),
                }
                // The remainder takes the block's entry (in place where it keeps its rank).
                let e = Entry { size: whole - rounded, addr: addr + rounded, id: rest_id };
                self.index_replace(slot, &taken, e);
                // The free block leaves the inactive splits and its remainder enters them.
                match split {
                    true => self.count_split_shrunk(seg, whole, whole - rounded),
                    false => self.count_split(seg, whole - rounded, true),
                }
                (rounded, Some(BlockId(rest_id)))
            }
            false => {
                self.index_remove(slot, &taken);
                if split {
                    self.count_split(seg, whole, false);
                }
                (whole, next)
            }
        };
        let oversize = self.oversize_at > 0 && size >= self.oversize_at;
        let b = &mut self.blocks[id.0];
        b.next = next;
        b.size = size;
        b.state = BlockState::Allocated;
        b.requested = requested;
        b.oversize = oversize;
        if oversize {
            self.oversize.increase(1);
        }
        let q = Self::quadrant(kind, res);
        let l = &mut self.live[q];
        l[Live::AllocatedBytes as usize] += size;
        l[Live::Allocation as usize] += 1;
        l[Live::ActiveBytes as usize] += size;
        l[Live::Active as usize] += 1;
        l[Live::RequestedBytes as usize] += requested;
        id
    }

    /// Where handing the allocated block `id` out again, unchanged, for a request rounded to
    /// `rounded` leaves the pool exactly as [`Pool::free`] of it followed by
    /// [`Pool::find_free`] and [`Pool::allocate`] would: the block, merged with a free right
    /// neighbour, is the best fit (no free left neighbour would move its start, no other free
    /// block of its key fits better) and the allocation would give back the same block: the
    /// bytes of that merged free block (`None` elsewhere). Two O(1) lookups in the free index.
    ///
    /// ```text
    ///  [busy][ id (allocated) ][free R]    freed: [busy][ id + R ]  best fit, starts at id,
    ///                                      split back into [id][R]  ⇒  reuse id as it is
    /// ```
    pub fn reuse_is_best_fit(&self, id: BlockId, rounded: u64, sizing: &Sizing) -> Option<u64> {
        let b = &self.blocks[id.0];
        if b.state != BlockState::Allocated || b.size < rounded {
            return None;
        }
        let free = |n: Option<BlockId>| n.filter(|n| self.blocks[n.0].state == BlockState::Free);
        if free(b.prev).is_some() {
            return None;
        }
        let seg = &self.segments[b.segment.0];
        let right = free(b.next);
        let merged = b.size + right.map_or(0, |r| self.blocks[r.0].size);
        let same_split = match right {
            // Freed, the block alone would be split again only where it was not before.
            None => !self.splits(sizing, seg.key.kind, b.size, rounded),
            // Freed, it merges with R: the allocation must split exactly R off again.
            Some(_) => b.size == rounded && self.splits(sizing, seg.key.kind, merged, rounded),
        };
        if !same_split || !sizing.may_serve(merged, rounded) {
            return None;
        }
        // The best fit among the other free blocks (R merges into the block when it is freed).
        let index = &self.free[seg.slot].index;
        let best = match index.best_fit(rounded) {
            Some(e) if right.is_some_and(|r| r.0 == e.id) => index.next_after(&e),
            e => e,
        };
        best.is_none_or(|e| (e.size, e.addr) > (merged, b.addr)).then_some(merged)
    }

    /// Marks an allocated block as freed by its user but waiting on events: it stops counting as
    /// allocated, stays active, and is neither reusable nor merged until [`Pool::free`].
    pub fn mark_pending(&mut self, id: BlockId) {
        let b = &mut self.blocks[id.0];
        assert_eq!(b.state, BlockState::Allocated, "mark_pending of a block that is not allocated");
        b.state = BlockState::Pending;
        if std::mem::take(&mut b.oversize) {
            self.oversize.decrease(1);
        }
        let (size, key) = (b.size, self.segments[b.segment.0].key);
        let q = Self::quadrant(key.kind, key.residency);
        self.live(q, Live::AllocatedBytes, size, false);
        self.live(q, Live::Allocation, 1, false);
    }

    /// Returns an allocated or pending block to the free index, merging it with free neighbours.
    /// Returns the id of the resulting free block.
    ///
    /// ```text
    ///  [left L free][ id ][right R free]  ──▶  [ L + id + R ]   L's record (else id's) stays;
    ///                                          it takes L's (else R's) free-index entry
    /// ```
    pub fn free(&mut self, id: BlockId) -> BlockId {
        let b = &mut self.blocks[id.0];
        let was = b.state;
        assert_ne!(was, BlockState::Free, "double free of a block");
        b.state = BlockState::Free;
        let (size, requested, seg) = (b.size, b.requested, b.segment);
        let (addr, prev, next) = (b.addr, b.prev, b.next);
        b.requested = 0;
        if std::mem::take(&mut b.oversize) {
            self.oversize.decrease(1);
        }
        self.frees += 1;
        let s = &mut self.segments[seg.0];
        s.busy_blocks -= 1;
        self.clock += self.ticks.of(s.key.kind);
        s.last_use = self.clock;
        let (key, slot) = (s.key, s.slot);
        let (kind, res) = (key.kind, key.residency);
        let l = &mut self.live[Self::quadrant(kind, res)];
        if was == BlockState::Allocated {
            l[Live::AllocatedBytes as usize] -= size;
            l[Live::Allocation as usize] -= 1;
        }
        l[Live::ActiveBytes as usize] -= size;
        l[Live::Active as usize] -= 1;
        l[Live::RequestedBytes as usize] -= requested;

        // Each neighbour's record is read once: its entry if it is free.
        let free_entry = |n: Option<BlockId>| {
            let n = n?;
            let x = &self.blocks[n.0];
            (x.state == BlockState::Free).then_some(Entry { size: x.size, addr: x.addr, id: n.0 })
        };
        let (left, right) = (free_entry(prev), free_entry(next));
        if left.is_none() && right.is_none() {
            let m = Entry { size, addr, id: id.0 };
            self.index_insert(slot, m);
            self.free[slot].whole |= size >= self.whole_page.0;
            if prev.is_some() || next.is_some() {
                self.count_split(seg, size, true);
            }
            return id;
        }
        // The merged block keeps the left neighbour's record if it is free, else `id`'s, and
        // ends where the right neighbour (if free) ended.
        let merged = left.map_or(id, |l| BlockId(l.id));
        let end_next = match right {
            Some(r) => self.blocks.remove(r.id).next,
            None => next,
        };
        if left.is_some() {
            self.blocks.remove(id.0);
        }
        match end_next {
            Some(n) => self.blocks[n.0].prev = Some(merged),
            None => self.segments[seg.0].last = merged,
        }
        let m = &mut self.blocks[merged.0];
        m.size = size + left.map_or(0, |l| l.size) + right.map_or(0, |r| r.size);
        m.next = end_next;
        let (m, split) = (Entry { size: m.size, addr: m.addr, id: merged.0 }, m.is_split());
        // The merged block takes the left neighbour's entry (else the right's), in place where
        // it keeps its rank; with both free, the right one leaves the index. (A free neighbour
        // of another block is always part of a split segment.) The inactive splits move by the
        // net change (PyTorch's `free_block`).
        let mut net = (0, 0);
        let taken = match (left, right) {
            (Some(l), Some(r)) => {
                if self.index_remove(slot, &r) {
                    self.split_change(seg, &mut net, r.size, false);
                }
                l
            }
            (Some(e), None) | (None, Some(e)) => e,
            (None, None) => unreachable!("a free neighbour: see above"),
        };
        if self.index_replace(slot, &taken, m) {
            self.split_change(seg, &mut net, taken.size, false);
        } else {
            self.index_insert(slot, m);
        }
        if split {
            self.split_change(seg, &mut net, m.size, true);
        }
        self.count_split_net(seg, net);
        self.free[slot].whole |= m.size >= self.whole_page.0;
        merged
    }

    /// Segments that hold no allocated or pending block (one free block each) and satisfy `keep`.
    pub fn releasable_segments(&self, mut keep: impl FnMut(&Segment) -> bool) -> Vec<SegmentId> {
        self.segments
            .iter()
            .filter(|(_, s)| s.busy_blocks == 0 && keep(s))
            .map(|(i, _)| SegmentId(i))
            .collect()
    }

    /// Removes a segment with no busy block; returns its (base, size) for the device to release.
    pub fn remove_segment(&mut self, id: SegmentId) -> (u64, u64) {
        let seg = &self.segments[id.0];
        assert_eq!(seg.busy_blocks, 0, "remove_segment of a segment in use");
        let b = &self.blocks[seg.first.0];
        debug_assert!(b.state == BlockState::Free && !b.is_split());
        let entry = Entry { size: b.size, addr: b.addr, id: seg.first.0 };
        self.index_remove(seg.slot, &entry);
        self.blocks.remove(entry.id);
        let seg = self.segments.remove(id.0);
        self.segment_gone(seg.slot);
        self.count_segment(seg.key, seg.size, false);
        (seg.base, seg.size)
    }

    /// Moves a segment with no busy block to another stream's free lists.
    pub fn rekey_segment(&mut self, id: SegmentId, stream: StreamId) {
        let seg = &self.segments[id.0];
        assert_eq!(seg.busy_blocks, 0, "rekey_segment of a segment in use");
        let b = &self.blocks[seg.first.0];
        let entry = Entry { size: b.size, addr: b.addr, id: seg.first.0 };
        let (key, old) = (PoolKey { stream, ..seg.key }, seg.slot);
        self.index_remove(old, &entry);
        self.segment_gone(old);
        let slot = self.slot_for(key);
        self.free[slot].segments += 1;
        let seg = &mut self.segments[id.0];
        (seg.key, seg.slot) = (key, slot);
        self.index_insert(slot, entry);
    }

    /// Bytes of free blocks cached for `stream`.
    pub fn free_bytes_of(&self, stream: StreamId) -> u64 {
        self.free.iter().filter(|k| k.key.stream == stream).map(|k| k.index.bytes()).sum()
    }

    /// Streams whose free bytes changed since the last call, in stream order, each once: what
    /// a trim of expandable ranges checks, each with whether a free since left a free block of
    /// at least [`Pool::set_whole_page`] bytes on it. Independent of
    /// [`Pool::take_dirty_streams`].
    pub fn take_trim_streams(&mut self) -> Vec<(StreamId, bool)> {
        let mut out: Vec<(StreamId, bool)> = Vec::with_capacity(self.trim_dirty.len());
        for slot in self.trim_dirty.drain(..) {
            let k = &mut self.free[slot];
            out.push((k.key.stream, std::mem::take(&mut k.whole)));
            k.dirty &= !TRIM;
        }
        out.sort_unstable();
        // One entry per stream, whole if any of its keys is.
        out.dedup_by(|b, a| {
            let same = a.0 == b.0;
            a.1 |= same && b.1;
            same
        });
        out
    }

    /// Marks every key of `stream` for the next [`Pool::take_trim_streams`], as a change of its
    /// free bytes would: a trim whose rules for the stream changed (a learning run opened on it)
    /// checks it even if nothing changed since the last trim took it.
    pub fn mark_trim_stream(&mut self, stream: StreamId) {
        for &(key, slot) in &self.keys {
            let k = &mut self.free[slot];
            if key.stream == stream && k.dirty & TRIM == 0 {
                k.dirty |= TRIM;
                self.trim_dirty.push(slot);
            }
        }
    }

    /// From now on, a free that leaves a free block of at least `bytes` marks its stream for
    /// the next [`Pool::take_trim_streams`]: the trims of expandable ranges set a page here.
    pub fn set_whole_page(&mut self, bytes: u64) {
        self.whole_page = AtLeast(bytes);
    }

    /// Streams whose free bytes changed since the last call (each once), for publishing.
    pub fn take_dirty_streams(&mut self, out: &mut Vec<StreamId>) {
        out.clear();
        out.append(&mut self.dirty_gone);
        for slot in self.dirty.drain(..) {
            let k = &mut self.free[slot];
            k.dirty &= !PUBLISH;
            if !out.contains(&k.key.stream) {
                out.push(k.key.stream);
            }
        }
    }

    /// Records the new request of an allocated block handed to another user unchanged (the
    /// allocator's stream caches reuse blocks without splitting).
    pub fn set_requested(&mut self, id: BlockId, requested: u64) {
        let b = &mut self.blocks[id.0];
        assert_eq!(b.state, BlockState::Allocated, "set_requested of a block not allocated");
        assert!(requested <= b.size, "set_requested beyond the block");
        let old = std::mem::replace(&mut b.requested, requested);
        let key = self.segments[b.segment.0].key;
        let q = Self::quadrant(key.kind, key.residency);
        self.live(q, Live::RequestedBytes, old, false);
        self.live(q, Live::RequestedBytes, requested, true);
    }

    /// Notes that slot `slot`'s free bytes changed, for the readers that took its last change
    /// (out of line: where both have it noted already, the callers' one compare of
    /// [`Keyed::dirty`] with both bits is all, the common case).
    #[inline(never)]
    fn mark_dirty(&mut self, slot: usize) {
        let k = &mut self.free[slot];
        let was = std::mem::replace(&mut k.dirty, PUBLISH | TRIM);
        if was & PUBLISH == 0 {
            self.dirty.push(slot);
        }
        if was & TRIM == 0 {
            self.trim_dirty.push(slot);
        }
    }

    #[inline(always)]
    fn index_insert(&mut self, slot: usize, e: Entry) {
        let k = &mut self.free[slot];
        k.index.insert(e);
        if k.dirty != PUBLISH | TRIM {
            self.mark_dirty(slot);
        }
    }

    /// [`FreeIndex::replace`] in slot `slot`; whether `old` was there.
    #[inline]
    fn index_replace(&mut self, slot: usize, old: &Entry, new: Entry) -> bool {
        let k = &mut self.free[slot];
        if !k.index.replace(old, new) {
            return false;
        }
        if k.dirty != PUBLISH | TRIM {
            self.mark_dirty(slot);
        }
        true
    }

    #[inline(always)]
    fn index_remove(&mut self, slot: usize, e: &Entry) -> bool {
        let k = &mut self.free[slot];
        if !k.index.remove(e) {
            return false;
        }
        if k.dirty != PUBLISH | TRIM {
            self.mark_dirty(slot);
        }
        true
    }

    /// The largest cached free block, in bytes.
    pub fn largest_free_block(&self) -> u64 {
        self.free.iter().filter_map(|k| k.index.largest()).map(|e| e.size).max().unwrap_or(0)
    }

    /// Bytes of free blocks whose key satisfies `pred`.
    pub fn free_bytes_where(&self, mut pred: impl FnMut(&PoolKey) -> bool) -> u64 {
        self.free.iter().filter(|k| pred(&k.key)).map(|k| k.index.bytes()).sum()
    }
}

#[cfg(test)]
mod tests;
