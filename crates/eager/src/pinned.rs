//! Host-to-device uploads through pinned staging buffers: the values are written into a
//! [`PinnedBuffer`](tidepool::PinnedBuffer) from the back end's [`HostAllocator`], copied to the
//! device asynchronously on the upload's stream (an event recorded after the copy), and the
//! buffer goes back to the cache at once — its block is reused only once that copy completed.
//!
//! ```text
//!   upload(stream, dst, data) ─▶ pinned.alloc(4·n) ─▶ as_mut_slice ← data (little endian)
//!                             ─▶ copy_to_device(dst, stream) + event ─▶ drop (pending until done)
//! ```

use super::backend::ELEM;
use super::error::Result;
use tidepool::device::{Device, DeviceAddr, DeviceError, StreamId};
use tidepool::{HostAllocError, HostAllocator};

/// Uploads `data` to `dst` on `stream` through `pinned`. `Ok(false)` (nothing done) where the
/// device has no pinned host memory, or none left for a staging block of this size, so the
/// caller falls back to its own copy (from pageable memory): staging is an optimisation the
/// caller did not ask for, and running out of page-locked memory (a locked-memory limit, a
/// host short of memory, a one-off upload larger than what can be pinned) must not fail an
/// upload the device can take. (While a CUDA-graph capture is underway, the error: a copy from
/// pageable memory cannot be captured, nor safely made beside a capture.) A copy enqueued whose
/// event could not be recorded is waited for before this returns, so its block is reusable.
///
/// `dst` must be device memory of `pinned`'s device holding at least `data.len()` floats that
/// stays allocated until the copy ran: the [`crate::Backend::upload`] contract (the caller's
/// tensor, freed in its stream's order).
pub(crate) fn upload<D: Device>(
    pinned: &HostAllocator<D>,
    stream: StreamId,
    dst: DeviceAddr,
    data: &[f32],
) -> Result<bool> {
    if data.is_empty() {
        return Ok(true);
    }
    let bytes = data.len() as u64 * ELEM;
    let mut staging = match pinned.alloc(bytes) {
        Ok(b) => b,
        Err(HostAllocError::Device(DeviceError::Unsupported(_))) => return Ok(false),
        // Not while a capture is underway: a copy from pageable memory cannot be captured, and
        // in CUDA's global capture mode one on any stream may be refused as unsafe, a refusal
        // that invalidates the capture; the error stays.
        // BROKEN (`pinned_oom_fails_upload`): the upload failed with the pinned allocator's
        // out-of-memory error wherever it ran.
        Err(HostAllocError::OutOfMemory { .. })
            if !pinned.device().capture_underway()
                && !cfg!(tidepool_broken = "pinned_oom_fails_upload") =>
        {
            return Ok(false);
        }
        Err(e) => return Err(e.into()),
    };
    for (out, x) in staging.as_mut_slice()?.chunks_exact_mut(ELEM as usize).zip(data) {
        out.copy_from_slice(&x.to_le_bytes());
    }
    // SAFETY: `dst` holds at least `data.len()` floats of this device's memory that stays
    // allocated until the copy ran — the `Backend::upload` contract (the caller's live tensor,
    // whose memory is reused only in its stream's order, and the copy is on that stream).
    let copied = unsafe { staging.copy_to_device(0, dst, bytes, stream) };
    if let Err(e) = copied {
        // Nothing enqueued (no use recorded): the error, the block back in the cache at once.
        // BROKEN (`staging_record_failure_pending`): the error for a failed event record too,
        // the block left pending until something synchronised the pinned allocator (its
        // `empty_cache`): the eager layer's own synchronisations never told it, so every later
        // upload of the class pinned a new block beside it.
        if staging.pending_streams().is_empty()
            || cfg!(tidepool_broken = "staging_record_failure_pending")
        {
            return Err(e.into());
        }
        // The copy was enqueued but its event could not be recorded: wait for it now (a
        // device synchronisation through the pinned allocator, counted in its host syncs), so
        // the block goes back to the cache reusable and the upload stands. Where that wait
        // fails too, the error, and the block stays pending (never reused before a later
        // synchronisation proved the copy done).
        staging.synchronize().map_err(|_| e)?;
    }
    Ok(true)
}
