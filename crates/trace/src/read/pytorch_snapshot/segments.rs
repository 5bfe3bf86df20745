//! The snapshot's `segments`: the blocks allocated before the history began, and the per-byte
//! budget on what a pickle's shared lists make the reader read.

use super::values::{bad, field, key, record, stream_field};
use crate::error::TraceError;
use crate::read::pickle::Obj;
use std::collections::BTreeMap;

/// A block of a segment that holds memory: `active_allocated`, or `active_pending_free` (freed,
/// its memory not reusable until the streams that used it are done: its `free_completed`).
pub(super) struct Block {
    pub(super) address: u64,
    pub(super) size: u64,
    pub(super) requested: u64,
    /// `active_pending_free`.
    pub(super) pending: bool,
}

/// A segment of `segments`, with its blocks that hold memory.
pub(super) struct Segment {
    pub(super) total_size: u64,
    pub(super) stream: u64,
    pub(super) blocks: Vec<Block>,
}

pub(super) fn parse_segments(
    v: Option<Obj<'_>>,
    budget: &mut Budget,
) -> Result<BTreeMap<u32, Vec<Segment>>, TraceError> {
    let mut out: BTreeMap<u32, Vec<Segment>> = BTreeMap::new();
    let list = match v {
        None | Some(Obj::None) => return Ok(out),
        Some(Obj::List(l)) => l,
        Some(_) => return Err(bad("`segments` is not a list".into())),
    };
    for (i, seg) in list.iter().enumerate() {
        let what = |m: String| bad(format!("segments[{i}]: {m}"));
        record(seg, &what)?;
        let device = u32::try_from(field(seg, "device", &what)?)
            .map_err(|_| what("`device` is not below 2^32".into()))?;
        let address = field(seg, "address", &what)?;
        let total_size = field(seg, "total_size", &what)?;
        let stream = stream_field(seg, &what)?;
        let blocks = match key(seg, "blocks") {
            Some(Obj::List(b)) => b,
            Some(_) => return Err(what("`blocks` is not a list".into())),
            None => return Err(what("missing key `blocks`".into())),
        };
        budget.take(blocks.len(), &what)?;
        let mut at = address;
        let mut kept = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let what = |m: String| bad(format!("segments[{i}].blocks[{j}]: {m}"));
            record(b, &what)?;
            let size = field(b, "size", &what)?;
            // Older snapshots have no block `address`: blocks follow each other from the
            // segment's address.
            let addr = match key(b, "address") {
                Some(_) => field(b, "address", &what)?,
                None => at,
            };
            at = addr.checked_add(size).ok_or_else(|| what("block ends past 2^64".into()))?;
            let state = match key(b, "state") {
                Some(Obj::Str(s)) => s,
                _ => return Err(what("missing or non-string `state`".into())),
            };
            // BROKEN (`pending_dropped`): an `active_pending_free` block was dropped.
            let pending =
                state == "active_pending_free" && !cfg!(tidepool_broken = "pending_dropped");
            if state == "active_allocated" || pending {
                let requested = match key(b, "requested_size") {
                    Some(_) => field(b, "requested_size", &what)?,
                    None => legacy_requested(b, size, &what)?,
                };
                // PyTorch's block holds its request rounded up: a larger request would make a
                // block live from the window's start with bytes no segment has.
                // BROKEN (`segment_blocks_unchecked`): taken as written.
                if requested > size && !cfg!(tidepool_broken = "segment_blocks_unchecked") {
                    return Err(what(format!(
                        "`requested_size` {requested} is larger than the block's `size` {size}"
                    )));
                }
                kept.push(Block { address: addr, size, requested, pending });
            }
        }
        out.entry(device).or_default().push(Segment { total_size, stream, blocks: kept });
    }
    // Blocks that hold memory do not overlap: two at one address (or one inside another) would
    // be live together from the window's start, their bytes counted twice in peak live and in
    // every replay.
    // BROKEN (`segment_blocks_unchecked`): overlapping blocks all taken.
    for (device, segs) in &out {
        if cfg!(tidepool_broken = "segment_blocks_unchecked") {
            break;
        }
        let mut spans: Vec<(u64, u64)> =
            segs.iter().flat_map(|s| s.blocks.iter().map(|b| (b.address, b.size))).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            let ((a, size), (b, _)) = (w[0], w[1]);
            if a.saturating_add(size) > b || a == b {
                return Err(bad(format!(
                    "segments: two blocks that hold memory on device {device} overlap: \
                     {size} B at {a:#x} and a block at {b:#x}"
                )));
            }
        }
    }
    Ok(out)
}

/// The entries and blocks left to read: one per byte of the pickle. A pickle shares an object
/// its pickler met twice, and the decoder keeps it shared (one value per input byte at most),
/// so a list of entries or blocks written once may be referenced by every device or segment;
/// each reference reads it again, as Python sees it (PyTorch writes a list of its own for each,
/// so its snapshots take a few percent of this budget). Without a bound, n bytes of pickle
/// made n² events: 5 000 devices over one list of 10 000 entries (30 KB) became 5 000 traces
/// of 10 000 events (2.7 GB, 31 s of `tidepool replay`), and 8 000 segments over one list of
/// 8 000 blocks (32 KB) asked for a 1 GB vector and aborted.
pub(super) struct Budget {
    left: usize,
    bytes: usize,
}

impl Budget {
    pub(super) fn new(bytes: usize) -> Self {
        Budget { left: bytes, bytes }
    }

    /// Takes `n` records of a list about to be read; `what` places the error.
    pub(super) fn take(
        &mut self,
        n: usize,
        what: &dyn Fn(String) -> TraceError,
    ) -> Result<(), TraceError> {
        // BROKEN (`shared_lists_reread`): every reference read in full, unbounded.
        if cfg!(tidepool_broken = "shared_lists_reread") {
            return Ok(());
        }
        self.left = self.left.checked_sub(n).ok_or_else(|| {
            what(format!(
                "the pickle's lists of entries and blocks, each read once per reference to it, \
                 hold more than one record per byte of its {} B (a list shared between devices \
                 or segments: PyTorch writes one per device and per segment)",
                self.bytes
            ))
        })?;
        Ok(())
    }
}

/// The requested bytes of a block with no `requested_size` (PyTorch 1.13): its `history`'s first
/// record's `real_size` (the current allocation's, newest first), as `_memory_viz.py` reads it,
/// else the block's size.
fn legacy_requested(
    b: Obj<'_>,
    size: u64,
    what: &dyn Fn(String) -> TraceError,
) -> Result<u64, TraceError> {
    // BROKEN (`history_size_ignored`): the block's rounded size, with the history there.
    if cfg!(tidepool_broken = "history_size_ignored") {
        return Ok(size);
    }
    match key(b, "history") {
        Some(Obj::List(h)) if !h.is_empty() => match h.get(0) {
            Some(first @ Obj::Dict(_)) => {
                let what = |m| what(format!("history[0]: {m}"));
                record(first, &what)?;
                match key(first, "real_size") {
                    Some(_) => field(first, "real_size", &what),
                    None => Ok(size),
                }
            }
            _ => Ok(size),
        },
        _ => Ok(size),
    }
}
