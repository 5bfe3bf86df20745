//! [`Device`](crate::device::Device) for [`SimDevice`]: memory, streams, events and the
//! virtual memory calls the allocator makes, with the faults a test armed and the sanitizer's
//! checks.

use super::stream::Op;
use super::{SimDevice, State, vmm};
use crate::device::{
    AccessKind, DeviceAddr, DeviceError, EventId, HostPtr, MemInfo, PhysHandle, StreamId,
};
use crate::sync::lock;

impl crate::device::Device for SimDevice {
    fn name(&self) -> String {
        format!("SimDevice {} MiB", self.config.capacity >> 20)
    }

    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError> {
        let mut st = self.state();
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
            return Err(DeviceError::Driver {
                op: "reserve",
                code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
            });
        }
        if bytes == 0 || bytes > self.config.capacity - st.used() {
            st.counters.failed_mallocs += 1;
            return Err(DeviceError::OutOfMemory { requested: bytes });
        }
        let Some(addr) = st.mem.reserve(bytes, self.config.backed) else {
            // A backed device whose host cannot hold the segment: out of memory, as CUDA's.
            st.counters.failed_mallocs += 1;
            return Err(DeviceError::OutOfMemory { requested: bytes });
        };
        st.counters.mallocs += 1;
        Ok(DeviceAddr(addr))
    }

    /// Synchronises the device (a host sync, as `cuMemFree` does), then frees the segment.
    fn release(&self, ptr: DeviceAddr) -> Result<(), DeviceError> {
        let mut st = self.state();
        if !st.mem.segments.contains_key(&ptr.0) {
            return Err(DeviceError::UnknownSegment(ptr));
        }
        st.graphs.refuse_during_capture("cuMemFree")?;
        let mut st = self.wait_until(st, State::idle);
        let bytes = st.mem.release(ptr.0).ok_or(DeviceError::UnknownSegment(ptr))?;
        let mut found = Vec::new();
        if let Some((lo, hi)) = st.graphs.held(ptr.0, ptr.0 + bytes) {
            found = st.san.flag(lo, hi, 0, None, "release of memory a CUDA graph uses");
        }
        found.extend(st.san.release_segment(ptr.0, ptr.0 + bytes));
        st.counters.frees += 1;
        st.counters.host_syncs += 1;
        let panic = st.panic_on_violation;
        drop(st);
        Self::after_check(found, panic);
        Ok(())
    }

    fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        let st = self.state();
        Ok(MemInfo { free: self.config.capacity - st.used(), total: self.config.capacity })
    }

    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        let mut st = self.state();
        let id = st.next_stream;
        st.next_stream += 1;
        self.start_stream(&mut st, id)?;
        Ok(StreamId(id))
    }

    /// Stops accepting work on `stream`, waits for its queue to drain, and joins its worker.
    fn destroy_stream(&self, stream: StreamId) -> Result<(), DeviceError> {
        if stream == StreamId::DEFAULT {
            return Err(DeviceError::Unsupported("destroying the default stream"));
        }
        let app = self.state().app_streams.get(&stream.0).copied();
        if let Some(adopted) = app {
            // The application's stream: drained and forgotten, never destroyed here.
            if !adopted {
                return Err(DeviceError::UnknownStream(stream));
            }
            return self.release_adopted(stream);
        }
        let handle = {
            let mut st = self.state();
            if st.graphs.capturing(stream.0) {
                return Err(DeviceError::capture_unsupported("cuStreamDestroy"));
            }
            let s = st.open_stream(stream)?;
            s.closing = true;
            s.handle.take()
        };
        self.shared.progress.notify_all();
        if let Some(h) = handle {
            // Draining the stream's work is a host wait like a synchronisation.
            self.state().host_waits += 1;
            let _ = h.join();
            self.state().host_waits -= 1;
        }
        let mut st = self.state();
        st.streams.remove(&stream.0);
        st.san.forget_stream(stream.0);
        // Waits on this stream are now satisfied (a missing stream has passed every position).
        self.shared.progress.notify_all();
        Ok(())
    }

    /// A stream made here, or one of the application's while adopted.
    fn has_stream(&self, stream: StreamId) -> bool {
        let st = self.state();
        st.streams.get(&stream.0).is_some_and(|s| !s.closing)
            && st.app_streams.get(&stream.0) != Some(&false)
    }

    fn create_event(&self) -> Result<EventId, DeviceError> {
        let mut st = self.state();
        if vmm::countdown(&mut st.faults.fail_nth_event_create) {
            let code = DeviceError::CUDA_ERROR_OUT_OF_MEMORY;
            return Err(DeviceError::Driver { op: "cuEventCreate", code });
        }
        let id = st.next_event;
        st.next_event += 1;
        st.events.insert(id, None);
        Ok(EventId(id))
    }

    fn destroy_event(&self, event: EventId) -> Result<(), DeviceError> {
        let mut st = self.state();
        st.events.remove(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
        st.san.forget_event(event.0);
        Ok(())
    }

    /// The event's marker is the stream's current end of queue; re-recording re-arms it.
    fn record_event(&self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        let mut st = self.state();
        st.event(event)?;
        if st.faults.fail_event_record {
            return Self::event_fault(st, "record_event");
        }
        let pos = st.open_stream(stream)?.enqueued;
        st.counters.event_records += 1;
        if st.graphs.record_event(event.0, stream.0) {
            // A node of the capture: nothing in the stream's queue to wait for or query.
            st.events.insert(event.0, None);
            st.san.forget_event(event.0);
            return Ok(());
        }
        st.events.insert(event.0, Some((stream.0, pos)));
        st.san.record(event.0, stream.0, pos);
        Ok(())
    }

    fn query_event(&self, event: EventId) -> Result<bool, DeviceError> {
        let mut st = self.state();
        let target = st.event(event)?;
        st.counters.event_queries += 1;
        st.graphs.refuse_during_capture("cuEventQuery")?;
        if st.faults.fail_next_queries > 0 {
            st.faults.fail_next_queries -= 1;
            return Self::event_fault(st, "query_event");
        }
        if st.faults.fail_event_query {
            return Self::event_fault(st, "query_event");
        }
        Ok(st.target_reached(target))
    }

    /// Enqueues a device-side wait for the event's latest marker (none if already passed).
    fn wait_event(&self, stream: StreamId, event: EventId) -> Result<(), DeviceError> {
        let mut st = self.state();
        let target = st.event(event)?;
        st.open_stream(stream)?;
        if st.faults.fail_event_wait {
            return Self::event_fault(st, "wait_event");
        }
        let captured = st.graphs.wait_event(stream, event.0)?;
        st.counters.event_waits += 1;
        if captured {
            // Inside a capture (the stream joined it, or orders its branch): nothing to enqueue.
            return Ok(());
        }
        if let Some((a, p)) = target
            && a != stream.0
            && !st.reached(a, p)
        {
            st.open_stream(stream)?.push(Op::Wait { stream: a, pos: p });
            self.shared.progress.notify_all();
        }
        st.san.wait(stream.0, event.0);
        Ok(())
    }

    fn synchronize_event(&self, event: EventId) -> Result<(), DeviceError> {
        let mut st = self.state();
        let target = st.event(event)?;
        st.graphs.refuse_during_capture("cuEventSynchronize")?;
        if st.faults.fail_host_sync {
            return Self::event_fault(st, "synchronize_event");
        }
        st.counters.host_syncs += 1;
        drop(self.wait_until(st, |st| st.target_reached(target)));
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        let mut st = self.state();
        st.graphs.refuse_during_capture("cuCtxSynchronize")?;
        if st.faults.fail_host_sync {
            return Self::event_fault(st, "synchronize");
        }
        st.counters.host_syncs += 1;
        drop(self.wait_until(st, State::idle));
        Ok(())
    }

    fn is_adopted(&self, stream: StreamId) -> bool {
        self.state().app_streams.get(&stream.0) == Some(&true)
    }

    fn observes_handouts(&self) -> bool {
        self.config.sanitize
    }

    #[inline]
    fn note_handout(&self, ptr: DeviceAddr, bytes: u64, stream: StreamId) {
        if self.config.sanitize {
            self.sanitize_handout(ptr, bytes, stream);
        }
    }

    #[inline]
    fn note_reclaim(&self, ptr: DeviceAddr, bytes: u64, stream: StreamId) {
        let hook = lock(&self.shared.reclaim_hook).clone();
        if let Some(hook) = hook {
            hook(ptr, bytes);
        }
        if self.config.sanitize {
            self.sanitize_reclaim(ptr, bytes, stream);
        }
    }

    fn supports_virtual_memory(&self) -> bool {
        self.state().vm.supported
    }

    fn vm_granularity(&self) -> Result<u64, DeviceError> {
        let st = self.state();
        st.vm.supported.then_some(st.vm.granularity).ok_or(crate::device::NO_VIRTUAL_MEMORY)
    }

    fn vm_reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError> {
        let mut guard = self.state();
        let st = &mut *guard;
        if !st.vm.supported {
            return Err(crate::device::NO_VIRTUAL_MEMORY);
        }
        let taken = st.vm.check_reserve(bytes).and_then(|()| {
            st.mem.take_addresses(bytes, st.vm.granularity).ok_or(DeviceError::Driver {
                op: "cuMemAddressReserve",
                code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
            })
        });
        let addr = taken.inspect_err(|_| st.vm.counters.failed_reserves += 1)?;
        st.vm.add_range(addr, bytes);
        Ok(DeviceAddr(addr))
    }

    fn vm_free(&self, base: DeviceAddr, bytes: u64) -> Result<(), DeviceError> {
        let mut st = self.state();
        if !st.vm.supported {
            return Err(crate::device::NO_VIRTUAL_MEMORY);
        }
        st.vm.free_range(base.0, bytes)
    }

    fn vm_create(&self, bytes: u64) -> Result<PhysHandle, DeviceError> {
        let mut st = self.state();
        if !st.vm.supported {
            return Err(crate::device::NO_VIRTUAL_MEMORY);
        }
        let room = self.config.capacity - st.used();
        st.vm.create(bytes, room, self.config.backed)
    }

    fn vm_release(&self, handle: PhysHandle) -> Result<(), DeviceError> {
        let mut st = self.state();
        if !st.vm.supported {
            return Err(crate::device::NO_VIRTUAL_MEMORY);
        }
        st.vm.release(handle)
    }

    fn vm_map(&self, va: DeviceAddr, bytes: u64, handle: PhysHandle) -> Result<(), DeviceError> {
        let mut st = self.state();
        if !st.vm.supported {
            return Err(crate::device::NO_VIRTUAL_MEMORY);
        }
        st.vm.map(va.0, bytes, handle)
    }

    /// Unmaps at once, without waiting for the streams: the sanitizer reports unfinished work on
    /// the range, and any part of it still handed out.
    fn vm_unmap(&self, va: DeviceAddr, bytes: u64) -> Result<(), DeviceError> {
        let mut st = self.state();
        if !st.vm.supported {
            return Err(crate::device::NO_VIRTUAL_MEMORY);
        }
        st.vm.unmap(va.0, bytes)?;
        let found = st.san.unmap(va.0, va.0.saturating_add(bytes));
        let panic = st.panic_on_violation;
        drop(st);
        Self::after_check(found, panic);
        Ok(())
    }

    fn host_alloc(&self, bytes: u64) -> Result<HostPtr, DeviceError> {
        self.sim_host_alloc(bytes)
    }

    /// [`SimDevice::set_host_capacity`]'s limit (by default the device's capacity).
    fn host_capacity(&self) -> Option<u64> {
        Some(self.sim_host_capacity())
    }

    /// Waits for copies still using the memory (reported as violations) before freeing it.
    unsafe fn host_free(&self, ptr: HostPtr) -> Result<(), DeviceError> {
        self.sim_host_free(ptr)
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DeviceAddr,
        src: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        self.sim_memcpy(src, dst, bytes, stream, true)
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: HostPtr,
        src: DeviceAddr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        self.sim_memcpy(dst, src, bytes, stream, false)
    }

    fn note_host_access(&self, ptr: HostPtr, bytes: u64, kind: AccessKind) {
        self.sim_note_host_access(ptr, bytes, kind);
    }

    /// One relaxed load (every allocator's hit path and free ask it): what a capture's state
    /// holds is read under the device's lock, which orders it, and a capture begun on another
    /// thread with no order to this call is a race an acquire would not close either (the
    /// capture gate, `guarded.rs`, covers the forbidden calls). An acquire kept the compiler
    /// from holding the allocator's lane cells in registers across it: the 4 KiB pair took
    /// ~29 ns against ~24.5 ns.
    #[inline]
    fn capture_underway(&self) -> bool {
        self.captures.load(crate::sync::atomic::Ordering::Relaxed) != 0
    }

    fn capture_of(&self, stream: StreamId) -> Option<StreamId> {
        if !self.capture_underway() {
            return None;
        }
        self.state().graphs.origin_of(stream.0).map(StreamId)
    }

    fn capture_mark(&self, stream: StreamId) -> Option<crate::device::CaptureMark> {
        if !self.capture_underway() {
            return None;
        }
        self.state().graphs.mark(stream.0)
    }

    fn capture_ordered_after(&self, stream: StreamId, mark: crate::device::CaptureMark) -> bool {
        self.capture_underway() && self.state().graphs.ordered_after(stream.0, mark)
    }
}
