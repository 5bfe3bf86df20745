//! Reader for PyTorch memory snapshots, as pickled by `torch.cuda.memory._dump_snapshot()`:
//!
//! ```text
//! { "segments": [...],                       <- ignored
//!   "device_traces": [                       <- one list per device
//!       [ {"action": "alloc", "addr": 139..., "size": 512, "stream": 0, "frames": [...], ...},
//!         {"action": "free_requested", ...}, {"action": "free_completed", ...},
//!         {"action": "segment_alloc", ...}, ... ],
//!       ... ] }
//! ```
//!
//! The pickle is decoded to a generic [`serde_pickle::Value`] and walked. `alloc` becomes
//! [`Op::Alloc`](crate::Op); `free_completed` becomes the free (or `free_requested`
//! for a device list that has no `free_completed` at all); the other free variant and
//! `segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`, `snapshot`, `oom` are
//! skipped and counted in [`Trace::skipped_records`]. Addresses become ids through a map of
//! live addresses (a reused address gets a fresh id); streams become dense ids per
//! (device, stream), 0 staying 0. All buffers are tagged [`Tag::Act`].
//!
//! PyTorch records history in a ring buffer (`max_entries`), so a snapshot can free a block
//! allocated before the window. Like PyTorch's own `_memory_viz`, such a block is treated as
//! allocated before the first entry: a synthetic alloc (with the free's `size`) is placed at
//! the start of the trace. Multi-device snapshots are read device after device, each with its
//! own address map.
//!
//! The pickle is decoded with serde-pickle's `replace_recursive_structures` option, because
//! PyTorch shares frame objects between entries (see [`read_pytorch_snapshot`]).
//!
//! Safety of decoding: the pickle is read into memory and scanned first
//! ([`super::pickle_guard`]), which rejects nesting deeper than 128 levels, cycles, and memo
//! sharing that would expand past 10^7 values — serde-pickle recurses per level and copies
//! each shared object at every reference.

use std::collections::HashMap;
use std::io::Read;

use serde_pickle::{DeOptions, HashableValue, Value};

use crate::error::{ErrorKind, Location, TraceError, echo};
use crate::event::{Event, Tag, Trace};
use crate::validate::Validator;

/// Actions that are recognised and deliberately skipped.
const SKIPPED_ACTIONS: [&str; 6] =
    ["segment_alloc", "segment_free", "segment_map", "segment_unmap", "snapshot", "oom"];

/// Reads a pickled PyTorch memory snapshot.
pub fn read_pytorch_snapshot<R: Read>(input: R, name: &str) -> Result<Trace, TraceError> {
    // Real snapshots share frame dicts between entries; serde-pickle cannot rebuild a shared
    // container nested in another shared one and would fail with "recursive structure".
    // Replacing those with None only touches such containers (frames), never the scalar
    // `action`/`addr`/`size`/`stream` fields read here.
    let mut data = Vec::new();
    let mut input = input;
    input.read_to_end(&mut data).map_err(|e| TraceError::input(ErrorKind::Io(e.to_string())))?;
    super::pickle_guard::prepare(&mut data)
        .map_err(|e| TraceError::input(ErrorKind::BadPickle(e)))?;
    let options = DeOptions::new().replace_recursive_structures();
    let value = serde_pickle::value_from_slice(&data, options)
        .map_err(|e| TraceError::input(ErrorKind::BadPickle(echo(&e.to_string()))))?;
    from_value(&value, name)
}

fn bad(kind: String) -> TraceError {
    TraceError::input(ErrorKind::BadStructure(kind))
}

fn key<'a>(dict: &'a Value, name: &str) -> Option<&'a Value> {
    match dict {
        Value::Dict(map) => map.get(&HashableValue::String(name.to_string())),
        _ => None,
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::I64(i) => u64::try_from(*i).ok(),
        Value::Int(big) => u64::try_from(big).ok(),
        Value::Bool(b) => Some(u64::from(*b)),
        _ => None,
    }
}

/// Builds a trace from an already decoded snapshot.
pub fn from_value(value: &Value, name: &str) -> Result<Trace, TraceError> {
    if !matches!(value, Value::Dict(_)) {
        return Err(bad("the pickle is not a dict".into()));
    }
    let devices = match key(value, "device_traces") {
        Some(Value::List(d)) => d,
        Some(_) => return Err(bad("`device_traces` is not a list".into())),
        None => {
            return Err(bad(
                "no `device_traces` key (record with torch.cuda.memory._record_memory_history())"
                    .into(),
            ));
        }
    };
    let mut trace = Trace { name: name.to_string(), ..Trace::default() };
    let mut prelude: Vec<Event> = Vec::new();
    let mut body: Vec<Event> = Vec::new();
    let mut next_id = 0u64;
    let mut stream_ids: HashMap<(usize, u64), u32> = HashMap::new();

    for (device, entries) in devices.iter().enumerate() {
        let Value::List(entries) = entries else {
            return Err(bad(format!("device_traces[{device}] is not a list")));
        };
        let action_of = |e: &Value| match key(e, "action") {
            Some(Value::String(s)) => Some(s.as_str() == "free_completed"),
            _ => None,
        };
        let free_action = if entries.iter().any(|e| action_of(e) == Some(true)) {
            "free_completed"
        } else {
            "free_requested"
        };
        let mut live: HashMap<u64, (u64, u64)> = HashMap::new(); // addr -> (id, bytes)
        for (index, entry) in entries.iter().enumerate() {
            let at = |kind| TraceError::new(Location::Entry { device, index }, kind);
            let structure = |s: String| at(ErrorKind::BadStructure(s));
            if !matches!(entry, Value::Dict(_)) {
                return Err(structure("entry is not a dict".into()));
            }
            let action = match key(entry, "action") {
                Some(Value::String(s)) => s.as_str(),
                Some(_) => return Err(structure("`action` is not a string".into())),
                None => return Err(structure("missing key `action`".into())),
            };
            let is_alloc = action == "alloc";
            if !is_alloc && action != free_action {
                if action == "free_requested"
                    || action == "free_completed"
                    || SKIPPED_ACTIONS.contains(&action)
                {
                    trace.skipped_records += 1;
                    continue;
                }
                return Err(at(ErrorKind::UnknownOp(echo(action))));
            }
            let int = |k: &'static str| -> Result<u64, TraceError> {
                let v = key(entry, k).ok_or_else(|| structure(format!("missing key `{k}`")))?;
                as_u64(v).ok_or_else(|| {
                    structure(format!("`{k}` is not a non-negative integer below 2^64"))
                })
            };
            let addr = int("addr")?;
            let size = int("size")?;
            let handle = match key(entry, "stream") {
                None | Some(Value::None) => 0,
                Some(_) => int("stream")?,
            };
            // Streams are per device: key by (device, handle), keeping 0 as 0.
            let stream = if handle == 0 {
                0
            } else {
                let n = u32::try_from(stream_ids.len() + 1).unwrap_or(u32::MAX);
                *stream_ids.entry((device, handle)).or_insert(n)
            };
            if is_alloc {
                if live.contains_key(&addr) {
                    return Err(at(ErrorKind::AllocOfLiveAddress(addr)));
                }
                live.insert(addr, (next_id, size));
                body.push(Event::alloc(next_id, size, stream, Tag::Act));
                next_id += 1;
            } else {
                let (id, bytes) = match live.remove(&addr) {
                    Some(x) => x,
                    None => {
                        // Allocated before the recorded window.
                        prelude.push(Event::alloc(next_id, size, stream, Tag::Act));
                        next_id += 1;
                        (next_id - 1, size)
                    }
                };
                body.push(Event::free(id, bytes, stream, Tag::Act));
            }
        }
    }
    prelude.extend(body);
    trace.events = prelude;
    let mut validator = Validator::new();
    for e in &trace.events {
        validator.check(e).map_err(|k| TraceError::new(Location::Input, k))?;
    }
    Ok(trace)
}
