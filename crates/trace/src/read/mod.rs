//! Trace readers and format sniffing.
//!
//! ```text
//!  bytes ──► 1f 8b? ──yes──► gzip decoder ──┐
//!              │no                         ▼
//!              └──────────────────────► 0x80? ──yes──► PyTorch snapshot (pickle)
//!                                          │no         ▲
//!                                          ▼           │ yes (protocols 0 and 1)
//!                                     ( } ] ? ─────────┘
//!                                          │no
//!                                          ▼
//!                                     PK\3\4? ──yes──► error: a zip (torch.save)
//!                                          │no
//!                                          ▼
//!                             first line = header ──► tidepool CSV | RMM log | error
//! ```
//!
//! Everything streams over a [`BufRead`]: CSV rows are parsed one at a time with bounded line
//! length, and nothing is pre-allocated from a size found in the input. Gzip input is
//! decompressed through a cap ([`ReadOptions::max_input_bytes`], [`DEFAULT_MAX_INPUT`] unless
//! raised), and a pickle, which is decoded whole, is read into memory only up to that cap: a
//! gzip bomb decompressing past it ends in [`ErrorKind::InputTooLarge`]. Below the cap, the
//! memory a pickle takes is bounded per decompressed byte (`pickle.rs`): about 7 bytes for a
//! real snapshot, 40 at worst (a hostile run of `EMPTY_LIST`), so a small `.gz` that
//! decompresses to the whole default cap may take tens of GiB before its error; lower
//! [`ReadOptions::max_input_bytes`] (the CLI's `--max-input-size`) where inputs are untrusted.
//!
//! A PyTorch snapshot holds one trace per device; [`read_traces`] returns them all (the CSV
//! formats give one), [`read_trace`] the only one (an error names the devices when there are
//! several).

mod lines;
pub mod pickle;
mod pytorch_snapshot;
mod rmm_log;
mod tidepool_csv;

use std::cell::Cell;
use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, Read};
use std::path::Path;
use std::rc::Rc;

use flate2::bufread::MultiGzDecoder;

pub use lines::MAX_LINE;
pub use pickle::MAX_DEPTH as MAX_PICKLE_DEPTH;
pub use pytorch_snapshot::{
    HOW_TO_RECORD, from_value as pytorch_snapshot_from_value, read_pytorch_snapshot,
};
pub use rmm_log::{HEADER as RMM_HEADER, read_rmm_log};
pub use tidepool_csv::{HEADER as TIDEPOOL_HEADER, read_tidepool_csv};

use super::error::{ErrorKind, TraceError, echo};
use super::event::Trace;
use lines::LineReader;

/// Gzip magic bytes.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// First byte of a pickle of protocol 2 or later (the `PROTO` opcode).
const PICKLE_PROTO: u8 = 0x80;
/// First bytes of a dict or list pickled in protocol 0 or 1, which have no `PROTO` opcode:
/// `MARK` (`(dp0`, `(lp0`), `EMPTY_DICT`, `EMPTY_LIST`. No CSV header starts with them.
const PICKLE_OLD_STARTS: [u8; 3] = [b'(', b'}', b']'];
/// Zip magic: `torch.save()` writes a zip archive around its pickle (`*/data.pkl`).
const ZIP_MAGIC: [u8; 4] = *b"PK\x03\x04";

/// The default cap on decompressed gzip input and on a pickle read into memory: 1 GiB.
pub const DEFAULT_MAX_INPUT: u64 = 1 << 30;

/// Options of the readers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOptions {
    /// The most bytes a gzip input may decompress to, and the largest pickle read into memory.
    /// Larger inputs are refused with [`ErrorKind::InputTooLarge`].
    pub max_input_bytes: u64,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions { max_input_bytes: DEFAULT_MAX_INPUT }
    }
}

/// Reads a trace file of any supported format, gzipped or not. The trace is named after the
/// file (its name without `.gz`, `.csv`, `.pickle`, `.pkl`). A snapshot of several devices is
/// an error ([`ErrorKind::SeveralDevices`]); [`read_traces`] reads those.
pub fn read_trace(path: &Path) -> Result<Trace, TraceError> {
    single(read_traces(path, &ReadOptions::default())?)
}

/// Reads a trace of any supported format from memory (named `trace`); see [`read_trace`].
pub fn read_trace_bytes(bytes: &[u8]) -> Result<Trace, TraceError> {
    read_trace_from(bytes, "trace")
}

/// Reads a trace of any supported format from a reader, sniffing gzip and the format; see
/// [`read_trace`].
pub fn read_trace_from<R: BufRead>(input: R, name: &str) -> Result<Trace, TraceError> {
    single(read_traces_from(input, name, &ReadOptions::default())?)
}

/// Reads a trace file of any supported format: one trace per device of a PyTorch snapshot (in
/// device order), one for the CSV formats. Named as in [`read_trace`].
pub fn read_traces(path: &Path, options: &ReadOptions) -> Result<Vec<Trace>, TraceError> {
    let file = File::open(path).map_err(|e| {
        TraceError::input(ErrorKind::Io(format!("cannot open {}: {e}", crate::echo_path(path))))
    })?;
    read_traces_from(BufReader::new(file), &trace_name(path), options)
}

/// [`read_traces`] from memory (named `trace`).
pub fn read_traces_bytes(bytes: &[u8], options: &ReadOptions) -> Result<Vec<Trace>, TraceError> {
    read_traces_from(bytes, "trace", options)
}

/// [`read_traces`] from a reader, sniffing gzip and the format.
pub fn read_traces_from<R: BufRead>(
    input: R,
    name: &str,
    options: &ReadOptions,
) -> Result<Vec<Trace>, TraceError> {
    let (magic, input) = peek(input, 2)?;
    if magic == GZIP_MAGIC {
        let cap = options.max_input_bytes;
        let hit = Rc::new(Cell::new(false));
        let capped = Capped { inner: MultiGzDecoder::new(input), left: cap, hit: hit.clone() };
        let result = read_plain(BufReader::new(capped), name, cap);
        if hit.get() {
            return Err(TraceError::input(ErrorKind::InputTooLarge { cap, decompressed: true }));
        }
        return result;
    }
    read_plain(input, name, options.max_input_bytes)
}

/// The only trace of `traces`, or an error naming the devices.
fn single(mut traces: Vec<Trace>) -> Result<Trace, TraceError> {
    if traces.len() == 1
        && let Some(t) = traces.pop()
    {
        return Ok(t);
    }
    let devices = traces.iter().filter_map(|t| t.snapshot.as_ref().map(|s| s.device)).collect();
    Err(TraceError::input(ErrorKind::SeveralDevices(devices)))
}

/// A reader that fails once more than `left` bytes would come out of `inner`, and says so in
/// `hit` (the error itself passes through readers that turn it into text).
struct Capped<R> {
    inner: R,
    left: u64,
    hit: Rc<Cell<bool>>,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut probe = [0u8; 1];
            if self.inner.read(&mut probe)? == 0 {
                return Ok(0);
            }
            self.hit.set(true);
            return Err(std::io::Error::other("decompressed input is larger than the cap"));
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// Reads a non-gzipped input of any supported format.
fn read_plain<R: BufRead>(input: R, name: &str, cap: u64) -> Result<Vec<Trace>, TraceError> {
    let (first, input) = peek(input, ZIP_MAGIC.len())?;
    // BROKEN (`pickle_proto2_only`): only a `PROTO` opcode said "pickle"; a protocol 0 or 1
    // snapshot was read as CSV (a wrong header), a zip as text (not UTF-8).
    let old_pickle =
        |b: &u8| PICKLE_OLD_STARTS.contains(b) && !cfg!(tidepool_broken = "pickle_proto2_only");
    match first.first() {
        None => Err(TraceError::input(ErrorKind::Empty)),
        Some(&PICKLE_PROTO) => pytorch_snapshot::read_capped(input, name, cap),
        Some(b) if old_pickle(b) => pytorch_snapshot::read_capped(input, name, cap),
        Some(_) if first == ZIP_MAGIC && !cfg!(tidepool_broken = "pickle_proto2_only") => {
            Err(TraceError::input(ErrorKind::BadStructure(
                "the file is a zip archive, as torch.save() writes: replay the pickle inside it \
                 (`unzip FILE '*/data.pkl'`), or save the snapshot with pickle.dump() as \
                 torch.cuda.memory._dump_snapshot() does"
                    .into(),
            )))
        }
        Some(_) => {
            let mut lines = LineReader::new(input);
            let (n, header) =
                lines.next_line()?.ok_or_else(|| TraceError::input(ErrorKind::Empty))?;
            let header = header.trim_start_matches('\u{feff}').trim();
            if header == TIDEPOOL_HEADER {
                Ok(vec![tidepool_csv::read_body(&mut lines, name)?])
            } else if header == RMM_HEADER {
                Ok(vec![rmm_log::read_body(&mut lines, name)?])
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
