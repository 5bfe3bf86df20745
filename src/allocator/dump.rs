//! `dump_snapshot`: the allocator's segments (the general allocator's with those of its private
//! pools, each with its pool id), its memory history and its settings, written as the
//! pickle `torch.cuda.memory._dump_snapshot()` writes, so PyTorch's memory viewer
//! (pytorch.org/memory_viz) and `torch/cuda/_memory_viz.py` draw tidepool's memory, and
//! `tidepool replay` reads it back.
//!
//! ```text
//!  { 'segments': [ { device, address, total_size, allocated_size, active_size, requested_size,
//!                    stream, segment_type: 'small'|'large', segment_pool_id: (0, 0) for
//!                    the general allocator, (0, id) a MemPool's, (id, 0) a graph's own
//!                    pool's (PyTorch's ids), is_expandable,
//!                    frames: [], blocks: [ { address, size, requested_size,
//!                                            state: active_allocated|active_pending_free|inactive,
//!                                            frames: [ its allocation's, where kept ] } ] } ],
//!    'device_traces': [ [ { action, addr (an oom's: device_free), size, stream, time_us,
//!                           frames: [...], user_metadata, pool_id: as segment_pool_id } ] ],
//!    'allocator_settings': { key: value },
//!    'external_annotations': [ { stage: 'START'|'END', name, device, time_us } ] }
//! ```

use super::history::TraceEntry;
use super::report::SegmentInfo;
use super::*;
use crate::pickle::{Py, to_pickle};
use crate::types::{BlockState, PoolKind};
use std::path::Path;

/// One device's part of a snapshot, each item stamped with the device's index.
pub(crate) struct DevicePart {
    /// The device's index: its segments' `device` and its place in `device_traces`.
    device: usize,
    segments: Vec<Py>,
    trace: Vec<Py>,
    marks: Vec<Py>,
}

/// The snapshot of devices `parts` (of distinct indices), with `settings` as
/// `allocator_settings`: device `n`'s trace is `device_traces[n]`, and the devices no part
/// stands for have an empty one, as PyTorch lists every device of the machine.
pub(crate) fn pickle_of(parts: Vec<DevicePart>, settings: Py) -> Vec<u8> {
    let (mut segments, mut traces, mut marks) = (Vec::new(), Vec::new(), Vec::new());
    for p in parts {
        segments.extend(p.segments);
        let n = p.device;
        if traces.len() <= n {
            traces.resize_with(n + 1, || Py::List(Vec::new()));
        }
        traces[n] = Py::List(p.trace);
        marks.extend(p.marks);
    }
    to_pickle(&Py::dict([
        ("segments", Py::List(segments)),
        ("device_traces", Py::List(traces)),
        ("allocator_settings", settings),
        ("external_annotations", Py::List(marks)),
    ]))
}

impl<D: Device> Allocator<D> {
    /// The snapshot pickle ([`Allocator::dump_snapshot`]) as bytes, as device
    /// [`Device::ordinal`] (its segments' `device`, its history `device_traces[ordinal]`).
    pub fn snapshot_pickle(&self) -> Vec<u8> {
        let ordinal = self.shared.device.ordinal();
        // BROKEN (`ordinal_ignored`): every allocator dumped itself as device 0.
        let ordinal = if cfg!(tidepool_broken = "ordinal_ignored") { 0 } else { ordinal };
        let part = self.snapshot_part(ordinal);
        pickle_of(vec![part], self.snapshot_settings())
    }

    /// `allocator_settings` of the snapshot: the configuration in force.
    pub(crate) fn snapshot_settings(&self) -> Py {
        settings(&self.config(), self.shared.device.supports_virtual_memory())
    }

    /// This allocator's part of a snapshot, as device `device`.
    ///
    /// Each allocator's segments are read in one lock section with the number of history
    /// entries made so far (a [`Cut`]); the history keeps, of each allocator's entries, those
    /// made before its cut, so what other threads do meanwhile shows in neither. (Read apart,
    /// a dump taken while another thread allocated held entries past its segments: a
    /// `segment_alloc` of a segment it does not list, whose undoing PyTorch's viewer applies
    /// to another segment, or a `segment_free` of one it still lists, drawn twice.)
    pub(crate) fn snapshot_part(&self, index: usize) -> DevicePart {
        let device = index as u64;
        // The general allocator's segments (pool id (0, 0)), then, from the general allocator,
        // those of every private pool of its family alive once those were read (a pool made
        // later made its entries after the general allocator's cut, so none is kept) —
        // PyTorch's snapshot shows every pool of the device, each segment with its
        // `segment_pool_id`.
        let (mut general, general_cut) = self.shared.snapshot_cut();
        stitch_not_expandable(&self.shared, &mut general);
        #[cfg(feature = "test-hooks")]
        if let Some(window) = crate::sync::lock(&self.shared.after_view).take() {
            window();
        }
        let mut parts =
            vec![(self.shared.role.pytorch_id(), self.shared.role.id, general, general_cut)];
        if self.shared.role.id == 0 {
            for (id, sh) in self.shared.family.live_pools() {
                let (mut segs, cut) = sh.snapshot_cut();
                stitch_not_expandable(&sh, &mut segs);
                parts.push((sh.role.pytorch_id(), id, segs, cut));
            }
        }
        let mut segments = Vec::new();
        for (label, _, segs, cut) in &parts {
            let stacks = cut.as_ref().map(|c| &c.stacks);
            segments.extend(segs.iter().map(|(s, e)| segment(s, *e, stacks, *label, device)));
        }
        // The history as the general allocator's lock section found it (none: not recorded
        // then), each pool's entries up to its own cut (that ring's); a pool's whose section
        // found another ring, or none of the dump's, up to the general allocator's.
        let trace = match &parts[0].3 {
            None => Vec::new(),
            Some(first) => {
                let cut_of = |pool: u64| {
                    parts
                        .iter()
                        .find(|p| p.1 == pool)
                        .and_then(|p| p.3.as_ref())
                        .filter(|c| Arc::ptr_eq(&c.ring, &first.ring))
                        .map_or(first.pushed, |c| c.pushed)
                };
                let h = crate::sync::lock(&first.ring);
                // BROKEN (`dump_apart`): every entry of the ring as the dump ends, past the
                // segments' lock sections.
                h.numbered()
                    .filter(|(n, e)| cfg!(tidepool_broken = "dump_apart") || *n < cut_of(e.pool_id))
                    .map(|(_, e)| entry(e))
                    .collect()
            }
        };
        // The range marks as the general allocator's section found them, with its entries.
        // BROKEN (`marks_after_cut`): read as the dump ends, past the cut.
        let marks = match cfg!(tidepool_broken = "marks_after_cut") {
            true => self.annotations(),
            false => parts[0].3.as_ref().map(|c| c.marks.clone()).unwrap_or_default(),
        };
        DevicePart {
            device: index,
            segments,
            trace,
            marks: marks.iter().map(|a| annotation(a, device)).collect(),
        }
    }

    /// Writes the allocator's segments and blocks, its memory history (when
    /// [`Allocator::record_history`] is on) and its settings to `path`, in the pickle format of
    /// `torch.cuda.memory._dump_snapshot()`: PyTorch's memory viewer opens it, and
    /// `tidepool replay` replays it.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, HistoryOptions, SimDevice, StreamId};
    ///
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    /// alloc.record_history(HistoryOptions::new(10_000));
    /// let a = alloc.alloc(4 << 20, StreamId::DEFAULT).unwrap();
    /// drop(a);
    /// // The history: the segment reserved, the block handed out, freed, reusable.
    /// let actions: Vec<_> = alloc.history().iter().map(|e| e.action.name()).collect();
    /// assert_eq!(actions, ["segment_alloc", "alloc", "free_requested", "free_completed"]);
    /// let path = std::env::temp_dir().join(format!("tidepool-doc-{}.pickle", std::process::id()));
    /// alloc.dump_snapshot(&path).unwrap();
    /// let bytes = std::fs::read(&path).unwrap();
    /// assert_eq!(bytes, alloc.snapshot_pickle());
    /// assert!(bytes.starts_with(&[0x80, 2]) && bytes.ends_with(b".")); // a protocol-2 pickle
    /// # std::fs::remove_file(path).unwrap();
    /// ```
    pub fn dump_snapshot(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        std::fs::write(path, self.snapshot_pickle())
    }
}

/// The allocation stacks of live blocks, by address (`History::block_stacks`).
type Stacks = std::collections::HashMap<u64, std::sync::Arc<std::backtrace::Backtrace>>;

/// Where the history stood when an allocator's segments were read, in the same lock section:
/// its ring, how many entries it had taken, the live blocks' allocation stacks and the range
/// marks.
pub(crate) struct Cut {
    pub ring: history::Ring,
    pub pushed: u64,
    pub stacks: Stacks,
    pub marks: Vec<super::Annotation>,
}

/// Whether each segment is mapped through virtual memory (PyTorch's `is_expandable`): a run of
/// a range or a stitched block's own range, asked in the snapshot's lock section.
/// BROKEN (`stitch_not_expandable`): asked of the ranges alone, in a second lock section, so a
/// live stitched block's segment showed as an ordinary one.
fn stitch_not_expandable<D: Device>(sh: &Shared<D>, segments: &mut [(SegmentInfo, bool)]) {
    if cfg!(tidepool_broken = "stitch_not_expandable") {
        let ranges = sh.expandable_ranges();
        for (s, e) in segments {
            *e = ranges
                .iter()
                .any(|r| r.base <= s.address && s.address.0 < r.base.0 + r.virtual_size);
        }
    }
}

/// One segment (with expandable segments: one run of mapped pages of a range); a block that is
/// not free shows the stack of its allocation where the history kept it.
fn segment(
    s: &SegmentInfo,
    is_expandable: bool,
    stacks: Option<&Stacks>,
    (pool_a, pool_b): (u64, u64),
    device: u64,
) -> Py {
    let sum = |pred: fn(BlockState) -> bool| -> u64 {
        s.blocks.iter().filter(|b| pred(b.state)).map(|b| b.size).sum()
    };
    let allocated = sum(|st| st == BlockState::Allocated);
    let active = sum(|st| st != BlockState::Free);
    let requested: u64 = s.blocks.iter().map(|b| b.requested).sum();
    Py::dict([
        ("device", Py::int(device)),
        ("address", Py::int(s.address.0)),
        ("total_size", Py::int(s.size)),
        ("allocated_size", Py::int(allocated)),
        ("active_size", Py::int(active)),
        ("requested_size", Py::int(requested)),
        ("stream", Py::int(s.stream.0)),
        ("segment_type", Py::str(if s.pool == PoolKind::Small { "small" } else { "large" })),
        ("segment_pool_id", Py::Tuple(vec![Py::int(pool_a), Py::int(pool_b)])),
        ("is_expandable", Py::Bool(is_expandable)),
        ("frames", Py::List(vec![])),
        (
            "blocks",
            Py::List(
                s.blocks
                    .iter()
                    .map(|b| {
                        let state = match b.state {
                            BlockState::Allocated => "active_allocated",
                            BlockState::Pending => "active_pending_free",
                            BlockState::Free => "inactive",
                        };
                        Py::dict([
                            ("address", Py::int(b.address.0)),
                            ("size", Py::int(b.size)),
                            ("requested_size", Py::int(b.requested)),
                            ("state", Py::str(state)),
                            (
                                "frames",
                                Py::List(
                                    match (b.state, stacks.and_then(|m| m.get(&b.address.0))) {
                                        (BlockState::Free, _) | (_, None) => vec![],
                                        (_, Some(stack)) => frames(stack),
                                    },
                                ),
                            ),
                        ])
                    })
                    .collect(),
            ),
        ),
    ])
}

/// One history entry, with PyTorch's keys (an `oom` entry's address field is the device's free
/// bytes, under PyTorch's name for it).
fn entry(e: &TraceEntry) -> Py {
    let addr_key = if e.action == Action::Oom { "device_free" } else { "addr" };
    Py::dict([
        ("action", Py::str(e.action.name())),
        (addr_key, Py::int(e.addr.0)),
        ("size", Py::int(e.size)),
        ("stream", Py::int(e.stream.0)),
        ("time_us", Py::int(e.time_us)),
        ("frames", Py::List(e.stack.as_deref().map(frames).unwrap_or_default())),
        ("user_metadata", Py::str(&*e.user_metadata)),
        ("pool_id", {
            let (a, b) = e.pytorch_pool_id();
            Py::Tuple(vec![Py::int(a), Py::int(b)])
        }),
    ])
}

/// One range mark, as PyTorch writes `external_annotations` entries.
fn annotation(a: &super::Annotation, device: u64) -> Py {
    Py::dict([
        ("stage", Py::str(if a.start { "START" } else { "END" })),
        ("name", Py::str(&*a.name)),
        ("device", Py::int(device)),
        ("time_us", Py::int(a.time_us)),
    ])
}

/// The frames of a captured stack, innermost first, as `{filename, line, name}` dicts. Resolved
/// here, at dump time, from the backtrace's text (std offers no structured frames).
fn frames(stack: &std::backtrace::Backtrace) -> Vec<Py> {
    let text = stack.to_string();
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let Some((_, name)) = line.trim_start().split_once(": ") else { continue };
        let (mut file, mut lineno) = (String::from("??"), 0u64);
        if let Some(next) = lines.peek()
            && let Some(loc) = next.trim_start().strip_prefix("at ")
        {
            let mut parts = loc.rsplitn(3, ':');
            let _col = parts.next();
            lineno = parts.next().and_then(|l| l.parse().ok()).unwrap_or(0);
            file = parts.next().unwrap_or(loc).to_string();
            lines.next();
        }
        out.push(Py::dict([
            ("filename", Py::str(file)),
            ("line", Py::int(lineno)),
            ("name", Py::str(name)),
        ]));
    }
    out
}

/// `allocator_settings` in PyTorch's form: its keys first (`roundup_power2_divisions` as a dict
/// of interval start in MiB → divisions, `expandable_segments` as in force), then tidepool's.
fn settings(c: &Config, virtual_memory: bool) -> Py {
    let z = &c.sizing;
    let roundup = Py::Dict(
        (0..crate::pool::ROUNDUP_INTERVALS)
            .map(|i| {
                (Py::str((1u64 << i).to_string()), Py::int(z.roundup_power2_divisions.interval(i)))
            })
            .collect(),
    );
    let mut v: Vec<(&str, Py)> = vec![
        (
            "max_split_size",
            Py::int(if z.max_split_size == u64::MAX { -1 } else { z.max_split_size as i128 }),
        ),
        ("roundup_power2_divisions", roundup),
        ("max_non_split_rounding", Py::int(z.max_non_split_rounding)),
        ("min_block_size", Py::int(z.min_block_size)),
        (
            "cross_stream",
            Py::str(match c.cross_stream {
                crate::config::CrossStream::Strict => "strict",
                crate::config::CrossStream::WaitEvent => "wait_event",
                crate::config::CrossStream::Never => "never",
            }),
        ),
        ("fast_cache", Py::Bool(c.fast_cache)),
        ("global_lock", Py::Bool(c.global_lock)),
        ("biased_lanes", Py::Bool(c.biased_lanes)),
        ("expandable_segments", Py::Bool(c.expandable_segments && virtual_memory)),
        ("graph_capture_record_stream_reuse", Py::Bool(c.graph_capture_record_stream_reuse)),
        ("throw_on_cudamalloc_oom", Py::Bool(c.throw_on_oom)),
    ];
    v.push(("memory_limit", c.memory_limit.map_or(Py::None, Py::int)));
    v.push(("per_process_memory_fraction", c.memory_fraction.map_or(Py::None, Py::Float)));
    // PyTorch's key (0.0: off), and the other controls of issue 18.
    v.push((
        "garbage_collection_threshold",
        Py::Float(c.garbage_collection_threshold.unwrap_or(0.0)),
    ));
    v.push(("initial_pool_size", Py::int(c.initial_pool_size)));
    v.push(("max_pool_size", c.max_pool_size.map_or(Py::None, Py::int)));
    v.push(("caching", Py::Bool(c.caching)));
    Py::dict(v)
}
