//! Stitched blocks (GMLake's stitching, over expandable ranges): a large request that finds
//! no free block gets a virtual range of its own, onto physical chunks that the stream's range
//! has mapped and left free — in pieces no request of that size could use — plus chunks the
//! range grows at its top for what they lack. CUDA maps one physical allocation at several
//! addresses, so the chunks stay mapped at home too.
//!
//! ```text
//!  home range  [busy][ A ][busy][ B ][busy][ C ]|top      A, B: whole free chunks; C: grown
//!  stitch      [ A' | B' | C' ]                           its own range, A, B, C mapped again
//!  live:       home runs cut around A, B, C (pages *lent*: mapped, in no run, not mappable)
//!  freed:      the stitch's segment leaves the pool, A, B, C join the home runs again; the
//!              stitch stays mapped (cached) for a request that finds its chunks all free
//! ```
//!
//! - **When.** A request of at least [`STITCH_MIN_PAGES`] pages that no mapped free block holds,
//!   where the stream's whole free chunks would leave fewer pages to map than a growth needs
//!   (`expandable_stitching:true`; off by default: see "Cost" below). Its ranges are then made
//!   of chunks of [`STITCH_CHUNK_PAGES`] pages, the granule a stitch can borrow. A cached stitch of the key whose
//!   chunks are all free again serves first: no device call, so a training step that repeats
//!   its pattern makes none (`mlp_train`: 1.032 → 1.001 × peak live, model and allocator).
//! - **Taken whole.** A stitched block is never split: a block in its tail would keep the
//!   segment busy after the stitched block went, and with it every chunk lent, out of reach
//!   of `empty_cache` and of a closed allocator (a 1.5 MiB block pinned 24 MiB that way). For
//!   the same reason an aligned request is never stitched: the padding split off its front
//!   would be such a block.
//! - **Counted once.** The stitch's pool segment counts its bytes while it is live, and its
//!   chunks are out of the home runs meanwhile: `reserved_bytes` stays the mapped physical bytes.
//! - **Released with its chunks.** A release of home chunks (`empty_cache`, the out-of-memory
//!   ladder, `release_threshold`) first unmaps the cached stitches over them, after the
//!   stream's work (the driver frees memory at its last unmapping); a page move to another
//!   stream passes chunks a stitch maps over. Unmappings the device refuses are tried again at
//!   each release, and left to the family when the allocator goes.
//! - **Cost.** Lending and returning chunks is segment surgery in the pool (a carve and a
//!   join per run of chunks), paid at every use of a stitch, and the 4-page chunks cost more
//!   creates and maps in a first step: on `mlp_train` the replay's instructions per op go from
//!   1090 to 1696 (`caching`: 934), and the `cs336` snapshot's peak rises (1.008 → 1.018 × live;
//!   docs/design-notes.md), which is why it is not on by default.

use super::broken::Broken;
use super::expandable::{Place, STITCH_CHUNK_PAGES, Vm, whole_pages};
use super::history::Action;
use super::page_table::Chunk;
use super::*;
use crate::device::PhysHandle;

/// Fewest pages of a request that a stitch serves (16 MiB of 2 MiB pages): below it a growth
/// costs few pages anyway, and each stitch costs a virtual range and a map per chunk.
pub(super) const STITCH_MIN_PAGES: u64 = 2 * STITCH_CHUNK_PAGES;

/// Most stitches (live and cached) one pool key keeps: past it a request grows the range.
const MAX_STITCHES_PER_KEY: usize = 16;

/// One chunk of a stitch: its home address and pages, its physical allocation, and where the
/// stitch maps it.
#[derive(Clone, Copy, Debug)]
pub(super) struct StitchChunk {
    home: u64,
    pages: u64,
    handle: PhysHandle,
    at: u64,
}

/// A stitched block's own virtual range and the home chunks it maps.
pub(super) struct Stitch {
    /// Its virtual range.
    pub(super) base: u64,
    pub(super) bytes: u64,
    /// The base of its home range, and that range's key.
    pub(super) home: u64,
    key: PoolKey,
    /// The chunks still mapped here (all of them, unless an unmapping was refused).
    chunks: Vec<StitchChunk>,
    /// Its pool segment while live.
    seg: Option<SegmentId>,
    /// An unmapping or the range's free was refused: serves nothing more, tried again.
    dead: bool,
}

impl StitchChunk {
    /// Home chunk `c`, not mapped in the stitch yet.
    fn of(c: Chunk) -> StitchChunk {
        StitchChunk { home: c.lo, pages: c.pages, handle: c.handle, at: 0 }
    }
}

impl Stitch {
    /// Cached, whole, for this key.
    fn idle(&self) -> bool {
        self.seg.is_none() && !self.dead
    }
}

/// The free blocks of range `home`'s runs, as (address, end), in address order.
fn free_spans(st: &State, home: u64) -> Vec<(u64, u64)> {
    let r = &st.vm.ranges[&home];
    r.segs
        .values()
        .flat_map(|&s| st.pool.segment_blocks(s))
        .filter(|(_, b)| b.state == BlockState::Free)
        .map(|(_, b)| (b.addr, b.addr + b.size))
        .collect()
}

/// The home pages of `chunks` as runs of neighbouring chunks, (first page, end), in address
/// order (a stitch's chunks are in address order: the free ones lowest first, then those grown
/// at the top).
fn runs_of(chunks: &[StitchChunk], page: u64) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for c in chunks {
        let end = c.home + c.pages * page;
        match runs.last_mut() {
            Some((_, e)) if *e == c.home => *e = end,
            _ => runs.push((c.home, end)),
        }
    }
    runs
}

/// Whether `[lo, hi)` lies inside one of `spans` (sorted, disjoint).
fn inside(spans: &[(u64, u64)], lo: u64, hi: u64) -> bool {
    let i = spans.partition_point(|&(a, _)| a <= lo);
    i > 0 && spans[i - 1].1 >= hi
}

impl<D: Device> Shared<D> {
    /// A stitched block for a request of `rounded` bytes of `key`, which no free block holds
    /// and a growth would serve with `exact.pages` new pages: the free block of a live stitch,
    /// or `None` (the caller grows the range). See the module docs.
    pub(super) fn try_stitch(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
        exact: Place,
    ) -> Result<Option<BlockId>, AllocError> {
        let page = st.vm.page;
        let need = rounded.div_ceil(page);
        if !config.stitching || need < STITCH_MIN_PAGES || exact.pages == 0 {
            return Ok(None);
        }
        // Chunks can save pages only where more bytes are free than the growth leaves unmapped.
        if st.pool.free_bytes_of(key.stream) <= need.saturating_sub(exact.pages) * page
            || self.device.capture_underway()
        {
            return Ok(None);
        }
        let home = st.vm.by_key[&key];
        let spans = free_spans(st, home);
        let mine = |s: &Stitch| s.key == key && s.idle();
        let cached = st
            .vm
            .stitches
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                mine(s) && s.bytes >= need * page && s.bytes <= (need + need / 4) * page
            })
            .filter(|(_, s)| {
                s.chunks.iter().all(|c| inside(&spans, c.home, c.home + c.pages * page))
            })
            .min_by_key(|(_, s)| (s.bytes, s.base))
            .map(|(i, _)| i);
        if let Some(i) = cached {
            return Ok(Some(self.lend(st, i)));
        }
        if st.vm.stitches.iter().filter(|s| s.key == key).count() >= MAX_STITCHES_PER_KEY {
            return Ok(None);
        }
        // Whole free chunks, lowest first, each no larger than what is still missing. (Measured,
        // not kept: highest first, or those of the smallest free blocks first; a stitch only
        // where free chunks hold half its pages or more. See docs/design-notes.md.)
        let r = &st.vm.ranges[&home];
        let mut chunks: Vec<StitchChunk> = Vec::new();
        let mut have = 0;
        let whole = spans.iter().filter_map(|&(lo, hi)| whole_pages(r.base, page, lo, hi));
        for c in whole.flat_map(|(a, z)| r.pages.whole_chunks(a, z)) {
            if have + c.pages <= need {
                chunks.push(StitchChunk::of(c));
                have += c.pages;
            }
        }
        let lacking = need - have;
        if lacking >= exact.pages {
            return Ok(None);
        }
        if lacking > 0 {
            let (lo, end) = (r.top_end(&st.pool, page), r.base + r.size);
            if lo + lacking * page > end {
                return Ok(None);
            }
            match self.grow_at(st, config, key, Place { lo, pages: lacking }) {
                Ok(_) => {}
                // The growth would need more pages still: it runs out too, and climbs the ladder.
                Err(AllocError::OutOfMemory(_)) => return Ok(None),
                Err(e) => return Err(e),
            }
            // The new chunks (a chunk moved from another stream may bring more pages).
            let r = &st.vm.ranges[&home];
            let mut va = lo;
            while have < need {
                let c = r.pages.get(va).expect("grown");
                chunks.push(StitchChunk::of(c));
                have += c.pages;
                va = c.lo + c.pages * page;
            }
        }
        let bytes = have * page;
        let Ok(base) = self.device.vm_reserve(bytes) else {
            return Ok(None);
        };
        let base = base.0;
        let mut at = base;
        for i in 0..chunks.len() {
            let c = &mut chunks[i];
            c.at = at;
            if self.device.vm_map(DeviceAddr(at), c.pages * page, c.handle).is_err() {
                // Undone: what was mapped is unmapped and the range freed (what the device
                // refuses waits as a dead stitch for the next release).
                chunks.truncate(i);
                self.register(st, Stitch { base, bytes, home, key, chunks, seg: None, dead: true });
                let last = st.vm.stitches.len() - 1;
                // (A refusal here leaves a dead stitch for the next release, which reports it;
                // this request grows the range instead.)
                let _ = self.unmap_stitch(st, last);
                return Ok(None);
            }
            st.vm.counts.add_maps(1);
            at += c.pages * page;
        }
        self.register(st, Stitch { base, bytes, home, key, chunks, seg: None, dead: false });
        let last = st.vm.stitches.len() - 1;
        Ok(Some(self.lend(st, last)))
    }

    /// Whether `seg` is a live stitch's segment, whose block is handed out whole: a block split
    /// off its tail would keep the segment busy once the stitched block is freed, and with it
    /// every chunk lent, out of reach of `empty_cache` and of a closed allocator's release.
    /// (The broken build `cfg(tidepool_broken = "stitch_split")` splits it.)
    #[inline]
    pub(super) fn stitched(vm: &Vm, seg: SegmentId) -> bool {
        !cfg!(tidepool_broken = "stitch_split")
            && vm.live_stitches != 0
            && vm.stitches.iter().any(|s| s.seg == Some(seg))
    }

    /// Lists a stitch whose range is reserved and whose `chunks` are mapped.
    fn register(&self, st: &mut State, s: Stitch) {
        let range = st.vm.ranges.get_mut(&s.home).expect("its home");
        for c in &s.chunks {
            *range.aliased.entry(c.home).or_default() += 1;
        }
        st.vm.virtual_bytes += s.bytes;
        st.vm.stitches.push(s);
    }

    /// Makes cached stitch `i` live: its chunks leave the home runs (lent), its range joins the
    /// pool as a segment of its own. Returns that segment's free block.
    fn lend(&self, st: &mut State, i: usize) -> BlockId {
        let page = st.vm.page;
        let s = &st.vm.stitches[i];
        let (home, key, base, bytes) = (s.home, s.key, s.base, s.bytes);
        if !self.broken(Broken::StitchKeepsHome) {
            // Neighbouring chunks leave the runs in one cut: they lie in one free block (free
            // blocks of a run never touch, nor do two runs).
            for (lo, hi) in runs_of(&s.chunks, page) {
                let blk = self.free_block_at(st, home, lo);
                self.carve_unmapped(st, (home, blk), lo, hi, key.stream);
                let range = st.vm.ranges.get_mut(&home).expect("its home");
                range.lent.insert(lo, hi);
            }
        }
        let (seg, blk) = st.pool.extend(key, base, bytes, None, None);
        st.note(Action::SegmentMap, DeviceAddr(base), bytes, key.stream);
        self.ensure_cache(st, key.stream);
        *st.segment_streams.entry(key.stream).or_default() += 1;
        st.vm.stitches[i].seg = Some(seg);
        st.vm.live_stitches += 1;
        self.publish_vm(&mut st.vm);
        blk
    }

    /// The free block of range `home`'s runs holding the page at `va`.
    fn free_block_at(&self, st: &State, home: u64, va: u64) -> BlockId {
        let r = &st.vm.ranges[&home];
        let (_, &seg) = r.segs.range(..=va).next_back().expect("a run below a lent chunk");
        st.pool
            .segment_blocks(seg)
            .find(|(_, b)| b.addr <= va && va < b.addr + b.size)
            .filter(|(_, b)| b.state == BlockState::Free)
            .map(|(id, _)| id)
            .expect("a stitched chunk lies in a free block")
    }

    /// Live stitches whose segment is wholly free again (their block freed, its stream-ordered
    /// uses done): the segment leaves the pool, the chunks join their home runs, the stitch
    /// stays mapped for a later request. Called as the global lock is let go.
    #[inline]
    pub(super) fn unstitch_freed(&self, st: &mut State) {
        // Only a free into the pool makes a segment wholly free.
        if st.vm.live_stitches != 0 && st.pool.frees() != st.vm.frees_seen {
            self.unstitch_freed_now(st);
        }
    }

    /// [`Shared::unstitch_freed`] where a live stitch's block may have been freed.
    #[cold]
    fn unstitch_freed_now(&self, st: &mut State) {
        st.vm.frees_seen = st.pool.frees();
        let page = st.vm.page;
        for i in 0..st.vm.stitches.len() {
            let Some(seg) = st.vm.stitches[i].seg else { continue };
            let segment = st.pool.segment(seg);
            if segment.busy_blocks != 0 {
                continue;
            }
            let first = segment.first;
            let s = &st.vm.stitches[i];
            let (base, bytes, key, home) = (s.base, s.bytes, s.key, s.home);
            debug_assert_eq!(
                st.pool.block(first).size,
                bytes,
                "a wholly free segment is one block"
            );
            st.pool.carve(first, base, base + bytes);
            Self::forget_segment(st, key.stream);
            st.note(Action::SegmentUnmap, DeviceAddr(base), bytes, key.stream);
            st.vm.stitches[i].seg = None;
            st.vm.live_stitches -= 1;
            if self.broken(Broken::StitchKeepsHome) {
                continue; // BROKEN: the chunks never left the home runs
            }
            for (lo, hi) in runs_of(&st.vm.stitches[i].chunks, page) {
                let range = st.vm.ranges.get_mut(&home).expect("its home");
                range.lent.remove(&lo);
                self.join_pages(st, home, lo, hi - lo);
            }
        }
        self.publish_vm(&mut st.vm);
    }

    /// Before chunks of range `home` in `runs` (free block, first page, end) are unmapped and
    /// released: unmaps the cached stitches that map any of them (the stream's work is done),
    /// and tries again the stitches whose unmapping was refused before. The first refusal is
    /// the answer (each refused stitch stays, dead, for the next release).
    pub(super) fn drop_stitches_over(
        &self,
        st: &mut State,
        home: u64,
        runs: &[(BlockId, u64, u64)],
    ) -> Result<(), DeviceError> {
        if st.vm.stitches.is_empty() {
            return Ok(());
        }
        let page = st.vm.page;
        let r = &st.vm.ranges[&home];
        let mut going = Vec::new();
        for &(_, a, b) in runs {
            let mut va = a;
            while va < b {
                let c = r.pages.get(va).expect("a mapped chunk");
                going.push(c.lo);
                va = c.lo + c.pages * page;
            }
        }
        let mut first = Ok(());
        for i in (0..st.vm.stitches.len()).rev() {
            let s = &st.vm.stitches[i];
            let over = s.home == home
                && s.seg.is_none()
                && (s.dead || s.chunks.iter().any(|c| going.contains(&c.home)));
            if over && let Err(e) = self.unmap_stitch(st, i) {
                first = first.and(Err(e));
            }
        }
        first
    }

    /// Unmaps cached stitch `i` and frees its range; what the device refuses leaves it dead
    /// (listed, serving nothing) for another try, and is the answer.
    fn unmap_stitch(&self, st: &mut State, i: usize) -> Result<(), DeviceError> {
        let page = st.vm.page;
        let s = &mut st.vm.stitches[i];
        let range = st.vm.ranges.get_mut(&s.home).expect("its home");
        while let Some(&c) = s.chunks.last() {
            if let Err(e) = self.device.vm_unmap(DeviceAddr(c.at), c.pages * page) {
                s.dead = true;
                return Err(e);
            }
            st.vm.counts.add_unmaps(1);
            s.chunks.pop();
            match range.aliased.get_mut(&c.home) {
                Some(n) if *n > 1 => *n -= 1,
                _ => {
                    range.aliased.remove(&c.home);
                }
            }
        }
        if let Err(e) = self.device.vm_free(DeviceAddr(s.base), s.bytes) {
            s.dead = true;
            return Err(e);
        }
        st.vm.virtual_bytes -= s.bytes;
        st.vm.stitches.remove(i);
        Ok(())
    }

    /// What the stitches still hold as the allocator goes: their mappings and ranges
    /// (`leftovers.rs`). A live one (a block still allocated, which only a bug leaves by now)
    /// stays.
    pub(super) fn stitch_leftovers(vm: &mut Vm) -> Vec<Leftover> {
        let page = vm.page;
        let mut left = Vec::new();
        for s in vm.stitches.iter().filter(|s| s.seg.is_none()) {
            for c in &s.chunks {
                left.push(Leftover::Unmap { va: c.at, bytes: c.pages * page });
            }
            left.push(Leftover::Free { base: s.base, size: s.bytes });
        }
        left
    }

    /// The stitches' invariants: each maps chunks its home range has mapped (the same physical
    /// allocation, counted in `aliased`); a live one's chunks are lent and its segment is in the
    /// pool, a cached one's are not lent.
    pub(super) fn check_stitches(&self, st: &State) -> Result<(), String> {
        let page = st.vm.page;
        let mut aliased: HashMap<(u64, u64), u32> = HashMap::new();
        let mut live = 0;
        let mut lent = std::collections::HashSet::new();
        for s in &st.vm.stitches {
            let Some(r) = st.vm.ranges.get(&s.home) else {
                return Err(format!("stitch at {:#x} has no home range", s.base));
            };
            if !s.dead && s.chunks.iter().map(|c| c.pages * page).sum::<u64>() != s.bytes {
                return Err(format!("stitch at {:#x} maps less than its size", s.base));
            }
            for c in &s.chunks {
                match r.pages.get(c.home) {
                    Some(h) if h.lo == c.home && h.pages == c.pages && h.handle == c.handle => {}
                    _ => {
                        return Err(format!(
                            "stitch at {:#x}: chunk {:#x} drifted",
                            s.base, c.home
                        ));
                    }
                }
                *aliased.entry((s.home, c.home)).or_default() += 1;
                if s.seg.is_some() {
                    for p in (c.home..c.home + c.pages * page).step_by(page as usize) {
                        if !lent.insert((s.home, p)) {
                            return Err(format!("page {p:#x} lent to two live stitches"));
                        }
                    }
                }
            }
            if let Some(seg) = s.seg {
                live += 1;
                let ok = st.pool.segments().any(|(id, g)| {
                    id == seg && g.base == s.base && g.size == s.bytes && g.key == s.key
                });
                if !ok {
                    return Err(format!("live stitch at {:#x} has no segment of its own", s.base));
                }
            }
        }
        if live != st.vm.live_stitches {
            return Err(format!("{live} live stitches, {} counted", st.vm.live_stitches));
        }
        let keeps = self.broken(Broken::StitchKeepsHome);
        let marked: usize = st
            .vm
            .ranges
            .values()
            .flat_map(|r| r.lent.iter())
            .map(|(&a, &e)| ((e - a) / page) as usize)
            .sum();
        if !keeps && marked != lent.len() {
            return Err(format!("{marked} pages marked lent, live stitches hold {}", lent.len()));
        }
        for r in st.vm.ranges.values() {
            let pages = r.lent.iter().flat_map(|(&a, &e)| (a..e).step_by(page as usize));
            if let Some(p) = pages.clone().find(|&p| !keeps && !lent.contains(&(r.base, p))) {
                return Err(format!("page {p:#x} is lent to no live stitch"));
            }
            for (&lo, &n) in &r.aliased {
                if aliased.get(&(r.base, lo)) != Some(&n) {
                    return Err(format!("chunk {lo:#x} aliased {n} times, stitches say otherwise"));
                }
            }
        }
        if aliased.len() != st.vm.ranges.values().map(|r| r.aliased.len()).sum::<usize>() {
            return Err("a stitched chunk is not counted as aliased".into());
        }
        Ok(())
    }
}
