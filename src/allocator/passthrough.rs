//! Caching off (`caching:false`, PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING=1`): every
//! allocation reserves a segment of its own block size and every free returns it to the device,
//! so a device-side memory checker (or SimDevice's sanitizer) sees every access to freed memory.
//!
//! ```text
//!  alloc ─▶ no stream cache, no free block to find ─▶ reserve(rounded)          one device call
//!  free  ─▶ (uses on other streams: wait for their events, counted host syncs)
//!        ─▶ pool ─▶ the lock is let go: every free segment released             one device call
//! ```
//!
//! The stream caches are off (`Config::fast_path`), scopes neither learn plans nor reuse
//! blocks locally, and the release happens where statistics are published (`publish.rs`),
//! so every path that frees into the pool returns the memory before the lock is let go.

use super::*;

impl<D: Device> Shared<D> {
    /// Returns every ordinary segment that holds no busy block to the device. A device that
    /// refuses leaves the segment cached (tried again at the next release).
    pub(super) fn release_free_segments(&self, st: &mut State) {
        if self.device.capture_underway() {
            return; // cuMemFree is illegal during a stream capture: released at a later free
        }
        // (An initial pool, kept from a configuration before `set_config(caching:false)`,
        // stays: it is kept until the allocator goes.)
        let (vm, initial) = (&st.vm, st.initial);
        for seg in st.pool.releasable_segments(|s| !vm.contains(s.base) && Some(s.base) != initial)
        {
            if self.release_segment(st, seg).is_err() {
                break;
            }
        }
    }
}
