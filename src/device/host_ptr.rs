//! [`HostPtr`]: the address of page-locked ("pinned") host memory a device allocated
//! ([`super::Device::host_alloc`]), which its asynchronous copies read and write without staging.
//!
//! | trait operation                         | CUDA driver           | [`super::SimDevice`]                    |
//! |-----------------------------------------|-----------------------|-----------------------------------------|
//! | [`super::Device::host_alloc`]           | `cuMemHostAlloc`      | zeroed heap memory, capacity-limited     |
//! | [`super::Device::host_free`]            | `cuMemFreeHost`       | free (waits for copies still using it)   |
//! | [`super::Device::memcpy_htod_async`]    | `cuMemcpyHtoDAsync`   | a copy kernel in stream order            |
//! | [`super::Device::memcpy_dtoh_async`]    | `cuMemcpyDtoHAsync`   | a copy kernel in stream order            |
//! | [`super::Device::note_host_access`]     | —                     | the sanitizer checks unfinished copies   |
//!
//! The safe face of this memory is [`crate::HostAllocator`] and its [`crate::PinnedBuffer`].

use std::fmt;
use std::ptr::NonNull;

/// The address of pinned host memory: a plain address, `Copy`, `Send` and `Sync`. Reading or
/// writing through it is `unsafe` (see [`HostPtr::as_ptr`]); [`crate::PinnedBuffer`] is the safe
/// way to touch it.
///
/// ```
/// use tidepool::device::HostPtr;
///
/// let mut byte = 7u8;
/// let p = HostPtr::new(&mut byte as *mut u8).unwrap();
/// assert_eq!(p.addr(), &byte as *const u8 as usize);
/// assert!(HostPtr::new(std::ptr::null_mut()).is_none());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostPtr(NonNull<u8>);

// SAFETY: a HostPtr is an address; it grants no access by itself (every dereference is `unsafe`
// and its caller answers for the memory), so moving or sharing it between threads is harmless.
unsafe impl Send for HostPtr {}
// SAFETY: as above: `&HostPtr` only gives the address.
unsafe impl Sync for HostPtr {}

impl HostPtr {
    /// Wraps a non-null pointer.
    pub fn new(ptr: *mut u8) -> Option<HostPtr> {
        NonNull::new(ptr).map(HostPtr)
    }

    /// The raw pointer, for FFI (cudarc, say). Dereferencing it is `unsafe`: the memory must be
    /// live and no unfinished copy may write it (or read it, for a write).
    pub fn as_ptr(self) -> *mut u8 {
        self.0.as_ptr()
    }

    /// The address as an integer (for maps and messages).
    pub fn addr(self) -> usize {
        self.0.as_ptr() as usize
    }

    /// The address `bytes` further on, keeping the pointer's provenance. `None` if it would wrap
    /// to null.
    pub fn offset(self, bytes: usize) -> Option<HostPtr> {
        HostPtr::new(self.0.as_ptr().wrapping_add(bytes))
    }
}

impl fmt::Debug for HostPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostPtr({:#x})", self.addr())
    }
}

impl fmt::Display for HostPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host {:#x}", self.addr())
    }
}
