//! Adopted regions: when a named scope learns its first plan, the plan's region is made at once,
//! out of the segments the learning run left behind, so the very next run already allocates
//! nothing from the device and searches nothing.
//!
//! ```text
//!  learning run exits:  seg A [free ][escape e1][free]   seg B [free      ]   seg C [e2][free]
//!       1. segments with nothing live but the run's escapes are *bins*; wholly free ones
//!          that hold no escape are released (the plan replaces them)
//!       2. the run's lifetimes are packed over the bins, laid end to end with walls between
//!          them (`pack_around`), largest first; what fits in no bin goes above the walls,
//!          into one fresh block
//!       3. the bins' free blocks and the fresh block are allocated to the region; each escape's
//!          range is pinned, and its block joins the region when the escape is freed
//!  virtual line:        [bin A ]|wall|[bin C ]|wall|[fresh ...]
//!  addresses:            A.base ...    C.base ...    fresh block
//! ```
//!
//! Offsets in an adopted plan are absolute addresses (the region's base is 0). The packing
//! assumes the escapes are freed before the next run needs their ranges (a gradient freed by
//! `zero_grad` at the start of the next step); an allocation whose slice is still pinned misses
//! the plan and is served by the pool instead, so a wrong guess costs speed, never safety.

use super::batch::BatchBlock;
use super::broken::Broken;
use super::counters::quadrant;
use super::page_release::Waits;
use super::plan::{Learned, Region, Step};
use super::{Shared, State};
use crate::device::{Device, StreamId};
use crate::packing::{align_up, pack_around, pack_greedy_by_size};
use crate::pool::{BlockId, BlockState, PoolKey, Segment, SegmentId};
use crate::stats::Residency;
use crate::sync::atomic::Ordering;
use crate::sync::{Arc, lock};
use crate::types::PoolKind;
use std::collections::HashMap;

/// An escape of the learning run whose block is in the pool: its block, address and size.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Escape {
    pub block: BlockId,
    pub ptr: u64,
    pub size: u64,
}

/// The walls on the virtual line: one granule after each bin, and the blocks in bins that
/// stay busy (not the learning run's escapes).
fn walls(bins: &[Bin], align: u64) -> Vec<(u64, u64)> {
    let inner =
        bins.iter().flat_map(|b| b.walls.iter().map(|&(lo, hi)| (b.virt + lo, b.virt + hi)));
    #[cfg(tidepool_broken = "adopt_walls")]
    let inner = inner.take(0); // BROKEN: the plan may place slices over blocks still in use.
    bins.iter().map(|b| (b.virt + b.size, b.virt + b.size + align)).chain(inner).collect()
}

/// Where the open space above the last bin starts on the virtual line.
fn open_end(bins: &[Bin], align: u64) -> u64 {
    bins.last().map_or(0, |b| b.virt + b.size + align)
}

/// A bin: a segment's place on the virtual line.
struct Bin {
    segment: SegmentId,
    virt: u64,
    base: u64,
    size: u64,
    /// Blocks of the segment that stay busy (offsets from its base): allocated, not escapes.
    walls: Vec<(u64, u64)>,
}

impl<D: Device> Shared<D> {
    /// Makes the first plan of scope `name` on `stream` and its region from the learning run's
    /// `steps` and `escapes`; see the module docs. Returns the region and the escapes pinned in
    /// it, or `None` (nothing changed) when the scope already has a region, the run allocated
    /// nothing, or the fresh block cannot be reserved; the caller then learns the ordinary way.
    pub(super) fn adopt_region(
        &self,
        name: &str,
        stream: StreamId,
        steps: &[Step],
        escapes: &[Escape],
        granule: u64,
        seen: u64,
    ) -> Option<(Arc<Region>, Vec<Escape>)> {
        let mut plans = lock(&self.plans);
        // Not over the segments of a stream gone meanwhile (as `Shared::learn`).
        if self.stream_gone_since(stream, seen) {
            return None;
        }
        let entry = super::regions::plan_entry(&mut plans, name, stream);
        if entry.region.is_some() || entry.learned.is_some() {
            return None;
        }
        let intervals = Learned::intervals(steps);
        if intervals.is_empty() {
            return None;
        }
        let config = self.config.load();
        let align = config.sizing.min_block_size;
        let mut st = self.lock_state();
        self.flush_stream(&mut st, stream, false);
        let by_block: HashMap<BlockId, Escape> = escapes.iter().map(|e| (e.block, *e)).collect();
        let transient = |k: &PoolKey| k.stream == stream && k.residency == Residency::Transient;
        // Free segments without escapes go back to the device: the plan replaces them.
        // Of the mappings that retire, only those of this stream's ranges (and chunks moved into
        // them) are waited for: their pages are walls there, or cannot be released until then;
        // other streams' are only queried.
        let waits = Waits::For(stream);
        let free = |s: &Segment| transient(&s.key) && s.busy_blocks == 0;
        let _ = self.release_segments_then(&mut st, free, waits);
        // In expandable ranges, every whole free page goes too: what is left of a run around the
        // live blocks may then be a bin.
        let _ = self.release_pages(&mut st, |s| transient(&s.key), 0, waits);
        let mut bins = self.bins(&st, &transient, &by_block, align);
        let mut plan = pack_around(&intervals, align, &walls(&bins, align)).ok()?;
        // Over expandable segments, the runs left around the escapes in the large range may be
        // joined (their gaps mapped) into one span at least as large as the run's own packing:
        // one bin, so the plan packs with no walls. Done where that makes the region smaller
        // (gpt2_train: 2 420 MB against 2 585 MB over six runs with walls; t5_train keeps its
        // bins, as its escapes spread over 1 038 MB, more than the 927 MB its run packs into).
        let large = PoolKey { residency: Residency::Transient, stream, kind: PoolKind::Large };
        let adoptable = |id: BlockId| by_block.contains_key(&id);
        let need = match config.expandable_segments {
            true => pack_greedy_by_size(&intervals, align).map_or(0, |p| p.total_size),
            false => 0,
        };
        if let Some(span) = self.joinable_span(&st, large, need, adoptable) {
            let fresh = plan.total_size.saturating_sub(open_end(&bins, align));
            let now = bins.iter().map(|b| b.size).sum::<u64>() + fresh;
            let outside = bins.iter().filter(|b| b.base + b.size <= span.0 || b.base >= span.1);
            let joined = outside.map(|b| b.size).sum::<u64>() + (span.1 - span.0);
            if joined < now {
                // A join that fails midway keeps the gaps it mapped, which joined runs into one
                // segment: the bins are made again either way (the old ones may name segments
                // that no longer exist).
                let joined_all = self.join_runs(&mut st, &config, large, span).is_ok();
                if joined_all || !self.broken(Broken::StaleJoinBins) {
                    bins = self.bins(&st, &transient, &by_block, align);
                    plan = pack_around(&intervals, align, &walls(&bins, align)).ok()?;
                }
            }
        }
        let open = open_end(&bins, align);
        // The bins' free blocks become the region's (before the fresh block is looked for, so
        // it cannot land in a bin); escapes join when they are freed.
        let mut blocks = Vec::new();
        let mut pinned = Vec::new();
        for bin in &bins {
            let ids: Vec<(BlockId, BlockState, u64)> =
                st.pool.segment_blocks(bin.segment).map(|(id, b)| (id, b.state, b.size)).collect();
            let key = st.pool.segment(bin.segment).key;
            let q = quadrant(key.kind, key.residency);
            for (id, state, bsize) in ids {
                if state == BlockState::Free {
                    let b = st.pool.allocate(id, bsize, bsize, &config.sizing);
                    st.base.live_up(q, bsize, bsize, || self.caches.all());
                    blocks.push(BatchBlock {
                        block: b,
                        quadrant: q,
                        size: bsize,
                        requested: bsize,
                    });
                } else if let Some(e) = by_block.get(&id) {
                    pinned.push(*e);
                }
            }
        }
        let fresh_bytes = plan.total_size.saturating_sub(open);
        let (mut fresh_base, mut fresh_size) = (0, 0);
        if fresh_bytes > 0 {
            let Ok((b, addr)) = self.region_block(&mut st, &config, stream, fresh_bytes) else {
                let st = &mut *st;
                super::batch::return_batch(&mut st.pool, &mut st.base, None, &blocks);
                return None;
            };
            (fresh_base, fresh_size) = (addr, b.size);
            blocks.push(b);
        }
        // The region's bytes: its bins but their walls (blocks it does not hold), and the fresh
        // block; counted in the section that made them live (see `Shared::make_region`).
        let walled: u64 = bins.iter().flat_map(|b| &b.walls).map(|&(lo, hi)| hi - lo).sum();
        let size = bins.iter().map(|b| b.size).sum::<u64>() - walled + fresh_size;
        #[cfg(not(tidepool_broken = "extras_apart"))]
        self.scope_counters.region_bytes.fetch_add(size, Ordering::Relaxed);
        drop(st);
        let absolute = |v: u64| match bins.iter().find(|b| b.virt <= v && v < b.virt + b.size) {
            Some(b) => b.base + (v - b.virt),
            None => fresh_base + (v - open),
        };
        let offsets: Vec<u64> = plan.offsets.iter().map(|&v| absolute(v)).collect();
        let region = Arc::new(Region::new(blocks, 0, size));
        for e in &pinned {
            region.pin(e.ptr, e.size);
        }
        let learned = Learned::with_offsets(steps, &offsets, size, granule);
        #[cfg(tidepool_broken = "extras_apart")]
        self.scope_counters.region_bytes.fetch_add(size, Ordering::Relaxed);
        entry.learned = Some(Arc::new(learned));
        entry.region = Some(region.clone());
        Some((region, pinned))
    }

    /// The stream's transient segments holding nothing live but escapes, on the virtual line.
    fn bins(
        &self,
        st: &State,
        transient: &impl Fn(&PoolKey) -> bool,
        escapes: &HashMap<BlockId, Escape>,
        align: u64,
    ) -> Vec<Bin> {
        let mut bins: Vec<Bin> = Vec::new();
        for (id, seg) in st.pool.segments().filter(|(_, seg)| transient(&seg.key)) {
            let mut walls = Vec::new();
            let mut escape = false;
            for (bid, b) in st.pool.segment_blocks(id) {
                match (b.state, escapes.contains_key(&bid)) {
                    (BlockState::Free, _) => {}
                    (BlockState::Allocated, true) => escape = true,
                    _ => walls.push((b.addr - seg.base, b.addr - seg.base + b.size)),
                }
            }
            if escape || walls.is_empty() {
                bins.push(Bin { segment: id, virt: 0, base: seg.base, size: seg.size, walls });
            }
        }
        // Largest bins first: the largest lifetimes are packed first and take the lowest place
        // that fits, so big bins fill with big buffers and the small ones are left for the
        // many small buffers. (In address order, GPT-2's region grows 6 %.)
        bins.sort_by_key(|b| (std::cmp::Reverse(b.size), b.base));
        let mut virt = 0;
        for b in &mut bins {
            b.virt = virt;
            virt += align_up(b.size, align).unwrap_or(b.size) + align;
        }
        bins
    }
}
