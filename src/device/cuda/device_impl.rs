//! [`Device`] for [`CudaDevice`]: one driver call (or a few) per method, through `result.rs`,
//! each with its `// SAFETY:` comment.

use super::{CudaDevice, EventSlot, SEGMENT_ALIGN, driver_error, lock, result};
use crate::device::{
    Device, DeviceAddr, DeviceError, EventId, HostPtr, MemInfo, PhysHandle, StreamId,
};

impl Device for CudaDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn ordinal(&self) -> usize {
        CudaDevice::ordinal(self)
    }

    /// Whether a capture `begin_capture` started has not ended (no driver call, no lock).
    #[inline]
    fn capture_underway(&self) -> bool {
        self.capturing_any()
    }

    /// From the streams `begin_capture` started capturing and those that joined them through
    /// [`Device::wait_event`] here (no driver call).
    fn capture_of(&self, stream: StreamId) -> Option<StreamId> {
        self.capture_origin(stream)
    }

    /// From the capture order: the next event recorded on `stream` covers the mark (no driver
    /// call). Work launched through cudarc on a captured stream is covered too: the mark stands
    /// for everything enqueued on the stream before it.
    fn capture_mark(&self, stream: StreamId) -> Option<crate::device::CaptureMark> {
        self.mark_of(stream)
    }

    /// From the capture order (the waits made through [`Device::wait_event`] here).
    fn capture_ordered_after(&self, stream: StreamId, mark: crate::device::CaptureMark) -> bool {
        self.ordered_after(stream, mark)
    }

    /// `cuMemAlloc`; the driver's out-of-memory answer is [`DeviceError::OutOfMemory`].
    fn reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError> {
        if bytes == 0 {
            return Err(DeviceError::Unsupported("reserving a segment of 0 bytes"));
        }
        self.bind()?;
        let ptr = result::relaxed_capture_mode(|| result::mem_alloc(bytes))?;
        if !ptr.is_multiple_of(SEGMENT_ALIGN) {
            // SAFETY: just allocated in the current context; never handed out.
            unsafe { result::mem_free(ptr) }?;
            return Err(DeviceError::Unsupported(
                "cuMemAlloc returned a pointer that is not 512-byte aligned",
            ));
        }
        lock(&self.segments).insert(ptr, bytes);
        Ok(DeviceAddr(ptr))
    }

    /// Synchronises the context (a host sync), then `cuMemFree`.
    fn release(&self, ptr: DeviceAddr) -> Result<(), DeviceError> {
        let bytes = lock(&self.segments).remove(&ptr.0).ok_or(DeviceError::UnknownSegment(ptr))?;
        let freed = self.bind().and_then(|()| result::ctx_synchronize()).and_then(|()| {
            // SAFETY: `ptr` is a live segment of this context (just taken out of `segments`, so
            // no other release frees it), and the context is idle, so no device work uses it.
            unsafe { result::mem_free(ptr.0) }
        });
        if freed.is_err() {
            lock(&self.segments).insert(ptr.0, bytes);
        }
        freed
    }

    fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        self.bind()?;
        result::mem_get_info()
    }

    /// A new non-blocking stream (cudarc's `CudaContext::new_stream`).
    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        let stream = self.ctx.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?;
        let mut streams = lock(&self.streams);
        let id = streams.new_id()?;
        streams.live.insert(id, stream);
        Ok(StreamId(id))
    }

    /// Forgets the stream, then waits for its work. cudarc destroys it when the last `Arc` from
    /// [`CudaDevice::stream`] goes.
    /// An adopted stream is drained and forgotten the same way; its owner destroys it.
    fn destroy_stream(&self, stream: StreamId) -> Result<(), DeviceError> {
        if stream == StreamId::DEFAULT {
            return Err(DeviceError::Unsupported("destroying the default stream"));
        }
        let s = {
            let mut streams = lock(&self.streams);
            streams.adopted.remove(&stream.0);
            streams.live.remove(&stream.0).ok_or(DeviceError::UnknownStream(stream))?
        };
        self.bind()?;
        // SAFETY: `s` is a live stream of this context, kept alive by the `Arc` we hold.
        unsafe { result::stream_synchronize(s.cu_stream()) }
    }

    fn is_adopted(&self, stream: StreamId) -> bool {
        lock(&self.streams).adopted.contains(&stream.0)
    }

    fn has_stream(&self, stream: StreamId) -> bool {
        lock(&self.streams).live.contains_key(&stream.0)
    }

    /// A pooled `CU_EVENT_DISABLE_TIMING` event, or a new one.
    fn create_event(&self) -> Result<EventId, DeviceError> {
        let mut events = lock(&self.events);
        let raw = match events.pool.pop() {
            Some(raw) => raw,
            None => {
                self.bind()?;
                result::event_create()?
            }
        };
        let id = events.next;
        events.next += 1;
        events.live.insert(id, EventSlot { raw, recorded: false, captured: None });
        Ok(EventId(id))
    }

    /// Returns the handle to the pool (it stays valid until the device is dropped).
    fn destroy_event(&self, event: EventId) -> Result<(), DeviceError> {
        let mut events = lock(&self.events);
        let slot = events.live.remove(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
        events.pool.push(slot.raw);
        Ok(())
    }

    /// `cuEventRecord`. On a capturing stream the record is a node of the capture (CUDA's
    /// fork): a stream outside any capture that waits on the event joins it.
    fn record_event(&self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        let s = self.stream(stream)?;
        let mut events = lock(&self.events);
        let slot = events.live.get_mut(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
        self.bind()?;
        // SAFETY: the event handle is live (pooled handles live as long as the device) and `s`
        // is a live stream of this context, kept alive by the `Arc` we hold.
        unsafe { result::event_record(slot.raw, s.cu_stream()) }?;
        // Numbered after the driver took it (a failed record orders nothing).
        let captured = self.capture_record(stream);
        slot.recorded = captured.is_none();
        slot.captured = captured;
        Ok(())
    }

    /// `cuEventQuery`: `CUDA_ERROR_NOT_READY` is `Ok(false)`; a never-recorded event is
    /// complete, and so is one recorded in a capture that is over (refused while it is not).
    fn query_event(&self, event: EventId) -> Result<bool, DeviceError> {
        let events = lock(&self.events);
        let slot = events.live.get(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
        if slot.captured.as_ref().is_some_and(|c| self.capture_live(c)) {
            return Err(DeviceError::capture_unsupported("cuEventQuery"));
        }
        if !slot.recorded {
            return Ok(true);
        }
        self.bind()?;
        // SAFETY: the handle is live for as long as the device.
        unsafe { result::event_query(slot.raw) }
    }

    /// `cuStreamWaitEvent`; nothing to wait for when the event was never recorded (or in a
    /// capture that is over). On an event recorded in a capture underway, a stream outside any
    /// capture joins it (CUDA's fork) and one inside it orders its branch; a capturing stream
    /// waiting on any other event is CUDA's `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`.
    fn wait_event(&self, stream: StreamId, event: EventId) -> Result<(), DeviceError> {
        let isolation = DeviceError::Driver {
            op: "cuStreamWaitEvent",
            code: DeviceError::CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
        };
        let s = self.stream(stream)?;
        let (raw, recorded, captured) = {
            let events = lock(&self.events);
            let slot = events.live.get(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
            (slot.raw, slot.recorded, slot.captured.clone())
        };
        let live = captured.filter(|c| self.capture_live(c));
        match (&live, self.capture_origin(stream)) {
            (Some(c), Some(mine)) if mine.0 != c.origin => return Err(isolation),
            (Some(_), None) if stream == StreamId::DEFAULT => {
                return Err(DeviceError::Unsupported("capturing the default (legacy null) stream"));
            }
            (None, Some(_)) => return Err(isolation),
            (None, None) if !recorded => return Ok(()),
            _ => {}
        }
        self.bind()?;
        // SAFETY: both handles are live: the event as long as the device (pooled handles are
        // never destroyed before it), `s` through its `Arc`.
        unsafe { result::stream_wait_event(s.cu_stream(), raw) }?;
        // A stream outside the capture joins it; one inside is ordered after the event.
        if let Some(c) = &live {
            self.capture_wait(stream, c);
        }
        Ok(())
    }

    /// `cuEventSynchronize`, without holding the event table's lock while blocked.
    fn synchronize_event(&self, event: EventId) -> Result<(), DeviceError> {
        let raw = {
            let events = lock(&self.events);
            let slot = events.live.get(&event.0).ok_or(DeviceError::UnknownEvent(event))?;
            if !slot.recorded {
                return Ok(());
            }
            slot.raw
        };
        self.bind()?;
        // SAFETY: the handle stays live until the device is dropped, even if the event is
        // destroyed (pooled) meanwhile.
        unsafe { result::event_synchronize(raw) }
    }

    /// `cuCtxSynchronize`.
    fn synchronize(&self) -> Result<(), DeviceError> {
        self.bind()?;
        result::ctx_synchronize()
    }

    /// The device attribute `VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` (and a granularity query that
    /// works).
    /// The context: two `CudaDevice::new(0)` share the device's primary context, so
    /// allocators over either help each other out of memory.
    fn memory_domain(&self) -> Option<u64> {
        Some(self.ctx.cu_ctx() as usize as u64)
    }

    fn supports_virtual_memory(&self) -> bool {
        self.vm_page().is_some()
    }

    fn vm_granularity(&self) -> Result<u64, DeviceError> {
        self.vm_page().ok_or(crate::device::NO_VIRTUAL_MEMORY)
    }

    /// `cuMemAddressReserve`, aligned to the granularity.
    fn vm_reserve(&self, bytes: u64) -> Result<DeviceAddr, DeviceError> {
        let page = self.vm_granularity()?;
        self.bind()?;
        let ptr = result::relaxed_capture_mode(|| result::mem_address_reserve(bytes, page))?;
        lock(&self.vm).ranges.insert(ptr, bytes);
        Ok(DeviceAddr(ptr))
    }

    /// `cuMemAddressFree` of a whole range with nothing mapped in it.
    fn vm_free(&self, base: DeviceAddr, bytes: u64) -> Result<(), DeviceError> {
        let mut vm = lock(&self.vm);
        // Saturating: a range whose end is past the address space is no reservation anyway.
        let end = base.0.saturating_add(bytes);
        let mapped = vm.mappings.keys().any(|&va| base.0 <= va && va < end);
        if vm.ranges.get(&base.0) != Some(&bytes) || mapped {
            return Err(DeviceError::Driver { op: "cuMemAddressFree", code: 1 });
        }
        self.bind()?;
        // SAFETY: `base` is a whole live reservation of this context (checked in `ranges`) with
        // nothing mapped in it (checked in `mappings`); it leaves the table, so it is freed once.
        unsafe { result::mem_address_free(base.0, bytes) }?;
        vm.ranges.remove(&base.0);
        Ok(())
    }

    /// `cuMemCreate` of pinned memory on this device.
    fn vm_create(&self, bytes: u64) -> Result<PhysHandle, DeviceError> {
        self.vm_granularity()?;
        self.bind()?;
        let h = result::relaxed_capture_mode(|| result::mem_create(bytes, self.ordinal_c()))?;
        lock(&self.vm).handles.insert(h, bytes);
        Ok(PhysHandle(h))
    }

    /// `cuMemRelease`; the memory goes once its mappings are gone.
    fn vm_release(&self, handle: PhysHandle) -> Result<(), DeviceError> {
        let mut vm = lock(&self.vm);
        if !vm.handles.contains_key(&handle.0) {
            return Err(DeviceError::Driver { op: "cuMemRelease", code: 400 });
        }
        self.bind()?;
        // SAFETY: a live handle of this device (checked in `handles`), released once: it leaves
        // the table. Mappings of it keep its memory alive until they are unmapped.
        unsafe { result::mem_release(handle.0) }?;
        vm.handles.remove(&handle.0);
        Ok(())
    }

    /// `cuMemMap` + `cuMemSetAccess` (read/write from this device).
    fn vm_map(&self, va: DeviceAddr, bytes: u64, handle: PhysHandle) -> Result<(), DeviceError> {
        let mut vm = lock(&self.vm);
        // An end past the address space lies in no reservation: an error, not an overflow.
        let end = va.0.checked_add(bytes);
        let end_in = |b: u64, n: u64| end.is_some_and(|e| e <= b + n);
        let in_range = vm.ranges.iter().any(|(&b, &n)| b <= va.0 && end_in(b, n));
        let e = end.unwrap_or(u64::MAX);
        let overlaps = vm.mappings.iter().any(|(&a, &(n, _))| a < e && va.0 < a + n);
        let sized = vm.handles.get(&handle.0) == Some(&bytes);
        if !in_range || overlaps || !sized {
            return Err(DeviceError::Driver { op: "cuMemMap", code: 1 });
        }
        self.bind()?;
        result::relaxed_capture_mode(|| {
            // SAFETY: `[va, va + bytes)` lies in a live reservation of this context with nothing
            // mapped there (both checked above, under the table's lock), and `handle` is a live
            // allocation of exactly `bytes` (checked in `handles`).
            unsafe { result::mem_map(va.0, bytes, handle.0, self.ordinal_c()) }
        })?;
        vm.mappings.insert(va.0, (bytes, handle.0));
        Ok(())
    }

    /// `cuMemUnmap` of one whole mapping; the caller made sure no unfinished work uses it.
    fn vm_unmap(&self, va: DeviceAddr, bytes: u64) -> Result<(), DeviceError> {
        let mut vm = lock(&self.vm);
        if vm.mappings.get(&va.0).map(|m| m.0) != Some(bytes) {
            return Err(DeviceError::Driver { op: "cuMemUnmap", code: 1 });
        }
        self.bind()?;
        // SAFETY: `[va, va + bytes)` is exactly one live mapping of this context (checked in
        // `mappings`), unmapped once (it leaves the table); the trait's contract makes the caller
        // order it after every use (the allocator waits for the stream's events first).
        unsafe { result::mem_unmap(va.0, bytes) }?;
        vm.mappings.remove(&va.0);
        Ok(())
    }

    /// `cuMemHostAlloc` (default flags).
    fn host_alloc(&self, bytes: u64) -> Result<HostPtr, DeviceError> {
        if bytes == 0 {
            return Err(DeviceError::Unsupported("allocating 0 bytes of pinned host memory"));
        }
        self.bind()?;
        let ptr = result::mem_host_alloc(bytes)?;
        lock(&self.host).insert(ptr.addr(), (ptr, bytes));
        Ok(ptr)
    }

    /// The host's physical memory (Linux: `MemTotal` in `/proc/meminfo`): `cuMemHostAlloc`
    /// page-locks physical pages, so no more can ever be pinned. Unknown elsewhere.
    fn host_capacity(&self) -> Option<u64> {
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let total = info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
        let kib: u64 = total.trim().strip_suffix("kB")?.trim().parse().ok()?;
        kib.checked_mul(1024)
    }

    /// Synchronises the context (as [`Device::release`] does), then `cuMemFreeHost`. An error for
    /// a pointer this device did not allocate.
    unsafe fn host_free(&self, ptr: HostPtr) -> Result<(), DeviceError> {
        let unknown = DeviceError::UnknownSegment(DeviceAddr(ptr.addr() as u64));
        let entry = lock(&self.host).remove(&ptr.addr()).ok_or(unknown)?;
        let freed = self.bind().and_then(|()| result::ctx_synchronize()).and_then(|()| {
            // SAFETY: a live pinned allocation of this device (just taken out of the table, so
            // freed once); the context is idle, and the caller promised no host use remains.
            unsafe { result::mem_free_host(ptr) }
        });
        if freed.is_err() {
            lock(&self.host).insert(ptr.addr(), entry);
        }
        freed
    }

    /// `cuMemcpyHtoDAsync` on the stream's cudarc stream.
    unsafe fn memcpy_htod_async(
        &self,
        dst: DeviceAddr,
        src: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let (s, n) = self.copy_args(src, bytes, stream)?;
        // SAFETY: the caller guarantees the host range is pinned memory of this device kept
        // valid and unwritten until the copy completed, and the device range is live memory of
        // this context; `s` is a live stream of this context, kept alive by the `Arc` we hold.
        unsafe { result::memcpy_htod_async(dst.0, src, n, s.cu_stream()) }
    }

    /// `cuMemcpyDtoHAsync` on the stream's cudarc stream.
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: HostPtr,
        src: DeviceAddr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let (s, n) = self.copy_args(dst, bytes, stream)?;
        // SAFETY: as in `memcpy_htod_async`, and the host leaves the range alone until then.
        unsafe { result::memcpy_dtoh_async(dst, src.0, n, s.cu_stream()) }
    }
}
