//! Segment surgery for expandable segments (virtual ranges whose pages are mapped on demand):
//! the pool keeps one segment per *run of mapped pages*, so a segment is always real memory and
//! every figure (reserved, free per stream, inactive splits) means what it means for ordinary
//! segments. Mapping pages extends or joins segments; unmapping pages cuts them. The pages
//! themselves (which are mapped, by which physical allocation) are the allocator's business.
//!
//! ```text
//!  range:   [seg A ···· free]  unmapped  [free ··· seg B]
//!  extend:  [seg A ···· free ++ new pages ++ free ··· seg B]    (A and B joined: one segment)
//!  carve:   [seg A ·· free]    unmapped      [free ·· seg A']   (a free block's whole pages cut)
//! ```
//!
//! A segment of a range never touches another one: two mapped pages that are neighbours are in
//! the same segment. Free blocks still merge only within a segment.

use super::free_index::Entry;
use super::{Block, BlockId, BlockState, Pool, PoolKey, Segment, SegmentId};
impl Pool {
    /// The block at the end of a segment (recorded: no walk).
    #[inline]
    pub fn last_block(&self, id: SegmentId) -> BlockId {
        self.segments[id.0].last
    }

    /// Streams whose free bytes changed since the last [`Pool::take_dirty_streams`] (each once).
    pub fn dirty_streams(&self) -> Vec<crate::types::StreamId> {
        let mut out: Vec<_> = self.dirty.iter().map(|&slot| self.free[slot].key.stream).collect();
        out.extend_from_slice(&self.dirty_gone);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Bytes carved out of `key`'s segments ([`Pool::carve`]) that the device still holds
    /// (pages waiting to be unmapped once their stream's work completes): `reserved_bytes`
    /// keeps counting them until [`Pool::unhold`].
    pub fn hold(&mut self, key: PoolKey, bytes: u64) {
        let q = Self::quadrant(key.kind, key.residency);
        self.held[q] += bytes;
        self.stats.reserved_bytes.increase(key.kind, key.residency, bytes);
        self.changed |= 1 << q;
    }

    /// Held bytes of `key` ([`Pool::hold`]) gone from the device.
    pub fn unhold(&mut self, key: PoolKey, bytes: u64) {
        let q = Self::quadrant(key.kind, key.residency);
        self.held[q] = self.held[q].checked_sub(bytes).expect("unhold of bytes not held");
        self.stats.reserved_bytes.decrease(key.kind, key.residency, bytes);
        self.changed |= 1 << q;
    }

    /// A free block leaves the index (and the inactive-split figures, if it is split).
    fn unlist(&mut self, id: BlockId, key: PoolKey) {
        let b = &self.blocks[id.0];
        let (size, addr, split, seg) = (b.size, b.addr, b.is_split(), b.segment);
        let slot = self.slot_of(key).expect("a listed block's key has an index");
        let removed = self.index_remove(slot, &Entry { size, addr, id: id.0 });
        debug_assert!(removed, "unlist of a block not in the free index");
        if split {
            self.count_split(seg, size, false);
        }
    }

    /// A free block enters the index (and the inactive-split figures, if it is split).
    fn relist(&mut self, id: BlockId, key: PoolKey) {
        let b = &self.blocks[id.0];
        let (size, addr, split, seg) = (b.size, b.addr, b.is_split(), b.segment);
        let slot = match self.slot_of(key) {
            Some(slot) => slot,
            None => self.slot_for(key),
        };
        self.index_insert(slot, Entry { size, addr, id: id.0 });
        if split {
            self.count_split(seg, size, true);
        }
    }

    /// Points every block from `first` on at segment `seg`; returns how many of them are busy.
    fn relabel(&mut self, first: Option<BlockId>, seg: SegmentId) -> usize {
        let (mut cur, mut busy) = (first, 0);
        while let Some(id) = cur {
            let b = &mut self.blocks[id.0];
            b.segment = seg;
            busy += usize::from(b.state != BlockState::Free);
            cur = b.next;
        }
        busy
    }

    /// Newly mapped memory `[addr, addr + bytes)` of `key`: joined to `left` (a segment of `key`
    /// ending at `addr`) and to `right` (one starting at `addr + bytes`), or a segment of its
    /// own. The free block at the end of `left` (the start of `right`) is extended, as PyTorch's
    /// expandable segments do.
    /// Returns the segment and the free block holding the new bytes.
    pub fn extend(
        &mut self,
        key: PoolKey,
        addr: u64,
        bytes: u64,
        left: Option<SegmentId>,
        right: Option<SegmentId>,
    ) -> (SegmentId, BlockId) {
        assert!(bytes > 0, "extend by nothing");
        let (kind, res) = (key.kind, key.residency);
        let Some(l) = left else {
            let Some(r) = right else {
                let b = self.add_segment(key, addr, bytes);
                let seg = self.blocks[b.0].segment;
                self.segments[seg.0].expandable = true;
                return (seg, b);
            };
            let seg = &self.segments[r.0];
            assert!(seg.key == key && seg.base == addr + bytes, "extend: right does not touch");
            let first = seg.first;
            let blk = if self.blocks[first.0].state == BlockState::Free {
                self.unlist(first, key);
                let b = &mut self.blocks[first.0];
                b.addr = addr;
                b.size += bytes;
                first
            } else {
                let nb = BlockId(self.blocks.insert(Block {
                    segment: r,
                    addr,
                    size: bytes,
                    requested: 0,
                    prev: None,
                    next: Some(first),
                    state: BlockState::Free,
                    oversize: false,
                }));
                self.blocks[first.0].prev = Some(nb);
                self.segments[r.0].first = nb;
                nb
            };
            let seg = &mut self.segments[r.0];
            seg.base = addr;
            seg.size += bytes;
            self.stats.reserved_bytes.increase(kind, res, bytes);
            self.changed |= 1 << Self::quadrant(kind, res);
            self.relist(blk, key);
            return (r, blk);
        };
        let seg = &self.segments[l.0];
        assert!(seg.key == key && seg.base + seg.size == addr, "extend: left does not touch");
        let last = self.segments[l.0].last;
        let blk = if self.blocks[last.0].state == BlockState::Free {
            self.unlist(last, key);
            self.blocks[last.0].size += bytes;
            last
        } else {
            let nb = BlockId(self.blocks.insert(Block {
                segment: l,
                addr,
                size: bytes,
                requested: 0,
                prev: Some(last),
                next: None,
                state: BlockState::Free,
                oversize: false,
            }));
            self.blocks[last.0].next = Some(nb);
            self.segments[l.0].last = nb;
            nb
        };
        self.segments[l.0].size += bytes;
        self.stats.reserved_bytes.increase(kind, res, bytes);
        self.changed |= 1 << Self::quadrant(kind, res);
        if let Some(r) = right {
            let rs = &self.segments[r.0];
            assert!(rs.key == key && rs.base == addr + bytes && r != l, "extend: right");
            let (rfirst, rlast, rsize, rbusy) = (rs.first, rs.last, rs.size, rs.busy_blocks);
            self.relabel(Some(rfirst), l);
            self.blocks[blk.0].next = Some(rfirst);
            self.blocks[rfirst.0].prev = Some(blk);
            if self.blocks[rfirst.0].state == BlockState::Free {
                // Both sides of the join are free: one block.
                self.blocks[rfirst.0].prev = None;
                self.blocks[blk.0].next = None;
                self.unlist(rfirst, key);
                let rb = self.blocks.remove(rfirst.0);
                if let Some(n) = rb.next {
                    self.blocks[n.0].prev = Some(blk);
                }
                let b = &mut self.blocks[blk.0];
                b.size += rb.size;
                b.next = rb.next;
            }
            let seg = &mut self.segments[l.0];
            seg.size += rsize;
            seg.busy_blocks += rbusy;
            // The joined run ends where the right one did (at `blk` where its only block merged).
            seg.last = if self.blocks[blk.0].next.is_none() { blk } else { rlast };
            let gone = self.segments.remove(r.0);
            self.segment_gone(gone.slot);
            self.stats.segment.decrease(kind, res, 1);
            self.changed |= 1 << Self::quadrant(kind, res);
        }
        self.relist(blk, key);
        (l, blk)
    }

    /// Unmapped memory: takes `[lo, hi)`, which lies in the free block `id`, out of its segment.
    /// What is left of the segment below `lo` keeps the segment (or is nothing); what is left
    /// above `hi` becomes a segment of its own (or keeps the segment, when nothing is below).
    /// Returns the segments left below and above.
    pub fn carve(
        &mut self,
        id: BlockId,
        lo: u64,
        hi: u64,
    ) -> (Option<SegmentId>, Option<SegmentId>) {
        let b = &self.blocks[id.0];
        assert_eq!(b.state, BlockState::Free, "carve of a block that is not free");
        let (x, y, seg, prev, next) = (b.addr, b.addr + b.size, b.segment, b.prev, b.next);
        assert!(x <= lo && lo < hi && hi <= y, "carve outside its block");
        let (key, old_last) = (self.segments[seg.0].key, self.segments[seg.0].last);
        let (sb, se) =
            (self.segments[seg.0].base, self.segments[seg.0].base + self.segments[seg.0].size);
        self.unlist(id, key);
        // What stays below: the block's own start, or the blocks before it.
        let left_last = if lo > x {
            let b = &mut self.blocks[id.0];
            b.size = lo - x;
            b.next = None;
            Some(id)
        } else {
            self.blocks.remove(id.0);
            if let Some(p) = prev {
                self.blocks[p.0].next = None;
            }
            prev
        };
        // What stays above: the block's own end, or the blocks after it.
        let right_first = if hi < y {
            let rb = BlockId(self.blocks.insert(Block {
                segment: seg,
                addr: hi,
                size: y - hi,
                requested: 0,
                prev: None,
                next,
                state: BlockState::Free,
                oversize: false,
            }));
            if let Some(n) = next {
                self.blocks[n.0].prev = Some(rb);
            }
            Some(rb)
        } else {
            if let Some(n) = next {
                self.blocks[n.0].prev = None;
            }
            next
        };
        // The last block above the cut: the segment's, or the new end piece where `id` was last.
        let upper_last = if old_last == id { right_first } else { Some(old_last) };
        let (kind, res) = (key.kind, key.residency);
        self.stats.reserved_bytes.decrease(kind, res, hi - lo);
        self.changed |= 1 << Self::quadrant(kind, res);
        let below = left_last.map(|_| seg);
        let above = match (left_last, right_first) {
            (Some(_), Some(first)) => {
                let upper = SegmentId(self.segments.vacant_key());
                let busy = self.relabel(Some(first), upper);
                let slot = self.segments[seg.0].slot;
                self.free[slot].segments += 1;
                self.segments.insert(Segment {
                    base: hi,
                    size: se - hi,
                    key,
                    first,
                    last: upper_last.expect("a block above"),
                    busy_blocks: busy,
                    slot,
                    last_use: self.segments[seg.0].last_use,
                    expandable: self.segments[seg.0].expandable,
                });
                let s = &mut self.segments[seg.0];
                s.size = lo - sb;
                s.last = left_last.expect("a block below");
                s.busy_blocks -= busy;
                self.stats.segment.increase(kind, res, 1);
                self.changed |= 1 << Self::quadrant(kind, res);
                Some(upper)
            }
            (Some(below_last), None) => {
                let s = &mut self.segments[seg.0];
                s.size = lo - sb;
                s.last = below_last;
                None
            }
            (None, Some(first)) => {
                let s = &mut self.segments[seg.0];
                s.base = hi;
                s.size = se - hi;
                s.first = first;
                s.last = upper_last.expect("a block above");
                Some(seg)
            }
            (None, None) => {
                let s = self.segments.remove(seg.0);
                debug_assert_eq!(s.busy_blocks, 0);
                // (Wholly carved: nothing of it is relisted below.)
                self.segment_gone(s.slot);
                self.stats.segment.decrease(kind, res, 1);
                self.changed |= 1 << Self::quadrant(kind, res);
                None
            }
        };
        if lo > x {
            self.relist(id, key);
        }
        if hi < y {
            let rb = right_first.expect("made above");
            self.relist(rb, key);
        }
        (below, above)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{MIB, Sizing};
    use super::*;
    use crate::types::{PoolKind, Residency, StreamId};

    const BASE: u64 = 0x2_0000_0000;
    const P: u64 = 2 * MIB;

    fn key() -> PoolKey {
        PoolKey { residency: Residency::Transient, stream: StreamId(0), kind: PoolKind::Large }
    }

    fn layout(pool: &Pool) -> Vec<Vec<(u64, u64, BlockState)>> {
        let mut segs: Vec<_> = pool.segments().map(|(id, s)| (s.base, id)).collect();
        segs.sort_unstable();
        segs.iter()
            .map(|&(_, id)| {
                pool.segment_blocks(id).map(|(_, b)| (b.addr - BASE, b.size, b.state)).collect()
            })
            .collect()
    }

    use BlockState::{Allocated as A, Free as F};

    #[test]
    fn extend_grows_the_free_end_block_and_joins_segments() {
        let (mut pool, s) = (Pool::new(), Sizing::default());
        let (seg, b) = pool.extend(key(), BASE, P, None, None);
        let a = pool.allocate(b, MIB + MIB / 2, MIB + MIB / 2, &s);
        assert_eq!(pool.block(a).addr, BASE);
        // The 512 KiB tail is not split off (large pool: the rest must exceed 1 MiB): one block.
        assert_eq!(layout(&pool), vec![vec![(0, P, A)]]);
        // Growing after a busy end block adds a free block.
        let (seg2, blk) = pool.extend(key(), BASE + P, P, Some(seg), None);
        assert_eq!((seg2, pool.block(blk).addr, pool.block(blk).size), (seg, BASE + P, P));
        pool.check_invariants().unwrap();
        // A separate segment three pages up, then the gap mapped: all one segment.
        let (far, _) = pool.extend(key(), BASE + 3 * P, P, None, None);
        assert_eq!(pool.stats().segment.all.current, 2);
        let (joined, blk) = pool.extend(key(), BASE + 2 * P, P, Some(seg), Some(far));
        assert_eq!(joined, seg);
        assert_eq!(layout(&pool), vec![vec![(0, P, A), (P, 3 * P, F)]]);
        assert_eq!(pool.block(blk).size, 3 * P);
        let st = pool.stats();
        assert_eq!(st.segment.all.current, 1);
        assert_eq!(st.reserved_bytes.all.current, 4 * P);
        // A run's free blocks are in no inactive-split figure (as PyTorch's expandable segments).
        assert_eq!(st.inactive_split_bytes.all.current, 0);
        assert_eq!(pool.free_bytes_of(StreamId(0)), 3 * P);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn extend_downwards_into_a_busy_first_block() {
        let (mut pool, s) = (Pool::new(), Sizing::default());
        let (seg, b) = pool.extend(key(), BASE + P, P, None, None);
        pool.allocate(b, P, P, &s);
        let (seg2, blk) = pool.extend(key(), BASE, P, None, Some(seg));
        assert_eq!(seg2, seg);
        assert_eq!(pool.segment(seg).base, BASE);
        assert_eq!(pool.block(blk).addr, BASE);
        assert_eq!(layout(&pool), vec![vec![(0, P, F), (P, P, A)]]);
        // And a free first block just grows down.
        let (_, blk2) = pool.extend(key(), BASE - P, P, None, Some(seg));
        assert_eq!(blk2, blk);
        assert_eq!(pool.block(blk).addr, BASE - P);
        assert_eq!(pool.block(blk).size, 2 * P);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn carve_splits_a_segment_around_whole_free_pages() {
        let (mut pool, s) = (Pool::new(), Sizing::default());
        let (seg, b) = pool.extend(key(), BASE, 5 * P, None, None);
        let a = pool.allocate(b, MIB, MIB, &s);
        let rest = pool.segment_blocks(seg).nth(1).unwrap().0;
        let c = pool.allocate(rest, 2 * P, 2 * P, &s); // [1 MiB, 1 MiB + 4 MiB)
        let d = pool.segment_blocks(seg).nth(2).unwrap().0; // free from 5 MiB
        let e = pool.allocate(d, MIB, MIB, &s); // [5, 6) MiB; free [6, 10) MiB
        pool.free(c); // free [1, 5) MiB: pages 1 and 2 (2..4, 4..6 MiB)? only [2, 4) MiB whole
        assert_eq!(
            layout(&pool),
            vec![vec![(0, MIB, A), (MIB, 4 * MIB, F), (5 * MIB, MIB, A), (6 * MIB, 4 * MIB, F)]]
        );
        let free = pool.segment_blocks(seg).nth(1).unwrap().0;
        let (below, above) = pool.carve(free, BASE + P, BASE + 2 * P);
        assert_eq!(below, Some(seg));
        let above = above.unwrap();
        assert_ne!(above, seg);
        assert_eq!(
            layout(&pool),
            vec![
                vec![(0, MIB, A), (MIB, MIB, F)],
                vec![(2 * P, MIB, F), (5 * MIB, MIB, A), (6 * MIB, 4 * MIB, F)]
            ]
        );
        assert_eq!(pool.segment(above).busy_blocks, 1);
        assert_eq!(pool.segment(seg).busy_blocks, 1);
        assert_eq!(pool.stats().reserved_bytes.all.current, 4 * P);
        pool.check_invariants().unwrap();
        // The free end block's whole pages: the segment just shrinks.
        let tail = pool.last_block(above);
        assert_eq!(pool.carve(tail, BASE + 3 * P, BASE + 5 * P), (Some(above), None));
        assert_eq!(layout(&pool)[1], vec![(2 * P, MIB, F), (5 * MIB, MIB, A)]);
        pool.check_invariants().unwrap();
        // Freed entirely, the upper segment is one free block: carving it all removes it.
        pool.free(e);
        let only = pool.segment(above).first;
        assert_eq!(pool.carve(only, BASE + 2 * P, BASE + 3 * P), (None, None));
        pool.free(a);
        let only = pool.segment(seg).first;
        assert_eq!(pool.carve(only, BASE, BASE + P), (None, None));
        assert_eq!(pool.segments().count(), 0);
        assert_eq!(pool.stats().reserved_bytes.all.current, 0);
        assert_eq!(pool.stats().segment.all.current, 0);
        assert_eq!(pool.free_blocks(), 0);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn carve_at_the_start_keeps_the_segment_for_the_rest() {
        let (mut pool, s) = (Pool::new(), Sizing::default());
        let (seg, b) = pool.extend(key(), BASE, 3 * P, None, None);
        let a = pool.allocate(b, 2 * P, 2 * P, &s);
        pool.free(a);
        let b = pool.segment(seg).first;
        let a = pool.allocate(b, P, P, &s);
        let mid = pool.segment_blocks(seg).nth(1).unwrap().0;
        let m = pool.allocate(mid, P, P, &s);
        pool.free(a);
        let first = pool.segment(seg).first;
        assert_eq!(pool.carve(first, BASE, BASE + P), (None, Some(seg)));
        assert_eq!(pool.segment(seg).base, BASE + P);
        assert_eq!(layout(&pool), vec![vec![(P, P, A), (2 * P, P, F)]]);
        assert_eq!(pool.stats().inactive_split_bytes.all.current, 0, "a run's free block");
        assert_eq!(pool.segment(seg).size, 2 * P);
        pool.check_invariants().unwrap();
        pool.free(m);
        pool.check_invariants().unwrap();
    }
}
