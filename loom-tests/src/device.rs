//! `LoomDevice`: just enough of a device for loom models of the real allocator.
//!
//! ```text
//!   state: loom Mutex { next address, segments, per stream (enqueued, completed),
//!                       events → (stream, position), busy ranges (ptr, len, stream, position) }
//!   use_on(ptr, len, s)  : work on s touches the range (position enqueued+1), unfinished
//!   complete(s)          : s finishes everything enqueued; its busy ranges go away
//!   wait_event(s, e)     : s's later work is ordered after e's (stream, position): waited[s]
//!   note_handout(p, n, s): panics if a busy range of another stream overlaps [p, p+n) and s
//!                          has not waited for it
//! ```
//!
//! Waiting operations (`synchronize_event`, `synchronize`, `release`) complete the work they wait
//! for at once: loom models end with everything completed anyway.

use loom::sync::Mutex;
use std::collections::HashMap;
use tidepool::device::{DeviceError, EventId, MemInfo};
use tidepool::{Device, DeviceAddr, StreamId};

const STREAMS: usize = 4;
const CAPACITY: u64 = 1 << 30;
const BASE: u64 = 0x1000_0000;

#[derive(Default)]
struct State {
    next: u64,
    segments: Vec<(u64, u64)>,
    enqueued: [u64; STREAMS],
    completed: [u64; STREAMS],
    events: HashMap<u64, Option<(usize, u64)>>,
    next_event: u64,
    busy: Vec<(u64, u64, usize, u64)>,
    /// `waited[s][o]`: stream `s`'s later work is ordered after position `waited[s][o]` of `o`.
    waited: [[u64; STREAMS]; STREAMS],
}

/// A loom-modelled device. See the module docs.
pub struct LoomDevice {
    st: Mutex<State>,
}

impl Default for LoomDevice {
    fn default() -> Self {
        LoomDevice::new()
    }
}

impl LoomDevice {
    /// A device with streams 0..4 (0 is the default stream).
    pub fn new() -> LoomDevice {
        LoomDevice { st: Mutex::new(State { next: BASE, ..State::default() }) }
    }

    /// Work on `stream` starts using `[ptr, ptr + len)` and has not finished.
    pub fn use_on(&self, ptr: DeviceAddr, len: u64, stream: StreamId) {
        let mut st = self.st.lock().unwrap();
        let s = stream.0 as usize;
        st.enqueued[s] += 1;
        let pos = st.enqueued[s];
        st.busy.push((ptr.0, len, s, pos));
    }

    /// `stream` finishes all work enqueued so far.
    pub fn complete(&self, stream: StreamId) {
        let mut st = self.st.lock().unwrap();
        let s = stream.0 as usize;
        st.completed[s] = st.enqueued[s];
        st.busy.retain(|b| b.2 != s);
    }

    /// Live segments.
    pub fn live_segments(&self) -> usize {
        self.st.lock().unwrap().segments.len()
    }
}

impl Device for LoomDevice {
    fn name(&self) -> String {
        "LoomDevice".into()
    }

    fn reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError> {
        let mut st = self.st.lock().unwrap();
        let used: u64 = st.segments.iter().map(|s| s.1).sum();
        if used + bytes > CAPACITY {
            return Err(DeviceError::OutOfMemory { requested: bytes });
        }
        let p = st.next;
        st.next += bytes;
        st.segments.push((p, bytes));
        Ok(DeviceAddr(p))
    }

    fn release(&self, ptr: DeviceAddr) -> Result<(), DeviceError> {
        let mut st = self.st.lock().unwrap();
        let i = st
            .segments
            .iter()
            .position(|s| s.0 == ptr.0)
            .ok_or(DeviceError::UnknownSegment(ptr))?;
        st.segments.remove(i);
        Ok(())
    }

    fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        let st = self.st.lock().unwrap();
        let used: u64 = st.segments.iter().map(|s| s.1).sum();
        Ok(MemInfo { free: CAPACITY - used, total: CAPACITY })
    }

    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        Err(DeviceError::Unsupported("streams are fixed"))
    }

    fn destroy_stream(&self, _stream: StreamId) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("streams are fixed"))
    }

    fn has_stream(&self, stream: StreamId) -> bool {
        (stream.0 as usize) < STREAMS
    }

    fn create_event(&self) -> Result<EventId, DeviceError> {
        let mut st = self.st.lock().unwrap();
        st.next_event += 1;
        let e = st.next_event;
        st.events.insert(e, None);
        Ok(EventId(e))
    }

    fn destroy_event(&self, event: EventId) -> Result<(), DeviceError> {
        self.st.lock().unwrap().events.remove(&event.0);
        Ok(())
    }

    fn record_event(&self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        let mut st = self.st.lock().unwrap();
        let s = stream.0 as usize;
        let pos = st.enqueued[s];
        st.events.insert(event.0, Some((s, pos)));
        Ok(())
    }

    fn query_event(&self, event: EventId) -> Result<bool, DeviceError> {
        let st = self.st.lock().unwrap();
        let target = *st.events.get(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
        Ok(target.is_none_or(|(s, p)| st.completed[s] >= p))
    }

    fn wait_event(&self, stream: StreamId, event: EventId) -> Result<(), DeviceError> {
        let mut st = self.st.lock().unwrap();
        let target = *st.events.get(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
        if let Some((o, pos)) = target {
            let w = &mut st.waited[stream.0 as usize][o];
            *w = (*w).max(pos);
        }
        Ok(())
    }

    fn synchronize_event(&self, event: EventId) -> Result<(), DeviceError> {
        let target = *self.st.lock().unwrap().events.get(&event.0).unwrap_or(&None);
        if let Some((s, _)) = target {
            self.complete(StreamId(s as u32));
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        for s in 0..STREAMS {
            self.complete(StreamId(s as u32));
        }
        Ok(())
    }

    fn observes_handouts(&self) -> bool {
        true
    }

    fn note_handout(&self, ptr: DeviceAddr, bytes: u64, stream: StreamId) {
        let st = self.st.lock().unwrap();
        let s = stream.0 as usize;
        for &(p, n, other, pos) in &st.busy {
            if other != s && st.waited[s][other] < pos && p < ptr.0 + bytes && ptr.0 < p + n {
                panic!(
                    "stream-order violation: {ptr:?} handed to {stream} while stream {other} uses it"
                );
            }
        }
    }
}
