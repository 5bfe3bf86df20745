//! Reader for PyTorch memory snapshots, as pickled by `torch.cuda.memory._dump_snapshot()`:
//!
//! ```text
//! { "segments": [ {"device": 0, "address": ..., "total_size": ..., "stream": ...,
//!                  "blocks": [ {"address": ..., "size": ..., "requested_size": ...,
//!                               "state": "active_allocated" | "active_pending_free" | "inactive"}, ...]},
//!                 ... ],
//!   "device_traces": [                       <- one list per device, oldest entry first
//!       [ {"action": "alloc", "addr": 139..., "size": 512, "stream": 0, "time_us": ..., ...},
//!         {"action": "free_requested", ...}, {"action": "free_completed", ...},
//!         {"action": "segment_alloc", ...}, ... ],
//!       ... ],
//!   "allocator_settings": {...},             <- PyTorch 2.1+ (optional)
//!   "external_annotations": [ {"stage": "START", "name": ..., "device": 0, "time_us": ...}, ...] }
//! ```
//!
//! One [`Trace`] per device that has trace entries or segments; each device has its own
//! address map and its own stream ids (handle 0 stays 0, others 1, 2, … in order of first
//! appearance), and is replayed on its own simulated device. When every entry of a device has
//! a `time_us`, the entries are put in time order (a stable sort: ties keep the list's order).
//!
//! Actions, as PyTorch's viewer (`MemoryViz.js`, `process_alloc_data`) reads them:
//!
//! | action                                   | becomes                                          |
//! |------------------------------------------|--------------------------------------------------|
//! | `alloc`                                  | an alloc                                         |
//! | `free_completed`, `free`                 | the free                                         |
//! | `free_requested`                         | the free when the device has neither of the two above, else skipped |
//! | `segment_alloc`/`_free`/`_map`/`_unmap`  | skipped; PyTorch's reserved bytes ([`RecordedReserved`](crate::snapshot::RecordedReserved)) |
//! | `oom`, `snapshot`, `user_defined`, `annotate` | skipped (markers)                          |
//! | any other                                | skipped, and said in a note                      |
//!
//! Skipped entries are counted by action in [`Trace::skipped`]; an action this reader does not
//! know (PyTorch keeps adding them) is skipped as `MemoryViz.js` skips it, counted as
//! `NAME (unknown action)` (eight names at most, then `other unknown actions`) and named in a
//! note of [`SnapshotInfo::notes`], which the replay prints. Blocks allocated before the
//! recorded window (PyTorch records history in a ring buffer) are live from its start: a free
//! of an address the window never allocated gets a synthetic alloc at the start of the trace,
//! and so does every block of `segments` that holds memory and is not live at the end of the
//! window: `active_allocated` (its `requested_size`; PyTorch 1.13's blocks have none: the
//! first `history` record's `real_size`, as `_memory_viz.py` reads it), and
//! `active_pending_free` where `free_completed` is the free (its memory is not reusable until
//! that entry, after the snapshot). Those are live at the start and at the end of the window
//! and are tagged [`Tag::Param`] (persistent: weights, optimizer state), everything else
//! [`Tag::Act`]. A device with segments but no entries (snapshot taken without
//! `_record_memory_history()`) becomes the static picture: those persistent blocks and nothing
//! else, with [`SnapshotInfo::history`] false.
//!
//! A free of an address the window freed already and has not allocated since is no such block
//! (it would have overlapped the window's own; PyTorch frees a block once) but a double free,
//! [`ErrorKind::FreeOfUnknownAddress`] — unless the device has no `alloc` entry at all
//! (`skip_actions`), where every free is of an unseen block, or has an action this reader does
//! not know, which may have allocated it. A free recorded with another size than its alloc's
//! (PyTorch records both with the requested size) frees the block the alloc made: it is
//! replayed at the alloc's size and a note counts such frees (the RMM reader refuses them,
//! since RMM's `deallocate` frees the bytes it is given).
//!
//! `external_annotations` START/END pairs (PyTorch 2.5+, e.g. `Optimizer.step#AdamW.step`) of a
//! device whose entries have `time_us` become scope markers: the scope is entered before the
//! first entry at or after START and left before the first entry after END. Only outermost
//! pairs become scopes (tidepool's scopes do not nest); the others are counted as skipped, and
//! so are records of any other stage.
//! `user_defined` entries carry no range and do not delimit scopes.
//!
//! Decoding: the pickle is read into memory (at most the cap of [`super::ReadOptions`]) and
//! decoded by [`super::pickle`], which shares what the pickle shares (PyTorch shares each
//! traceback, its frame list and dicts, between the entries that recorded it) instead of
//! copying it, holds at most one value per input byte, and refuses nesting deeper than 128
//! levels and anything but plain data. Frames are not read. Nothing is pre-allocated from a
//! number found in the input. A list the pickle shares between devices or segments is read
//! once per reference, as Python sees it, but the entries and blocks read are at most one per
//! byte of the pickle (`Budget`; a hostile pickle made n² events of n bytes), and a record of
//! more than 256 items is refused (`MAX_RECORD_KEYS`; its keys are looked up by a scan).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::Read;
use std::sync::Arc;

use super::pickle::{self, Obj, Seq};

use super::rmm_log::StreamIds;
use crate::error::{ErrorKind, Location, TraceError, echo, echo_cut};
use crate::event::{Event, Op, Tag, Trace};
use crate::snapshot::{AllocatorSettings, SnapshotInfo};
use crate::validate::Validator;

/// How to record a snapshot that tidepool can replay.
pub const HOW_TO_RECORD: &str = "call torch.cuda.memory._record_memory_history(max_entries=100000) \
     before the workload and torch.cuda.memory._dump_snapshot(\"snapshot.pickle\") after it";

/// Reads a pickled PyTorch memory snapshot: one trace per device (see the module docs), holding
/// at most [`super::DEFAULT_MAX_INPUT`] bytes of pickle in memory.
pub fn read_pytorch_snapshot<R: Read>(input: R, name: &str) -> Result<Vec<Trace>, TraceError> {
    read_capped(input, name, super::DEFAULT_MAX_INPUT)
}

/// [`read_pytorch_snapshot`] with a cap on the bytes read into memory.
pub(super) fn read_capped<R: Read>(
    input: R,
    name: &str,
    cap: u64,
) -> Result<Vec<Trace>, TraceError> {
    let mut data = Vec::new();
    input
        .take(cap.saturating_add(1))
        .read_to_end(&mut data)
        .map_err(|e| TraceError::input(ErrorKind::Io(e.to_string())))?;
    if data.len() as u64 > cap {
        return Err(TraceError::input(ErrorKind::InputTooLarge { cap, decompressed: false }));
    }
    // The decoder's messages are short (it cuts what it quotes from the input).
    let decoded = pickle::decode(data).map_err(|e| TraceError::input(ErrorKind::BadPickle(e)))?;
    from_value(decoded.root(), name)
}

/// Most items a record of the snapshot may have: a trace entry, segment, block, annotation, a
/// block's first `history` record, `allocator_settings` and its `roundup_power2_divisions`.
/// PyTorch's have about a dozen keys. A record's keys are looked up one by one, each by a scan
/// of its items, so a wide dict that the pickle shares between many records (its items written
/// once, one `DUP` byte per reference) made reading quadratic in the input: 16 001 items shared
/// by 32 000 entries (64 KB) took 1.3 s, 256 KB 19 s. The settings' values are each formatted
/// and their keys sorted, so 20 000 keys naming one shared 200 KB string (400 KB) took 2.5 s.
const MAX_RECORD_KEYS: usize = 256;

/// Checks that `v` is a record: a dict of at most [`MAX_RECORD_KEYS`] items.
fn record(v: Obj<'_>, what: &dyn Fn(String) -> TraceError) -> Result<(), TraceError> {
    match v {
        // BROKEN (`wide_records_scanned`): any dict taken, its keys scanned per lookup.
        Obj::Dict(d)
            if d.len() <= MAX_RECORD_KEYS || cfg!(tidepool_broken = "wide_records_scanned") =>
        {
            Ok(())
        }
        Obj::Dict(d) => Err(what(format!(
            "a dict of {} items; this reader takes at most {MAX_RECORD_KEYS} (PyTorch writes \
             about a dozen)",
            d.len()
        ))),
        _ => Err(what("not a dict".into())),
    }
}

fn bad(kind: String) -> TraceError {
    TraceError::input(ErrorKind::BadStructure(kind))
}

fn key<'a>(dict: Obj<'a>, name: &str) -> Option<Obj<'a>> {
    match dict {
        Obj::Dict(map) => map.get(name),
        _ => None,
    }
}

fn as_u64(v: Obj<'_>) -> Option<u64> {
    match v {
        Obj::Int(i) => u64::try_from(i).ok(),
        Obj::Bool(b) => Some(u64::from(b)),
        _ => None,
    }
}

fn as_i128(v: Obj<'_>) -> Option<i128> {
    match v {
        Obj::Int(i) => Some(i),
        Obj::Bool(b) => Some(i128::from(b)),
        _ => None,
    }
}

/// A `time_us` value: an integer, in microseconds.
fn time_us(v: Obj<'_>) -> Result<i128, String> {
    match v {
        // BROKEN (`time_us_big_unnamed`): a huge integer was said not to be one.
        Obj::BigInt if !cfg!(tidepool_broken = "time_us_big_unnamed") => {
            Err("`time_us` is an integer outside ±2^127 microseconds".into())
        }
        v => as_i128(v).ok_or_else(|| "`time_us` is not an integer".into()),
    }
}

/// A required non-negative integer field; `what` names the record in the message.
fn field(dict: Obj<'_>, k: &str, what: &dyn Fn(String) -> TraceError) -> Result<u64, TraceError> {
    let v = key(dict, k).ok_or_else(|| what(format!("missing key `{k}`")))?;
    as_u64(v).ok_or_else(|| what(format!("`{k}` is not a non-negative integer below 2^64")))
}

/// An optional stream handle (`None` or absent: the default stream).
fn stream_field(dict: Obj<'_>, what: &dyn Fn(String) -> TraceError) -> Result<u64, TraceError> {
    match key(dict, "stream") {
        None | Some(Obj::None) => Ok(0),
        Some(_) => field(dict, "stream", what),
    }
}

/// Why a list is not a snapshot, and what to record instead.
fn list_message(items: Seq<'_>) -> String {
    let segment_like = |v: Obj<'_>| {
        record(v, &bad).is_ok() && (key(v, "total_size").is_some() || key(v, "blocks").is_some())
    };
    if !items.is_empty() && items.iter().all(segment_like) {
        format!(
            "the pickle is a list of {}, as torch.cuda.memory_snapshot() returns: the caching \
             allocator's state with no allocation history, which cannot be replayed. Record a \
             snapshot instead: {HOW_TO_RECORD}",
            count(items.len() as u64, "segment")
        )
    } else {
        format!(
            "the pickle is a list of {}, not a dict (torch.cuda.memory_snapshot() returns a \
             list of segments, which cannot be replayed). Record a snapshot instead: \
             {HOW_TO_RECORD}",
            count(items.len() as u64, "item")
        )
    }
}

/// `n things` (`1 thing`).
fn count(n: u64, thing: &str) -> String {
    if n == 1 { format!("1 {thing}") } else { format!("{n} {thing}s") }
}

/// A block of a segment that holds memory: `active_allocated`, or `active_pending_free` (freed,
/// its memory not reusable until the streams that used it are done: its `free_completed`).
struct Block {
    address: u64,
    size: u64,
    requested: u64,
    /// `active_pending_free`.
    pending: bool,
}

/// A segment of `segments`, with its blocks that hold memory.
struct Segment {
    total_size: u64,
    stream: u64,
    blocks: Vec<Block>,
}

fn parse_segments(
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
struct Budget {
    left: usize,
    bytes: usize,
}

impl Budget {
    fn new(bytes: usize) -> Self {
        Budget { left: bytes, bytes }
    }

    /// Takes `n` records of a list about to be read; `what` places the error.
    fn take(&mut self, n: usize, what: &dyn Fn(String) -> TraceError) -> Result<(), TraceError> {
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

/// `text` cut to `max` characters (settings are shown in full unless absurdly long), control
/// characters escaped ([`echo_cut`]).
fn cut(text: &str, max: usize) -> String {
    echo_cut(text, max)
}

fn parse_settings(v: Option<Obj<'_>>) -> Result<Option<AllocatorSettings>, TraceError> {
    let map = match v {
        None | Some(Obj::None) => return Ok(None),
        Some(v @ Obj::Dict(m)) => {
            record(v, &|e| bad(format!("allocator_settings: {e}")))?;
            m
        }
        Some(_) => return Err(bad("`allocator_settings` is not a dict".into())),
    };
    // String keys in order, each once with its last value (as Python's dict holds them).
    let map: BTreeMap<&str, Obj<'_>> = map
        .iter()
        .filter_map(|(k, v)| match k {
            Obj::Str(k) => Some((k, v)),
            _ => None,
        })
        .collect();
    let mut s = AllocatorSettings::default();
    for (k, val) in map {
        let text = match val {
            Obj::Str(t) => format!("{t:?}"),
            Obj::Bool(b) => if b { "True" } else { "False" }.to_string(),
            Obj::Dict(_) => "{…}".to_string(),
            other => as_i128(other).map(|i| i.to_string()).unwrap_or_else(|| "…".into()),
        };
        match (k, val) {
            ("PYTORCH_CUDA_ALLOC_CONF", Obj::Str(t)) => s.conf = t.to_string(),
            ("max_split_size", v) => s.max_split_size = as_i128(v),
            ("expandable_segments", Obj::Bool(b)) => s.expandable_segments = Some(b),
            ("roundup_power2_divisions", v @ Obj::Dict(d)) => {
                record(v, &|e| bad(format!("allocator_settings.roundup_power2_divisions: {e}")))?;
                // Keys `"1024"` or `1024`, each once with its last value.
                let unique: BTreeMap<Result<i64, &str>, Obj<'_>> = d
                    .iter()
                    .filter_map(|(k, v)| match k {
                        Obj::Str(s) => Some((Err(s), v)),
                        Obj::Int(i) => Some((Ok(i64::try_from(i).ok()?), v)),
                        _ => None,
                    })
                    .collect();
                let mut r: Vec<(u64, String, u64)> = unique
                    .into_iter()
                    .filter_map(|(k, v)| {
                        let name = match k {
                            Err(s) => cut(s, 64),
                            Ok(i) => i.to_string(),
                        };
                        Some((name.parse().unwrap_or(u64::MAX), name, as_u64(v)?))
                    })
                    .collect();
                r.sort();
                s.roundup_power2_divisions = r.into_iter().map(|(_, k, v)| (k, v)).collect();
            }
            ("roundup_power2_divisions", v) => {
                if let Some(n) = as_u64(v) {
                    s.roundup_power2_divisions = vec![(String::new(), n)];
                }
            }
            _ => {}
        }
        s.entries.push((cut(k, 64), cut(&text, 256)));
    }
    // Floats are not shown (as before this decoder, which zeroed them: the figures stay the
    // same), and dicts have no short text: write those from what was read.
    let gc = s.conf_value("garbage_collection_threshold").map(|v| cut(v, 64));
    let roundup = s.roundup_summary();
    for (k, v) in &mut s.entries {
        match k.as_str() {
            "garbage_collection_threshold" => *v = gc.clone().unwrap_or_else(|| "0".into()),
            "roundup_power2_divisions" => *v = roundup.clone(),
            _ => {}
        }
    }
    Ok(Some(s))
}

/// One `external_annotations` record.
struct Annotation {
    device: u64,
    /// START (`true`) or END; `None`: another stage (skipped).
    stage: Option<bool>,
    name: String,
    time: i128,
}

fn parse_annotations(v: Option<Obj<'_>>) -> Result<Vec<Annotation>, TraceError> {
    let list = match v {
        None | Some(Obj::None) => return Ok(Vec::new()),
        Some(Obj::List(l)) => l,
        Some(_) => return Err(bad("`external_annotations` is not a list".into())),
    };
    let mut out = Vec::new();
    for (i, a) in list.iter().enumerate() {
        let what = |m: String| bad(format!("external_annotations[{i}]: {m}"));
        record(a, &what)?;
        let start = match key(a, "stage") {
            Some(Obj::Str("START")) => true,
            Some(Obj::Str("END")) => false,
            // A stage PyTorch may add: no scope, skipped and counted on its device.
            // BROKEN (`annotation_stage_refused`): it refused the whole snapshot.
            Some(Obj::Str(_)) if !cfg!(tidepool_broken = "annotation_stage_refused") => {
                out.push(Annotation {
                    device: field(a, "device", &what)?,
                    stage: None,
                    name: String::new(),
                    time: 0,
                });
                continue;
            }
            Some(Obj::Str(_)) => return Err(what("`stage` is not START or END".into())),
            _ => return Err(what("missing or non-string `stage`".into())),
        };
        let name = match key(a, "name") {
            Some(Obj::Str(s)) => echo(s),
            _ => return Err(what("missing or non-string `name`".into())),
        };
        let device = field(a, "device", &what)?;
        let time = match key(a, "time_us") {
            Some(v) => time_us(v).map_err(what)?,
            None => return Err(what("missing key `time_us`".into())),
        };
        out.push(Annotation { device, stage: Some(start), name, time });
    }
    Ok(out)
}

/// Builds one trace per device from an already decoded snapshot (see the module docs).
///
/// `value` is the root of a decoded pickle ([`super::pickle::decode`], [`Pickle::root`]).
///
/// [`Pickle::root`]: super::pickle::Pickle::root
pub fn from_value(value: Obj<'_>, name: &str) -> Result<Vec<Trace>, TraceError> {
    let input_bytes = match value {
        Obj::Dict(d) => d.input_bytes(),
        Obj::List(items) => return Err(bad(list_message(items))),
        _ => return Err(bad("the pickle is not a dict".into())),
    };
    let devices = match key(value, "device_traces") {
        Some(Obj::List(d)) => d,
        Some(_) => return Err(bad("`device_traces` is not a list".into())),
        None => {
            return Err(bad(format!(
                "no `device_traces` key; to record a snapshot, {HOW_TO_RECORD}"
            )));
        }
    };
    let mut budget = Budget::new(input_bytes);
    let segments = parse_segments(key(value, "segments"), &mut budget)?;
    let settings = parse_settings(key(value, "allocator_settings"))?.map(Arc::new);
    let annotations = parse_annotations(key(value, "external_annotations"))?;
    let mut indices: BTreeSet<u32> = segments.keys().copied().collect();
    for i in 0..devices.len() {
        indices.insert(u32::try_from(i).map_err(|_| bad("more than 2^32 devices".into()))?);
    }
    let mut by_device: BTreeMap<u64, Vec<&Annotation>> = BTreeMap::new();
    for a in &annotations {
        by_device.entry(a.device).or_default().push(a);
    }
    let mut traces = Vec::new();
    for d in indices {
        let entries = match devices.get(d as usize) {
            Some(Obj::List(e)) => Some(e),
            Some(_) => return Err(bad(format!("device_traces[{d}] is not a list"))),
            None => None,
        };
        let n = entries.map_or(0, |e| e.len());
        budget.take(n, &|m| bad(format!("device_traces[{d}]: {m}")))?;
        let segs = segments.get(&d).map(Vec::as_slice).unwrap_or(&[]);
        if entries.is_none_or(|e| e.is_empty()) && segs.is_empty() {
            continue;
        }
        let anns = by_device.get(&u64::from(d)).map(Vec::as_slice).unwrap_or(&[]);
        let input = DeviceInput { device: d, entries, segments: segs, annotations: anns };
        traces.push(device_trace(&input, settings.as_ref(), name)?);
    }
    if traces.is_empty() {
        return Err(bad(format!(
            "the snapshot holds no allocations: every list of `device_traces` is empty (it was \
             taken without torch.cuda.memory._record_memory_history()) and no device has \
             segments. To record one, {HOW_TO_RECORD}"
        )));
    }
    Ok(traces)
}

/// What a trace entry does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Alloc,
    /// `free_completed` or `free`.
    Free,
    FreeRequested,
    /// `segment_alloc`, `segment_map`: reserved grows.
    SegmentUp,
    /// `segment_free`, `segment_unmap`: reserved shrinks.
    SegmentDown,
    /// `oom`, `snapshot`, `user_defined`, `annotate`.
    Marker,
    /// An action this reader does not know: skipped, counted and noted.
    Unknown,
}

/// Distinct unknown actions counted under their own names; more are counted together (the
/// names come from the input, so their number is bounded here, not by it).
const MAX_UNKNOWN_NAMES: usize = 8;

/// The unknown actions of one device, for the skipped counts and the note.
#[derive(Default)]
struct Unknown {
    /// Distinct names seen (at most [`MAX_UNKNOWN_NAMES`]), each cut by `echo`.
    names: Vec<String>,
    entries: u64,
}

impl Unknown {
    fn skip(&mut self, name: &str, trace: &mut Trace) {
        self.entries += 1;
        let name = echo(name);
        if !self.names.contains(&name) {
            if self.names.len() == MAX_UNKNOWN_NAMES {
                trace.skip("other unknown actions");
                return;
            }
            self.names.push(name.clone());
        }
        trace.skip(&format!("{name} (unknown action)"));
    }

    fn note(&self) -> Option<String> {
        if self.entries == 0 {
            return None;
        }
        let names: Vec<String> = self.names.iter().map(|n| format!("`{n}`")).collect();
        let more = if self.names.len() == MAX_UNKNOWN_NAMES { " and others" } else { "" };
        Some(format!(
            "{} of action{} {}{more} unknown to this reader {} skipped (as PyTorch's viewer \
             skips them); if such an entry allocates or frees memory, the replay misses it",
            if self.entries == 1 { "1 entry".into() } else { format!("{} entries", self.entries) },
            if self.names.len() == 1 && more.is_empty() { "" } else { "s" },
            names.join(", "),
            if self.entries == 1 { "was" } else { "were" },
        ))
    }
}

/// One trace entry with what the reader uses.
struct Entry<'a> {
    index: usize,
    action: Action,
    /// The action's name (for counting skipped entries).
    name: &'a str,
    addr: u64,
    size: u64,
    stream: u64,
    time: Option<i128>,
}

/// Frees recorded with another size than their allocation's: how many, and the first.
#[derive(Default)]
struct Resized {
    frees: u64,
    /// The first: its entry's index, the allocation's size and the free's.
    first: Option<(usize, u64, u64)>,
}

impl Resized {
    fn see(&mut self, index: usize, allocated: u64, freed: u64) {
        self.frees += 1;
        self.first.get_or_insert((index, allocated, freed));
    }

    fn note(&self) -> Option<String> {
        let (index, allocated, freed) = self.first?;
        let (count, first, each) = match self.frees {
            1 => ("1 free was".to_string(), "", "it is"),
            n => (format!("{n} frees were"), "the first, ", "each is"),
        };
        Some(format!(
            "{count} recorded with another size than its allocation's ({first}entry {index}: \
             {freed} B freed, {allocated} B allocated); {each} replayed as a free of the block \
             its allocation made"
        ))
    }
}

fn parse_entry(device: usize, index: usize, entry: Obj<'_>) -> Result<Entry<'_>, TraceError> {
    let structure =
        |s: String| TraceError::new(Location::Entry { device, index }, ErrorKind::BadStructure(s));
    match entry {
        Obj::Dict(_) => record(entry, &structure)?,
        _ => return Err(structure("entry is not a dict".into())),
    }
    let name = match key(entry, "action") {
        Some(Obj::Str(s)) => s,
        Some(_) => return Err(structure("`action` is not a string".into())),
        None => return Err(structure("missing key `action`".into())),
    };
    let action = match name {
        "alloc" => Action::Alloc,
        "free_completed" | "free" => Action::Free,
        "free_requested" => Action::FreeRequested,
        "segment_alloc" | "segment_map" => Action::SegmentUp,
        "segment_free" | "segment_unmap" => Action::SegmentDown,
        // `workspace_snapshot`: torch_npu (Ascend) writes the same snapshot format with it.
        "oom" | "snapshot" | "user_defined" | "workspace_snapshot" => Action::Marker,
        // `annotate` (`torch.cuda.memory._annotate_memory`, PyTorch's main branch): metadata
        // attached to a live allocation, its `addr` that allocation's: nothing is allocated or
        // freed.
        // BROKEN (`annotate_refused`): an unknown action that refused the whole snapshot.
        #[cfg(not(tidepool_broken = "annotate_refused"))]
        "annotate" => Action::Marker,
        // Any other action is one this reader does not know (PyTorch keeps adding them):
        // skipped and counted, as `MemoryViz.js` ignores it, with a note (see `Unknown`).
        // BROKEN (`unknown_action_refused`): it refused the whole snapshot.
        #[cfg(not(tidepool_broken = "unknown_action_refused"))]
        _ => Action::Unknown,
        #[cfg(tidepool_broken = "unknown_action_refused")]
        other => {
            return Err(TraceError::new(
                Location::Entry { device, index },
                ErrorKind::UnknownOp(echo(other)),
            ));
        }
    };
    let time = match key(entry, "time_us") {
        None | Some(Obj::None) => None,
        Some(v) => Some(time_us(v).map_err(structure)?),
    };
    let (addr, size, stream) = if matches!(action, Action::Marker | Action::Unknown) {
        (0, 0, 0)
    } else {
        (
            field(entry, "addr", &structure)?,
            field(entry, "size", &structure)?,
            stream_field(entry, &structure)?,
        )
    };
    Ok(Entry { index, action, name, addr, size, stream, time })
}

/// One device's part of the snapshot.
struct DeviceInput<'a> {
    device: u32,
    /// The device's list of entries (`None`: none).
    entries: Option<Seq<'a>>,
    segments: &'a [Segment],
    annotations: &'a [&'a Annotation],
}

/// Scope markers from annotations, placed between entries by time.
struct Scopes<'a> {
    /// (time, START?, name), in time order.
    pending: Vec<(i128, bool, &'a str)>,
    next: usize,
    /// The open outermost scope: (index in scope_names, instance id, name).
    open: Option<(u32, u64, &'a str)>,
    /// Names of open annotations nested in it (skipped).
    nested: Vec<&'a str>,
    instances: u64,
    /// Scope name -> index in `scope_names`.
    index: HashMap<&'a str, u32>,
}

impl<'a> Scopes<'a> {
    fn new(annotations: &[&'a Annotation]) -> Self {
        let mut pending: Vec<(i128, bool, &str)> =
            annotations.iter().filter_map(|a| Some((a.time, a.stage?, a.name.as_str()))).collect();
        pending.sort_by_key(|&(t, _, _)| t);
        Scopes {
            pending,
            next: 0,
            open: None,
            nested: Vec::new(),
            instances: 0,
            index: HashMap::new(),
        }
    }

    /// Emits the markers due before an entry at `time` (all remaining ones when `None`).
    fn emit(
        &mut self,
        time: Option<i128>,
        trace: &mut Trace,
        out: &mut Vec<(Event, i128)>,
        at: i128,
    ) {
        while let Some(&(t, start, name)) = self.pending.get(self.next) {
            let due = match time {
                None => true,
                Some(now) => {
                    if start {
                        t <= now
                    } else {
                        t < now
                    }
                }
            };
            if !due {
                break;
            }
            self.next += 1;
            if start {
                if self.open.is_some() {
                    self.nested.push(name);
                    trace.skip("external_annotations (nested)");
                    continue;
                }
                let index = *self.index.entry(name).or_insert_with(|| {
                    trace.scope_names.push(name.to_string());
                    u32::try_from(trace.scope_names.len() - 1).unwrap_or(u32::MAX)
                });
                let id = self.instances;
                self.instances += 1;
                self.open = Some((index, id, name));
                out.push((marker(Op::ScopeEnter, id, index), at));
            } else if self.nested.last() == Some(&name) {
                self.nested.pop();
            } else {
                match self.open {
                    Some((index, id, open)) if open == name => {
                        out.push((marker(Op::ScopeExit, id, index), at));
                        self.open = None;
                        self.nested.clear();
                    }
                    _ => trace.skip("external_annotations (END without START)"),
                }
            }
        }
    }

    /// Closes a scope still open at the end of the window.
    fn close(&mut self, out: &mut Vec<(Event, i128)>, at: i128) -> Option<&'a str> {
        let (index, id, name) = self.open.take()?;
        out.push((marker(Op::ScopeExit, id, index), at));
        Some(name)
    }
}

fn marker(op: Op, id: u64, scope: u32) -> Event {
    Event { op, id, bytes: 0, stream: 0, tag: Tag::Act, scope: Some(scope) }
}

fn clamp_u64(x: i128) -> u64 {
    u64::try_from(x.max(0)).unwrap_or(u64::MAX)
}

/// Builds the trace of one device: in time order when the entries have times, else (or when
/// time order is not a consistent history: a clock that stepped back between two entries
/// can put an alloc before the free of the block it reuses) in the list's order, the order
/// PyTorch recorded them in under its allocator lock.
fn device_trace(
    input: &DeviceInput<'_>,
    settings: Option<&Arc<AllocatorSettings>>,
    name: &str,
) -> Result<Trace, TraceError> {
    match device_trace_in(input, settings, name, true) {
        // BROKEN (`time_order_only`): no second reading in list order.
        Err(e)
            if matches!(
                e.kind,
                ErrorKind::AllocOfLiveAddress(_) | ErrorKind::FreeOfUnknownAddress(_)
            ) && !cfg!(tidepool_broken = "time_order_only") =>
        {
            let mut trace = device_trace_in(input, settings, name, false).map_err(|_| e)?;
            if let Some(info) = trace.snapshot.as_mut() {
                info.notes.push(
                    "in time_us order the entries allocate a live address or free one twice; \
                     they were read in the order of the list"
                        .into(),
                );
            }
            Ok(trace)
        }
        other => other,
    }
}

fn device_trace_in(
    input: &DeviceInput<'_>,
    settings: Option<&Arc<AllocatorSettings>>,
    name: &str,
    time_order: bool,
) -> Result<Trace, TraceError> {
    let device = input.device as usize;
    let mut entries = input
        .entries
        .iter()
        .flat_map(|e| e.iter())
        .enumerate()
        .map(|(i, e)| parse_entry(device, i, e))
        .collect::<Result<Vec<_>, _>>()?;
    let mut info = SnapshotInfo {
        device: input.device,
        history: !entries.is_empty(),
        entries: entries.len() as u64,
        // BROKEN (`settings_copied_per_device`): each device's trace had a copy of its own.
        settings: match cfg!(tidepool_broken = "settings_copied_per_device") {
            true => settings.map(|s| Arc::new(AllocatorSettings::clone(s))),
            false => settings.cloned(),
        },
        ..SnapshotInfo::default()
    };
    let timed = !entries.is_empty() && entries.iter().all(|e| e.time.is_some());
    if timed {
        let out_of_order = entries.windows(2).filter(|w| w[1].time < w[0].time).count() as u64;
        info.reordered = if time_order { out_of_order } else { 0 };
        if info.reordered > 0 {
            entries.sort_by_key(|e| e.time);
            info.notes.push(match info.reordered {
                1 => "1 entry was out of time_us order and was put in order".into(),
                n => format!("{n} entries were out of time_us order and were put in order"),
            });
        }
    }
    let free_action = if entries.iter().any(|e| e.action == Action::Free) {
        Action::Free
    } else {
        Action::FreeRequested
    };

    let mut trace = Trace { name: name.to_string(), ..Trace::default() };
    let mut streams = StreamIds::default();
    let mut live: HashMap<u64, (u64, u64)> = HashMap::new(); // addr -> (id, bytes)
    // Addresses freed in the window and not allocated since.
    let mut freed: HashSet<u64> = HashSet::new();
    // Where no `alloc` is recorded (`skip_actions`), or an action this reader does not know
    // may have allocated, a second free may be of a block the reader did not see allocated.
    let double_free_known = entries.iter().any(|e| e.action == Action::Alloc)
        && !entries.iter().any(|e| e.action == Action::Unknown);
    let mut next_id = 0u64;
    let mut freed_before: Vec<Event> = Vec::new();
    // Body events with the change of reserved bytes since the start of the window.
    let mut body: Vec<(Event, i128)> = Vec::new();
    let (mut delta, mut max_delta, mut min_delta) = (0i128, 0i128, 0i128);
    let mut unknown = Unknown::default();
    let mut resized = Resized::default();
    let mut scopes = Scopes::new(input.annotations);
    for a in input.annotations {
        if a.stage.is_none() {
            trace.skip("external_annotations (stage neither START nor END)");
        }
    }
    if !timed && !scopes.pending.is_empty() {
        for _ in &scopes.pending {
            trace.skip("external_annotations (no time_us in the trace)");
        }
        scopes.pending.clear();
    }

    for e in &entries {
        if timed {
            scopes.emit(e.time, &mut trace, &mut body, delta);
        }
        let at = |kind| TraceError::new(Location::Entry { device, index: e.index }, kind);
        match e.action {
            Action::Alloc => {
                if live.contains_key(&e.addr) {
                    return Err(at(ErrorKind::AllocOfLiveAddress(e.addr)));
                }
                freed.remove(&e.addr);
                let stream = streams.id(e.stream);
                live.insert(e.addr, (next_id, e.size));
                body.push((Event::alloc(next_id, e.size, stream, Tag::Act), delta));
                next_id += 1;
            }
            a if a == free_action => {
                let stream = streams.id(e.stream);
                let (id, bytes) = match live.remove(&e.addr) {
                    Some(x) => {
                        freed.insert(e.addr);
                        // PyTorch records a free with its allocation's requested size: another
                        // size is a fork's or a broken recording. The free is of the block the
                        // allocation made, so it is replayed at that size, and a note says so
                        // (the RMM reader refuses one: RMM's `deallocate` frees the bytes it is
                        // given).
                        // BROKEN (`snapshot_resize_unnoted`): no note.
                        if x.1 != e.size && !cfg!(tidepool_broken = "snapshot_resize_unnoted") {
                            resized.see(e.index, x.1, e.size);
                        }
                        x
                    }
                    // Freed in the window and not allocated since: a block from before the
                    // window cannot be there (it would have overlapped the window's own), and
                    // PyTorch frees a block once.
                    // BROKEN (`snapshot_double_free_prewindow`): read as a block from before.
                    None if freed.contains(&e.addr)
                        && double_free_known
                        && !cfg!(tidepool_broken = "snapshot_double_free_prewindow") =>
                    {
                        return Err(at(ErrorKind::FreeOfUnknownAddress(e.addr)));
                    }
                    None => {
                        freed.insert(e.addr);
                        // Allocated before the recorded window: live from its start.
                        freed_before.push(Event::alloc(next_id, e.size, stream, Tag::Act));
                        trace.pre_window.freed_blocks += 1;
                        trace.pre_window.freed_bytes =
                            trace.pre_window.freed_bytes.saturating_add(e.size);
                        next_id += 1;
                        (next_id - 1, e.size)
                    }
                };
                body.push((Event::free(id, bytes, stream, Tag::Act), delta));
            }
            Action::SegmentUp | Action::SegmentDown => {
                let size = i128::from(e.size);
                delta += if e.action == Action::SegmentUp { size } else { -size };
                max_delta = max_delta.max(delta);
                min_delta = min_delta.min(delta);
                info.reserved.segment_events += 1;
                trace.skip(e.name);
            }
            Action::Free | Action::FreeRequested | Action::Marker => {
                trace.skip(e.name);
            }
            Action::Unknown => unknown.skip(e.name, &mut trace),
        }
    }
    info.notes.extend(unknown.note());
    info.notes.extend(resized.note());
    if timed {
        scopes.emit(None, &mut trace, &mut body, delta);
        if let Some(open) = scopes.close(&mut body, delta) {
            info.notes.push(format!(
                "annotation `{open}` has no END: its scope runs to the end of the window"
            ));
        }
    }
    info.annotation_scopes = scopes.instances;

    // Blocks live at the snapshot that the window never allocated: live throughout. A block
    // pending its free holds its memory until its `free_completed`, after the snapshot, so it is
    // live too where `free_completed` is the free; where `free_requested` is (no entry completes
    // a free), its free was requested in the window (and read there) or before it.
    let pending_live =
        free_action == Action::Free || !entries.iter().any(|e| e.action == Action::FreeRequested);
    let mut persistent: Vec<Event> = Vec::new();
    let mut at_snapshot: u128 = 0;
    for seg in input.segments {
        at_snapshot += u128::from(seg.total_size);
        for b in &seg.blocks {
            if live.contains_key(&b.address) || (b.pending && !pending_live) {
                continue;
            }
            let stream = streams.id(seg.stream);
            persistent.push(Event::alloc(next_id, b.requested, stream, Tag::Param));
            next_id += 1;
            trace.pre_window.live_blocks += 1;
            trace.pre_window.live_bytes = trace.pre_window.live_bytes.saturating_add(b.requested);
        }
    }

    // PyTorch's reserved bytes, backwards from the snapshot.
    let at_snapshot = i128::try_from(at_snapshot).unwrap_or(i128::MAX);
    let mut start = at_snapshot.saturating_sub(delta);
    info.reserved.consistent = start.saturating_add(min_delta) >= 0;
    if !info.reserved.consistent {
        start = -min_delta;
        info.notes.push(
            "the segment entries free more than the snapshot's segments account for; PyTorch's \
             reserved bytes are raised so that their lowest point is 0"
                .into(),
        );
    }
    info.reserved.at_start = clamp_u64(start);
    info.reserved.at_snapshot = clamp_u64(at_snapshot);
    info.reserved.peak = clamp_u64(start.saturating_add(max_delta));

    let prelude = persistent.len() + freed_before.len();
    let mut events = Vec::with_capacity(prelude + body.len());
    let mut timeline = Vec::with_capacity(prelude + body.len());
    for e in persistent.into_iter().chain(freed_before) {
        events.push(e);
        timeline.push(info.reserved.at_start);
    }
    for (e, d) in body {
        events.push(e);
        timeline.push(clamp_u64(start.saturating_add(d)));
    }
    info.reserved.timeline = timeline;
    trace.events = events;
    if !info.history {
        info.notes.push(format!(
            "no allocation history: the snapshot was taken without \
             torch.cuda.memory._record_memory_history(), so this is the static picture at the \
             snapshot ({} live, tagged persistent). To replay the workload, {HOW_TO_RECORD}",
            count(trace.pre_window.live_blocks, "block")
        ));
    }
    trace.snapshot = Some(info);

    let mut validator = Validator::new();
    for e in &trace.events {
        validator.check(e).map_err(|k| TraceError::new(Location::Input, k))?;
    }
    validator.finish().map_err(|k| TraceError::new(Location::Input, k))?;
    Ok(trace)
}
