//! What `CudaBuffer::from_buffer` (feature `cuda`) checks before it types a
//! buffer, over any device, so that the SimDevice tests it where there is no GPU: the element
//! count, and the refusal with the buffer given back whole.

use crate::allocator::{AllocError, Buffer};
use crate::device::{Device, DeviceError};

/// An accepted buffer, its element count and what was found for its stream.
pub(crate) type Viewed<D, S> = (Buffer<D>, usize, S);

/// A refusal: why, and the buffer given back (boxed: the refusal is the cold path, and keeps
/// the `Result` small).
pub(crate) type Refusal<D> = Box<(DeviceError, Buffer<D>)>;

/// `buffer` as elements of `elem` bytes: the buffer, their count and what `stream` found for
/// the buffer's stream (the cudarc stream of a `CudaBuffer`). Refused with
/// [`DeviceError::Unsupported`] for a zero-sized element or a length that is not a whole number
/// of elements, or with `stream`'s error (a stream the device no longer knows), and then the
/// buffer comes back as it was given, as `String::from_utf8` gives its bytes back: it used to
/// be dropped with the error, so a caller who got the element type wrong lost the allocation.
pub(crate) fn elements<D: Device, S>(
    buffer: Buffer<D>,
    elem: usize,
    stream: impl FnOnce(&Buffer<D>) -> Result<S, DeviceError>,
) -> Result<Viewed<D, S>, Refusal<D>> {
    let len = match count(buffer.len(), elem) {
        Ok(len) => len,
        Err(e) => return Err(refused(e, buffer)),
    };
    match stream(&buffer) {
        Ok(s) => Ok((buffer, len, s)),
        Err(e) => Err(refused(e, buffer)),
    }
}

/// The bytes of `len` elements of `elem` bytes, for a new `CudaBuffer` (`CudaBuffer::alloc`):
/// a zero-sized element is refused with `from_buffer`'s reason, as cudarc's own `alloc`
/// refuses it (`cuMemAllocAsync` of 0 bytes: `CUDA_ERROR_INVALID_VALUE`). It used to be
/// accepted as a slice of `len` elements with no memory behind it, at address 0, which
/// `from_buffer` refuses to view and whose `is_empty` said no. A product past `u64` is
/// [`AllocError::InvalidSize`]. (BROKEN, `cuda_buffer_zst_accepted`: 0 bytes.)
pub(crate) fn alloc_bytes(len: usize, elem: usize) -> Result<u64, AllocError> {
    if elem == 0 && !cfg!(tidepool_broken = "cuda_buffer_zst_accepted") {
        return Err(AllocError::Device(DeviceError::Unsupported(ZERO_SIZED)));
    }
    (len as u64).checked_mul(elem as u64).ok_or(AllocError::InvalidSize { requested: u64::MAX })
}

/// Why a zero-sized element type is refused.
const ZERO_SIZED: &str = "a buffer of zero-sized elements";

/// `bytes` as elements of `elem` bytes: how many.
fn count(bytes: u64, elem: usize) -> Result<usize, DeviceError> {
    if elem == 0 {
        return Err(DeviceError::Unsupported(ZERO_SIZED));
    }
    let elem = elem as u64;
    if !bytes.is_multiple_of(elem) {
        return Err(DeviceError::Unsupported(
            "a buffer whose length is not a whole number of elements",
        ));
    }
    usize::try_from(bytes / elem)
        .map_err(|_| DeviceError::Unsupported("a buffer longer than usize::MAX elements"))
}

/// The refusal: `error`, with `buffer` given back.
fn refused<D: Device>(error: DeviceError, buffer: Buffer<D>) -> Refusal<D> {
    // BROKEN (`from_buffer_drops`): the buffer dropped (its memory freed), an empty buffer of
    // its allocator given back in its place: the caller's allocation is lost, as before.
    #[cfg(tidepool_broken = "from_buffer_drops")]
    let buffer = buffer.dropped();
    Box::new((error, buffer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceAddr;
    use crate::sync::Arc;
    use crate::{Allocator, Config, MIB, SimDevice};

    /// A refusal gives the buffer back whole: its address, length and stream, still a live
    /// allocation of its allocator, which its drop frees. Broken build `from_buffer_drops`.
    #[test]
    fn a_refused_buffer_comes_back_whole() {
        let dev = Arc::new(SimDevice::backed(64 * MIB));
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let s = dev.create_stream().unwrap();
        let live = |alloc: &Allocator<SimDevice>| alloc.stats().blocks.allocated_bytes.all.current;
        let buf = alloc.alloc(10, s).unwrap();
        let (ptr, len, held) = (buf.ptr(), buf.len(), live(&alloc));
        assert!(ptr != DeviceAddr::NULL && held > 0);
        let no_stream =
            |b: &Buffer<SimDevice>| Err::<(), _>(DeviceError::UnknownStream(b.stream()));
        let cases: [(usize, bool, DeviceError); 4] = [
            (
                4,
                true,
                DeviceError::Unsupported("a buffer whose length is not a whole number of elements"),
            ),
            (
                3,
                true,
                DeviceError::Unsupported("a buffer whose length is not a whole number of elements"),
            ),
            (0, true, DeviceError::Unsupported("a buffer of zero-sized elements")),
            (2, false, DeviceError::UnknownStream(s)),
        ];
        let mut buf = buf;
        for (elem, stream_known, want) in cases {
            let r = match stream_known {
                true => elements(buf, elem, |_| Ok(())),
                false => elements(buf, elem, no_stream),
            };
            let Err(refusal) = r else { panic!("{elem}-byte elements: accepted") };
            let (error, back) = *refusal;
            assert_eq!(error, want, "{elem}-byte elements");
            assert_eq!((back.ptr(), back.len(), back.stream()), (ptr, len, s), "given back whole");
            assert_eq!(live(&alloc), held, "still live");
            buf = back;
        }
        // Accepted: the same buffer, as 5 two-byte or 10 one-byte elements.
        let Ok((buf, 5, ())) = elements(buf, 2, |_| Ok(())) else { panic!("refused") };
        let Ok((buf, 10, ())) = elements(buf, 1, |_| Ok(())) else { panic!("refused") };
        assert_eq!((buf.ptr(), buf.len()), (ptr, len));
        drop(buf);
        assert_eq!(live(&alloc), 0, "freed by its drop");
        alloc.check_invariants().unwrap();
    }

    /// `CudaBuffer::alloc`'s size: a zero-sized element type is refused (any length, 0 too),
    /// as `from_buffer` refuses to view a buffer as one; an overflow is an invalid size.
    /// Broken build `cuda_buffer_zst_accepted` (0 bytes, accepted).
    #[test]
    fn alloc_bytes_refuse_zero_sized_elements() {
        let zst = AllocError::Device(DeviceError::Unsupported("a buffer of zero-sized elements"));
        assert_eq!(alloc_bytes(1000, 0), Err(zst.clone()));
        assert_eq!(alloc_bytes(0, 0), Err(zst));
        assert_eq!(alloc_bytes(0, 4), Ok(0));
        assert_eq!(alloc_bytes(1024, 4), Ok(4096));
        assert_eq!(alloc_bytes(usize::MAX, 1), Ok(usize::MAX as u64));
        let over = AllocError::InvalidSize { requested: u64::MAX };
        assert_eq!(alloc_bytes(usize::MAX, 2), Err(over));
    }

    #[test]
    fn element_counts() {
        assert_eq!(count(0, 4), Ok(0));
        assert_eq!(count(4096, 4), Ok(1024));
        assert_eq!(count(12, 12), Ok(1));
        assert!(count(10, 4).is_err() && count(4, 0).is_err() && count(0, 0).is_err());
    }
}
