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
//!
//! Here: the guard and its allocation path. A run's state is in `run.rs`, following the plan in
//! `plan_steps.rs`, pool blocks in `pool_blocks.rs`, frees in `frees.rs`, the run's end in
//! `end.rs`, [`ScopedBuffer`] in `buffer.rs` and an unbound buffer's tag in `tag.rs`.

mod buffer;
mod end;
mod frees;
mod plan_steps;
mod pool_blocks;
mod run;
mod tag;

pub use buffer::ScopedBuffer;
use buffer::{Kind, pool_id};
use run::{Cursor, LiveEntry, NO_BASE, RegionSlot, Run, claim_slot, no_script};
pub(crate) use tag::ScopeTag;
use tag::{ScopeShared, SharedRun};

use super::counters::quadrant;
use super::plan::{Entry, Learned, Script, Step, UNFREED};
use super::{AllocError, Allocator, Buffer, Origin};
use crate::config::Config;
use crate::device::{Device, DeviceAddr, Guarded, StreamId};
use crate::stats::Residency;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::{Arc, Mutex};
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
/// `Scope::gone_seen` of a scope whose stream is gone: a count the family never reaches.
const DEAD: u64 = u64::MAX;
/// What the general path returns instead of an id when it failed (no id is 0: a planned
/// buffer's free is never a run's first step); the error waits in `Scope::error`.
const FAILED: u64 = 0;

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
    /// The family's count of streams gone from the device (`Family::gone`), and the count as
    /// this scope last saw it with its stream there, or `DEAD` once the stream is known gone
    /// (or was never there): while they differ (a stream went, maybe this one, on any
    /// thread), the planned path stands aside and the general path asks the device again
    /// (`Scope::check_stream`). One word for both: the general path's check of the stream is
    /// one comparison.
    gone: &'a AtomicU64,
    gone_seen: Cell<u64>,
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
    /// The plan this run follows while its steps repeat it.
    plan: Option<Arc<Learned>>,
    /// The plan's script (empty without a plan), where the planned path reads it: no `Option`
    /// to test and no pointer to the plan to follow.
    script: Script,
    /// The mark of this learning run over expandable segments (see
    /// `Shared::learning_opens`), 0 if it is none.
    learning: u64,
    cursor: Cursor,
    run: RefCell<Run<D>>,
    /// Made by the first unbound allocation (a run without one allocates nothing for it).
    shared: OnceCell<Arc<ScopeShared>>,
    /// The error of the general path's last failed allocation, for `Scope::alloc`.
    error: Cell<Option<AllocError>>,
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
        let learning = match (&name, &plan) {
            (Some(n), None) => alloc.shared.learning_opens(n, stream),
            _ => 0,
        };
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
        // Read before the device is asked: a stream destroyed after the answer moves it.
        let gone_seen = alloc.shared.family.gone.load(Ordering::Acquire);
        let stream_ok = alloc.shared.stream_exists(stream).is_ok();
        let gone_seen = if stream_ok { gone_seen } else { DEAD };
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
            gone: &alloc.shared.family.gone,
            gone_seen: Cell::new(gone_seen),
            granule,
            fast_ok,
            stream,
            name,
            annotation,
            config,
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
        // No stream went from the device since the scope last saw its own there (else the
        // general path asks whether it was this one; a stream known gone never matches).
        // BROKEN (`scope_outlives_stream`): not looked at.
        // While a capture is underway on the device, the general path asks whose it is.
        // BROKEN (`foreign_capture_served`, and `foreign_capture_hit` alone): not asked.
        if size.wrapping_sub(bytes) | self.route_mask.load(Ordering::Relaxed) >= span
            || (!cfg!(tidepool_broken = "scope_outlives_stream")
                && self.gone.load(Ordering::Relaxed) != self.gone_seen.get())
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

    /// Refuses every allocation of a scope opened on a stream the device did not have, or whose
    /// stream went since (destroyed through an allocator of the family, or forgotten by
    /// `release_stream` once gone from the device; one destroyed on the device behind the
    /// allocators' backs is served on until then, as the allocator serves it). (The planned
    /// path needs the region, which such a scope never claims, and stands aside once a
    /// stream went, so it never gets that far.)
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
        match self.gone.load(Ordering::Relaxed) == self.gone_seen.get() {
            true => Ok(()),
            false => self.recheck_stream(),
        }
    }

    /// A stream went from the device since the scope last looked (`gone`), or its own is known
    /// gone (`DEAD`): whether it is this scope's. If so the scope serves nothing more, as every
    /// other allocation on the stream is refused once the allocator destroyed or forgot it;
    /// what it handed out stays valid. (`DEAD` never matches the count, so the planned path
    /// stands aside for good.)
    #[cold]
    fn recheck_stream(&self) -> Result<(), AllocError> {
        let seen = self.gone_seen.get();
        let now = self.gone.load(Ordering::Acquire);
        if seen != DEAD && !self.alloc.shared.stream_gone_since(self.stream, seen) {
            self.gone_seen.set(now);
            return Ok(());
        }
        self.gone_seen.set(DEAD);
        Err(AllocError::UnknownStream(self.stream))
    }

    #[inline]
    fn round(&self, bytes: u64) -> Result<u64, AllocError> {
        match self.config.sizing.round(bytes) {
            Some(rounded) => Ok(rounded),
            None => Err(AllocError::InvalidSize { requested: bytes }),
        }
    }
}
