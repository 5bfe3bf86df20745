//! `HostBackend`: the op interface as host kernels on any device that runs them ([`Launch`]) — on
//! [`tidepool::SimDevice`], each op becomes a [`Kernel`] run later by the stream's worker thread, so
//! ops really are asynchronous, and its declared accesses ([`KernelOp::accesses`]) let the
//! stream-order sanitizer check every use of memory.
//!
//! ```text
//!   launch(stream, op) ─▶ Kernel { name: op.name(), accesses: op.accesses(),
//!                                  body: move |mem| math::execute(&op, mem) } ─▶ device queue
//!   upload(stream, dst, data) ─▶ pinned staging buffer (HostAllocator) ─▶ memcpy_htod_async
//!                                + event; the block is reused once the copy ran
//!   download(stream, src, n) ─▶ read kernel → slot; event recorded after it; host waits on it
//! ```
//!
//! The arithmetic lives in [`math`].

pub mod math;

use super::backend::{Backend, ELEM, KernelOp};
use super::error::{EagerError, Result};
use std::sync::{Arc, Mutex};
use tidepool::HostAllocator;
use tidepool::device::{Access, AccessKind, DeviceAddr, Kernel, Launch, SimDevice, StreamId};

/// Eager ops as host kernels on a device that runs them ([`SimDevice`] by default).
pub struct HostBackend<D: Launch = SimDevice> {
    device: Arc<D>,
    pinned: HostAllocator<D>,
}

impl<D: Launch> HostBackend<D> {
    /// A back end launching host kernels on `device`. The device must be backed by memory the
    /// kernels can read and write ([`SimDevice::backed`]).
    pub fn new(device: Arc<D>) -> HostBackend<D> {
        HostBackend { pinned: HostAllocator::new(device.clone()), device }
    }

    /// The pinned host allocator uploads stage through (where the device has pinned memory;
    /// otherwise uploads copy through a kernel).
    ///
    /// ```
    /// use tidepool::StreamId;
    /// use tidepool_eager::{Eager, Tensor};
    ///
    /// let eager = Eager::sim(16 << 20).unwrap();
    /// for _ in 0..3 {
    ///     let cx = eager.ctx(StreamId::DEFAULT);
    ///     let x = cx.tensor(&[1.0; 100], &[100]).unwrap();
    ///     assert_eq!(x.to_host().unwrap(), vec![1.0; 100]);
    /// }
    /// let stats = eager.backend().host_allocator().stats();
    /// assert_eq!(stats.num_host_alloc, 1); // one 512-byte pinned block, reused
    /// ```
    pub fn host_allocator(&self) -> &HostAllocator<D> {
        &self.pinned
    }
}

impl<D: Launch> Backend for HostBackend<D> {
    type Device = D;

    fn device(&self) -> &Arc<D> {
        &self.device
    }

    fn name(&self) -> String {
        format!("host kernels on {}", self.device.name())
    }

    /// Through a pinned staging buffer where the device has pinned memory (SimDevice does) and
    /// a block for it can be had, else through a kernel carrying a copy of the data.
    fn upload(&self, stream: StreamId, dst: DeviceAddr, data: &[f32]) -> Result<()> {
        if super::pinned::upload(&self.pinned, stream, dst, data)? {
            return Ok(());
        }
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        let access = Access { ptr: dst, bytes: bytes.len() as u64, kind: AccessKind::Write };
        let kernel = Kernel::new("upload", vec![access], move |mem| {
            mem.write(dst, &bytes).expect("upload outside its declared memory");
        });
        Ok(self.device.launch(stream, kernel)?)
    }

    fn download(&self, stream: StreamId, src: DeviceAddr, len: usize) -> Result<Vec<f32>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        type Slot = Arc<Mutex<Option<std::result::Result<Vec<f32>, tidepool::DeviceError>>>>;
        let slot: Slot = Arc::new(Mutex::new(None));
        let out = slot.clone();
        let access = Access { ptr: src, bytes: len as u64 * ELEM, kind: AccessKind::Read };
        // The read's error comes back to the caller (an unbacked device says how to get a
        // backed one), not only to the device's record of failed kernels.
        let kernel = Kernel::new("download", vec![access], move |mem| {
            let data = math::try_read(mem, src, len);
            *out.lock().unwrap_or_else(|p| p.into_inner()) = Some(data);
        });
        self.device.launch(stream, kernel)?;
        let event = self.device.create_event()?;
        let waited = self
            .device
            .record_event(event, stream)
            .and_then(|()| self.device.synchronize_event(event));
        let _ = self.device.destroy_event(event);
        waited?;
        let data = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        let failed = |why: String| {
            EagerError::Backend(format!("download of {len} floats at {src} failed{why}"))
        };
        match data {
            Some(Ok(data)) => Ok(data),
            Some(Err(e)) => Err(failed(format!(": {e}"))),
            None => Err(failed(String::new())),
        }
    }

    fn launch(&self, stream: StreamId, op: &KernelOp) -> Result<()> {
        let op = *op;
        let kernel = Kernel::new(op.name(), op.accesses(), move |mem| math::execute(&op, mem));
        Ok(self.device.launch(stream, kernel)?)
    }
}
