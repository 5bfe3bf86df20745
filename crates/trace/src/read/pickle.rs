//! A small pickle decoder for plain data: what CPython's pickler writes for dicts, lists,
//! tuples, sets, strings, bytes, integers, floats, booleans and `None`, in protocols 0 to 5.
//! PyTorch memory snapshots are such pickles.
//!
//! The decoder runs the pickle VM over the input once, without recursion:
//!
//! ```text
//!  input ──► opcode loop ──► stack of Values (+ marks) ──► STOP: the root Value
//!                 │   ▲
//!                 ▼   │ PUT / GET / DUP copy a 16-byte handle, never the object
//!               memo ──┘
//!
//!  Value: None | Bool | Int | Float | Str(span) | Bytes(span) | List(i) | Dict(i) | …
//!                                      │                        │
//!                     the input itself (or `extra`)       arena: Vec<Vec<Value>>
//! ```
//!
//! A `Value` is a 16-byte `Copy` handle. Containers live in an arena (`Vec<Vec<Value>>`,
//! a dict as its keys and values in turn) and are named by index, so a memo reference or a
//! `DUP` shares the object as Python does (PyTorch shares every traceback between the entries
//! that recorded it) and costs 16 bytes whatever the object's size: "billion laughs" is
//! cheap. Mutation through any reference is seen through all of them, cycles are harmless,
//! and dropping a [`Pickle`] frees flat vectors (no recursive `Drop`). Bytes are spans of the
//! input, which the [`Pickle`] keeps; only protocol 0's escaped strings and the latin-1
//! conversions of `_codecs.encode`/`bytearray` are copied (into `extra`). Strings are checked
//! once, as they are decoded, and copied into one `String` (`text`, at most the input's size
//! again), so viewing one is O(1) however often it is viewed: viewing them as spans of the
//! input checked their UTF-8 at every view, and one 500 KB `action` string shared by 500 000
//! entries (a 1 MB pickle) took 6 s to read.
//!
//! Bounds, whatever the input claims:
//! - every opcode creates at most one container, stack slot or memo slot, and a length read
//!   from the input is checked against the bytes that remain before anything is sliced: the
//!   values held are at most one per input byte. The worst case is `EMPTY_LIST` repeated,
//!   each byte a new list (24 bytes of arena, a height byte, a 16-byte stack slot, and the
//!   vectors' doubling): about 40 bytes of memory per input byte (20 MB of it peak at 825 MB
//!   of RSS; `N` + `TUPLE1` pairs at 37 bytes per byte, `DUP`, `MEMOIZE` or `NONE` at 17).
//!   A real snapshot takes about 7 (a trace entry is a dict of 8 keys, ~50 bytes of pickle,
//!   ~340 bytes decoded with its memo and list slots).
//! - decoded copies (`extra`) are at most [`EXTRA_PER_BYTE`] bytes per input byte;
//! - nesting is at most [`MAX_DEPTH`] levels (a container's height is recorded when items are
//!   added to it; one changed after it was itself added elsewhere is not re-measured, so the
//!   bound is the one a pickler's output meets: nothing here recurses over values), and at
//!   most [`MAX_DEPTH`] marks are open at once;
//! - the decimal text of `INT`/`LONG` is at most [`MAX_TEXT_INT`] digits; integers are kept
//!   as `i64`, or `i128`, or marked as wider ([`Obj::BigInt`]);
//! - inputs of 4 GiB or more are refused (spans are 32-bit).
//!
//! Objects other than plain data are refused with the opcode's name (`BUILD`, `NEWOBJ`…) or
//! the global's: the only globals accepted are those the pickler uses for plain data
//! (`builtins.set`/`frozenset`/`list`/`bytes`/`bytearray`/`int`, `_codecs.encode` for bytes
//! in protocols 0–2, `collections.OrderedDict`), applied by `REDUCE`. Persistent ids, extension
//! codes and out-of-band buffers are refused. Data after `STOP` is an error.
//!
//! Here: the decoded values and their views ([`Pickle`], [`Obj`], [`Seq`], [`Dict`]); the VM is
//! in `pickle/decoder.rs`.

mod decoder;

pub use decoder::decode;

use std::fmt;

/// Deepest nesting of containers, and most marks open at once (PyTorch snapshots nest about
/// 6 levels).
pub const MAX_DEPTH: u32 = 128;
/// Longest decimal text of an `INT` or `LONG` opcode (no snapshot field needs more than 20).
pub const MAX_TEXT_INT: usize = 1024;
/// Most bytes of decoded copies (protocol 0's escaped strings, latin-1 conversions) per byte
/// of input: an escaped string decodes to at most twice its text, a conversion to at most
/// its string's length, each done once by a pickler.
pub const EXTRA_PER_BYTE: usize = 3;

/// A decoded value: a scalar, or a handle on a string or container of its [`Pickle`] (read
/// through `Pickle::obj`).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Value(V);

#[derive(Clone, Copy, Debug, PartialEq)]
enum V {
    None,
    Bool(bool),
    Int(i64),
    /// An integer outside `i64`, inside `i128`: index in `Pickle::bigs`.
    Big(u32),
    /// An integer outside `i128`.
    Huge,
    Float(f64),
    Str(Span),
    Bytes(Span),
    List(u32),
    Tuple(u32),
    Dict(u32),
    Set(u32),
    FrozenSet(u32),
    Global(Global),
}

const _: () = assert!(std::mem::size_of::<V>() == 16);

/// Bytes of the input (below its length) or of `extra` (from the input's length on).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Span {
    at: u32,
    len: u32,
}

/// The globals accepted: those the pickler writes for plain data.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Global {
    Set,
    FrozenSet,
    List,
    Bytearray,
    Bytes,
    Int,
    /// `_codecs.encode(text, "latin1")`: bytes in protocols 0–2.
    Encode,
    OrderedDict,
}

impl Global {
    fn name(self) -> &'static str {
        match self {
            Global::Set => "builtins.set",
            Global::FrozenSet => "builtins.frozenset",
            Global::List => "builtins.list",
            Global::Bytearray => "builtins.bytearray",
            Global::Bytes => "builtins.bytes",
            Global::Int => "builtins.int",
            Global::Encode => "_codecs.encode",
            Global::OrderedDict => "collections.OrderedDict",
        }
    }
}

/// A decoded pickle: the input it was read from and everything decoded out of it.
pub struct Pickle {
    data: Vec<u8>,
    /// Decoded copies; a span at `data.len() + i` starts at `extra[i]`.
    extra: Vec<u8>,
    /// Every string, checked UTF-8 when decoded; a `V::Str` span is a span of it.
    text: String,
    /// Bytes checked as UTF-8 so far, decoding and viewing (for the tests' bound on work).
    #[cfg(test)]
    utf8_checked: std::sync::atomic::AtomicUsize,
    /// Containers: list, tuple and set items in order, a dict's keys and values in turn.
    seqs: Vec<Vec<Value>>,
    /// Height of each container (1 + its tallest item's; scalars are 0).
    heights: Vec<u8>,
    /// Integers outside `i64`.
    bigs: Vec<i128>,
    root: Value,
}

impl fmt::Debug for Pickle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pickle")
            .field("bytes", &self.data.len())
            .field("containers", &self.seqs.len())
            .field("root", &self.root())
            .finish()
    }
}

/// A view of a value, borrowed from its [`Pickle`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Obj<'a> {
    /// Python's `None`.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// An integer (any of `INT`, `BININT*`, `LONG*`) that fits in `i128`.
    Int(i128),
    /// An integer outside `i128`.
    BigInt,
    /// A float (`BINFLOAT`, or protocol 0's `FLOAT`).
    Float(f64),
    /// A `str`, borrowed from the input (or from the copies the decoder had to make).
    Str(&'a str),
    /// `bytes`, `bytearray`, or a protocol 0–2 `str` of Python 2 (`STRING`, `BINSTRING`).
    Bytes(&'a [u8]),
    /// A `list`.
    List(Seq<'a>),
    /// A `tuple`.
    Tuple(Seq<'a>),
    /// A `set`.
    Set(Seq<'a>),
    /// A `frozenset`.
    FrozenSet(Seq<'a>),
    /// A `dict`.
    Dict(Dict<'a>),
    /// A global left unapplied (`builtins.set`…).
    Global(&'static str),
}

/// The items of a list, tuple or set.
#[derive(Clone, Copy)]
pub struct Seq<'a> {
    pickle: &'a Pickle,
    items: &'a [Value],
}

/// The items of a dict, in the order they were set (a key set twice is there twice; [`get`]
/// finds the last, as Python keeps).
///
/// [`get`]: Dict::get
#[derive(Clone, Copy)]
pub struct Dict<'a> {
    pickle: &'a Pickle,
    /// Keys and values in turn.
    items: &'a [Value],
}

impl PartialEq for Seq<'_> {
    /// The same container.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.items, other.items)
    }
}

impl PartialEq for Dict<'_> {
    /// The same container.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.items, other.items)
    }
}

impl fmt::Debug for Seq<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{} items]", self.items.len())
    }
}

impl fmt::Debug for Dict<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{{{} items}}", self.len())
    }
}

impl<'a> Seq<'a> {
    /// The number of items.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether there are no items.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The item at index `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<Obj<'a>> {
        self.items.get(i).map(|&v| self.pickle.obj(v))
    }

    /// The items in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Obj<'a>> + 'a {
        let pickle = self.pickle;
        self.items.iter().map(move |&v| pickle.obj(v))
    }
}

impl<'a> Dict<'a> {
    /// Items, counting a key set twice twice.
    pub fn len(&self) -> usize {
        self.items.len() / 2
    }

    /// Whether there are no items.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The value of the string key `key` (the last one set).
    pub fn get(&self, key: &str) -> Option<Obj<'a>> {
        self.items.chunks_exact(2).rev().find_map(|kv| match kv[0].0 {
            V::Str(s) if self.pickle.str_of(s) == key => Some(self.pickle.obj(kv[1])),
            _ => None,
        })
    }

    /// Keys and values in the order they were set.
    pub fn iter(&self) -> impl Iterator<Item = (Obj<'a>, Obj<'a>)> + 'a {
        let pickle = self.pickle;
        self.items.chunks_exact(2).map(move |kv| (pickle.obj(kv[0]), pickle.obj(kv[1])))
    }

    /// Bytes of the pickle it was decoded from: a reader bounds by them what it reads of
    /// objects the pickle shares.
    pub(crate) fn input_bytes(&self) -> usize {
        self.pickle.data.len()
    }
}

impl Pickle {
    /// The decoded object.
    pub fn root(&self) -> Obj<'_> {
        self.obj(self.root)
    }

    /// A view of `v` (a value of this pickle).
    fn obj(&self, v: Value) -> Obj<'_> {
        let seq = |i: u32| Seq { pickle: self, items: self.items(i) };
        match v.0 {
            V::None => Obj::None,
            V::Bool(b) => Obj::Bool(b),
            V::Int(i) => Obj::Int(i128::from(i)),
            V::Big(i) => self.bigs.get(i as usize).map_or(Obj::BigInt, |&b| Obj::Int(b)),
            V::Huge => Obj::BigInt,
            V::Float(f) => Obj::Float(f),
            V::Str(s) => Obj::Str(self.str_of(s)),
            V::Bytes(s) => Obj::Bytes(self.bytes(s)),
            V::List(i) => Obj::List(seq(i)),
            V::Tuple(i) => Obj::Tuple(seq(i)),
            V::Set(i) => Obj::Set(seq(i)),
            V::FrozenSet(i) => Obj::FrozenSet(seq(i)),
            V::Dict(i) => Obj::Dict(Dict { pickle: self, items: self.items(i) }),
            V::Global(g) => Obj::Global(g.name()),
        }
    }

    /// Containers decoded (lists, tuples, dicts, sets), for tests and measurements.
    pub fn containers(&self) -> usize {
        self.seqs.len()
    }

    fn items(&self, i: u32) -> &[Value] {
        self.seqs.get(i as usize).map_or(&[], Vec::as_slice)
    }

    /// The string of a `V::Str` span (checked when decoded, at no cost here).
    fn str_of(&self, s: Span) -> &str {
        let (at, len) = (s.at as usize, s.len as usize);
        let text = self.text.get(at..at + len).unwrap_or_default();
        // BROKEN (`strings_rechecked`): every view checked the string's UTF-8 again.
        if cfg!(tidepool_broken = "strings_rechecked") {
            return self.check_utf8(text.as_bytes()).unwrap_or_default();
        }
        text
    }

    /// `bytes` as UTF-8 (counted, in tests).
    fn check_utf8<'b>(&self, bytes: &'b [u8]) -> Result<&'b str, std::str::Utf8Error> {
        #[cfg(test)]
        self.utf8_checked.fetch_add(bytes.len(), std::sync::atomic::Ordering::Relaxed);
        std::str::from_utf8(bytes)
    }

    fn bytes(&self, s: Span) -> &[u8] {
        let (at, len) = (s.at as usize, s.len as usize);
        let (buf, at) = match at.checked_sub(self.data.len()) {
            None => (&self.data, at),
            Some(e) => (&self.extra, e),
        };
        buf.get(at..at + len).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
