//! The simulated address space and the kernels' view of it.
//!
//! Segments live in a fake address space starting at [`SIM_BASE`]; addresses are handed out by a
//! bump pointer and never reused, so a stale pointer can never alias a newer segment. Each segment
//! is optionally backed by zeroed host memory; unbacked segments cost nothing, which lets
//! multi-GiB traces replay on a laptop.
//!
//! ```text
//!   SIM_BASE                                                   next_addr
//!   |-- seg A (live) --|-- gap (released) --|-- seg C (live) --|------->
//!   segments: BTreeMap<base, Segment{bytes, data: Option<Vec<u8>>}>
//! ```

use super::Shared;
use crate::device::{Access, AccessKind, DeviceAddr, DeviceError, KernelMemory};
use crate::sync::lock;
use std::collections::BTreeMap;

/// First address of the simulated address space.
pub const SIM_BASE: u64 = 0x7f00_0000_0000;

/// Alignment of every segment, as `cuMemAlloc` guarantees (at least) 512 bytes.
pub const SIM_ALIGN: u64 = 512;

/// One reserved segment.
pub(super) struct Segment {
    pub(super) bytes: u64,
    data: Option<Vec<u8>>,
}

/// Live segments and the bump pointer.
pub(super) struct Memory {
    next_addr: u64,
    pub(super) reserved: u64,
    pub(super) segments: BTreeMap<u64, Segment>,
}

impl Memory {
    pub(super) fn new() -> Memory {
        Memory { next_addr: SIM_BASE, reserved: 0, segments: BTreeMap::new() }
    }

    /// Places a segment of `bytes` (the caller checked capacity) and returns its address;
    /// `None` (nothing placed) when the host cannot back it.
    pub(super) fn reserve(&mut self, bytes: u64, backed: bool) -> Option<u64> {
        let data = match backed {
            true => Some(zeroed(bytes)?),
            false => None,
        };
        let addr = self.next_addr;
        self.next_addr += bytes.div_ceil(SIM_ALIGN) * SIM_ALIGN;
        self.reserved += bytes;
        self.segments.insert(addr, Segment { bytes, data });
        Some(addr)
    }

    /// Takes `bytes` of fresh addresses aligned to `align` (a power of two) for a virtual range:
    /// the same bump pointer as segments, so ranges and segments never overlap.
    pub(super) fn take_addresses(&mut self, bytes: u64, align: u64) -> Option<u64> {
        let addr = self.next_addr.checked_add(align - 1)? & !(align - 1);
        self.next_addr = addr.checked_add(bytes)?;
        Some(addr)
    }

    /// Removes the segment starting at `addr`, returning its size.
    pub(super) fn release(&mut self, addr: u64) -> Option<u64> {
        let seg = self.segments.remove(&addr)?;
        self.reserved -= seg.bytes;
        Some(seg.bytes)
    }

    /// Does `[lo, hi)` lie inside one live segment?
    pub(super) fn contains(&self, lo: u64, hi: u64) -> bool {
        self.segments
            .range(..=lo)
            .next_back()
            .is_some_and(|(&base, s)| hi <= base.saturating_add(s.bytes))
    }

    /// The host bytes of `[ptr, ptr + bytes)`, which must lie inside one live, backed segment.
    fn bytes_mut(&mut self, ptr: DeviceAddr, bytes: u64) -> Result<&mut [u8], DeviceError> {
        let bad = DeviceError::BadAccess { ptr, bytes };
        let (&base, seg) = self.segments.range_mut(..=ptr.0).next_back().ok_or(bad.clone())?;
        let off = ptr.0 - base;
        if off.saturating_add(bytes) > seg.bytes {
            return Err(bad);
        }
        let data = seg.data.as_mut().ok_or(DeviceError::Unsupported(super::UNBACKED_KERNEL))?;
        Ok(&mut data[off as usize..(off + bytes) as usize])
    }
}

/// Kernel view of a [`super::SimDevice`]'s memory, limited to the kernel's declared accesses.
pub(super) struct SimMemory<'a> {
    pub(super) shared: &'a Shared,
    pub(super) accesses: &'a [Access],
}

impl SimMemory<'_> {
    fn declared(&self, ptr: DeviceAddr, bytes: u64, write: bool) -> bool {
        self.accesses.iter().any(|a| {
            a.ptr.0 <= ptr.0
                && ptr.0.saturating_add(bytes) <= a.ptr.0.saturating_add(a.bytes)
                && (!write || a.kind == AccessKind::Write)
        })
    }

    fn with_range<R>(
        &self,
        ptr: DeviceAddr,
        bytes: u64,
        write: bool,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, DeviceError> {
        if !self.declared(ptr, bytes, write) {
            return Err(DeviceError::BadAccess { ptr, bytes });
        }
        let mut st = lock(&self.shared.state);
        Ok(f(st.mem.bytes_mut(ptr, bytes)?))
    }

    /// Copies between `buf` and mapped virtual memory at `ptr` (page by page: each page may be
    /// backed by another physical allocation). `None` when `ptr` is not in a virtual range.
    fn virtual_copy(
        &self,
        ptr: DeviceAddr,
        buf: super::vmm::Buf<'_>,
    ) -> Option<Result<(), DeviceError>> {
        let bytes = buf.len() as u64;
        let mut st = lock(&self.shared.state);
        if !st.vm.is_virtual(ptr.0) {
            return None;
        }
        let write = matches!(buf, super::vmm::Buf::Write(_));
        if !self.declared(ptr, bytes, write) {
            return Some(Err(DeviceError::BadAccess { ptr, bytes }));
        }
        Some(st.vm.copy(ptr, buf))
    }
}

impl KernelMemory for SimMemory<'_> {
    fn read(&self, ptr: DeviceAddr, out: &mut [u8]) -> Result<(), DeviceError> {
        if let Some(r) = self.virtual_copy(ptr, super::vmm::Buf::Read(&mut *out)) {
            return r;
        }
        self.with_range(ptr, out.len() as u64, false, |src| out.copy_from_slice(src))
    }

    fn write(&self, ptr: DeviceAddr, data: &[u8]) -> Result<(), DeviceError> {
        if let Some(r) = self.virtual_copy(ptr, super::vmm::Buf::Write(data)) {
            return r;
        }
        self.with_range(ptr, data.len() as u64, true, |dst| dst.copy_from_slice(data))
    }
}

/// `bytes` zeroed host bytes backing device memory, or `None` where the host cannot hold them
/// (a backed device larger than the host's memory): the device call fails as out of memory
/// rather than aborting the process, as `vec![0; n]` does. Hand-written because stable Rust has
/// no fallible zeroed allocation, and `try_reserve_exact` + `resize` would write (and so touch)
/// every page where `alloc_zeroed` leaves the host's zero pages untouched until used.
pub(super) fn zeroed(bytes: u64) -> Option<Vec<u8>> {
    let n = usize::try_from(bytes).ok()?;
    // BROKEN (`backing_aborts`): the infallible allocation (the process aborts).
    if n == 0 || cfg!(tidepool_broken = "backing_aborts") {
        return Some(vec![0u8; n]);
    }
    let layout = std::alloc::Layout::array::<u8>(n).ok()?;
    // SAFETY: `layout` has a non-zero size (n > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `[u8; n]` (the
    // layout a `Vec<u8>` of capacity `n` frees with), and its `n` bytes are initialised (zero).
    Some(unsafe { Vec::from_raw_parts(ptr, n, n) })
}
