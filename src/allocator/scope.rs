//! Scopes: transient regions of work on one stream (one training step, one request).
//!
//! ```text
//!  Scope (guard, one thread) ── run: RefCell<Run> ── steps so far / plan cursor, live table,
//!     │                                              region slot, local cache, counters
//!     ├─ alloc()          ─▶ ScopedBuffer<'scope> { &scope, ptr, index, slot of its pool buffer
//!     │                        in `run.held`, or none for a planned slice }
//!     │                        drop: records Free(index) in `run` directly (no lock, no atomic)
//!     └─ alloc_unbound()  ─▶ Buffer + ScopeTag ── Arc<ScopeShared> { Mutex<open, freed[]>, flag }
//!                              drop (any thread): queues Free(index); the scope drains the queue
//!                              at its next operation
//! ```
//!
//! A scoped buffer cannot outlive its scope (its lifetime borrows the guard), and a scope is
//! used from one thread (it is `!Sync`), so the run's state needs no lock: a planned allocation
//! is a comparison with the plan's next step and an addition to the region's base. Freed scoped
//! buffers from the pool go to the scope's local cache, reused by the scope's next allocation of
//! the same rounded size; at exit the cache goes back to the stream's pool in one batch under one
//! lock. The blocks belong to the scope's stream, so stream order makes the batch safe with no
//! event at all; other streams reach them only through the cross-stream rules. Buffers made with
//! [`Scope::alloc_unbound`] may outlive the scope and be freed on any thread: their frees are
//! queued under a small mutex and recorded by the scope in order at its next step.
//!
//! A *named* scope also records its run and serves the next identical run from a learned plan
//! (see `plan.rs`).

use super::adopt::Escape;
use super::batch::BatchBlock;
use super::counters::quadrant;
use super::plan::{Entry, Learned, Region, Script, Step, UNFREED};
use super::{AllocError, Allocator, Buffer, Origin};
use crate::config::Config;
use crate::device::{Device, DeviceAddr, Guarded, StreamId};
use crate::pool::BlockId;
use crate::stats::Residency;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::{Arc, Mutex, lock};
use std::cell::{Cell, OnceCell, RefCell};
use std::collections::HashMap;

const TRANSIENT: Residency = Residency::Transient;
/// `LiveEntry::offset` of an allocation not served from the region.
const NO_OFFSET: u64 = u64::MAX;
/// An allocation index no allocation gets (the run's allocation count stops below it).
const NO_INDEX: u32 = u32::MAX;
/// The slot field of a pool buffer's id (30 bits) all ones: the most pool buffers a run holds
/// at once is one fewer.
const NO_SLOT: u32 = (1 << 30) - 1;
/// The top bits of a pool buffer's id (see [`ScopedBuffer`]).
const POOL: u64 = 3 << 62;
/// The id of a zero-byte buffer (no step recorded).
const ZERO_ID: u64 = u64::MAX;
/// Set in `Cursor::pos` while the planned path may not serve: no script position is that large,
/// so the planned path's one bounds check fails.
const FAST_OFF: usize = 1 << (usize::BITS - 1);
/// What the general path returns instead of an id when it failed (no id is 0: a planned
/// buffer's free is never a run's first step); the error waits in `Scope::error`.
const FAILED: u64 = 0;

/// What unbound buffers of a run reach from any thread.
pub(crate) struct ScopeShared {
    state: Mutex<SharedRun>,
    /// Set while `freed` is non-empty, so the scope's steps skip the lock when nothing is queued.
    pending: AtomicBool,
}

struct SharedRun {
    open: bool,
    /// Unbound buffers freed while the run is open, in order, not yet recorded by the scope.
    freed: Vec<u32>,
    /// The region that adopted the segments of this run's escapes (see `adopt.rs`), held until
    /// every escape pinned in it was freed (`to_absorb` of them are left).
    adopt: Option<Arc<Region>>,
    to_absorb: usize,
}

/// Ties an unbound buffer to the scope run that made it.
pub(crate) struct ScopeTag {
    shared: Arc<ScopeShared>,
    index: u32,
    /// Other streams it was used on (`record_stream`), for planned buffers, which have no pool
    /// block to hold: their free makes the owner stream wait for these streams instead.
    uses: Mutex<Vec<StreamId>>,
    /// Whether `uses` is non-empty (so a free without uses takes no lock for them).
    has_uses: AtomicBool,
}

impl ScopeTag {
    /// Notes a use on another stream, remembered for planned buffers.
    pub(crate) fn used_on(&self, stream: StreamId) {
        self.has_uses.store(true, Ordering::Relaxed);
        let mut uses = lock(&self.uses);
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// The other streams the buffer was used on (a copy).
    pub(crate) fn uses(&self) -> Vec<StreamId> {
        match self.has_uses.load(Ordering::Relaxed) {
            true => lock(&self.uses).clone(),
            false => Vec::new(),
        }
    }

    /// The other streams the buffer was used on (taken: called once, as it is freed).
    pub(crate) fn take_uses(&self) -> Vec<StreamId> {
        match self.has_uses.load(Ordering::Relaxed) {
            true => std::mem::take(&mut *lock(&self.uses)),
            false => Vec::new(),
        }
    }

    /// Called from `Buffer::drop`, once the buffer's memory is ordered after its uses on other
    /// streams: queues the free while the run is open (the scope may reuse a planned slice at
    /// its next step); after it ended, unpins an escaped planned slice, or hands an escaped pool
    /// block to the region that adopted its segment.
    pub(crate) fn on_drop<D: Device>(&self, buf: &mut Buffer<D>) {
        let mut run = lock(&self.shared.state);
        if run.open {
            run.freed.push(self.index);
            self.shared.pending.store(true, Ordering::Release);
            return;
        }
        match buf.origin() {
            Origin::Region(region, offset) => region.unpin(*offset),
            &Origin::Pool(block) => {
                let Some(region) = run.adopt.clone() else { return };
                if !region.is_pinned(buf.ptr.0) {
                    return; // an escape in a segment the region did not adopt
                }
                // Freed during a foreign capture of its stream (or of one it was used on): its
                // block is held for good (the buffer's drop), its slice pinned for good.
                let uses = match buf.used_elsewhere() {
                    true => buf.owner.block_uses(block),
                    false => Vec::new(),
                };
                let foreign = buf.owner.scope_free_foreign(buf.stream, &uses);
                // (Not under the run's lock: a block used on other streams takes the global one.)
                drop(run);
                let b = BatchBlock {
                    block,
                    quadrant: buf.quadrant as usize,
                    size: buf.size,
                    requested: buf.accounted,
                };
                if foreign {
                    // (Kept pinned: the region never serves the range again.)
                } else if !buf.used_elsewhere() {
                    // Taken back before the region can serve the range again.
                    buf.owner.device.note_reclaim(buf.ptr, buf.size, buf.stream);
                    region.absorb(b, buf.ptr.0);
                    buf.take_block();
                } else if buf.owner.absorb_later(&region, b, buf.ptr, buf.stream) {
                    // Joins once the other streams' work on it is done (`Region::settle`), or
                    // at once; `absorb_later` told the sanitizer.
                    if cfg!(tidepool_broken = "escape_reclaimed_late") {
                        buf.owner.device.note_reclaim(buf.ptr, buf.size, buf.stream);
                    }
                    buf.take_block();
                }
                // (Otherwise the block takes the event path to the pool, its range pinned.)
                let mut run = lock(&self.shared.state);
                run.to_absorb = run.to_absorb.saturating_sub(1);
                let last = if run.to_absorb == 0 { run.adopt.take() } else { None };
                drop(run);
                if let Some(last) = last {
                    buf.owner.release_region(last);
                }
                buf.owner.release_region(region);
            }
            Origin::None => {}
        }
    }
}

/// An unbound allocation of the run: its index, block size, offset in the region (or
/// `NO_OFFSET`), and whether it is still live. (Bound buffers cannot outlive the scope, so
/// only unbound ones can escape.)
#[derive(Clone, Copy)]
struct LiveEntry {
    index: u32,
    size: u64,
    offset: u64,
    live: bool,
    /// Its address, and its pool block if it has one.
    ptr: u64,
    block: Option<BlockId>,
}

/// A run's hold on its plan's region: one run at a time serves from a region.
enum RegionSlot {
    /// Not used yet by this run (the plan's region, if it has one already).
    Unclaimed(Option<Arc<Region>>),
    /// This run serves planned slices from it.
    Claimed(Arc<Region>),
    /// Another run of the same scope holds it, or it could not be reserved: no planned slices.
    Denied,
}

/// Where a run stands against its plan: the planned path reads and writes only `pos`.
struct Cursor {
    /// Number of steps taken, with `FAST_OFF` set unless the planned path may serve the next
    /// step: the run follows its plan, holds its region, has no pins to check and no planned
    /// buffer used on another stream, and the scope's rules allow it (`Scope::fast_ok`). One
    /// load and one bounds check stand for all of these (see `Scope::set_fast`).
    pos: Cell<usize>,
    /// Whether every step so far equals the plan's step at the same position. While it does,
    /// the steps are the plan's prefix of length `len` and `Run::steps` stays empty.
    following: Cell<bool>,
    /// Number of allocations made (the next allocation's index) once the run stopped following
    /// its plan or had none; while it follows, the plan counts them (`Learned::allocs_before`).
    allocs: Cell<u32>,
    /// Base address of the claimed region, `NO_BASE` until claimed (or if denied).
    base: Cell<u64>,
    /// Whether slices must be checked against pinned ones (an earlier run left escapes when
    /// the region was claimed; pins are only removed while this run holds the claim).
    check_pins: Cell<bool>,
    /// Whether some planned buffer was used on another stream (see `Run::uses`).
    any_uses: Cell<bool>,
    /// The step at which the run stopped following its plan (`usize::MAX`: it has not).
    diverged_at: Cell<usize>,
    /// A CUDA graph holds the claimed region (a planned slice was freed during a capture): the
    /// run serves no more slices from it (`base` stays, for what the run's end reclaims).
    held: Cell<bool>,
}

impl Cursor {
    /// Number of steps taken.
    #[inline]
    fn len(&self) -> usize {
        self.pos.get() & !FAST_OFF
    }
}

const NO_BASE: u64 = u64::MAX;

/// The rest of a run's state, owned by its scope.
struct Run<D: Device> {
    /// The steps, once the run stopped following a plan (or had none).
    steps: Vec<Step>,
    /// Unbound allocations, in index order, and how many are live.
    unbound: Vec<LiveEntry>,
    live_unbound: usize,
    region: RegionSlot,
    /// Freed pool blocks by rounded size, ready for reuse in this run.
    local: HashMap<u64, Vec<(BatchBlock, DeviceAddr)>>,
    /// The pool buffers behind live scoped buffers, by slot (kept here so a scoped buffer stays
    /// a few words), and the free slots.
    held: Vec<Option<Buffer<D>>>,
    free_slots: Vec<u32>,
    /// Planned buffers used on other streams: (allocation index, stream).
    uses: Vec<(u32, StreamId)>,
    misses: u64,
    /// Allocation indices that followed the plan but were served by the pool (plan misses).
    /// Every other allocation that followed the plan is a plan hit, so hits are not counted.
    missed: Vec<u32>,
}

impl<D: Device> Run<D> {
    /// Whether every slot is taken (`NO_SLOT` pool buffers are held).
    fn full(&self) -> bool {
        self.free_slots.is_empty() && self.held.len() >= NO_SLOT as usize
    }

    /// Keeps a pool buffer for a scoped buffer; returns its slot (`full` was checked).
    fn hold(&mut self, buf: Buffer<D>) -> u32 {
        match self.free_slots.pop() {
            Some(i) => {
                self.held[i as usize] = Some(buf);
                i
            }
            None => {
                self.held.push(Some(buf));
                (self.held.len() - 1) as u32
            }
        }
    }

    fn unhold(&mut self, slot: u32) -> Buffer<D> {
        self.free_slots.push(slot);
        self.held[slot as usize].take().expect("a held buffer")
    }

    /// Allocation `index` followed the plan but was served by the pool.
    fn missed(&mut self, index: u32) {
        self.misses += 1;
        self.missed.push(index);
    }

    /// Marks unbound allocation `index` freed.
    fn unbound_freed(&mut self, index: u32) {
        if let Ok(k) = self.unbound.binary_search_by_key(&index, |e| e.index) {
            self.unbound[k].live = false;
            self.live_unbound -= 1;
        }
    }
}

/// A transient region of work on one stream; see the module docs. Ends when dropped.
///
/// A scope is used from the thread that opened it (it is not `Sync`); buffers from
/// [`Scope::alloc`] borrow the scope, so they cannot outlive it:
///
/// ```compile_fail
/// use std::sync::Arc;
/// use tidepool::{Allocator, Config, SimDevice, StreamId};
/// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
/// let scope = alloc.scope(StreamId::DEFAULT);
/// let buf = scope.alloc(4096).unwrap();
/// drop(scope); // error: `scope` is still borrowed by `buf`
/// drop(buf);
/// ```
///
/// ```
/// use std::sync::Arc;
/// use tidepool::{Allocator, Config, SimDevice, StreamId};
/// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
/// for _step in 0..3 {
///     let scope = alloc.named_scope("train_step", StreamId::DEFAULT);
///     let a = scope.alloc(4096).unwrap();
///     let b = scope.alloc(8192).unwrap();
///     drop(a);
///     drop(b);
/// }
/// let s = alloc.stats();
/// assert_eq!(s.plan_hits, 4); // runs 2 and 3 follow the plan learned in run 1
/// ```
#[must_use = "a Scope ends (and recycles its buffers) when dropped"]
pub struct Scope<'a, D: Device> {
    alloc: &'a Allocator<D>,
    device: &'a Guarded<D>,
    /// The planned path's stand-aside mask (all ones while any stream is routed or the history
    /// records, see `Routes::mask_word`), ORed into its size check at every allocation: a
    /// guard or a capture may begin on the stream, or recording start, on any thread, while
    /// the scope is open.
    route_mask: &'a AtomicU64,
    /// The rounding granule when this run's size rules round every request up to a multiple
    /// of it and nothing else (the default rules): the planned path then checks a request
    /// against the plan's rounded size with one subtraction. 0 otherwise.
    granule: u64,
    /// Whether the planned path may serve this run at all: a plan whose sizes are multiples of
    /// `granule` (non-zero), and a device whose sanitizer hooks are off (with a sanitizer every
    /// hand-out and free goes through the general path, which tells it).
    fast_ok: bool,
    stream: StreamId,
    name: Option<std::sync::Arc<str>>,
    /// The name this run marked the start of in the memory history (recorded when it opened),
    /// and the ring it marked: its end is marked there when it closes (not in a ring recording
    /// started again since, where it would be an end without a start).
    annotation: Option<(std::sync::Arc<str>, super::history::Ring)>,
    /// The configuration as of opening: every request of the run is rounded the same way.
    config: Arc<Config>,
    /// Whether the device had the stream when the scope opened (if not, every allocation is
    /// refused with [`AllocError::UnknownStream`]).
    stream_ok: bool,
    /// The plan this run follows while its steps repeat it.
    plan: Option<Arc<Learned>>,
    /// The plan's script (empty without a plan), where the planned path reads it: no `Option`
    /// to test and no pointer to the plan to follow.
    script: Script,
    /// Whether this is a learning run over expandable segments (see `Shared::learning`).
    learning: bool,
    cursor: Cursor,
    run: RefCell<Run<D>>,
    /// Made by the first unbound allocation (a run without one allocates nothing for it).
    shared: OnceCell<Arc<ScopeShared>>,
    /// The error of the general path's last failed allocation, for `Scope::alloc`.
    error: Cell<Option<AllocError>>,
}

/// A buffer of a [`Scope`]; it cannot outlive the scope, nor leave its thread (the scope's
/// run state is not synchronised, which is what makes a planned allocation a few nanoseconds):
///
/// ```compile_fail
/// use std::sync::Arc;
/// use tidepool::{Allocator, Config, SimDevice, StreamId};
/// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
/// let scope = alloc.scope(StreamId::DEFAULT);
/// let buf = scope.alloc(4096).unwrap();
/// std::thread::scope(|t| {
///     t.spawn(move || drop(buf)); // error: `ScopedBuffer` cannot be sent between threads
/// });
/// ```
///
/// Memory that another thread frees comes from [`Scope::alloc_unbound`] instead.
#[must_use = "dropping a ScopedBuffer frees its memory at once"]
pub struct ScopedBuffer<'s, D: Device> {
    scope: &'s Scope<'s, D>,
    ptr: DeviceAddr,
    requested: u64,
    /// What it is, in one word (see [`Scope::kind`]):
    ///
    /// ```text
    ///  planned, freed by the plan   position of its free in the script   (< 2^62)
    ///  planned, never freed by it   UNFREED | allocation index           (01 in the top bits)
    ///  pool buffer                  POOL | slot << 32 | allocation index (11; slot in `Run::held`)
    ///  zero bytes                   ZERO_ID                              (all ones)
    /// ```
    ///
    /// The run's position (`Cursor::pos`) equals the id only for a planned buffer whose free is
    /// the plan's next step while the planned path may serve, so its drop is one comparison.
    id: u64,
}

/// What a [`ScopedBuffer::id`] stands for.
#[derive(Clone, Copy)]
enum Kind {
    Zero,
    /// A planned slice, with its allocation index.
    Planned(u32),
    /// A pool buffer: its allocation index and slot.
    Pool(u32, u32),
}

/// A run's hold on `region`: claimed, or denied (let go through `release_region`, so the last
/// hold returns its blocks) while another run holds it or once it is poisoned.
fn claim_slot<D: Device>(shared: &super::state::Shared<D>, region: Arc<Region>) -> RegionSlot {
    if region.try_claim() {
        // Escapes whose other streams' work is done join it first: their slices are planned.
        if region.is_settling() {
            shared.settle_claimed(&region);
        }
        return RegionSlot::Claimed(region);
    }
    shared.release_region(region);
    RegionSlot::Denied
}

/// The script of a scope without a plan: empty, made once.
fn no_script() -> Script {
    static EMPTY: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| Script::from([]));
    EMPTY.clone()
}

/// The id of a pool buffer (see [`ScopedBuffer::id`]).
#[inline]
const fn pool_id(index: u32, slot: u32) -> u64 {
    POOL | (slot as u64) << 32 | index as u64
}

// A zero-byte buffer's id is no pool buffer's (slot `NO_SLOT` is never held).
const _: () = assert!(pool_id(NO_INDEX, NO_SLOT) == ZERO_ID);

impl<D: Device> ScopedBuffer<'_, D> {
    fn kind(&self) -> Kind {
        self.scope.kind(self.id)
    }

    /// The device address of the first byte ([`DeviceAddr::NULL`] for a zero-byte buffer).
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        self.requested
    }

    /// Whether this is a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.requested == 0
    }

    /// Bytes of the block or slice behind it.
    pub fn block_size(&self) -> u64 {
        match self.kind() {
            Kind::Zero => 0,
            // A planned slice is the plan's step, which is the request rounded by the run's rules.
            Kind::Planned(_) => self.scope.round(self.requested).unwrap_or(0),
            Kind::Pool(_, slot) => {
                self.scope.run.borrow().held[slot as usize].as_ref().map_or(0, |b| b.size)
            }
        }
    }

    /// The scope's stream, which owns it.
    pub fn stream(&self) -> StreamId {
        self.scope.stream
    }

    /// The device its memory lives on (the scope's allocator's).
    pub(crate) fn device(&self) -> &Arc<D> {
        self.scope.alloc.device()
    }

    /// Whether it was served from the learned plan's region.
    pub fn is_planned(&self) -> bool {
        matches!(self.kind(), Kind::Planned(_))
    }

    /// Marks it as used on `stream` too (see [`Allocator::record_stream`]): it is no longer
    /// reused locally, and its reuse is ordered after `stream`'s work.
    pub fn record_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        self.scope.alloc.shared.stream_exists(stream)?;
        if stream == self.scope.stream {
            return Ok(());
        }
        let mut run = self.scope.run.borrow_mut();
        match self.kind() {
            Kind::Zero => {}
            Kind::Pool(_, slot) => {
                if let Some(buf) = &run.held[slot as usize] {
                    self.scope.alloc.shared.record_use(buf, stream)?;
                }
            }
            Kind::Planned(index) => {
                if !run.uses.contains(&(index, stream)) {
                    run.uses.push((index, stream));
                    self.scope.cursor.any_uses.set(true);
                    self.scope.set_fast();
                }
            }
        }
        Ok(())
    }
}

impl<D: Device> Drop for ScopedBuffer<'_, D> {
    #[inline(always)]
    fn drop(&mut self) {
        self.scope.free_bound(self.id, self.ptr, self.requested);
    }
}

impl<D: Device> std::fmt::Debug for ScopedBuffer<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.requested)
            .field("block_size", &self.block_size())
            .field("stream", &self.scope.stream)
            .field("planned", &self.is_planned())
            .finish()
    }
}

impl<D: Device> Allocator<D> {
    /// Opens an anonymous scope on `stream`.
    pub fn scope(&self, stream: StreamId) -> Scope<'_, D> {
        Scope::open(self, stream, None)
    }

    /// Opens a scope named `name` on `stream`: it remembers its run, and a later run that
    /// repeats it is served from a planned layout in O(1) per allocation.
    pub fn named_scope(&self, name: &str, stream: StreamId) -> Scope<'_, D> {
        Scope::open(self, stream, Some(name))
    }
}

impl<'a, D: Device> Scope<'a, D> {
    fn open(alloc: &'a Allocator<D>, stream: StreamId, name: Option<&str>) -> Scope<'a, D> {
        let config = alloc.shared.config.load_full();
        // While the history is recorded, a named run is a range of it (`record_annotation`).
        let recording = alloc.shared.recording.load(Ordering::Relaxed);
        let annotation = match name {
            Some(n) if recording => {
                let n: std::sync::Arc<str> = std::sync::Arc::from(n);
                alloc.shared.annotate(n.clone(), true).map(|ring| (n, ring))
            }
            _ => None,
        };
        // With caching off (`caching:false`) a scope neither learns plans nor reuses blocks
        // locally: every allocation and free reaches the device. Nor while the history is
        // recorded: every allocation and free then goes through the allocator, which records
        // it (a plan's slices and the local cache's reuses would not be, and a learned run's
        // adopted segments would show as segments freed and reserved).
        // BROKEN (`scopes_unrecorded`): plans and the local cache while recording.
        let local = config.caching && (!recording || cfg!(tidepool_broken = "scopes_unrecorded"));
        let (name, plan, region) = match name.filter(|_| local) {
            Some(n) => {
                let (name, plan, region) = alloc.shared.plan_for(n, stream);
                (Some(name), plan, region)
            }
            None => (None, None, None),
        };
        let learning = name.is_some() && plan.is_none() && alloc.shared.learning(stream, true);
        let z = &config.sizing;
        let granule =
            match z.min_block_size.is_power_of_two() && z.roundup_power2_divisions.is_off() {
                true => z.min_block_size,
                false => 0,
            };
        let fast_ok = granule != 0
            && plan.as_ref().is_some_and(|p| p.granule == granule)
            && (!alloc.shared.device.observes_handouts()
                || alloc.shared.broken(super::Broken::PlannedUnobserved));
        let stream_ok = alloc.shared.stream_exists(stream).is_ok();
        // A plan whose region exists is claimed now, so the run's first allocation is planned
        // too (one that must make its region makes it at its first planned allocation).
        let region = match region {
            Some(r) if stream_ok => claim_slot(&alloc.shared, r),
            r => RegionSlot::Unclaimed(r),
        };
        let (base, check_pins) = match &region {
            RegionSlot::Claimed(r) => (r.base, r.has_pins()),
            _ => (NO_BASE, false),
        };
        // As `set_fast` has it.
        let on = fast_ok && base != NO_BASE && !check_pins;
        Scope {
            alloc,
            device: &alloc.shared.device,
            route_mask: alloc
                .shared
                .routes
                .mask_word(alloc.shared.broken(super::Broken::PlannedStaleRoutes)),
            granule,
            fast_ok,
            stream,
            name,
            annotation,
            config,
            stream_ok,
            cursor: Cursor {
                pos: Cell::new(if on { 0 } else { FAST_OFF }),
                following: Cell::new(plan.is_some()),
                allocs: Cell::new(0),
                base: Cell::new(base),
                check_pins: Cell::new(check_pins),
                any_uses: Cell::new(false),
                diverged_at: Cell::new(usize::MAX),
                held: Cell::new(false),
            },
            script: plan.as_ref().map_or_else(no_script, |p| p.script.clone()),
            plan,
            learning,
            run: RefCell::new(Run {
                steps: Vec::new(),
                unbound: Vec::new(),
                live_unbound: 0,
                region,
                local: HashMap::new(),
                held: Vec::new(),
                free_slots: Vec::new(),
                uses: Vec::new(),
                misses: 0,
                missed: Vec::new(),
            }),
            shared: OnceCell::new(),
            error: Cell::new(None),
        }
    }

    /// Recomputes whether the planned path may serve the next step (the `FAST_OFF` bit of
    /// `Cursor::pos`); called wherever one of its conditions changes.
    fn set_fast(&self) {
        let c = &self.cursor;
        let on = self.fast_ok
            && c.following.get()
            && c.base.get() != NO_BASE
            && !c.check_pins.get()
            && !c.any_uses.get()
            && !c.held.get();
        c.pos.set(c.len() | if on { 0 } else { FAST_OFF });
    }

    /// The queue of unbound buffers' frees, made by the run's first unbound allocation.
    fn shared(&self) -> &Arc<ScopeShared> {
        self.shared.get_or_init(|| {
            Arc::new(ScopeShared {
                state: Mutex::new(SharedRun {
                    open: true,
                    freed: Vec::new(),
                    adopt: None,
                    to_absorb: 0,
                }),
                pending: AtomicBool::new(false),
            })
        })
    }

    /// The scope's stream.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// **Test only** (feature `test-hooks`): pretends the run already made `n` allocations, so
    /// tests reach the end of the run's allocation index without 2³² allocations (a run that
    /// follows a plan counts its allocations from the plan instead).
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn set_allocation_count(&self, n: u32) {
        self.cursor.allocs.set(n);
    }

    /// Marks a scoped buffer as used on `stream` too; see [`ScopedBuffer::record_stream`].
    /// A buffer of another scope is refused ([`AllocError::ForeignBuffer`]), nothing recorded.
    pub fn record_stream(
        &self,
        buffer: &ScopedBuffer<'_, D>,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let theirs = buffer.scope as *const Scope<'_, D> as *const ();
        if !std::ptr::eq(theirs, self as *const Self as *const ())
            && !self.alloc.shared.broken(super::Broken::ForeignBuffers)
        {
            return Err(AllocError::ForeignBuffer);
        }
        buffer.record_stream(stream)
    }

    /// Allocates `bytes` of transient memory for this scope; the buffer cannot outlive it.
    #[inline]
    pub fn alloc(&self, bytes: u64) -> Result<ScopedBuffer<'_, D>, AllocError> {
        // Both paths give (address, id) in registers, and the buffer is made once, here.
        let (ptr, id) = match self.try_planned(bytes) {
            Some(r) => r,
            None => {
                std::hint::cold_path();
                match self.alloc_slow(bytes) {
                    (_, FAILED) => return Err(self.take_error(bytes)),
                    r => r,
                }
            }
        };
        Ok(ScopedBuffer { scope: self, ptr, requested: bytes, id })
    }

    /// The planned path, small enough to inline: the planned path may serve (`Cursor::pos`
    /// has no `FAST_OFF`: the run follows its plan, holds the region, has no pins to check),
    /// the plan's next step is this allocation, and no private pool routes a stream. Changes
    /// nothing unless it succeeds. Frees of unbound buffers queued by other threads are not
    /// looked at: while one is queued the plan's next step is its free (the run stops at it and
    /// takes the general path, which records it) or a later one (then the plan's slice for
    /// this allocation does not overlap it, which is still live in the plan).
    #[inline(always)]
    fn try_planned(&self, bytes: u64) -> Option<(DeviceAddr, u64)> {
        let c = &self.cursor;
        let pos = c.pos.get();
        let &Entry { size, span, offset, id } = self.script.get(pos)?;
        // The plan's next step is an allocation that `bytes` rounds to (see `Entry`; the plan's
        // granule is the run's, `fast_ok`), and no stream is routed (the mask is then all ones,
        // above any span). A zero-byte request never matches.
        // While a capture is underway on the device, the general path asks whose it is.
        // BROKEN (`foreign_capture_served`, and `foreign_capture_hit` alone): not asked.
        if size.wrapping_sub(bytes) | self.route_mask.load(Ordering::Relaxed) >= span
            || (!cfg!(tidepool_broken = "foreign_capture_served")
                && !cfg!(tidepool_broken = "foreign_capture_hit")
                && self.alloc.shared.device.capture_underway())
        {
            return None;
        }
        c.pos.set(pos + 1);
        Some((DeviceAddr(c.base.get() + offset), id))
    }

    /// The general path: the buffer's address and id, or `FAILED` with the error in `error`.
    /// (Cold: the planned path falls through to the buffer.)
    #[cold]
    #[inline(never)]
    fn alloc_slow(&self, bytes: u64) -> (DeviceAddr, u64) {
        match self.alloc_general(bytes) {
            Ok(r) => r,
            Err(e) => {
                self.error.set(Some(e));
                (DeviceAddr::NULL, FAILED)
            }
        }
    }

    #[cold]
    fn take_error(&self, bytes: u64) -> AllocError {
        self.error.take().unwrap_or(AllocError::InvalidSize { requested: bytes })
    }

    fn alloc_general(&self, bytes: u64) -> Result<(DeviceAddr, u64), AllocError> {
        self.check_stream()?;
        self.drain_freed();
        if bytes == 0 {
            return Ok((DeviceAddr::NULL, ZERO_ID));
        }
        let rounded = self.round(bytes)?;
        let index = self.next_index()?;
        let mut missed = false;
        if let Some(e) = self.step(Step::Alloc(rounded)) {
            if let Some(ptr) = self.planned(e.offset, rounded) {
                return Ok((ptr, e.id));
            }
            missed = true;
        }
        if self.run.borrow().full() {
            self.unstep();
            return Err(AllocError::TooManyScopeAllocations { limit: u64::from(NO_SLOT) });
        }
        let buf = self.pool_block_or_unstep(bytes, rounded)?;
        let ptr = buf.ptr;
        let mut run = self.run.borrow_mut();
        if missed {
            run.missed(index);
        }
        let slot = run.hold(buf);
        Ok((ptr, pool_id(index, slot)))
    }

    /// What a buffer id of this run stands for (see [`ScopedBuffer::id`]).
    #[inline]
    fn kind(&self, id: u64) -> Kind {
        if id < UNFREED {
            // The position of its free in this run's plan, whose entry holds its index.
            Kind::Planned(self.script[id as usize].offset as u32)
        } else if id < POOL {
            Kind::Planned(id as u32)
        } else if id == ZERO_ID {
            Kind::Zero
        } else {
            Kind::Pool(id as u32, (id >> 32) as u32 & NO_SLOT)
        }
    }

    /// Whether frees of unbound buffers wait to be recorded.
    #[inline(always)]
    fn queued(&self) -> bool {
        self.shared.get().is_some_and(|s| s.pending.load(Ordering::Acquire))
    }

    /// Allocates `bytes` through this scope as an ordinary [`Buffer`] that may outlive it (and
    /// be freed on any thread), for callers that cannot express lifetimes (the trace replayer,
    /// framework bridges). One still live at scope exit is an *escape*: counted, kept correct,
    /// and planned like any other allocation (its slice stays pinned until it is freed).
    pub fn alloc_unbound(&self, bytes: u64) -> Result<Buffer<D>, AllocError> {
        self.check_stream()?;
        self.drain_freed();
        if bytes == 0 {
            return Ok(self.alloc.hand_out(
                DeviceAddr::NULL,
                0,
                0,
                self.stream,
                None,
                0,
                TRANSIENT,
                0,
            ));
        }
        let rounded = self.round(bytes)?;
        let index = self.next_index()?;
        let (mut planned, mut missed) = (None, false);
        if let Some(e) = self.step(Step::Alloc(rounded)) {
            match self.planned(e.offset, rounded) {
                Some(ptr) => planned = Some(ptr),
                None => missed = true,
            }
        }
        let (mut buf, offset) = match planned {
            Some(ptr) => {
                let q = quadrant(self.config.sizing.kind(rounded), TRANSIENT);
                let mut b = self.alloc.hand_out(
                    ptr,
                    bytes,
                    rounded,
                    self.stream,
                    None,
                    rounded,
                    TRANSIENT,
                    q,
                );
                let offset = ptr.0 - self.cursor.base.get();
                let RegionSlot::Claimed(region) = &self.run.borrow().region else {
                    unreachable!("a planned slice comes from the claimed region")
                };
                b.set_origin(Origin::Region(region.clone(), offset));
                (b, offset)
            }
            None => (self.pool_block_or_unstep(bytes, rounded)?, NO_OFFSET),
        };
        let mut run = self.run.borrow_mut();
        if missed {
            run.missed(index);
        }
        let (ptr, block) = (buf.ptr.0, buf.block());
        run.unbound.push(LiveEntry { index, size: buf.size, offset, live: true, ptr, block });
        run.live_unbound += 1;
        buf.set_scope(Box::new(ScopeTag {
            shared: self.shared().clone(),
            index,
            uses: Mutex::new(Vec::new()),
            has_uses: AtomicBool::new(false),
        }));
        Ok(buf)
    }

    /// The next allocation's index in the run. `NO_INDEX` (`u32::MAX`) is never given: the
    /// allocation that would take it is refused, so the index cannot overflow. (A run that
    /// follows a plan never gets there: its plan was learned from a run that did not.)
    #[inline]
    fn next_index(&self) -> Result<u32, AllocError> {
        let c = &self.cursor;
        let index = match &self.plan {
            Some(plan) if c.following.get() => plan.allocs_before(c.len()),
            _ => c.allocs.get(),
        };
        if index == NO_INDEX {
            return Err(AllocError::TooManyScopeAllocations { limit: u64::from(NO_INDEX) });
        }
        c.allocs.set(index + 1);
        Ok(index)
    }

    /// Refuses every allocation of a scope opened on a stream the device did not have. (The
    /// planned path needs the region, which such a scope never claims, so it never gets that
    /// far.)
    #[inline]
    fn check_stream(&self) -> Result<(), AllocError> {
        let sh = &self.alloc.shared;
        if sh.routes.routed(self.stream) || sh.family.captures.joined(sh, self.stream) {
            return Err(AllocError::StreamRouted(self.stream));
        }
        // A capture of another family (or of the device itself) captures the stream: its
        // replays would write the run's memory, which the scope hands out again.
        // BROKEN (`foreign_capture_served`): served as usual.
        if !cfg!(tidepool_broken = "foreign_capture_served")
            && let Some(origin) = sh.foreign_capture(self.stream)
        {
            return Err(AllocError::ForeignCapture { stream: self.stream, origin });
        }
        match self.stream_ok {
            true => Ok(()),
            false => Err(AllocError::UnknownStream(self.stream)),
        }
    }

    #[inline]
    fn round(&self, bytes: u64) -> Result<u64, AllocError> {
        match self.config.sizing.round(bytes) {
            Some(rounded) => Ok(rounded),
            None => Err(AllocError::InvalidSize { requested: bytes }),
        }
    }

    /// Takes a step; while the run still follows its plan, returns the plan's entry for it.
    #[inline]
    fn step(&self, step: Step) -> Option<Entry> {
        let c = &self.cursor;
        let len = c.len();
        c.pos.set(c.pos.get() + 1);
        // (While the run follows, the script is its plan's.)
        if c.following.get()
            && let Some(e) = self.script.get(len)
            && e.step() == step
        {
            return Some(*e);
        }
        self.step_off_plan(len, step);
        None
    }

    /// Takes back the last step, an allocation that failed: it never happened, so neither the
    /// plan nor the run's indices may count it, and a run it made diverge follows again.
    #[cold]
    fn unstep(&self) {
        let c = &self.cursor;
        c.pos.set(c.pos.get() - 1);
        let len = c.len();
        if c.following.get() {
            return; // the plan counts the run's allocations
        }
        c.allocs.set(c.allocs.get() - 1);
        let mut run = self.run.borrow_mut();
        run.steps.pop();
        if c.diverged_at.get() == len {
            c.following.set(true);
            c.diverged_at.set(usize::MAX);
            run.steps.clear();
            drop(run);
            self.set_fast();
        }
    }

    #[cold]
    fn step_off_plan(&self, len: usize, step: Step) {
        let mut run = self.run.borrow_mut();
        if self.cursor.following.replace(false)
            && let Some(plan) = &self.plan
        {
            run.steps = plan.steps(len);
            self.cursor.diverged_at.set(len);
            // From now on the run counts its allocations (this one included).
            let this = u32::from(matches!(step, Step::Alloc(_)));
            self.cursor.allocs.set(plan.allocs_before(len) + this);
            self.set_fast();
        }
        run.steps.push(step);
    }

    /// The steps of the run, for learning.
    fn take_steps(&mut self) -> Vec<Step> {
        match &self.plan {
            Some(plan) if self.cursor.following.get() => plan.steps(self.cursor.len()),
            _ => std::mem::take(&mut self.run.get_mut().steps),
        }
    }

    /// The planned slice at `offset` (of an allocation that follows the plan), if it can be
    /// served.
    #[inline]
    fn planned(&self, offset: u64, size: u64) -> Option<DeviceAddr> {
        let c = &self.cursor;
        // While the history records (whenever the run opened), the allocator serves and
        // records every allocation: a planned slice would be in no entry.
        // BROKEN (`planned_while_recording`): the plan serves on.
        let recording = self.recording_now() && !cfg!(tidepool_broken = "planned_while_recording");
        if c.held.get() || recording {
            return None;
        }
        let base = c.base.get();
        if base == NO_BASE {
            return self.planned_claiming(offset, size);
        }
        if c.check_pins.get() && self.pinned(offset, size) {
            return None;
        }
        let ptr = DeviceAddr(base + offset);
        self.device.note_handout(ptr, size, self.stream);
        Some(ptr)
    }

    fn pinned(&self, offset: u64, size: u64) -> bool {
        match &self.run.borrow().region {
            RegionSlot::Claimed(region) => region.overlaps_pinned(offset, size),
            _ => true,
        }
    }

    /// The first planned allocation of a run that has not claimed its plan's region yet: claims
    /// it, made on first use. `None` when another run holds it or it cannot be made (out of
    /// memory, a device error): then the whole run is served by the pool, which reports any
    /// error itself.
    #[cold]
    fn planned_claiming(&self, offset: u64, size: u64) -> Option<DeviceAddr> {
        match self.claim(true) {
            true => self.planned(offset, size),
            false => None,
        }
    }

    /// Claims the plan's region for this run, if it was not tried yet: the plan's region, or
    /// with `make` one made now if the plan has none (the stream's cached transient segments
    /// are trimmed first so the region replaces them). `false` when there is none to claim (or
    /// `make` is false and it does not exist yet), or another run holds it; then this run
    /// serves no planned slice.
    fn claim(&self, make: bool) -> bool {
        let mut run = self.run.borrow_mut();
        let (Some(name), Some(plan)) = (self.name.as_deref(), &self.plan) else { return false };
        let RegionSlot::Unclaimed(existing) = &mut run.region else { return false };
        // The run's hold moves out of the slot; every hold lets go through `release_region`
        // (a plain drop of the last one would strand the region's blocks in the pool).
        let region = match existing.take() {
            Some(r) => r,
            None if !make => return false,
            None => match self.alloc.shared.make_region(name, self.stream, plan) {
                Ok(Some(r)) => r,
                _ => {
                    run.region = RegionSlot::Denied;
                    return false;
                }
            },
        };
        // (A denied region is let go with the run's borrow ended.)
        let slot = {
            drop(run);
            claim_slot(&self.alloc.shared, region)
        };
        let RegionSlot::Claimed(r) = &slot else {
            self.run.borrow_mut().region = slot;
            return false;
        };
        self.cursor.base.set(r.base);
        self.cursor.check_pins.set(r.has_pins());
        self.run.borrow_mut().region = slot;
        self.set_fast();
        true
    }

    /// [`Scope::pool_block`] for the allocation just stepped: the step is taken back if it
    /// fails, and also if it unwinds. The allocator runs user code on the way (out-of-memory
    /// observers, the failure callback), and a panic there that the caller catches must leave
    /// the run as an error would; else the run records an allocation that never happened, and
    /// the next run learns a plan with it.
    fn pool_block_or_unstep(&self, bytes: u64, rounded: u64) -> Result<Buffer<D>, AllocError> {
        /// Takes the step back as it goes, unless disarmed.
        struct Unstep<'s, 'a, D: Device>(&'s Scope<'a, D>, bool);
        impl<D: Device> Drop for Unstep<'_, '_, D> {
            fn drop(&mut self) {
                if self.1 {
                    self.0.unstep();
                }
            }
        }
        // BROKEN: a panic in the allocator's user code leaves the step taken.
        let mut guard = Unstep(self, !cfg!(tidepool_broken = "unwind_step"));
        let r = self.pool_block(bytes, rounded);
        guard.1 = r.is_err();
        r
    }

    /// A pool block for the run: from the local cache when one of the size was freed in this
    /// run, else from the allocator.
    fn pool_block(&self, bytes: u64, rounded: u64) -> Result<Buffer<D>, AllocError> {
        // (While the history is recorded, the allocator hands out and records every block.)
        let cached = if self.recording_now() {
            None
        } else {
            let mut run = self.run.borrow_mut();
            let list = run.local.get_mut(&rounded);
            list.and_then(|v| v.pop_if(|(b, _)| self.may_reuse(b)))
        };
        let Some((b, ptr)) = cached else {
            // Out of memory, the run's own idle memory goes back first (`give_back_idle`).
            // BROKEN (`scope_idle_kept`): it stays out of the ladder's reach.
            let give_back =
                &mut || !cfg!(tidepool_broken = "scope_idle_kept") && self.give_back_idle();
            return self.alloc.alloc_in_giving_back(bytes, self.stream, TRANSIENT, give_back);
        };
        // A transient request may have been placed in a persistent segment's free space
        // (`residency.rs`): the block keeps its segment's residency, as when it was handed out.
        let residency = super::stats_layout::residency_of(b.quadrant);
        let mut reused = self.alloc.hand_out(
            ptr,
            bytes,
            b.size,
            self.stream,
            Some(b.block),
            rounded,
            residency,
            b.quadrant,
        );
        // The statistics still account the block with the request it was first made for.
        reused.accounted = b.requested;
        Ok(reused)
    }

    /// The out-of-memory ladder's first rung for the run's requests (found in review: a request
    /// the allocator alone would serve failed inside a scope): returns the run's locally cached
    /// blocks to the pool (as its end would), and lets go of the region of a run that left its
    /// plan once none of the planned slices it was served is live (it serves no more). Whether
    /// anything was given back.
    #[cold]
    fn give_back_idle(&self) -> bool {
        let blocks: Vec<BatchBlock> = {
            let mut run = self.run.borrow_mut();
            run.local.drain().flat_map(|(_, v)| v.into_iter().map(|(b, _)| b)).collect()
        };
        let any = !blocks.is_empty();
        if any {
            self.alloc.shared.free_blocks(self.stream, &blocks);
        }
        let c = &self.cursor;
        if c.following.get() || c.held.get() || c.base.get() == NO_BASE {
            return any;
        }
        let mut run = self.run.borrow_mut();
        if !matches!(run.region, RegionSlot::Claimed(_)) || !run.uses.is_empty() {
            return any;
        }
        // The planned allocations are the ones before the divergence that did not miss; one
        // not freed in the run's steps (a live buffer, an escape, a forgotten one) may still be
        // in use.
        let freed: std::collections::HashSet<u32> = run
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Free(i) => Some(*i),
                _ => None,
            })
            .collect();
        let missed: std::collections::HashSet<u32> = run.missed.iter().copied().collect();
        let before = &run.steps[..c.diverged_at.get().min(run.steps.len())];
        let allocs = before.iter().filter(|s| matches!(s, Step::Alloc(_)));
        let live = (0u32..).zip(allocs).any(|(i, _)| !missed.contains(&i) && !freed.contains(&i));
        if live {
            return any;
        }
        let RegionSlot::Claimed(region) = std::mem::replace(&mut run.region, RegionSlot::Denied)
        else {
            unreachable!("checked above")
        };
        drop(run);
        region.unclaim();
        c.base.set(NO_BASE);
        self.set_fast();
        self.alloc.shared.release_region(region);
        true
    }

    /// Whether the memory history is recorded now (whenever the run opened): the local cache
    /// neither takes nor serves blocks meanwhile, and the run learns no plan, so that what the
    /// history sees stays whole.
    fn recording_now(&self) -> bool {
        // BROKEN (`local_while_recording`, `scopes_unrecorded`): never.
        !cfg!(tidepool_broken = "local_while_recording")
            && !cfg!(tidepool_broken = "scopes_unrecorded")
            && self.alloc.shared.recording.load(Ordering::Relaxed)
    }

    /// Whether a block the run freed into its local cache may serve a transient request now:
    /// one that sits in persistent memory (a persistent ordinary segment's free space, where
    /// the search placed it while the residencies shared free space) only while they still
    /// do, i.e. while no expandable ranges serve requests (`residency.rs`); otherwise it waits
    /// in the cache for the run's end, and the request goes to the pool.
    fn may_reuse(&self, b: &BatchBlock) -> bool {
        let sh = &self.alloc.shared;
        super::stats_layout::residency_of(b.quadrant) == TRANSIENT
            || !sh.over_ranges(&self.alloc.config())
            || sh.broken(super::Broken::LocalReuseAcrossRanges)
    }

    /// Records the free of a bound buffer (`id` as in [`ScopedBuffer`]). The planned path,
    /// inlined: the run's position is the buffer's id, so the planned path may serve (no
    /// `FAST_OFF`: following, no planned buffer used on another stream, no sanitizer) and the
    /// plan's next step is this buffer's free (a pool buffer's or a zero-byte one's id is no
    /// position).
    #[inline(always)]
    fn free_bound(&self, id: u64, ptr: DeviceAddr, requested: u64) {
        let c = &self.cursor;
        let pos = c.pos.get();
        // (While a stream is routed — a guard, or a capture that may hold the slice back — the
        // mask is all ones and the free takes the slow path.)
        // (Nor while a capture is underway on the device: one of another family may capture the
        // stream, and its graph may use the slice for as long as it lives.)
        // BROKEN (`foreign_scope_reused`): not asked.
        if (pos as u64 ^ id) | self.route_mask.load(Ordering::Relaxed) == 0
            && (cfg!(tidepool_broken = "foreign_scope_reused")
                || !self.alloc.shared.device.capture_underway())
        {
            c.pos.set(pos + 1);
            return;
        }
        self.free_slow(id, ptr, requested);
    }

    /// A planned slice only orders its reuse after the streams it was used on; a pool block
    /// goes to the local cache unless it was used on another stream. Frees of unbound buffers
    /// queued by other threads are recorded first (the plan may have them before this one).
    #[inline(never)]
    fn free_slow(&self, id: u64, ptr: DeviceAddr, requested: u64) {
        let (index, slot) = match self.kind(id) {
            Kind::Zero => return,
            Kind::Planned(index) => (index, None),
            Kind::Pool(index, slot) => (index, Some(slot)),
        };
        self.drain_freed();
        self.step(Step::Free(index));
        let Some(slot) = slot else {
            // A planned slice: the plan's step, the request rounded by the run's rules.
            let size = self.round(requested).unwrap_or(0);
            self.device.note_reclaim(ptr, size, self.stream);
            let uses = match self.cursor.any_uses.get() {
                true => self.take_uses(index),
                false => Vec::new(),
            };
            // A capture that holds the slice orders its reuse after `uses` as the graph goes
            // (no event can be waited on by a captured stream now).
            if self.alloc.shared.family.captures.any() && self.hold_region(&uses) {
                return;
            }
            // A foreign capture's graph may use the slice for good: its region serves no more.
            if self.alloc.shared.scope_free_foreign(self.stream, &uses) {
                self.foreign_region();
                return;
            }
            if !uses.is_empty() && !self.alloc.shared.order_after(self.stream, &uses) {
                self.poison_region();
            }
            return;
        };
        let mut run = self.run.borrow_mut();
        let mut buf = run.unhold(slot);
        // A private pool may have served it (a guard or a capture began routing the stream on
        // another thread, or in an out-of-memory callback, after the scope checked the route):
        // its block is that pool's, freed there by the ordinary drop, never kept here.
        let ours = {
            let theirs: &super::state::Shared<D> = &buf.owner;
            std::ptr::eq(theirs, &*self.alloc.shared)
                || self.alloc.shared.broken(super::Broken::ScopeKeepsRouted)
        };
        // Nor while its stream is captured: the graph's replays may read it, so its drop
        // hands it to the graph (`capture.rs`) instead, or, for a capture of another family,
        // holds it for good (`Shared::hold_for_foreign`).
        let sh = &self.alloc.shared;
        let captured = (sh.family.captures.capturing(sh, self.stream)
            && !sh.broken(super::Broken::CaptureScopeFrees))
            || sh.scope_free_foreign(self.stream, &[]);
        if ours
            && !captured
            && !buf.used_elsewhere()
            && self.config.caching
            && !self.recording_now()
            && let Some(block) = buf.block()
        {
            self.device.note_reclaim(buf.ptr, buf.size, self.stream);
            let b = BatchBlock {
                block,
                quadrant: buf.quadrant as usize,
                size: buf.size,
                requested: buf.accounted,
            };
            run.local.entry(buf.rounded).or_default().push((b, buf.ptr));
            buf.take_block();
        }
        drop(run);
        drop(buf); // the ordinary stream-ordered free, unless taken into the local cache
    }

    /// The streams freed planned allocation `index` was used on (taken out of the run's
    /// record): its reuse must be ordered after them.
    #[cold]
    fn take_uses(&self, index: u32) -> Vec<StreamId> {
        let mut others = Vec::new();
        self.run.borrow_mut().uses.retain(|&(i, s)| {
            if i == index {
                others.push(s);
            }
            i != index
        });
        others
    }

    /// A planned slice (used on `uses` too) was freed while a capture may hold it: if one does
    /// (`true`), the graph holds the claimed region, which serves no more slices in this run
    /// and is claimed by no later run until the graph is gone (its replays may read the slice),
    /// and orders its reuse after `uses` then. Broken mode `CaptureScopeFrees`: the slice is
    /// served again at once.
    #[cold]
    fn hold_region(&self, uses: &[StreamId]) -> bool {
        let sh = &self.alloc.shared;
        if sh.broken(super::Broken::CaptureScopeFrees) {
            return false;
        }
        let RegionSlot::Claimed(region) = &self.run.borrow().region else { return false };
        if !sh.family.captures.hold_region(sh, self.stream, uses, region) {
            return false;
        }
        self.cursor.held.set(true);
        self.set_fast();
        true
    }

    /// Nothing could order a freed planned slice's reuse: the claimed region serves no more
    /// slices in this run and is never claimed or reused again.
    #[cold]
    fn poison_region(&self) {
        if let RegionSlot::Claimed(region) = &self.run.borrow().region {
            region.poison();
        }
        self.cursor.base.set(NO_BASE);
        self.set_fast();
    }

    /// A planned slice was freed during a foreign capture (`Shared::scope_free_foreign`): the
    /// claimed region serves no more slices in this run, and is never claimed or returned to
    /// the pool again (its plan lets go of it as the next run opens).
    #[cold]
    fn foreign_region(&self) {
        if let RegionSlot::Claimed(region) = &self.run.borrow().region {
            region.mark_foreign();
        }
        self.cursor.held.set(true);
        self.set_fast();
    }

    /// At exit: the planned slices of bound buffers that were never freed (`mem::forget`) go
    /// back to the sanitizer, and the stream is ordered after every use recorded on a planned
    /// buffer that was never freed, so neither the next run nor the pool reuses the memory
    /// before those uses completed. `steps` are the run's steps unless it `followed` its plan.
    fn reclaim_forgotten(&mut self, steps: &[Step], followed: bool) {
        let base = self.cursor.base.get();
        if let (Some(plan), true) = (&self.plan, base != NO_BASE) {
            // Planned allocations are the run's first steps that followed the plan.
            let prefix = self.followed();
            let computed;
            let unfreed = match followed {
                true => &plan.unfreed,
                false => {
                    computed = Learned::unfreed(steps);
                    &computed
                }
            };
            let run = self.run.get_mut();
            let mut forgotten = false;
            for &(pos, index) in unfreed {
                if pos as usize >= prefix
                    || run.missed.contains(&index)
                    || run.unbound.binary_search_by_key(&index, |e| e.index).is_ok()
                {
                    continue; // not a planned slice, or an unbound one (an escape)
                }
                let e = plan.script[pos as usize];
                if let Step::Alloc(size) = e.step() {
                    self.device.note_reclaim(DeviceAddr(base + e.offset), size, self.stream);
                    forgotten = true;
                }
            }
            // The run's end frees them: during a foreign capture of the stream (or of one a
            // planned buffer was used on), that graph may use them for good, and the region
            // serves and returns nothing more (as for a planned slice freed then).
            let uses: Vec<StreamId> = run.uses.iter().map(|&(_, s)| s).collect();
            if forgotten
                && self.alloc.shared.scope_free_foreign(self.stream, &uses)
                && let RegionSlot::Claimed(region) = &run.region
            {
                region.mark_foreign();
            }
        }
        let run = self.run.get_mut();
        if run.uses.is_empty() || self.alloc.shared.broken(super::Broken::ForgottenUses) {
            return;
        }
        let mut others: Vec<StreamId> = run.uses.drain(..).map(|(_, s)| s).collect();
        others.sort_unstable();
        others.dedup();
        if !self.alloc.shared.order_after(self.stream, &others) {
            self.poison_region();
        }
    }

    /// Number of the run's first steps that followed its plan.
    fn followed(&self) -> usize {
        match self.cursor.following.get() {
            true => self.cursor.len(),
            false => self.cursor.diverged_at.get(),
        }
    }

    /// The run's plan hits: every allocation that followed the plan but was not a miss (the
    /// planned path counts nothing).
    fn plan_hits(&self) -> u64 {
        let followed = self.plan.as_ref().map_or(0, |p| p.allocs_before(self.followed()));
        let misses = self.run.borrow().misses;
        debug_assert!(u64::from(followed) >= misses, "{followed} allocations, {misses} misses");
        u64::from(followed).saturating_sub(misses)
    }

    /// Records the frees of unbound buffers queued since the last step.
    #[inline]
    fn drain_freed(&self) {
        if self.queued() {
            self.drain_queue();
        }
    }

    #[cold]
    fn drain_queue(&self) {
        let Some(shared) = self.shared.get() else { return };
        let freed = {
            let mut st = lock(&shared.state);
            shared.pending.store(false, Ordering::Relaxed);
            std::mem::take(&mut st.freed)
        };
        for i in freed {
            self.unbound_freed(i);
        }
        // An unbound planned slice freed during a foreign capture marked the region (before its
        // free was queued): the run serves no more slices from it.
        if let RegionSlot::Claimed(region) = &self.run.borrow().region
            && region.is_foreign()
        {
            self.cursor.held.set(true);
            self.set_fast();
        }
    }

    /// Records the free of unbound allocation `index`.
    fn unbound_freed(&self, index: u32) {
        self.step(Step::Free(index));
        self.run.borrow_mut().unbound_freed(index);
    }
}

impl<D: Device> Drop for Scope<'_, D> {
    /// Ends the run: escapes are counted (planned ones pinned), the local cache goes back to the
    /// pool in one batch, and a named scope learns the run unless it followed its plan exactly.
    /// A first plan adopts the run's leftover segments (`adopt.rs`); later ones get their region
    /// when the next run first needs it.
    fn drop(&mut self) {
        let sh = &self.alloc.shared;
        // Closed under the queue's lock, held to the end: an unbound buffer freed from now on
        // finds the run closed (and any adopted region in place), one freed before is recorded.
        if self.learning {
            sh.learning(self.stream, false);
        }
        // (A run without unbound buffers has no queue: nothing can reach it after the exit.)
        let shared = self.shared.get().cloned();
        let mut st = shared.as_ref().map(|s| lock(&s.state));
        if let Some(st) = &mut st {
            for i in std::mem::take(&mut st.freed) {
                self.unbound_freed(i);
            }
            st.open = false;
        }
        let followed = self.cursor.following.get()
            && self.plan.as_ref().is_some_and(|p| p.len() == self.cursor.len());
        let steps = if followed { Vec::new() } else { self.take_steps() };
        // Planned slices of forgotten scoped buffers: taken back, and ordered after the other
        // streams they were used on, before the region can serve or return them.
        self.reclaim_forgotten(&steps, followed);
        let hits = self.plan_hits();
        let recording = self.recording_now();
        let run = self.run.get_mut();
        // Pool buffers of forgotten scoped buffers: freed now, before the pool is looked at.
        run.held.clear();
        if let RegionSlot::Claimed(region) = &run.region {
            for e in run.unbound.iter().filter(|e| e.live && e.offset != NO_OFFSET) {
                region.pin(e.offset, e.size);
            }
            region.unclaim();
        }
        // Every hold on a region lets go through `release_region`, so whichever is last (the
        // plan relearned below, this scope, an escaped buffer) returns its blocks to the pool.
        let region = match std::mem::replace(&mut run.region, RegionSlot::Denied) {
            RegionSlot::Claimed(r) | RegionSlot::Unclaimed(Some(r)) => Some(r),
            _ => None,
        };
        let c = &sh.scope_counters;
        for (counter, n) in [
            (&c.escapes, run.live_unbound as u64),
            (&c.plan_hits, hits),
            (&c.plan_misses, run.misses),
        ] {
            if n != 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
        if !run.local.is_empty() {
            let blocks: Vec<BatchBlock> =
                run.local.drain().flat_map(|(_, v)| v.into_iter().map(|(b, _)| b)).collect();
            sh.free_blocks(self.stream, &blocks);
        }
        if self.plan.is_some() && !followed {
            c.plan_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        let learner = if followed || recording { None } else { self.name.as_deref() };
        #[cfg(tidepool_broken = "adopt")]
        drop(st); // BROKEN: an escape freed now finds the run closed and no region yet.
        let adopted = match (learner, &self.plan) {
            (Some(name), None) => {
                let escapes: Vec<Escape> = run
                    .unbound
                    .iter()
                    .filter(|e| e.live)
                    .filter_map(|e| Some(Escape { block: e.block?, ptr: e.ptr, size: e.size }))
                    .collect();
                sh.adopt_region(name, self.stream, &steps, &escapes, self.granule)
            }
            _ => None,
        };
        #[cfg(tidepool_broken = "adopt")]
        let mut st = shared.as_ref().map(|s| lock(&s.state));
        // Holds let go of once the run's lock is let go (through `release_region`, so the last
        // one returns the region's blocks to the pool).
        let mut adopted_release = None;
        match (adopted, learner) {
            (Some((region, pinned)), _) => match (pinned.is_empty(), &mut st) {
                (false, Some(st)) => {
                    st.to_absorb = pinned.len();
                    st.adopt = Some(region);
                }
                // Escapes are unbound buffers, so a run that pinned any has a queue.
                _ => adopted_release = Some(region),
            },
            (None, Some(name)) => {
                let align = sh.config.load().sizing.min_block_size;
                sh.learn(name, self.stream, Learned::from_steps(&steps, align, self.granule));
            }
            (None, None) => {}
        }
        drop(st);
        for r in region.into_iter().chain(adopted_release) {
            sh.release_region(r);
        }
        if let Some((name, ring)) = self.annotation.take() {
            // BROKEN (`end_in_new_ring`): into whatever ring records now.
            match cfg!(tidepool_broken = "end_in_new_ring") {
                true => drop(sh.annotate(name, false)),
                false => lock(&ring).annotate(name, false),
            }
        }
    }
}
