//! The `trace_parse` harness: arbitrary bytes into every trace reader.
//!
//! ```text
//!   bytes ──▶ read_traces_bytes (sniffs gzip, pickle, CSV header) ─┐
//!         ├─▶ read_tidepool_csv                                    ├─▶ Ok(traces): each validates,
//!         ├─▶ read_rmm_log                                         │   its lifetimes and live-byte
//!         ├─▶ read_pytorch_snapshot                                │   figures agree, a snapshot's
//!         │                                                        │   per-event reserved timeline
//!         │                                                        │   fits its peak
//!         └─▶ gzip(bytes) ─▶ read_traces_bytes ── same result as the plain bytes
//!                                                                  └─▶ Err(e): a non-empty message
//! ```
//!
//! A pickle (first byte `0x80`) is decoded once: `read_traces_bytes` already hands it to
//! `read_pytorch_snapshot` (one trace per device), and it is not gzipped again. Decoding a
//! pickle is linear in its size (shared objects are not copied). Inputs
//! are read with the default cap on decompressed bytes, so a gzip bomb ends at the cap.
//!
//! No reader may panic, nor make more than [`EVENTS_PER_BYTE`] events per byte of plain input
//! (a list the pickle shares is read once per reference, within that bound). Memory is bounded
//! by the readers' own limits (line length, pickle nesting, at most one decoded value per input
//! byte); the fuzz script runs libFuzzer with `-rss_limit_mb` and `-malloc_limit_mb` so that a
//! reader allocating what an input *claims* is caught.

use flate2::Compression;
use flate2::write::GzEncoder;
use std::io::Write;
use tidepool_trace::read::{read_pytorch_snapshot, read_rmm_log, read_tidepool_csv};
use tidepool_trace::{Op, ReadOptions, Trace, TraceError, read_traces_bytes};

/// Inputs up to this size are also read gzipped (compressing costs more than reading).
const GZIP_BELOW: usize = 1 << 16;

/// Reads `data` with every reader; panics if a check fails.
pub fn trace_parse(data: &[u8]) {
    if let Err(e) = check(data) {
        panic!(
            "trace_parse: {e}\ninput ({} bytes): {:?}",
            data.len(),
            String::from_utf8_lossy(data)
        );
    }
}

/// Most events a reader may make per byte of (uncompressed) input. A CSV row or a pickle's
/// entry, annotation or segment block takes at least one byte, even one written once and
/// referenced again by a one-byte `DUP`; a free the window never allocated is two events (its
/// synthetic alloc before the window and the free). More means the reader read something the
/// pickle shares once per reference: n bytes making n² events.
pub const EVENTS_PER_BYTE: usize = 2;

/// Checks every reader on `data`.
pub fn check(data: &[u8]) -> Result<(), String> {
    let options = ReadOptions::default();
    let sniffed = read_traces_bytes(data, &options);
    outcomes("read_traces_bytes", &sniffed)?;
    let csv = read_tidepool_csv(data, "trace");
    outcome("read_tidepool_csv", &csv)?;
    let rmm = read_rmm_log(data, "trace");
    outcome("read_rmm_log", &rmm)?;
    let pickle = data.first() == Some(&0x80);
    let snapshot = (!pickle).then(|| read_pytorch_snapshot(data, "trace"));
    if let Some(snapshot) = &snapshot {
        outcomes("read_pytorch_snapshot", snapshot)?;
    }
    // A gzip's bytes bound nothing (a compressed input may decompress to the cap): its plain
    // bytes are checked when the fuzzer tries them.
    if !data.starts_with(&[0x1f, 0x8b]) {
        let all = |r: &Result<Vec<Trace>, TraceError>| {
            r.as_ref().map_or(0, |ts| ts.iter().map(|t| t.events.len()).sum())
        };
        let one = |r: &Result<Trace, TraceError>| r.as_ref().map_or(0, |t| t.events.len());
        let read = [
            ("read_traces_bytes", all(&sniffed)),
            ("read_tidepool_csv", one(&csv)),
            ("read_rmm_log", one(&rmm)),
            ("read_pytorch_snapshot", snapshot.as_ref().map_or(0, all)),
        ];
        for (reader, events) in read {
            if events > EVENTS_PER_BYTE * data.len() {
                return Err(format!(
                    "{reader}: {events} events from {} bytes of input (at most \
                     {EVENTS_PER_BYTE} per byte)",
                    data.len()
                ));
            }
        }
    }
    if data.len() < GZIP_BELOW && !pickle && !data.starts_with(&[0x1f, 0x8b]) {
        let mut gz = GzEncoder::new(Vec::new(), Compression::fast());
        gz.write_all(data).and_then(|()| gz.flush()).map_err(|e| e.to_string())?;
        let gz = gz.finish().map_err(|e| e.to_string())?;
        let unzipped = read_traces_bytes(&gz, &options);
        let same = match (&sniffed, &unzipped) {
            (Ok(a), Ok(b)) => a == b,
            (Err(a), Err(b)) => a.to_string() == b.to_string(),
            _ => false,
        };
        if !same {
            return Err(format!(
                "gzipped input read differently: plain {:?}, gzipped {:?}",
                sniffed.as_ref().map(|t| t.iter().map(|t| t.events.len()).collect::<Vec<_>>()),
                unzipped.as_ref().map(|t| t.iter().map(|t| t.events.len()).collect::<Vec<_>>())
            ));
        }
    }
    Ok(())
}

/// Every trace of an `Ok` must be valid and self-consistent (and there is at least one); an
/// error must say something.
fn outcomes(reader: &str, result: &Result<Vec<Trace>, TraceError>) -> Result<(), String> {
    match result {
        Ok(traces) if traces.is_empty() => Err(format!("{reader}: Ok with no trace")),
        Ok(traces) => traces.iter().try_for_each(|t| trace_ok(reader, t)),
        Err(e) => error_ok(reader, e),
    }
}

/// An `Ok` trace must be valid and self-consistent; an error must say something.
fn outcome(reader: &str, result: &Result<Trace, TraceError>) -> Result<(), String> {
    match result {
        Ok(t) => trace_ok(reader, t),
        Err(e) => error_ok(reader, e),
    }
}

/// An error must say something.
fn error_ok(reader: &str, e: &TraceError) -> Result<(), String> {
    if e.to_string().trim().is_empty() {
        return Err(format!("{reader}: empty error message for {e:?}"));
    }
    Ok(())
}

/// A trace must be valid and self-consistent.
fn trace_ok(reader: &str, t: &Trace) -> Result<(), String> {
    t.validate().map_err(|e| format!("{reader} returned an invalid trace: {e}"))?;
    let allocs = t.events.iter().filter(|e| e.op == Op::Alloc).count();
    let lifetimes = t.lifetimes();
    if lifetimes.len() != allocs || t.num_allocs() != allocs {
        return Err(format!("{reader}: {} lifetimes for {allocs} allocs", lifetimes.len()));
    }
    if lifetimes.iter().any(|l| l.alloc >= l.free || l.free > t.events.len()) {
        return Err(format!("{reader}: a lifetime ends before it starts"));
    }
    let timeline = t.live_bytes_timeline();
    let peak = timeline.iter().copied().max().unwrap_or(0);
    if timeline.len() != t.events.len() || t.peak_live_bytes() != peak {
        return Err(format!("{reader}: peak {} != timeline max {peak}", t.peak_live_bytes()));
    }
    if let Some(s) = &t.snapshot {
        let r = &s.reserved;
        if r.timeline.len() != t.events.len()
            || r.timeline.iter().any(|&x| x > r.peak)
            || r.at_start > r.peak
            || (r.consistent && r.at_snapshot > r.peak)
        {
            return Err(format!("{reader}: reserved timeline does not fit its peak"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CSV: &str = "seq,op,id,bytes,stream,tag\n0,alloc,0,1024,0,param\n1,alloc,1,512,0,act\n\
                       2,free,1,512,0,act\n";

    #[test]
    fn good_traces_and_garbage_pass() {
        check(CSV.as_bytes()).unwrap();
        check(b"Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,8,0x0\n").unwrap();
        check(include_bytes!("../../trace/tests/fixtures/pytorch_snapshot.pickle")).unwrap();
        check(include_bytes!("../../trace/tests/fixtures/multi_device_snapshot.pickle")).unwrap();
        check(include_bytes!("../../../data/traces/mlp_train.csv.gz")).unwrap();
        for junk in [&b""[..], b"\x80", b"\x1f\x8b", b"\x80\x04]]]]]", b"seq,op\n", b"\xff\xfe"] {
            check(junk).unwrap();
            trace_parse(junk);
        }
    }

    #[test]
    fn inconsistent_traces_are_caught() {
        let mut t = tidepool_trace::read_trace_bytes(CSV.as_bytes()).unwrap();
        outcome("test", &Ok(t.clone())).unwrap();
        t.events.swap(0, 2); // a free before its alloc
        let err = outcome("test", &Ok(t)).unwrap_err();
        assert!(err.contains("invalid trace"), "{err}");
    }
}
