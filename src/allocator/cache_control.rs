//! What an application asks of the cache: give it back (`empty_cache`, `release_persistent`),
//! give one stream's back, or forget a stream (`destroy_stream`).

use super::page_release::Waits;
use super::*;

impl<D: Device> Allocator<D> {
    /// Releases every cached segment that holds no live block, persistent ones excepted (see
    /// [`Allocator::release_persistent`]). Like PyTorch's `emptyCache`, it first waits for
    /// every pending event (counted in `num_sync_all_streams`), so blocks whose free waited on
    /// other streams' work are released too; while a capture is underway (no host wait
    /// allowed) it only polls them.
    ///
    /// The region of a named scope's plan ([`Allocator::named_scope`]) is cached memory too:
    /// where no run, planned buffer, escaped buffer or CUDA graph holds it, it goes back to the
    /// pool and is released with the rest. The plan stays learned where its offsets are
    /// relative to the region (the scope's next run makes the region anew); a plan whose region
    /// adopted its learning run's own segments is forgotten with them (the next run learns
    /// again).
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let _ = sh.release_idle_regions();
        let mut st = sh.lock_state();
        st.vm.refused.clear(); // ranges refused are asked for again
        sh.flush_all(&mut st);
        if sh.device.capture_underway() || sh.broken(Broken::EmptyCacheSkipsEvents) {
            sh.process_events(&mut st);
        } else {
            sh.sync_events(&mut st)?;
        }
        let holds = sh.family.take_graph_holds(&sh.device, &mut st);
        if !holds.is_empty() {
            // Dropped graphs' holds whose wait failed, now waited for: freed before the release.
            drop(st);
            holds.into_iter().for_each(capture::Held::release);
            st = sh.lock_state();
            sh.flush_all(&mut st);
        }
        let released = sh.release_segments(&mut st, |s| s.key.residency == Residency::Transient);
        if !sh.device.capture_underway() {
            // The ranges of streams the device no longer knows (destroyed on the device or
            // by another allocator, not through `destroy_stream` / `release_stream`) give
            // their virtual addresses back once nothing is mapped there, as PyTorch's
            // `release_cached_blocks` releases a wholly unmapped expandable segment
            // (`release_expandable_segment`). A live stream's range stays for its next growth.
            // Kept, they held the address space until the allocator went, and once it ran
            // out every new stream fell back to ordinary segments.
            // BROKEN (`empty_cache_keeps_ranges`): kept until the stream or allocator goes.
            let dev = &sh.device;
            let gone = |k: &PoolKey| !dev.has_stream(k.stream);
            if !cfg!(tidepool_broken = "empty_cache_keeps_ranges")
                && st.vm.ranges.values().any(|r| r.pages.is_empty() && gone(&r.key))
            {
                sh.free_ranges(&mut st, gone);
            }
            // What gone allocators of the family could not give back (`leftovers.rs`).
            sh.family.leftovers.retry(&sh.device);
        }
        released
    }

    /// Releases cached persistent segments that hold no live block.
    pub fn release_persistent(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        sh.flush_all(&mut st);
        sh.process_events(&mut st);
        sh.release_segments(&mut st, |s| s.key.residency == Residency::Persistent)
    }

    /// Returns to the device the free segments cached for `stream` (stranded memory of a stream
    /// that no longer allocates). Call it before destroying a stream.
    /// A stream that neither exists nor owns segments here is refused
    /// ([`AllocError::UnknownStream`]); a destroyed stream's stranded segments are released,
    /// and a stream destroyed elsewhere (by another allocator, or on the device) is forgotten:
    /// later requests on it are refused.
    ///
    /// The regions of named scopes' plans on the stream that nothing holds go too (see
    /// [`Allocator::empty_cache`]).
    ///
    /// For a stream the application owns and the device adopted (`CudaDevice::adopt_stream`,
    /// [`crate::SimDevice::adopt_stream`]), this also lets go of it: its work is drained and the
    /// device forgets it, so the application may destroy it; later use of its id is
    /// `UnknownStream`. That needs every buffer allocated on it freed first: while any is live
    /// (or waits on events), the answer is [`AllocError::StreamInUse`] and nothing is released.
    pub fn release_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        let sh = &self.shared;
        let adopted = sh.device.is_adopted(stream);
        if !sh.broken(Broken::StreamKeepsRegions) {
            // The idle regions of plans learned on it are its cached memory too.
            let _ = sh.release_idle_regions_of(|s| s == stream);
        }
        let mut st = sh.lock_state();
        let gone = !sh.broken(Broken::UnknownStreams) && !sh.device.has_stream(stream);
        if gone {
            st.streams.remove(&stream);
            sh.family.note_gone(); // refused from now on, in open scopes too
        }
        // Cached blocks go back to the pool first (what releasing does anyway), so that only
        // blocks really in use count; the caches of a stream that is gone are closed.
        sh.flush_stream(&mut st, stream, gone);
        if gone && !st.segment_streams.contains_key(&stream) {
            return Err(AllocError::UnknownStream(stream));
        }
        sh.process_events(&mut st);
        if adopted {
            let in_use = sh.bytes_in_use_on(&st, stream);
            if in_use > 0 {
                return Err(AllocError::StreamInUse { stream, bytes: in_use });
            }
            sh.flush_stream(&mut st, stream, true);
        }
        sh.release_segments_then(
            &mut st,
            |s| s.key.stream == stream,
            Shared::<D>::own_waits(stream),
        )?;
        sh.free_ranges(&mut st, |k| k.stream == stream);
        drop(st);
        if adopted {
            sh.device.destroy_stream(stream)?;
            sh.family.note_gone();
            // Drained and forgotten by the device: refused from now on, nothing left of it to
            // wait for.
            let mut st = sh.lock_state();
            st.streams.remove(&stream);
            sh.family.note_destroyed(stream, private_pool::FAMILY_WIDE);
        }
        Ok(())
    }

    /// Destroys the stream on the device (which drains its work), then returns the stream's
    /// cached segments to the device and forgets the plans of scopes on it. Blocks whose free
    /// waited for its work (`record_stream`, `use_on`) are free then (the device drained it),
    /// with no host wait; those waiting for other streams' work stay pending as any free does
    /// (`release_stream` or `empty_cache` returns their segment once they are free). The
    /// stream is checked first: one the device refuses (the default stream, an unknown one) is
    /// an error and changes nothing here. An error from giving its memory back (the device
    /// refused an unmap or a free) comes after the stream is destroyed: that memory stays
    /// cached, and [`Allocator::release_stream`] or [`Allocator::empty_cache`] gives it back
    /// later.
    pub fn destroy_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        let sh = &self.shared;
        if sh.broken(Broken::DestroyStream) {
            // BROKEN: closes and flushes the stream's caches before the device may refuse.
            let mut st = sh.lock_state();
            sh.flush_stream(&mut st, stream, true);
            drop(st);
            sh.device.destroy_stream(stream)?;
            return Ok(());
        }
        if stream == StreamId::DEFAULT {
            return Err(DeviceError::Unsupported("destroying the default stream").into());
        }
        sh.stream_exists(stream)?;
        sh.device.destroy_stream(stream)?;
        // Open scopes on it refuse from now on; counted before its plans are forgotten, so a
        // run that ends meanwhile learns none for it (`Shared::stream_gone_since`).
        sh.family.note_gone();
        sh.forget_plans(stream);
        let mut st = sh.lock_state();
        st.streams.remove(&stream);
        let by = match sh.broken(Broken::PoolDestroyedStreams) {
            true => sh.role.id, // BROKEN: the family's other pools are not told
            false => private_pool::FAMILY_WIDE,
        };
        sh.family.note_destroyed(stream, by);
        sh.flush_stream(&mut st, stream, true);
        // BROKEN (`destroy_waits_all`): a wait on the host for every pending event of every
        // stream — the host blocked on unrelated streams' work, and an error (a capture
        // underway elsewhere refuses the wait) after the stream was destroyed.
        #[cfg(tidepool_broken = "destroy_waits_all")]
        if st.pending.contains_key(&stream) {
            sh.sync_events(&mut st)?;
        }
        // The device drained the stream before destroying it: every event recorded on it has
        // completed, so the blocks that waited on them are done with it (as `Mark::Drained`
        // takes it). Events recorded on other streams are left to their own polls.
        #[cfg(not(tidepool_broken = "destroy_waits_all"))]
        if let Some(done) = st.pending.remove(&stream) {
            done.into_iter().for_each(|e| Shared::<D>::event_done(&mut st, e));
        }
        sh.release_segments_then(
            &mut st,
            |s| s.key.stream == stream,
            Shared::<D>::own_waits(stream),
        )?;
        sh.free_ranges(&mut st, |k| k.stream == stream);
        Ok(())
    }
}

impl<D: Device> Shared<D> {
    /// The retiring mappings a release of `stream`'s memory (`release_stream`,
    /// `destroy_stream`) waits for on the host: those of its own ranges and those moved into
    /// them ([`Waits::For`]), which its pages and its ranges wait on; other streams' are only
    /// queried, as every lock section's end does. Waiting for all of them blocked the host on
    /// unrelated streams' work (another stream's trimmed pages retiring behind its kernel),
    /// and counted a host sync, as a learning run's end did (`adopt_waits_all`).
    /// BROKEN (`release_stream_waits_all`): every stream's waited for.
    fn own_waits(stream: StreamId) -> Waits {
        match cfg!(tidepool_broken = "release_stream_waits_all") {
            true => Waits::All,
            false => Waits::For(stream),
        }
    }
}
