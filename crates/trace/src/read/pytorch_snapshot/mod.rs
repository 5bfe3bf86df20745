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
//!
//! Here: reading a snapshot and its devices; records and their fields are read in `values.rs`,
//! `segments` in `segments.rs`, the settings and annotations in `settings.rs`, the entries in
//! `entries.rs`, and each device's trace is made in `device_trace.rs`.
//!
//! [`SnapshotInfo::notes`]: crate::snapshot::SnapshotInfo::notes
//! [`SnapshotInfo::history`]: crate::snapshot::SnapshotInfo::history
//! [`Tag::Param`]: crate::Tag::Param
//! [`Tag::Act`]: crate::Tag::Act

mod device_trace;
mod entries;
mod segments;
mod settings;
mod values;

use device_trace::{DeviceInput, device_trace};
use segments::{Budget, parse_segments};
use settings::{Annotation, parse_annotations, parse_settings};
use values::{bad, key, list_message};

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::sync::Arc;

use super::pickle::{self, Obj};
use crate::error::{ErrorKind, TraceError};
use crate::event::Trace;

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
    let recorded = |d: usize| matches!(devices.get(d), Some(Obj::List(e)) if !e.is_empty());
    let recorded_anywhere = (0..devices.len()).any(recorded);
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
        let input = DeviceInput {
            device: d,
            entries,
            segments: segs,
            annotations: anns,
            recorded_elsewhere: recorded_anywhere && !recorded(d as usize),
        };
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
