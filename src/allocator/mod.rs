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
//! The pool and the event queues sit behind one lock (`Shared::state`): the slow path. Blocks
//! freed after a `record_stream` wait in per-stream FIFO queues of events until their uses
//! completed. The common case — a free and a re-allocation of the same class on the same stream —
//! goes through that stream's cache instead (`fast_cache.rs`) and never takes the global lock;
//! statistics are published through sequence locks and read without any lock (`counters.rs`);
//! the configuration is swapped as a whole (`request.rs`). `global_lock:true` turns all of that
//! off (everything under the one lock, PyTorch's design) as a comparison point.

mod adopt;
mod batch;
mod buffer;
mod counters;
mod error;
mod fast_cache;
mod owner;
mod plan;
mod report;
mod request;
mod scope;
mod seqlock;

pub use buffer::Buffer;
pub use error::{AllocError, OomReport};
pub use report::{BlockInfo, SegmentInfo};
pub use scope::{Scope, ScopedBuffer};

/// The lock-free pieces, exposed for the loom models in `loom-tests/` (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
pub(crate) mod internals {
    pub use super::batch::{BatchBlock, return_batch};
    pub use super::counters::{
        BASE_WORDS, BYTES, BaseStats, CACHED_BLOCKS, CACHED_BYTES, COUNT, CacheList, FAST_WORDS,
        REQ, Snapshot, assemble, collect, fast_cur, fast_tot, quadrant,
    };
    pub use super::fast_cache::{
        CacheTable, CachedBlock, ClassKey, FAST_STREAMS, Limits, Pop, StreamCache, flush_into,
    };
    pub use super::request::RequestPlan;
    pub use super::seqlock::{Collect, SeqBlock, SeqWriter, Versioned};
    pub use crate::sync::{ArcCell, ArcRef};
}

use crate::config::{Config, CrossStream};
use crate::device::{Device, DeviceAddr, DeviceError, EventId, StreamId};
use crate::pool::{BlockId, BlockState, Pool, PoolKey, SegmentId};
use crate::stats::{MemoryStats, Residency};
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::{Arc, ArcCell, Mutex, MutexGuard, lock};
use batch::BatchBlock;
use buffer::Origin;
use counters::{BASE_WORDS, BaseStats, quadrant};
use fast_cache::{CacheTable, CachedBlock, ClassKey, Limits, Pop, StreamCache, flush_into};
use owner::OwnerTable;
use plan::{Learned, Region};
use request::RequestPlan;
use seqlock::SeqBlock;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::{Deref, DerefMut};

/// Attempts of a lock-free statistics read before it takes the locks instead.
const STATS_TRIES: usize = 64;

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
    /// What buffers hold, one per stream (see `owner.rs`).
    owners: Arc<OwnerTable<D>>,
}

impl<D: Device> Clone for Allocator<D> {
    fn clone(&self) -> Self {
        Allocator { shared: self.shared.clone(), owners: self.owners.clone() }
    }
}

pub(crate) struct Shared<D: Device> {
    device: Arc<D>,
    config: ArcCell<Config>,
    device_total: u64,
    state: Mutex<State>,
    /// One cache per stream that owns memory; added to under `state`'s lock.
    caches: CacheTable,
    /// Whether frees may use the stream caches (`Config::fast_path`), set with the config.
    fast_path: AtomicBool,
    /// Whether statistics are published for lock-free readers (off under `global_lock`, where
    /// `stats()` reads them under the lock), set with the config.
    publish_stats: AtomicBool,
    /// The base statistics as published by the slow path (see `counters.rs`).
    stats: SeqBlock<BASE_WORDS>,
    /// Test-only deliberate bug: skip every event that orders cross-stream reuse.
    broken_skip_events: AtomicBool,
    /// Acquisitions of `state`'s lock, for tests proving the fast path skips it.
    lock_count: AtomicU64,
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
    searches: AtomicU64,
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
    /// Statistics kept under this lock, published when the lock is let go.
    base: BaseStats,
    /// Scratch list of streams whose pool free bytes changed.
    dirty: Vec<StreamId>,
}

/// The global lock held: publishes the statistics when let go.
struct Locked<'a, D: Device> {
    sh: &'a Shared<D>,
    st: MutexGuard<'a, State>,
}

impl<D: Device> Deref for Locked<'_, D> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.st
    }
}

impl<D: Device> DerefMut for Locked<'_, D> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.st
    }
}

impl<D: Device> Drop for Locked<'_, D> {
    fn drop(&mut self) {
        self.sh.publish(&mut self.st);
    }
}

impl<D: Device> Allocator<D> {
    /// An allocator over `device`. Fails only if the device cannot report its memory.
    pub fn new(device: Arc<D>, config: Config) -> Result<Allocator<D>, AllocError> {
        config.validate().map_err(|e| AllocError::Device(DeviceError::Driver(e.to_string())))?;
        let total = device.mem_info()?.total;
        let (fast, global_lock) = (config.fast_path(), config.global_lock);
        let shared = Arc::new(Shared {
            device,
            config: ArcCell::new(config),
            device_total: total,
            state: Mutex::new(State::default()),
            caches: CacheTable::default(),
            fast_path: AtomicBool::new(fast),
            publish_stats: AtomicBool::new(!global_lock),
            stats: SeqBlock::new(),
            broken_skip_events: AtomicBool::new(false),
            plans: Mutex::new(HashMap::new()),
            scope_counters: ScopeCounters::default(),
            lock_count: AtomicU64::new(0),
        });
        Ok(Allocator { owners: Arc::new(OwnerTable::new(&shared)), shared })
    }

    /// The device underneath.
    pub fn device(&self) -> &Arc<D> {
        &self.shared.device
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.shared.config.load_full()
    }

    /// Replaces the configuration; allocations already under way finish with the old one (each
    /// allocation loads the configuration once). The stream caches are flushed and take the new
    /// limits.
    pub fn set_config(&self, config: Config) -> Result<(), crate::config::ConfigError> {
        config.validate()?;
        let sh = &self.shared;
        let mut st = sh.lock_state();
        let limits = limits(&config);
        sh.fast_path.store(config.fast_path(), Ordering::Relaxed);
        sh.publish_stats.store(!config.global_lock, Ordering::Relaxed);
        for c in sh.caches.all().iter() {
            c.set_limits(limits);
        }
        sh.flush_all(&mut st);
        // Published statistics are current before a lock-free reader can see the new config.
        sh.publish(&mut st);
        sh.config.store(Arc::new(config));
        Ok(())
    }

    /// Allocates `bytes` of transient memory on `stream`.
    ///
    /// A zero-byte request returns an empty buffer at [`DeviceAddr::NULL`] that holds no memory.
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
            return Ok(self.hand_out(DeviceAddr::NULL, 0, 0, stream, None, 0, residency, 0));
        }
        let plan = RequestPlan::new(&sh.config, bytes)?;
        let config = &*plan.config;
        let class = ClassKey { residency, rounded: plan.rounded };
        let mut cached = None;
        if plan.fast {
            // This thread's lane first, then the stream's other lanes (a block freed on another
            // thread), each under its own lock only.
            for lane in 0..fast_cache::LANES {
                let Some(cache) = sh.caches.fast_lane(stream, lane) else { break };
                match cache.pop(class, bytes) {
                    Pop::Hit(b) => {
                        return Ok(self.hand_out_cached(&b, bytes, stream, &plan, residency));
                    }
                    Pop::NeedsLock => {
                        cached = Some(cache);
                        break;
                    }
                    Pop::Miss => {}
                }
            }
        }
        let mut st = sh.lock_state();
        if let Some(b) = cached.and_then(|c| c.pop_locked(class)) {
            // A cached block for another request size, or beyond the stream's credit: account
            // it here, where the peak can be raised exactly.
            if b.requested != bytes {
                st.pool.set_requested(b.block, bytes);
            }
            st.base.live_up(b.quadrant, b.size, bytes, || sh.caches.all());
            drop(st);
            return Ok(self.hand_out_cached(&b, bytes, stream, &plan, residency));
        }
        if !plan.fast
            && config.fast_path()
            && let Some(b) = sh.reuse_large(&mut st, stream, class, bytes, &config.sizing)
        {
            drop(st);
            return Ok(self.hand_out_cached(&b, bytes, stream, &plan, residency));
        }
        let key = PoolKey { residency, stream, kind: plan.kind };
        let block = sh.find_or_reserve(&mut st, config, key, bytes, plan.rounded)?;
        let block = st.pool.allocate(block, plan.rounded, bytes, &config.sizing);
        let b = st.pool.block(block);
        let (ptr, size) = (DeviceAddr(b.addr), b.size);
        let q = quadrant(key.kind, residency);
        st.base.live_up(q, size, bytes, || sh.caches.all());
        drop(st);
        Ok(self.hand_out(ptr, bytes, size, stream, Some(block), plan.rounded, residency, q))
    }

    /// Frees `buffers` under one acquisition of the global lock, straight into the pool so they
    /// coalesce at once (no stream cache), then flushes their streams' caches — what a scope's
    /// exit does. Buffers with uses on other streams take the ordinary stream-ordered path.
    pub fn free_batch(&self, buffers: Vec<Buffer<D>>) {
        let sh = &self.shared;
        let mut batch: BTreeMap<StreamId, Vec<BatchBlock>> = BTreeMap::new();
        for mut buf in buffers {
            if buf.used_elsewhere() {
                continue; // dropped at the end of this iteration: the ordinary free
            }
            if buf.scope.is_some() {
                continue; // its scope records the free: the ordinary path
            }
            let Origin::Pool(block) = buf.origin else { continue };
            buf.origin = Origin::None;
            sh.device.note_reclaim(buf.ptr, buf.size, buf.stream);
            batch.entry(buf.stream).or_default().push(BatchBlock {
                block,
                quadrant: buf.quadrant as usize,
                size: buf.size,
                requested: buf.accounted,
            });
        }
        if batch.is_empty() {
            return;
        }
        let mut st = sh.lock_state();
        for (&stream, blocks) in &batch {
            sh.return_to_stream(&mut st, stream, blocks);
        }
    }

    /// Marks `buffer` as used on `stream` as well: when it is freed, its block is held until the
    /// work enqueued on `stream` up to that moment has completed (like
    /// `torch.Tensor.record_stream`). Recording its own stream does nothing.
    pub fn record_stream(&self, buffer: &Buffer<D>, stream: StreamId) {
        if stream == buffer.stream {
            return;
        }
        buffer.mark_used_elsewhere();
        if let Some(tag) = &buffer.scope {
            tag.used_on(stream);
        }
        let Some(block) = buffer.block() else { return };
        let mut st = self.shared.lock_state();
        let uses = st.stream_uses.entry(block).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// Releases every cached segment that holds no live or pending block, persistent ones
    /// excepted (see [`Allocator::release_persistent`]). Completed events are processed first.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        sh.flush_all(&mut st);
        sh.process_events(&mut st);
        sh.release_segments(&mut st, |s| s.key.residency == Residency::Transient)
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
    pub fn release_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        sh.flush_stream(&mut st, stream, false);
        sh.process_events(&mut st);
        sh.release_segments(&mut st, |s| s.key.stream == stream)
    }

    /// Returns the stream's cached segments to the device, then destroys the stream on the
    /// device (which drains its work). Its pending events are waited for first.
    pub fn destroy_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        sh.flush_stream(&mut st, stream, true);
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

    /// **Test only.** How many times the global lock has been taken so far (tests use it to
    /// prove that the fast path does not take it).
    #[doc(hidden)]
    pub fn global_lock_acquisitions(&self) -> u64 {
        self.shared.lock_count.load(Ordering::Relaxed)
    }

    /// Waits for every pending event and returns those blocks to the pool (a host sync per
    /// event).
    pub fn synchronize(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        sh.sync_events(&mut st)
    }

    /// A consistent copy of every statistic, read without the global lock (see `counters.rs`):
    /// one double collect over the published base and stream-cache statistics. Under
    /// `global_lock:true` it is read under the lock instead; if writers keep interfering, too.
    pub fn stats(&self) -> MemoryStats {
        let sh = &self.shared;
        if !sh.config.load().global_lock
            && let Some((table, snap)) =
                counters::collect(&sh.stats, || sh.caches.all(), STATS_TRIES)
        {
            return sh.with_scope_stats(stats_from(&table, snap));
        }
        // Under the lock: exact, whether or not the statistics are being published.
        let mut st = sh.lock_state();
        let all = sh.caches.all();
        let inners: Vec<_> = all.iter().map(|c| c.lock_inner()).collect();
        let st = &mut *st;
        let c = &st.counters;
        st.base.mirror(
            st.pool.stats(),
            [c.retries, c.ooms, c.device_alloc, c.device_free, c.host_syncs],
        );
        let snap = counters::Snapshot {
            base: *st.base.words(),
            fast: inners.iter().map(|i| i.words).collect(),
            pool_free: (0..all.len())
                .map(|i| match CacheTable::is_first_lane(&all, i) {
                    true => st.pool.free_bytes_of(all[i].stream()),
                    false => 0,
                })
                .collect(),
        };
        drop(inners);
        sh.with_scope_stats(stats_from(&all, snap))
    }

    /// Bytes currently reserved from the device.
    pub fn reserved_bytes(&self) -> u64 {
        self.stats().blocks.reserved_bytes.all.current
    }

    /// Bytes currently allocated to live buffers.
    pub fn allocated_bytes(&self) -> u64 {
        self.stats().blocks.allocated_bytes.all.current
    }

    /// Resets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        st.pool.reset_peak_stats();
        st.base.reset_peaks(&sh.caches.all());
    }

    /// Checks the pool's invariants (tiling, no adjacent free blocks, exact stats), that the
    /// pending-event bookkeeping matches the pending blocks, that every stream-cached block is
    /// allocated in the pool under its stream, and that the published statistics equal the
    /// pool's minus the cached blocks, below their peaks. For tests and fuzzing; it takes every
    /// lock, so it may run while other threads allocate.
    pub fn check_invariants(&self) -> Result<(), String> {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        if !sh.publish_stats.load(Ordering::Relaxed) {
            // Under `global_lock` the kept statistics are brought up to date only when read.
            let st = &mut *st;
            let c = &st.counters;
            let counters = [c.retries, c.ooms, c.device_alloc, c.device_free, c.host_syncs];
            st.base.mirror(st.pool.stats(), counters);
        }
        let table = sh.caches.all();
        let inners: Vec<_> = table.iter().map(|c| c.lock_inner()).collect();
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
        let mut cached = Vec::new();
        for (i, (c, inner)) in table.iter().zip(&inners).enumerate() {
            for (class, b) in inner.entries() {
                let blk = st.pool.block(b.block);
                let key = st.pool.segment(blk.segment).key;
                if blk.state != BlockState::Allocated
                    || blk.addr != b.ptr.0
                    || blk.size != b.size
                    || blk.requested != b.requested
                    || key.stream != c.stream()
                    || key.residency != class.residency
                    || quadrant(key.kind, key.residency) != b.quadrant
                {
                    return Err(format!("cached block at {} does not match the pool", b.ptr));
                }
                cached.push(b);
            }
            // Lane 0 of a stream publishes its pool free bytes; the other lanes none.
            let free = match CacheTable::is_first_lane(&table, i) {
                true => st.pool.free_bytes_of(c.stream()),
                false => 0,
            };
            if sh.publish_stats.load(Ordering::Relaxed) && free != c.slow_block().get(0) {
                return Err(format!("published free bytes of {} drifted", c.stream()));
            }
        }
        let refs: Vec<&fast_cache::CacheInner> = inners.iter().map(|g| &**g).collect();
        let exact = st.base.exact(&refs);
        drop(inners);
        let mut expect = counters::currents(st.pool.stats());
        let minus = counters::currents(&counters::cached_in_pool(&st.pool, &cached));
        for (row, m) in expect.iter_mut().zip(minus) {
            for (v, m) in row.iter_mut().zip(m) {
                *v -= m;
            }
        }
        if counters::currents(&exact) != expect {
            return Err(format!(
                "statistics drifted: kept {:?}, expected {expect:?}",
                counters::currents(&exact)
            ));
        }
        st.base.check(&exact)
    }
}

/// `Allocator` is shared between threads and `Buffer` may be freed on any thread.
#[allow(dead_code)]
fn assert_thread_safety<D: Device>() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Allocator<D>>();
    send_sync::<Buffer<D>>();
}
const _: fn() = assert_thread_safety::<crate::device::SimDevice>;

/// What a stream may cache under `config`.
fn limits(config: &Config) -> Limits {
    Limits {
        enabled: config.fast_path(),
        entries: config.fast_cache_entries,
        bytes: config.fast_cache_bytes,
    }
}

/// Builds [`MemoryStats`] from one consistent copy.
fn stats_from(caches: &[Arc<StreamCache>], snap: counters::Snapshot) -> MemoryStats {
    let counters::Snapshot { base, fast, pool_free: slow } = snap;
    let [retries, ooms, device_alloc, device_free, host_syncs] = counters::counters(&base);
    let mut per_stream = Vec::new();
    let mut cached_fast_bytes = 0;
    for ((c, f), pool_free) in caches.iter().zip(&fast).zip(&slow) {
        let cached = f[counters::CACHED_BYTES];
        cached_fast_bytes += cached;
        // The lanes of a stream are adjacent: one entry per stream.
        match per_stream.last_mut() {
            Some((s, bytes)) if *s == c.stream().0 => *bytes += cached + pool_free,
            _ => per_stream.push((c.stream().0, cached + pool_free)),
        }
    }
    per_stream.retain(|&(_, bytes)| bytes > 0);
    MemoryStats {
        blocks: counters::assemble(&base, &fast),
        num_alloc_retries: retries,
        num_ooms: ooms,
        num_device_alloc: device_alloc,
        num_device_free: device_free,
        num_host_syncs: host_syncs,
        cached_free_bytes_per_stream: per_stream,
        cached_fast_bytes,
        ..MemoryStats::default()
    }
}

impl<D: Device> Allocator<D> {
    /// A buffer for a block popped from a stream cache.
    fn hand_out_cached(
        &self,
        b: &CachedBlock,
        bytes: u64,
        stream: StreamId,
        plan: &RequestPlan,
        residency: Residency,
    ) -> Buffer<D> {
        let (rounded, q) = (plan.rounded, b.quadrant);
        self.hand_out(b.ptr, bytes, b.size, stream, Some(b.block), rounded, residency, q)
    }

    /// A buffer for a block just handed out; tells the device's sanitizer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hand_out(
        &self,
        ptr: DeviceAddr,
        requested: u64,
        size: u64,
        stream: StreamId,
        block: Option<BlockId>,
        rounded: u64,
        residency: Residency,
        quadrant: usize,
    ) -> Buffer<D> {
        if block.is_some() {
            self.shared.device.note_handout(ptr, size, stream);
        }
        Buffer {
            ptr,
            requested,
            accounted: requested,
            size,
            stream,
            origin: block.map_or(Origin::None, Origin::Pool),
            scope: None,
            owner: self.owners.owner(stream),
            rounded,
            residency,
            quadrant: quadrant as u8,
            used_elsewhere: AtomicBool::new(false),
        }
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
        self.scope_counters.searches.fetch_add(1, Ordering::Relaxed);
        if key.kind == crate::stats::PoolKind::Large {
            // A large block waiting in a stream cache is searched as the pool would hold it.
            self.flush_large(st);
        }
        if let Some(b) = st.pool.find_free(key, rounded, &config.sizing) {
            return Ok(b);
        }
        // Before going further afield, return what the stream caches hold: they never make the
        // allocator reserve more than it would without them.
        if self.flush_all(st) > 0
            && let Some(b) = st.pool.find_free(key, rounded, &config.sizing)
        {
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
                self.ensure_cache(st, key.stream);
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
                    self.move_segment(st, seg, key.stream);
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
                self.move_segment(st, seg, key.stream);
                return Ok(Some(st.pool.segment(seg).first));
            }
        }
        Ok(None)
    }

    fn move_segment(&self, st: &mut State, seg: SegmentId, to: StreamId) {
        self.ensure_cache(st, to);
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
            self.device.release(DeviceAddr(base))?;
            let stream = st.pool.segment(seg).key.stream;
            st.pool.remove_segment(seg);
            Self::forget_segment(st, stream);
            st.counters.device_free += 1;
            st.counters.host_syncs += 1;
        }
        Ok(())
    }

    /// Frees a block on behalf of a dropped buffer: into its stream's cache when it has no uses
    /// on other streams and the cache has room (no global lock), else into the pool or, after
    /// `record_stream`, behind events. A large-pool block goes to the stream's first lane, which
    /// holds at most one: it is reused only where that is exactly the pool's best fit
    /// ([`Shared::reuse_large`]), and any other search of the large pool frees it first.
    fn free(&self, f: buffer::Freed) {
        self.device.note_reclaim(f.ptr, f.size, f.stream);
        if !f.used_elsewhere
            && self.fast_path.load(Ordering::Relaxed)
            && let Some(cache) = match counters::is_small(f.quadrant) {
                true => self.caches.fast(f.stream),
                false => self.caches.first_lane(f.stream),
            }
        {
            let class = ClassKey { residency: f.residency, rounded: f.rounded };
            let b = CachedBlock {
                block: f.block,
                ptr: f.ptr,
                size: f.size,
                requested: f.requested,
                quadrant: f.quadrant,
            };
            if cache.push(class, b).is_ok() {
                return;
            }
        }
        let block = f.block;
        let mut st = self.lock_state();
        let uses = if st.stream_uses.is_empty() {
            Vec::new()
        } else {
            st.stream_uses.remove(&block).unwrap_or_default()
        };
        if uses.is_empty() || self.broken_skip_events.load(Ordering::Relaxed) {
            st.pool.free(block);
            st.base.live_down(f.quadrant, f.size, f.requested);
            return;
        }
        st.pool.mark_pending(block);
        st.base.to_pending(f.quadrant, f.size);
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
            st.base.pending_done(f.quadrant, f.size, f.requested);
        } else {
            st.pending_count.insert(block, recorded);
        }
    }

    /// Flushes every stream cache into the pool; returns how many blocks moved.
    fn flush_all(&self, st: &mut State) -> usize {
        let mut n = 0;
        for c in self.caches.all().iter() {
            if c.cached_blocks() > 0 {
                n += flush_into(c, &mut st.pool).len();
            }
        }
        n
    }

    /// Frees into the pool the large-pool block each stream cache may hold, so that a search of
    /// the large pool sees them as if they had never been cached. The caller holds the global
    /// lock. (A block cached concurrently is as if freed after the search.)
    fn flush_large(&self, st: &mut State) {
        for c in self.caches.all().iter() {
            if c.large_blocks() > 0
                && let Some(b) = c.drain_large()
            {
                st.pool.free(b.block);
            }
        }
    }

    /// Same-stream reuse of a large block without the pool's split and coalesce: the block
    /// `stream` caches for `class`, if handing it out is exactly what freeing it and taking the
    /// best fit would do ([`Pool::reuse_is_best_fit`]; the stream holds no other large block
    /// back from the pool). Accounted like a stream-cache hit. The caller holds the global lock.
    fn reuse_large(
        &self,
        st: &mut State,
        stream: StreamId,
        class: ClassKey,
        bytes: u64,
        sizing: &crate::pool::Sizing,
    ) -> Option<CachedBlock> {
        let cache = self.caches.first_lane(stream)?;
        if cache.large_blocks() == 0 {
            return None;
        }
        let pool = &st.pool;
        match cache
            .pop_checked(class, bytes, |b| pool.reuse_is_best_fit(b.block, class.rounded, sizing))
        {
            Pop::Hit(b) => Some(b),
            Pop::Miss => None,
            Pop::NeedsLock => {
                // Accepted, but another request size or too little credit: account it here.
                // Large blocks are popped under the global lock only, so it is the same block.
                let b = cache.pop_locked(class)?;
                if b.requested != bytes {
                    st.pool.set_requested(b.block, bytes);
                }
                st.base.live_up(b.quadrant, b.size, bytes, || self.caches.all());
                Some(b)
            }
        }
    }

    /// Flushes one stream's cache into the pool, closing it first if the stream goes away.
    fn flush_stream(&self, st: &mut State, stream: StreamId, close: bool) {
        for c in self.caches.lanes(stream) {
            if close {
                c.close();
            }
            flush_into(&c, &mut st.pool);
        }
    }

    /// Gives `stream` a cache if it has none (it is about to own memory).
    fn ensure_cache(&self, st: &mut State, stream: StreamId) {
        if self.caches.get(stream).is_some() {
            return;
        }
        let limits = limits(&self.config.load());
        let lanes: Vec<_> =
            (0..fast_cache::LANES).map(|_| Arc::new(StreamCache::new(stream, limits))).collect();
        lanes[0].publish_pool_free(st.pool.free_bytes_of(stream));
        self.caches.add(lanes);
        // Readers that loaded the old table must retry.
        st.base.touch(&self.stats);
    }

    /// Takes the global lock; the statistics are published when it is let go.
    fn lock_state(&self) -> Locked<'_, D> {
        self.lock_count.fetch_add(1, Ordering::Relaxed);
        Locked { sh: self, st: lock(&self.state) }
    }

    /// Publishes the base statistics and the pool's free bytes of every stream that changed
    /// (unless `global_lock` is on: then changes accumulate until it is turned off).
    fn publish(&self, st: &mut State) {
        if !self.publish_stats.load(Ordering::Relaxed) {
            return;
        }
        let c = &st.counters;
        let counters = [c.retries, c.ooms, c.device_alloc, c.device_free, c.host_syncs];
        let changed = st.pool.take_changed();
        st.base.mirror_changed(st.pool.stats(), counters, changed);
        st.base.publish(&self.stats);
        let mut dirty = std::mem::take(&mut st.dirty);
        st.pool.take_dirty_streams(&mut dirty);
        for &s in &dirty {
            match self.caches.first_lane(s) {
                Some(c) => c.publish_pool_free(st.pool.free_bytes_of(s)),
                None => {
                    if let Some(c) = self.caches.get(s) {
                        c.publish_pool_free(st.pool.free_bytes_of(s));
                    }
                }
            }
        }
        st.dirty = dirty;
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
            let b = st.pool.block(done.block);
            let (size, requested) = (b.size, b.requested);
            let key = st.pool.segment(b.segment).key;
            st.pool.free(done.block);
            st.base.pending_done(quadrant(key.kind, key.residency), size, requested);
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

    /// Adds the scope and plan counters to statistics read elsewhere.
    fn with_scope_stats(&self, mut m: MemoryStats) -> MemoryStats {
        let c = &self.scope_counters;
        m.best_fit_searches = sh_load(&c.searches);
        m.plan_hits = sh_load(&c.plan_hits);
        m.plan_misses = sh_load(&c.plan_misses);
        m.plan_fallbacks = sh_load(&c.plan_fallbacks);
        m.plan_region_bytes = sh_load(&c.region_bytes);
        m.scope_escapes = sh_load(&c.escapes);
        m
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
        if config.sizing.round(size).is_none() {
            return Err(AllocError::InvalidSize { requested: size });
        }
        let mut st = self.lock_state();
        // The stream's cached blocks go back to the pool first, so the trim can release them.
        self.flush_stream(&mut st, stream, false);
        self.release_segments(&mut st, |s| {
            s.key.stream == stream && s.key.residency == Residency::Transient
        })?;
        let (block, base) = self.region_block(&mut st, &config, stream, size)?;
        drop(st);
        let bsize = block.size;
        self.scope_counters.region_bytes.fetch_add(bsize, Ordering::Relaxed);
        let region = Arc::new(Region::new(vec![block], base, bsize));
        entry.region = Some(region.clone());
        Ok(region)
    }

    /// Drops one hold on a region; the last one returns its block to the pool.
    fn release_region(&self, region: Arc<Region>) {
        if let Some(r) = crate::sync::arc_into_inner(region) {
            let size = r.size;
            let blocks = r.into_blocks();
            let mut st = self.lock_state();
            let st = &mut *st;
            batch::return_batch(&mut st.pool, &mut st.base, None, &blocks);
            self.scope_counters.region_bytes.fetch_sub(size, Ordering::Relaxed);
        }
    }

    /// Returns a scope's locally cached blocks of `stream` to the pool under one lock, and
    /// flushes the stream's cache with them.
    fn free_blocks(&self, stream: StreamId, blocks: &[BatchBlock]) {
        if blocks.is_empty() {
            return;
        }
        let mut st = self.lock_state();
        self.return_to_stream(&mut st, stream, blocks);
    }

    /// Frees `blocks` of `stream` into the pool and flushes every cache lane of the stream, so
    /// its cached blocks coalesce with them. The caller holds the global lock.
    fn return_to_stream(&self, st: &mut State, stream: StreamId, blocks: &[BatchBlock]) {
        let lanes = self.caches.lanes(stream);
        batch::return_batch(&mut st.pool, &mut st.base, lanes.first().map(|c| &**c), blocks);
        for cache in lanes.iter().skip(1) {
            flush_into(cache, &mut st.pool);
        }
    }

    /// Takes a fresh transient block of `bytes` on `stream` for a plan's region, found or
    /// reserved like any allocation and accounted as allocated: the block and its address.
    fn region_block(
        &self,
        st: &mut State,
        config: &Config,
        stream: StreamId,
        bytes: u64,
    ) -> Result<(BatchBlock, u64), AllocError> {
        let rounded =
            config.sizing.round(bytes).ok_or(AllocError::InvalidSize { requested: bytes })?;
        let key =
            PoolKey { residency: Residency::Transient, stream, kind: config.sizing.kind(rounded) };
        let block = self.find_or_reserve(st, config, key, bytes, rounded)?;
        let block = st.pool.allocate(block, rounded, bytes, &config.sizing);
        let (addr, size) = (st.pool.block(block).addr, st.pool.block(block).size);
        let q = quadrant(key.kind, key.residency);
        st.base.live_up(q, size, bytes, || self.caches.all());
        Ok((BatchBlock { block, quadrant: q, size, requested: bytes }, addr))
    }

    /// Makes `stream`'s later work wait, on the device, for the work enqueued so far on each of
    /// `others` (a freed planned buffer that was used on other streams). No host sync.
    fn order_after(&self, stream: StreamId, others: &[StreamId]) {
        if others.is_empty() || self.broken_skip_events.load(Ordering::Relaxed) {
            return;
        }
        let mut st = self.lock_state();
        for &other in others {
            let Ok(event) = self.event(&mut st) else {
                // No event to order with: wait for the other stream's work on the host.
                let _ = self.device.synchronize();
                st.counters.host_syncs += 1;
                continue;
            };
            // A stream that is gone was drained: nothing of it can still use the memory.
            if self.device.record_event(event, other).is_ok()
                && self.device.wait_event(stream, event).is_err()
            {
                // The owner stream is gone (or refuses to wait): whoever reuses the memory next
                // may be any stream, so the other stream's work must be done now.
                let _ = self.device.synchronize_event(event);
                st.counters.host_syncs += 1;
            }
            st.free_events.push(event);
        }
    }
}

impl<D: Device> Drop for Shared<D> {
    /// The last handle and the last buffer are gone: wait for pending events and return every
    /// segment to the device.
    fn drop(&mut self) {
        let plans = std::mem::take(&mut *lock(&self.plans));
        let mut st = lock(&self.state);
        let mut st = std::mem::take(&mut *st);
        self.flush_all(&mut st);
        // No buffer is left (each holds the allocator), so the plans hold the only regions.
        for (_, plan) in plans {
            if let Some(r) = plan.region.and_then(|r| Arc::try_unwrap(r).ok()) {
                for b in r.into_blocks() {
                    st.pool.free(b.block);
                }
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
