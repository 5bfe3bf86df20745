//! The memory history's calls (PyTorch's `_record_memory_history` and its readers): start or
//! stop recording, metadata, annotations, the entries and an allocation's traceback.

use super::*;

impl<D: Device> Allocator<D> {
    /// Starts (or, with `max_entries` 0, stops) recording the memory history, PyTorch's
    /// `torch.cuda.memory._record_memory_history(max_entries=…, context=…, skip_actions=…,
    /// clear_history=…)`: a ring of the last `max_entries` allocations, frees (requested and
    /// completed), segment reserves and releases and out-of-memory errors, each with its size,
    /// address, stream, time, the user's metadata ([`Allocator::set_memory_metadata`]) and, at
    /// the [`HistoryContext`] level asked for, the Rust stack. Starting
    /// again while recording keeps the entries (unless `clear_history`) and applies the new
    /// options from then on; stopping forgets them. [`Allocator::dump_snapshot`] writes it out.
    ///
    /// The history is the family's, as PyTorch's is the device's: the allocator's private pools
    /// ([`MemPool`], CUDA graphs' pools), those made later included, record into the same
    /// ring, each entry tagged with its [`TraceEntry::pool_id`].
    ///
    /// While recording, every allocation and free takes the slow path (the stream caches are
    /// bypassed), so the entries are complete and in order; scopes opened while recording
    /// neither follow nor learn plans and keep no local cache, so their allocations and frees
    /// are recorded too, and a named scope's run is a range of the history
    /// ([`Allocator::annotations`]). Off (the default), recording costs the hot path one
    /// relaxed load.
    pub fn record_history(&self, options: HistoryOptions) {
        let family = &self.shared.family;
        // The family's slot is held throughout, so that a pool made meanwhile (`new_pool`,
        // which taps the ring under the same slot) records exactly when the others do.
        let mut slot = lock(&family.history);
        let ring = match (options.max_entries > 0, slot.ring.take()) {
            (false, _) => None,
            (true, Some(ring)) if !options.clear_history => {
                lock(&ring).rearm(options);
                Some(ring)
            }
            (true, _) => Some(Arc::new(Mutex::new(history::History::new(
                options,
                slot.user_metadata.clone(),
            )))),
        };
        slot.ring = ring.clone();
        let general = (self.shared.role.id == 0).then(|| self.shared.clone());
        // BROKEN (`pools_unrecorded`): the general allocator alone records, as before the
        // history was the family's; a pool's allocations are missing from the trace.
        let pools = if cfg!(tidepool_broken = "pools_unrecorded") {
            Vec::new()
        } else {
            family.live_pools()
        };
        for sh in general.into_iter().chain(pools.into_iter().map(|(_, p)| p)) {
            sh.tap_history(ring.clone());
        }
    }

    /// Stamps `metadata` on every history entry made from now on (PyTorch's
    /// `torch.cuda.memory._set_memory_metadata`); an empty string stamps nothing. It stays set
    /// across [`Allocator::record_history`] calls.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, HistoryOptions, SimDevice, StreamId};
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    /// alloc.record_history(HistoryOptions::new(100));
    /// alloc.set_memory_metadata("step 3");
    /// drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap());
    /// assert!(alloc.history().iter().all(|e| &*e.user_metadata == "step 3"));
    /// ```
    pub fn set_memory_metadata(&self, metadata: &str) {
        let mut slot = lock(&self.shared.family.history);
        slot.user_metadata = std::sync::Arc::from(metadata);
        if let Some(ring) = &slot.ring {
            lock(ring).set_user_metadata(slot.user_metadata.clone());
        }
    }

    /// Marks the start (`start`) or the end of a named range of the program in the memory
    /// history, as PyTorch's `torch.profiler.record_function` ranges are marked in its
    /// snapshot's `external_annotations`; [`Allocator::dump_snapshot`] writes them there, and
    /// `tidepool replay` reads the outermost ranges as scopes. Named scopes mark their runs
    /// themselves. Nothing while not recording.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, HistoryOptions, SimDevice, StreamId};
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    /// alloc.record_history(HistoryOptions::new(100));
    /// alloc.record_annotation("forward", true);
    /// let x = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    /// alloc.record_annotation("forward", false);
    /// let marks = alloc.annotations();
    /// assert_eq!((&*marks[0].name, marks[0].start, marks[1].start), ("forward", true, false));
    /// # drop(x);
    /// ```
    pub fn record_annotation(&self, name: &str, start: bool) {
        let _ = self.shared.annotate(std::sync::Arc::from(name), start);
    }

    /// The range marks of the memory history, oldest first (empty when not recording): those
    /// of [`Allocator::record_annotation`] and of named scopes.
    pub fn annotations(&self) -> Vec<Annotation> {
        let ring = self.shared.history_ring();
        ring.map(|r| lock(&r).annotations().cloned().collect()).unwrap_or_default()
    }

    /// The recorded memory history, oldest entry first (empty when not recording): the
    /// entries of the general allocator and of its private pools together, each with its
    /// [`TraceEntry::pool_id`].
    pub fn history(&self) -> Vec<TraceEntry> {
        self.shared
            .history_ring()
            .map(|r| lock(&r).entries().cloned().collect())
            .unwrap_or_default()
    }

    /// The Rust stack that allocated the live buffer at `ptr` (PyTorch's
    /// `torch.cuda.memory._allocation_traceback`): kept while history is recorded with
    /// [`HistoryContext::State`] or more, until the buffer's free completes. `None` for an
    /// address no live recorded buffer starts at, or when not recording.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, HistoryContext, HistoryOptions, SimDevice, StreamId};
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    /// let before = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    /// alloc.record_history(HistoryOptions::new(100).with_context(HistoryContext::State));
    /// let buf = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    /// assert!(alloc.allocation_traceback(buf.ptr()).is_some());
    /// assert!(alloc.allocation_traceback(before.ptr()).is_none(), "allocated unrecorded");
    /// let ptr = buf.ptr();
    /// drop(buf);
    /// assert!(alloc.allocation_traceback(ptr).is_none());
    /// ```
    pub fn allocation_traceback(
        &self,
        ptr: DeviceAddr,
    ) -> Option<std::sync::Arc<std::backtrace::Backtrace>> {
        let ring = self.shared.history_ring()?;
        lock(&ring).block_stacks().get(&ptr.0).cloned()
    }
}
