//! A small pickle writer (protocol 2), for snapshots in the format of PyTorch's
//! `torch.cuda.memory._dump_snapshot()`, which PyTorch's memory viewer and `_memory_viz.py` read.
//!
//! Hand-written rather than a dependency: the core crate stays at its few dependencies, and a
//! snapshot needs only plain values — no classes, no memo, no framing:
//!
//! ```text
//!  0x80 0x02 ─ value ─ '.'          value := N | 0x88 | 0x89          None, True, False
//!                                          | K u8 | M u16 | J i32 | 0x8a n bytes   ints
//!                                          | G f64 (big endian)                    floats
//!                                          | X u32 utf-8                           str
//!                                          | ] ( values e                          list
//!                                          | } ( key value ... u                   dict
//!                                          | ( values t                            tuple
//! ```

/// A Python value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Py {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<Py>),
    Dict(Vec<(Py, Py)>),
    Tuple(Vec<Py>),
}

impl Py {
    /// A `str`.
    pub fn str(s: impl Into<String>) -> Py {
        Py::Str(s.into())
    }

    /// An `int`.
    pub fn int(v: impl Into<i128>) -> Py {
        Py::Int(v.into())
    }

    /// A dict with string keys, in this order.
    pub fn dict<'a>(entries: impl IntoIterator<Item = (&'a str, Py)>) -> Py {
        Py::Dict(entries.into_iter().map(|(k, v)| (Py::str(k), v)).collect())
    }
}

/// The pickle of `value`, protocol 2.
pub(crate) fn to_pickle(value: &Py) -> Vec<u8> {
    let mut out = vec![0x80, 2];
    write(value, &mut out);
    out.push(b'.');
    out
}

fn write(value: &Py, out: &mut Vec<u8>) {
    match value {
        Py::None => out.push(b'N'),
        Py::Bool(true) => out.push(0x88),
        Py::Bool(false) => out.push(0x89),
        Py::Int(v) => write_int(*v, out),
        Py::Float(f) => {
            out.push(b'G');
            out.extend_from_slice(&f.to_be_bytes());
        }
        Py::Str(s) => {
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Py::List(items) => {
            out.push(b']');
            if !items.is_empty() {
                out.push(b'(');
                items.iter().for_each(|v| write(v, out));
                out.push(b'e');
            }
        }
        Py::Dict(entries) => {
            out.push(b'}');
            if !entries.is_empty() {
                out.push(b'(');
                for (k, v) in entries {
                    write(k, out);
                    write(v, out);
                }
                out.push(b'u');
            }
        }
        Py::Tuple(items) => {
            out.push(b'(');
            items.iter().for_each(|v| write(v, out));
            out.push(b't');
        }
    }
}

fn write_int(v: i128, out: &mut Vec<u8>) {
    if (0..256).contains(&v) {
        out.extend_from_slice(&[b'K', v as u8]);
    } else if (0..65536).contains(&v) {
        out.push(b'M');
        out.extend_from_slice(&(v as u16).to_le_bytes());
    } else if i32::try_from(v).is_ok() {
        out.push(b'J');
        out.extend_from_slice(&(v as i32).to_le_bytes());
    } else {
        // LONG1: little-endian two's complement, as few bytes as keep the sign.
        let bytes = v.to_le_bytes();
        let mut n = bytes.len();
        while n > 1 {
            let (last, prev) = (bytes[n - 1], bytes[n - 2]);
            let redundant = (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
            if !redundant {
                break;
            }
            n -= 1;
        }
        out.extend_from_slice(&[0x8a, n as u8]);
        out.extend_from_slice(&bytes[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: &Py) -> Vec<u8> {
        let p = to_pickle(v);
        assert_eq!(&p[..2], &[0x80, 2]);
        assert_eq!(p.last(), Some(&b'.'));
        p[2..p.len() - 1].to_vec()
    }

    #[test]
    fn scalars() {
        assert_eq!(body(&Py::None), b"N");
        assert_eq!(body(&Py::Bool(true)), [0x88]);
        assert_eq!(body(&Py::Bool(false)), [0x89]);
        assert_eq!(body(&Py::int(7)), [b'K', 7]);
        assert_eq!(body(&Py::int(300)), [b'M', 0x2c, 0x01]);
        assert_eq!(body(&Py::int(-1)), [b'J', 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(body(&Py::int(1i64 << 40)), [0x8a, 6, 0, 0, 0, 0, 0, 1]);
        assert_eq!(body(&Py::int(0x8000_0000u32)), [0x8a, 5, 0, 0, 0, 0x80, 0]);
        assert_eq!(body(&Py::int(-(1i64 << 40))), [0x8a, 6, 0, 0, 0, 0, 0, 0xff]);
        assert_eq!(
            body(&Py::int(u64::MAX)),
            [0x8a, 9, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0]
        );
        assert_eq!(body(&Py::Float(1.5)), [b'G', 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
        assert_eq!(body(&Py::str("hé")), [b'X', 3, 0, 0, 0, b'h', 0xc3, 0xa9]);
    }

    #[test]
    fn containers() {
        assert_eq!(body(&Py::List(vec![])), b"]");
        assert_eq!(body(&Py::List(vec![Py::int(1), Py::None])), [b']', b'(', b'K', 1, b'N', b'e']);
        assert_eq!(body(&Py::dict([])), b"}");
        assert_eq!(
            body(&Py::dict([("a", Py::int(2))])),
            [b'}', b'(', b'X', 1, 0, 0, 0, b'a', b'K', 2, b'u']
        );
        assert_eq!(body(&Py::Tuple(vec![])), b"(t");
    }
}
