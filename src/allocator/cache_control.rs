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
    ///
    /// A private pool that no [`MemPool`] handle reaches any more, kept only by a
    /// `mem::forget`ten [`PoolGuard`]'s route, is emptied too, as its own
    /// [`MemPool::empty_cache`] would be (a pool someone still holds is theirs to empty).
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        // What families of the device with no general allocator left hold back (`peers.rs`).
        let _ = crate::peers::let_go_of_orphans(&sh.device);
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
        sh.release_gone(&mut st);
        drop(st);
        // The pools only a `mem::forget`ten guard routes to: no `MemPool` handle is left to
        // empty them, so this call does, as the pool's own `empty_cache` would. BROKEN
        // (`forgotten_guard_pool_kept`): their cache stays as long as the allocator.
        if sh.role.id == 0 && !cfg!(tidepool_broken = "forgotten_guard_pool_kept") {
            for pool in sh.routes.unreachable_pools() {
                if !pool.shared.role.graph_held() {
                    pool.empty_cache()?;
                    pool.release_persistent()?;
                }
            }
        }
        released
    }

    /// Gives cached memory back to the device until this allocator reserves no more than
    /// `min_bytes_to_keep` bytes, or nothing more can be given back now; CUDA's
    /// `cudaMemPoolTrimTo(pool, minBytesToKeep)`. Returns the bytes released: how far the
    /// call brought [`Allocator::reserved_bytes`] down (0 where it was at or below the floor:
    /// then nothing is done at all); `reserved_bytes` read before and after would also count
    /// what other threads reserved or released meanwhile.
    ///
    /// What may go is what [`Allocator::empty_cache`] gives back: the stream caches are flushed,
    /// then transient segments that hold no block in use or waiting, and, on expandable
    /// segments, the wholly free chunks of transient ranges (persistent memory only goes by
    /// [`Allocator::release_persistent`]; the initial pool stays). Never below the floor:
    /// cudaMallocAsync's pool "will be guaranteed to have at least minBytesToKeep bytes
    /// reserved after the operation", so a segment or chunk whose release would take reserved
    /// below it is passed over (the next, smaller, may fit) and the call may end above the
    /// floor; `trim_to(0)` releases all that may go. The order:
    ///
    /// 1. ordinary segments, the largest first (the lowest address first among equals): the
    ///    fewest releases for the bytes — each `cuMemFree` synchronises the device — as
    ///    PyTorch's `release_available_cached_blocks` takes the largest first, and the small
    ///    pool's 2 MiB segments, which small requests soon reserve again, go last;
    /// 2. then the expandable ranges' free chunks, range by range in address order, each from
    ///    its top down, as `empty_cache` and `release_threshold` give pages back;
    /// 3. only where that leaves reserved above the floor, the regions of named scopes' plans
    ///    that nothing holds (see [`Allocator::empty_cache`]; a region let go costs its plan's
    ///    next run a new one), then 1 and 2 again. A region on ordinary segments goes only
    ///    where the segments it frees can then all go within the floor (else it stays its
    ///    plan's: letting it go would release nothing); one over expandable segments goes
    ///    whenever reserved is above the floor.
    ///
    /// Unlike `empty_cache`, it waits on the host for no pending free, as `cudaMemPoolTrimTo`
    /// does not: blocks freed after [`Buffer::record_stream`] or [`Buffer::use_on`] whose
    /// events have not completed are only polled, and their segments (or chunks) stay until
    /// those complete; what dropped CUDA graphs hold back for a synchronisation stays too.
    /// (With no free pending — after [`Allocator::synchronize`] — and no dropped graph holding
    /// memory back, `trim_to(0)` releases what `empty_cache` does.)
    /// Releasing is the same as everywhere here: each segment's release is a counted host sync
    /// (`num_host_syncs`: `cuMemFree` synchronises), and a range's chunks go once its stream's
    /// work enqueued so far has completed, waited for where it has not (a counted host sync).
    /// Chunks a `release_threshold` trim already gave up (retiring behind their stream's work)
    /// go first, whatever the floor, and count in the bytes released; the floor weighs the
    /// rest. Nothing is released while a capture is underway (`Ok(0)`). A device error is returned
    /// as it comes; what was released before it stays released.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, MIB, SimDevice, StreamId};
    ///
    /// let dev = Arc::new(SimDevice::new(1 << 30));
    /// let alloc = Allocator::new(dev, Config::default()).unwrap();
    /// let s = StreamId::DEFAULT;
    /// // Segments of 12, 16 and 20 MiB (requests of 10 MiB or more are reserved as asked).
    /// let bufs: Vec<_> = [12, 16, 20].map(|n| alloc.alloc(n * MIB, s).unwrap()).into();
    /// drop(bufs);
    /// assert_eq!(alloc.reserved_bytes(), 48 * MIB);
    /// // Keep at least 30 MiB: the 20 MiB segment would leave 28, so the 16 MiB one goes.
    /// assert_eq!(alloc.trim_to(30 * MIB).unwrap(), 16 * MIB);
    /// assert_eq!(alloc.reserved_bytes(), 32 * MIB);
    /// assert_eq!(alloc.trim_to(0).unwrap(), 32 * MIB);
    /// ```
    pub fn trim_to(&self, min_bytes_to_keep: u64) -> Result<u64, AllocError> {
        // BROKEN (`trim_releases_persistent`): persistent segments trimmed too.
        let which: &[Residency] = match cfg!(tidepool_broken = "trim_releases_persistent") {
            true => &[Residency::Transient, Residency::Persistent],
            false => &[Residency::Transient],
        };
        self.shared.trim_to(min_bytes_to_keep, which)
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
    /// [`Allocator::trim_to`] over the free memory of the residencies `which`, in that order
    /// (a private pool's trim gives back both).
    pub(super) fn trim_to(&self, floor: u64, which: &[Residency]) -> Result<u64, AllocError> {
        if self.device.capture_underway() {
            return Ok(0); // cuMemFree is illegal during a capture (as `release_segments`)
        }
        let mut st = self.lock_state();
        if st.pool.reserved_bytes() <= floor {
            return Ok(0); // cudaMemPoolTrimTo: a no-op
        }
        let mut released = 0;
        self.flush_all(&mut st);
        // Pending frees polled, not waited for: cudaMemPoolTrimTo does not synchronise.
        // BROKEN (`trim_waits_pending`): waited for, as `empty_cache` (host syncs on other
        // streams' work, and blocks released that the call should have kept).
        match cfg!(tidepool_broken = "trim_waits_pending") {
            true => self.sync_events(&mut st)?,
            false => self.process_events(&mut st),
        }
        released += self.trim_locked(&mut st, floor, which)?;
        // BROKEN (`trim_keeps_regions`): idle plan regions stay whatever the floor.
        if st.pool.reserved_bytes() > floor && !cfg!(tidepool_broken = "trim_keeps_regions") {
            // Last, the idle regions of plans (the plans' lock comes before the state's): only
            // those whose return frees ordinary segments that can all go within the floor
            // (a region let go costs its plan's next run a new one, an adopted plan its
            // learning). The bytes that may go are shared among them.
            drop(st);
            let mut room = None;
            let fits = |st: &State, r: &plan::Region| -> bool {
                // BROKEN (`trim_regions_past_floor`): every idle region, whatever it frees.
                if cfg!(tidepool_broken = "trim_regions_past_floor") {
                    return true;
                }
                let room =
                    room.get_or_insert_with(|| st.pool.reserved_bytes().saturating_sub(floor));
                match self.region_frees(st, r, which) {
                    // Over expandable ranges (its pages go from the tops down): as before.
                    None => true,
                    Some(bytes) if bytes != 0 && bytes <= *room => {
                        *room -= bytes;
                        true
                    }
                    Some(_) => false,
                }
            };
            let any = self.release_idle_regions_then(false, |_| true, fits);
            st = self.lock_state();
            if any {
                self.flush_all(&mut st);
                released += self.trim_locked(&mut st, floor, which)?;
            }
        }
        self.release_gone(&mut st);
        Ok(released)
    }

    /// One pass of [`Shared::trim_to`] under the lock: per residency, free ordinary segments
    /// the largest first, then free chunks of expandable ranges, none taking reserved below
    /// `floor`. The bytes the pass took off reserved.
    fn trim_locked(
        &self,
        st: &mut State,
        floor: u64,
        which: &[Residency],
    ) -> Result<u64, AllocError> {
        // BROKEN (`trim_ignores_floor`): everything free goes, as `empty_cache`.
        let floor = if cfg!(tidepool_broken = "trim_ignores_floor") { 0 } else { floor };
        let start = st.pool.reserved_bytes();
        // Chunks a threshold's trim retired (out of the pool, still mapped and counted
        // reserved until their event is seen complete) go whatever the floor: the release of
        // expandable chunks below waits for them first, and a segment's release synchronises
        // the device (`cuMemFree`). So they go first (waited for where their stream's work has
        // not completed), and the floor weighs what stays. (The broken build
        // `cfg(tidepool_broken = "trim_floor_counts_retiring")` weighs the segments with them
        // still counted: the chunks went after the segments, below the floor.)
        #[cfg(not(tidepool_broken = "trim_floor_counts_retiring"))]
        self.poll_retiring(st, true);
        for &res in which {
            let (vm, initial) = (&st.vm, st.initial);
            let mut segs: Vec<(u64, u64, SegmentId)> = st
                .pool
                .releasable_segments(|s| {
                    s.key.residency == res && !vm.contains(s.base) && Some(s.base) != initial
                })
                .into_iter()
                .map(|id| (st.pool.segment(id).size, st.pool.segment(id).base, id))
                .collect();
            // The largest first, the lowest address first among equals.
            segs.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            for (size, _, seg) in segs {
                let reserved = st.pool.reserved_bytes();
                if reserved <= floor {
                    return Ok(start - reserved);
                }
                if reserved - size >= floor {
                    self.release_segment(st, seg)?;
                }
            }
            if !st.vm.is_empty() && st.pool.reserved_bytes() > floor {
                let keep = |s: &crate::pool::Segment| s.key.residency == res;
                self.release_pages_above(st, keep, 0, Waits::All, Some(floor), false)?;
            }
        }
        Ok(start.saturating_sub(st.pool.reserved_bytes()))
    }

    /// The bytes of the ordinary segments of the residencies `which` that a trim could
    /// release once region `r` returned to the pool: those whose every busy block is the
    /// region's (nothing else live or pending in them), not the initial pool. `None` where a
    /// block of it lies in an expandable range (its pages go from the range's top down).
    fn region_frees(&self, st: &State, r: &plan::Region, which: &[Residency]) -> Option<u64> {
        let mut held: HashMap<SegmentId, usize> = HashMap::new();
        for b in r.block_ids() {
            let seg = st.pool.block(b).segment;
            if st.vm.contains(st.pool.segment(seg).base) {
                return None;
            }
            *held.entry(seg).or_default() += 1;
        }
        let frees = held.into_iter().filter_map(|(id, n)| {
            let s = st.pool.segment(id);
            let goes = s.busy_blocks == n
                && which.contains(&s.key.residency)
                && Some(s.base) != st.initial;
            goes.then_some(s.size)
        });
        Some(frees.sum())
    }

    /// What `empty_cache` and `trim_to` give back besides cached memory (not during a
    /// capture): the virtual ranges of streams the device no longer knows, and what gone
    /// allocators of the family left.
    fn release_gone(&self, st: &mut State) {
        if self.device.capture_underway() {
            return;
        }
        // The ranges of streams the device no longer knows (destroyed on the device or
        // by another allocator, not through `destroy_stream` / `release_stream`) give
        // their virtual addresses back once nothing is mapped there, as PyTorch's
        // `release_cached_blocks` releases a wholly unmapped expandable segment
        // (`release_expandable_segment`). A live stream's range stays for its next growth.
        // Kept, they held the address space until the allocator went, and once it ran
        // out every new stream fell back to ordinary segments.
        // BROKEN (`empty_cache_keeps_ranges`): kept until the stream or allocator goes.
        let dev = &self.device;
        let gone = |k: &PoolKey| !dev.has_stream(k.stream);
        if !cfg!(tidepool_broken = "empty_cache_keeps_ranges")
            && st.vm.ranges.values().any(|r| r.pages.is_empty() && gone(&r.key))
        {
            self.free_ranges(st, gone);
        }
        // What gone allocators of the family could not give back (`leftovers.rs`).
        self.family.leftovers.retry(&self.device);
    }

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
