//! Errors of the trace readers: a [`Location`] (which line or record) and an [`ErrorKind`]
//! (why). Every reader reports the first problem it meets and stops; nothing panics.
//!
//! Display reads like `line 12: free of unknown id 7` or
//! `device 0 entry 3: missing key `size``, so CLI users can find the record at once.

use std::fmt;

/// Longest piece of input text echoed back in an error message (longer text is cut).
const MAX_ECHO: usize = 48;

/// Where in the input an error was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// 1-based line number of a CSV input (the header is line 1).
    Line(u64),
    /// 0-based entry index within `device_traces[device]` of a PyTorch snapshot.
    Entry {
        /// Index into `device_traces`.
        device: usize,
        /// Index into that device's list of entries.
        index: usize,
    },
    /// The input as a whole (unreadable file, empty input, unknown format, end of input).
    Input,
}

/// Why a trace could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    /// An I/O error (file missing, truncated gzip stream, ...), as text.
    Io(String),
    /// The input is empty.
    Empty,
    /// The first line is not one of the known CSV headers.
    WrongHeader {
        /// What the reader expected.
        expected: &'static str,
        /// What it found (cut to a few dozen characters).
        found: String,
    },
    /// A row has fewer columns than the header; names the first missing column.
    MissingColumn(&'static str),
    /// A row has more columns than the header.
    ExtraColumn,
    /// A column that must hold a number does not.
    BadNumber {
        /// Column name.
        column: &'static str,
        /// The offending text.
        text: String,
    },
    /// An unknown operation / action name.
    UnknownOp(String),
    /// An unknown `tag` (expected `param` or `act`).
    UnknownTag(String),
    /// An id (or address) was allocated while already allocated, or allocated a second time.
    DoubleAlloc(u64),
    /// A free of an id that was never allocated.
    FreeOfUnknownId(u64),
    /// An allocation at an address that is live (pointer-based formats).
    AllocOfLiveAddress(u64),
    /// A free of an address that is not live and cannot be a block from before the input
    /// began, because the input freed it already (pointer-based formats: a double free).
    FreeOfUnknownAddress(u64),
    /// A free of an id that was already freed.
    DoubleFree(u64),
    /// A free whose byte count differs from the allocation's (0 on a free is accepted).
    FreeSizeMismatch {
        /// The id.
        id: u64,
        /// Bytes at allocation.
        allocated: u64,
        /// Bytes on the free row.
        freed: u64,
    },
    /// A free whose byte count differs from the allocation's, at an address (pointer-based
    /// formats that name both sizes: RMM's log, where `deallocate` must be given the bytes
    /// `allocate` was).
    FreeSizeMismatchAt {
        /// The address.
        addr: u64,
        /// Bytes at allocation.
        allocated: u64,
        /// Bytes on the free row.
        freed: u64,
    },
    /// Scope markers do not nest: an exit without a matching enter, an enter of a scope that
    /// is open, a scope left open at the end, or a scope id reused under another name.
    UnbalancedScope(String),
    /// A line longer than the reader accepts (protects memory on garbage input).
    LineTooLong(usize),
    /// A line is not valid UTF-8.
    NotUtf8,
    /// The pickle could not be decoded.
    BadPickle(String),
    /// The pickle decoded, but not into the structure of a PyTorch memory snapshot.
    BadStructure(String),
    /// The input (decompressed, for gzip; or a pickle, which is read whole) is larger than the
    /// cap of [`crate::read::ReadOptions::max_input_bytes`].
    InputTooLarge {
        /// The cap, in bytes.
        cap: u64,
        /// Whether the input was gzip (the cap bounds the decompressed bytes).
        decompressed: bool,
    },
    /// A single trace was asked of a snapshot that holds several devices.
    SeveralDevices(Vec<u32>),
}

/// A trace reading error: where, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    /// Where the problem is.
    pub location: Location,
    /// What the problem is.
    pub kind: ErrorKind,
}

impl TraceError {
    /// An error at `location`.
    pub fn new(location: Location, kind: ErrorKind) -> Self {
        TraceError { location, kind }
    }

    /// An error at 1-based CSV line `line`.
    pub fn at_line(line: u64, kind: ErrorKind) -> Self {
        Self::new(Location::Line(line), kind)
    }

    /// An error about the input as a whole.
    pub fn input(kind: ErrorKind) -> Self {
        Self::new(Location::Input, kind)
    }
}

/// A file's path as messages show it: control characters and bidirectional overrides written
/// as escapes, as for any input echoed (a file name may hold any of them, and a name holding
/// a newline made a one-line error two lines, one holding `ESC` drove the terminal).
///
/// ```
/// # use std::path::Path;
/// assert_eq!(tidepool_trace::echo_path(Path::new("a\u{1b}[2Jb.csv")), "a\\u{1b}[2Jb.csv");
/// ```
pub fn echo_path(path: &std::path::Path) -> String {
    // BROKEN (`path_echo_raw`): the path as it is.
    if cfg!(tidepool_broken = "path_echo_raw") {
        return path.display().to_string();
    }
    echo_cut(&path.to_string_lossy(), usize::MAX)
}

/// `text` cut to [`MAX_ECHO`] characters, for echoing input back in messages.
pub(crate) fn echo(text: &str) -> String {
    echo_cut(text, MAX_ECHO)
}

/// `text` cut to `max` characters (then `…`), with control characters and the bidirectional
/// overrides written as escapes (`\u{1b}`): text from the input reaches a terminal through
/// error messages and the report, and an escape sequence in it must not drive the terminal
/// (clear it, retitle it, hide the text after it) or reorder what the user reads.
pub(crate) fn echo_cut(text: &str, max: usize) -> String {
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        // BROKEN (`echo_control_raw`): input characters echoed as they are.
        let unsafe_char = c.is_control()
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if unsafe_char && !cfg!(tidepool_broken = "echo_control_raw") {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(n) => write!(f, "line {n}"),
            Location::Entry { device, index } => write!(f, "device {device} entry {index}"),
            Location::Input => f.write_str("input"),
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorKind::Io(e) => write!(f, "I/O error: {e}"),
            ErrorKind::Empty => f.write_str("empty trace (no header)"),
            ErrorKind::WrongHeader { expected, found } => {
                write!(f, "wrong header `{found}` (expected {expected})")
            }
            ErrorKind::MissingColumn(c) => write!(f, "missing column `{c}`"),
            ErrorKind::ExtraColumn => f.write_str("more columns than the header"),
            ErrorKind::BadNumber { column, text } => {
                write!(f, "bad number `{text}` in column `{column}`")
            }
            ErrorKind::UnknownOp(op) => write!(f, "unknown op `{op}`"),
            ErrorKind::UnknownTag(t) => write!(f, "unknown tag `{t}` (expected param or act)"),
            ErrorKind::DoubleAlloc(id) => write!(f, "double alloc of id {id}"),
            ErrorKind::FreeOfUnknownId(id) => write!(f, "free of unknown id {id}"),
            ErrorKind::AllocOfLiveAddress(a) => write!(f, "allocate at live address {a:#x}"),
            ErrorKind::FreeOfUnknownAddress(a) => {
                write!(f, "free of address {a:#x}, which was freed already and not allocated since")
            }
            ErrorKind::DoubleFree(id) => write!(f, "double free of id {id}"),
            ErrorKind::FreeSizeMismatch { id, allocated, freed } => write!(
                f,
                "free of id {id} with {freed} bytes, but it was allocated with {allocated}"
            ),
            ErrorKind::FreeSizeMismatchAt { addr, allocated, freed } => write!(
                f,
                "free of address {addr:#x} with {freed} bytes, but it was allocated with {allocated}"
            ),
            ErrorKind::UnbalancedScope(why) => write!(f, "unbalanced scope: {why}"),
            ErrorKind::LineTooLong(max) => write!(f, "line longer than {max} bytes"),
            ErrorKind::NotUtf8 => f.write_str("line is not valid UTF-8"),
            ErrorKind::BadPickle(e) => write!(f, "bad pickle: {e}"),
            ErrorKind::BadStructure(e) => write!(f, "not a PyTorch memory snapshot: {e}"),
            ErrorKind::InputTooLarge { cap, decompressed } => {
                let what = if *decompressed { "decompressed input" } else { "input" };
                let size = tidepool::Bytes(*cap);
                let exact = if *cap < 1024 { String::new() } else { format!(" ({cap} B)") };
                write!(
                    f,
                    "{what} is larger than the cap of {size}{exact}; raise the cap with \
                     `tidepool replay --max-input-size SIZE` (library: \
                     ReadOptions::max_input_bytes)"
                )
            }
            ErrorKind::SeveralDevices(devices) => {
                let list: Vec<String> = devices.iter().map(u32::to_string).collect();
                write!(
                    f,
                    "the snapshot holds {} devices ({}); read them with read_traces \
                     (`tidepool replay` reports each device, `--device N` picks one)",
                    devices.len(),
                    list.join(", ")
                )
            }
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.location, self.kind)
    }
}

impl std::error::Error for TraceError {}

impl From<std::io::Error> for TraceError {
    fn from(e: std::io::Error) -> Self {
        TraceError::input(ErrorKind::Io(e.to_string()))
    }
}
