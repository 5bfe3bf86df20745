//! `SimDevice`: a device made of host memory, so that every test and the replayer run anywhere.
//!
//! Segments live in a fake address space starting at [`SIM_BASE`]; addresses are handed out by a
//! bump pointer and never reused, so a stale pointer can never alias a newer segment. Each segment
//! is optionally backed by zeroed host memory (`SimConfig::backed`); unbacked segments cost nothing,
//! which lets multi-GiB traces replay on a laptop.
//!
//! ```text
//!   SIM_BASE                                                   next_addr
//!   |-- seg A (live) --|-- gap (released) --|-- seg C (live) --|------->
//! ```
//!
//! This version runs streams synchronously: a launched kernel runs before `launch` returns, so
//! every event is complete as soon as it is recorded. It counts every call and can inject faults.

use super::{DeviceError, DevicePtr, EventId, Kernel, KernelMemory, MemInfo, StreamId};
use crate::sync::{Mutex, lock};
use std::collections::{BTreeMap, HashSet};

/// First address of the simulated address space.
pub const SIM_BASE: u64 = 0x7f00_0000_0000;

/// Alignment of every segment, as `cuMemAlloc` guarantees (at least) 512 bytes.
pub const SIM_ALIGN: u64 = 512;

/// How a [`SimDevice`] behaves.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Total device memory in bytes.
    pub capacity: u64,
    /// Back segments with host memory (needed by kernels; off for trace replay).
    pub backed: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            capacity: 8 << 30,
            backed: false,
        }
    }
}

/// Counters of every device call, for tests and reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Successful segment reservations (`cuMemAlloc`).
    pub mallocs: u64,
    /// Refused segment reservations (out of memory or injected).
    pub failed_mallocs: u64,
    /// Segment releases (`cuMemFree`).
    pub frees: u64,
    /// Host synchronisations: event/device synchronise and segment releases.
    pub host_syncs: u64,
    /// Events recorded.
    pub event_records: u64,
    /// Event queries.
    pub event_queries: u64,
    /// Device-side waits on events.
    pub event_waits: u64,
    /// Kernels launched.
    pub launches: u64,
}

/// A stream-order violation found by the sanitizer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// First byte of the offending range.
    pub ptr: DevicePtr,
    /// Length of the offending range.
    pub bytes: u64,
    /// The stream that received or touched the memory.
    pub stream: StreamId,
    /// The stream whose unfinished work was on it, if any.
    pub other: Option<StreamId>,
    /// What happened ("handout", "kernel <name>", ...).
    pub op: String,
}

struct Segment {
    bytes: u64,
    data: Option<Vec<u8>>,
}

#[derive(Default)]
struct Faults {
    /// Fail the Nth successful-looking malloc from now (1 = the next one).
    fail_nth_malloc: Option<u64>,
    /// Fail every malloc of more than this many bytes.
    fail_above: Option<u64>,
    /// Fail every event query.
    fail_event_query: bool,
}

struct State {
    next_addr: u64,
    reserved: u64,
    segments: BTreeMap<u64, Segment>,
    streams: HashSet<u32>,
    next_stream: u32,
    events: HashSet<u64>,
    next_event: u64,
    counters: SimCounters,
    faults: Faults,
}

/// A simulated device. See the module docs.
pub struct SimDevice {
    config: SimConfig,
    state: Mutex<State>,
}

impl SimDevice {
    /// A device with `capacity` bytes, unbacked.
    pub fn new(capacity: u64) -> SimDevice {
        SimDevice::with_config(SimConfig {
            capacity,
            ..SimConfig::default()
        })
    }

    /// A device with `capacity` bytes, backed by host memory so kernels can read and write it.
    pub fn backed(capacity: u64) -> SimDevice {
        SimDevice::with_config(SimConfig {
            capacity,
            backed: true,
        })
    }

    /// A device from a full configuration.
    pub fn with_config(config: SimConfig) -> SimDevice {
        let mut streams = HashSet::new();
        streams.insert(StreamId::DEFAULT.0);
        SimDevice {
            config,
            state: Mutex::new(State {
                next_addr: SIM_BASE,
                reserved: 0,
                segments: BTreeMap::new(),
                streams,
                next_stream: 1,
                events: HashSet::new(),
                next_event: 1,
                counters: SimCounters::default(),
                faults: Faults::default(),
            }),
        }
    }

    /// The device's configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Every call counted so far.
    pub fn counters(&self) -> SimCounters {
        lock(&self.state).counters
    }

    /// Live segments, as (address, bytes), in address order.
    pub fn live_segments(&self) -> Vec<(DevicePtr, u64)> {
        lock(&self.state)
            .segments
            .iter()
            .map(|(&a, s)| (DevicePtr(a), s.bytes))
            .collect()
    }

    /// Bytes currently reserved.
    pub fn reserved_bytes(&self) -> u64 {
        lock(&self.state).reserved
    }

    /// Makes the `n`th malloc from now fail (`n` = 1: the next one). `None` clears it.
    pub fn fail_nth_malloc(&self, n: Option<u64>) {
        lock(&self.state).faults.fail_nth_malloc = n.filter(|&n| n > 0);
    }

    /// Makes every malloc of more than `bytes` fail. `None` clears it.
    pub fn fail_mallocs_above(&self, bytes: Option<u64>) {
        lock(&self.state).faults.fail_above = bytes;
    }

    /// Makes every event query fail while `on`.
    pub fn fail_event_queries(&self, on: bool) {
        lock(&self.state).faults.fail_event_query = on;
    }

    /// Stream-order violations found so far (none on this synchronous device).
    pub fn violations(&self) -> Vec<Violation> {
        Vec::new()
    }

    fn check_stream(state: &State, stream: StreamId) -> Result<(), DeviceError> {
        if state.streams.contains(&stream.0) {
            Ok(())
        } else {
            Err(DeviceError::UnknownStream(stream))
        }
    }

    fn check_event(state: &State, event: EventId) -> Result<(), DeviceError> {
        if state.events.contains(&event.0) {
            Ok(())
        } else {
            Err(DeviceError::UnknownEvent(event))
        }
    }
}

impl super::Device for SimDevice {
    fn name(&self) -> String {
        format!("SimDevice {} MiB", self.config.capacity >> 20)
    }

    fn reserve(&self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        let mut st = lock(&self.state);
        let injected = match st.faults.fail_nth_malloc {
            Some(1) => {
                st.faults.fail_nth_malloc = None;
                true
            }
            Some(n) => {
                st.faults.fail_nth_malloc = Some(n - 1);
                false
            }
            None => false,
        };
        if injected || st.faults.fail_above.is_some_and(|limit| bytes > limit) {
            st.counters.failed_mallocs += 1;
            return Err(DeviceError::Injected("reserve"));
        }
        if bytes == 0 || bytes > self.config.capacity - st.reserved {
            st.counters.failed_mallocs += 1;
            return Err(DeviceError::OutOfMemory { requested: bytes });
        }
        let addr = st.next_addr;
        let span = bytes.div_ceil(SIM_ALIGN) * SIM_ALIGN;
        st.next_addr += span;
        st.reserved += bytes;
        let data = self.config.backed.then(|| vec![0u8; bytes as usize]);
        st.segments.insert(addr, Segment { bytes, data });
        st.counters.mallocs += 1;
        Ok(DevicePtr(addr))
    }

    fn release(&self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let mut st = lock(&self.state);
        let seg = st
            .segments
            .remove(&ptr.0)
            .ok_or(DeviceError::UnknownSegment(ptr))?;
        st.reserved -= seg.bytes;
        st.counters.frees += 1;
        st.counters.host_syncs += 1;
        Ok(())
    }

    fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        let st = lock(&self.state);
        Ok(MemInfo {
            free: self.config.capacity - st.reserved,
            total: self.config.capacity,
        })
    }

    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        let mut st = lock(&self.state);
        let id = st.next_stream;
        st.next_stream += 1;
        st.streams.insert(id);
        Ok(StreamId(id))
    }

    fn destroy_stream(&self, stream: StreamId) -> Result<(), DeviceError> {
        if stream == StreamId::DEFAULT {
            return Err(DeviceError::Unsupported("destroying the default stream"));
        }
        let mut st = lock(&self.state);
        if st.streams.remove(&stream.0) {
            Ok(())
        } else {
            Err(DeviceError::UnknownStream(stream))
        }
    }

    fn create_event(&self) -> Result<EventId, DeviceError> {
        let mut st = lock(&self.state);
        let id = st.next_event;
        st.next_event += 1;
        st.events.insert(id);
        Ok(EventId(id))
    }

    fn destroy_event(&self, event: EventId) -> Result<(), DeviceError> {
        let mut st = lock(&self.state);
        if st.events.remove(&event.0) {
            Ok(())
        } else {
            Err(DeviceError::UnknownEvent(event))
        }
    }

    fn record_event(&self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        let mut st = lock(&self.state);
        Self::check_event(&st, event)?;
        Self::check_stream(&st, stream)?;
        st.counters.event_records += 1;
        Ok(())
    }

    fn query_event(&self, event: EventId) -> Result<bool, DeviceError> {
        let mut st = lock(&self.state);
        Self::check_event(&st, event)?;
        st.counters.event_queries += 1;
        if st.faults.fail_event_query {
            return Err(DeviceError::Injected("query_event"));
        }
        Ok(true)
    }

    fn wait_event(&self, stream: StreamId, event: EventId) -> Result<(), DeviceError> {
        let mut st = lock(&self.state);
        Self::check_event(&st, event)?;
        Self::check_stream(&st, stream)?;
        st.counters.event_waits += 1;
        Ok(())
    }

    fn synchronize_event(&self, event: EventId) -> Result<(), DeviceError> {
        let mut st = lock(&self.state);
        Self::check_event(&st, event)?;
        st.counters.host_syncs += 1;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        lock(&self.state).counters.host_syncs += 1;
        Ok(())
    }

    fn launch(&self, stream: StreamId, kernel: Kernel) -> Result<(), DeviceError> {
        {
            let mut st = lock(&self.state);
            Self::check_stream(&st, stream)?;
            st.counters.launches += 1;
        }
        std::thread::sleep(kernel.sleep);
        if let Some(body) = kernel.body {
            let mem = SimMemory {
                device: self,
                accesses: &kernel.accesses,
            };
            body(&mem);
        }
        Ok(())
    }
}

/// Kernel view of a [`SimDevice`]'s memory, limited to the kernel's declared accesses.
struct SimMemory<'a> {
    device: &'a SimDevice,
    accesses: &'a [super::Access],
}

impl SimMemory<'_> {
    fn declared(&self, ptr: DevicePtr, bytes: u64, write: bool) -> bool {
        self.accesses.iter().any(|a| {
            a.ptr.0 <= ptr.0
                && ptr.0 + bytes <= a.ptr.0 + a.bytes
                && (!write || a.kind == super::AccessKind::Write)
        })
    }

    fn with_range<R>(
        &self,
        ptr: DevicePtr,
        bytes: u64,
        write: bool,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, DeviceError> {
        let bad = DeviceError::BadAccess { ptr, bytes };
        if !self.declared(ptr, bytes, write) {
            return Err(bad);
        }
        let mut st = lock(&self.device.state);
        let (&base, seg) = st
            .segments
            .range_mut(..=ptr.0)
            .next_back()
            .ok_or(bad.clone())?;
        let off = ptr.0 - base;
        if off + bytes > seg.bytes {
            return Err(bad);
        }
        let data = seg
            .data
            .as_mut()
            .ok_or(DeviceError::Unsupported("kernel on unbacked memory"))?;
        Ok(f(&mut data[off as usize..(off + bytes) as usize]))
    }
}

impl KernelMemory for SimMemory<'_> {
    fn read(&self, ptr: DevicePtr, out: &mut [u8]) -> Result<(), DeviceError> {
        self.with_range(ptr, out.len() as u64, false, |src| out.copy_from_slice(src))
    }

    fn write(&self, ptr: DevicePtr, data: &[u8]) -> Result<(), DeviceError> {
        self.with_range(ptr, data.len() as u64, true, |dst| {
            dst.copy_from_slice(data)
        })
    }
}
