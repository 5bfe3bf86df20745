//! A pre-flight scan of a pickle, run before serde-pickle decodes it, that rejects inputs the
//! decoder would turn into a crash or an explosion: nesting deeper than [`MAX_DEPTH`] (the
//! decoder and `Drop` recurse once per level, so `]]]]…aaaa` overflows the stack) and `DUP`
//! sharing that expands to more than [`MAX_EXPANDED`] values (the decoder clones the shared
//! object at each reference: "billion laughs"), a string or bytes value counting one more for
//! every 64 bytes it holds.
//!
//! The scan walks the opcodes once, skipping their arguments without allocating, and mirrors
//! the unpickler's stack with a graph: every container is a node, scalars are counted as
//! leaves, memo entries point at nodes, and `APPEND`/`SETITEM`/`BUILD`… add edges to the
//! node on top of the stack. At `STOP`, an iterative depth-first search from the result
//! computes each node's depth and expanded size. The decoder also deep-copies values
//! while it reads, before `STOP`: the item under `DUP`, the arguments of `REDUCE`, `NEWOBJ`…
//! Those copies count towards the same bound, whether or not they end up in the result, and
//! an opcode the scan does not know is refused at once (the decoder would refuse it too, but
//! only after doing all the work before it). What the decoder holds while it reads counts as
//! well: every value it creates and every memo entry, whether or not it ends up in the result
//! (at most [`MAX_CREATED`]), open `MARK`s (serde-pickle gives each a stack of its own: at most
//! [`MAX_DEPTH`] at once), and the text of `INT`/`LONG` opcodes, which it parses in quadratic
//! time (at most [`MAX_TEXT_INT`] bytes).
//!
//! [`prepare`] turns every memo reference (`GET`) to a *container* into `None`. Python's pickler
//! writes a `GET` wherever one object is reached again, and serde-pickle rebuilds no sharing:
//! it deep-copies the object at each reference. PyTorch snapshots share exactly one kind of
//! container, the traceback (`frames` lists and the frame dicts in them, one per allocation
//! site), so a real snapshot expanded 7–10 times over: 7.9 million values for the 2.6 MB
//! ftcourse snapshot (0.7 GB of memory), close to the bound, so a snapshot 1.3 times longer
//! was refused. With the references cut, a container is decoded once, where it was first
//! written (ftcourse: 0.83 million values, 47 MB; cs336: 5.3 → 0.80 million, 468 → 63 MB);
//! tidepool reads no field that is shared (frames are not read), and a field it needs that
//! came out `None` is refused by the reader with its name. This also cuts cycles
//! (a container's reference to itself becomes `None`, as serde-pickle's
//! `replace_recursive_structures` would) and makes memo chains shallow.
//!
//! [`prepare`] also keeps short strings out of serde-pickle's memo. serde-pickle replaces a
//! memoized value by a counted reference, the count being the references it read; a shared
//! container holding one (PyTorch's frame dicts hold their keys and file names so) is expanded
//! at each of its own references, each expansion spends one count, and once they are spent
//! the string decodes as `None` — wherever it is used next (the empty string of a frame is
//! also `allocator_settings["PYTORCH_CUDA_ALLOC_CONF"]`). So a string of at most
//! [`MAX_INLINE`] bytes is memoized through a copy (`DUP`, the memo opcode, `POP`: the memo gets
//! the copy, the value stays a plain string), and each memo reference (`GET`) to one becomes a
//! copy of the string's opcode. The decoded value is the same, with no more values (each
//! reference was already counted); the pickle grows by at most [`MAX_INLINE_TOTAL`] bytes,
//! after which the remaining strings are left as they are.
//!
//! [`prepare`] also zeroes every float before decoding: serde-pickle orders hashable values
//! (set elements, dict keys) with a comparison that is not total once floats are involved (NaN
//! is "less" than everything, integers and floats compare lossily), and building a set or dict
//! sorts them, which panics on such a comparison. No field tidepool reads is a float, so
//! turning each one into `0.0` changes no trace and leaves the ordering total.

use std::collections::HashMap;

/// Deepest nesting accepted (PyTorch snapshots nest about 6 levels).
pub const MAX_DEPTH: u32 = 128;
/// Most values the decoded pickle may expand to (after memo and `DUP` references are copied),
/// a string or bytes value counting one more per 64 bytes. A decoded value costs about 64
/// bytes, twice while serde-pickle converts it, so this bounds one decode near 1.3 GB and a few
/// seconds, whatever the input claims (2·10^8 unweighted values, the bound before, let a 1.5 KB
/// pickle of duplicated tuples take 12 GB, and a duplicated string could take any amount).
pub const MAX_EXPANDED: u64 = 10_000_000;
/// Most values the decoder may create while it reads, whether or not they end up in the
/// result (values left on the stack, memo entries): a real pickle creates each value of its
/// result once and memoizes at most as many, so twice [`MAX_EXPANDED`].
pub const MAX_CREATED: u64 = 2 * MAX_EXPANDED;
/// Longest decimal text of an `INT` or `LONG` opcode accepted (serde-pickle parses it in time
/// quadratic in its length; no field of a snapshot needs more than 20 digits).
pub const MAX_TEXT_INT: usize = 1024;
/// Longest string opcode (opcode, length and text) copied in place of a memo reference.
pub const MAX_INLINE: usize = 256;
/// Most bytes added to a pickle by copying strings in place of memo references.
pub const MAX_INLINE_TOTAL: usize = 64 << 20;

/// A rewrite of the opcode at a range of the input.
type Rewrite = (std::ops::Range<usize>, Replace);

/// What a rewritten opcode becomes.
enum Replace {
    /// The memo opcode wrapped in `DUP` … `POP`: the memo gets a copy.
    Wrap,
    /// The bytes at another range of the input (a string opcode in place of a `GET`).
    Copy(std::ops::Range<usize>),
    /// `NONE` (a `GET` of a shared container).
    Nothing,
}

#[derive(Clone, Copy)]
enum Item {
    /// A scalar, with its weight: 1, plus 1 per 64 bytes of text or bytes it holds.
    Leaf(u64),
    Node(u32),
}

/// Where a float sits in the pickle.
enum Float {
    /// An IEEE 754 double, big-endian.
    Binary(std::ops::Range<usize>),
    /// A decimal number as text.
    Text(std::ops::Range<usize>),
}

#[derive(Default)]
struct Node {
    children: Vec<u32>,
    leaves: u64,
}

struct Scan<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Item>,
    marks: Vec<usize>,
    memo: HashMap<u64, Item>,
    nodes: Vec<Node>,
    /// Float payloads: `BINFLOAT`'s 8 bytes, `FLOAT`'s decimal text.
    floats: Vec<Float>,
    /// Items the decoder deep-copies while reading (`DUP`, `REDUCE`-like arguments).
    copied: Vec<Item>,
    /// The last short string opcode: its bytes and the stack length after it pushed.
    last_string: Option<(std::ops::Range<usize>, usize)>,
    /// Memo ids holding a short string, with the string opcode's bytes.
    memo_text: HashMap<u64, std::ops::Range<usize>>,
    /// Rewrites, in input order: a memo opcode to wrap in `DUP` … `POP`, a `GET` to replace
    /// by the string opcode's bytes or by `NONE`.
    inline: Vec<Rewrite>,
    /// Bytes `inline` adds.
    inline_bytes: usize,
    /// Values the decoder creates, whether or not they end up in the result (a value left on
    /// the stack or popped costs as much memory while decoding), memo entries included.
    created: u64,
    /// The most `created` may reach: [`MAX_CREATED`] (a smaller one in tests).
    max_created: u64,
}

/// Checks `data`; `Err` carries the reason. Opcodes the scan does not know are left to the
/// decoder (which rejects them).
#[cfg(test)]
pub fn check(data: &[u8]) -> Result<(), String> {
    scan(data, MAX_CREATED).map(|_| ())
}

/// Checks `data` as described above, then sets every float in it to `0.0` and copies short
/// shared strings in place of their memo references (see the module docs).
pub fn prepare(data: &mut Vec<u8>) -> Result<(), String> {
    let (floats, inline, added) = scan(data, MAX_CREATED)?;
    for float in floats {
        match float {
            Float::Binary(r) => data[r].fill(0),
            Float::Text(r) => data[r].fill(b'0'),
        }
    }
    if !inline.is_empty() {
        let mut out = Vec::with_capacity(data.len().saturating_add(added));
        let mut at = 0;
        for (op, replace) in inline {
            out.extend_from_slice(&data[at..op.start]);
            match replace {
                Replace::Copy(text) => out.extend_from_slice(&data[text]),
                Replace::Wrap => {
                    out.push(b'2');
                    out.extend_from_slice(&data[op.clone()]);
                    out.push(b'0');
                }
                Replace::Nothing => out.push(b'N'),
            }
            at = op.end;
        }
        out.extend_from_slice(&data[at..]);
        *data = out;
    }
    Ok(())
}

/// Checks `data`, refusing it where the decoder would create more than `max_created` values;
/// where its floats are, the strings to copy in place of memo references, and the bytes that
/// adds.
fn scan(data: &[u8], max_created: u64) -> Result<(Vec<Float>, Vec<Rewrite>, usize), String> {
    let mut s = Scan {
        data,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        nodes: Vec::new(),
        floats: Vec::new(),
        copied: Vec::new(),
        last_string: None,
        memo_text: HashMap::new(),
        inline: Vec::new(),
        inline_bytes: 0,
        created: 0,
        max_created,
    };
    let result = s.run()?;
    let mut measured = std::mem::take(&mut s.copied);
    measured.extend(result);
    s.measure(&measured)?;
    Ok((s.floats, s.inline, s.inline_bytes))
}

impl Scan<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or("truncated pickle")?;
        let out = &self.data[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn uint(&mut self, n: usize) -> Result<u64, String> {
        let b = self.take(n)?;
        Ok(b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    }

    fn line(&mut self) -> Result<&[u8], String> {
        let rest = &self.data[self.pos..];
        let n = rest.iter().position(|&b| b == b'\n').ok_or("truncated pickle")?;
        self.pos += n + 1;
        Ok(&rest[..n])
    }

    fn pop(&mut self) -> Result<Item, String> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err("pickle stack underflow".into());
        }
        self.stack.pop().ok_or_else(|| "pickle stack underflow".into())
    }

    fn pop_mark(&mut self) -> Result<Vec<Item>, String> {
        let mark = self.marks.pop().ok_or("pickle mark underflow")?;
        Ok(self.stack.split_off(mark.min(self.stack.len())))
    }

    /// Counts one more value created by the decoder.
    fn create(&mut self) -> Result<(), String> {
        self.created += 1;
        if self.created > self.max_created {
            return Err(format!("pickle creates more than {} values", self.max_created));
        }
        Ok(())
    }

    fn new_node(&mut self, items: &[Item]) -> Result<Item, String> {
        self.create()?;
        let id = u32::try_from(self.nodes.len()).map_err(|_| "pickle too large")?;
        self.nodes.push(Node::default());
        self.add(id, items);
        Ok(Item::Node(id))
    }

    fn add(&mut self, node: u32, items: &[Item]) {
        let n = &mut self.nodes[node as usize];
        for it in items {
            match *it {
                Item::Leaf(weight) => n.leaves = n.leaves.saturating_add(weight),
                Item::Node(c) => n.children.push(c),
            }
        }
    }

    fn add_to_top(&mut self, items: &[Item]) -> Result<(), String> {
        match self.stack.last() {
            Some(&Item::Node(top)) => {
                self.add(top, items);
                Ok(())
            }
            _ => Err("pickle modifies a value that is not a container".into()),
        }
    }

    fn top(&self) -> Result<Item, String> {
        self.stack.last().copied().ok_or_else(|| "pickle stack underflow".into())
    }

    /// Runs to `STOP`; the result item, or `None` for an opcode left to the decoder.
    fn run(&mut self) -> Result<Option<Item>, String> {
        loop {
            let op_start = self.pos;
            let op = self.take(1)?[0];
            let mut weight = 1;
            match op {
                0x80 | b'K' => _ = self.take(1)?,
                b'M' => _ = self.take(2)?,
                b'J' => _ = self.take(4)?,
                b'G' => {
                    let start = self.pos;
                    self.take(8)?;
                    self.floats.push(Float::Binary(start..self.pos));
                }
                b'F' => {
                    let start = self.pos;
                    let text = self.line()?;
                    // Only text that parses (the decoder rejects the rest). A `\r` before the
                    // newline is part of the text here (the decoder strips it): "0…0" either way.
                    let end = start + text.len();
                    let parses = std::str::from_utf8(text)
                        .is_ok_and(|t| t.trim_end_matches('\r').parse::<f64>().is_ok());
                    if parses {
                        self.floats.push(Float::Text(start..end));
                    }
                }
                0x95 => _ = self.take(8)?,
                b'I' | b'L' => {
                    if self.line()?.len() > MAX_TEXT_INT {
                        return Err(format!(
                            "pickle has a decimal integer longer than {MAX_TEXT_INT} digits"
                        ));
                    }
                }
                b'S' | b'V' => weight += self.line()?.len() as u64 / 64,
                b'U' | b'C' | 0x8c | 0x8a | b'T' | b'B' | b'X' | 0x8b | 0x8d | 0x8e | 0x96 => {
                    let width = match op {
                        b'U' | b'C' | 0x8c | 0x8a => 1,
                        b'T' | b'B' | b'X' | 0x8b => 4,
                        _ => 8,
                    };
                    let len = self.uint(width)?;
                    self.take(usize::try_from(len).map_err(|_| "truncated pickle")?)?;
                    weight += len / 64;
                }
                b'N' | 0x88 | 0x89 => {}
                b'(' => {
                    // serde-pickle allocates a 128-value stack per open mark: a run of marks
                    // would cost kilobytes per input byte. Marks open at once nest like the
                    // containers they build.
                    if self.marks.len() >= MAX_DEPTH as usize {
                        return Err(format!("pickle nests deeper than {MAX_DEPTH} levels"));
                    }
                    self.marks.push(self.stack.len());
                    continue;
                }
                b'.' => return Ok(Some(self.pop()?)),
                b'0' => {
                    if self.stack.len() <= self.marks.last().copied().unwrap_or(0)
                        && !self.marks.is_empty()
                    {
                        self.pop_mark()?;
                    } else {
                        self.pop()?;
                    }
                    continue;
                }
                b'1' => {
                    self.pop_mark()?;
                    continue;
                }
                b'2' => {
                    let t = self.top()?;
                    self.copied.push(t);
                    self.stack.push(t);
                    continue;
                }
                b')' | b']' | b'}' | 0x8f => {
                    let n = self.new_node(&[])?;
                    self.stack.push(n);
                    continue;
                }
                0x85..=0x87 => {
                    let k = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(k);
                    for _ in 0..k {
                        items.push(self.pop()?);
                    }
                    let n = self.new_node(&items)?;
                    self.stack.push(n);
                    continue;
                }
                b't' | b'l' | b'd' | 0x91 | b'o' => {
                    let items = self.pop_mark()?;
                    let n = self.new_node(&items)?;
                    self.stack.push(n);
                    continue;
                }
                b'i' => {
                    self.line()?;
                    self.line()?;
                    let items = self.pop_mark()?;
                    let n = self.new_node(&items)?;
                    self.stack.push(n);
                    continue;
                }
                b'a' | b'b' => {
                    let x = self.pop()?;
                    self.add_to_top(&[x])?;
                    continue;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.add_to_top(&[k, v])?;
                    continue;
                }
                b'e' | b'u' | 0x90 => {
                    let items = self.pop_mark()?;
                    self.add_to_top(&items)?;
                    continue;
                }
                b'c' => {
                    self.line()?;
                    self.line()?;
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    self.copied.extend([name, module]);
                }
                b'R' | 0x81 | 0x92 => {
                    let k = if op == 0x92 { 3 } else { 2 };
                    let mut items = Vec::with_capacity(k);
                    for _ in 0..k {
                        items.push(self.pop()?);
                    }
                    self.copied.extend(items.iter().copied());
                    let n = self.new_node(&items)?;
                    self.stack.push(n);
                    continue;
                }
                b'P' => _ = self.line()?,
                b'Q' => {
                    let x = self.pop()?;
                    let n = self.new_node(&[x])?;
                    self.stack.push(n);
                    continue;
                }
                0x82 => _ = self.take(1)?,
                0x83 => _ = self.take(2)?,
                0x84 => _ = self.take(4)?,
                0x97 => {}
                0x98 => continue,
                b'p' | b'q' | b'r' | 0x94 => {
                    let id = match op {
                        b'p' => {
                            let l = self.line()?;
                            std::str::from_utf8(l)
                                .ok()
                                .and_then(|t| t.trim().parse::<u64>().ok())
                                .ok_or("bad memo id")?
                        }
                        b'q' => self.uint(1)?,
                        b'r' => self.uint(4)?,
                        _ => self.memo.len() as u64,
                    };
                    let t = self.top()?;
                    // A memo entry costs the decoder about as much as a value.
                    self.create()?;
                    self.memo.insert(id, t);
                    match &self.last_string {
                        Some((text, depth))
                            if text.end == op_start
                                && *depth == self.stack.len()
                                && self.inline_bytes + 2 <= MAX_INLINE_TOTAL =>
                        {
                            self.memo_text.insert(id, text.clone());
                            self.inline_bytes += 2;
                            self.inline.push((op_start..self.pos, Replace::Wrap));
                        }
                        _ => _ = self.memo_text.remove(&id),
                    }
                    continue;
                }
                b'g' | b'h' | b'j' => {
                    let id = match op {
                        b'g' => {
                            let l = self.line()?;
                            std::str::from_utf8(l)
                                .ok()
                                .and_then(|t| t.trim().parse::<u64>().ok())
                                .ok_or("bad memo id")?
                        }
                        b'h' => self.uint(1)?,
                        _ => self.uint(4)?,
                    };
                    let item = *self.memo.get(&id).ok_or("pickle memo reference to nothing")?;
                    if let Item::Node(_) = item {
                        // A shared container decodes as `None` (see the module docs).
                        self.stack.push(Item::Leaf(1));
                        self.inline.push((op_start..self.pos, Replace::Nothing));
                        continue;
                    }
                    self.stack.push(item);
                    if let Some(text) = self.memo_text.get(&id)
                        && self.inline_bytes + text.len() <= MAX_INLINE_TOTAL
                    {
                        self.inline_bytes += text.len();
                        self.inline.push((op_start..self.pos, Replace::Copy(text.clone())));
                    }
                    continue;
                }
                _ => return Err(format!("unsupported pickle opcode {op:#04x}")),
            }
            // Every arm that falls through here, except PROTO and FRAME, yields one scalar.
            if !matches!(op, 0x80 | 0x95) {
                self.create()?;
                self.stack.push(Item::Leaf(weight));
                let short_text =
                    matches!(op, 0x8c | b'X' | 0x8d) && self.pos - op_start <= MAX_INLINE;
                self.last_string = short_text.then_some((op_start..self.pos, self.stack.len()));
            }
        }
    }

    /// Depth and expanded size of the graph under each of `items`, iteratively; their
    /// expanded sizes must add up to at most [`MAX_EXPANDED`].
    fn measure(&self, items: &[Item]) -> Result<(), String> {
        const NEW: u8 = 0;
        const OPEN: u8 = 1;
        const DONE: u8 = 2;
        let too_big = || {
            Err(format!(
                "pickle expands to more than {MAX_EXPANDED} values (a snapshot of more than \
                 about 600 000 trace entries, or values copied through shared references); \
                 record fewer entries (max_entries)"
            ))
        };
        let n = self.nodes.len();
        let mut state = vec![NEW; n];
        let mut depth = vec![0u32; n];
        let mut size = vec![0u64; n];
        let mut total = 0u64;
        for item in items {
            let root = match *item {
                Item::Leaf(weight) => {
                    total = total.saturating_add(weight);
                    if total > MAX_EXPANDED {
                        return too_big();
                    }
                    continue;
                }
                Item::Node(root) => root,
            };
            if state[root as usize] == NEW {
                state[root as usize] = OPEN;
                let mut path: Vec<(u32, usize)> = vec![(root, 0)];
                while let Some(&mut (node, ref mut next)) = path.last_mut() {
                    let children = &self.nodes[node as usize].children;
                    if let Some(&child) = children.get(*next) {
                        *next += 1;
                        match state[child as usize] {
                            NEW => {
                                state[child as usize] = OPEN;
                                path.push((child, 0));
                                if path.len() as u32 > MAX_DEPTH {
                                    return Err(format!(
                                        "pickle nests deeper than {MAX_DEPTH} levels"
                                    ));
                                }
                            }
                            OPEN => return Err("pickle contains a recursive structure".into()),
                            _ => {}
                        }
                        continue;
                    }
                    let me = &self.nodes[node as usize];
                    let mut d = u32::from(me.leaves > 0);
                    let mut s = 1u64.saturating_add(me.leaves);
                    for &c in &me.children {
                        d = d.max(depth[c as usize]);
                        s = s.saturating_add(size[c as usize]);
                    }
                    depth[node as usize] = d + 1;
                    size[node as usize] = s;
                    if d + 1 > MAX_DEPTH {
                        return Err(format!("pickle nests deeper than {MAX_DEPTH} levels"));
                    }
                    if s > MAX_EXPANDED {
                        return too_big();
                    }
                    state[node as usize] = DONE;
                    path.pop();
                }
            }
            total = total.saturating_add(size[root as usize]);
            if total > MAX_EXPANDED {
                return too_big();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_and_shallow_pickles_pass() {
        // {"x": [1, 2]} with protocol 4 framing and memoization.
        let p =
            b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01x\x94]\x94(K\x01K\x02es.";
        assert_eq!(check(p), Ok(()));
    }

    /// Values the decoder creates count, whether or not they end up in the result: `]` × n
    /// then `None` (the lists stay on the stack; the result is `None`) cost ~48 bytes of memory
    /// per input byte, `None` then `MEMOIZE` × n ~87 (a memo entry each): refused past the bound
    /// (found in review; the bound is smaller here, so the test stays small).
    #[test]
    fn values_left_on_the_stack_or_in_the_memo_count() {
        for op in [b']', 0x94] {
            let pickle = |n: usize| {
                let mut p = b"\x80\x04N".to_vec();
                p.extend(std::iter::repeat_n(op, n));
                p.extend(b"N.");
                p
            };
            // `N`, n values or memo entries, `N`: n + 2 created.
            assert_eq!(scan(&pickle(998), 1000).map(|_| ()), Ok(()), "{op:#x}");
            let e = scan(&pickle(999), 1000).map(|_| ());
            assert_eq!(e, Err("pickle creates more than 1000 values".into()), "{op:#x}");
        }
    }

    #[test]
    fn deep_nesting_is_rejected() {
        let n = 10_000;
        let mut p = b"\x80\x04".to_vec();
        p.extend(std::iter::repeat_n(b']', n));
        p.extend(std::iter::repeat_n(b'a', n - 1));
        p.push(b'.');
        assert_eq!(check(&p), Err("pickle nests deeper than 128 levels".into()));
    }

    /// `data` prepared and decoded as the snapshot reader does.
    fn decoded(data: &[u8]) -> Result<Value, String> {
        let mut p = data.to_vec();
        prepare(&mut p)?;
        let options = serde_pickle::DeOptions::new().replace_recursive_structures();
        serde_pickle::value_from_slice(&p, options).map_err(|e| e.to_string())
    }

    use serde_pickle::Value;

    /// A list of `items`.
    fn list(items: Vec<Value>) -> Value {
        Value::List(items)
    }

    #[test]
    fn memo_chains_are_cut() {
        // L0 = []; memo 0. Then repeatedly: L = [memo[i]]; memo i+1. Nested 200 deep through
        // the memo, each reference is a `None` now: the result is [None].
        let mut p = b"\x80\x04]\x94".to_vec();
        for i in 0..200u8 {
            p.extend([b']', b'h', i, b'a', 0x94]);
        }
        p.push(b'.');
        assert_eq!(decoded(&p), Ok(list(vec![Value::None])));
    }

    #[test]
    fn exponential_sharing_is_cut() {
        // L0 = [1]; L(i+1) = [L(i), L(i)]: 2^60 values if each reference were copied, as
        // serde-pickle does; each is a `None` now.
        let mut p = b"\x80\x04]\x94K\x01a".to_vec();
        for i in 0..60u8 {
            p.extend([b']', 0x94, b'h', i, b'a', b'h', i, b'a']);
        }
        p.push(b'.');
        assert_eq!(check(&p), Ok(()));
        assert_eq!(decoded(&p), Ok(list(vec![Value::None, Value::None])));
    }

    #[test]
    fn cycles_are_cut() {
        // L = []; memo 0; append L to itself: [None].
        let p = b"\x80\x04]\x94h\x00a.";
        assert_eq!(decoded(p), Ok(list(vec![Value::None])));
        // A reference to a container that is then modified through it (no pickler writes
        // that) is refused before decoding.
        let p = b"\x80\x04]\x940h\x00K\x01a.";
        assert_eq!(check(p), Err("pickle modifies a value that is not a container".into()));
    }

    /// `T(k)`: nested pairs of 2^k leaves built by `DUP` (2^(k+1) − 1 values, and as many
    /// again copied by the `DUP`s on the way), left on top of the stack.
    fn shared_lists(k: u8) -> Vec<u8> {
        let mut p = b"\x80\x04K\x01\x85".to_vec();
        p.extend(b"2\x86".repeat(usize::from(k)));
        p
    }

    /// Regression (found by the `trace_parse` fuzz target, as a timeout at 1.9 GB of memory):
    /// tuples of `DUP`licated tuples double the decoded size per 2 bytes of input.
    #[test]
    fn duplicated_tuples_are_bounded() {
        let doubling = |n: usize| {
            let mut p = b"\x80\x04K\x01\x85".to_vec();
            p.extend(b"2\x86".repeat(n));
            p.push(b'.');
            p
        };
        // 2^20 leaves, twice as many tuples, and as much again copied by each DUP on the way
        // (6·10^6 values, ~0.4 GB) are fine; 2^24 would take 2 GB.
        assert_eq!(check(&doubling(20)), Ok(()));
        let e = check(&doubling(24)).unwrap_err();
        assert!(e.contains("expands to more than 10000000 values"), "{e}");
        // The fuzzer's input.
        let p = include_bytes!(
            "../../../../fuzz/artifacts/trace_parse/timeout-ee5fb973092f80fd15a970ac968bc38daeb6ea00"
        );
        let e = check(p).unwrap_err();
        assert!(e.contains("expands to more than"), "{e}");
    }

    /// Regression (found by the `trace_parse` fuzz target, out of memory): frozensets of
    /// `DUP`licated tuples ending in an opcode the decoder does not know. The decoder copied
    /// everything before refusing that opcode; the scan used to stop there and pass it on.
    #[test]
    fn copies_made_before_the_result_count_and_unknown_opcodes_are_refused() {
        let p = include_bytes!(
            "../../../../fuzz/artifacts/trace_parse/oom-2f6a1e9bb5c3d0364ca7673f2428393338b6e7c3"
        );
        assert!(check(p).is_err());
        assert_eq!(check(b"\x80\x04]\x00."), Err("unsupported pickle opcode 0x00".into()));
        // T(20) (4·10^6 values with its copies) is fine; copied by DUP and dropped by POP three
        // times more, it is not.
        let dup_pop = |times: usize| {
            let mut p = shared_lists(20);
            p.extend(b"20".repeat(times));
            p.push(b'.');
            p
        };
        assert_eq!(check(&dup_pop(1)), Ok(()));
        assert!(check(&dup_pop(3)).unwrap_err().contains("expands to more than"));
        // The same through REDUCE, whose arguments the decoder copies: T(20) copied once by
        // DUP and POP is fine next to a callable; as the callable's argument it is copied once
        // more, too many.
        let call = |reduce: bool| {
            let mut p = b"\x80\x04cbuiltins\nobject\n".to_vec();
            p.extend(&dup_pop(1)[2..dup_pop(1).len() - 1]);
            p.extend(if reduce { &b"\x85R"[..] } else { &b"\x86"[..] });
            p.push(b'.');
            p
        };
        assert_eq!(check(&call(false)), Ok(()));
        assert!(check(&call(true)).unwrap_err().contains("expands to more than"));
    }

    /// A string or bytes value weighs one value per 64 bytes it holds.
    #[test]
    fn duplicated_strings_are_weighed_by_their_bytes() {
        let doubling = |n: usize| {
            let mut p = b"\x80\x04X\x60\xea\x00\x00".to_vec(); // a 60000-byte string
            p.extend(std::iter::repeat_n(b'x', 60_000));
            p.push(0x85);
            p.extend(b"2\x86".repeat(n));
            p.push(b'.');
            p
        };
        // 2^8 copies are 15 MB; 2^14 copies would be 1 GB though only 2^15 values.
        assert_eq!(check(&doubling(8)), Ok(()));
        assert!(check(&doubling(14)).unwrap_err().contains("expands to more than"));
    }

    /// Regression (found by the `trace_parse` fuzz target): serde-pickle sorts set elements
    /// and dict keys with an ordering that is not total for floats (NaN; integers against
    /// floats), and Rust's sort panics on that. Floats are zeroed before decoding.
    #[test]
    fn floats_are_zeroed_so_sets_and_dict_keys_sort() {
        // Python: pickle.dumps([frozenset({nan, nan, nan, 1.5, 2**53 + 1, 2.0**53, 0.5, -1.0, 7}),
        //                       {2**53 + 1: 1, 2.0**53: 3, nan: 4, 0.5: 5}], protocol=4)
        let mut p = b"\x80\x04\x95\x82\x00\x00\x00\x00\x00\x00\x00]\x94((GC@\x00\x00\x00\x00\x00\x00G?\xf8\x00\x00\x00\x00\x00\x00\x8a\x07\x01\x00\x00\x00\x00\x00 G\x7f\xf8\x00\x00\x00\x00\x00\x00G?\xe0\x00\x00\x00\x00\x00\x00K\x07G\x7f\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf8\x00\x00\x00\x00\x00\x00G\xbf\xf0\x00\x00\x00\x00\x00\x00\x91\x94}\x94(\x8a\x07\x01\x00\x00\x00\x00\x00 K\x01GC@\x00\x00\x00\x00\x00\x00K\x03G\x7f\xf8\x00\x00\x00\x00\x00\x00K\x04G?\xe0\x00\x00\x00\x00\x00\x00K\x05ue.".to_vec();
        assert_eq!(check(&p), Ok(()));
        let len = p.len();
        prepare(&mut p).unwrap();
        assert_eq!(p.len(), len, "floats are rewritten in place");
        let v = serde_pickle::value_from_slice(&p, serde_pickle::DeOptions::new()).unwrap();
        let text = format!("{v:?}");
        assert!(!text.contains("NaN") && !text.contains("1.5"), "{text}");
        assert!(text.contains("9007199254740993"), "integers are kept: {text}");
    }

    /// The fuzzer's input (fuzz/artifacts/trace_parse/crash-d04fa3c1…): a frozenset of floats,
    /// one of them NaN, and of a dict. Without zeroing, decoding it panics while sorting the
    /// floats; with zeroing, the decoder gets as far as the dict and refuses it (unhashable).
    #[test]
    fn the_fuzzer_input_decodes_without_panicking() {
        let mut p = b"\x95\xd6\x04\x00\xff\x00\x00\x00\x00}\x94(NNNKKNNNKKKKGGNGGGGGCGGGGGGYGGGGGGGGGGGGGGGGG\x5cGGGGGGGG-GGGGGGGGGGGG\xff\xff\xff\xc6GGGGGGGGGGGGGGGG%GGGGGGGGGGGGIGGGGGNNNNNNN\x94}KKKKKKKKKKKKKKKKK\x94\x91.\x06((".to_vec();
        prepare(&mut p).unwrap();
        let r = serde_pickle::value_from_slice(&p, serde_pickle::DeOptions::new());
        assert!(r.as_ref().is_err_and(|e| e.to_string().contains("hashable")), "{r:?}");
    }

    /// A string shared by a shared container and another value: the container's second
    /// reference is `None`, the string's is a copy of it. (Without the copy, serde-pickle
    /// runs out of references to a string that a copied container holds, and decodes the
    /// later ones as `None`; `DUP` still copies containers.)
    #[test]
    fn shared_strings_are_copied_in_place_and_shared_containers_cut() {
        // Python: s = "kkk"; inner = {"a": s}; pickle.dumps([inner, inner, s], protocol=4)
        let original =
            b"\x80\x04\x95\x16\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94\x8c\x01a\x94\x8c\x03kkk\x94sh\x01h\x03e.";
        let options = || serde_pickle::DeOptions::new().replace_recursive_structures();
        let mut p = original.to_vec();
        prepare(&mut p).unwrap();
        // Two memo opcodes wrapped (+2 bytes each), the GET of `kkk` (2 bytes) became its
        // opcode (5 bytes), the GET of the dict (2 bytes) became `NONE` (1 byte).
        assert_eq!(p.len(), original.len() + 2 * 2 + 5 - 2 + 1 - 2);
        let v = serde_pickle::value_from_slice(&p, options()).unwrap();
        let kkk = || Value::String("kkk".into());
        let inner = Value::Dict([(serde_pickle::HashableValue::String("a".into()), kkk())].into());
        assert_eq!(v, list(vec![inner, Value::None, kkk()]));
        // DUP copies the container, so the string it holds is referenced once more than the
        // decoder read: the copy keeps it a string.
        let dup = b"\x80\x04]\x94(}\x94\x8c\x01a\x94\x8c\x03kkk\x94s2h\x03e.";
        let text = format!("{:?}", decoded(dup).unwrap());
        assert_eq!(text.matches("String(\"kkk\")").count(), 3, "{text}");
        let broken = serde_pickle::value_from_slice(dup, options()).unwrap();
        assert!(format!("{broken:?}").contains("None"), "{broken:?}");
    }

    #[test]
    fn text_floats_are_zeroed_when_they_parse() {
        let mut p = b"(Fnan\nF-1.5\r\nFjunk\nl.".to_vec();
        prepare(&mut p).unwrap();
        assert_eq!(&p, b"(F000\nF00000\nFjunk\nl.");
    }
}
