//! Virtual memory on the simulated device: reserved address ranges, physical allocations and the
//! mappings between them (CUDA's `cuMemAddressReserve` / `cuMemCreate` / `cuMemMap` family).
//!
//! ```text
//!   ranges   : base → {bytes, mappings}           addresses only (finite: virtual_capacity)
//!     mappings : va → {bytes, handle}             per range; a page is usable iff a mapping
//!                                                 covers it
//!   physical : handle → {bytes, data?, at: [va]}  counts against the device's capacity
//!
//!   range  [........|== page (h1) ==|== page (h2) ==|...................]
//!                    va              va + g
//! ```
//!
//! A mapping lies inside one range (`cuMemMap` refuses one that leaves its range), so each range
//! keeps its own mappings: a lookup searches one range's table, and a range that grows at its
//! top appends to its table instead of moving the mappings of every range above it (one sorted
//! table for the whole device made each growth of a low range a `memmove` of the others).
//!
//! A physical allocation may be mapped at several addresses at once (as CUDA allows): the
//! allocator moves a page by mapping it at its new address before the old mapping is gone. Its
//! memory is freed when it has been released and its last mapping is gone. With host backing,
//! kernels read and write the physical bytes through whichever mapping they use, page by page.

use crate::device::{DeviceAddr, DeviceError, PhysHandle};
use crate::types::SortedMap;

/// `CUDA_ERROR_INVALID_VALUE`.
const INVALID_VALUE: u32 = 1;
/// `CUDA_ERROR_INVALID_HANDLE`.
const INVALID_HANDLE: u32 = 400;

/// Default granularity of physical allocations and mappings: CUDA's 2 MiB.
pub const SIM_VM_GRANULARITY: u64 = 2 << 20;

/// Counters of every virtual-memory call of a [`super::SimDevice`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmCounters {
    /// Address ranges reserved (`cuMemAddressReserve`).
    pub reserves: u64,
    /// Address reservations refused (no room left in the virtual address space).
    pub failed_reserves: u64,
    /// Address ranges freed (`cuMemAddressFree`).
    pub frees: u64,
    /// Physical allocations made (`cuMemCreate`).
    pub creates: u64,
    /// Physical allocations refused (out of memory or injected).
    pub failed_creates: u64,
    /// Physical allocations released (`cuMemRelease`).
    pub releases: u64,
    /// Mappings made (`cuMemMap` + `cuMemSetAccess`).
    pub maps: u64,
    /// Mappings refused (injected).
    pub failed_maps: u64,
    /// Mappings removed (`cuMemUnmap`).
    pub unmaps: u64,
    /// Unmaps refused (injected: `SimDevice::fail_nth_vm_unmap`).
    pub failed_unmaps: u64,
}

/// A copy to or from mapped memory.
pub(super) enum Buf<'a> {
    /// Device → host.
    Read(&'a mut [u8]),
    /// Host → device.
    Write(&'a [u8]),
}

impl Buf<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Buf::Read(b) => b.len(),
            Buf::Write(b) => b.len(),
        }
    }
}

/// One physical allocation. Kept small (its rare parts boxed): the table of them grows by one
/// per growth of an expandable range.
struct Physical {
    bytes: u64,
    /// Host backing, where the device has it.
    data: Option<Box<[u8]>>,
    /// The address it is mapped at, if any.
    at: Option<u64>,
    /// Further addresses it is mapped at (rare: a page being moved; rebuilt on each change).
    more: Option<Box<[u64]>>,
    released: bool,
}

impl Physical {
    fn addresses(&self) -> impl Iterator<Item = u64> + '_ {
        self.at.into_iter().chain(self.more.iter().flat_map(|m| m.iter().copied()))
    }

    fn unmapped(&self) -> bool {
        self.at.is_none() && self.more.as_ref().is_none_or(|m| m.is_empty())
    }

    fn forget(&mut self, va: u64) {
        let mut more = self.more.take().map(Vec::from).unwrap_or_default();
        if self.at == Some(va) {
            self.at = more.pop();
        } else {
            more.retain(|&a| a != va);
        }
        self.more = (!more.is_empty()).then(|| more.into_boxed_slice());
    }

    /// Records a further address it is mapped at.
    fn also_at(&mut self, va: u64) {
        let mut more = self.more.take().map(Vec::from).unwrap_or_default();
        more.push(va);
        self.more = Some(more.into_boxed_slice());
    }
}

/// Physical allocations by handle: a slab whose handles carry the slot's generation, so a
/// released handle never reaches the allocation that reuses its slot (the driver answers
/// `CUDA_ERROR_INVALID_HANDLE`, as before the slot was reused).
///
/// ```text
///  handle = generation << 32 | (slot + 1)      slots [Some(p) | era] [None | era] ...
/// ```
#[derive(Default)]
struct PhysTable {
    slots: Vec<(u32, Option<Physical>)>,
    /// Empty slots, reused last-freed first.
    free: Vec<u32>,
    len: usize,
}

impl PhysTable {
    #[inline]
    fn slot(h: u64) -> Option<(usize, u32)> {
        let idx = (h & u64::from(u32::MAX)).checked_sub(1)?;
        Some((idx as usize, (h >> 32) as u32))
    }

    #[inline]
    fn get(&self, h: &u64) -> Option<&Physical> {
        let (i, g) = Self::slot(*h)?;
        match self.slots.get(i) {
            Some((era, Some(p))) if *era == g => Some(p),
            _ => None,
        }
    }

    #[inline]
    fn get_mut(&mut self, h: &u64) -> Option<&mut Physical> {
        let (i, g) = Self::slot(*h)?;
        match self.slots.get_mut(i) {
            Some((era, Some(p))) if *era == g => Some(p),
            _ => None,
        }
    }

    /// Stores `p`; returns its handle.
    fn insert(&mut self, p: Physical) -> u64 {
        self.len += 1;
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize].1 = Some(p);
                i as usize
            }
            None => {
                self.slots.push((0, Some(p)));
                self.slots.len() - 1
            }
        };
        (u64::from(self.slots[i].0) << 32) | (i as u64 + 1)
    }

    fn remove(&mut self, h: &u64) -> Option<Physical> {
        let (i, g) = Self::slot(*h)?;
        let (era, slot) = self.slots.get_mut(i)?;
        if *era != g || slot.is_none() {
            return None;
        }
        let p = slot.take();
        *era = era.wrapping_add(1);
        self.free.push(i as u32);
        self.len -= 1;
        p
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl std::ops::Index<&u64> for PhysTable {
    type Output = Physical;

    fn index(&self, h: &u64) -> &Physical {
        self.get(h).expect("a live physical allocation")
    }
}

#[derive(Clone, Copy)]
struct Mapping {
    bytes: u64,
    handle: u64,
}

/// A reserved address range and the mappings inside it.
struct VRange {
    bytes: u64,
    mappings: SortedMap<u64, Mapping>,
}

impl VRange {
    /// The mapping covering `addr`, as (address, mapping).
    #[inline]
    fn mapping_at(&self, addr: u64) -> Option<(u64, Mapping)> {
        let (&va, &m) = self.mappings.floor(&addr)?;
        (addr < va + m.bytes).then_some((va, m))
    }
}

/// Injected virtual-memory faults.
#[derive(Default)]
pub(super) struct VmFaults {
    /// Fail the Nth `vm_create` from now (1 = the next one).
    pub(super) fail_nth_create: Option<u64>,
    /// Fail the Nth `vm_map` from now.
    pub(super) fail_nth_map: Option<u64>,
    /// Fail the Nth `vm_unmap` from now (the mapping stays).
    pub(super) fail_nth_unmap: Option<u64>,
}

/// Counts down an injected fault; true when this call is the one to fail.
pub(super) fn countdown(n: &mut Option<u64>) -> bool {
    match *n {
        Some(1) => {
            *n = None;
            true
        }
        Some(k) => {
            *n = Some(k - 1);
            false
        }
        None => false,
    }
}

/// The device's virtual memory; lives under the device lock.
pub(super) struct Vmm {
    pub(super) supported: bool,
    pub(super) granularity: u64,
    pub(super) virtual_capacity: u64,
    pub(super) virtual_reserved: u64,
    /// Bytes of live physical allocations (released ones still mapped included).
    pub(super) physical_bytes: u64,
    /// Reserved ranges by base, each with its mappings.
    ranges: SortedMap<u64, VRange>,
    physical: PhysTable,
    /// Mappings, over all ranges.
    mapping_count: usize,
    pub(super) counters: VmCounters,
    pub(super) faults: VmFaults,
}

fn invalid(op: &'static str) -> DeviceError {
    DeviceError::Driver { op, code: INVALID_VALUE }
}

impl Vmm {
    pub(super) fn new(capacity: u64) -> Vmm {
        Vmm {
            supported: true,
            granularity: SIM_VM_GRANULARITY,
            virtual_capacity: capacity.saturating_mul(1024).clamp(1 << 40, 1 << 60),
            virtual_reserved: 0,
            physical_bytes: 0,
            ranges: SortedMap::default(),
            physical: PhysTable::default(),
            mapping_count: 0,
            counters: VmCounters::default(),
            faults: VmFaults::default(),
        }
    }

    fn aligned(&self, v: u64) -> bool {
        v.is_multiple_of(self.granularity)
    }

    /// The reserved range holding `addr`, as (base, range).
    #[inline]
    fn range_of(&self, addr: u64) -> Option<(u64, &VRange)> {
        let (&b, r) = self.ranges.floor(&addr)?;
        (addr < b + r.bytes).then_some((b, r))
    }

    /// The reserved range holding `addr`, to change.
    #[inline]
    fn range_of_mut(&mut self, addr: u64) -> Option<(u64, &mut VRange)> {
        let (&b, r) = self.ranges.floor_mut(&addr)?;
        (addr < b + r.bytes).then_some((b, r))
    }

    /// The mapping covering `addr`, as (address, mapping).
    #[inline]
    fn mapping_at(&self, addr: u64) -> Option<(u64, Mapping)> {
        self.range_of(addr)?.1.mapping_at(addr)
    }

    /// No mapping exists.
    pub(super) fn is_empty(&self) -> bool {
        self.mapping_count == 0
    }

    /// Is `addr` inside a reserved range?
    pub(super) fn is_virtual(&self, addr: u64) -> bool {
        !self.ranges.is_empty() && self.range_of(addr).is_some()
    }

    /// Is all of `[lo, hi)` covered by mappings?
    pub(super) fn mapped(&self, lo: u64, hi: u64) -> bool {
        let mut cur = lo;
        while cur < hi {
            match self.mapping_at(cur) {
                Some((va, m)) => cur = va + m.bytes,
                None => return false,
            }
        }
        lo < hi
    }

    /// Checks a new range of `bytes` and records it at `addr` (from the device's bump pointer).
    pub(super) fn check_reserve(&self, bytes: u64) -> Result<(), DeviceError> {
        if bytes == 0 || !self.aligned(bytes) {
            return Err(invalid("cuMemAddressReserve"));
        }
        if bytes > self.virtual_capacity - self.virtual_reserved {
            return Err(DeviceError::Driver {
                op: "cuMemAddressReserve",
                code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
            });
        }
        Ok(())
    }

    pub(super) fn add_range(&mut self, addr: u64, bytes: u64) {
        self.ranges.insert(addr, VRange { bytes, mappings: SortedMap::default() });
        self.virtual_reserved += bytes;
        self.counters.reserves += 1;
    }

    pub(super) fn free_range(&mut self, base: u64, bytes: u64) -> Result<(), DeviceError> {
        match self.ranges.get(&base) {
            Some(r) if r.bytes == bytes && r.mappings.is_empty() => {}
            _ => return Err(invalid("cuMemAddressFree")),
        }
        self.ranges.remove(&base);
        self.virtual_reserved -= bytes;
        self.counters.frees += 1;
        Ok(())
    }

    /// A physical allocation of `bytes`; `room` is what the device's capacity still allows.
    pub(super) fn create(
        &mut self,
        bytes: u64,
        room: u64,
        backed: bool,
    ) -> Result<PhysHandle, DeviceError> {
        if bytes == 0 || !self.aligned(bytes) {
            return Err(invalid("cuMemCreate"));
        }
        if countdown(&mut self.faults.fail_nth_create) || bytes > room {
            self.counters.failed_creates += 1;
            return Err(DeviceError::Driver {
                op: "cuMemCreate",
                code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
            });
        }
        let data = match backed.then(|| super::memory::zeroed(bytes)) {
            Some(None) => {
                // The host cannot back it: out of memory, as CUDA's.
                self.counters.failed_creates += 1;
                return Err(DeviceError::Driver {
                    op: "cuMemCreate",
                    code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
                });
            }
            data => data.flatten().map(Vec::into_boxed_slice),
        };
        let p = Physical { bytes, data, at: None, more: None, released: false };
        let h = self.physical.insert(p);
        self.physical_bytes += bytes;
        self.counters.creates += 1;
        Ok(PhysHandle(h))
    }

    /// Frees a physical allocation that is released and mapped nowhere.
    fn reap(&mut self, h: u64) {
        if self.physical.get(&h).is_some_and(|p| p.released && p.unmapped()) {
            let p = self.physical.remove(&h).expect("checked");
            self.physical_bytes -= p.bytes;
        }
    }

    pub(super) fn release(&mut self, handle: PhysHandle) -> Result<(), DeviceError> {
        let p = self
            .physical
            .get_mut(&handle.0)
            .filter(|p| !p.released)
            .ok_or(DeviceError::Driver { op: "cuMemRelease", code: INVALID_HANDLE })?;
        p.released = true;
        self.counters.releases += 1;
        self.reap(handle.0);
        Ok(())
    }

    pub(super) fn map(
        &mut self,
        va: u64,
        bytes: u64,
        handle: PhysHandle,
    ) -> Result<(), DeviceError> {
        let p = self
            .physical
            .get(&handle.0)
            .filter(|p| !p.released)
            .ok_or(DeviceError::Driver { op: "cuMemMap", code: INVALID_HANDLE })?;
        if p.bytes != bytes || !self.aligned(va) {
            return Err(invalid("cuMemMap"));
        }
        // An address whose end is past the address space lies in no range (an error, not an
        // overflow). BROKEN (`vm_map_overflows`): the end computed unchecked.
        let end = match cfg!(tidepool_broken = "vm_map_overflows") {
            true => Some(va + bytes),
            false => va.checked_add(bytes),
        };
        let end = end.ok_or(invalid("cuMemMap"))?;
        // Mappings lie inside their ranges: only this range's can overlap the new one.
        let range = match self.ranges.floor_mut(&va) {
            Some((&b, r)) if end <= b + r.bytes => r,
            _ => return Err(invalid("cuMemMap")),
        };
        let below = range.mappings.floor(&(end - 1));
        if below.is_some_and(|(&a, m)| a + m.bytes > va) {
            return Err(invalid("cuMemMap"));
        }
        if countdown(&mut self.faults.fail_nth_map) {
            self.counters.failed_maps += 1;
            return Err(DeviceError::Driver {
                op: "cuMemMap",
                code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
            });
        }
        range.mappings.insert(va, Mapping { bytes, handle: handle.0 });
        let p = self.physical.get_mut(&handle.0).expect("checked");
        match p.at {
            None => p.at = Some(va),
            Some(_) => p.also_at(va),
        }
        self.mapping_count += 1;
        self.counters.maps += 1;
        Ok(())
    }

    pub(super) fn unmap(&mut self, va: u64, bytes: u64) -> Result<(), DeviceError> {
        let Some((_, range)) = self.range_of_mut(va) else {
            return Err(invalid("cuMemUnmap"));
        };
        match range.mappings.get(&va) {
            Some(m) if m.bytes == bytes => {}
            _ => return Err(invalid("cuMemUnmap")),
        }
        if countdown(&mut self.faults.fail_nth_unmap) {
            self.counters.failed_unmaps += 1;
            let code = DeviceError::CUDA_ERROR_UNKNOWN;
            return Err(DeviceError::Driver { op: "cuMemUnmap", code });
        }
        let range = self.range_of_mut(va).expect("checked").1;
        let m = range.mappings.remove(&va).expect("checked");
        self.mapping_count -= 1;
        let p = self.physical.get_mut(&m.handle).expect("a mapping's allocation is live");
        p.forget(va);
        self.counters.unmaps += 1;
        self.reap(m.handle);
        Ok(())
    }

    /// The other addresses the physical memory under `[lo, hi)` is mapped at, as ranges.
    pub(super) fn aliases(&self, lo: u64, hi: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        if self.mapping_count == 0 || hi <= lo {
            return out;
        }
        // The ranges meeting [lo, hi): the one holding `lo` (if any), then those starting below `hi`.
        let first = self.ranges.floor(&lo).map_or(lo, |(&b, _)| b);
        let mappings = self.ranges.range(first..hi).flat_map(|(_, r)| {
            let first = r.mappings.floor(&lo).map_or(lo, |(&a, _)| a);
            r.mappings.range(first..hi)
        });
        for (&va, m) in mappings {
            let (a, b) = (va.max(lo), (va + m.bytes).min(hi));
            if a >= b {
                continue;
            }
            for other in self.physical[&m.handle].addresses() {
                if other != va {
                    out.push((other + (a - va), other + (b - va)));
                }
            }
        }
        out
    }

    /// Copies through the mappings of `[ptr, ptr + len)`, page by page.
    pub(super) fn copy(&mut self, ptr: DeviceAddr, mut buf: Buf<'_>) -> Result<(), DeviceError> {
        let len = buf.len() as u64;
        let bad = DeviceError::BadAccess { ptr, bytes: len };
        let mut done = 0u64;
        while done < len {
            let at = ptr.0 + done;
            let (va, m) = self.mapping_at(at).ok_or(bad.clone())?;
            let off = (at - va) as usize;
            let n = ((va + m.bytes - at).min(len - done)) as usize;
            let data = self.physical.get_mut(&m.handle).expect("live").data.as_mut();
            let data = data.ok_or(DeviceError::Unsupported(super::UNBACKED_KERNEL))?;
            let d = done as usize;
            match &mut buf {
                Buf::Read(out) => out[d..d + n].copy_from_slice(&data[off..off + n]),
                Buf::Write(src) => data[off..off + n].copy_from_slice(&src[d..d + n]),
            }
            done += n as u64;
        }
        Ok(())
    }

    /// Live mappings as (address, bytes), in address order.
    pub(super) fn mappings(&self) -> Vec<(DeviceAddr, u64)> {
        let all = self.ranges.values().flat_map(|r| r.mappings.iter());
        all.map(|(&a, m)| (DeviceAddr(a), m.bytes)).collect()
    }

    /// Live mappings as (address, bytes, physical allocation), in address order.
    pub(super) fn mappings_with_handles(&self) -> Vec<(DeviceAddr, u64, u64)> {
        let all = self.ranges.values().flat_map(|r| r.mappings.iter());
        all.map(|(&a, m)| (DeviceAddr(a), m.bytes, m.handle)).collect()
    }

    /// Reserved ranges as (base, bytes), in address order.
    pub(super) fn ranges(&self) -> Vec<(DeviceAddr, u64)> {
        self.ranges.iter().map(|(&a, r)| (DeviceAddr(a), r.bytes)).collect()
    }

    /// Physical allocations not yet freed.
    pub(super) fn physical_count(&self) -> usize {
        self.physical.len()
    }
}
