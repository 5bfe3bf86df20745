//! Trace readers and format sniffing.
//!
//! ```text
//!  bytes ──► 1f 8b? ──yes──► gzip decoder ──┐
//!              │no                         ▼
//!              └──────────────────────► 0x80? ──yes──► PyTorch snapshot (pickle)
//!                                          │no
//!                                          ▼
//!                             first line = header ──► tidepool CSV | RMM log | error
//! ```
//!
//! Everything streams over a [`BufRead`]: CSV rows are parsed one at a time with bounded line
//! length, and nothing is pre-allocated from a size found in the input.

mod lines;
mod pickle_guard;
mod pytorch_snapshot;
mod rmm_log;
mod tidepool_csv;

use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, Read};
use std::path::Path;

use flate2::bufread::MultiGzDecoder;

pub use lines::MAX_LINE;
pub use pickle_guard::{MAX_DEPTH as MAX_PICKLE_DEPTH, MAX_EXPANDED as MAX_PICKLE_VALUES};
pub use pytorch_snapshot::{from_value as pytorch_snapshot_from_value, read_pytorch_snapshot};
pub use rmm_log::{HEADER as RMM_HEADER, read_rmm_log};
pub use tidepool_csv::{HEADER as TIDEPOOL_HEADER, read_tidepool_csv};

use super::error::{ErrorKind, TraceError, echo};
use super::event::Trace;
use lines::LineReader;

/// Gzip magic bytes.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// First byte of a pickle of protocol 2 or later (the `PROTO` opcode).
const PICKLE_PROTO: u8 = 0x80;

/// Reads a trace file of any supported format, gzipped or not. The trace is named after the
/// file (its name without `.gz`, `.csv`, `.pickle`, `.pkl`).
pub fn read_trace(path: &Path) -> Result<Trace, TraceError> {
    let file = File::open(path).map_err(|e| {
        TraceError::input(ErrorKind::Io(format!("cannot open {}: {e}", path.display())))
    })?;
    read_trace_from(BufReader::new(file), &trace_name(path))
}

/// Reads a trace of any supported format from memory (named `trace`).
pub fn read_trace_bytes(bytes: &[u8]) -> Result<Trace, TraceError> {
    read_trace_from(bytes, "trace")
}

/// Reads a trace of any supported format from a reader, sniffing gzip and the format.
pub fn read_trace_from<R: BufRead>(input: R, name: &str) -> Result<Trace, TraceError> {
    let (magic, input) = peek(input, 2)?;
    if magic == GZIP_MAGIC {
        return read_plain(BufReader::new(MultiGzDecoder::new(input)), name);
    }
    read_plain(input, name)
}

/// Reads a non-gzipped input of any supported format.
fn read_plain<R: BufRead>(input: R, name: &str) -> Result<Trace, TraceError> {
    let (first, input) = peek(input, 1)?;
    match first.first() {
        None => Err(TraceError::input(ErrorKind::Empty)),
        Some(&PICKLE_PROTO) => read_pytorch_snapshot(input, name),
        Some(_) => {
            let mut lines = LineReader::new(input);
            let (n, header) =
                lines.next_line()?.ok_or_else(|| TraceError::input(ErrorKind::Empty))?;
            let header = header.trim_start_matches('\u{feff}').trim();
            if header == TIDEPOOL_HEADER {
                tidepool_csv::read_body(&mut lines, name)
            } else if header == RMM_HEADER {
                rmm_log::read_body(&mut lines, name)
            } else {
                Err(TraceError::at_line(
                    n,
                    ErrorKind::WrongHeader {
                        expected: "`seq,op,id,bytes,stream,tag` (tidepool), \
                                   `Thread,Time,Action,Pointer,Size,Stream` (RMM) \
                                   or a pickled PyTorch snapshot",
                        found: echo(header),
                    },
                ))
            }
        }
    }
}

/// Reads up to `n` bytes and gives back a reader that still yields them.
fn peek<R: BufRead>(mut input: R, n: usize) -> Result<(Vec<u8>, impl BufRead), TraceError> {
    let mut head = Vec::with_capacity(n);
    (&mut input)
        .take(n as u64)
        .read_to_end(&mut head)
        .map_err(|e| TraceError::input(ErrorKind::Io(e.to_string())))?;
    let rest = Cursor::new(head.clone()).chain(input);
    Ok((head, rest))
}

/// The file name without directory and trace extensions.
fn trace_name(path: &Path) -> String {
    let mut name = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    for ext in [".gz", ".csv", ".pickle", ".pkl"] {
        if let Some(stripped) = name.strip_suffix(ext) {
            name = stripped.to_string();
        }
    }
    name
}
