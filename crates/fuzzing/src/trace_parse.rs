//! The `trace_parse` harness: arbitrary bytes into every trace reader.
//!
//! ```text
//!   bytes ──▶ read_trace_bytes (sniffs gzip, pickle, CSV header) ─┐
//!         ├─▶ read_tidepool_csv                                   ├─▶ Ok(trace): it validates,
//!         ├─▶ read_rmm_log                                        │   its lifetimes and live-byte
//!         ├─▶ read_pytorch_snapshot                               │   figures agree
//!         └─▶ gzip(bytes) ─▶ read_trace_bytes ── same result as the plain bytes
//!                                                                 └─▶ Err(e): a non-empty message
//! ```
//!
//! A pickle (first byte `0x80`) is decoded once: `read_trace_bytes` already hands it to
//! `read_pytorch_snapshot`, and it is not gzipped again. Decoding a pickle is the slow part
//! (up to seconds for one that expands to the guard's limit).
//!
//! No reader may panic. Memory is bounded by the readers' own limits (line length, pickle
//! nesting and expansion); the fuzz script runs libFuzzer with `-rss_limit_mb` and
//! `-malloc_limit_mb` so that a reader allocating what an input *claims* is caught.

use flate2::Compression;
use flate2::write::GzEncoder;
use std::io::Write;
use tidepool_trace::read::{read_pytorch_snapshot, read_rmm_log, read_tidepool_csv};
use tidepool_trace::{Op, Trace, TraceError, read_trace_bytes};

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

/// Checks every reader on `data`.
pub fn check(data: &[u8]) -> Result<(), String> {
    let sniffed = read_trace_bytes(data);
    outcome("read_trace_bytes", &sniffed)?;
    outcome("read_tidepool_csv", &read_tidepool_csv(data, "trace"))?;
    outcome("read_rmm_log", &read_rmm_log(data, "trace"))?;
    let pickle = data.first() == Some(&0x80);
    if !pickle {
        outcome("read_pytorch_snapshot", &read_pytorch_snapshot(data, "trace"))?;
    }
    if data.len() < GZIP_BELOW && !pickle && !data.starts_with(&[0x1f, 0x8b]) {
        let mut gz = GzEncoder::new(Vec::new(), Compression::fast());
        gz.write_all(data).and_then(|()| gz.flush()).map_err(|e| e.to_string())?;
        let gz = gz.finish().map_err(|e| e.to_string())?;
        let unzipped = read_trace_bytes(&gz);
        let same = match (&sniffed, &unzipped) {
            (Ok(a), Ok(b)) => a == b,
            (Err(a), Err(b)) => a.to_string() == b.to_string(),
            _ => false,
        };
        if !same {
            return Err(format!(
                "gzipped input read differently: plain {:?}, gzipped {:?}",
                sniffed.as_ref().map(|t| t.events.len()),
                unzipped.as_ref().map(|t| t.events.len())
            ));
        }
    }
    Ok(())
}

/// An `Ok` trace must be valid and self-consistent; an error must say something.
fn outcome(reader: &str, result: &Result<Trace, TraceError>) -> Result<(), String> {
    match result {
        Ok(t) => {
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
                return Err(format!(
                    "{reader}: peak {} != timeline max {peak}",
                    t.peak_live_bytes()
                ));
            }
            Ok(())
        }
        Err(e) if e.to_string().trim().is_empty() => {
            Err(format!("{reader}: empty error message for {e:?}"))
        }
        Err(_) => Ok(()),
    }
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
        check(include_bytes!("../../../data/traces/mlp_train.csv.gz")).unwrap();
        for junk in [&b""[..], b"\x80", b"\x1f\x8b", b"\x80\x04]]]]]", b"seq,op\n", b"\xff\xfe"] {
            check(junk).unwrap();
            trace_parse(junk);
        }
    }

    #[test]
    fn inconsistent_traces_are_caught() {
        let mut t = read_trace_bytes(CSV.as_bytes()).unwrap();
        outcome("test", &Ok(t.clone())).unwrap();
        t.events.swap(0, 2); // a free before its alloc
        let err = outcome("test", &Ok(t)).unwrap_err();
        assert!(err.contains("invalid trace"), "{err}");
    }
}
