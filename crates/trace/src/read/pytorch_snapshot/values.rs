//! Reading a snapshot's plain values: records (dicts) and their fields, integers, times and
//! stream handles, with the error messages that name what was wrong.

use super::HOW_TO_RECORD;
use crate::error::{ErrorKind, TraceError, echo_cut};
use crate::read::pickle::{Obj, Seq};

/// Most items a record of the snapshot may have: a trace entry, segment, block, annotation, a
/// block's first `history` record, `allocator_settings` and its `roundup_power2_divisions`.
/// PyTorch's have about a dozen keys. A record's keys are looked up one by one, each by a scan
/// of its items, so a wide dict that the pickle shares between many records (its items written
/// once, one `DUP` byte per reference) made reading quadratic in the input: 16 001 items shared
/// by 32 000 entries (64 KB) took 1.3 s, 256 KB 19 s. The settings' values are each formatted
/// and their keys sorted, so 20 000 keys naming one shared 200 KB string (400 KB) took 2.5 s.
const MAX_RECORD_KEYS: usize = 256;

/// Checks that `v` is a record: a dict of at most [`MAX_RECORD_KEYS`] items.
pub(super) fn record(v: Obj<'_>, what: &dyn Fn(String) -> TraceError) -> Result<(), TraceError> {
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

pub(super) fn bad(kind: String) -> TraceError {
    TraceError::input(ErrorKind::BadStructure(kind))
}

pub(super) fn key<'a>(dict: Obj<'a>, name: &str) -> Option<Obj<'a>> {
    match dict {
        Obj::Dict(map) => map.get(name),
        _ => None,
    }
}

pub(super) fn as_u64(v: Obj<'_>) -> Option<u64> {
    match v {
        Obj::Int(i) => u64::try_from(i).ok(),
        Obj::Bool(b) => Some(u64::from(b)),
        _ => None,
    }
}

pub(super) fn as_i128(v: Obj<'_>) -> Option<i128> {
    match v {
        Obj::Int(i) => Some(i),
        Obj::Bool(b) => Some(i128::from(b)),
        _ => None,
    }
}

/// A `time_us` value: an integer, in microseconds.
pub(super) fn time_us(v: Obj<'_>) -> Result<i128, String> {
    match v {
        // BROKEN (`time_us_big_unnamed`): a huge integer was said not to be one.
        Obj::BigInt if !cfg!(tidepool_broken = "time_us_big_unnamed") => {
            Err("`time_us` is an integer outside ±2^127 microseconds".into())
        }
        v => as_i128(v).ok_or_else(|| "`time_us` is not an integer".into()),
    }
}

/// A required non-negative integer field; `what` names the record in the message.
pub(super) fn field(
    dict: Obj<'_>,
    k: &str,
    what: &dyn Fn(String) -> TraceError,
) -> Result<u64, TraceError> {
    let v = key(dict, k).ok_or_else(|| what(format!("missing key `{k}`")))?;
    as_u64(v).ok_or_else(|| what(format!("`{k}` is not a non-negative integer below 2^64")))
}

/// An optional stream handle (`None` or absent: the default stream).
pub(super) fn stream_field(
    dict: Obj<'_>,
    what: &dyn Fn(String) -> TraceError,
) -> Result<u64, TraceError> {
    match key(dict, "stream") {
        None | Some(Obj::None) => Ok(0),
        Some(_) => field(dict, "stream", what),
    }
}

/// Why a list is not a snapshot, and what to record instead.
pub(super) fn list_message(items: Seq<'_>) -> String {
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
pub(super) fn count(n: u64, thing: &str) -> String {
    if n == 1 { format!("1 {thing}") } else { format!("{n} {thing}s") }
}

/// `text` cut to `max` characters (settings are shown in full unless absurdly long), control
/// characters escaped ([`echo_cut`]).
pub(super) fn cut(text: &str, max: usize) -> String {
    echo_cut(text, max)
}
