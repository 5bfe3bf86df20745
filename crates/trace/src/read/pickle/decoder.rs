//! The pickle VM (see the parent module): one pass over the opcodes, with a stack of values
//! and marks and a memo, each opcode checked against the bounds the parent module lists.

use super::{EXTRA_PER_BYTE, Global, MAX_DEPTH, MAX_TEXT_INT, Pickle, Span, V, Value};
use std::collections::HashMap;

/// Decodes `data`, a whole pickle, keeping it (strings are spans of it). `Err` says why not.
pub fn decode(data: Vec<u8>) -> Result<Pickle, String> {
    if u32::try_from(data.len()).is_err() {
        return Err("pickle of 4 GiB or more".into());
    }
    let pickle = Pickle {
        data,
        extra: Vec::new(),
        text: String::new(),
        #[cfg(test)]
        utf8_checked: Default::default(),
        seqs: Vec::new(),
        heights: Vec::new(),
        bigs: Vec::new(),
        root: Value(V::None),
    };
    let mut d = Decoder {
        p: pickle,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        sparse: HashMap::new(),
    };
    d.p.root = d.run()?;
    Ok(d.p)
}

struct Decoder {
    p: Pickle,
    pos: usize,
    stack: Vec<Value>,
    /// Stack lengths at the open marks.
    marks: Vec<usize>,
    /// Memo entries 0, 1, 2…
    memo: Vec<Value>,
    /// Memo entries past the first gap in the ids.
    sparse: HashMap<u32, Value>,
}

/// The name of a pickle opcode.
fn opcode_name(op: u8) -> Option<&'static str> {
    Some(match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return None,
    })
}

/// Appends `s` to `text` (the strings of a pickle of `input` bytes); its span. The strings
/// are at most [`EXTRA_PER_BYTE`] bytes per input byte (a string of the input is its own bytes;
/// protocol 0's escapes decode to at most twice their text) and below 4 GiB.
fn add_text(text: &mut String, input: usize, s: &str) -> Result<Span, String> {
    let budget = input.saturating_mul(EXTRA_PER_BYTE).min(u32::MAX as usize);
    if text.len() + s.len() > budget {
        return Err(format!(
            "pickle decodes more than {EXTRA_PER_BYTE} bytes of strings per byte of input"
        ));
    }
    let at = text.len() as u32;
    text.push_str(s);
    Ok(Span { at, len: s.len() as u32 })
}

fn too_deep() -> String {
    format!("pickle nests deeper than {MAX_DEPTH} levels")
}

impl Decoder {
    /// The next `n` bytes' position, checked against the input's end.
    fn take(&mut self, n: u64) -> Result<usize, String> {
        let start = self.pos;
        let rest = (self.p.data.len() - start) as u64;
        if n > rest {
            return Err("truncated pickle".into());
        }
        self.pos += n as usize;
        Ok(start)
    }

    fn byte(&mut self) -> Result<u8, String> {
        let at = self.take(1)?;
        Ok(self.p.data[at])
    }

    /// A little-endian unsigned integer of `n` ≤ 8 bytes.
    fn uint(&mut self, n: usize) -> Result<u64, String> {
        let at = self.take(n as u64)?;
        Ok(self.p.data[at..at + n].iter().rev().fold(0, |acc, &b| (acc << 8) | u64::from(b)))
    }

    /// `n` bytes as a span.
    fn span(&mut self, n: u64) -> Result<Span, String> {
        let at = self.take(n)?;
        // The input is below 4 GiB.
        Ok(Span { at: at as u32, len: n as u32 })
    }

    /// The text up to the next newline (consumed), without a trailing `\r`.
    fn line(&mut self) -> Result<std::ops::Range<usize>, String> {
        let start = self.pos;
        let rest = &self.p.data[start..];
        let n = rest.iter().position(|&b| b == b'\n').ok_or("truncated pickle")?;
        self.pos += n + 1;
        let end = if n > 0 && rest[n - 1] == b'\r' { start + n - 1 } else { start + n };
        Ok(start..end)
    }

    /// Start of the current mark's frame.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<Value, String> {
        if self.stack.len() <= self.floor() {
            return Err("pickle stack underflow".into());
        }
        self.stack.pop().ok_or_else(|| "pickle stack underflow".into())
    }

    fn top(&self) -> Result<Value, String> {
        if self.stack.len() <= self.floor() {
            return Err("pickle stack underflow".into());
        }
        self.stack.last().copied().ok_or_else(|| "pickle stack underflow".into())
    }

    /// Closes the last mark; its items are `stack[returned..]`.
    fn pop_mark(&mut self) -> Result<usize, String> {
        self.marks.pop().ok_or_else(|| "pickle mark underflow (no MARK open)".into())
    }

    fn push(&mut self, v: V) {
        self.stack.push(Value(v));
    }

    fn height(&self, v: Value) -> u8 {
        match v.0 {
            V::List(i) | V::Tuple(i) | V::Dict(i) | V::Set(i) | V::FrozenSet(i) => {
                self.p.heights.get(i as usize).copied().unwrap_or(0)
            }
            _ => 0,
        }
    }

    /// Height of a container holding `items` (and already `at_least` tall).
    fn height_of(&self, items: &[Value], at_least: u8) -> Result<u8, String> {
        let tallest = items.iter().map(|&v| self.height(v)).max().unwrap_or(0);
        let h = at_least.max(tallest + 1);
        // BROKEN (`depth_unbounded`).
        if u32::from(h) > MAX_DEPTH && !cfg!(tidepool_broken = "depth_unbounded") {
            return Err(too_deep());
        }
        Ok(h)
    }

    /// A new container holding `items`.
    fn new_seq(&mut self, items: Vec<Value>) -> Result<u32, String> {
        let h = self.height_of(&items, 1)?;
        let id = u32::try_from(self.p.seqs.len()).map_err(|_| "pickle too large")?;
        self.p.seqs.push(items);
        self.p.heights.push(h);
        Ok(id)
    }

    /// A new container holding the items of the last mark, which is closed.
    fn seq_from_mark(&mut self) -> Result<u32, String> {
        let m = self.pop_mark()?;
        let items = self.stack.split_off(m);
        self.new_seq(items)
    }

    /// Adds `stack[from..]` to the container `top` (a `kind` below them), and drops them from
    /// the stack.
    fn extend(&mut self, from: usize, kind: &str) -> Result<(), String> {
        let target = match (from.checked_sub(1), kind) {
            (Some(t), _) if t < self.floor() => return Err("pickle stack underflow".into()),
            (None, _) => return Err("pickle stack underflow".into()),
            (Some(t), _) => self.stack[t],
        };
        let i = match (target.0, kind) {
            (V::List(i), "list") | (V::Dict(i), "dict") | (V::Set(i), "set") => i as usize,
            _ => return Err(format!("pickle adds items to a value that is not a {kind}")),
        };
        let items = &self.stack[from..];
        if kind == "dict" && items.len() % 2 == 1 {
            return Err("pickle sets a dict item without a value".into());
        }
        let h = self.height_of(items, self.p.heights[i])?;
        self.p.heights[i] = h;
        self.p.seqs[i].extend_from_slice(items);
        self.stack.truncate(from);
        Ok(())
    }

    fn memo_put(&mut self, id: u32) -> Result<(), String> {
        let v = self.top()?;
        let i = id as usize;
        if i < self.memo.len() {
            self.memo[i] = v;
        } else if i == self.memo.len() {
            self.memo.push(v);
            while let Some(next) = self.sparse.remove(&(self.memo.len() as u32)) {
                self.memo.push(next);
            }
        } else {
            self.sparse.insert(id, v);
        }
        Ok(())
    }

    fn memo_get(&mut self, id: u64) -> Result<(), String> {
        let v = usize::try_from(id)
            .ok()
            .and_then(|i| self.memo.get(i))
            .or_else(|| u32::try_from(id).ok().and_then(|id| self.sparse.get(&id)))
            .copied()
            .ok_or("pickle memo reference to nothing")?;
        self.stack.push(v);
        Ok(())
    }

    /// A memo id written as text.
    fn text_id(&mut self) -> Result<u32, String> {
        let r = self.line()?;
        std::str::from_utf8(&self.p.data[r])
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
            .ok_or_else(|| "bad memo id".into())
    }

    fn int(&mut self, i: i128) -> Result<V, String> {
        if let Ok(small) = i64::try_from(i) {
            return Ok(V::Int(small));
        }
        let id = u32::try_from(self.p.bigs.len()).map_err(|_| "pickle too large")?;
        self.p.bigs.push(i);
        Ok(V::Big(id))
    }

    /// A two's complement little-endian integer (`LONG1`, `LONG4`).
    fn binary_long(&mut self, at: usize, n: usize) -> Result<V, String> {
        let bytes = &self.p.data[at..at + n];
        let Some(&last) = bytes.last() else { return Ok(V::Int(0)) };
        let fill = if last & 0x80 != 0 { 0xff } else { 0 };
        let (low, high) = bytes.split_at(n.min(16));
        // Fits in i128 when every byte past the 16th repeats the sign, and so does the 16th's
        // top bit.
        let fits = high.iter().all(|&b| b == fill) && (n < 16 || (low[15] & 0x80) == (fill & 0x80));
        if !fits {
            return Ok(V::Huge);
        }
        let mut buf = [fill; 16];
        buf[..low.len()].copy_from_slice(low);
        self.int(i128::from_le_bytes(buf))
    }

    /// A decimal integer written as text (`INT`, `LONG`), with its limit on digits.
    fn text_int(&mut self, long: bool) -> Result<V, String> {
        let r = self.line()?;
        // BROKEN (`text_int_unbounded`).
        if r.len() > MAX_TEXT_INT && !cfg!(tidepool_broken = "text_int_unbounded") {
            return Err(format!("pickle has a decimal integer longer than {MAX_TEXT_INT} digits"));
        }
        let mut text = &self.p.data[r];
        if !long {
            // Protocol 0 writes booleans so.
            match text {
                b"00" => return Ok(V::Bool(false)),
                b"01" => return Ok(V::Bool(true)),
                _ => {}
            }
        } else if let [rest @ .., b'L'] = text {
            text = rest;
        }
        let (negative, digits) = match text {
            [b'-', d @ ..] => (true, d),
            [b'+', d @ ..] => (false, d),
            d => (false, d),
        };
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return Err("bad integer in pickle".into());
        }
        let mut acc: Option<i128> = Some(0);
        for &d in digits {
            let d = i128::from(d - b'0');
            acc = acc
                .and_then(|a| a.checked_mul(10))
                .and_then(|a| if negative { a.checked_sub(d) } else { a.checked_add(d) });
        }
        match acc {
            Some(i) => self.int(i),
            None => Ok(V::Huge),
        }
    }

    /// Appends decoded bytes to `extra`; their span.
    fn add_extra(&mut self, bytes: &[u8]) -> Result<Span, String> {
        let n = self.p.data.len();
        let budget = n.saturating_mul(EXTRA_PER_BYTE).min(u32::MAX as usize - n);
        if self.p.extra.len() + bytes.len() > budget {
            return Err(format!(
                "pickle decodes more than {EXTRA_PER_BYTE} bytes of strings per byte of input"
            ));
        }
        let at = (n + self.p.extra.len()) as u32;
        self.p.extra.extend_from_slice(bytes);
        Ok(Span { at, len: bytes.len() as u32 })
    }

    /// A UTF-8 string of the input, copied into `text`.
    fn utf8(&mut self, s: Span) -> Result<V, String> {
        let p = &mut self.p;
        let bytes = p.data.get(s.at as usize..(s.at as usize + s.len as usize)).unwrap_or_default();
        let text = p.check_utf8(bytes).map_err(|_| "pickle string is not UTF-8")?;
        Ok(V::Str(add_text(&mut p.text, p.data.len(), text)?))
    }

    /// `STRING`: a Python 2 string literal, quoted, with backslash escapes.
    fn escaped_string(&mut self) -> Result<V, String> {
        let r = self.line()?;
        let text = &self.p.data[r];
        let text = match text {
            [q, inner @ .., last] if q == last && (*q == b'\'' || *q == b'"') => inner,
            _ => return Err("bad STRING in pickle (not quoted)".into()),
        };
        let mut out = Vec::with_capacity(text.len());
        let mut it = text.iter().copied();
        while let Some(b) = it.next() {
            if b != b'\\' {
                out.push(b);
                continue;
            }
            let c = match it.next() {
                Some(b'\\') => b'\\',
                Some(b'\'') => b'\'',
                Some(b'"') => b'"',
                Some(b'a') => 7,
                Some(b'b') => 8,
                Some(b't') => b'\t',
                Some(b'n') => b'\n',
                Some(b'v') => 11,
                Some(b'f') => 12,
                Some(b'r') => b'\r',
                Some(b'x') => {
                    let hex = |b: Option<u8>| b.and_then(|b| char::from(b).to_digit(16));
                    match (hex(it.next()), hex(it.next())) {
                        (Some(h), Some(l)) => (h * 16 + l) as u8,
                        _ => return Err("bad escape in a pickle STRING".into()),
                    }
                }
                _ => return Err("bad escape in a pickle STRING".into()),
            };
            out.push(c);
        }
        Ok(V::Bytes(self.add_extra(&out)?))
    }

    /// `UNICODE`: raw-unicode-escape text (latin-1, with `\uXXXX` and `\UXXXXXXXX`).
    fn escaped_unicode(&mut self) -> Result<V, String> {
        let r = self.line()?;
        let text = &self.p.data[r];
        let mut out = String::with_capacity(text.len());
        let mut i = 0;
        while i < text.len() {
            let b = text[i];
            let width = match (b, text.get(i + 1)) {
                (b'\\', Some(b'u')) => 4,
                (b'\\', Some(b'U')) => 8,
                _ => {
                    out.push(char::from(b));
                    i += 1;
                    continue;
                }
            };
            let hex = text.get(i + 2..i + 2 + width).and_then(|h| std::str::from_utf8(h).ok());
            let c = hex
                .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .and_then(char::from_u32)
                .ok_or("bad escape in a pickle UNICODE string")?;
            out.push(c);
            i += 2 + width;
        }
        Ok(V::Str(add_text(&mut self.p.text, self.p.data.len(), &out)?))
    }

    fn global(&self, module: &[u8], name: &[u8]) -> Result<Global, String> {
        let builtin = matches!(module, b"builtins" | b"__builtin__");
        Ok(match (module, name) {
            (_, b"set") if builtin => Global::Set,
            (_, b"frozenset") if builtin => Global::FrozenSet,
            (_, b"list") if builtin => Global::List,
            (_, b"bytearray") if builtin => Global::Bytearray,
            (_, b"bytes") if builtin => Global::Bytes,
            (_, b"int") if builtin => Global::Int,
            (b"_codecs", b"encode") => Global::Encode,
            (b"collections", b"OrderedDict") => Global::OrderedDict,
            _ => {
                let text = |b: &[u8]| crate::error::echo_cut(&String::from_utf8_lossy(b), 64);
                return Err(format!(
                    "pickle refers to `{}.{}`, which is not plain data (only dicts, lists, \
                     tuples, sets, strings, bytes, numbers, booleans and None are read)",
                    text(module),
                    text(name)
                ));
            }
        })
    }

    /// Bytes of the latin-1 text `s` (`_codecs.encode(s, "latin1")`, `bytearray(s, …)`).
    fn latin1(&mut self, s: Span) -> Result<V, String> {
        let text = self.p.str_of(s);
        let bytes: Option<Vec<u8>> = text.chars().map(|c| u8::try_from(c).ok()).collect();
        let bytes = bytes.ok_or("pickle encodes text that is not latin-1 as bytes")?;
        Ok(V::Bytes(self.add_extra(&bytes)?))
    }

    /// `REDUCE`: `global(*args)` for the globals accepted.
    fn reduce(&mut self) -> Result<V, String> {
        let args = self.pop()?;
        let f = self.pop()?;
        let V::Global(g) = f.0 else {
            return Err("pickle calls a value that is not a global (REDUCE)".into());
        };
        let V::Tuple(t) = args.0 else {
            return Err("pickle calls a global without an argument tuple (REDUCE)".into());
        };
        let args = self.p.seqs.get(t as usize).map_or(&[][..], Vec::as_slice);
        let arg = |i: usize| args.get(i).map(|v| v.0);
        let bad = || format!("pickle calls {} with arguments it does not take", g.name());
        Ok(match (g, args.len(), arg(0)) {
            // The item list is shared, not copied (as `set(x)` would): each call costs O(1).
            (Global::Set, 1, Some(V::List(i))) => V::Set(i),
            (Global::FrozenSet, 1, Some(V::List(i))) => V::FrozenSet(i),
            (Global::List, 1, Some(V::List(i))) => V::List(i),
            (Global::Set, 0, _) => V::Set(self.new_seq(Vec::new())?),
            (Global::FrozenSet, 0, _) => V::FrozenSet(self.new_seq(Vec::new())?),
            (Global::List, 0, _) => V::List(self.new_seq(Vec::new())?),
            (Global::OrderedDict, 0, _) => V::Dict(self.new_seq(Vec::new())?),
            (Global::Int, 1, Some(v @ (V::Int(_) | V::Big(_) | V::Huge))) => v,
            (Global::Bytearray | Global::Bytes, 0, _) => V::Bytes(Span { at: 0, len: 0 }),
            (Global::Bytearray, 1 | 2, Some(v @ V::Bytes(_))) => v,
            (Global::Bytearray, 2, Some(V::Str(s))) | (Global::Encode, 2, Some(V::Str(s))) => {
                self.latin1(s)?
            }
            _ => return Err(bad()),
        })
    }

    /// Runs the VM to `STOP`.
    fn run(&mut self) -> Result<Value, String> {
        loop {
            let op = self.byte()?;
            let v = match op {
                b'(' => {
                    // BROKEN (`marks_unbounded`).
                    if self.marks.len() >= MAX_DEPTH as usize
                        && !cfg!(tidepool_broken = "marks_unbounded")
                    {
                        return Err(too_deep());
                    }
                    self.marks.push(self.stack.len());
                    continue;
                }
                b'.' => {
                    let v = self.pop()?;
                    if self.pos != self.p.data.len() {
                        return Err("pickle has data after its STOP opcode".into());
                    }
                    return Ok(v);
                }
                b'0' => {
                    if self.stack.len() <= self.floor() && !self.marks.is_empty() {
                        let m = self.pop_mark()?;
                        self.stack.truncate(m);
                    } else {
                        self.pop()?;
                    }
                    continue;
                }
                b'1' => {
                    let m = self.pop_mark()?;
                    self.stack.truncate(m);
                    continue;
                }
                b'2' => self.top()?.0,
                0x80 => {
                    self.take(1)?;
                    continue;
                }
                0x95 => {
                    self.take(8)?;
                    continue;
                }
                // Memo.
                b'p' | b'q' | b'r' | 0x94 => {
                    let id = match op {
                        b'p' => self.text_id()?,
                        b'q' => self.uint(1)? as u32,
                        b'r' => self.uint(4)? as u32,
                        _ => u32::try_from(self.memo.len() + self.sparse.len())
                            .map_err(|_| "pickle too large")?,
                    };
                    self.memo_put(id)?;
                    continue;
                }
                b'g' | b'h' | b'j' => {
                    let id = match op {
                        b'g' => self.text_id()?,
                        b'h' => self.uint(1)? as u32,
                        _ => self.uint(4)? as u32,
                    };
                    self.memo_get(u64::from(id))?;
                    continue;
                }
                // Scalars.
                b'N' => V::None,
                0x88 => V::Bool(true),
                0x89 => V::Bool(false),
                b'K' => V::Int(self.uint(1)? as i64),
                b'M' => V::Int(self.uint(2)? as i64),
                b'J' => V::Int(i64::from(self.uint(4)? as u32 as i32)),
                b'I' => self.text_int(false)?,
                b'L' => self.text_int(true)?,
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        self.uint(1)?
                    } else {
                        let n = self.uint(4)? as u32 as i32;
                        u64::try_from(n).map_err(|_| "pickle LONG4 of negative length")?
                    };
                    let at = self.take(n)?;
                    self.binary_long(at, n as usize)?
                }
                b'G' => {
                    let at = self.take(8)?;
                    let mut b = [0; 8];
                    b.copy_from_slice(&self.p.data[at..at + 8]);
                    V::Float(f64::from_be_bytes(b))
                }
                b'F' => {
                    let r = self.line()?;
                    let f = std::str::from_utf8(&self.p.data[r]).ok().and_then(|t| t.parse().ok());
                    V::Float(f.ok_or("bad FLOAT in pickle")?)
                }
                // Strings and bytes.
                b'X' | 0x8c | 0x8d => {
                    let width = match op {
                        0x8c => 1,
                        b'X' => 4,
                        _ => 8,
                    };
                    let n = self.uint(width)?;
                    let s = self.span(n)?;
                    self.utf8(s)?
                }
                b'B' | b'C' | 0x8e | 0x96 | b'T' | b'U' => {
                    let n = match op {
                        b'C' | b'U' => self.uint(1)?,
                        b'B' => self.uint(4)?,
                        b'T' => {
                            let n = self.uint(4)? as u32 as i32;
                            u64::try_from(n).map_err(|_| "pickle BINSTRING of negative length")?
                        }
                        _ => self.uint(8)?,
                    };
                    V::Bytes(self.span(n)?)
                }
                b'S' => self.escaped_string()?,
                b'V' => self.escaped_unicode()?,
                // Containers.
                b']' => V::List(self.new_seq(Vec::new())?),
                b')' => V::Tuple(self.new_seq(Vec::new())?),
                b'}' => V::Dict(self.new_seq(Vec::new())?),
                0x8f => V::Set(self.new_seq(Vec::new())?),
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < self.floor() + n {
                        return Err("pickle stack underflow".into());
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    V::Tuple(self.new_seq(items)?)
                }
                b't' => V::Tuple(self.seq_from_mark()?),
                b'l' => V::List(self.seq_from_mark()?),
                0x91 => V::FrozenSet(self.seq_from_mark()?),
                b'd' => {
                    let id = self.seq_from_mark()?;
                    if self.p.seqs[id as usize].len() % 2 == 1 {
                        return Err("pickle sets a dict item without a value".into());
                    }
                    V::Dict(id)
                }
                b'a' | b's' => {
                    let n = if op == b'a' { 1 } else { 2 };
                    if self.stack.len() < self.floor() + n {
                        return Err("pickle stack underflow".into());
                    }
                    let from = self.stack.len() - n;
                    self.extend(from, if op == b'a' { "list" } else { "dict" })?;
                    continue;
                }
                b'e' | b'u' | 0x90 => {
                    let from = self.pop_mark()?;
                    let kind = match op {
                        b'e' => "list",
                        b'u' => "dict",
                        _ => "set",
                    };
                    self.extend(from, kind)?;
                    continue;
                }
                // Globals.
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let g = self.global(&self.p.data[module], &self.p.data[name])?;
                    V::Global(g)
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (V::Str(module), V::Str(name)) = (module.0, name.0) else {
                        return Err("pickle STACK_GLOBAL of values that are not strings".into());
                    };
                    let (module, name) = (self.p.str_of(module), self.p.str_of(name));
                    V::Global(self.global(module.as_bytes(), name.as_bytes())?)
                }
                b'R' => self.reduce()?,
                _ => {
                    return Err(match opcode_name(op) {
                        Some(name) => {
                            format!("unsupported pickle opcode {name} ({op:#04x}): not plain data")
                        }
                        None => format!("unsupported pickle opcode {op:#04x}"),
                    });
                }
            };
            self.push(v);
        }
    }
}
