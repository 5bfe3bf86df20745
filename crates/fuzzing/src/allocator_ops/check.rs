//! The checks after every step: the allocator's invariants and statistics against the model,
//! its segments against the device's, every live buffer's block and placement.

use super::{FAST_SLOTS, Harness, Live, cells, mapped, stat_groups};
use std::collections::HashSet;
use tidepool::device::{DeviceAddr, StreamId};
use tidepool::{AllocError, BlockState, PoolKind, Residency, SegmentInfo};

impl Harness<'_> {
    /// After a release: no segment selected by `which` (expandable runs included) is left with
    /// only free blocks.
    pub(super) fn nothing_releasable(
        &self,
        which: impl Fn(&SegmentInfo) -> bool,
        what: &str,
    ) -> Result<(), String> {
        let kept = self.initial[0].map(|(a, _)| a);
        for seg in self.alloc.snapshot().iter().filter(|s| which(s) && Some(s.address) != kept) {
            ensure!(
                seg.blocks.iter().any(|b| b.state != BlockState::Free),
                "{what} left the free segment at {} ({} bytes, {}) cached",
                seg.address,
                seg.size,
                seg.stream
            );
        }
        Ok(())
    }

    pub(super) fn inspect(&self, summary: bool) -> Result<(), String> {
        if summary {
            ensure!(!self.alloc.memory_summary().is_empty(), "empty memory_summary");
        }
        let f = self.alloc.stats().fragmentation();
        ensure!((0.0..=1.0).contains(&f), "fragmentation {f} outside [0, 1]");
        self.alloc.reset_peak_stats();
        let b = self.alloc.stats().blocks;
        for g in stat_groups(&b) {
            for s in cells(g) {
                ensure!(s.peak == s.current, "reset_peak_stats left peak {} > current", s.peak);
            }
        }
        Ok(())
    }

    /// Everything that must hold between any two steps.
    pub(super) fn check(&self) -> Result<(), String> {
        self.alloc.check_invariants()?;
        // A gone stream whose fast-path slot (`id % 64`) now serves a live stream of the
        // program: a request on it is refused, not served from the newer stream's lane.
        for &g in &self.gone {
            if self.slots.iter().flatten().any(|s| s.0 % FAST_SLOTS == g.0 % FAST_SLOTS) {
                let r = self.alloc.alloc(4096, g);
                ensure!(
                    matches!(r, Err(AllocError::UnknownStream(x)) if x == g),
                    "a request on {g}, which is gone, got {r:?}"
                );
            }
        }
        self.other.check_invariants().map_err(|e| format!("second allocator: {e}"))?;
        let snap = self.alloc.snapshot();
        let other_snap = self.other.snapshot();
        let device_segs = self.dev.live_segments();
        let ranges = self.dev.live_virtual_ranges();
        let in_range = |a: DeviceAddr| ranges.iter().any(|&(b, n)| b <= a && a.0 < b.0 + n);
        let mut alloc_segs: Vec<(DeviceAddr, u64)> = snap
            .iter()
            .chain(&other_snap)
            .filter(|s| !in_range(s.address))
            .map(|s| (s.address, s.size))
            .collect();
        alloc_segs.sort_unstable();
        // A segment in a virtual range is a run of pages the device maps (no view lists pages
        // its own lock section unmaps: `view_unsettled`).
        let maps = self.dev.live_mappings();
        for s in snap.iter().chain(&other_snap).filter(|s| in_range(s.address)) {
            ensure!(
                mapped(&maps, s.address.0, s.address.0 + s.size),
                "segment at {} ({} bytes, {}) of an expandable range is not wholly mapped",
                s.address,
                s.size,
                s.stream
            );
        }
        ensure!(
            alloc_segs == device_segs,
            "allocator segments {alloc_segs:?} != device live segments {device_segs:?}"
        );
        let stats = self.alloc.stats();
        let other_stats = self.other.stats();
        let b = &stats.blocks;
        let device_reserved: u64 = device_segs.iter().map(|s| s.1).sum();
        let reserved = b.reserved_bytes.all.current + other_stats.blocks.reserved_bytes.all.current;
        ensure!(
            reserved == device_reserved + self.dev.physical_bytes()
                && device_reserved == self.dev.reserved_bytes(),
            "reserved_bytes {reserved} (both allocators) != Σ device segments {device_reserved} + physical {}",
            self.dev.physical_bytes()
        );
        for o in self.others.iter().filter(|o| o.block_size() > 0) {
            let blk =
                other_snap.iter().flat_map(|seg| &seg.blocks).find(|blk| blk.address == o.ptr());
            ensure!(
                blk.is_some_and(
                    |blk| blk.size == o.block_size() && blk.state == BlockState::Allocated
                ),
                "the second allocator's {o:?} does not match its block {blk:?}"
            );
        }
        let held: Vec<&Live> = self.live.iter().filter(|l| l.buf.block_size() > 0).collect();
        // Planned buffers are slices of a region's blocks, not blocks of their own.
        let (planned, pooled): (Vec<&Live>, Vec<&Live>) =
            held.iter().partition(|l| l.buf.is_planned());
        let (other_bytes, other_blocks) = self.unowned_blocks(&snap, &pooled)?;
        ensure!(
            planned.is_empty() && other_blocks == 0 || self.runs > 0,
            "blocks or planned buffers with no scope ever opened: {other_blocks} blocks, {} \
             planned buffers",
            planned.len()
        );
        let allocated: u64 = pooled.iter().map(|l| l.buf.block_size()).sum::<u64>() + other_bytes;
        // A scope accounts a block it reused locally with the block's first request.
        let requested: u64 = pooled.iter().filter(|l| l.run.is_none()).map(|l| l.buf.len()).sum();
        ensure!(
            b.allocated_bytes.all.current == allocated,
            "allocated_bytes {} != Σ live block sizes {allocated} (of which {other_bytes} in \
             regions or a scope's cache)",
            b.allocated_bytes.all.current
        );
        ensure!(
            b.allocation.all.current == pooled.len() as u64 + other_blocks,
            "{} allocations counted, {} live pool buffers and {other_blocks} other blocks",
            b.allocation.all.current,
            pooled.len()
        );
        ensure!(
            b.requested_bytes.all.current >= requested && b.active_bytes.all.current >= allocated,
            "requested {} < {requested} or active {} < {allocated}",
            b.requested_bytes.all.current,
            b.active_bytes.all.current
        );
        ensure!(
            self.scope.is_some() || other_bytes <= stats.plan_region_bytes,
            "{other_bytes} bytes of allocated blocks back no live buffer, with no scope open and \
             {} bytes in plan regions",
            stats.plan_region_bytes
        );
        for g in stat_groups(b) {
            for s in cells(g) {
                ensure!(
                    s.allocated.checked_sub(s.freed) == Some(s.current) && s.peak >= s.current,
                    "stat identity broken: {s:?}"
                );
            }
            ensure!(
                g.all.current == g.small_pool.current + g.large_pool.current
                    && g.all.current == g.persistent.current + g.transient.current,
                "stat group does not add up: {g:?}"
            );
        }
        let c = self.dev.counters();
        let (mallocs, frees) = (c.mallocs - self.base.mallocs, c.frees - self.base.frees);
        let counted = (
            stats.num_device_alloc + other_stats.num_device_alloc + self.pool_calls.0,
            stats.num_device_free + other_stats.num_device_free + self.pool_calls.1,
        );
        ensure!(
            (mallocs, frees) == counted,
            "device counted {mallocs} mallocs / {frees} frees, the allocators {counted:?}"
        );
        for l in &pooled {
            self.check_placement(l, &snap)?;
        }
        for l in &planned {
            let b = &l.buf;
            self.check_in_block(b.ptr(), b.block_size(), b.stream(), &snap)
                .map_err(|e| format!("planned {b:?}: {e}"))?;
        }
        let mut spans: Vec<(u64, u64)> = held
            .iter()
            .map(|l| &l.buf)
            .chain(&self.others)
            .filter(|b| b.block_size() > 0)
            .map(|b| (b.ptr().0, b.block_size()))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            ensure!(w[0].0 + w[0].1 <= w[1].0, "live buffers overlap: {w:x?}");
        }
        self.vm_fail_mark.set(self.vm_failures());
        self.check_device()
    }

    /// The device-side part of [`Harness::check`]: no sanitizer violation, no failed kernel. A
    /// step that does not call the allocator leaves the rest of `check` as it was, so the
    /// harness only runs this part after one (it is most of the cost of a step).
    pub(super) fn check_device(&self) -> Result<(), String> {
        let v = self.dev.violations();
        ensure!(v.is_empty(), "stream-order violations: {v:?}");
        let k = self.dev.kernel_failures();
        ensure!(k.is_empty(), "kernel failures: {k:?}");
        Ok(())
    }

    /// A live buffer sits in an allocated block of its size, in a segment of its stream,
    /// residency and pool.
    fn check_placement(&self, l: &Live, snap: &[SegmentInfo]) -> Result<(), String> {
        let b = &l.buf;
        let i = snap.partition_point(|s| s.address <= b.ptr());
        let seg = i.checked_sub(1).map(|i| &snap[i]);
        let Some(seg) = seg.filter(|s| b.ptr().0 + b.block_size() <= s.address.0 + s.size) else {
            return Err(format!("live {b:?} is in no segment"));
        };
        ensure!(
            seg.stream == b.stream()
                && l.residency.is_none_or(|r| seg.residency == r)
                && seg.pool == l.kind,
            "live {b:?} ({:?}, {:?}) sits in a segment of {}, {:?}, {:?}",
            l.residency,
            l.kind,
            seg.stream,
            seg.residency,
            seg.pool
        );
        let block = seg.blocks.iter().find(|blk| blk.address == b.ptr());
        // (A block a scope reused locally keeps the request it was first made for.)
        ensure!(
            block.is_some_and(|blk| blk.size == b.block_size()
                && (blk.requested == b.len() || l.run.is_some())
                && blk.state == BlockState::Allocated),
            "live {b:?} does not match its block {block:?}"
        );
        Ok(())
    }

    /// Whether a transient block may sit in `seg`: a transient one, or any large-pool ordinary
    /// segment (both residencies share free space there: `residency.rs`), whatever the current
    /// configuration (a `SetConfig` may turn expandable segments on after it was made); not a
    /// persistent expandable range.
    fn transient_may_use(&self, seg: &SegmentInfo) -> bool {
        let in_range = |a: u64| {
            self.alloc
                .expandable_ranges()
                .iter()
                .any(|r| r.base.0 <= a && a < r.base.0 + r.virtual_size)
        };
        seg.residency == Residency::Transient
            || (seg.pool == PoolKind::Large && !in_range(seg.address.0))
    }

    /// The allocated blocks of `snap` that back none of the live pool buffers `pooled` (a plan's
    /// region, the blocks an open scope freed and keeps): their bytes and number. All are
    /// transient (in segments a transient block may use).
    fn unowned_blocks(&self, snap: &[SegmentInfo], pooled: &[&Live]) -> Result<(u64, u64), String> {
        let owned: HashSet<u64> = pooled.iter().map(|l| l.buf.ptr().0).collect();
        let (mut bytes, mut blocks) = (0, 0);
        for seg in snap {
            for blk in &seg.blocks {
                if blk.state == BlockState::Allocated && !owned.contains(&blk.address.0) {
                    ensure!(
                        self.transient_may_use(seg),
                        "an allocated persistent block at {} backs no live buffer",
                        blk.address
                    );
                    bytes += blk.size;
                    blocks += 1;
                }
            }
        }
        Ok((bytes, blocks))
    }

    /// `[ptr, ptr + size)` lies inside one segment of `stream` that a transient block may use
    /// ([`Harness::transient_may_use`]), on allocated blocks
    /// only (a planned slice in its region, which may span several blocks of an adopted
    /// segment; a bound buffer in its pool block).
    pub(super) fn check_in_block(
        &self,
        ptr: DeviceAddr,
        size: u64,
        stream: StreamId,
        snap: &[SegmentInfo],
    ) -> Result<(), String> {
        let (lo, hi) = (ptr.0, ptr.0 + size);
        let i = snap.partition_point(|s| s.address <= ptr);
        let seg = i.checked_sub(1).map(|i| &snap[i]);
        let Some(seg) = seg.filter(|s| hi <= s.address.0 + s.size) else {
            return Err("in no segment".into());
        };
        ensure!(
            seg.stream == stream && self.transient_may_use(seg),
            "in a segment of {} ({:?}), not one of {stream} a transient block may use",
            seg.stream,
            seg.residency
        );
        let mut under = seg.blocks.iter().filter(|b| b.address.0 < hi && lo < b.address.0 + b.size);
        let bad = under.find(|b| b.state != BlockState::Allocated);
        ensure!(bad.is_none(), "over a block that is not allocated: {bad:?}");
        Ok(())
    }
}
