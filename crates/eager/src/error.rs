//! `EagerError`: everything an eager op can fail with — the allocator (out of memory), the
//! device (a refused launch), a shape that does not fit the op, or a back end that cannot run.

use std::fmt;
use tidepool::device::DeviceError;
use tidepool::{AllocError, HostAllocError};

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

impl fmt::Display for EagerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EagerError::Alloc(e) => write!(f, "allocation failed: {e}"),
            EagerError::Device(e) => write!(f, "device error: {e}"),
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
/// pinned memory, say) as [`EagerError::Backend`].
impl From<HostAllocError> for EagerError {
    fn from(e: HostAllocError) -> Self {
        match e {
            HostAllocError::Device(d) => EagerError::Device(d),
            other => EagerError::Backend(other.to_string()),
        }
    }
}

/// A shape error with a formatted message.
pub(crate) fn shape_err<T>(msg: impl Into<String>) -> Result<T> {
    Err(EagerError::Shape(msg.into()))
}
