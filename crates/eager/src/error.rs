//! `EagerError`: everything an eager op can fail with — the allocator (out of memory), the
//! device (a refused launch), a shape that does not fit the op, or a back end that cannot run.

use std::fmt;
use tidepool::device::DeviceError;
use tidepool::{AllocError, ErrorChain, HostAllocError};

/// Why an eager operation failed.
#[derive(Debug)]
pub enum EagerError {
    /// The allocator could not serve the output (out of memory, bad size).
    Alloc(AllocError),
    /// The device refused the work (unknown stream, unsupported launch).
    Device(DeviceError),
    /// The operands' shapes do not fit the op; the text says how.
    Shape(String),
    /// The back end failed (a kernel that did not run, a library that is missing).
    Backend(String),
}

/// Result of an eager operation.
pub type Result<T> = std::result::Result<T, EagerError>;

/// `Alloc` and `Device` say their own layer only: the allocator's or the device's error is
/// their [`source`](std::error::Error::source), so whatever prints the chain (each `source()`
/// in turn, as anyhow's `{:#}` does) prints it once. `to_string()` alone leaves it out.
impl fmt::Display for EagerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // BROKEN (`error_text_doubled`): the inner error's message again.
        let doubled = cfg!(tidepool_broken = "error_text_doubled");
        match self {
            EagerError::Alloc(e) if doubled => write!(f, "the allocator failed: {e}"),
            EagerError::Alloc(_) => write!(f, "the allocator failed"),
            EagerError::Device(e) if doubled => write!(f, "the device refused the work: {e}"),
            EagerError::Device(_) => write!(f, "the device refused the work"),
            EagerError::Shape(msg) => write!(f, "shape error: {msg}"),
            EagerError::Backend(msg) => write!(f, "back end error: {msg}"),
        }
    }
}

impl std::error::Error for EagerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            EagerError::Alloc(e) => Some(e),
            EagerError::Device(e) => Some(e),
            _ => None,
        }
    }
}

impl From<AllocError> for EagerError {
    fn from(e: AllocError) -> Self {
        EagerError::Alloc(e)
    }
}

impl From<DeviceError> for EagerError {
    fn from(e: DeviceError) -> Self {
        EagerError::Device(e)
    }
}

/// A pinned host memory failure: the device's error as [`EagerError::Device`], the rest (out of
/// pinned memory, say) as [`EagerError::Backend`], whose text is the whole chain (out of pinned
/// memory, then the device's answer).
impl From<HostAllocError> for EagerError {
    fn from(e: HostAllocError) -> Self {
        match e {
            HostAllocError::Device(d) => EagerError::Device(d),
            other => EagerError::Backend(ErrorChain(&other).to_string()),
        }
    }
}

/// A shape error with a formatted message.
pub(crate) fn shape_err<T>(msg: impl Into<String>) -> Result<T> {
    Err(EagerError::Shape(msg.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;
    use tidepool::StreamId;

    /// `outer` says `own` and nothing of `inner`, which its `source()` is; the chain holds each
    /// once.
    fn says_its_layer_only<I: Error + PartialEq + 'static>(
        outer: &EagerError,
        inner: &I,
        own: &str,
    ) {
        let (text, inner_text) = (outer.to_string(), inner.to_string());
        assert_eq!(text, own);
        assert!(!text.contains(&inner_text), "the wrapper repeats its source: {text}");
        let source = outer.source().expect("the inner error is the source");
        assert_eq!(source.downcast_ref::<I>(), Some(inner));
        let whole = ErrorChain(outer).to_string();
        assert_eq!(whole, format!("{own}: {}", ErrorChain(inner)));
        assert_eq!(whole.matches(&inner_text).count(), 1, "{whole}");
    }

    /// Each wrapper variant says its own layer only (the error-handling working group's rule:
    /// the inner error is the source, or in the message, never both): whatever prints the chain
    /// printed the inner message twice (found in review). Broken build `error_text_doubled`.
    #[test]
    fn wrappers_leave_the_inner_message_to_their_source() {
        let device = DeviceError::UnknownStream(StreamId(7));
        says_its_layer_only(
            &EagerError::Device(device.clone()),
            &device,
            "the device refused the work",
        );
        let alloc = AllocError::UnknownStream(StreamId(7));
        says_its_layer_only(&EagerError::Alloc(alloc.clone()), &alloc, "the allocator failed");
        // Three layers: the device's error inside the allocator's.
        let alloc = AllocError::Device(device.clone());
        let e = EagerError::from(alloc.clone());
        says_its_layer_only(&e, &alloc, "the allocator failed");
        assert_eq!(
            ErrorChain(&e).to_string(),
            format!("the allocator failed: a device call of the allocator failed: {device}")
        );
        for e in [EagerError::Shape("x".into()), EagerError::Backend("y".into())] {
            assert!(e.source().is_none());
            assert_eq!(ErrorChain(&e).to_string(), e.to_string());
        }
    }

    /// A pinned allocation's out-of-memory becomes a back-end error whose text is the whole
    /// chain: the pinned allocator's layer, then the device's answer, each once.
    #[test]
    fn a_pinned_out_of_memory_keeps_the_devices_answer_once() {
        let device = DeviceError::OutOfMemory { requested: 1 << 20 };
        let host = HostAllocError::OutOfMemory {
            requested: 1000,
            class: 1024,
            reserved: 0,
            error: device.clone(),
        };
        let EagerError::Backend(text) = EagerError::from(host.clone()) else {
            panic!("expected a back end error")
        };
        assert_eq!(text, format!("{host}: {device}"));
        assert_eq!(text.matches(&device.to_string()).count(), 1, "{text}");
    }
}
