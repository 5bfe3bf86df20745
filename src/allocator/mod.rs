//! The allocator front: [`Allocator`] over any [`Device`], with pools per (residency, stream,
//! size class), stream-ordered frees, cross-stream reuse, the out-of-memory ladder and statistics.
//!
//! ```text
//!  alloc(bytes, stream) ─▶ process completed events ─▶ best fit in own pool ─┬─▶ split, hand out
//!                                                                             ├─▶ take a free segment
//!                                                                             │   of another stream
//!                                                                             └─▶ reserve a segment
//!             OOM ladder: wait for pending events → search again → release cached → retry → error
//! ```
//!
//! All mutable state sits behind one lock (`Shared::state`). Blocks freed after a
//! `record_stream` wait in per-stream FIFO queues of events until their uses completed.

mod buffer;
mod error;
mod plan;
mod report;
mod scope;

pub use buffer::Buffer;
pub use error::{AllocError, OomReport};
pub use report::{BlockInfo, SegmentInfo};
pub use scope::{Scope, ScopedBuffer};

use crate::config::{Config, CrossStream};
use crate::device::{Device, DeviceError, DevicePtr, EventId, StreamId};
use crate::pool::{BlockId, BlockState, Pool, PoolKey, SegmentId};
use crate::stats::{MemoryStats, Residency};
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::{Arc, Mutex, MutexGuard, lock};
use arc_swap::ArcSwap;
use buffer::Origin;
use plan::{Learned, Region};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// A stream-ordered caching allocator over a [`Device`]. Cheap to clone (a handle); `Send + Sync`.
///
/// ```
/// use std::sync::Arc;
/// use tidepool::{Allocator, Config, SimDevice, StreamId};
///
/// let device = Arc::new(SimDevice::new(1 << 30));
/// let alloc = Allocator::new(device.clone(), Config::default()).unwrap();
/// let a = alloc.alloc(1000, StreamId::DEFAULT).unwrap();
/// assert_eq!(a.block_size(), 1024);               // rounded to 512 B
/// drop(a);                                        // cached, not returned to the device
/// let b = alloc.alloc(1000, StreamId::DEFAULT).unwrap();
/// assert_eq!(alloc.stats().num_device_alloc, 1);  // served from the cache
/// drop(b);
/// alloc.empty_cache().unwrap();
/// assert!(device.live_segments().is_empty());
/// ```
pub struct Allocator<D: Device> {
    shared: Arc<Shared<D>>,
}

impl<D: Device> Clone for Allocator<D> {
    fn clone(&self) -> Self {
        Allocator { shared: self.shared.clone() }
    }
}

pub(crate) struct Shared<D: Device> {
    device: Arc<D>,
    config: ArcSwap<Config>,
    device_total: u64,
    state: Mutex<State>,
    /// Test-only deliberate bug: skip every event that orders cross-stream reuse.
    broken_skip_events: AtomicBool,
    /// Learned plans of named scopes, by (name, stream). Taken before `state`, never inside it.
    plans: Mutex<HashMap<(String, StreamId), PlanState>>,
    scope_counters: ScopeCounters,
}

/// What a named scope learned, and the region its plan lives in.
#[derive(Default)]
struct PlanState {
    learned: Option<Arc<Learned>>,
    region: Option<Arc<Region>>,
}

/// Scope and plan counters, updated without the allocator's lock.
#[derive(Default)]
struct ScopeCounters {
    plan_hits: AtomicU64,
    plan_misses: AtomicU64,
    plan_fallbacks: AtomicU64,
    escapes: AtomicU64,
    region_bytes: AtomicU64,
}

/// A block freed by its user while other streams may still use it.
struct PendingEvent {
    event: EventId,
    block: BlockId,
}

#[derive(Default)]
struct Counters {
    retries: u64,
    ooms: u64,
    device_alloc: u64,
    device_free: u64,
    host_syncs: u64,
    searches: u64,
}

#[derive(Default)]
struct State {
    pool: Pool,
    counters: Counters,
    /// Streams a block was used on besides its own (`record_stream`), by block.
    stream_uses: HashMap<BlockId, Vec<StreamId>>,
    /// Events recorded at free time, per stream they were recorded on, oldest first.
    pending: BTreeMap<StreamId, VecDeque<PendingEvent>>,
    /// Outstanding events per pending block.
    pending_count: HashMap<BlockId, usize>,
    /// Recorded-and-completed events ready for reuse.
    free_events: Vec<EventId>,
    /// Streams that own segments, with how many (cross-stream search is skipped with one).
    segment_streams: BTreeMap<StreamId, usize>,
}

impl<D: Device> Allocator<D> {
    /// An allocator over `device`. Fails only if the device cannot report its memory.
    pub fn new(device: Arc<D>, config: Config) -> Result<Allocator<D>, AllocError> {
        config.validate().map_err(|e| AllocError::Device(DeviceError::Driver(e.to_string())))?;
        let total = device.mem_info()?.total;
        Ok(Allocator {
            shared: Arc::new(Shared {
                device,
                config: ArcSwap::from_pointee(config),
                device_total: total,
                state: Mutex::new(State::default()),
                broken_skip_events: AtomicBool::new(false),
                plans: Mutex::new(HashMap::new()),
                scope_counters: ScopeCounters::default(),
            }),
        })
    }

    /// The device underneath.
    pub fn device(&self) -> &Arc<D> {
        &self.shared.device
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.shared.config.load_full()
    }

    /// Replaces the configuration; allocations already under way finish with the old one.
    pub fn set_config(&self, config: Config) -> Result<(), crate::config::ConfigError> {
        config.validate()?;
        self.shared.config.store(Arc::new(config));
        Ok(())
    }

    /// Allocates `bytes` of transient memory on `stream`.
    ///
    /// A zero-byte request returns an empty buffer at [`DevicePtr::NULL`] that holds no memory.
    pub fn alloc(&self, bytes: u64, stream: StreamId) -> Result<Buffer<D>, AllocError> {
        self.alloc_in(bytes, stream, Residency::Transient)
    }

    /// Allocates `bytes` on `stream` with the given residency. Persistent and transient blocks
    /// never share a segment.
    pub fn alloc_in(
        &self,
        bytes: u64,
        stream: StreamId,
        residency: Residency,
    ) -> Result<Buffer<D>, AllocError> {
        let sh = &self.shared;
        if bytes == 0 {
            return Ok(Buffer::empty(stream, sh.clone()));
        }
        let config = sh.config.load();
        let rounded =
            config.sizing.round(bytes).ok_or(AllocError::InvalidSize { requested: bytes })?;
        let key = PoolKey { residency, stream, kind: config.sizing.kind(rounded) };
        let mut st = lock(&sh.state);
        let block = sh.find_or_reserve(&mut st, &config, key, bytes, rounded)?;
        let block = st.pool.allocate(block, rounded, bytes, &config.sizing);
        let b = st.pool.block(block);
        let (ptr, size) = (DevicePtr(b.addr), b.size);
        drop(st);
        sh.device.note_handout(ptr, size, stream);
        Ok(Buffer {
            ptr,
            requested: bytes,
            size,
            stream,
            origin: Origin::Pool(block),
            scope: None,
            owner: sh.clone(),
        })
    }

    /// Marks `buffer` as used on `stream` as well: when it is freed, its block is held until the
    /// work enqueued on `stream` up to that moment has completed (like
    /// `torch.Tensor.record_stream`). Recording its own stream does nothing.
    pub fn record_stream(&self, buffer: &Buffer<D>, stream: StreamId) {
        if stream == buffer.stream {
            return;
        }
        if let Some(tag) = &buffer.scope {
            tag.used_on(stream);
        }
        let Some(block) = buffer.block() else { return };
        let mut st = lock(&self.shared.state);
        let uses = st.stream_uses.entry(block).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// Releases every cached segment that holds no live or pending block, persistent ones
    /// excepted (see [`Allocator::release_persistent`]). Completed events are processed first.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = lock(&sh.state);
        sh.process_events(&mut st);
        sh.release_segments(&mut st, |s| s.key.residency == Residency::Transient)
    }

    /// Releases cached persistent segments that hold no live block.
    pub fn release_persistent(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = lock(&sh.state);
        sh.process_events(&mut st);
        sh.release_segments(&mut st, |s| s.key.residency == Residency::Persistent)
    }

    /// Returns to the device the free segments cached for `stream` (stranded memory of a stream
    /// that no longer allocates). Call it before destroying a stream.
    pub fn release_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = lock(&sh.state);
        sh.process_events(&mut st);
        sh.release_segments(&mut st, |s| s.key.stream == stream)
    }

    /// Returns the stream's cached segments to the device, then destroys the stream on the
    /// device (which drains its work). Its pending events are waited for first.
    pub fn destroy_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = lock(&sh.state);
        if st.pending.contains_key(&stream) {
            sh.sync_events(&mut st)?;
        }
        sh.release_segments(&mut st, |s| s.key.stream == stream)?;
        drop(st);
        sh.device.destroy_stream(stream)?;
        Ok(())
    }

    /// **Test only — a deliberate bug.** While on, the allocator records no event for
    /// `record_stream` uses and hands another stream's free segments over without ordering, so
    /// tests can prove that the SimDevice sanitizer catches premature reuse.
    #[doc(hidden)]
    pub fn set_broken_skip_events(&self, on: bool) {
        self.shared.broken_skip_events.store(on, Ordering::Relaxed);
    }

    /// Waits for every pending event and returns those blocks to the pool (a host sync per
    /// event).
    pub fn synchronize(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = lock(&sh.state);
        sh.sync_events(&mut st)
    }

    /// A consistent copy of every statistic.
    pub fn stats(&self) -> MemoryStats {
        let st = lock(&self.shared.state);
        let per_stream = st.pool.free_bytes_by_stream();
        MemoryStats {
            blocks: *st.pool.stats(),
            num_alloc_retries: st.counters.retries,
            num_ooms: st.counters.ooms,
            num_device_alloc: st.counters.device_alloc,
            num_device_free: st.counters.device_free,
            num_host_syncs: st.counters.host_syncs,
            best_fit_searches: st.counters.searches,
            plan_hits: sh_load(&self.shared.scope_counters.plan_hits),
            plan_misses: sh_load(&self.shared.scope_counters.plan_misses),
            plan_fallbacks: sh_load(&self.shared.scope_counters.plan_fallbacks),
            plan_region_bytes: sh_load(&self.shared.scope_counters.region_bytes),
            scope_escapes: sh_load(&self.shared.scope_counters.escapes),
            cached_free_bytes_per_stream: per_stream.into_iter().map(|(s, b)| (s.0, b)).collect(),
        }
    }

    /// Bytes currently reserved from the device (cheaper than [`Allocator::stats`]).
    pub fn reserved_bytes(&self) -> u64 {
        lock(&self.shared.state).pool.stats().reserved_bytes.all.current
    }

    /// Bytes currently allocated to live buffers (cheaper than [`Allocator::stats`]).
    pub fn allocated_bytes(&self) -> u64 {
        lock(&self.shared.state).pool.stats().allocated_bytes.all.current
    }

    /// Resets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        lock(&self.shared.state).pool.reset_peak_stats();
    }

    /// Checks the pool's invariants (tiling, no adjacent free blocks, exact stats) and that the
    /// pending-event bookkeeping matches the pending blocks. For tests and fuzzing.
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = lock(&self.shared.state);
        st.pool.check_invariants()?;
        let queued: usize = st.pending.values().map(VecDeque::len).sum();
        let counted: usize = st.pending_count.values().sum();
        if queued != counted {
            return Err(format!("{queued} pending events queued but {counted} counted"));
        }
        for (&b, _) in st.pending_count.iter() {
            if st.pool.block(b).state != BlockState::Pending {
                return Err(format!("block {b:?} has events but is not pending"));
            }
        }
        let mut streams: BTreeMap<StreamId, usize> = BTreeMap::new();
        for (_, seg) in st.pool.segments() {
            *streams.entry(seg.key.stream).or_default() += 1;
        }
        if streams != st.segment_streams {
            return Err("segment count per stream drifted".into());
        }
        Ok(())
    }
}

impl<D: Device> Shared<D> {
    /// Finds a free block for `key` or makes one, climbing the out-of-memory ladder.
    fn find_or_reserve(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        bytes: u64,
        rounded: u64,
    ) -> Result<BlockId, AllocError> {
        if !st.pending.is_empty() {
            self.process_events(st);
        }
        st.counters.searches += 1;
        if let Some(b) = st.pool.find_free(key, rounded, &config.sizing) {
            return Ok(b);
        }
        if let Some(b) = self.take_from_other_stream(st, config, key, rounded)? {
            return Ok(b);
        }
        let seg_size = config.sizing.segment_size(rounded);
        let mut retried = false;
        loop {
            match self.reserve(st, config, key, seg_size) {
                Ok(b) => {
                    if retried {
                        st.counters.retries += 1;
                    }
                    return Ok(b);
                }
                Err(AllocError::OutOfMemory(_)) if !retried => {
                    // The ladder: wait for pending events and search the pool again (their
                    // blocks may now fit), then release cached transient segments and retry.
                    retried = true;
                    if !st.pending.is_empty() {
                        self.sync_events(st)?;
                        if let Some(b) = st.pool.find_free(key, rounded, &config.sizing) {
                            st.counters.retries += 1;
                            return Ok(b);
                        }
                    }
                    self.release_segments(st, |s| s.key.residency == Residency::Transient)?;
                }
                Err(AllocError::OutOfMemory(_)) => {
                    st.counters.ooms += 1;
                    return Err(AllocError::OutOfMemory(Box::new(
                        self.oom_report(st, config, key, bytes, rounded, seg_size),
                    )));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Reserves a new segment for `key`; a refusal (device or limit) is `OutOfMemory`.
    fn reserve(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        seg_size: u64,
    ) -> Result<BlockId, AllocError> {
        let reserved = st.pool.stats().reserved_bytes.all.current;
        let refused = || AllocError::OutOfMemory(Box::default());
        if config.limit(self.device_total).is_some_and(|limit| reserved + seg_size > limit) {
            return Err(refused());
        }
        match self.device.reserve(seg_size) {
            Ok(ptr) => {
                st.counters.device_alloc += 1;
                *st.segment_streams.entry(key.stream).or_default() += 1;
                Ok(st.pool.add_segment(key, ptr.0, seg_size))
            }
            Err(DeviceError::OutOfMemory { .. } | DeviceError::Injected(_)) => Err(refused()),
            Err(e) => Err(AllocError::Device(e)),
        }
    }

    /// Cross-stream reuse: takes a whole free segment cached for another stream, if one fits.
    /// Under `Strict` only when the owner's work is done (an event recorded on it now has already
    /// completed: no host sync); under `WaitEvent` at once, by making `key.stream` wait for that
    /// event on the device.
    fn take_from_other_stream(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if !st.segment_streams.keys().any(|&s| s != key.stream) {
            return Ok(None);
        }
        let fits = |s: &crate::pool::Segment| {
            s.key.stream != key.stream
                && s.key.residency == key.residency
                && s.key.kind == key.kind
                && s.size >= rounded
                && config.sizing.may_serve(s.size, rounded)
        };
        let mut candidates = st.pool.releasable_segments(fits);
        candidates.sort_by_key(|&id| (st.pool.segment(id).size, st.pool.segment(id).base));
        for seg in candidates {
            let owner = st.pool.segment(seg).key.stream;
            let event = self.event(st)?;
            match self.device.record_event(event, owner) {
                Ok(()) => {}
                Err(DeviceError::UnknownStream(_)) => {
                    // The owner was destroyed, hence drained: nothing can still use the segment.
                    st.free_events.push(event);
                    Self::move_segment(st, seg, key.stream);
                    return Ok(Some(st.pool.segment(seg).first));
                }
                Err(e) => {
                    st.free_events.push(event);
                    return Err(e.into());
                }
            }
            let ready = match config.cross_stream {
                _ if self.broken_skip_events.load(Ordering::Relaxed) => true,
                CrossStream::WaitEvent => {
                    self.device.wait_event(key.stream, event)?;
                    true
                }
                CrossStream::Strict => self.device.query_event(event).unwrap_or(false),
            };
            st.free_events.push(event);
            if ready {
                Self::move_segment(st, seg, key.stream);
                return Ok(Some(st.pool.segment(seg).first));
            }
        }
        Ok(None)
    }

    fn move_segment(st: &mut State, seg: SegmentId, to: StreamId) {
        let from = st.pool.segment(seg).key.stream;
        st.pool.rekey_segment(seg, to);
        Self::forget_segment(st, from);
        *st.segment_streams.entry(to).or_default() += 1;
    }

    fn forget_segment(st: &mut State, stream: StreamId) {
        if let Some(n) = st.segment_streams.get_mut(&stream) {
            *n -= 1;
            if *n == 0 {
                st.segment_streams.remove(&stream);
            }
        }
    }

    /// An event from the pool, or a new one.
    fn event(&self, st: &mut State) -> Result<EventId, AllocError> {
        match st.free_events.pop() {
            Some(e) => Ok(e),
            None => Ok(self.device.create_event()?),
        }
    }

    /// Releases segments with no busy block that satisfy `which`. Each release is a host sync.
    fn release_segments(
        &self,
        st: &mut State,
        which: impl FnMut(&crate::pool::Segment) -> bool,
    ) -> Result<(), AllocError> {
        for seg in st.pool.releasable_segments(which) {
            let base = st.pool.segment(seg).base;
            // Release on the device first: if it fails, the segment stays cached and consistent.
            self.device.release(DevicePtr(base))?;
            let stream = st.pool.segment(seg).key.stream;
            st.pool.remove_segment(seg);
            Self::forget_segment(st, stream);
            st.counters.device_free += 1;
            st.counters.host_syncs += 1;
        }
        Ok(())
    }

    /// Frees a block on behalf of a dropped buffer.
    fn free(&self, block: BlockId, ptr: DevicePtr, size: u64, stream: StreamId) {
        self.device.note_reclaim(ptr, size, stream);
        let mut st = lock(&self.state);
        let uses = if st.stream_uses.is_empty() {
            Vec::new()
        } else {
            st.stream_uses.remove(&block).unwrap_or_default()
        };
        if uses.is_empty() || self.broken_skip_events.load(Ordering::Relaxed) {
            st.pool.free(block);
            return;
        }
        st.pool.mark_pending(block);
        let mut recorded = 0;
        for s in uses {
            let event = match self.event(&mut st) {
                Ok(e) => e,
                Err(_) => continue,
            };
            if self.device.record_event(event, s).is_err() {
                // The stream is gone (destroyed, hence drained): nothing to wait for.
                st.free_events.push(event);
                continue;
            }
            st.pending.entry(s).or_default().push_back(PendingEvent { event, block });
            recorded += 1;
        }
        if recorded == 0 {
            st.pool.free(block);
        } else {
            st.pending_count.insert(block, recorded);
        }
    }

    /// Polls pending events without blocking, oldest first per stream; frees blocks whose
    /// events all completed. A failing query counts as "not yet".
    fn process_events(&self, st: &mut State) {
        let streams: Vec<StreamId> = st.pending.keys().copied().collect();
        for s in streams {
            while let Some(front) = st.pending.get(&s).and_then(VecDeque::front) {
                if !self.device.query_event(front.event).unwrap_or(false) {
                    break;
                }
                let done =
                    st.pending.get_mut(&s).and_then(VecDeque::pop_front).expect("front exists");
                Self::event_done(st, done);
            }
            if st.pending.get(&s).is_some_and(VecDeque::is_empty) {
                st.pending.remove(&s);
            }
        }
    }

    /// Blocks until every pending event completed, freeing their blocks. A host sync per event.
    fn sync_events(&self, st: &mut State) -> Result<(), AllocError> {
        while let Some((&s, _)) = st.pending.iter().next() {
            while let Some(front) = st.pending.get(&s).and_then(VecDeque::front) {
                st.counters.host_syncs += 1;
                self.device.synchronize_event(front.event)?;
                let done =
                    st.pending.get_mut(&s).and_then(VecDeque::pop_front).expect("front exists");
                Self::event_done(st, done);
            }
            st.pending.remove(&s);
        }
        Ok(())
    }

    fn event_done(st: &mut State, done: PendingEvent) {
        st.free_events.push(done.event);
        let n = st.pending_count.get_mut(&done.block).expect("pending block has a count");
        *n -= 1;
        if *n == 0 {
            st.pending_count.remove(&done.block);
            st.pool.free(done.block);
        }
    }

    fn oom_report(
        &self,
        st: &State,
        config: &Config,
        key: PoolKey,
        bytes: u64,
        rounded: u64,
        seg_size: u64,
    ) -> OomReport {
        let info = self
            .device
            .mem_info()
            .unwrap_or(crate::device::MemInfo { free: 0, total: self.device_total });
        let s = st.pool.stats();
        OomReport {
            requested: bytes,
            rounded,
            segment: seg_size,
            stream: key.stream,
            device_free: info.free,
            device_total: info.total,
            limit: config.limit(self.device_total),
            reserved: s.reserved_bytes.all.current,
            allocated: s.allocated_bytes.all.current,
            largest_free_block: st.pool.largest_free_block(),
            inactive_split: s.inactive_split_bytes.all.current,
            free_on_other_streams: st.pool.free_bytes_where(|k| k.stream != key.stream),
            waiting_on_events: s.active_bytes.all.current - s.allocated_bytes.all.current,
            persistent_reserved: s.reserved_bytes.persistent.current,
            transient_reserved: s.reserved_bytes.transient.current,
        }
    }

    /// The plan learned for a named scope and its region, if any.
    fn plan_for(
        &self,
        name: &str,
        stream: StreamId,
    ) -> (Option<Arc<Learned>>, Option<Arc<Region>>) {
        let plans = lock(&self.plans);
        match plans.get(&(name.to_string(), stream)) {
            Some(p) => (p.learned.clone(), p.region.clone()),
            None => (None, None),
        }
    }

    /// Stores what a named scope learned on `stream`; the old plan's region is let go (it
    /// returns to the pool once no escaped buffer holds it).
    fn learn(&self, name: &str, stream: StreamId, learned: Option<Learned>) {
        let old = {
            let mut plans = lock(&self.plans);
            let entry = plans.entry((name.to_string(), stream)).or_default();
            entry.learned = learned.map(Arc::new);
            entry.region.take()
        };
        if let Some(region) = old {
            self.release_region(region);
        }
    }

    /// Reserves the region of a named scope's plan: the stream's cached transient segments
    /// with no live block are released first (the plan replaces them), then one block of
    /// `size` bytes is taken from the pool.
    fn make_region(
        &self,
        name: &str,
        stream: StreamId,
        size: u64,
    ) -> Result<Arc<Region>, AllocError> {
        let mut plans = lock(&self.plans);
        let entry = plans.entry((name.to_string(), stream)).or_default();
        if let Some(r) = &entry.region {
            return Ok(r.clone());
        }
        let config = self.config.load();
        let rounded =
            config.sizing.round(size).ok_or(AllocError::InvalidSize { requested: size })?;
        let key =
            PoolKey { residency: Residency::Transient, stream, kind: config.sizing.kind(rounded) };
        let mut st = lock(&self.state);
        self.release_segments(&mut st, |s| {
            s.key.stream == stream && s.key.residency == Residency::Transient
        })?;
        let block = self.find_or_reserve(&mut st, &config, key, size, rounded)?;
        let block = st.pool.allocate(block, rounded, size, &config.sizing);
        let base = st.pool.block(block).addr;
        drop(st);
        self.scope_counters.region_bytes.fetch_add(rounded, Ordering::Relaxed);
        let region = Arc::new(Region::new(block, base, rounded));
        entry.region = Some(region.clone());
        Ok(region)
    }

    /// Drops one hold on a region; the last one returns its block to the pool.
    fn release_region(&self, region: Arc<Region>) {
        if let Ok(r) = Arc::try_unwrap(region) {
            lock(&self.state).pool.free(r.block);
            self.scope_counters.region_bytes.fetch_sub(r.size, Ordering::Relaxed);
        }
    }

    /// Returns a scope's locally cached blocks to the pool under one lock.
    fn free_blocks(&self, blocks: &[BlockId]) {
        if blocks.is_empty() {
            return;
        }
        let mut st = lock(&self.state);
        for &b in blocks {
            st.pool.free(b);
        }
    }

    /// Makes `stream`'s later work wait, on the device, for the work enqueued so far on each of
    /// `others` (a freed planned buffer that was used on other streams). No host sync.
    fn order_after(&self, stream: StreamId, others: &[StreamId]) {
        if others.is_empty() || self.broken_skip_events.load(Ordering::Relaxed) {
            return;
        }
        let mut st = lock(&self.state);
        for &other in others {
            let Ok(event) = self.event(&mut st) else { continue };
            if self.device.record_event(event, other).is_ok() {
                let _ = self.device.wait_event(stream, event);
            }
            st.free_events.push(event);
        }
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }
}

impl<D: Device> Drop for Shared<D> {
    /// The last handle and the last buffer are gone: wait for pending events and return every
    /// segment to the device.
    fn drop(&mut self) {
        let plans = std::mem::take(&mut *lock(&self.plans));
        let mut st = self.lock_state();
        let mut st = std::mem::take(&mut *st);
        // No buffer is left (each holds the allocator), so the plans hold the only regions.
        for (_, plan) in plans {
            if let Some(r) = plan.region.and_then(|r| Arc::try_unwrap(r).ok()) {
                st.pool.free(r.block);
            }
        }
        let _ = self.sync_events(&mut st);
        let _ = self.release_segments(&mut st, |_| true);
        for e in st.free_events.drain(..) {
            let _ = self.device.destroy_event(e);
        }
    }
}

fn sh_load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}
