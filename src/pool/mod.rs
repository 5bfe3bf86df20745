//! Single-threaded block bookkeeping over address ranges: segments, blocks, best fit, split,
//! coalesce. No device calls, no locks, no threads: a pure data structure, tested on a fake
//! address space.
//!
//! ```text
//!  blocks:   Slab<Block>      segment = address-ordered doubly linked list of blocks
//!  segments: Slab<Segment>
//!  free:     BTreeSet<(PoolKey, size, addr, BlockId)>   best fit = first entry ≥ (key, size)
//!
//!  seg 0x1000_0000 [alloc 512][free 1536][alloc 1024][free 2 MiB - 3 KiB]
//! ```
//!
//! A freed block merges at once with free neighbours of its segment. Pending blocks (waiting on
//! events) are neither free nor merged. [`BlockStats`] are kept exact after every operation, and
//! [`Pool::check_invariants`] recomputes them from scratch to prove it.

mod block;
mod pages;
mod sizing;

pub use block::{Block, BlockId, BlockState, PoolKey, Segment, SegmentId};
pub use sizing::{MIB, Sizing};

use crate::types::{BlockStats, StreamId};
use slab::Slab;
use std::collections::{BTreeMap, BTreeSet};

type FreeEntry = (PoolKey, u64, u64, usize);

/// Segments and blocks of every pool of one device. See the module docs.
#[derive(Default)]
pub struct Pool {
    blocks: Slab<Block>,
    segments: Slab<Segment>,
    free: BTreeSet<FreeEntry>,
    stats: BlockStats,
    /// Bytes in the free index per stream (streams with none omitted), kept with the index; a
    /// short vector sorted by stream (a handful of streams).
    free_by_stream: Vec<(StreamId, u64)>,
    /// Streams whose free bytes changed since the last [`Pool::take_dirty_streams`] (each once,
    /// so it is bounded by the number of streams).
    dirty: Vec<StreamId>,
}

impl Pool {
    /// An empty pool.
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn new() -> Pool {
        Pool::default()
    }

    /// The exact block statistics.
    pub fn stats(&self) -> &BlockStats {
        &self.stats
    }

    /// Resets every peak statistic to its current value.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    /// The block record of `id`. Panics on an id that is not a live block (a caller bug).
    pub fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id.0]
    }

    /// The segment record of `id`.
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
        self.free.len()
    }

    /// The best-fit free block of `key` for a rounded request: the smallest block ≥ `rounded`
    /// (lowest address among equals), unless the size rules forbid spending it on this request.
    pub fn find_free(&self, key: PoolKey, rounded: u64, sizing: &Sizing) -> Option<BlockId> {
        let &(k, size, _, id) = self.free.range((key, rounded, 0, 0)..).next()?;
        (k == key && sizing.may_serve(size, rounded)).then_some(BlockId(id))
    }

    /// Free blocks of `key` in (size, address) order.
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn free_of(&self, key: PoolKey) -> impl Iterator<Item = BlockId> + '_ {
        self.free.range((key, 0, 0, 0)..).take_while(move |e| e.0 == key).map(|e| BlockId(e.3))
    }

    /// Adds a segment of `size` bytes at `base` for `key`, as one free block; returns that block.
    pub fn add_segment(&mut self, key: PoolKey, base: u64, size: u64) -> BlockId {
        let seg = SegmentId(self.segments.vacant_key());
        let block = BlockId(self.blocks.insert(Block {
            segment: seg,
            addr: base,
            size,
            requested: 0,
            prev: None,
            next: None,
            state: BlockState::Free,
        }));
        self.segments.insert(Segment { base, size, key, first: block, busy_blocks: 0 });
        self.index_insert((key, size, base, block.0));
        self.stats.reserved_bytes.increase(key.kind, key.residency, size);
        self.stats.segment.increase(key.kind, key.residency, 1);
        block
    }

    /// Hands out the free block `id` for a request of `requested` bytes rounded to `rounded`,
    /// splitting off the remainder when `sizing` says so. Returns the allocated block (at the
    /// same address as `id`).
    pub fn allocate(
        &mut self,
        id: BlockId,
        rounded: u64,
        requested: u64,
        sizing: &Sizing,
    ) -> BlockId {
        let b = &self.blocks[id.0];
        assert_eq!(b.state, BlockState::Free, "allocate of a block that is not free");
        assert!(b.size >= rounded, "allocate of a block smaller than the request");
        let seg = b.segment;
        let key = self.segments[seg.0].key;
        let (kind, res) = (key.kind, key.residency);
        let (size0, addr0) = (b.size, b.addr);
        self.index_remove(&(key, size0, addr0, id.0));
        let b = &self.blocks[id.0];
        if b.is_split() {
            self.stats.inactive_split_bytes.decrease(kind, res, b.size);
            self.stats.inactive_split.decrease(kind, res, 1);
        }
        if sizing.should_split(kind, b.size, rounded) {
            let rest = Block {
                segment: seg,
                addr: b.addr + rounded,
                size: b.size - rounded,
                requested: 0,
                prev: Some(id),
                next: b.next,
                state: BlockState::Free,
            };
            let (rest_addr, rest_size, old_next) = (rest.addr, rest.size, rest.next);
            let rest_id = self.blocks.insert(rest);
            if let Some(n) = old_next {
                self.blocks[n.0].prev = Some(BlockId(rest_id));
            }
            let b = &mut self.blocks[id.0];
            b.next = Some(BlockId(rest_id));
            b.size = rounded;
            self.index_insert((key, rest_size, rest_addr, rest_id));
            self.stats.inactive_split_bytes.increase(kind, res, rest_size);
            self.stats.inactive_split.increase(kind, res, 1);
        }
        let b = &mut self.blocks[id.0];
        b.state = BlockState::Allocated;
        b.requested = requested;
        let size = b.size;
        self.segments[seg.0].busy_blocks += 1;
        let st = &mut self.stats;
        st.allocated_bytes.increase(kind, res, size);
        st.allocation.increase(kind, res, 1);
        st.active_bytes.increase(kind, res, size);
        st.active.increase(kind, res, 1);
        st.requested_bytes.increase(kind, res, requested);
        id
    }

    /// Marks an allocated block as freed by its user but waiting on events: it stops counting as
    /// allocated, stays active, and is neither reusable nor merged until [`Pool::free`].
    pub fn mark_pending(&mut self, id: BlockId) {
        let b = &mut self.blocks[id.0];
        assert_eq!(b.state, BlockState::Allocated, "mark_pending of a block that is not allocated");
        b.state = BlockState::Pending;
        let (size, key) = (b.size, self.segments[b.segment.0].key);
        self.stats.allocated_bytes.decrease(key.kind, key.residency, size);
        self.stats.allocation.decrease(key.kind, key.residency, 1);
    }

    /// Returns an allocated or pending block to the free index, merging it with free neighbours.
    /// Returns the id of the resulting free block.
    pub fn free(&mut self, id: BlockId) -> BlockId {
        let b = &mut self.blocks[id.0];
        let was = b.state;
        assert_ne!(was, BlockState::Free, "double free of a block");
        b.state = BlockState::Free;
        let (size, requested, seg) = (b.size, b.requested, b.segment);
        b.requested = 0;
        let key = self.segments[seg.0].key;
        let (kind, res) = (key.kind, key.residency);
        self.segments[seg.0].busy_blocks -= 1;
        let st = &mut self.stats;
        if was == BlockState::Allocated {
            st.allocated_bytes.decrease(kind, res, size);
            st.allocation.decrease(kind, res, 1);
        }
        st.active_bytes.decrease(kind, res, size);
        st.active.decrease(kind, res, 1);
        st.requested_bytes.decrease(kind, res, requested);

        let mut merged = id;
        if let Some(p) =
            self.blocks[id.0].prev.filter(|p| self.blocks[p.0].state == BlockState::Free)
        {
            self.absorb(p, merged, key);
            merged = p;
        }
        if let Some(n) =
            self.blocks[merged.0].next.filter(|n| self.blocks[n.0].state == BlockState::Free)
        {
            self.absorb(merged, n, key);
        }
        let m = &self.blocks[merged.0];
        let entry = (key, m.size, m.addr, merged.0);
        self.index_insert(entry);
        let m = &self.blocks[merged.0];
        if m.is_split() {
            let size = m.size;
            self.stats.inactive_split_bytes.increase(kind, res, size);
            self.stats.inactive_split.increase(kind, res, 1);
        }
        merged
    }

    /// Merges block `right` into its left neighbour `left`; whichever of them was in the free index
    /// (as an inactive split) leaves it.
    fn absorb(&mut self, left: BlockId, right: BlockId, key: PoolKey) {
        for id in [left, right] {
            let b = &self.blocks[id.0];
            let size = b.size;
            if self.index_remove(&(key, size, b.addr, id.0)) {
                // A free neighbour of another block is always part of a split segment.
                self.stats.inactive_split_bytes.decrease(key.kind, key.residency, size);
                self.stats.inactive_split.decrease(key.kind, key.residency, 1);
            }
        }
        let r = self.blocks.remove(right.0);
        if let Some(n) = r.next {
            self.blocks[n.0].prev = Some(left);
        }
        let l = &mut self.blocks[left.0];
        l.size += r.size;
        l.next = r.next;
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
        let entry = (seg.key, b.size, b.addr, seg.first.0);
        self.index_remove(&entry);
        self.blocks.remove(entry.3);
        let seg = self.segments.remove(id.0);
        self.stats.reserved_bytes.decrease(seg.key.kind, seg.key.residency, seg.size);
        self.stats.segment.decrease(seg.key.kind, seg.key.residency, 1);
        (seg.base, seg.size)
    }

    /// Moves a segment with no busy block to another stream's free lists.
    pub fn rekey_segment(&mut self, id: SegmentId, stream: crate::device::StreamId) {
        let seg = &self.segments[id.0];
        assert_eq!(seg.busy_blocks, 0, "rekey_segment of a segment in use");
        let b = &self.blocks[seg.first.0];
        let old = (seg.key, b.size, b.addr, seg.first.0);
        self.index_remove(&old);
        let seg = &mut self.segments[id.0];
        seg.key.stream = stream;
        let key = seg.key;
        self.index_insert((key, old.1, old.2, old.3));
    }

    /// Bytes of free blocks cached per stream (streams with none omitted).
    pub fn free_bytes_by_stream(&self) -> BTreeMap<StreamId, u64> {
        self.free_by_stream.iter().copied().collect()
    }

    /// Bytes of free blocks cached for `stream`.
    pub fn free_bytes_of(&self, stream: StreamId) -> u64 {
        self.free_by_stream.iter().find(|e| e.0 == stream).map_or(0, |e| e.1)
    }

    /// Streams whose free bytes changed since the last call (each once), for publishing.
    pub fn take_dirty_streams(&mut self, out: &mut Vec<StreamId>) {
        out.clear();
        std::mem::swap(out, &mut self.dirty);
    }

    /// Records the new request of an allocated block handed to another user unchanged (the
    /// allocator's stream caches reuse blocks without splitting).
    pub fn set_requested(&mut self, id: BlockId, requested: u64) {
        let b = &mut self.blocks[id.0];
        assert_eq!(b.state, BlockState::Allocated, "set_requested of a block not allocated");
        assert!(requested <= b.size, "set_requested beyond the block");
        let old = std::mem::replace(&mut b.requested, requested);
        let key = self.segments[b.segment.0].key;
        self.stats.requested_bytes.decrease(key.kind, key.residency, old);
        self.stats.requested_bytes.increase(key.kind, key.residency, requested);
    }

    fn index_insert(&mut self, e: FreeEntry) {
        let s = e.0.stream;
        match self.free_by_stream.binary_search_by_key(&s, |x| x.0) {
            Ok(i) => self.free_by_stream[i].1 += e.1,
            Err(i) => self.free_by_stream.insert(i, (s, e.1)),
        }
        self.note_dirty(s);
        self.free.insert(e);
    }

    fn index_remove(&mut self, e: &FreeEntry) -> bool {
        if !self.free.remove(e) {
            return false;
        }
        let s = e.0.stream;
        let i = self.free_by_stream.binary_search_by_key(&s, |x| x.0).expect("indexed stream");
        self.free_by_stream[i].1 -= e.1;
        if self.free_by_stream[i].1 == 0 {
            self.free_by_stream.remove(i);
        }
        self.note_dirty(s);
        true
    }

    fn note_dirty(&mut self, s: StreamId) {
        if !self.dirty.contains(&s) {
            self.dirty.push(s);
        }
    }

    /// The largest cached free block, in bytes.
    pub fn largest_free_block(&self) -> u64 {
        self.free.iter().map(|e| e.1).max().unwrap_or(0)
    }

    /// Bytes of free blocks whose key satisfies `pred`.
    pub fn free_bytes_where(&self, mut pred: impl FnMut(&PoolKey) -> bool) -> u64 {
        self.free.iter().filter(|e| pred(&e.0)).map(|e| e.1).sum()
    }

    /// Recomputes everything from scratch and compares: blocks tile each segment exactly, no two
    /// adjacent free blocks, segments do not overlap, the free index holds exactly the free blocks,
    /// and every current statistic equals its recomputed value.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut expect = BlockStats::default();
        let mut free_seen = 0usize;
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for (sid, seg) in self.segments.iter() {
            let (kind, res) = (seg.key.kind, seg.key.residency);
            ranges.push((seg.base, seg.size));
            expect.reserved_bytes.increase(kind, res, seg.size);
            expect.segment.increase(kind, res, 1);
            let mut addr = seg.base;
            let mut prev: Option<BlockId> = None;
            let mut prev_free = false;
            let mut busy = 0;
            let mut cur = Some(seg.first);
            let mut blocks_in_seg = 0;
            while let Some(id) = cur {
                let b = self
                    .blocks
                    .get(id.0)
                    .ok_or(format!("segment {sid}: dangling block {}", id.0))?;
                blocks_in_seg += 1;
                if blocks_in_seg > self.blocks.len() {
                    return Err(format!("segment {sid}: block list has a cycle"));
                }
                if b.segment.0 != sid || b.prev != prev || b.addr != addr || b.size == 0 {
                    return Err(format!(
                        "segment {sid}: block {} at {:#x} breaks the tiling",
                        id.0, b.addr
                    ));
                }
                let is_free = b.state == BlockState::Free;
                if is_free && prev_free {
                    return Err(format!("segment {sid}: adjacent free blocks at {:#x}", b.addr));
                }
                match b.state {
                    BlockState::Free => {
                        free_seen += 1;
                        if !self.free.contains(&(seg.key, b.size, b.addr, id.0)) {
                            return Err(format!(
                                "free block at {:#x} missing from the index",
                                b.addr
                            ));
                        }
                        if b.is_split() {
                            expect.inactive_split_bytes.increase(kind, res, b.size);
                            expect.inactive_split.increase(kind, res, 1);
                        }
                    }
                    BlockState::Allocated | BlockState::Pending => {
                        busy += 1;
                        if b.state == BlockState::Allocated {
                            expect.allocated_bytes.increase(kind, res, b.size);
                            expect.allocation.increase(kind, res, 1);
                        }
                        expect.active_bytes.increase(kind, res, b.size);
                        expect.active.increase(kind, res, 1);
                        expect.requested_bytes.increase(kind, res, b.requested);
                        if b.requested > b.size {
                            return Err(format!("block at {:#x} smaller than its request", b.addr));
                        }
                    }
                }
                prev_free = is_free;
                prev = Some(id);
                addr += b.size;
                cur = b.next;
            }
            if addr != seg.base + seg.size {
                return Err(format!(
                    "segment {sid}: blocks cover {:#x}..{addr:#x}, not its size",
                    seg.base
                ));
            }
            if busy != seg.busy_blocks {
                return Err(format!(
                    "segment {sid}: busy count {} but {busy} busy blocks",
                    seg.busy_blocks
                ));
            }
        }
        let mut by_stream: BTreeMap<StreamId, u64> = BTreeMap::new();
        for e in &self.free {
            *by_stream.entry(e.0.stream).or_insert(0) += e.1;
        }
        if by_stream != self.free_bytes_by_stream() {
            return Err("free bytes per stream drifted".into());
        }
        if free_seen != self.free.len() {
            return Err(format!(
                "free index has {} entries, {free_seen} free blocks exist",
                self.free.len()
            ));
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!("segments at {:#x} and {:#x} overlap", w[0].0, w[1].0));
            }
        }
        let current = |s: &BlockStats| {
            [
                s.allocated_bytes,
                s.reserved_bytes,
                s.active_bytes,
                s.inactive_split_bytes,
                s.requested_bytes,
                s.allocation,
                s.segment,
                s.active,
                s.inactive_split,
            ]
            .map(|g| {
                [g.all, g.small_pool, g.large_pool, g.persistent, g.transient].map(|s| s.current)
            })
        };
        if current(&expect) != current(&self.stats) {
            return Err(format!(
                "stats drifted: kept {:?}, recomputed {:?}",
                current(&self.stats),
                current(&expect)
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
