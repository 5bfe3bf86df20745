//! [`PinnedBuffer`]: one block of pinned host memory from a [`HostAllocator`], with the copies
//! recorded on it.

use super::{HostAllocError, HostAllocator, Use};
use crate::allocator::{Buffer, ScopedBuffer};
use crate::device::{AccessKind, Device, DeviceAddr, HostPtr, StreamId};
use crate::sync::Arc;
use std::fmt;

/// A pinned host buffer of [`PinnedBuffer::len`] bytes (zeroed when its block was first
/// allocated; a reused block keeps its last bytes). Its block goes back to the allocator's cache
/// when it is dropped, and is reused only after every copy recorded on it completed.
///
/// Safe access: a copy needs `&mut self`, so no slice of the buffer is alive while one is
/// enqueued; [`PinnedBuffer::as_slice`] first waits for the copies that write the buffer,
/// [`PinnedBuffer::as_mut_slice`] for every copy. A buffer that work captured into a CUDA graph
/// copies to or from gives no slice at all (see [`PinnedBuffer::record_use`]). `Send + Sync`.
///
/// ```
/// use std::sync::Arc;
/// use tidepool::{Allocator, Config, HostAllocator, SimDevice, StreamId};
///
/// let dev = Arc::new(SimDevice::backed(16 << 20));
/// let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
/// let pinned = HostAllocator::new(dev.clone());
/// let gpu = alloc.alloc(8, StreamId::DEFAULT).unwrap();
///
/// let mut host = pinned.alloc(8).unwrap();
/// host.as_mut_slice().unwrap().copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
/// host.upload(&gpu).unwrap();                 // enqueued; an event recorded after it
/// assert_eq!(host.pending_streams(), vec![StreamId::DEFAULT]);
/// host.as_mut_slice().unwrap().fill(0);       // waits for the upload first
/// host.download(&gpu).unwrap();
/// assert_eq!(host.as_slice().unwrap(), &[1, 2, 3, 4, 5, 6, 7, 8]);
/// ```
pub struct PinnedBuffer<D: Device> {
    alloc: HostAllocator<D>,
    ptr: HostPtr,
    len: u64,
    size: u64,
    /// Copies recorded on the block and not known complete: at most one per stream (a later
    /// copy's event on the same stream completes after an earlier one's).
    uses: Vec<Use>,
    /// Work captured into a CUDA graph copies to or from the buffer: the graph's replays use
    /// it whenever they run (see [`PinnedBuffer::record_use`]). The capture, by the stream it
    /// began on.
    captured: Option<StreamId>,
}

/// What a buffer that one capture's copies use refuses in another: two graphs' replays could
/// copy at once, unordered.
const CAPTURED_ELSEWHERE: HostAllocError = HostAllocError::Captured {
    reason: "another capture's copies already use it: two graphs' replays could copy to or \
             from it at once",
};

/// What a buffer that captured work uses refuses ([`HostAllocError::Captured`]).
const CAPTURED: HostAllocError = HostAllocError::Captured {
    reason: "work captured into a CUDA graph copies to or from it: its replays may use it at \
             any time (write it through `host_ptr`, unsafe, between replays)",
};

impl<D: Device> fmt::Debug for PinnedBuffer<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("block_size", &self.size)
            .field("pending_streams", &self.pending_streams())
            .finish()
    }
}

impl<D: Device> PinnedBuffer<D> {
    pub(super) fn new(alloc: HostAllocator<D>, ptr: HostPtr, len: u64, size: u64) -> Self {
        PinnedBuffer { alloc, ptr, len, size, uses: Vec::new(), captured: None }
    }

    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the buffer has no bytes (never: zero-byte requests are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of its block (the size class).
    pub fn block_size(&self) -> u64 {
        self.size
    }

    /// The address of the buffer, for copies made outside tidepool (cudarc, say): dereferencing
    /// it is `unsafe`, and such a copy must be recorded with [`PinnedBuffer::record_use`].
    pub fn host_ptr(&self) -> HostPtr {
        self.ptr
    }

    /// The allocator it came from (and returns to).
    pub fn allocator(&self) -> &HostAllocator<D> {
        &self.alloc
    }

    /// Streams with a copy recorded on the buffer that is not known to have completed (in the
    /// order first recorded). Empty after [`PinnedBuffer::synchronize`] or
    /// [`PinnedBuffer::as_mut_slice`].
    pub fn pending_streams(&self) -> Vec<StreamId> {
        self.uses.iter().map(|u| u.stream).collect()
    }

    /// Whether every copy recorded on the buffer has completed. Never blocks. Never, for a
    /// buffer that captured work uses.
    pub fn is_ready(&self) -> Result<bool, HostAllocError> {
        if self.captured.is_some() {
            return Ok(false);
        }
        let inner = self.alloc.inner();
        for u in &self.uses {
            if !inner.use_complete(u)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Blocks until every copy recorded on the buffer has completed (a host sync when one has
    /// not), and forgets them.
    pub fn synchronize(&mut self) -> Result<(), HostAllocError> {
        if self.captured.is_some() {
            return Err(CAPTURED);
        }
        let inner = self.alloc.inner();
        for u in &self.uses {
            inner.wait_use(u)?;
        }
        inner.recycle(self.uses.drain(..));
        Ok(())
    }

    /// The bytes, once every copy that writes them (device to host) has completed: waits for
    /// those first. Copies that only read the buffer may still run (reads do not conflict).
    pub fn as_slice(&self) -> Result<&[u8], HostAllocError> {
        if self.captured.is_some() {
            return Err(CAPTURED);
        }
        let inner = self.alloc.inner();
        for u in self.uses.iter().filter(|u| u.writes_host) {
            inner.wait_use(u)?;
        }
        inner.device().note_host_access(self.ptr, self.len, AccessKind::Read);
        // SAFETY: the block is `len` (≤ its size) bytes of pinned memory owned by this buffer
        // alone (the allocator hands a block to one buffer at a time and frees none while it is
        // handed out; the buffer keeps the allocator, which keeps the device, alive). Its bytes
        // are initialised (zeroed when allocated; copies write whole bytes). Every copy that
        // writes it has completed (waited for just above), and none can be enqueued while the
        // returned borrow of `self` lives (copies take `&mut self`), so nothing writes the bytes
        // during the borrow.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len as usize) })
    }

    /// The bytes for writing, once every copy recorded on the buffer has completed: waits for
    /// them first (see [`PinnedBuffer::synchronize`]).
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], HostAllocError> {
        self.synchronize()?;
        self.alloc.inner().device().note_host_access(self.ptr, self.len, AccessKind::Write);
        // SAFETY: as in `as_slice`; moreover no copy recorded on the block is unfinished (all
        // waited for above), and `&mut self` excludes every other borrow and every new copy for
        // the life of the returned slice.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len as usize) })
    }

    /// Enqueues a copy of `bytes` bytes at `offset` of this buffer to device memory at `dst`, on
    /// `stream`, and records it (an event after it). Returns at once; the buffer may be dropped
    /// at once (its block waits for the copy). The copy is ordered after this buffer's copies to
    /// the host on other streams (on the device). An error after the copy was enqueued (the
    /// event could not be recorded) leaves the use recorded without an event: it then counts as
    /// complete only after a later device synchronisation.
    ///
    /// # Safety
    /// `[dst, dst + bytes)` is device memory of this allocator's device that stays allocated
    /// until the copy has run (a tidepool [`Buffer`] used on `stream`, or on a stream `stream`
    /// waits for, is; [`PinnedBuffer::upload`] is the checked form).
    pub unsafe fn copy_to_device(
        &mut self,
        offset: u64,
        dst: DeviceAddr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), HostAllocError> {
        // SAFETY: the caller's promise about `dst`, passed on.
        unsafe { self.copy(offset, dst, bytes, stream, true) }
    }

    /// Enqueues a copy of `bytes` bytes of device memory at `src` into this buffer at `offset`,
    /// on `stream`, and records it. Returns at once; [`PinnedBuffer::as_slice`] waits for it. The
    /// copy is ordered after this buffer's other copies on other streams (on the device).
    ///
    /// # Safety
    /// `[src, src + bytes)` is device memory of this allocator's device that stays allocated
    /// until the copy has run ([`PinnedBuffer::download`] is the checked form).
    pub unsafe fn copy_from_device(
        &mut self,
        offset: u64,
        src: DeviceAddr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), HostAllocError> {
        // SAFETY: the caller's promise about `src`, passed on.
        unsafe { self.copy(offset, src, bytes, stream, false) }
    }

    /// Copies the whole buffer to the start of `dst`, on `dst`'s stream (so the copy runs before
    /// `dst`'s memory is reused by anyone), and records it. The copy is a write of `dst` as
    /// [`Buffer::use_on`] has it: after the uses of `dst` announced on other streams (their
    /// kernels may still read or write it). An error, copying nothing, when `dst` is shorter
    /// than this buffer or on another device.
    pub fn upload(&mut self, dst: &Buffer<D>) -> Result<(), HostAllocError> {
        self.check_buffer(dst)?;
        device_use(dst, AccessKind::Write)?;
        // SAFETY: `dst` is a live buffer of this device (checked) holding at least `len` bytes;
        // its memory is reused only in its stream's order (or after events on other streams),
        // and the copy is enqueued on its stream, so the memory stays allocated until it ran.
        unsafe { self.copy(0, dst.ptr(), self.len, dst.stream(), true) }
    }

    /// Copies the first [`PinnedBuffer::len`] bytes of `src` into this buffer, on `src`'s
    /// stream, and records it. The copy is a read of `src` as [`Buffer::use_on`] has it: after
    /// the last write of `src` announced on another stream. An error, copying nothing, when
    /// `src` is shorter or on another device.
    pub fn download(&mut self, src: &Buffer<D>) -> Result<(), HostAllocError> {
        self.check_buffer(src)?;
        device_use(src, AccessKind::Read)?;
        // SAFETY: as in `upload`.
        unsafe { self.copy(0, src.ptr(), self.len, src.stream(), false) }
    }

    /// [`PinnedBuffer::upload`] into a buffer of a [`Scope`](crate::Scope) (an activation of a
    /// step, say): the whole buffer to the start of `dst`, on the scope's stream, recorded. A
    /// scope's memory is reused in its stream's order, so the copy runs before anyone else gets
    /// it. A scope's buffer keeps no cross-stream order of its own ([`ScopedBuffer::record_stream`]
    /// is PyTorch's: the use is held, not ordered), so work on other streams that uses `dst`
    /// must be ordered around the copy by the caller, as around a kernel on the scope's stream.
    /// An error, copying nothing, when `dst` is shorter or on another device, or while its stream
    /// is being captured into a CUDA graph (scopes take no part in captures).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, HostAllocator, SimDevice, StreamId};
    ///
    /// let dev = Arc::new(SimDevice::backed(16 << 20));
    /// let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    /// let pinned = HostAllocator::new(dev.clone());
    /// let scope = alloc.named_scope("step", StreamId::DEFAULT);
    /// let x = scope.alloc(8).unwrap();
    /// let mut host = pinned.alloc(8).unwrap();
    /// host.as_mut_slice().unwrap().copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    /// host.upload_scoped(&x).unwrap();
    /// let mut back = pinned.alloc(8).unwrap();
    /// back.download_scoped(&x).unwrap();
    /// assert_eq!(back.as_slice().unwrap(), &[1, 2, 3, 4, 5, 6, 7, 8]); // waits for the copy
    /// ```
    pub fn upload_scoped(&mut self, dst: &ScopedBuffer<'_, D>) -> Result<(), HostAllocError> {
        self.check_scoped(dst)?;
        // SAFETY: `dst` is a live buffer of a scope of this device (checked) holding at least
        // `len` bytes; a scope's memory is reused only in its stream's order (its next
        // allocation, or the pool's after the scope's exit, which waits for the other streams
        // it was recorded on), and the copy is enqueued on that stream, so the memory stays
        // allocated until it ran.
        unsafe { self.copy(0, dst.ptr(), self.len, dst.stream(), true) }
    }

    /// [`PinnedBuffer::download`] from a buffer of a [`Scope`](crate::Scope): its first
    /// [`PinnedBuffer::len`] bytes into this buffer, on the scope's stream, recorded (see
    /// [`PinnedBuffer::upload_scoped`] for the order with other streams and the errors).
    pub fn download_scoped(&mut self, src: &ScopedBuffer<'_, D>) -> Result<(), HostAllocError> {
        self.check_scoped(src)?;
        // SAFETY: as in `upload_scoped`.
        unsafe { self.copy(0, src.ptr(), self.len, src.stream(), false) }
    }

    /// What `upload_scoped` / `download_scoped` check before copying.
    fn check_scoped(&self, buf: &ScopedBuffer<'_, D>) -> Result<(), HostAllocError> {
        // BROKEN (`scoped_copies_refused`): as before there was a safe copy for a scope's
        // buffer (the only way was `unsafe copy_to_device`).
        if cfg!(tidepool_broken = "scoped_copies_refused") {
            return Err(HostAllocError::Device(crate::DeviceError::Unsupported(
                "copies to or from a scope's buffer",
            )));
        }
        if !Arc::ptr_eq(buf.device(), self.alloc.device()) {
            return Err(HostAllocError::WrongDevice);
        }
        if buf.len() < self.len {
            return Err(HostAllocError::OutOfRange { offset: 0, bytes: self.len, len: buf.len() });
        }
        if self.alloc.inner().device().capture_of(buf.stream()).is_some() {
            return Err(HostAllocError::Captured {
                reason: "a copy to or from a scope's buffer on a capturing stream (scopes take \
                         no part in captures)",
            });
        }
        Ok(())
    }

    /// Records a use of the buffer by work the caller enqueued on `stream` through
    /// [`PinnedBuffer::host_ptr`] (a cudarc copy, say): `Read` for work that reads the buffer
    /// (host to device), `Write` for work that writes it. The block then waits for it like for
    /// tidepool's own copies. On an error the use still counts, as complete only after a later
    /// device synchronisation.
    ///
    /// On a stream being captured into a CUDA graph the work is a node of the graph, run again
    /// at every replay, so the buffer becomes the graph's staging memory: from then on it gives
    /// no slice and takes no copy outside the capture ([`HostAllocError::Captured`]), and once
    /// dropped its block is never reused nor freed (`HostStats::captured_bytes`; PyTorch keeps
    /// pinned memory used in a capture the same way). The same holds for the copies below when
    /// their stream is capturing (a copy is then a node of the graph).
    pub fn record_use(&mut self, stream: StreamId, kind: AccessKind) -> Result<(), HostAllocError> {
        if let Some(origin) = self.alloc.inner().device().capture_of(stream) {
            // The work is enqueued already: the buffer is the graph's whatever the answer.
            let first = *self.captured.get_or_insert(origin);
            return if first == origin { Ok(()) } else { Err(CAPTURED_ELSEWHERE) };
        }
        let (u, recorded) = self.alloc.inner().record_use(stream, kind == AccessKind::Write);
        self.add_use(u);
        Ok(recorded?)
    }

    fn check_buffer(&self, buf: &Buffer<D>) -> Result<(), HostAllocError> {
        if !Arc::ptr_eq(buf.device(), self.alloc.device()) {
            return Err(HostAllocError::WrongDevice);
        }
        if buf.len() < self.len {
            return Err(HostAllocError::OutOfRange { offset: 0, bytes: self.len, len: buf.len() });
        }
        Ok(())
    }

    /// Adds a use, superseding the older use on the same stream (its event returns to the pool).
    fn add_use(&mut self, u: Use) {
        match self.uses.iter_mut().find(|old| old.stream == u.stream) {
            Some(old) => {
                let superseded = *old;
                *old = Use { writes_host: u.writes_host || superseded.writes_host, ..u };
                self.alloc.inner().recycle([superseded]);
            }
            None => self.uses.push(u),
        }
    }

    /// The copy behind `copy_to_device` / `copy_from_device`.
    ///
    /// # Safety
    /// As `copy_to_device` (the device range stays allocated until the copy has run).
    unsafe fn copy(
        &mut self,
        offset: u64,
        dev: DeviceAddr,
        bytes: u64,
        stream: StreamId,
        to_device: bool,
    ) -> Result<(), HostAllocError> {
        let out_of_range = HostAllocError::OutOfRange { offset, bytes, len: self.len };
        if offset.checked_add(bytes).is_none_or(|end| end > self.len) {
            return Err(out_of_range);
        }
        if bytes == 0 {
            return Ok(());
        }
        let writes_host = !to_device;
        let inner = self.alloc.inner();
        let origin = inner.device().capture_of(stream);
        let capturing = origin.is_some();
        // BROKEN (`captured_elsewhere`): a second capture copies it too.
        if capturing
            && self.captured.is_some_and(|c| Some(c) != origin)
            && !cfg!(tidepool_broken = "captured_elsewhere")
        {
            return Err(CAPTURED_ELSEWHERE);
        }
        if capturing && !self.uses.is_empty() {
            return Err(HostAllocError::Captured {
                reason: "a copy on a capturing stream of a buffer with copies not known \
                         complete (synchronize it before the capture)",
            });
        }
        if self.captured.is_some() && !capturing {
            return Err(CAPTURED);
        }
        // Two copies on different streams never touch the same host bytes unordered when one
        // of them writes them.
        for u in self.uses.iter().filter(|u| u.stream != stream && (writes_host || u.writes_host)) {
            inner.order_after(stream, u)?;
        }
        let host = self.ptr.offset(offset as usize).ok_or(out_of_range)?;
        let device = inner.device();
        // SAFETY: host side: `[host, host + bytes)` lies in this buffer's block (range checked),
        // pinned memory of this device that stays allocated until the use recorded below has
        // completed (the allocator reuses or frees a block only then). No host access overlaps
        // the copy: `&mut self` excludes live slices now, and the accessors wait for this use
        // before making new ones. Copies of this buffer on other streams that conflict were
        // ordered before it just above. Device side: the caller's promise.
        let enqueued = unsafe {
            if to_device {
                device.memcpy_htod_async(dev, host, bytes, stream)
            } else {
                device.memcpy_dtoh_async(host, dev, bytes, stream)
            }
        };
        enqueued?;
        if capturing {
            // A node of the graph: each replay copies again; no event can be recorded.
            self.captured = origin;
            return Ok(());
        }
        let (u, recorded) = inner.record_use(stream, writes_host);
        self.add_use(u);
        Ok(recorded?)
    }
}

/// Announces the copy's use of `buf` on its own stream ([`Buffer::use_on`]): the stream waits
/// for the uses announced on other streams that the copy conflicts with, and later uses on
/// other streams wait for the copy. Nothing when no other stream used `buf`. Before, `upload`
/// and `download` skipped it: a download read a buffer while a kernel announced on another
/// stream still wrote it, and an upload wrote it under a kernel still reading it.
fn device_use<D: Device>(buf: &Buffer<D>, access: AccessKind) -> Result<(), HostAllocError> {
    if cfg!(tidepool_broken = "pinned_copy_unannounced") {
        return Ok(()); // BROKEN: the copy takes no part in the buffer's cross-stream order
    }
    buf.use_on(buf.stream(), access).map_err(|e| match e {
        crate::AllocError::Device(e) => HostAllocError::Device(e),
        crate::AllocError::UnknownStream(s) => {
            HostAllocError::Device(crate::DeviceError::UnknownStream(s))
        }
        other => HostAllocError::Device(crate::DeviceError::Unavailable(other.to_string())),
    })
}

impl<D: Device> Drop for PinnedBuffer<D> {
    /// Gives the block back: reusable at once if no copy was recorded on it, else once every
    /// recorded copy completed.
    fn drop(&mut self) {
        let uses = std::mem::take(&mut self.uses);
        match self.captured {
            Some(_) => self.alloc.inner().retire(self.ptr, self.len, self.size, uses),
            None => self.alloc.inner().give_back(self.ptr, self.len, self.size, uses),
        }
    }
}
