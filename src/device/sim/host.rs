//! SimDevice's pinned host memory: ordinary heap memory (zeroed, page aligned) with capacity
//! accounting, copies between it and device memory run as kernels in stream order, and the
//! sanitizer's view of copies that have not finished.
//!
//! ```text
//!   host_alloc(n) ─▶ allocations: addr → (HostPtr, Layout)       capacity − reserved, faults
//!   memcpy_htod_async(dst, src, n, s) ─▶ Kernel "copy_htod" at position p of s (device access
//!                                        declared, checked by the sanitizer) + copies: (src range, s, p)
//!   note_host_access / host_free ─▶ a copy in `copies` overlapping the range that s has not
//!                                   passed yet is a violation ("host write", "host free"),
//!                                   and so is a range a graph's captured copy uses
//! ```
//!
//! The event rules are the device's: a copy is one operation of its stream, so an event recorded
//! after it completes once the copy has run. `host_free` of memory a copy still uses reports a
//! violation and then waits for the copy (a host sync), so even a broken caller cannot make a
//! worker touch freed memory.

use super::stream::Op;
use super::{SimDevice, State};
use crate::device::{
    Access, AccessKind, DeviceAddr, DeviceError, HostPtr, Kernel, KernelMemory, StreamId,
};
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::BTreeMap;

/// Alignment of SimDevice's pinned host allocations (a page, as `cuMemHostAlloc` gives).
const HOST_ALIGN: usize = 4096;

/// What a copy between pinned host memory and an unbacked device answers: the device has no
/// bytes to copy (`SimDevice::new` makes one, for replays that touch no memory), and a user
/// following the README's first example has one, so the error says how to get a backed one.
const UNBACKED_COPY: &str = "copies to or from unbacked device memory: this SimDevice has no \
    bytes behind its memory; make it with SimDevice::backed(capacity) (or SimConfig { backed: \
    true, .. }) to copy and run kernels";

/// Counters of SimDevice's pinned host memory calls, for tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimHostCounters {
    /// Successful pinned allocations (`cuMemHostAlloc`).
    pub allocs: u64,
    /// Refused pinned allocations (out of host capacity, zero bytes, or injected).
    pub failed_allocs: u64,
    /// Pinned frees (`cuMemFreeHost`).
    pub frees: u64,
    /// Host-to-device copies enqueued.
    pub copies_to_device: u64,
    /// Device-to-host copies enqueued.
    pub copies_to_host: u64,
}

/// One live pinned allocation.
struct Allocation {
    ptr: HostPtr,
    layout: Layout,
}

/// A copy enqueued on a stream that touches `[lo, hi)` of host memory.
struct HostCopy {
    lo: usize,
    hi: usize,
    stream: u32,
    pos: u64,
    /// The copy writes the host memory (device to host).
    writes_host: bool,
}

/// The host back end's state; lives under the device lock.
pub(super) struct HostMem {
    capacity: u64,
    reserved: u64,
    allocations: BTreeMap<usize, Allocation>,
    /// Allocations freed while a graph's captured copies still use them (a violation): kept
    /// until the device goes, so a replay never touches freed memory.
    kept: Vec<Allocation>,
    /// Copies enqueued, dropped once their stream passed them.
    copies: Vec<HostCopy>,
    counters: SimHostCounters,
    /// Fail the Nth pinned allocation from now (1 = the next one).
    fail_nth_alloc: Option<u64>,
}

impl HostMem {
    pub(super) fn new(capacity: u64) -> HostMem {
        HostMem {
            capacity,
            reserved: 0,
            allocations: BTreeMap::new(),
            kept: Vec::new(),
            copies: Vec::new(),
            counters: SimHostCounters::default(),
            fail_nth_alloc: None,
        }
    }

    /// Counts a copy enqueued or captured.
    fn count_copy(&mut self, to_device: bool) {
        match to_device {
            true => self.counters.copies_to_device += 1,
            false => self.counters.copies_to_host += 1,
        }
    }

    /// Does `[lo, hi)` lie inside one live allocation?
    fn contains(&self, lo: usize, hi: usize) -> bool {
        self.allocations
            .range(..=lo)
            .next_back()
            .is_some_and(|(&base, a)| hi <= base.saturating_add(a.layout.size()))
    }
}

impl Drop for HostMem {
    /// Frees what is still allocated. The device drops its state only after every stream's
    /// worker has been joined, so no copy runs any more.
    fn drop(&mut self) {
        let kept = std::mem::take(&mut self.kept);
        for a in std::mem::take(&mut self.allocations).into_values().chain(kept) {
            // SAFETY: allocated by `alloc_zeroed` with this layout and freed once (taken out of
            // the table); no worker is left to copy from or to it.
            unsafe { dealloc(a.ptr.as_ptr(), a.layout) };
        }
    }
}

/// Copies not yet passed by their stream that conflict with a host access of `[lo, hi)`: any
/// copy for a write, copies that write the host for a read. As (stream, position).
fn unfinished(st: &State, lo: usize, hi: usize, host_writes: bool) -> Vec<(u32, u64)> {
    st.host
        .copies
        .iter()
        .filter(|c| c.lo < hi && lo < c.hi && (host_writes || c.writes_host))
        .filter(|c| !st.reached(c.stream, c.pos))
        .map(|c| (c.stream, c.pos))
        .collect()
}

/// A raw pointer a copy kernel carries to its worker.
struct SendPtr(*mut u8);

// SAFETY: the pointer is only dereferenced by the copy kernel, under the rules stated where it
// does so; moving the address to the worker thread is harmless.
unsafe impl Send for SendPtr {}

// SAFETY: a captured copy's kernel (shared by the graph's replays) dereferences it only while a
// replay runs, and the device orders each launch of a graph after the previous one, so no two
// replays of one copy run at once; copies of two graphs over the same host bytes are what the
// caller of `memcpy_*_async` promised not to race (the pinned allocator refuses a second
// capture's copy of a captured buffer). Sharing the address between replays is harmless.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `SendPtr`, not its field).
    fn get(&self) -> *mut u8 {
        self.0
    }
}

/// The name of a copy's kernel.
fn copy_name(to_device: bool) -> &'static str {
    if to_device { "copy_htod" } else { "copy_dtoh" }
}

/// The body of a copy's kernel between host `[raw, raw + n)` and device `[dev, dev + n)`: run
/// once for an ordinary copy, at every replay for a captured one.
fn copy_body(
    raw: SendPtr,
    n: usize,
    dev: DeviceAddr,
    to_device: bool,
) -> impl Fn(&dyn KernelMemory) + Send + Sync + 'static {
    move |mem: &dyn KernelMemory| {
        // (Both directions:) `[raw, raw + n)` lies in a live pinned allocation of this
        // device, checked when the copy was enqueued or captured. `host_free` does not release
        // it before an enqueued copy, or a queued replay of a captured one, has run (it waits
        // for them), and keeps it allocated for good while a graph that captured the copy
        // exists. The caller of `memcpy_*_async` promised the host leaves the range alone
        // while a copy runs (the pinned allocator gives no slice of a buffer a graph copies),
        // and replays of one graph never run at once, so no access races this one.
        if to_device {
            // SAFETY: as above.
            let data = unsafe { std::slice::from_raw_parts(raw.get(), n) };
            mem.write(dev, data).expect("copy_htod: device range checked when enqueued");
        } else {
            let mut data = vec![0u8; n];
            mem.read(dev, &mut data).expect("copy_dtoh: device range checked when enqueued");
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), raw.get(), n) };
        }
    }
}

impl State {
    /// A graph launch enqueued on `stream` up to `pos`, whose captured copies use the host
    /// `ranges`: they count as copies of that stream until it passes `pos` (a host free waits
    /// for them, a host access while they run is reported).
    pub(super) fn note_replayed_copies(
        &mut self,
        ranges: &[(usize, usize, bool)],
        stream: u32,
        pos: u64,
    ) {
        for &(lo, hi, writes_host) in ranges {
            self.host.copies.push(HostCopy { lo, hi, stream, pos, writes_host });
        }
    }
}

/// Pinned host memory: inspection and fault injection for tests.
impl SimDevice {
    /// Limits pinned host memory to `bytes` in all (by default the device's capacity). Memory
    /// already allocated stays.
    pub fn set_host_capacity(&self, bytes: u64) {
        self.state().host.capacity = bytes;
    }

    /// Bytes of pinned host memory allocated now.
    pub fn host_reserved_bytes(&self) -> u64 {
        self.state().host.reserved
    }

    /// Live pinned host allocations, as (address, bytes), in address order.
    pub fn live_host_allocations(&self) -> Vec<(HostPtr, u64)> {
        let st = self.state();
        st.host.allocations.values().map(|a| (a.ptr, a.layout.size() as u64)).collect()
    }

    /// Counters of the pinned host memory calls.
    pub fn host_counters(&self) -> SimHostCounters {
        self.state().host.counters
    }

    /// Copies between host and device that have not run yet (or are running).
    pub fn host_copies_in_flight(&self) -> usize {
        let st = self.state();
        st.host.copies.iter().filter(|c| !st.reached(c.stream, c.pos)).count()
    }

    /// Makes the `n`th pinned host allocation from now fail with a driver error (`n` = 1: the
    /// next one). `None` clears it.
    pub fn fail_nth_host_alloc(&self, n: Option<u64>) {
        self.state().host.fail_nth_alloc = n.filter(|&n| n > 0);
    }
}

/// The [`crate::device::Device`] host-memory operations (called from the trait impl).
impl SimDevice {
    /// The pinned host memory it may hold in all.
    pub(super) fn sim_host_capacity(&self) -> u64 {
        self.state().host.capacity
    }

    pub(super) fn sim_host_alloc(&self, bytes: u64) -> Result<HostPtr, DeviceError> {
        let mut guard = self.state();
        let host = &mut guard.host;
        let injected = match host.fail_nth_alloc {
            Some(1) => {
                host.fail_nth_alloc = None;
                true
            }
            Some(n) => {
                host.fail_nth_alloc = Some(n - 1);
                false
            }
            None => false,
        };
        let refused = if injected {
            Some(DeviceError::Driver {
                op: "cuMemHostAlloc",
                code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
            })
        } else if bytes == 0 {
            Some(DeviceError::Unsupported("allocating 0 bytes of pinned host memory"))
        } else if bytes > host.capacity.saturating_sub(host.reserved) {
            Some(DeviceError::OutOfMemory { requested: bytes })
        } else {
            None
        };
        let layout =
            usize::try_from(bytes).ok().and_then(|n| Layout::from_size_align(n, HOST_ALIGN).ok());
        let (Some(layout), None) = (layout, refused.clone()) else {
            host.counters.failed_allocs += 1;
            return Err(refused.unwrap_or(DeviceError::OutOfMemory { requested: bytes }));
        };
        // SAFETY: `layout` has a non-zero size (bytes > 0 was checked).
        let Some(ptr) = HostPtr::new(unsafe { alloc_zeroed(layout) }) else {
            host.counters.failed_allocs += 1;
            return Err(DeviceError::OutOfMemory { requested: bytes });
        };
        host.allocations.insert(ptr.addr(), Allocation { ptr, layout });
        host.reserved += bytes;
        host.counters.allocs += 1;
        Ok(ptr)
    }

    /// Frees a pinned allocation; a copy still using it is a violation, waited for first.
    pub(super) fn sim_host_free(&self, ptr: HostPtr) -> Result<(), DeviceError> {
        let unknown = DeviceError::UnknownSegment(DeviceAddr(ptr.addr() as u64));
        let mut st = self.state();
        let size = st.host.allocations.get(&ptr.addr()).ok_or(unknown.clone())?.layout.size();
        let (lo, hi) = (ptr.addr(), ptr.addr() + size);
        let busy = unfinished(&st, lo, hi, true);
        let mut found = Vec::new();
        if !busy.is_empty() {
            if self.config.sanitize {
                for &(s, _) in &busy {
                    st.san.report(&mut found, lo as u64, hi as u64, s, Some(s), "host free".into());
                }
            }
            st.counters.host_syncs += 1;
            st = self.wait_until(st, |st| busy.iter().all(|&(s, p)| st.reached(s, p)));
        }
        // Another thread may have freed it while this one waited.
        let a = st.host.allocations.remove(&lo).ok_or(unknown)?;
        st.host.reserved -= size as u64;
        st.host.counters.frees += 1;
        if st.graphs.uses_host(lo, hi) {
            // A graph's replays would copy from or into freed memory: reported, and the memory
            // is kept until the device goes.
            let op = "host free of memory a CUDA graph's captured copy uses";
            found.extend(st.san.flag(lo as u64, hi as u64, 0, None, op));
            st.host.kept.push(a);
            let panic = st.panic_on_violation;
            drop(st);
            Self::after_check(found, panic);
            return Ok(());
        }
        let panic = st.panic_on_violation;
        drop(st);
        // SAFETY: allocated by `alloc_zeroed` with this layout and freed once (just taken out of
        // the table); every copy that used it has completed (waited for above), and the caller
        // promised that no host reference into it remains.
        unsafe { dealloc(a.ptr.as_ptr(), a.layout) };
        Self::after_check(found, panic);
        Ok(())
    }

    /// Enqueues a copy between host `[host, host + bytes)` and device `[dev, dev + bytes)`.
    pub(super) fn sim_memcpy(
        &self,
        host: HostPtr,
        dev: DeviceAddr,
        bytes: u64,
        stream: StreamId,
        to_device: bool,
    ) -> Result<(), DeviceError> {
        let mut guard = self.state();
        let st = &mut *guard;
        st.open_stream(stream)?;
        if bytes == 0 {
            return Ok(());
        }
        let n = usize::try_from(bytes).map_err(|_| DeviceError::BadAccess { ptr: dev, bytes })?;
        let lo = host.addr();
        let in_host = lo.checked_add(n).is_some_and(|hi| st.host.contains(lo, hi));
        if !in_host {
            return Err(DeviceError::BadAccess { ptr: DeviceAddr(lo as u64), bytes });
        }
        let in_device = |hi: u64| st.mem.contains(dev.0, hi) || st.vm.mapped(dev.0, hi);
        if !dev.0.checked_add(bytes).is_some_and(in_device) {
            return Err(DeviceError::BadAccess { ptr: dev, bytes });
        }
        if !self.config.backed {
            // BROKEN (`unbacked_copy_terse`): the error did not say how to get a backed device.
            return Err(DeviceError::Unsupported(
                if cfg!(tidepool_broken = "unbacked_copy_terse") {
                    "copies to or from unbacked device memory"
                } else {
                    UNBACKED_COPY
                },
            ));
        }
        let kind = if to_device { AccessKind::Write } else { AccessKind::Read };
        let accesses = vec![Access { ptr: dev, bytes, kind }];
        let raw = SendPtr(host.as_ptr());
        if st.graphs.capturing(stream.0) {
            return self.capture_copy(guard, raw, n, dev, accesses, stream, to_device);
        }
        let kernel = Kernel::new(copy_name(to_device), accesses, copy_body(raw, n, dev, to_device));
        let pos = st.open_stream(stream)?.next_pos();
        // Checked as any kernel: mapped pages of an expandable segment are device memory too,
        // and their physical pages may be mapped elsewhere. BROKEN (`copy_checks_segments_only`):
        // only live segments count, and no alias is checked (a copy into an expandable segment
        // was reported as touching unallocated memory, one racing another mapping was not).
        let found = if cfg!(tidepool_broken = "copy_checks_segments_only") {
            st.san.launch(stream.0, pos, kernel.name, &kernel.accesses, &[], |a, b| {
                st.mem.contains(a, b)
            })
        } else {
            st.check_kernel(stream, pos, &kernel, &[])
        };
        st.open_stream(stream)?.push(Op::Kernel { pos, kernel });
        let streams = &st.streams;
        st.host.copies.retain(|c| streams.get(&c.stream).is_some_and(|s| s.completed < c.pos));
        st.host.copies.push(HostCopy {
            lo,
            hi: lo + n,
            stream: stream.0,
            pos,
            writes_host: !to_device,
        });
        st.host.count_copy(to_device);
        let panic = st.panic_on_violation;
        drop(guard);
        self.shared.progress.notify_all();
        Self::after_check(found, panic);
        Ok(())
    }

    /// A pinned copy on a captured stream: recorded into the capture as a replayable kernel
    /// (each replay copies again, as CUDA's memcpy node does), its host range noted for the
    /// graph's life.
    #[allow(clippy::too_many_arguments)]
    fn capture_copy(
        &self,
        mut guard: crate::sync::MutexGuard<'_, State>,
        raw: SendPtr,
        n: usize,
        dev: DeviceAddr,
        accesses: Vec<Access>,
        stream: StreamId,
        to_device: bool,
    ) -> Result<(), DeviceError> {
        let st = &mut *guard;
        let lo = raw.get() as usize;
        let body = copy_body(raw, n, dev, to_device);
        let kernel = Kernel::replayable(copy_name(to_device), accesses, body);
        let races = match st.graphs.record(stream.0, kernel)? {
            super::graph::Recorded::Yes(races) => races,
            super::graph::Recorded::No(_) => unreachable!("the stream is captured"),
        };
        st.graphs.record_host(stream.0, lo, lo + n, !to_device);
        let op = "kernel touch (branches of a captured graph not ordered)";
        let mut found = Vec::new();
        for (a, b, other) in races {
            found.extend(st.san.flag(a, b, stream.0, Some(other), op));
        }
        st.host.count_copy(to_device);
        let panic = st.panic_on_violation;
        drop(guard);
        Self::after_check(found, panic);
        Ok(())
    }

    /// The host is about to touch `[ptr, ptr + bytes)`: a copy still running on it is a
    /// violation (any copy for a write, a copy to the host for a read).
    pub(super) fn sim_note_host_access(&self, ptr: HostPtr, bytes: u64, kind: AccessKind) {
        if !self.config.sanitize || bytes == 0 {
            return;
        }
        let mut st = self.state();
        let (lo, hi) = (ptr.addr(), ptr.addr().saturating_add(bytes as usize));
        let write = kind == AccessKind::Write;
        let busy = unfinished(&st, lo, hi, write);
        let op = if write { "host write" } else { "host read" };
        let mut found = Vec::new();
        for (s, _) in busy {
            st.san.report(&mut found, lo as u64, hi as u64, s, Some(s), op.into());
        }
        if write && st.graphs.uses_host(lo, hi) {
            let op = "host write of memory a CUDA graph's captured copy uses";
            found.extend(st.san.flag(lo as u64, hi as u64, 0, None, op));
        }
        let panic = st.panic_on_violation;
        drop(st);
        Self::after_check(found, panic);
    }
}
