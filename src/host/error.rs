//! [`HostAllocError`]: why a pinned host allocation or copy failed.

use crate::device::DeviceError;
use crate::types::{Bytes, MAX_REQUEST};
use std::fmt;

/// Why a pinned host allocation or copy failed. The allocator stays usable after any of them.
///
/// [`std::error::Error::source`] gives the device's error where there is one
/// ([`HostAllocError::OutOfMemory`], [`HostAllocError::Device`]); their `Display` does not
/// repeat it, so print the whole chain for a user.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostAllocError {
    /// A request of zero bytes.
    ZeroSize,
    /// A request above [`crate::MAX_REQUEST`]: an error, not an out-of-memory.
    TooLarge {
        /// Bytes asked for.
        requested: u64,
    },
    /// The device refused the pinned allocation, even after the cache was freed.
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// The size class that was to be allocated.
        class: u64,
        /// Pinned bytes this allocator held when it gave up.
        reserved: u64,
        /// The device's answer.
        error: DeviceError,
    },
    /// A device call failed (event, copy, synchronisation).
    Device(DeviceError),
    /// A copy outside the buffer: `offset + bytes` exceeds `len` (or the other buffer is too
    /// small).
    OutOfRange {
        /// First byte of the copy in the pinned buffer.
        offset: u64,
        /// Length of the copy.
        bytes: u64,
        /// Length of the buffer.
        len: u64,
    },
    /// The device buffer belongs to another device than the pinned allocator's.
    WrongDevice,
    /// The buffer and a CUDA-graph capture: work captured into a graph copies to or from the
    /// buffer (its replays do, whenever they run), so it gives no slice and takes no copy
    /// outside the capture; or a copy on a capturing stream was asked of a buffer with copies
    /// not known complete (the capture cannot be ordered after them).
    Captured {
        /// Which of the two.
        reason: &'static str,
    },
}

impl fmt::Display for HostAllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostAllocError::ZeroSize => write!(f, "pinned host allocation of 0 bytes"),
            HostAllocError::TooLarge { requested } => write!(
                f,
                "pinned host allocation of {requested} bytes exceeds the limit of {MAX_REQUEST}"
            ),
            // The device's answer is `source()`'s to say, once down the chain.
            // BROKEN (`error_text_doubled`): said here too.
            HostAllocError::OutOfMemory { requested, class, reserved, error } => {
                write!(
                    f,
                    "out of pinned host memory allocating {} (class {}; {} held)",
                    Bytes(*requested),
                    Bytes(*class),
                    Bytes(*reserved)
                )?;
                match cfg!(tidepool_broken = "error_text_doubled") {
                    true => write!(f, ": {error}"),
                    false => Ok(()),
                }
            }
            HostAllocError::Device(e) if cfg!(tidepool_broken = "error_text_doubled") => {
                write!(f, "a device call on pinned host memory failed: {e}")
            }
            HostAllocError::Device(_) => write!(f, "a device call on pinned host memory failed"),
            HostAllocError::OutOfRange { offset, bytes, len } => write!(
                f,
                "copy of {bytes} bytes at offset {offset} is outside a buffer of {len} bytes"
            ),
            HostAllocError::WrongDevice => {
                write!(f, "the device buffer is on another device than the pinned allocator")
            }
            HostAllocError::Captured { reason } => {
                write!(f, "pinned buffer and CUDA-graph capture: {reason}")
            }
        }
    }
}

impl std::error::Error for HostAllocError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HostAllocError::OutOfMemory { error, .. } | HostAllocError::Device(error) => {
                Some(error)
            }
            _ => None,
        }
    }
}

impl From<DeviceError> for HostAllocError {
    fn from(e: DeviceError) -> Self {
        HostAllocError::Device(e)
    }
}
