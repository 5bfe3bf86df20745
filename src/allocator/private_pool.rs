//! Private memory pools (PyTorch's `torch.cuda.MemPool` and `use_mem_pool`): a [`MemPool`] has
//! its own segments, statistics and snapshot; while a [`PoolGuard`] is alive, allocations on its
//! stream are served from the pool; the pool's memory returns to the device as a whole when the
//! pool and its last buffer are gone.
//!
//! ```text
//!  Allocator (general) ── Shared ─┬─ routes: [(route id, stream, pool)]   chosen at the top of alloc
//!                                 └─ family: Arc<Family> ─ captures, pools usable on OOM
//!  MemPool ── Allocator (private) ── Shared (its own pool, caches, statistics) ─ same family
//!  Buffer of the pool ── Owner ── private Shared          (freed into the pool, from any thread)
//! ```
//!
//! A private pool *is* an allocator of its own over the same device, sharing the general
//! allocator's family (capture table, out-of-memory helpers), so everything an allocator does —
//! stream order, events, the fast path, statistics, snapshots, the invariant checker — holds for
//! it unchanged, and routing is one lookup at the top of `alloc`. Each buffer holds its pool's
//! state, so a pool dropped while buffers are live stays sound: its segments are released when
//! the last buffer returns (after their pending events), not before.
//!
//! Routing is per *stream*, not per thread: a guard routes every allocation made on its stream,
//! from any thread. Stream order is what makes reuse inside a pool safe, and a stream capture
//! (CUDA graphs) is a property of a stream, so capture routing (`capture/`) is the same
//! mechanism; thread-local routing would send an allocation to a pool depending on which thread
//! happens to make it, which a multi-threaded stream user cannot control.
//!
//! The residency pools are *not* private pools: persistent and transient blocks share the
//! allocator's statistics, lock, stream caches and out-of-memory ladder and differ only in
//! eviction, which is a key of one pool (`PoolKey::residency`); a private pool separates all of
//! that, so making residency two private pools would split what callers read as one allocator.

use super::destroyed::DestroyedStreams;
use super::*;
use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

/// What the general allocator and its private pools share.
pub(crate) struct Family<D: Device> {
    /// Stream captures underway (`capture/`).
    pub(super) captures: capture::CaptureTable<D>,
    /// Pools whose free cached memory may serve others when they run out (`use_on_oom`), by
    /// pool id; an entry goes when the pool's last handle does.
    oom_pools: Mutex<Vec<(u64, Arc<Shared<D>>)>>,
    /// Streams destroyed through an allocator of the family (the device drained them), with
    /// the pool id of the one that destroyed each: an event that cannot be recorded on one
    /// has nothing to wait for, in every pool of the family (a graph pool's buffer used on a
    /// stream the general allocator destroyed). Runs of ids (`destroyed.rs`).
    destroyed: Mutex<DestroyedStreams>,
    /// Counts the streams an allocator of the family destroyed or forgot as gone from the
    /// device (`Family::note_gone`): an open scope compares it with the count it last saw, at
    /// each allocation, and asks the device about its stream when it moved (`Scope`'s
    /// `gone_seen`).
    pub(super) gone: AtomicU64,
    next_id: AtomicU64,
    /// What an allocator of the family could not give back to the device as it went.
    pub(super) leftovers: Leftovers,
    /// What dropped graphs held back and could not let go of because the wait for their
    /// launches failed: let go of after a later device synchronisation succeeds.
    pub(super) graph_holds: Mutex<Vec<capture::Held<D>>>,
    /// Bytes reserved by the allocators of the family together, as each last counted its own
    /// in (`pool_size.rs`): what the caps on reserved memory are checked against.
    pub(super) reserved: AtomicU64,
    /// The memory history the family records while it does, and the user's metadata
    /// (`history.rs`; [`Allocator::record_history`]).
    pub(super) history: Mutex<history::FamilyHistory>,
    /// Held by `set_config` across the general allocator's and its pools' configuration, and
    /// by `new_pool` while it reads it: two `set_config` calls at once leave every allocator of
    /// the family on the same one.
    pub(super) configuring: Mutex<()>,
    /// The device, once the general allocator's last handle went ([`Family::orphan`]): what
    /// another allocator's call synchronises to let go of the dropped graphs' holds.
    device: std::sync::OnceLock<Guarded<D>>,
    /// Every private pool made, by id, without keeping it alive: what the general allocator's
    /// snapshot pickle lists besides its own segments (PyTorch's snapshot shows every pool of
    /// the device). Not under loom, whose `Arc` has no `Weak` (and which models no dump).
    #[cfg(not(loom))]
    pools: Mutex<Vec<(u64, std::sync::Weak<Shared<D>>)>>,
}

impl<D: Device> Default for Family<D> {
    fn default() -> Self {
        Family {
            captures: capture::CaptureTable::default(),
            oom_pools: Mutex::new(Vec::new()),
            destroyed: Mutex::new(DestroyedStreams::default()),
            gone: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            leftovers: Leftovers::default(),
            graph_holds: Mutex::new(Vec::new()),
            reserved: AtomicU64::new(0),
            history: Mutex::new(history::FamilyHistory::default()),
            configuring: Mutex::new(()),
            device: std::sync::OnceLock::new(),
            #[cfg(not(loom))]
            pools: Mutex::new(Vec::new()),
        }
    }
}

impl<D: Device> Family<D> {
    /// Notes that pool `by` destroyed `stream` through the device (which drained it).
    pub(super) fn note_destroyed(&self, stream: StreamId, by: u64) {
        lock(&self.destroyed).insert(stream, by);
    }

    /// A stream went from the device (destroyed through an allocator of the family, or found
    /// gone by `release_stream`): open scopes ask again whether theirs is still there. Called
    /// once the device no longer has it.
    pub(super) fn note_gone(&self) {
        self.gone.fetch_add(1, Ordering::Release);
    }

    /// Whether `stream` was destroyed through the family, as pool `me` sees it: any pool's
    /// destruction counts (with [`Broken::PoolDestroyedStreams`] only the destroyer's own).
    pub(super) fn destroyed_for(&self, stream: StreamId, me: u64) -> bool {
        lock(&self.destroyed).by(stream).is_some_and(|by| by == FAMILY_WIDE || by == me)
    }

    /// Runs of destroyed stream ids the family keeps (`destroyed.rs`).
    #[cfg(feature = "test-hooks")]
    pub(super) fn destroyed_runs(&self) -> usize {
        lock(&self.destroyed).runs()
    }

    /// Keeps a run per destroyed id ([`Broken::DestroyedStreamsPerId`]).
    #[cfg(feature = "test-hooks")]
    pub(super) fn destroyed_per_id(&self, on: bool) {
        lock(&self.destroyed).set_per_id(on);
    }

    /// Lets go of what dropped graphs could not (`graph_holds`) once a device synchronisation
    /// succeeds (then one host sync, counted in `st`); nothing while a capture is underway.
    /// Called with `st`, the calling allocator's state, locked: the holds are let go of after it
    /// is unlocked by the caller, as their frees take allocator locks.
    pub(super) fn take_graph_holds(
        &self,
        device: &Guarded<D>,
        st: &mut State,
    ) -> Vec<capture::Held<D>> {
        self.take_graph_holds_counted(device, &mut st.counters.host_syncs)
    }

    /// [`Family::take_graph_holds`], its host sync counted in `syncs`.
    fn take_graph_holds_counted(
        &self,
        device: &Guarded<D>,
        syncs: &mut u64,
    ) -> Vec<capture::Held<D>> {
        let mut holds = lock(&self.graph_holds);
        if holds.is_empty() || device.capture_underway() {
            return Vec::new();
        }
        match super::events::count_host_wait(syncs, device.synchronize()) {
            Ok(()) => std::mem::take(&mut *holds),
            Err(_) => Vec::new(),
        }
    }

    /// The general allocator's last handle went (`Allocator`'s drop): holds that dropped
    /// graphs leave in the family from now on (or left already, the device refusing to
    /// synchronise then), are let go of by the other allocators of the device
    /// (`peers::let_go_of_orphans`: as their captures end, at their `empty_cache`, out of
    /// memory, as they go), since no call of this family is left to do it. BROKEN
    /// (`orphaned_graph_holds`): nobody does, and they stay for good.
    /// (A plain `&Arc` argument: loom's `Arc` is no method receiver.)
    pub(super) fn orphan(family: &Arc<Self>, device: &Guarded<D>) {
        if cfg!(tidepool_broken = "orphaned_graph_holds") {
            return;
        }
        let _ = family.device.set(Guarded::new(device.arc().clone()));
        crate::peers::orphan(device, family);
    }

    /// Whether dropped graphs left holds for a later synchronisation (`graph_holds`).
    pub(super) fn has_graph_holds(&self) -> bool {
        !lock(&self.graph_holds).is_empty()
    }

    /// The private pools of the family still alive (their handles gone or not: a pool lives
    /// while a buffer of it does), by id, in the order they were made.
    pub(super) fn live_pools(&self) -> Vec<(u64, Arc<Shared<D>>)> {
        #[cfg(not(loom))]
        return lock(&self.pools).iter().filter_map(|(id, p)| Some((*id, p.upgrade()?))).collect();
        #[cfg(loom)]
        Vec::new()
    }

    /// Notes a pool just made (and forgets those gone).
    fn register_pool(&self, id: u64, pool: &Arc<Shared<D>>) {
        #[cfg(not(loom))]
        {
            let mut pools = lock(&self.pools);
            pools.retain(|(_, p)| p.strong_count() > 0);
            pools.push((id, Arc::downgrade(pool)));
        }
        #[cfg(loom)]
        let _ = (id, pool);
    }

    /// A new id for a pool, a route or a capture (never 0).
    pub(super) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// A family whose general allocator is gone: another allocator of the device lets go of what
/// its dropped graphs held back (`src/peers.rs`), its host sync counted by none (the family's
/// general allocator is gone; the device's own count has it).
impl<D: Device> crate::peers::Orphan for Family<D> {
    fn let_go_of_holds(&self) -> bool {
        let Some(device) = self.device.get() else { return false };
        if !self.has_graph_holds() {
            return false;
        }
        let holds = self.take_graph_holds_counted(device, &mut 0);
        let any = !holds.is_empty();
        holds.into_iter().for_each(capture::Held::release);
        any
    }
}

/// [`Family::note_destroyed`]'s `by` for a destruction every pool of the family sees.
pub(super) const FAMILY_WIDE: u64 = u64::MAX;

/// PyTorch's pool id of pool `id` (0: the general allocator), made by a capture (`graph`) or by
/// the user ([`PoolRole::pytorch_id`]). BROKEN (`graph_pool_ids_as_mempools`): `(0, id)` for
/// every pool, a graph's as a `MemPool`'s.
pub(crate) fn pytorch_pool_id(id: u64, graph: bool) -> (u64, u64) {
    match graph && !cfg!(tidepool_broken = "graph_pool_ids_as_mempools") {
        true => (id, 0),
        false => (0, id),
    }
}

/// A private pool's own bookkeeping (in its `Shared`); the general allocator has id 0.
#[derive(Default)]
pub(crate) struct PoolRole {
    /// 0 for the general allocator.
    pub(super) id: u64,
    /// Guards routing to the pool now.
    pub(super) guards: AtomicUsize,
    /// Captures underway and graphs alive that use the pool.
    pub(super) graphs: AtomicUsize,
    /// Whether the pool was made by a capture given none ([`Allocator::begin_capture`] with
    /// `None`): PyTorch's graph-private pool, whose id is `(N, 0)` where a `MemPool`'s is
    /// `(0, N)`. Set before the pool is seen by anything else.
    pub(super) graph_made: AtomicBool,
}

impl PoolRole {
    /// The pool's id as PyTorch writes it in a snapshot (`segment_pool_id`, the history's
    /// `pool_id`): `(0, 0)` for the general allocator, `(id, 0)` for a pool a CUDA graph's
    /// capture made (PyTorch's `MemPool::graph_pool_handle(false)`, `{uuid_++, 0}`), `(0, id)`
    /// for one the user made (`{0, uid_++}`).
    pub(super) fn pytorch_id(&self) -> (u64, u64) {
        pytorch_pool_id(self.id, self.graph_made.load(Ordering::Relaxed))
    }

    /// Whether a graph (or a capture underway) uses the pool: then its free blocks are memory
    /// the replays write (the captures' freed temporaries), and none of it goes back to the
    /// device. Read under the pool's lock by every release: a capture that begins later
    /// allocates only after that release.
    pub(super) fn graph_held(&self) -> bool {
        self.graphs.load(Ordering::SeqCst) > 0
    }

    /// Counts one more holder in `mine` unless `theirs` has any: guards and graphs exclude each
    /// other (each side counts itself first, then looks, so two racing claims cannot both win:
    /// sequentially consistent, since each stores one location and loads the other). The caller
    /// gives its count back when done.
    pub(super) fn claim(mine: &AtomicUsize, theirs: &AtomicUsize) -> bool {
        mine.fetch_add(1, Ordering::SeqCst);
        if theirs.load(Ordering::SeqCst) > 0 {
            mine.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// As [`PoolRole::claim`] for a graph's capture, which must also be the only graph: counted
    /// in `graphs` only if no graph (or capture) and no guard holds the pool.
    pub(super) fn claim_alone(
        graphs: &AtomicUsize,
        guards: &AtomicUsize,
    ) -> Result<(), &'static str> {
        if graphs.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return Err("a live CUDA graph uses the pool (sharing it is begin_capture_sharing)");
        }
        if guards.load(Ordering::SeqCst) > 0 {
            graphs.fetch_sub(1, Ordering::SeqCst);
            return Err("a PoolGuard routes allocations to it");
        }
        Ok(())
    }
}

/// The streams routed to a private pool, in the general allocator.
pub(crate) struct Routes<D: Device> {
    /// All ones while any route exists, else 0 (checked before the table, with one load).
    active: AtomicU64,
    /// All ones while any route exists or the memory history records, else 0: what a scope's
    /// planned path ORs into its size check ([`Routes::mask_word`]), so that it stands aside
    /// for the general path then (which routes, or records, each allocation).
    aside: AtomicU64,
    /// Always 0: what a scope reads instead of `aside` in broken mode `PlannedStaleRoutes`.
    never: AtomicU64,
    /// The routes, and whether the history records (both set under this lock).
    table: Mutex<(Vec<Route<D>>, bool)>,
}

impl<D: Device> Default for Routes<D> {
    fn default() -> Self {
        Routes {
            active: AtomicU64::new(0),
            aside: AtomicU64::new(0),
            never: AtomicU64::new(0),
            table: Mutex::new((Vec::new(), false)),
        }
    }
}

struct Route<D: Device> {
    id: u64,
    stream: StreamId,
    pool: Allocator<D>,
    /// A guard's route (counted in the pool's `guards`), not a capture's.
    guard: bool,
}

impl<D: Device> Routes<D> {
    /// Whether any stream is routed (one relaxed load: the fast path's only cost).
    /// Relaxed is enough: the table itself is read under its lock, and a route (capture) that
    /// happens-before this call is seen by coherence; one installed concurrently by another
    /// thread has no order with this call anyway. (Acquire cost the planned pair 18 → 34 ns:
    /// it keeps the compiler from holding the scope's cursor cells in registers across it.)
    #[inline(always)]
    pub(super) fn any(&self) -> bool {
        self.active.load(Ordering::Relaxed) != 0
    }

    /// The word a scope's planned path reads (all ones while any stream is routed or the
    /// history records, else 0), with no pointer to the table in between; with `stale` (broken
    /// mode `PlannedStaleRoutes`) a word that stays 0, as if the routes were read once when the
    /// scope opened and no route existed.
    pub(super) fn mask_word(&self, stale: bool) -> &AtomicU64 {
        match stale {
            false => &self.aside,
            true => &self.never,
        }
    }

    fn set_active(&self, table: &(Vec<Route<D>>, bool)) {
        let word = |on: bool| if on { u64::MAX } else { 0 };
        let (routes, recording) = (!table.0.is_empty(), table.1);
        self.active.store(word(routes), Ordering::Release);
        // BROKEN (`planned_while_recording`): the planned path serves while the history records.
        let recording = recording && !cfg!(tidepool_broken = "planned_while_recording");
        self.aside.store(word(routes || recording), Ordering::Release);
    }

    /// Whether the memory history records: scopes' planned paths stand aside meanwhile.
    pub(super) fn set_recording(&self, on: bool) {
        let mut t = lock(&self.table);
        t.1 = on;
        self.set_active(&t);
    }

    /// The pool allocations on `stream` go to: the latest route of the stream.
    pub(super) fn get(&self, stream: StreamId) -> Option<Allocator<D>> {
        if !self.any() {
            return None;
        }
        lock(&self.table).0.iter().rev().find(|r| r.stream == stream).map(|r| r.pool.clone())
    }

    /// Whether `stream` is routed to a pool.
    pub(super) fn routed(&self, stream: StreamId) -> bool {
        self.any() && lock(&self.table).0.iter().any(|r| r.stream == stream)
    }

    /// Routes `stream` to `pool` (`guard`: for a guard, else for a capture) as route `id`.
    pub(super) fn add(&self, id: u64, stream: StreamId, pool: Allocator<D>, guard: bool) {
        let mut t = lock(&self.table);
        t.0.push(Route { id, stream, pool, guard });
        self.set_active(&t);
    }

    /// Removes every guard's route, their pools' `guards` counts given back; returns the pools
    /// (dropped by the caller, outside the lock). What the general allocator's last handle
    /// does: no allocation can be routed any more, and a `mem::forget`ten guard's route was
    /// the last hold of its pool once its `MemPool` handles went.
    pub(super) fn remove_guards(&self) -> Vec<Allocator<D>> {
        let mut t = lock(&self.table);
        let (gone, kept): (Vec<Route<D>>, Vec<Route<D>>) =
            std::mem::take(&mut t.0).into_iter().partition(|r| r.guard);
        t.0 = kept;
        self.set_active(&t);
        gone.into_iter()
            .map(|r| {
                r.pool.shared.role.guards.fetch_sub(1, Ordering::AcqRel);
                r.pool
            })
            .collect()
    }

    /// The pools that only routes reach: each route's pool whose `Allocator` values are all
    /// routes' (no `MemPool` handle, graph or capture holds it), once each. Only a
    /// `mem::forget`ten guard routes to such a pool: its own `empty_cache` is out of reach.
    pub(super) fn unreachable_pools(&self) -> Vec<Allocator<D>> {
        let t = lock(&self.table);
        let mut out: Vec<Allocator<D>> = Vec::new();
        for r in &t.0 {
            let sh = &r.pool.shared;
            if out.iter().any(|p| Arc::ptr_eq(&p.shared, sh)) {
                continue;
            }
            let routes = t.0.iter().filter(|q| Arc::ptr_eq(&q.pool.shared, sh)).count();
            // (A handle made meanwhile is a clone of one counted here, or of a graph's pool.)
            if sh.handles.load(Ordering::Acquire) == routes {
                out.push(r.pool.clone());
            }
        }
        out
    }

    /// Removes route `id`; returns its pool (dropped by the caller, outside the lock).
    pub(super) fn remove(&self, id: u64) -> Option<Allocator<D>> {
        let mut t = lock(&self.table);
        let i = t.0.iter().position(|r| r.id == id)?;
        let r = t.0.remove(i);
        self.set_active(&t);
        Some(r.pool)
    }
}

/// How a private pool behaves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolOptions {
    /// When an allocation elsewhere (the general allocator or another pool) runs out of memory,
    /// the pool's free cached segments are returned to the device and the allocation retried
    /// (PyTorch's `MemPool(use_on_oom=True)`, which lends the free blocks themselves).
    pub use_on_oom: bool,
    /// The pool never splits a block (PyTorch's `MemPool(no_split=True)`): each allocation
    /// takes a free block whole, so a new segment (sized as usual: 20 MiB for a 4 MiB
    /// request) holds one allocation — what code that registers each allocation's memory as a
    /// whole (NCCL) needs. An aligned request
    /// ([`Allocator::alloc_aligned`]) still splits its padding off.
    pub no_split: bool,
}

impl PoolOptions {
    /// Sets [`PoolOptions::use_on_oom`].
    pub fn with_use_on_oom(mut self, on: bool) -> PoolOptions {
        self.use_on_oom = on;
        self
    }

    /// Sets [`PoolOptions::no_split`].
    pub fn with_no_split(mut self, on: bool) -> PoolOptions {
        self.no_split = on;
        self
    }
}

/// A private memory pool: its own segments, statistics and snapshot. Allocations are routed to
/// it by [`Allocator::use_pool`] (or by a stream capture, [`Allocator::begin_capture`]). Cheap to
/// clone (a handle); when every handle is gone, its cached memory goes back to the device (unless
/// a live graph replays into it: then when the graph goes), and the rest as its buffers go.
///
/// ```
/// use std::sync::Arc;
/// use tidepool::{Allocator, Config, Device, PoolOptions, SimDevice};
///
/// let device = Arc::new(SimDevice::new(1 << 30));
/// let stream = device.create_stream().unwrap();
/// let alloc = Allocator::new(device.clone(), Config::default()).unwrap();
/// let pool = alloc.new_pool(PoolOptions::default()).unwrap();
/// let guard = alloc.use_pool(&pool, stream).unwrap();
/// let a = alloc.alloc(4096, stream).unwrap();        // from the pool
/// drop(guard);
/// assert_eq!(pool.stats().blocks.allocated_bytes.all.current, 4096);
/// assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 0);
/// drop((a, pool));                                   // the pool's segment goes back
/// assert!(device.live_segments().is_empty());
/// ```
pub struct MemPool<D: Device> {
    pub(super) alloc: Allocator<D>,
    /// Shared by the pool's handles: the last one takes the pool off the out-of-memory list.
    handle: Arc<PoolHandle<D>>,
}

/// What a pool's handles share.
struct PoolHandle<D: Device> {
    family: Arc<Family<D>>,
    id: u64,
}

impl<D: Device> Drop for PoolHandle<D> {
    fn drop(&mut self) {
        let gone: Vec<_> = {
            let mut list = lock(&self.family.oom_pools);
            let (gone, kept) =
                std::mem::take(&mut *list).into_iter().partition(|(id, _)| *id == self.id);
            *list = kept;
            gone
        };
        drop(gone); // outside the lock: may be the pool's last hold
    }
}

impl<D: Device> Clone for MemPool<D> {
    fn clone(&self) -> Self {
        MemPool { alloc: self.alloc.clone(), handle: self.handle.clone() }
    }
}

impl<D: Device> fmt::Debug for MemPool<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemPool")
            .field("id", &self.id())
            .field("reserved_bytes", &self.alloc.reserved_bytes())
            .field("allocated_bytes", &self.alloc.allocated_bytes())
            .finish()
    }
}

impl<D: Device> MemPool<D> {
    /// The pool's id (unique within its allocator family, never 0).
    pub fn id(&self) -> u64 {
        self.alloc.shared.role.id
    }

    /// The configuration the pool runs with: its allocator's (`set_config` reaches it), with
    /// no initial pool.
    pub fn config(&self) -> Arc<Config> {
        self.alloc.config()
    }

    /// The pool's own statistics (the general allocator's exclude it).
    pub fn stats(&self) -> MemoryStats {
        self.alloc.stats()
    }

    /// The pool's own statistics as `torch.cuda.memory_stats()`'s flat dictionary (see
    /// [`Allocator::memory_stats`]).
    pub fn memory_stats(&self) -> std::collections::BTreeMap<String, i64> {
        self.alloc.memory_stats()
    }

    /// Resets the pool's peak statistics to their current values (the general allocator's
    /// [`Allocator::reset_peak_stats`] resets them with its own).
    pub fn reset_peak_stats(&self) {
        self.alloc.shared.reset_peaks();
    }

    /// Resets the pool's accumulated statistics (the general allocator's
    /// [`Allocator::reset_accumulated_stats`] resets them with its own).
    pub fn reset_accumulated_stats(&self) {
        self.alloc.shared.reset_accumulated();
    }

    /// The pool's segments and blocks.
    pub fn snapshot(&self) -> Vec<SegmentInfo> {
        self.alloc.snapshot()
    }

    /// A text table of the pool's statistics.
    pub fn memory_summary(&self) -> String {
        self.alloc.memory_summary()
    }

    /// Returns the pool's free cached segments to the device. Refused (nothing released) while a
    /// graph uses the pool: its replays read that memory. (A capture that begins meanwhile is
    /// safe too: every release looks again under the pool's lock.) A graph of the pool dropped
    /// while it could not wait for its launches (during a capture) holds the pool until a
    /// device synchronisation: this call makes it first, as [`Allocator::empty_cache`] does.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        // A graph of the pool dropped during a capture left its hold on the pool in the family,
        // to go after a device synchronisation: this call makes it, as the general allocator's
        // `empty_cache` does. BROKEN (`pool_empty_keeps_graph_holds`): refused until then.
        if self.alloc.shared.role.graph_held()
            && !cfg!(tidepool_broken = "pool_empty_keeps_graph_holds")
        {
            let _ = self.alloc.shared.let_go_of_graph_holds();
        }
        if self.alloc.shared.role.graph_held() {
            return Err(AllocError::PoolBusy { reason: "a CUDA graph uses the pool" });
        }
        self.alloc.empty_cache()?;
        self.alloc.release_persistent()
    }

    /// Gives the pool's free cached memory back to the device until the pool reserves no more
    /// than `min_bytes_to_keep` bytes (`cudaMemPoolTrimTo` on a pool of its own); the bytes
    /// released. As [`Allocator::trim_to`], with what the pool's [`MemPool::empty_cache`]
    /// gives back: its transient memory first, then its persistent memory (a pool's memory is
    /// all its own). Refused while a graph uses the pool, as `empty_cache` is.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, MIB, PoolOptions, SimDevice, StreamId};
    ///
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    /// let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    /// let s = StreamId::DEFAULT;
    /// let bufs = {
    ///     let _guard = alloc.use_pool(&pool, s).unwrap();
    ///     [alloc.alloc(12 * MIB, s).unwrap(), alloc.alloc(12 * MIB, s).unwrap()]
    /// };
    /// drop(bufs);
    /// // Two 12 MiB segments: keeping at least 20 MiB keeps both, 12 MiB one.
    /// assert_eq!(pool.trim_to(20 * MIB).unwrap(), 0);
    /// assert_eq!(pool.trim_to(12 * MIB).unwrap(), 12 * MIB);
    /// assert_eq!(pool.stats().blocks.reserved_bytes.all.current, 12 * MIB);
    /// ```
    pub fn trim_to(&self, min_bytes_to_keep: u64) -> Result<u64, AllocError> {
        if self.alloc.shared.role.graph_held() {
            return Err(AllocError::PoolBusy { reason: "a CUDA graph uses the pool" });
        }
        let both = [Residency::Transient, Residency::Persistent];
        self.alloc.shared.trim_to(min_bytes_to_keep, &both)
    }

    /// Checks the pool's invariants (see [`Allocator::check_invariants`]).
    #[cfg(feature = "test-hooks")]
    pub fn check_invariants(&self) -> Result<(), String> {
        self.alloc.check_invariants()
    }

    /// Whether the buffers handed out from the pool and not yet freed start exactly at the
    /// addresses in `live` (PyTorch's `checkPoolLiveAllocations`, which CUDA-graph trees use to
    /// check that a graph's outputs are all that is left of its pool). Freed blocks that still
    /// wait on events, and buffers a graph holds back, are not live.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, Device, PoolOptions, SimDevice};
    ///
    /// let dev = Arc::new(SimDevice::new(1 << 30));
    /// let s = dev.create_stream().unwrap();
    /// let alloc = Allocator::new(dev, Config::default()).unwrap();
    /// let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    /// let (graph, out) = alloc.capture(s, Some(&pool), || alloc.alloc(16, s).unwrap()).unwrap();
    /// assert!(pool.check_live_allocations(&[out.ptr()]));
    /// assert!(!pool.check_live_allocations(&[]));
    /// drop(out);
    /// assert!(pool.check_live_allocations(&[]));
    /// # drop(graph);
    /// ```
    pub fn check_live_allocations(&self, live: &[DeviceAddr]) -> bool {
        let mut allocated: Vec<DeviceAddr> = self
            .snapshot()
            .iter()
            .flat_map(|seg| &seg.blocks)
            .filter(|b| b.state == BlockState::Allocated)
            .map(|b| b.address)
            .collect();
        let mut want = live.to_vec();
        allocated.sort_unstable();
        want.sort_unstable();
        want.dedup();
        allocated == want
    }

    /// Whether graphs (or captures underway) use the pool.
    pub fn graphs(&self) -> usize {
        self.alloc.shared.role.graphs.load(Ordering::Acquire)
    }
}

/// While alive, allocations on its stream are served from its pool ([`Allocator::use_pool`]).
/// Dropping it restores the routing that was in force before (an outer guard, or none).
#[must_use = "the pool is used only while the guard is alive"]
pub struct PoolGuard<'a, D: Device> {
    alloc: &'a Allocator<D>,
    id: u64,
}

impl<D: Device> Drop for PoolGuard<'_, D> {
    fn drop(&mut self) {
        if let Some(pool) = self.alloc.shared.routes.remove(self.id) {
            pool.shared.role.guards.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl<D: Device> fmt::Debug for PoolGuard<'_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolGuard").field("route", &self.id).finish()
    }
}

impl<D: Device> Allocator<D> {
    /// A new private pool, with this allocator's configuration (no initial pool of its own).
    pub fn new_pool(&self, options: PoolOptions) -> Result<MemPool<D>, AllocError> {
        self.new_pool_made(options, false)
    }

    /// [`Allocator::new_pool`]; `graph`: made by a capture given no pool (its PyTorch id is
    /// `(id, 0)`, [`PoolRole::pytorch_id`]).
    pub(super) fn new_pool_made(
        &self,
        options: PoolOptions,
        graph: bool,
    ) -> Result<MemPool<D>, AllocError> {
        let sh = &self.shared;
        let id = sh.family.next_id();
        let made_with = self.config();
        let config = (*made_with).clone().for_pool();
        let alloc = Allocator::build(sh.device.arc().clone(), config, sh.family.clone(), id)?;
        alloc.shared.role.graph_made.store(graph, Ordering::Relaxed);
        // A pool has its allocator's deliberate bugs (feature `test-hooks`).
        #[cfg(feature = "test-hooks")]
        {
            alloc.shared.broken.store(sh.broken.load(Ordering::Relaxed), Ordering::Relaxed);
            alloc.shared.device.set_unwind(sh.broken(super::Broken::DevicePanicsUnwind));
            let forks = sh.broken(super::Broken::CaptureForks);
            alloc.shared.device.set_records_in_captures(forks);
        }
        if options.no_split {
            alloc.shared.lock_state().pool.set_no_split(true);
        }
        if options.use_on_oom {
            lock(&sh.family.oom_pools).push((id, alloc.shared.clone()));
        }
        sh.family.register_pool(id, &alloc.shared);
        // A `set_config` since the configuration was read: the pool takes the new one (one
        // made after this registration lists the pool and gives it the same).
        {
            let _configuring = lock(&sh.family.configuring);
            let now = self.config();
            if !Arc::ptr_eq(&now, &made_with) {
                alloc.shared.apply_config((*now).clone().for_pool());
            }
        }
        // Recording the family's history: the pool records too (under the slot, so a
        // `record_history` call meanwhile either sees the pool registered or is seen here).
        if !cfg!(tidepool_broken = "pools_unrecorded") {
            let slot = lock(&sh.family.history);
            if let Some(ring) = &slot.ring {
                alloc.shared.tap_history(Some(ring.clone()));
            }
        }
        let handle = Arc::new(PoolHandle { family: sh.family.clone(), id });
        Ok(MemPool { alloc, handle })
    }

    /// Routes the allocations made on `stream` (by any thread) to `pool` while the guard is
    /// alive; scopes on the stream refuse to allocate meanwhile ([`AllocError::StreamRouted`]).
    /// Guards nest: the latest one of a stream wins. A pool of another allocator is refused
    /// ([`AllocError::ForeignPool`]), and so is one a CUDA graph uses (its free memory is the
    /// graph's: [`AllocError::PoolBusy`]), and a stream being captured ([`AllocError::Capture`]:
    /// its allocations come from the graph's pool until the capture ends, whatever guard routes
    /// it, since the graph's replays write them).
    pub fn use_pool(
        &self,
        pool: &MemPool<D>,
        stream: StreamId,
    ) -> Result<PoolGuard<'_, D>, AllocError> {
        let sh = &self.shared;
        if !Arc::ptr_eq(&pool.alloc.shared.family, &sh.family) || sh.role.id != 0 {
            return Err(AllocError::ForeignPool);
        }
        sh.stream_exists(stream)?;
        // A stream being captured allocates from its graph's pool until the capture ends
        // (`Allocator::routed_pool`): a guard would not route it, so it is refused, not left
        // to do nothing. (PyTorch's `use_mem_pool` inside a capture routes the captured
        // allocations to the pool, whose memory the graph's replays then write while nothing
        // keeps it from being handed out again.) BROKEN (`guard_in_capture`): given.
        if !cfg!(tidepool_broken = "guard_in_capture") && sh.family.captures.capturing(sh, stream) {
            return Err(AllocError::Capture {
                stream,
                reason: "the stream is being captured: its allocations come from the graph's pool",
            });
        }
        let role = &pool.alloc.shared.role;
        if !PoolRole::claim(&role.guards, &role.graphs) {
            return Err(AllocError::PoolBusy { reason: "a CUDA graph uses the pool" });
        }
        let id = sh.family.next_id();
        sh.routes.add(id, stream, pool.alloc.clone(), true);
        Ok(PoolGuard { alloc: self, id })
    }

    /// The allocator behind a buffer of this allocator or of one of its private pools.
    pub(super) fn shared_of<'b>(&'b self, buffer: &'b Buffer<D>) -> Option<&'b Shared<D>> {
        if self.shared.owns(buffer) {
            return Some(&self.shared);
        }
        let theirs: &Shared<D> = &buffer.owner;
        Arc::ptr_eq(&theirs.family, &self.shared.family).then_some(theirs)
    }
}

impl<D: Device> Shared<D> {
    /// A request on `stream`, routed to a private pool by a guard, ran out of memory: this (the
    /// general) allocator returns its free cached transient segments to the device, after the
    /// wait for its pending events (its own ladder's last rung), so that memory it cached serves
    /// the pool; whether any was released. Nothing for a stream that is not routed, nor while
    /// a capture is underway (a graph pool's request). (PyTorch's pool contexts skip this rung
    /// because they share the capture mechanism; a tidepool pool guard does not.)
    pub(super) fn release_for_routed(&self, stream: StreamId) -> bool {
        if self.role.id != 0
            || !self.routes.any()
            || self.routes.get(stream).is_none()
            || self.device.capture_underway()
            || self.broken(Broken::PoolOomKeepsGeneral)
        {
            return false;
        }
        self.give_back_transient()
    }

    /// Lets go of what dropped graphs of the family held back ([`Family::take_graph_holds`]:
    /// after a device synchronisation, none while a capture is underway), with no lock held
    /// as the holds go (their frees take allocator locks); whether any went.
    pub(super) fn let_go_of_graph_holds(&self) -> bool {
        if !self.family.has_graph_holds() {
            return false;
        }
        let holds = self.family.take_graph_holds(&self.device, &mut self.lock_state());
        let any = !holds.is_empty();
        holds.into_iter().for_each(capture::Held::release);
        any
    }

    /// Flushes the stream caches, waits for the pending frees (the ladder's wait, idle plan
    /// regions included) and returns the free transient segments and pages to the device;
    /// whether reserved bytes went down. What a routed request asks of the general allocator,
    /// and another allocator of the device of this one (`src/peers.rs`).
    pub(super) fn give_back_transient(&self) -> bool {
        let mut st = self.lock_state();
        let before = st.pool.reserved_bytes();
        self.flush_all(&mut st);
        let _ = self.ladder_wait(&mut st);
        let _ = self.release_segments(&mut st, |s| s.key.residency == Residency::Transient);
        st.pool.reserved_bytes() < before
    }

    /// Returns the free cached segments of the `use_on_oom` pools (other than this one) to the
    /// device; whether any was released. Nothing while a capture is underway.
    pub(super) fn release_oom_pools(&self) -> bool {
        if self.device.capture_underway() {
            return false;
        }
        let pools: Vec<Arc<Shared<D>>> =
            lock(&self.family.oom_pools).iter().map(|(_, p)| p.clone()).collect();
        let mut released = false;
        for pool in pools {
            if std::ptr::eq(&*pool, self) {
                continue;
            }
            // (A pool a graph uses releases nothing: `release_segment` and `release_pages` look
            // under its lock.) Released means reserved bytes went: segments, or an expandable
            // range's pages.
            let mut st = pool.lock_state();
            let (before, before_free) = (st.pool.reserved_bytes(), st.counters.device_free);
            pool.flush_all(&mut st);
            pool.process_events(&mut st);
            let _ = pool.release_segments(&mut st, |_| true);
            released |= match self.broken(Broken::OomPoolPagesUncounted) {
                // BROKEN: only released segments count; released pages leave the request failed.
                true => st.counters.device_free > before_free,
                false => st.pool.reserved_bytes() < before,
            };
        }
        released
    }
}
