//! Deliberate bugs for tests (feature `test-hooks`): each [`Broken`] mode reverts one soundness
//! fix at run time, so the property tests (`tests/multi_props.rs`) can be shown to catch it.
//! Without the feature [`Shared::broken`](super::Shared) is a constant `false` and the checks
//! compile away.
//!
//! ```text
//!   alloc.set_broken(Broken::ForeignBuffers, true)   // test only
//!        └─▶ Shared::broken: AtomicU64 bit set ─▶ the guarded check is skipped
//! ```

/// A soundness fix that a test may revert (one bit each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u64)]
pub enum Broken {
    /// `free_batch`, `record_stream` and `use_on` take a buffer of another allocator as their
    /// own (findings 1 and 2): its block id is interpreted in this allocator's tables.
    ForeignBuffers = 1,
    /// A scope's exit ignores the recorded uses of planned buffers that were never freed
    /// (`mem::forget`, finding 3): the region returns to the pool unordered.
    ForgottenUses = 1 << 1,
    /// The free of an unbound planned buffer is queued for its scope before its stream waits for
    /// the buffer's other streams (finding 4); a short pause between the two stands for the
    /// contention on the global lock that opens the window.
    UnboundFreeOrder = 1 << 2,
    /// `use_on` does nothing, as the cudarc interop did (finding 5): the using stream does not
    /// wait for the owner's writes and the use is not recorded.
    UseOn = 1 << 3,
    /// Streams are not validated: an unknown stream is taken as an empty, drained one.
    UnknownStreams = 1 << 4,
    /// A failed `record_event` is taken as "the stream is gone": the wait is skipped.
    EventErrors = 1 << 5,
    /// `destroy_stream` closes the stream's caches before the device may refuse.
    DestroyStream = 1 << 6,
    /// A stream capture routes nothing to the graph's private pool and holds no free back: the
    /// captured allocations come from the general cache, and what is freed during the capture
    /// is reused outside the graph (the crash on replay users of graph capture report).
    CaptureGeneral = 1 << 7,
    /// The garbage collection releases the most recently used idle segments first.
    GcYoungestFirst = 1 << 8,
    /// The garbage collection releases idle persistent segments too.
    GcPersistent = 1 << 9,
    /// Aligned allocations are served from the stream caches and the large-block reuse like
    /// any other (a cached block of the class may start anywhere).
    AlignedFromCache = 1 << 10,
    /// Over expandable segments the same-stream reuse of a large block ignores the rule that
    /// the end of a range's top run is used last (placement then differs from the pool's).
    ReuseGrowthEnd = 1 << 11,
    /// The two residencies keep their free space apart on ordinary segments (the rule before
    /// `residency.rs`): a request never takes free space in a segment of the other residency,
    /// and small persistent blocks get small segments of their own.
    ResidencySplit = 1 << 12,
    /// `destroy_stream` tells only the allocator it was called on that the stream is drained,
    /// not the family's private pools (graph pools): a pool buffer used on that stream and
    /// freed later needs a host wait, which a capture underway refuses.
    PoolDestroyedStreams = 1 << 13,
    /// A free whose host wait is refused because a stream capture is underway gives the block
    /// up for good (it stays allocated, and its segment is never released) instead of waiting
    /// for the capture to end.
    RefusedWaitLeaks = 1 << 14,
    /// A large block checked under the global lock is handed out again without it even after
    /// later sections changed the pool (`fast_cache::LargeVerdict` trusted whatever the epoch):
    /// placement then differs from the pool's best fit.
    StaleLargeVerdict = 1 << 15,
    /// A scope's planned path serves runs on a device whose sanitizer observes hand-outs (the
    /// path tells it nothing): a planned slice reused while another stream still uses it goes
    /// unreported.
    PlannedUnobserved = 1 << 16,
    /// On ordinary segments a large request may take the other residency's free block even
    /// when that block lies in an expandable range (made while `expandable_segments` was on):
    /// a transient block then pins a persistent range's pages, or a persistent one a transient
    /// range's.
    SharedRanges = 1 << 17,
    /// A growth that fails after taking pages from another stream under `wait_event` releases
    /// them while their old mappings still retire: the device holds memory no range counts
    /// until a later poll.
    UnsettledMoves = 1 << 18,
    /// A scope's planned path reads the private-pool routes as they were when the scope opened
    /// (none): a guard or a capture begun on the stream while the scope is open does not stop
    /// its planned allocations there.
    PlannedStaleRoutes = 1 << 19,
    /// Recording the memory history leaves the stream-cache lanes open (their room and size
    /// bound as configured): hits and frees then bypass the slow path and go unrecorded.
    HistoryLanesOpen = 1 << 22,
    /// A stream the device no longer knows is taken as drained wherever expandable pages are
    /// released or moved, whoever destroyed it: while another thread (another allocator, the
    /// application) destroys it, its work may still run on the pages being unmapped.
    GoneStreamDrained = 1 << 20,
    /// `reset_accumulated_stats` leaves the expandable-segment counters (maps, unmaps, physical
    /// creates and releases, page moves) as they were, so PyTorch's `num_device_alloc` and
    /// `num_device_free`, which count the maps and unmaps, do not start again from zero.
    ResetKeepsMaps = 1 << 21,
    /// Virtual-memory counters changed by a path that does not publish them itself (a failed
    /// growth's creates and releases, a retired page's unmap) stay unpublished until some later
    /// growth: the lock-free statistics report stale figures meanwhile.
    VmCountsUnpublished = 1 << 23,
    /// `begin_capture` shares a pool that live graphs use, as PyTorch's `pool=` does: a later
    /// capture is handed memory the earlier graphs' replays still write.
    SharedGraphPools = 1 << 24,
    /// A private pool a graph uses releases free memory (a trim after `release_threshold`, a
    /// release with caching off, its own out-of-memory ladder): the captures' freed temporaries,
    /// which the replays still write, go back to the device.
    GraphPoolReleased = 1 << 26,
    /// The caps on reserved memory (`memory_limit_mb`, `per_process_memory_fraction`,
    /// `max_pool_size_mb`) hold for each allocator of a family alone: the general allocator and
    /// every private pool may each reserve up to the cap.
    LimitPerPool = 1 << 25,
    /// The out-of-memory ladder retries after the `use_on_oom` pools' release only if they
    /// released a segment: pages an expandable range released do not count, and the request
    /// fails with the memory it needed back on the device.
    OomPoolPagesUncounted = 1 << 27,
    /// The garbage collection compares the collecting allocator's own reserved bytes with its
    /// threshold, leaving out what the family's private pools reserve: cached segments stay
    /// while the device's memory is past the threshold.
    GcPerPool = 1 << 28,
    /// A private pool's request that runs out of memory leaves the general allocator's free
    /// cached segments where they are: the pool fails while cached memory could serve it.
    PoolOomKeepsGeneral = 1 << 31,
    /// A block a thread takes from another lane of its stream (freed on another thread, or
    /// last handed out there) is handed out holding that lane's owner, so its free caches it
    /// there again and every later request of the thread misses its own lane (not a soundness
    /// bug: twice the work per pair).
    CrossLaneHitStays = 1 << 32,
    /// A stream whose fast-path slot (its id modulo `FAST_STREAMS`) served a destroyed stream
    /// gets lanes of its own outside the slots, as every stream past the 64th did: no fast
    /// path for any stream created after the 64th (not a soundness bug: the slow path every
    /// time).
    NoLaneRetag = 1 << 33,
    /// A free into a lane does not check that the lane still serves the buffer's stream: a
    /// buffer that outlived its stream, freed after the lane was re-tagged for a new stream,
    /// is cached there, and the new stream hands out a block of the old stream's segments.
    RetaggedLaneTakesStaleFrees = 1 << 34,
    /// A hit does not check that the lane it found serves the requested stream: a request on
    /// a destroyed stream, whose lane was re-tagged meanwhile, takes a block cached for the new
    /// stream instead of failing.
    RetaggedLaneServesAnyStream = 1 << 35,
    /// A stream whose first fast-path slot serves a live stream (the default stream 64 ids
    /// below it, say) gets unslotted lanes instead of its second choice's: no fast path for
    /// it, as for every such stream before (not a soundness bug: the slow path every time).
    NoSecondSlot = 1 << 36,
    /// The family's record of destroyed streams keeps an entry per stream id instead of runs
    /// of consecutive ids: it grows with every stream a program makes and destroys.
    DestroyedStreamsPerId = 1 << 37,
    /// The allocator records its events on a stream that joined a capture (or began one) as on
    /// any other: the record is a node of the graph, a stream waiting on it is pulled into the
    /// capture, and the block's reuse waits on an event no query may ask about.
    CaptureForks = 1 << 38,
    /// A stream that joined a capture by waiting on an event recorded inside it is treated as
    /// outside it: its allocations come from the general pool and what it frees is reused at
    /// once, although the graph's replays use it.
    JoinedStreamsOutside = 1 << 39,
    /// With `graph_capture_record_stream_reuse`, a block used on a side stream of a capture and
    /// freed during it is reused within the capture without asking the device whether its
    /// stream is ordered after those uses: the side stream's captured work and the new owner's
    /// race at every replay.
    CaptureReuseUnordered = 1 << 47,
    /// A block a capture holds back stays counted as allocated until the graph lets go of it
    /// (tidepool's figures before): PyTorch counts a freed block whose reuse waits as active
    /// only, and `memory_allocated()` during a capture disagreed with it.
    HeldBlocksAllocated = 1 << 48,
    /// `use_on` of a buffer for a stream of the same capture as the buffer's last writer records
    /// the use without ordering it: the captured kernels of the two branches race at every
    /// replay.
    CaptureUseOnUnordered = 1 << 63,
    /// A growth whose headroom (expandable segments) does not fit the device fails the request
    /// instead of growing by exactly what the request needs.
    HeadroomOom = 1 << 30,
    /// A scope keeps the block of a freed pool buffer for local reuse even when a private pool
    /// served it (the stream was routed after the scope's check): the block is handed out again
    /// and returned as the general pool's, whose tables it corrupts.
    ScopeKeepsRouted = 1 << 29,
    /// Tagging a buffer as a scope's unbound buffer leaves its flags byte as it was: its drop
    /// takes the common case (straight into its lane) and its scope never sees the free.
    UnflaggedScopeTag = 1 << 40,
    /// A routed allocation goes to its private pool without asking whether the stream still
    /// exists: a pool that never saw the stream's destruction serves it (from its stream cache
    /// or its whole path, where it remembers the stream as known).
    RoutedDeadStreams = 1 << 41,
    /// Scope memory (an unbound buffer of a scope: a planned slice, or a pool block an open run
    /// or a region may take back) freed while a capture holds it goes to its scope or region at
    /// once instead of to the graph, which then shares it with work outside the graph.
    CaptureScopeFrees = 1 << 42,
    /// A failed event record while expandable segments move or release pages fails the
    /// allocation (or release) instead of skipping the donor or waiting on the host.
    VmEventErrors = 1 << 43,
    /// A credit revocation leaves a lane's hot block where it is (`class_table.rs`): its hit,
    /// which checks no credit, then spends headroom the lane no longer holds, past the peak.
    /// (Set on the lanes that exist when it is turned on.)
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    HotCreditKept = 1 << 44,
    /// A learning run's region is laid out over the bins found before joining its runs even
    /// when the join failed midway (a map refused): the gaps it did map joined runs into one
    /// segment, so a bin names a segment that no longer exists.
    StaleJoinBins = 1 << 45,
    /// A free into a lane grants credit without marking the lane (`fast_cache/`): a
    /// revocation that finds no lane marked skips them all, and raises the peak from an
    /// `upper` that still holds that credit — past the exact peak. (Set on the lanes that
    /// exist when it is turned on.)
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    UnmarkedCredit = 1 << 46,
    /// A scope run hands out again a block it freed into its local cache even where the
    /// search would no longer place the request there: a transient block in a persistent
    /// ordinary segment's free space (shared while segments were in force), reused after
    /// `expandable_segments` was turned on, when residencies no longer share (`scope/pool_blocks.rs`).
    LocalReuseAcrossRanges = 1 << 49,
    /// `empty_cache` only polls the pending events instead of waiting for them all (PyTorch's
    /// `release_cached_blocks` → `synchronize_and_free_events`): a block whose free waits on
    /// another stream's unfinished work keeps its segment, and `num_sync_all_streams` does
    /// not count the call.
    EmptyCacheSkipsEvents = 1 << 50,
    /// The out-of-memory ladder counts its last attempt in `num_alloc_retries` only when it
    /// succeeds, and its wait for every event in `num_sync_all_streams` only when an event was
    /// pending (PyTorch counts both whenever the ladder reaches `release_cached_blocks`).
    LadderUncounted = 1 << 51,
    /// The out-of-memory ladder skips its first step under `max_split_size_mb` (PyTorch's
    /// `release_available_cached_blocks`: cached oversize segments of the request's stream
    /// and pool only) and releases every cached transient segment at once.
    OversizeReleasedLast = 1 << 52,
    /// A physical allocation the device refuses to release (`vm_release` fails or panics) is
    /// forgotten instead of kept for another try: its memory stays taken on the device.
    LostReleases = 1 << 53,
    /// A panic in a [`crate::Device`] method unwinds through the allocator instead of being
    /// caught at the call (`device/guarded.rs`): the operation it interrupts is left half done.
    DevicePanicsUnwind = 1 << 54,
    /// What the device refuses to take back as an allocator goes (a range, a physical
    /// allocation, a segment, an event) is lost with it instead of left to its family.
    LostLeftovers = 1 << 55,
    /// A CUDA graph the device refused to destroy gives its pool's memory and the buffers it
    /// holds back anyway, although the graph still references them.
    UndestroyedGraphFreed = 1 << 56,
    /// What a dropped graph holds back is leaked for good when the wait for its launches fails,
    /// instead of let go of after a later device synchronisation (`empty_cache`).
    GraphHoldsLeaked = 1 << 57,
    /// `empty_cache` lets go of an idle region that adopted its learning run's segments but
    /// keeps the plan, whose offsets are addresses in that released memory: the scope's next
    /// run makes a new region and hands out slices outside it.
    AdoptedPlanKept = 1 << 58,
    /// The out-of-memory ladder does not let go of idle plan regions: memory that only a
    /// learned plan holds makes a request fail.
    OomKeepsRegions = 1 << 59,
    /// `release_stream` does not let go of the idle regions of plans on the stream: an adopted
    /// stream where a named scope ran can never be given back (`StreamInUse`).
    StreamKeepsRegions = 1 << 60,
    /// A stitched block's chunks stay in their home range's runs while it is live (not lent):
    /// the home range hands the same physical memory out again.
    StitchKeepsHome = 1 << 61,
    /// A release of expandable pages unmaps the cached stitched blocks over its range before
    /// the stream's work is done: a kernel still running on a stitched block loses its memory.
    StitchUnmapEarly = 1 << 62,
}

#[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
impl Broken {
    /// The stream-order soundness modes, which the property test `tests/multi_props.rs` must
    /// catch one by one (`every_broken_mode_is_caught`): the first eight of [`Broken::EVERY`].
    /// The other modes are caught by their own deterministic tests (`tests/broken_modes.rs`
    /// checks that each has one).
    pub const STREAM_ORDER: &[Broken] = Broken::EVERY.split_at(8).0;

    /// Every mode, in declaration order. Kept complete by [`Broken::position`], whose match
    /// stops compiling when a mode is added and not listed.
    pub const EVERY: [Broken; 64] = [
        Broken::ForeignBuffers,
        Broken::ForgottenUses,
        Broken::UnboundFreeOrder,
        Broken::UseOn,
        Broken::UnknownStreams,
        Broken::EventErrors,
        Broken::DestroyStream,
        Broken::CaptureGeneral,
        Broken::GcYoungestFirst,
        Broken::GcPersistent,
        Broken::AlignedFromCache,
        Broken::ReuseGrowthEnd,
        Broken::ResidencySplit,
        Broken::PoolDestroyedStreams,
        Broken::RefusedWaitLeaks,
        Broken::StaleLargeVerdict,
        Broken::PlannedUnobserved,
        Broken::SharedRanges,
        Broken::UnsettledMoves,
        Broken::PlannedStaleRoutes,
        Broken::HistoryLanesOpen,
        Broken::HeadroomOom,
        Broken::ScopeKeepsRouted,
        Broken::UnflaggedScopeTag,
        Broken::RoutedDeadStreams,
        Broken::CaptureScopeFrees,
        Broken::VmEventErrors,
        Broken::HotCreditKept,
        Broken::StaleJoinBins,
        Broken::UnmarkedCredit,
        Broken::LocalReuseAcrossRanges,
        Broken::EmptyCacheSkipsEvents,
        Broken::LadderUncounted,
        Broken::OversizeReleasedLast,
        Broken::LostReleases,
        Broken::DevicePanicsUnwind,
        Broken::LostLeftovers,
        Broken::UndestroyedGraphFreed,
        Broken::GraphHoldsLeaked,
        Broken::AdoptedPlanKept,
        Broken::OomKeepsRegions,
        Broken::StreamKeepsRegions,
        Broken::StitchKeepsHome,
        Broken::StitchUnmapEarly,
        Broken::GoneStreamDrained,
        Broken::ResetKeepsMaps,
        Broken::VmCountsUnpublished,
        Broken::SharedGraphPools,
        Broken::GraphPoolReleased,
        Broken::LimitPerPool,
        Broken::OomPoolPagesUncounted,
        Broken::GcPerPool,
        Broken::PoolOomKeepsGeneral,
        Broken::CrossLaneHitStays,
        Broken::NoLaneRetag,
        Broken::RetaggedLaneTakesStaleFrees,
        Broken::RetaggedLaneServesAnyStream,
        Broken::NoSecondSlot,
        Broken::DestroyedStreamsPerId,
        Broken::CaptureForks,
        Broken::JoinedStreamsOutside,
        Broken::CaptureReuseUnordered,
        Broken::HeldBlocksAllocated,
        Broken::CaptureUseOnUnordered,
    ];

    /// Its place in [`Broken::EVERY`].
    pub const fn position(self) -> usize {
        match self {
            Broken::ForeignBuffers => 0,
            Broken::ForgottenUses => 1,
            Broken::UnboundFreeOrder => 2,
            Broken::UseOn => 3,
            Broken::UnknownStreams => 4,
            Broken::EventErrors => 5,
            Broken::DestroyStream => 6,
            Broken::CaptureGeneral => 7,
            Broken::GcYoungestFirst => 8,
            Broken::GcPersistent => 9,
            Broken::AlignedFromCache => 10,
            Broken::ReuseGrowthEnd => 11,
            Broken::ResidencySplit => 12,
            Broken::PoolDestroyedStreams => 13,
            Broken::RefusedWaitLeaks => 14,
            Broken::StaleLargeVerdict => 15,
            Broken::PlannedUnobserved => 16,
            Broken::SharedRanges => 17,
            Broken::UnsettledMoves => 18,
            Broken::PlannedStaleRoutes => 19,
            Broken::HistoryLanesOpen => 20,
            Broken::HeadroomOom => 21,
            Broken::ScopeKeepsRouted => 22,
            Broken::UnflaggedScopeTag => 23,
            Broken::RoutedDeadStreams => 24,
            Broken::CaptureScopeFrees => 25,
            Broken::VmEventErrors => 26,
            Broken::HotCreditKept => 27,
            Broken::StaleJoinBins => 28,
            Broken::UnmarkedCredit => 29,
            Broken::LocalReuseAcrossRanges => 30,
            Broken::EmptyCacheSkipsEvents => 31,
            Broken::LadderUncounted => 32,
            Broken::OversizeReleasedLast => 33,
            Broken::LostReleases => 34,
            Broken::DevicePanicsUnwind => 35,
            Broken::LostLeftovers => 36,
            Broken::UndestroyedGraphFreed => 37,
            Broken::GraphHoldsLeaked => 38,
            Broken::AdoptedPlanKept => 39,
            Broken::OomKeepsRegions => 40,
            Broken::StreamKeepsRegions => 41,
            Broken::StitchKeepsHome => 42,
            Broken::StitchUnmapEarly => 43,
            Broken::GoneStreamDrained => 44,
            Broken::ResetKeepsMaps => 45,
            Broken::VmCountsUnpublished => 46,
            Broken::SharedGraphPools => 47,
            Broken::GraphPoolReleased => 48,
            Broken::LimitPerPool => 49,
            Broken::OomPoolPagesUncounted => 50,
            Broken::GcPerPool => 51,
            Broken::PoolOomKeepsGeneral => 52,
            Broken::CrossLaneHitStays => 53,
            Broken::NoLaneRetag => 54,
            Broken::RetaggedLaneTakesStaleFrees => 55,
            Broken::RetaggedLaneServesAnyStream => 56,
            Broken::NoSecondSlot => 57,
            Broken::DestroyedStreamsPerId => 58,
            Broken::CaptureForks => 59,
            Broken::JoinedStreamsOutside => 60,
            Broken::CaptureReuseUnordered => 61,
            Broken::HeldBlocksAllocated => 62,
            Broken::CaptureUseOnUnordered => 63,
        }
    }

    /// Its bit.
    pub(crate) fn bit(self) -> u64 {
        self as u64
    }
}
