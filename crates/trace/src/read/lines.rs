//! A bounded line reader over any [`BufRead`], plus the small field parsers the CSV readers
//! share.
//!
//! Lines are read byte by byte out of the reader's buffer into one reusable `Vec<u8>`; a line
//! longer than [`MAX_LINE`] is an error rather than an unbounded allocation, so garbage input
//! (a binary file, a gzip bomb with no newlines) cannot exhaust memory. Blank lines are
//! skipped; `\r\n` endings are accepted, and so is a byte-order mark before the first line.

use std::io::BufRead;

use crate::error::{ErrorKind, TraceError, echo};

/// UTF-8's byte-order mark.
const BOM: &[u8] = "\u{feff}".as_bytes();

/// The longest line accepted, in bytes.
pub const MAX_LINE: usize = 64 * 1024;

/// Reads lines with 1-based line numbers.
pub struct LineReader<R> {
    inner: R,
    buf: Vec<u8>,
    line_no: u64,
}

impl<R: BufRead> LineReader<R> {
    /// A reader positioned at line 1.
    pub fn new(inner: R) -> Self {
        LineReader { inner, buf: Vec::new(), line_no: 0 }
    }

    /// Reads the first line and checks it is exactly `header` (surrounding blanks ignored):
    /// an empty input or any other first line is an error naming what was found.
    pub fn expect_header(&mut self, header: &'static str) -> Result<(), TraceError> {
        match self.next_line()? {
            None => Err(TraceError::input(ErrorKind::Empty)),
            Some((n, h)) if h.trim() != header => Err(TraceError::at_line(
                n,
                ErrorKind::WrongHeader { expected: header, found: echo(h) },
            )),
            Some(_) => Ok(()),
        }
    }

    /// The next non-blank line and its number, or `None` at the end of input.
    pub fn next_line(&mut self) -> Result<Option<(u64, &str)>, TraceError> {
        loop {
            self.buf.clear();
            self.line_no += 1;
            let line_no = self.line_no;
            let mut saw_any = false;
            loop {
                let chunk = self
                    .inner
                    .fill_buf()
                    .map_err(|e| TraceError::at_line(line_no, ErrorKind::Io(e.to_string())))?;
                if chunk.is_empty() {
                    break;
                }
                saw_any = true;
                let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
                    Some(p) => (p + 1, true),
                    None => (chunk.len(), false),
                };
                let body = if done { &chunk[..take - 1] } else { chunk };
                if self.buf.len() + body.len() > MAX_LINE {
                    return Err(TraceError::at_line(line_no, ErrorKind::LineTooLong(MAX_LINE)));
                }
                self.buf.extend_from_slice(body);
                self.inner.consume(take);
                if done {
                    break;
                }
            }
            if !saw_any {
                return Ok(None);
            }
            if self.buf.last() == Some(&b'\r') {
                self.buf.pop();
            }
            // A byte-order mark (as Windows editors and Excel write UTF-8) is no part of the
            // first line, whichever reader reads it.
            // BROKEN (`bom_direct_refused`): only the format sniffing took it off.
            if line_no == 1
                && self.buf.starts_with(BOM)
                && !cfg!(tidepool_broken = "bom_direct_refused")
            {
                self.buf.drain(..BOM.len());
            }
            if self.buf.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            let text = std::str::from_utf8(&self.buf)
                .map_err(|_| TraceError::at_line(line_no, ErrorKind::NotUtf8))?;
            return Ok(Some((line_no, text)));
        }
    }
}

/// Splits a CSV row into exactly `N` fields named by `names` (no quoting: none of the
/// supported formats quotes). Fields are trimmed.
pub fn split_fields<'a, const N: usize>(
    line: &'a str,
    names: &[&'static str; N],
) -> Result<[&'a str; N], ErrorKind> {
    let mut out = [""; N];
    let mut parts = line.split(',');
    for (slot, name) in out.iter_mut().zip(names) {
        *slot = parts.next().ok_or(ErrorKind::MissingColumn(name))?.trim();
    }
    if parts.next().is_some() {
        return Err(ErrorKind::ExtraColumn);
    }
    Ok(out)
}

/// Parses a decimal `u64`.
pub fn parse_u64(text: &str, column: &'static str) -> Result<u64, ErrorKind> {
    text.parse::<u64>().map_err(|_| ErrorKind::BadNumber { column, text: echo(text) })
}

/// Parses a `u64` written in hex with a `0x` prefix, or in decimal.
pub fn parse_u64_hex_or_dec(text: &str, column: &'static str) -> Result<u64, ErrorKind> {
    let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse::<u64>(),
    };
    parsed.map_err(|_| ErrorKind::BadNumber { column, text: echo(text) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_numbers_blank_and_crlf() {
        let mut r = LineReader::new(&b"a\r\n\n  \nb\nc"[..]);
        assert_eq!(r.next_line().unwrap(), Some((1, "a")));
        assert_eq!(r.next_line().unwrap(), Some((4, "b")));
        assert_eq!(r.next_line().unwrap(), Some((5, "c")));
        assert_eq!(r.next_line().unwrap(), None);
    }

    #[test]
    fn long_line_is_an_error() {
        let data = vec![b'x'; MAX_LINE + 1];
        let mut r = LineReader::new(&data[..]);
        let e = r.next_line().unwrap_err();
        assert_eq!(e.location, crate::Location::Line(1));
        assert_eq!(e.kind, ErrorKind::LineTooLong(MAX_LINE));
    }

    #[test]
    fn numbers() {
        assert_eq!(parse_u64_hex_or_dec("0x1f", "p"), Ok(31));
        assert_eq!(parse_u64_hex_or_dec("31", "p"), Ok(31));
        assert!(parse_u64("-1", "bytes").is_err());
        assert_eq!(parse_u64("18446744073709551615", "bytes"), Ok(u64::MAX));
    }
}
