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
//! goes through that stream's cache instead (`fast_cache/`) and never takes the global lock;
//! statistics are published through sequence locks and read without any lock (`counters.rs`);
//! the configuration is swapped as a whole (`request.rs`). `global_lock:true` turns all of that
//! off (everything under the one lock, PyTorch's design) as a comparison point.

mod adopt;
mod aligned;
mod batch;
mod broken;
mod buffer;
mod cache_control;
mod capture;
mod checker;
mod class_table;
mod closed;
mod counters;
mod destroyed;
pub(crate) mod dump;
mod error;
mod events;
mod expandable;
mod extra_stats;
mod fast_cache;
mod gc;
mod history;
mod history_calls;
mod lane_lock;
mod lane_table;
mod leftovers;
mod observers;
mod oom;
mod owner;
mod page_growth;
mod page_moves;
mod page_release;
mod page_table;
mod passthrough;
mod plan;
mod pool_size;
mod private_pool;
mod publish;
mod regions;
mod report;
mod request;
mod residency;
mod scope;
mod seqlock;
mod slow_path;
mod state;
mod stats_calls;
mod stats_layout;
mod stitch;
#[cfg(feature = "test-hooks")]
mod test_hooks;
mod thread_token;
mod vm_report;

pub use buffer::Buffer;
pub use capture::Graph;
pub use error::{AllocError, OomReport};
pub use expandable::RangeInfo;
pub use history::{Action, Annotation, HistoryContext, HistoryOptions, TraceEntry};
pub use private_pool::{MemPool, PoolGuard, PoolOptions};
pub use report::{BlockInfo, SegmentInfo};
pub use scope::{Scope, ScopedBuffer};

/// The lock-free pieces, exposed for the loom models in `loom-tests/` (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
pub(crate) mod internals {
    pub use super::batch::{BatchBlock, return_batch};
    pub use super::broken::Broken;
    pub use super::counters::{
        BASE_WORDS, BYTES, BaseStats, CACHED_BYTES, COUNT, CacheList, FAST_WORDS, REQ, Snapshot,
        assemble, collect, fast_cur, fast_tot, quadrant,
    };
    pub use super::fast_cache::{
        CachedBlock, ClassKey, FAST_STREAMS, Limits, Pop, StreamCache, flush_into,
    };
    pub use super::lane_lock::{LaneGuard, LaneLock};
    pub use super::lane_table::{CacheTable, thread_lane};
    pub use super::request::RequestPlan;
    pub use super::seqlock::{Collect, SeqBlock, SeqWriter, Versioned};
    #[cfg(loom)]
    pub use super::thread_token::retire;
    pub use crate::sync::{ArcCell, ArcRef};
}

use crate::config::{Config, CrossStream};
use crate::device::AccessKind;
use crate::device::{Device, DeviceAddr, DeviceError, EventId, Guarded, StreamId};
use crate::pool::{BlockId, BlockState, Pool, PoolKey, SegmentId};
use crate::stats::{MemoryStats, Residency};
use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use crate::sync::{Arc, ArcCell, Mutex, MutexGuard, lock};
use batch::BatchBlock;
use broken::Broken;
use buffer::Origin;
use counters::{BASE_WORDS, BaseStats, quadrant};
use events::Mark;
use fast_cache::{CachedBlock, ClassKey, Limits, Pop, StreamCache, flush_into};
use lane_table::CacheTable;
use leftovers::{Leftover, Leftovers};
use owner::OwnerTable;
use plan::{Learned, Region};
use publish::{limits, stats_from};
use request::RequestPlan;
use seqlock::SeqBlock;
use state::{Locked, PendingEvent, ScopeCounters, Shared, State, UseState};
use stats_layout::is_small;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
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
///
/// A buffer keeps its allocator alive. Dropping the last handle *closes* the allocator: nothing
/// can allocate from it again, so its cached memory goes back to the device at once (stream
/// caches flushed, frees pending on other streams' events waited for), and each buffer still
/// alive returns its memory as it is freed (after its uses on other streams, waited for on the
/// host, as with `caching:false`). A `mem::forget`ten buffer keeps its own segment only.
///
/// ```
/// # use std::sync::Arc;
/// # use tidepool::{Allocator, Config, SimDevice, StreamId};
/// let device = Arc::new(SimDevice::new(1 << 30));
/// let alloc = Allocator::new(device.clone(), Config::default()).unwrap();
/// drop(alloc.alloc(64 << 20, StreamId::DEFAULT).unwrap()); // cached
/// let kept = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
/// drop(alloc);                                             // closed: the 64 MiB go back
/// assert_eq!(device.live_segments().len(), 1);             // `kept`'s 2 MiB segment
/// drop(kept);
/// assert!(device.live_segments().is_empty());
/// ```
pub struct Allocator<D: Device> {
    shared: Arc<Shared<D>>,
    /// What buffers hold, one per stream (see `owner.rs`).
    owners: Arc<OwnerTable<D>>,
}

impl<D: Device> fmt::Debug for Allocator<D> {
    /// The device, the configuration and the current reserved and allocated bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocator")
            .field("device", &self.shared.device.name())
            .field("reserved_bytes", &self.reserved_bytes())
            .field("allocated_bytes", &self.allocated_bytes())
            .field("config", &*self.config())
            .finish()
    }
}

impl<D: Device> Clone for Allocator<D> {
    fn clone(&self) -> Self {
        self.shared.handles.fetch_add(1, Ordering::Relaxed);
        Allocator { shared: self.shared.clone(), owners: self.owners.clone() }
    }
}

impl<D: Device> Drop for Allocator<D> {
    /// The general allocator's last handle: a capture begun through it and still underway can
    /// no longer be ended by anyone, and it holds the allocator (through the blocks it holds)
    /// and its pool (through the family), so nothing would ever go back to the device, which
    /// would stay capturing. It is ended here and its graph dropped (`capture::end_orphaned`).
    ///
    /// Then what dropped graphs held back because the wait for their launches failed (a
    /// capture was underway) is let go of, once the device synchronises: those holds wait in
    /// the family for an `empty_cache` and hold the allocators that hold the family, so with
    /// no `empty_cache` to come their memory stayed reserved for good. Where the device
    /// refuses that synchronisation (another family's capture is underway), or a graph is
    /// dropped later during one, the family is left to the device's other allocators
    /// (`peers::let_go_of_orphans`), which let go of its holds once they can.
    fn drop(&mut self) {
        let sh = &self.shared;
        if sh.handles.fetch_sub(1, Ordering::AcqRel) == 1 && sh.role.id == 0 {
            // BROKEN (`orphan_capture`): such a capture is left as is.
            if !cfg!(tidepool_broken = "orphan_capture")
                && let Some(end) = sh.end_captures.get()
            {
                end(self);
            }
            // The routes of `mem::forget`ten guards: nothing can be routed any more, and each
            // kept its pool, whose cache would stay as long as this allocator's last buffer
            // (a closed allocator keeps only its live buffers' segments). BROKEN
            // (`closed_keeps_routes`): kept.
            if !cfg!(tidepool_broken = "closed_keeps_routes") {
                drop(sh.routes.remove_guards());
            }
            // BROKEN (`graph_holds_kept_at_drop`): left to an `empty_cache` that never comes.
            if !cfg!(tidepool_broken = "graph_holds_kept_at_drop") {
                let _ = sh.let_go_of_graph_holds();
            }
            // What is left (the device refused the synchronisation: another family's capture
            // is underway), and what graphs dropped from now on leave, is let go of by the
            // device's other allocators: no call of this family can any more.
            private_pool::Family::orphan(&sh.family, &sh.device);
            // As it goes, what orphaned families of its device left (`peers.rs`).
            let _ = crate::peers::let_go_of_orphans(&sh.device);
        }
    }
}

impl<D: Device> Allocator<D> {
    /// An allocator over `device`. Fails if the configuration is inconsistent
    /// ([`AllocError::Config`]) or the device cannot report its memory.
    pub fn new(device: Arc<D>, config: Config) -> Result<Allocator<D>, AllocError> {
        Allocator::build(device, config, Arc::new(private_pool::Family::default()), 0)
    }

    /// An allocator of `family`: the general one (`pool` 0) or a private pool.
    fn build(
        device: Arc<D>,
        config: Config,
        family: Arc<private_pool::Family<D>>,
        pool: u64,
    ) -> Result<Allocator<D>, AllocError> {
        config.validate()?;
        let device = Guarded::new(device);
        let total = device.mem_info()?.total;
        let (fast, global_lock) = (config.fast_path(), config.global_lock);
        // Over expandable segments only while a free releases no pages at once (no learning
        // run is open yet).
        let cache_large = Shared::<D>::large_cacheable_by(&config)
            && (!config.expandable_segments || config.release_threshold == u64::MAX);
        let (config_caching, oversize_at) = (config.caching, config.sizing.max_split_size);
        let hint = StreamCache::fast_max_of(
            limits(&config, false, config.expandable_segments),
            &config.sizing,
        );
        let config = Arc::new(config);
        let shared = Arc::new(Shared {
            device,
            config: ArcCell::from_arc(config.clone()),
            device_total: total,
            // The device's own pool has room for a training step's blocks from the start.
            state: Mutex::new(State {
                config,
                pool: if pool == 0 { Pool::with_room() } else { Pool::default() },
                ..State::default()
            }),
            caches: CacheTable::default(),
            fast_path: AtomicBool::new(fast),
            small_hint: AtomicU64::new(hint),
            cache_large: AtomicBool::new(cache_large),
            publish_stats: AtomicBool::new(!global_lock),
            stats: SeqBlock::new(),
            broken_skip_events: AtomicBool::new(false),
            #[cfg(feature = "test-hooks")]
            broken: AtomicU64::new(0),
            #[cfg(feature = "test-hooks")]
            in_config_window: Mutex::new(None),
            #[cfg(all(feature = "test-hooks", not(loom)))]
            after_collect: Mutex::new(None),
            #[cfg(feature = "test-hooks")]
            after_view: Mutex::new(None),
            plans: Mutex::new(regions::Plans::default()),
            scope_counters: ScopeCounters::default(),
            lock_count: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            vm_published: Default::default(),
            recording: AtomicBool::new(false),
            observers: observers::Observers::default(),
            family,
            routes: private_pool::Routes::default(),
            role: private_pool::PoolRole { id: pool, ..Default::default() },
            passthrough: AtomicBool::new(!config_caching),
            oversize_at: AtomicU64::new(oversize_at),
            accumulated_base: ArcCell::new(MemoryStats::default()),
            handles: AtomicUsize::new(1), // the one made below
            end_captures: std::sync::OnceLock::new(),
        });
        {
            let mut st = lock(&shared.state);
            st.pool.set_oversize_size(oversize_at);
            let gc = st.config.garbage_collection_threshold.is_some();
            st.pool.run_clock(gc);
        }
        if pool == 0 {
            crate::peers::join(crate::peers::Kind::Device, &shared.device, &shared);
        }
        let alloc = Allocator { owners: Arc::new(OwnerTable::new(&shared)), shared };
        alloc.reserve_initial_pool()?;
        Ok(alloc)
    }

    /// The device underneath.
    pub fn device(&self) -> &Arc<D> {
        self.shared.device.arc()
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.shared.config.load_full()
    }

    /// Replaces the configuration; allocations already under way finish with the old one (each
    /// allocation loads the configuration once). The stream caches are flushed and take the new
    /// limits. As PyTorch's `_set_allocator_settings` does for every pool of the device, the
    /// allocator's private pools ([`MemPool`], CUDA graphs' pools) take it too (with no initial
    /// pool of their own).
    ///
    /// What is already reserved stays as it is: the size rules (segment sizes, `small_size`,
    /// `min_block_size`, rounding) apply to requests and segments from now on, and segments of
    /// the old sizes go on serving what fits them (a free block carved at a finer
    /// `min_block_size` is handed out whole where the rest past a request is under the new
    /// one); a cap lowered below the reserved bytes releases nothing at once, but a request
    /// that needs a new segment then climbs the out-of-memory ladder and fails if it still
    /// does not fit; `initial_pool_size` is reserved only by [`Allocator::new`], and the
    /// initial pool it reserved is kept whatever the new configuration says (a
    /// `max_split_size` at or below its size is refused: the pool would be an oversize block,
    /// never split, serving no smaller request).
    pub fn set_config(&self, config: Config) -> Result<(), crate::config::ConfigError> {
        config.validate()?;
        self.shared.keeps_initial_pool_under(&config)?;
        // BROKEN (`config_race`): the general allocator's and the pools' apart.
        let _configuring =
            (!cfg!(tidepool_broken = "config_race")).then(|| lock(&self.shared.family.configuring));
        self.shared.apply_config(config.clone());
        // After the general allocator's: a pool made meanwhile either is listed here or
        // reads the new configuration once registered (`new_pool`).
        if self.shared.role.id == 0 && !cfg!(tidepool_broken = "pools_keep_config") {
            for (_, pool) in self.shared.family.live_pools() {
                pool.apply_config(config.clone().for_pool());
            }
        }
        Ok(())
    }
}

impl<D: Device> Shared<D> {
    /// [`Allocator::set_config`] for this allocator alone (`config` validated).
    pub(super) fn apply_config(&self, config: Config) {
        let sh = self;
        let mut st = sh.lock_state();
        sh.cache_large.store(Shared::<D>::large_cacheable(&st, &config), Ordering::Relaxed);
        sh.publish_stats.store(!config.global_lock, Ordering::Relaxed);
        sh.passthrough.store(!config.caching, Ordering::Relaxed);
        sh.oversize_at.store(config.sizing.max_split_size, Ordering::Relaxed);
        st.pool.set_oversize_size(config.sizing.max_split_size);
        sh.configure_lanes(&st, &config, sh.recording.load(Ordering::Relaxed));
        #[cfg(feature = "test-hooks")]
        if let Some(window) = lock(&sh.in_config_window).take() {
            window();
        }
        sh.flush_all(&mut st);
        // The idle ages count while a collection threshold is in force: from here (after the
        // flush, so that a cache's blocks freed before count as the pool's own: `gc.rs`).
        st.pool.run_clock(config.garbage_collection_threshold.is_some());
        // Published statistics are current before a lock-free reader can see the new config.
        sh.publish_now(&mut st);
        st.vm.refused.clear(); // the new configuration may ask for other ranges
        // The ranges trim by the new threshold from now on, not from the next growth.
        // BROKEN (`stale_release_threshold`): until then, by the old one.
        if !cfg!(tidepool_broken = "stale_release_threshold") {
            st.vm.threshold = config.release_threshold;
        }
        // What the trims remembered as checked was checked against the old threshold: under a
        // lower one, a stream's next free checks again, however small.
        // BROKEN (`threshold_memo_kept`): kept, a stream skipped until a page more was freed.
        if !cfg!(tidepool_broken = "threshold_memo_kept") {
            st.vm.checked.clear();
        }
        let config = Arc::new(config);
        st.config = config.clone();
        st.config_spare = Some(config.clone());
        sh.config.store(config);
    }
}

impl<D: Device> Allocator<D> {
    /// Allocates `bytes` of transient memory on `stream`.
    ///
    /// A zero-byte request returns an empty buffer at [`DeviceAddr::NULL`] that holds no memory.
    #[inline]
    pub fn alloc(&self, bytes: u64, stream: StreamId) -> Result<Buffer<D>, AllocError> {
        self.alloc_in(bytes, stream, Residency::Transient)
    }

    /// Allocates `bytes` on `stream` with the given residency. The residency decides what a
    /// segment reserved for the request is — persistent segments are never released by
    /// `empty_cache`, the garbage collection or the out-of-memory ladder, only by
    /// [`Allocator::release_persistent`] — not where the block may sit: small-pool blocks
    /// (≤ 1 MiB) of both residencies share the stream's small segments and count as transient,
    /// and on ordinary segments a large block takes the best fit over the free space of both.
    /// A block is accounted by its segment's residency.
    ///
    /// When memory runs out, the out-of-memory ladder releases cached memory (the regions of
    /// named scopes' plans that nothing holds included, as [`Allocator::empty_cache`] does) and
    /// tries again; then the out-of-memory observers are called with the report, and the
    /// failure callback (if any) may free memory and ask for another attempt
    /// ([`Allocator::attach_oom_observer`], [`Allocator::set_failure_callback`]).
    #[inline]
    pub fn alloc_in(
        &self,
        bytes: u64,
        stream: StreamId,
        residency: Residency,
    ) -> Result<Buffer<D>, AllocError> {
        match self.hit(bytes, stream, residency) {
            Some(buffer) => Ok(buffer),
            None => self.alloc_missed(bytes, stream, residency, &mut || false),
        }
    }

    /// [`Allocator::alloc_in`] past the small hit: the large hit, then the whole path. Out of
    /// line, so that the small hit builds its buffer straight into the caller's result (one
    /// place makes it there, one call the rest).
    #[inline(never)]
    fn alloc_missed(
        &self,
        bytes: u64,
        stream: StreamId,
        residency: Residency,
        give_back: &mut dyn FnMut() -> bool,
    ) -> Result<Buffer<D>, AllocError> {
        if let Some(buffer) = self.hit_large(bytes, stream, residency) {
            return Ok(buffer);
        }
        self.alloc_with_retries_after(bytes, stream, residency, 0, give_back)
    }

    /// The hit path: a block of the request's class from this thread's lane of `stream`, with
    /// no global lock, no configuration load and no reference count touched (`owner.rs`).
    /// `None` sends the request down the whole path (which looks at every lane).
    ///
    /// A large request asks the stream's first lane for the large block it holds, which it
    /// hands out only where the global-lock side checked it for this very request and the pool
    /// has not changed since (`fast_cache::LargeVerdict`): placement stays the pool's.
    #[inline(always)]
    fn hit(&self, bytes: u64, stream: StreamId, residency: Residency) -> Option<Buffer<D>> {
        let sh = &*self.shared;
        // (Recording the history closes every lane: `Limits::enabled`.) A request above the
        // small bound goes on to the large hit with no lane looked up. While a capture is
        // underway on the device, the whole path asks whose it is (`alloc_in_once`).
        if sh.routes.any()
            || Self::capture_on_device(sh)
            || bytes.wrapping_sub(1) >= sh.small_hint.load(Ordering::Relaxed)
        {
            return None;
        }
        // The one lookup: this thread's lane owner of the stream, which holds the lane.
        let slot = self.owners.lane_owner(stream)?;
        #[allow(clippy::needless_borrow)]
        let owner: &Arc<owner::Owner<D>> = &slot; // a reference under std, a clone under loom
        // (With the sanitizer on, the whole path serves it, and tells the sanitizer.)
        let cache = owner.quiet_lane()?;
        // The lane's own bound: `small_hint` but for a moment after a configuration change.
        // (Redundant otherwise; left in, the pair's code is laid out faster: design notes.)
        if !cache.may_serve(bytes) {
            return None;
        }
        let residency = sh.cached_residency(residency);
        match cache.pop_request(residency, bytes, stream) {
            (Pop::Hit(b), rounded, stashed) => {
                let owner = OwnerTable::hit_owner(owner, stashed);
                Some(Self::buffer_of_hit(owner, &b, bytes, stream, rounded, residency))
            }
            _ => None,
        }
    }

    /// [`Allocator::hit`] for a request the small-pool lanes do not serve.
    #[inline(always)]
    fn hit_large(&self, bytes: u64, stream: StreamId, residency: Residency) -> Option<Buffer<D>> {
        let sh = &*self.shared;
        // A routed stream allocates from its private pool (`alloc_in_once`), and the whole path
        // asks whose a capture underway on the device is.
        if sh.routes.any() || Self::capture_on_device(sh) {
            return None;
        }
        // A stream's large block waits in its first lane, whose owner large buffers hold.
        let slot = self.owners.owner_slot(stream, 0)?;
        #[allow(clippy::needless_borrow)]
        let owner: &Arc<owner::Owner<D>> = &slot;
        let cache = owner.lane()?;
        let stale = sh.broken(Broken::StaleLargeVerdict);
        match cache.pop_large(residency, bytes, stream, &sh.epoch, stale) {
            (Pop::Hit(b), rounded, stashed) => {
                Some(self.hand_out_hit(owner, &b, bytes, stream, rounded, residency, stashed))
            }
            _ => None,
        }
    }

    /// Whether a stream capture is underway on the device (one load): the hit paths then leave
    /// the request to the whole path, which refuses a stream a foreign capture captures
    /// ([`Shared::foreign_capture`]). A capture of this allocator's own family routes its
    /// streams, which the hits leave to the whole path anyway; but a capture of another
    /// allocator on the device, or one begun on the device itself, is seen only here.
    #[inline(always)]
    fn capture_on_device(sh: &Shared<D>) -> bool {
        // BROKEN (`foreign_capture_served`, and `foreign_capture_hit` alone): the hits serve a
        // foreign capture's streams.
        !cfg!(tidepool_broken = "foreign_capture_served")
            && !cfg!(tidepool_broken = "foreign_capture_hit")
            && sh.device.capture_underway()
    }

    /// A buffer for block `b` popped by a hit through lane owner `slot` that served `bytes`
    /// (rounded to `rounded`).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn hand_out_hit(
        &self,
        slot: &Arc<owner::Owner<D>>,
        b: &CachedBlock,
        bytes: u64,
        stream: StreamId,
        rounded: u64,
        residency: Residency,
        stashed: bool,
    ) -> Buffer<D> {
        if slot.cells().observes {
            self.shared.device.note_handout(b.ptr, b.size, stream);
        }
        let owner = OwnerTable::hit_owner(slot, stashed);
        Self::buffer_of_hit(owner, b, bytes, stream, rounded, residency)
    }

    /// The hold on the allocator for a buffer of a small block popped from lane owner `from`'s
    /// lane, which is not this thread's: this thread's lane owner (a new hold), so that the
    /// free caches the block in this thread's lane; the hold the block's last buffer left in
    /// `from`'s lane, if the pop took one, is let go. Both lanes are the stream's, so the block
    /// may wait in either; the lanes' statistics deltas sum to the stream's whichever lane the
    /// free lands in.
    #[cold]
    fn moved_owner(
        &self,
        from: &Arc<owner::Owner<D>>,
        stream: StreamId,
        stashed: bool,
    ) -> Arc<owner::Owner<D>> {
        #[cfg(not(tidepool_broken = "moved_hold"))]
        if stashed {
            // The kept hold is `from`'s (a lane keeps its own owner's holds); its slot holds
            // another, so this is never the last.
            drop(OwnerTable::hit_owner(from, true));
        }
        // BROKEN (`moved_hold`): the kept hold is taken from the lane and never let go, so the
        // allocator outlives its last handle and buffer.
        #[cfg(tidepool_broken = "moved_hold")]
        let _ = (from, stashed);
        self.owners.owner(stream)
    }

    /// The buffer for block `b` popped by a hit that served `bytes` (rounded to `rounded`),
    /// holding `owner`.
    #[inline(always)]
    fn buffer_of_hit(
        owner: Arc<owner::Owner<D>>,
        b: &CachedBlock,
        bytes: u64,
        stream: StreamId,
        rounded: u64,
        residency: Residency,
    ) -> Buffer<D> {
        let origin = Origin::Pool(b.block);
        Buffer::new(b.ptr, bytes, b.size, stream, origin, owner, rounded, residency, b.quadrant)
    }

    /// Counts a failed request (`num_ooms`, its history `oom` entry) in the pool whose attempt
    /// failed (`report.failed_in`, or this allocator), and forgets which pool that was.
    #[cold]
    fn count_oom(&self, report: &mut OomReport) {
        match report.failed_in.0.take() {
            Some(pool) => pool.count_oom(report),
            None => self.shared.count_oom(report),
        }
    }

    /// The private pool `stream`'s requests go to instead of this allocator, if any: the one a
    /// capture or a guard routes it to (`true`), or the pool of a capture it joined (`false`).
    #[inline]
    fn routed_pool(&self, stream: StreamId) -> Option<(Allocator<D>, bool)> {
        let sh = &self.shared;
        // A stream being captured allocates from its capture's pool, whatever guard routes it
        // (one begun during the capture, on another thread maybe): the graph's replays write
        // what its captured work was handed, so that must be memory the graph holds. A stream
        // that joined a capture (it waited on an event recorded on a capturing stream: CUDA's
        // fork) allocates from the capture's pool, as the stream it began on.
        // BROKEN (`guard_in_capture`): a guard begun on the capturing stream during the
        // capture routes it to the guard's pool (the stream's latest route).
        let joined_only = cfg!(tidepool_broken = "guard_in_capture");
        if sh.family.captures.any()
            && let Some((pool, began)) = sh.family.captures.capture_pool(sh, stream, joined_only)
            && !Arc::ptr_eq(&pool.shared, &self.shared)
        {
            return Some((pool, began));
        }
        if sh.routes.any()
            && let Some(pool) = sh.routes.get(stream)
        {
            return Some((pool, true));
        }
        None
    }

    /// Asks the other allocators of this device to return their free cached transient memory
    /// (`src/peers.rs`); whether any did.
    #[cold]
    fn release_peers(&self) -> bool {
        let me = Arc::as_ptr(&self.shared) as *const ();
        crate::peers::ask(crate::peers::Kind::Device, &self.shared.device, me)
    }

    /// [`Allocator::alloc_in`], the block starting at a multiple of `align` (0: no more than
    /// every block's [`MIN_ALIGN`](crate::config::MIN_ALIGN)), with the out-of-memory
    /// observers' retries.
    pub(super) fn alloc_with_retries(
        &self,
        bytes: u64,
        stream: StreamId,
        residency: Residency,
        align: u64,
    ) -> Result<Buffer<D>, AllocError> {
        self.alloc_with_retries_after(bytes, stream, residency, align, &mut || false)
    }

    /// [`Allocator::alloc_in`] for a caller that holds idle memory of its own the allocator
    /// cannot see (a scope's run: its local cache, the region of a run that left its plan):
    /// the out-of-memory ladder's first rung asks `give_back` to return it (whether it did).
    pub(super) fn alloc_in_giving_back(
        &self,
        bytes: u64,
        stream: StreamId,
        residency: Residency,
        give_back: &mut dyn FnMut() -> bool,
    ) -> Result<Buffer<D>, AllocError> {
        match self.hit(bytes, stream, residency) {
            Some(buffer) => Ok(buffer),
            None => self.alloc_missed(bytes, stream, residency, give_back),
        }
    }

    /// [`Allocator::alloc_with_retries`], `give_back` the ladder's first rung.
    fn alloc_with_retries_after(
        &self,
        bytes: u64,
        stream: StreamId,
        residency: Residency,
        align: u64,
        give_back: &mut dyn FnMut() -> bool,
    ) -> Result<Buffer<D>, AllocError> {
        // The common case: a buffer, or an error no retry helps (a rejection by
        // `throw_on_cudamalloc_oom` asks nothing of anyone). The ladder's state and loop live
        // in `alloc_after_oom`, out of line. (The result is still copied once into the
        // caller's place: matching it where it is returned did not remove that copy.)
        match self.alloc_in_once(bytes, stream, residency, align) {
            Err(AllocError::OutOfMemory(report)) if !report.rejected => {
                self.alloc_after_oom(bytes, stream, residency, align, give_back, report)
            }
            r => r,
        }
    }

    /// [`Allocator::alloc_with_retries_after`] past a first attempt that ran out of memory
    /// (`report`): the out-of-memory ladder.
    #[cold]
    #[inline(never)]
    fn alloc_after_oom(
        &self,
        bytes: u64,
        stream: StreamId,
        residency: Residency,
        align: u64,
        give_back: &mut dyn FnMut() -> bool,
        report: Box<OomReport>,
    ) -> Result<Buffer<D>, AllocError> {
        let mut attempt = 0;
        let (mut own_released, mut holds_released) = (false, false);
        let (mut pools_released, mut general_released) = (false, false);
        // Whether the last attempt was the retry of an inner rung (pools, general, peers).
        let (mut peers_released, mut retried) = (false, false);
        let mut r = Err(AllocError::OutOfMemory(report));
        loop {
            if !matches!(r, Err(AllocError::OutOfMemory(_))) || oom::is_rejected(&r) {
                return r;
            }
            // BROKEN (`rescued_oom_counted`): each failed attempt but an inner rung's retry
            // counted, so a request a rung then rescued read as a failure; (`oom_counted_twice`)
            // every failed attempt, the retries too.
            let was_retry = std::mem::take(&mut retried);
            if let Err(AllocError::OutOfMemory(report)) = &mut r
                && (cfg!(tidepool_broken = "oom_counted_twice")
                    || (cfg!(tidepool_broken = "rescued_oom_counted") && !was_retry))
            {
                let mut counted = report.clone();
                self.count_oom(&mut counted);
            }
            match r {
                Err(AllocError::OutOfMemory(_)) if !own_released && give_back() => {
                    // The caller returned idle memory of its own: once more.
                    (own_released, retried) = (true, true);
                }
                // BROKEN (`graph_holds_kept_at_oom`): left to `empty_cache`.
                Err(AllocError::OutOfMemory(_))
                    if !holds_released
                        && !cfg!(tidepool_broken = "graph_holds_kept_at_oom")
                        && self.shared.let_go_of_graph_holds() =>
                {
                    // What dropped graphs held back (their wait failed during a capture) went,
                    // after a device synchronisation, as `empty_cache` lets it go (PyTorch's
                    // `release_cached_blocks` frees the pools no graph uses any more): once more.
                    (holds_released, retried) = (true, true);
                }
                Err(AllocError::OutOfMemory(_))
                    if !pools_released && self.shared.release_oom_pools() =>
                {
                    // The `use_on_oom` pools gave their free segments back: once more.
                    (pools_released, retried) = (true, true);
                }
                Err(AllocError::OutOfMemory(_))
                    if !general_released && self.shared.release_for_routed(stream) =>
                {
                    // A private pool's request: the general allocator gave its free cached
                    // segments back (as its own ladder would for its own request): once more.
                    (general_released, retried) = (true, true);
                }
                Err(AllocError::OutOfMemory(ref report))
                    if !peers_released
                        && !report.over_limit()
                        && report.segment <= report.device_total
                        && self.release_peers() =>
                {
                    // Other allocators of the device returned their free cached transient
                    // memory (`src/peers.rs`): once more. (Not for what the device could never
                    // hold, nor what this allocator's own limit refused.)
                    (peers_released, retried) = (true, true);
                }
                Err(AllocError::OutOfMemory(mut report)) => {
                    // The ladder gives up on this attempt: one failed request (each round of
                    // the observers' retries is another).
                    if !cfg!(tidepool_broken = "oom_counted_twice")
                        && !cfg!(tidepool_broken = "rescued_oom_counted")
                    {
                        self.count_oom(&mut report);
                    }
                    report.failed_in = Default::default();
                    attempt += 1;
                    if !self.shared.observers.out_of_memory(&report, attempt) {
                        return Err(AllocError::OutOfMemory(report));
                    }
                }
                other => return other,
            }
            r = self.alloc_in_once(bytes, stream, residency, align);
        }
    }

    /// One attempt of [`Allocator::alloc_in`].
    fn alloc_in_once(
        &self,
        bytes: u64,
        stream: StreamId,
        residency: Residency,
        align: u64,
    ) -> Result<Buffer<D>, AllocError> {
        let sh = &self.shared;
        // A stream a capture of another family (or of the device itself) captures: whatever the
        // captured work is handed, that graph replays, and no graph of this family would hold
        // it. Refused, whatever guard routes the stream (a private pool is no graph's either).
        // BROKEN (`foreign_capture_served`): served from the general pool (or a guard's).
        if !cfg!(tidepool_broken = "foreign_capture_served")
            && let Some(origin) = sh.foreign_capture(stream)
        {
            return Err(AllocError::ForeignCapture { stream, origin });
        }
        if let Some((pool, routed)) = self.routed_pool(stream) {
            // The stream may have been destroyed under a route (here, or elsewhere and released
            // here): the pool's lanes and its known streams never heard of it, so the device is
            // asked here (one lookup; routed allocations already take the route table's lock).
            if !routed || !sh.broken(Broken::RoutedDeadStreams) {
                sh.stream_exists(stream)?;
            }
            if sh.family.captures.waiting() {
                sh.family.captures.reclaim(sh, stream);
            }
            // Its failure is the pool's to count (`Allocator::count_oom`).
            return pool.alloc_in_once(bytes, stream, residency, align).map_err(|mut e| {
                if let AllocError::OutOfMemory(r) = &mut e
                    && r.failed_in.0.is_none()
                    && !r.rejected
                {
                    r.failed_in.0 = Some(std::sync::Arc::new(FailedPool(pool.clone())));
                }
                e
            });
        }
        if bytes == 0 {
            sh.stream_exists(stream)?;
            return Ok(self.hand_out(DeviceAddr::NULL, 0, 0, stream, None, 0, residency, 0));
        }
        let mut cached = None;
        // An aligned request skips the stream caches and the large-block reuse: a cached block
        // of its class may start anywhere.
        let cacheable = align <= crate::config::MIN_ALIGN || sh.broken(Broken::AlignedFromCache);
        // A request above the lanes' small bound (`small_hint`, as the hit reads it: every lane
        // is configured with it, and each checks its own under its lock) skips the lane loop,
        // which used to leave at its first lane's bound (`may_serve`) after looking the lane's
        // owner up, or making it: ~40 instructions per large allocation. The thread's lane is
        // still asked for, so that threads take lanes in the order they first allocate.
        let lanes = cacheable && !sh.recording.load(Ordering::Relaxed);
        if lanes && bytes.wrapping_sub(1) >= sh.small_hint.load(Ordering::Relaxed) {
            lane_table::thread_lane();
        } else if lanes {
            // This thread's lane first, then the stream's other lanes (a block freed on another
            // thread), each under its own lock only. Each lane rounds the request by the size
            // rules it was configured with, so a hit loads no configuration.
            for k in 0..lane_table::LANES {
                // Through the lane's owner (made here the first time), whose hold a hit takes;
                // borrowed once made (no reference count touched: a large request leaves at the
                // first lane, and a miss looks at every lane).
                let lane = (lane_table::thread_lane() + k) % lane_table::LANES;
                let (held, made);
                let owner: &Arc<owner::Owner<D>> = match self.owners.owner_slot(stream, lane) {
                    Some(slot) => {
                        held = slot;
                        #[allow(clippy::needless_borrow)]
                        &held // a reference under std, a clone under loom
                    }
                    None => {
                        made = self.owners.owner_of_lane(stream, lane);
                        &made
                    }
                };
                let Some(cache) = owner.lane() else { break };
                let r = sh.cached_residency(residency);
                match cache.pop_request(r, bytes, stream) {
                    (Pop::Hit(b), rounded, stashed)
                        if k == 0 || sh.broken(Broken::CrossLaneHitStays) =>
                    {
                        return Ok(self.hand_out_hit(owner, &b, bytes, stream, rounded, r, stashed));
                    }
                    (Pop::Hit(b), rounded, stashed) => {
                        // A block of another lane (freed there, or handed out there last): its
                        // buffer holds this thread's lane, so its free caches it here and this
                        // thread's next request of the class is a hit in its own lane. (Holding
                        // the other lane's owner, every later pair would miss here and pop there,
                        // through this path: twice the instructions and three lane locks.)
                        if owner.cells().observes {
                            sh.device.note_handout(b.ptr, b.size, stream);
                        }
                        let held = self.moved_owner(owner, stream, stashed);
                        return Ok(Self::buffer_of_hit(held, &b, bytes, stream, rounded, r));
                    }
                    (Pop::NeedsLock, ..) => {
                        cached = sh.caches.fast_lane_at(stream, lane);
                        break;
                    }
                    (Pop::Miss, ..) => {}
                }
            }
        }
        let mut st = sh.lock_state();
        // Only holders of the global lock count these: a load and a store, no shared RMW.
        let locked = &sh.scope_counters.locked;
        locked.store(locked.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        // The configuration as the global lock holds it: `set_config` replaces it under this
        // lock, so it is the cell's too (no load of the cell on the slow path). The plan holds
        // the state's spare handle of it, given back before the lock is let go: no reference
        // count is touched (a clone only when an error kept the spare).
        let held = st.config_spare.take().unwrap_or_else(|| st.config.clone());
        let plan = RequestPlan::with(held, bytes)?;
        let config = &*plan.config;
        // Small-pool blocks of both residencies share the stream's small segments and count as
        // transient; large ones share free space on ordinary segments (`residency.rs`).
        let residency = sh.placed_residency(config, plan.kind, residency);
        let class = ClassKey { residency, rounded: plan.rounded };
        sh.check_stream(&mut st, stream)?;
        // The pending frees whose events completed join the pool first, as PyTorch's `malloc`
        // processes events before anything else: before a stream cache's block is accounted
        // here (where a peak may rise: with them still active, the requested peak rose by
        // bytes PyTorch had freed) or checked for reuse (`reuse_large`, whose best fit must
        // see them free), not only before the search. BROKEN (`locked_pop_unpolled`): before
        // the reuse check and the search alone; (`reuse_large_unpolled`): before the search
        // alone, so the lane's large block went out where a block freed meanwhile fitted better.
        #[cfg(not(any(
            tidepool_broken = "locked_pop_unpolled",
            tidepool_broken = "reuse_large_unpolled"
        )))]
        if !st.pending.is_empty() {
            sh.process_events(&mut st);
        }
        let locked: &mut State = &mut st;
        if let Some((b, accounted)) =
            cached.and_then(|c| c.pop_locked_topped(class, stream, bytes, &mut locked.base))
        {
            // A cached block for another request size, or beyond the stream's credit: account
            // it here, where the peak can be raised exactly (in the lane's section, which then
            // tops the lane's credit up, where it stays under the peaks).
            if b.requested != bytes {
                locked.pool.set_requested(b.block, bytes);
            }
            if !accounted {
                locked.base.live_up(b.quadrant, b.size, bytes, || &locked.lanes[..]);
            }
            st.config_spare = Some(plan.config);
            drop(st);
            return Ok(self.hand_out_cached(&b, bytes, stream, plan.rounded, residency));
        }
        if !plan.fast
            && cacheable
            && config.fast_path()
            && !sh.recording.load(Ordering::Relaxed)
            && let Some(b) = sh.reuse_large(&mut st, stream, class, bytes, config)
        {
            st.config_spare = Some(plan.config);
            drop(st);
            return Ok(self.hand_out_cached(&b, bytes, stream, plan.rounded, residency));
        }
        let key = PoolKey { residency, stream, kind: plan.kind };
        let block = sh.find_or_reserve_aligned(&mut st, config, key, bytes, plan.rounded, align)?;
        let mut own = None;
        let sizing = sh.alloc_sizing(&st, block, &config.sizing, &mut own);
        let block = st.pool.allocate(block, plan.rounded, bytes, sizing);
        let b = st.pool.block(block);
        let (ptr, size) = (DeviceAddr(b.addr), b.size);
        // An oversize block counts in `oversize_allocations` until the pool frees it: freed
        // straight into the pool (`POOL_ONLY`), also after a `set_config` raised or unset
        // `max_split_size` (a lane would keep it counted as live, and hand it out counted).
        // BROKEN (`oversize_in_lane`): it may wait in a lane once the new limit lets it.
        let oversize = b.oversize && !cfg!(tidepool_broken = "oversize_in_lane");
        // Accounted, and cached once freed, by its segment's residency (a block may sit in free
        // space of the other residency's segment; see `residency.rs`).
        let held = st.pool.segment(b.segment).key.residency;
        let q = quadrant(key.kind, held);
        // A stitched block is freed straight into the pool (`buffer.rs`, `POOL_ONLY`).
        // BROKEN (`stitch_in_lane`): it waits in its stream's first lane like any large block.
        let stitched =
            Shared::<D>::stitched(&st.vm, b.segment) && !cfg!(tidepool_broken = "stitch_in_lane");
        let locked: &mut State = &mut st;
        locked.base.live_up(q, size, bytes, || &locked.lanes[..]);
        st.note(Action::Alloc, ptr, bytes, stream);
        st.config_spare = Some(plan.config);
        drop(st);
        let mut buf = self.hand_out(ptr, bytes, size, stream, Some(block), plan.rounded, held, q);
        if stitched || oversize {
            buf.mark_pool_only();
        }
        Ok(buf)
    }

    /// Frees `buffers` under one acquisition of the global lock, straight into the pool so they
    /// coalesce at once (no stream cache), then flushes their streams' caches — what a scope's
    /// exit does. Buffers with uses on other streams take the ordinary stream-ordered path.
    ///
    /// A buffer of another allocator is never looked up in this one's tables: it is freed by its
    /// own allocator (as dropping it would), and the call returns [`AllocError::ForeignBuffer`]
    /// once the rest of the batch is freed.
    pub fn free_batch(&self, buffers: Vec<Buffer<D>>) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut foreign = false;
        let mut batch: BTreeMap<StreamId, Vec<BatchBlock>> = BTreeMap::new();
        for mut buf in buffers {
            if !sh.owns(&buf) {
                // A buffer of one of this allocator's private pools is freed by its pool.
                foreign |= self.shared_of(&buf).is_none();
                continue; // dropped at the end of this iteration: freed by its own allocator
            }
            if buf.used_elsewhere() {
                continue; // dropped at the end of this iteration: the ordinary free
            }
            if buf.scope_tag().is_some() {
                continue; // its scope records the free: the ordinary path
            }
            // BROKEN (`foreign_capture_lane`): straight into the pool during a foreign capture.
            if sh.family.captures.capturing(sh, buf.stream)
                || (!cfg!(tidepool_broken = "foreign_capture_lane")
                    && sh.foreign_capture(buf.stream).is_some())
            {
                // The capture may hold it back, or one of another family holds it for good
                // (`hold_for_foreign`): the ordinary path.
                continue;
            }
            let Some(block) = buf.take_block() else { continue };
            sh.device.note_reclaim(buf.ptr, buf.size, buf.stream);
            batch.entry(buf.stream).or_default().push(BatchBlock {
                block,
                quadrant: buf.quadrant as usize,
                size: buf.size,
                requested: buf.accounted,
            });
        }
        if !batch.is_empty() {
            let mut st = sh.lock_state();
            for (&stream, blocks) in &batch {
                // (Each buffer's free is recorded in `return_to_stream`: `State::note_returned`.)
                sh.return_to_stream(&mut st, stream, blocks);
            }
        }
        if foreign { Err(AllocError::ForeignBuffer) } else { Ok(()) }
    }

    /// Marks `buffer` as used on `stream` as well: when it is freed, its block is held until the
    /// work enqueued on `stream` up to that moment has completed (like
    /// `torch.Tensor.record_stream`). Recording its own stream does nothing.
    /// [`Buffer::record_stream`] does the same without naming the allocator.
    ///
    /// A buffer of another allocator is refused ([`AllocError::ForeignBuffer`]) and nothing is
    /// recorded anywhere.
    pub fn record_stream(&self, buffer: &Buffer<D>, stream: StreamId) -> Result<(), AllocError> {
        let sh = self.shared_of(buffer).ok_or(AllocError::ForeignBuffer)?;
        sh.record_use(buffer, stream)
    }

    /// Announces that work about to be enqueued on `stream` will `access` `buffer`; see
    /// [`Buffer::use_on`]. A buffer of another allocator is refused
    /// ([`AllocError::ForeignBuffer`]).
    pub fn use_on(
        &self,
        buffer: &Buffer<D>,
        stream: StreamId,
        access: AccessKind,
    ) -> Result<(), AllocError> {
        let sh = self.shared_of(buffer).ok_or(AllocError::ForeignBuffer)?;
        sh.use_on(buffer, stream, access)
    }

    /// Whether `buffer` was made by this allocator (or a clone of it).
    pub fn owns(&self, buffer: &Buffer<D>) -> bool {
        let theirs: &Shared<D> = &buffer.owner;
        std::ptr::eq(theirs, &*self.shared)
    }

    /// Waits for every pending event and returns those blocks to the pool (a host sync per
    /// event): the blocks freed after a use on another stream ([`Buffer::record_stream`],
    /// [`Buffer::use_on`]) become reusable now rather than when their events are next polled.
    ///
    /// It waits for those events only, not for the device: with nothing pending it returns at
    /// once, whatever the streams still run. To wait for all work (before reading results on
    /// the host, say), synchronise the device ([`Device::synchronize`], `torch.cuda.synchronize`).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tidepool::device::{Kernel, Launch};
    /// use tidepool::{Allocator, Config, Device, SimDevice, StreamId};
    ///
    /// let device = Arc::new(SimDevice::new(1 << 30));
    /// let other = device.create_stream().unwrap();
    /// let alloc = Allocator::new(device.clone(), Config::default()).unwrap();
    /// device.launch(other, Kernel::sleep(Duration::from_millis(200))).unwrap();
    /// alloc.synchronize().unwrap(); // nothing pending: no wait, `other` still runs
    /// assert_eq!(device.counters().host_syncs, 0);
    ///
    /// let buf = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    /// let ptr = buf.ptr();
    /// buf.record_stream(other).unwrap();
    /// drop(buf); // pending on an event recorded on `other`, behind the sleep
    /// alloc.synchronize().unwrap(); // waits for that event: one host sync
    /// assert_eq!(device.counters().host_syncs, 1);
    /// assert_eq!(alloc.alloc(4096, StreamId::DEFAULT).unwrap().ptr(), ptr); // reusable
    /// ```
    pub fn synchronize(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        sh.sync_events(&mut st)
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

/// What a general allocator does for another of its device that ran out of memory
/// (`src/peers.rs`): what its `empty_cache` does for transient memory.
impl<D: Device> crate::peers::Peer for Shared<D> {
    fn release_for_peer(&self) -> bool {
        if cfg!(tidepool_broken = "peers_kept") || self.device.capture_underway() {
            return false; // BROKEN (the first): the peers keep their caches
        }
        let _ = self.release_idle_regions();
        // What the family's dropped graphs held back for a synchronisation, as its own
        // `empty_cache` (and ladder) lets it go. BROKEN (`peers_keep_graph_holds`): kept.
        let holds =
            !cfg!(tidepool_broken = "peers_keep_graph_holds") && self.let_go_of_graph_holds();
        // The family's `use_on_oom` pools lend their free segments to any request of the
        // device that ran out, as they do for this allocator's own.
        // BROKEN (`peers_skip_pools`): only the general allocator's cache.
        let pools = !cfg!(tidepool_broken = "peers_skip_pools") && self.release_oom_pools();
        self.give_back_transient() | pools | holds
    }
}

/// A private pool a routed request failed in: counts the failure there once the ladder gives
/// up (`Allocator::count_oom`).
struct FailedPool<D: Device>(Allocator<D>);

impl<D: Device> crate::allocator::error::OomSink for FailedPool<D> {
    fn count_oom(&self, report: &OomReport) {
        self.0.shared.count_oom(report);
    }
}
