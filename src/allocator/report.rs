//! Human-readable views of the allocator: `snapshot()` (every segment and block) and
//! `memory_summary()` (a table in the style of `torch.cuda.memory_summary()`).

use super::{Allocator, Shared};
use crate::device::{Device, DeviceAddr, StreamId};
use crate::pool::BlockState;
use crate::stats::{Bytes, MemoryStats, PoolKind, Residency, Stat, StatGroup};
use crate::sync::atomic::Ordering;
use std::fmt::Write;

/// One block of a segment, as `snapshot()` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// First address.
    pub address: DeviceAddr,
    /// Size in bytes.
    pub size: u64,
    /// Bytes the user asked for (0 when free).
    pub requested: u64,
    /// Free, allocated, or pending (freed, waiting on events).
    pub state: BlockState,
}

/// One segment, as `snapshot()` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// First address.
    pub address: DeviceAddr,
    /// Size in bytes.
    pub size: u64,
    /// The stream it is cached for.
    pub stream: StreamId,
    /// Small or large pool.
    pub pool: PoolKind,
    /// Persistent or transient.
    pub residency: Residency,
    /// Its blocks in address order.
    pub blocks: Vec<BlockInfo>,
}

impl<D: Device> Allocator<D> {
    /// Every segment and block, segments in address order. The stream caches are flushed first,
    /// so blocks freed by their users show as free (and coalesced) pool blocks.
    pub fn snapshot(&self) -> Vec<SegmentInfo> {
        self.shared.snapshot()
    }
}

impl<D: Device> Shared<D> {
    /// [`Allocator::snapshot`].
    pub(super) fn snapshot(&self) -> Vec<SegmentInfo> {
        self.snapshot_marked().into_iter().map(|(s, _)| s).collect()
    }

    /// [`Allocator::snapshot`], each segment with whether it is mapped through virtual memory
    /// management (a run of an expandable range, or a stitched block's own range: PyTorch's
    /// `is_expandable`), read in the same lock section.
    pub(super) fn snapshot_marked(&self) -> Vec<(SegmentInfo, bool)> {
        let mut st = self.lock_state();
        self.segments_in(&mut st)
    }

    /// [`Shared::snapshot_marked`] and, read in the same lock section, where the history stood
    /// (`None` when not recording): so a dump's segments and the entries it keeps of this
    /// allocator (those numbered below the cut) are of one moment, whatever other threads do.
    pub(super) fn snapshot_cut(&self) -> (Vec<(SegmentInfo, bool)>, Option<super::dump::Cut>) {
        let mut st = self.lock_state();
        let segments = self.segments_in(&mut st);
        let cut = st.history.as_ref().map(|tap| {
            let ring = tap.ring().clone();
            let (pushed, stacks, marks) = {
                let h = crate::sync::lock(&ring);
                (h.pushed(), h.block_stacks().clone(), h.annotations().cloned().collect())
            };
            super::dump::Cut { ring, pushed, stacks, marks }
        });
        (segments, cut)
    }

    /// The segments, as [`Shared::snapshot_marked`] reads them under the global lock.
    fn segments_in(&self, st: &mut super::state::State) -> Vec<(SegmentInfo, bool)> {
        self.flush_for_view(st);
        let vm = &st.vm;
        let mut out: Vec<(SegmentInfo, bool)> = st
            .pool
            .segments()
            .map(|(id, seg)| {
                (
                    SegmentInfo {
                        address: DeviceAddr(seg.base),
                        size: seg.size,
                        stream: seg.key.stream,
                        pool: seg.key.kind,
                        residency: seg.key.residency,
                        blocks: st
                            .pool
                            .segment_blocks(id)
                            .map(|(_, b)| BlockInfo {
                                address: DeviceAddr(b.addr),
                                size: b.size,
                                requested: b.requested,
                                state: b.state,
                            })
                            .collect(),
                    },
                    vm.contains(seg.base),
                )
            })
            .collect();
        out.sort_by_key(|s| s.0.address);
        out
    }
}

impl<D: Device> Allocator<D> {
    /// The controls section of [`Allocator::memory_summary`]: each control's state, and how to
    /// turn it on.
    fn controls_rows(&self, out: &mut String, s: &MemoryStats) {
        let c = self.config();
        let total = self.shared.device_total;
        let mib = |b: u64| Bytes(b).to_string();
        let history = self.shared.recording.load(Ordering::Relaxed);
        let rows: [(String, &str); 10] = [
            (
                match (c.garbage_collection_threshold, c.gc_limit(total)) {
                    (Some(t), Some(at)) => format!("garbage collection: {t} ({})", mib(at)),
                    _ => "garbage collection: off".into(),
                },
                "garbage_collection_threshold:0.8",
            ),
            (
                match c.initial_pool_size {
                    0 => "initial pool: none".into(),
                    b => format!("initial pool: {}", mib(b)),
                },
                "initial_pool_size_mb:N",
            ),
            (
                match c.max_pool_size {
                    Some(b) => format!("max pool size: {}", mib(b)),
                    None => "max pool size: none".into(),
                },
                "max_pool_size_mb:N",
            ),
            (
                match c.limit(total) {
                    Some(b) => format!("cap on reserved: {}", mib(b)),
                    None => "cap on reserved: none".into(),
                },
                "memory_limit_mb, per_process_memory_fraction",
            ),
            (
                format!("caching: {}", if c.caching { "on" } else { "off (pass-through)" }),
                "caching:false (TIDEPOOL_NO_MEMORY_CACHING=1)",
            ),
            (
                format!(
                    "biased lanes: {}",
                    // (Asked only with the key on: with it off, nothing probes `membarrier`.)
                    match c.biased_lanes {
                        false => "off",
                        true if crate::membarrier::supported() => "on",
                        true => "off (no membarrier here)",
                    }
                ),
                "biased_lanes:false",
            ),
            (
                format!(
                    "capture reuse after joins: {}",
                    if c.graph_capture_record_stream_reuse { "on" } else { "off" }
                ),
                "graph_capture_record_stream_reuse:true",
            ),
            (
                format!("memory history: {}", if history { "recording" } else { "off" }),
                "Allocator::record_history",
            ),
            ("aligned allocations".into(), "Allocator::alloc_aligned(bytes, align, s)"),
            (
                format!(
                    "oversize allocs / segs: {} / {}",
                    s.oversize_allocations.current, s.oversize_segments.current
                ),
                "reset_accumulated_stats; max_split_size_mb",
            ),
        ];
        for (state, how) in rows {
            let _ = writeln!(out, "| {state:<38}| {how:<46}|");
        }
        for kv in &c.no_effect {
            let _ = writeln!(out, "| {kv:<38}| {:<46}|", "PyTorch key, accepted: no effect here");
        }
    }

    /// What [`Allocator::memory_summary`] prints, read in one lock section: the expandable
    /// ranges, the note, and every statistic as [`Allocator::stats`] gives it (as exact as
    /// its locked read), so the ranges' mapped bytes add up to the reserved figures beside
    /// them. BROKEN (`summary_apart`): the ranges in one lock section, the statistics read
    /// after it, apart (another thread's growth between the two showed in one only).
    fn summary_read(&self) -> (Vec<super::RangeInfo>, Option<String>, MemoryStats) {
        use super::{Broken, extra_stats};
        use crate::sync::lock;
        let sh = &self.shared;
        if cfg!(tidepool_broken = "summary_apart") {
            let (ranges, note) = {
                let st = sh.lock_state();
                (sh.range_infos(&st), st.vm.note().map(str::to_string))
            };
            #[cfg(feature = "test-hooks")]
            if let Some(window) = crate::sync::lock(&sh.after_view).take() {
                window();
            }
            return (ranges, note, self.stats());
        }
        // The lock alone, as a locked `stats()` read takes it (a read settles nothing).
        let (ranges, note, raw) = {
            let mut st = lock(&sh.state);
            sh.count_lock();
            let ranges = sh.range_infos(&st);
            let note = st.vm.note().map(str::to_string);
            (ranges, note, sh.stats_in(&mut st))
        };
        #[cfg(feature = "test-hooks")]
        if let Some(window) = crate::sync::lock(&sh.after_view).take() {
            window();
        }
        let base = sh.accumulated_base.load();
        (ranges, note, extra_stats::since(raw, &base, sh.broken(Broken::ResetKeepsMaps)))
    }

    /// A text table of the statistics, like `torch.cuda.memory_summary()`.
    ///
    /// A read: unlike [`Allocator::snapshot`] it flushes no stream cache, so the blocks they
    /// hold show in the fast-cached row, and the ranges as the last lock section left them.
    pub fn memory_summary(&self) -> String {
        let (ranges, note, s) = self.summary_read();
        let b = &s.blocks;
        let rule = format!("|{}|\n", "=".repeat(87));
        let thin = format!("|{}|\n", "-".repeat(87));
        let mut out = String::new();
        out += &rule;
        let _ = writeln!(
            out,
            "|{:^87}|",
            format!("tidepool memory summary — {}", self.device().name())
        );
        out += &thin;
        let _ = writeln!(
            out,
            "|{:^87}|",
            format!(
                "OOMs: {:<10} alloc retries: {:<10} host syncs: {}",
                s.num_ooms, s.num_alloc_retries, s.num_host_syncs
            )
        );
        if self.config().throw_on_oom {
            let _ = writeln!(
                out,
                "|{:^87}|",
                format!(
                    "throw_on_cudamalloc_oom: on, reservations past the cap refused: {}",
                    s.num_oom_rejections
                )
            );
        }
        let _ = writeln!(
            out,
            "|{:^87}|",
            format!(
                "device mallocs: {:<10} device frees: {:<10} fragmentation: {:.3}",
                s.num_device_alloc,
                s.num_device_free,
                s.fragmentation()
            )
        );
        out += &thin;
        self.controls_rows(&mut out, &s);
        out += &rule;
        let _ = writeln!(
            out,
            "| {:<26}| {:>12} | {:>12} | {:>12} | {:>12} |",
            "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
        );
        let bytes_rows: [(&str, &StatGroup); 5] = [
            ("Allocated memory", &b.allocated_bytes),
            ("Active memory", &b.active_bytes),
            ("Requested memory", &b.requested_bytes),
            ("Reserved memory", &b.reserved_bytes),
            ("Non-releasable memory", &b.inactive_split_bytes),
        ];
        let count_rows: [(&str, &StatGroup); 4] = [
            ("Allocations", &b.allocation),
            ("Active allocs", &b.active),
            ("Reserved segments", &b.segment),
            ("Non-releasable allocs", &b.inactive_split),
        ];
        let row = |out: &mut String, name: &str, st: &Stat, bytes: bool| {
            let f = |v: u64| {
                if bytes { Bytes(v).to_string() } else { v.to_string() }
            };
            let _ = writeln!(
                out,
                "| {:<26}| {:>12} | {:>12} | {:>12} | {:>12} |",
                name,
                f(st.current),
                f(st.peak),
                f(st.allocated),
                f(st.freed)
            );
        };
        for (rows, bytes) in [(&bytes_rows[..], true), (&count_rows[..], false)] {
            for (name, g) in rows {
                out += &thin;
                row(&mut out, name, &g.all, bytes);
                row(&mut out, "      from large pool", &g.large_pool, bytes);
                row(&mut out, "      from small pool", &g.small_pool, bytes);
                row(&mut out, "      persistent", &g.persistent, bytes);
                row(&mut out, "      transient", &g.transient, bytes);
            }
        }
        // PyTorch's last two rows (`memory_summary` ends its table with them), all four figures.
        // BROKEN (`summary_oversize_current`): the current counts only, in the controls' rows.
        if !cfg!(tidepool_broken = "summary_oversize_current") {
            for (name, st) in [
                ("Oversize allocations", &s.oversize_allocations),
                ("Oversize GPU segments", &s.oversize_segments),
            ] {
                out += &thin;
                row(&mut out, name, st, false);
            }
        }
        out += &rule;
        // A row of one figure in bytes: its name, the bytes, what they are.
        let line = |out: &mut String, name: &str, bytes: u64, what: &str| {
            let _ =
                writeln!(out, "| {:<26}| {:>12} | {:>42} |", name, Bytes(bytes).to_string(), what);
        };
        line(&mut out, "Fast-cached memory", s.cached_fast_bytes, "(freed, in per-stream caches)");
        // How many allocations the stream caches served with no lock: the rest took the whole
        // path (`MemoryStats::locked_allocations`).
        let _ = writeln!(
            out,
            "| {:<26}| {:>12} | {:>42} |",
            "Lock-free hits",
            s.lock_free_allocations(),
            format!("(of {} allocations; the rest locked)", s.blocks.allocation.all.allocated)
        );
        if s.plan_region_bytes > 0 {
            // Counted as allocated above; `empty_cache` releases the idle ones.
            line(
                &mut out,
                "Plan regions",
                s.plan_region_bytes,
                "(named scopes' plans, in allocated)",
            );
        }
        out += &rule;
        if s.expandable_segments || note.is_some() {
            let _ = writeln!(
                out,
                "|{:^87}|",
                format!(
                    "expandable segments: {} virtual, {} maps, {} unmaps, {} creates, {} releases, {} moved",
                    Bytes(s.virtual_reserved_bytes),
                    s.num_device_map,
                    s.num_device_unmap,
                    s.num_physical_create,
                    s.num_physical_release,
                    s.num_pages_moved
                )
            );
            for r in &ranges {
                let _ = writeln!(
                    out,
                    "| {:<26}| {:>12} | {:>42} |",
                    format!(
                        "Range {} {} {}",
                        r.stream,
                        match r.pool {
                            PoolKind::Small => "small",
                            PoolKind::Large => "large",
                        },
                        match r.residency {
                            Residency::Persistent => "pers.",
                            Residency::Transient => "trans.",
                        }
                    ),
                    Bytes(r.mapped_bytes).to_string(),
                    // BROKEN (`chunk_figures_as_pages`): "in whole pages", which it is not.
                    format!(
                        "mapped; {} free ({} in {}), {} runs",
                        Bytes(r.free_bytes),
                        Bytes(r.free_page_bytes),
                        match cfg!(tidepool_broken = "chunk_figures_as_pages") {
                            true => "whole pages",
                            false => "free chunks",
                        },
                        r.runs.len()
                    )
                );
            }
            if let Some(note) = note {
                let _ = writeln!(out, "| note: {:<80}|", note);
            }
            out += &rule;
        }
        if !s.cached_free_bytes_per_stream.is_empty() {
            for (stream, bytes) in &s.cached_free_bytes_per_stream {
                line(&mut out, &format!("Cached free, stream {stream}"), *bytes, "");
            }
            out += &rule;
        }
        out
    }
}
