//! [`Pool::check_invariants`]: every block, segment, free index entry and statistic recomputed
//! from scratch and compared with what the pool keeps.

use super::free_index::Entry;
use super::{BlockId, BlockState, DIRECT_STREAMS, NO_SLOT, PUBLISH, Pool, TRIM};
use crate::types::BlockStats;

impl Pool {
    /// Recomputes everything from scratch and compares: blocks tile each segment exactly, no two
    /// adjacent free blocks, segments do not overlap, the free index holds exactly the free blocks,
    /// and every current statistic equals its recomputed value.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut expect = BlockStats::default();
        let mut free_seen = 0usize;
        let mut oversize = 0u64;
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
                        let e = Entry { size: b.size, addr: b.addr, id: id.0 };
                        let k = &self.free[seg.slot];
                        if k.key != seg.key || !k.index.contains(&e) {
                            return Err(format!(
                                "free block at {:#x} missing from the index",
                                b.addr
                            ));
                        }
                        if b.is_split() && !seg.expandable {
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
                        oversize += u64::from(b.oversize);
                        if b.oversize && b.state != BlockState::Allocated {
                            return Err(format!("pending block at {:#x} still oversize", b.addr));
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
            if prev != Some(seg.last) {
                return Err(format!("segment {sid}: its last block is not the one recorded"));
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
        {
            use crate::types::{PoolKind, Residency};
            for kind in [PoolKind::Small, PoolKind::Large] {
                for res in [Residency::Persistent, Residency::Transient] {
                    expect.reserved_bytes.increase(kind, res, self.held[Self::quadrant(kind, res)]);
                }
            }
        }
        let mut segments = vec![0u32; self.free.len()];
        for (_, seg) in self.segments.iter() {
            segments[seg.slot] += 1;
            if self.free[seg.slot].key != seg.key || self.vacant.contains(&seg.slot) {
                return Err(format!("segment at {:#x} has the slot of another key", seg.base));
            }
        }
        for (s, k) in self.free.iter().enumerate() {
            k.index.check()?;
            let vacant = self.vacant.contains(&s);
            if k.segments != segments[s] || vacant != (k.segments == 0) {
                return Err(format!("free index {s}: {} segments counted", k.segments));
            }
            if vacant && (k.dirty != 0 || k.index.len() > 0) {
                return Err(format!("retired free index {s} is dirty or holds blocks"));
            }
        }
        let slots: Vec<_> = (self.free.iter().enumerate())
            .filter(|(s, _)| !self.vacant.contains(s))
            .map(|(s, k)| (k.key, s))
            .collect();
        if !self.keys.is_sorted_by(|a, b| a.0 < b.0) || {
            let mut sorted = slots;
            sorted.sort_unstable();
            sorted != self.keys
        } {
            return Err("free index keys drifted".into());
        }
        for (s, row) in self.direct.iter().enumerate() {
            for (q, &slot) in row.iter().enumerate() {
                let found = self.keys.iter().find(|(k, _)| {
                    k.stream.0 as usize == s && Self::quadrant(k.kind, k.residency) == q
                });
                if found.map_or(NO_SLOT, |&(_, i)| i as u32) != slot {
                    return Err(format!("direct slot of stream {s} quadrant {q} drifted"));
                }
            }
        }
        if let Some(&(k, _)) = self.keys.iter().find(|(k, _)| {
            (k.stream.0 as usize) < DIRECT_STREAMS && (k.stream.0 as usize) >= self.direct.len()
        }) {
            return Err(format!("key {k:?} missing from the direct slots"));
        }
        for (s, k) in self.free.iter().enumerate() {
            if (k.dirty & PUBLISH != 0) != self.dirty.contains(&s)
                || (k.dirty & TRIM != 0) != self.trim_dirty.contains(&s)
                || (k.whole && k.dirty & TRIM == 0)
            {
                return Err(format!("dirty flags of free index {s} drifted"));
            }
        }
        if free_seen != self.free_blocks() {
            return Err(format!(
                "free index has {} entries, {free_seen} free blocks exist",
                self.free_blocks()
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
        if oversize != self.oversize.current {
            return Err(format!(
                "oversize allocations drifted: kept {}, recounted {oversize}",
                self.oversize.current
            ));
        }
        let kept = self.stats();
        if current(&expect) != current(&kept) {
            return Err(format!(
                "stats drifted: kept {:?}, recomputed {:?}",
                current(&kept),
                current(&expect)
            ));
        }
        Ok(())
    }
}
