//! A tiny byte decoder for fuzz inputs, and the encoder that writes what it reads.
//!
//! The decoder takes bytes from the front of the input and never fails: once the input is used
//! up, every read yields zero. So every byte string is a valid program, a longer string is a
//! longer program, and libFuzzer's byte mutations map to small program changes (one byte: one
//! operand or one operation).
//!
//! ```text
//!   input:  [u8][u8][u16 le][u64 le] ...  (missing bytes read as 0)
//!            ▲ Input::u8 advances one byte; Input::u16 two; Input::u64 eight
//! ```
//!
//! [`Output`] writes the same shapes, so seeds can be built from readable programs and a
//! program survives a round trip (`decode(encode(p)) == p`).

/// Reads integers from the front of a byte slice; zero once it is empty.
#[derive(Clone, Debug)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// An input over `data`.
    pub fn new(data: &'a [u8]) -> Input<'a> {
        Input { data }
    }

    /// Whether every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The next byte, or 0.
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    /// The next `N` bytes as a little-endian number; missing bytes are 0.
    fn le<const N: usize>(&mut self) -> u64 {
        let mut v = 0u64;
        for i in 0..N {
            v |= u64::from(self.u8()) << (8 * i);
        }
        v
    }

    /// The next two bytes, little endian.
    pub fn u16(&mut self) -> u16 {
        self.le::<2>() as u16
    }

    /// The next four bytes, little endian.
    pub fn u32(&mut self) -> u32 {
        self.le::<4>() as u32
    }

    /// The next eight bytes, little endian.
    pub fn u64(&mut self) -> u64 {
        self.le::<8>()
    }

    /// A byte reduced modulo `n` (`n` ≥ 1): an index into a table of `n` choices.
    pub fn below(&mut self, n: usize) -> usize {
        usize::from(self.u8()) % n
    }

    /// One bit of the next byte.
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
}

/// Writes integers in the shapes [`Input`] reads.
#[derive(Clone, Debug, Default)]
pub struct Output {
    bytes: Vec<u8>,
}

impl Output {
    /// An empty output.
    pub fn new() -> Output {
        Output::default()
    }

    /// The bytes written so far.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Writes one byte.
    pub fn u8(&mut self, v: u8) {
        self.bytes.push(v);
    }

    /// Writes a number as two little-endian bytes.
    pub fn u16(&mut self, v: u16) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    /// Writes a number as four little-endian bytes.
    pub fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    /// Writes a number as eight little-endian bytes.
    pub fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    /// Writes a choice `i` of a table read with [`Input::below`] (`i` must be below its size).
    pub fn choice(&mut self, i: usize) {
        self.u8(u8::try_from(i).expect("a choice fits a byte"));
    }

    /// Writes a bit read with [`Input::bool`].
    pub fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_little_endian_and_zero_past_the_end() {
        let mut i = Input::new(&[1, 0x34, 0x12, 7]);
        assert_eq!(i.u8(), 1);
        assert_eq!(i.u16(), 0x1234);
        assert!(!i.is_empty());
        assert_eq!(i.u32(), 7, "missing bytes read as zero");
        assert!(i.is_empty());
        assert_eq!(i.u64(), 0);
        assert_eq!(i.below(5), 0);
        assert!(!i.bool());
    }

    #[test]
    fn output_writes_what_input_reads() {
        let mut o = Output::new();
        o.u8(9);
        o.u16(0xbeef);
        o.u32(0xdead_beef);
        o.u64(u64::MAX - 3);
        o.choice(4);
        o.bool(true);
        let bytes = o.into_bytes();
        let mut i = Input::new(&bytes);
        assert_eq!(i.u8(), 9);
        assert_eq!(i.u16(), 0xbeef);
        assert_eq!(i.u32(), 0xdead_beef);
        assert_eq!(i.u64(), u64::MAX - 3);
        assert_eq!(i.below(5), 4);
        assert!(i.bool());
        assert!(i.is_empty());
    }
}
