//! Scopes: transient regions of work on one stream (one training step, one request).
//!
//! ```text
//!  Scope (guard, borrows the Allocator) ──Arc──▶ ScopeRun (Mutex<RunState>, scope-local)
//!     │                                              ▲
//!     └─ alloc() ─▶ ScopedBuffer<'scope> ── tag ─────┘   free: record the step; keep the block
//!                                                         in the scope's local cache for reuse
//! ```
//!
//! A scoped buffer cannot outlive its scope (its lifetime borrows the guard). Freed scoped
//! buffers go to the scope's local cache, reused by the scope's next allocation of the same
//! rounded size without the allocator's lock; at exit the cache goes back to the stream's pool
//! in one batch under one lock. The blocks belong to the scope's stream, so stream order makes
//! the batch safe with no event at all; other streams reach them only through the cross-stream
//! rules. A *named* scope also records its run and serves the next identical run from a learned
//! plan (see `plan.rs`).

use super::batch::BatchBlock;
use super::counters::quadrant;
use super::plan::{Learned, Region, Step};
use super::{AllocError, Allocator, Buffer, Origin, Shared};
use crate::device::{Device, DevicePtr, StreamId};
use crate::stats::Residency;

const TRANSIENT: Residency = Residency::Transient;
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::{Arc, Mutex, lock};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::ops::Deref;

/// Ties a buffer to the scope run that made it.
pub(crate) struct ScopeTag {
    run: Arc<ScopeRun>,
    index: u32,
    /// Whether its block may go to the scope's local cache on free (scoped buffers without
    /// `record_stream` uses).
    local_reuse: AtomicBool,
    /// Other streams it was used on (`record_stream`), for planned buffers, which have no pool
    /// block to hold: their free makes the owner stream wait for these streams instead.
    uses: Mutex<Vec<StreamId>>,
    /// Whether `uses` is non-empty (so a free without uses takes no lock for them).
    has_uses: AtomicBool,
}

impl ScopeTag {
    /// Notes a use on another stream: no local reuse, and remembered for planned buffers.
    pub(crate) fn used_on(&self, stream: StreamId) {
        self.local_reuse.store(false, Ordering::Relaxed);
        self.has_uses.store(true, Ordering::Relaxed);
        let mut uses = lock(&self.uses);
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// Called from `Buffer::drop`: records the free while the run is open (maybe taking the
    /// block into the local cache), or unpins an escaped planned slice after it ended. Returns
    /// the other streams the buffer was used on.
    pub(crate) fn on_drop<D: Device>(&self, buf: &mut Buffer<D>) -> Vec<StreamId> {
        let uses = if self.has_uses.load(Ordering::Relaxed) {
            std::mem::take(&mut *lock(&self.uses))
        } else {
            Vec::new()
        };
        let mut run = lock(&self.run.state);
        if !run.open {
            if let Origin::Region(region, offset) = &buf.origin {
                region.unpin(*offset);
            }
            return uses;
        }
        run.record(Step::Free(self.index));
        run.live[self.index as usize] = None;
        run.live_count -= 1;
        if self.local_reuse.load(Ordering::Relaxed)
            && let Origin::Pool(block) = buf.origin
        {
            buf.owner.device.note_reclaim(buf.ptr, buf.size, buf.stream);
            let b = BatchBlock {
                block,
                quadrant: buf.quadrant as usize,
                size: buf.size,
                requested: buf.accounted,
            };
            run.local.entry(buf.rounded).or_default().push((b, buf.ptr));
            buf.origin = Origin::None;
        }
        uses
    }
}

/// A live allocation of the run: its size and, when planned, its offset in the region.
#[derive(Clone, Copy)]
struct LiveEntry {
    size: u64,
    region_offset: Option<u64>,
}

struct RunState {
    open: bool,
    /// Every step of this run, in order.
    steps: Vec<Step>,
    allocs: u32,
    /// The plan this run follows, until it diverges.
    learned: Option<Arc<Learned>>,
    diverged: bool,
    /// Live allocations of the run by index (`None` once freed), and how many are live.
    live: Vec<Option<LiveEntry>>,
    live_count: usize,
    /// Freed scoped blocks by size, ready for reuse in this run.
    local: HashMap<u64, Vec<(BatchBlock, DevicePtr)>>,
}

impl RunState {
    /// Appends a step and checks it against the plan; returns whether the plan still holds.
    fn record(&mut self, step: Step) -> bool {
        let k = self.steps.len();
        self.steps.push(step);
        if self.diverged {
            return false;
        }
        match &self.learned {
            Some(l) if l.steps.get(k) == Some(&step) => true,
            Some(_) => {
                self.diverged = true;
                false
            }
            None => false,
        }
    }
}

pub(crate) struct ScopeRun {
    state: Mutex<RunState>,
}

/// A transient region of work on one stream; see the module docs. Ends when dropped.
///
/// Buffers from [`Scope::alloc`] borrow the scope, so they cannot outlive it:
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
pub struct Scope<'a, D: Device> {
    alloc: &'a Allocator<D>,
    stream: StreamId,
    name: Option<String>,
    run: Arc<ScopeRun>,
    /// The region of the plan being followed (created on the first planned allocation).
    region: Mutex<RegionSlot>,
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

/// A buffer of a [`Scope`]; it cannot outlive the scope. Derefs to [`Buffer`].
pub struct ScopedBuffer<'s, D: Device> {
    buf: Buffer<D>,
    _scope: PhantomData<&'s ()>,
}

impl<D: Device> Deref for ScopedBuffer<'_, D> {
    type Target = Buffer<D>;
    fn deref(&self) -> &Buffer<D> {
        &self.buf
    }
}

impl<D: Device> std::fmt::Debug for ScopedBuffer<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.buf.fmt(f)
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
        Scope::open(self, stream, Some(name.to_string()))
    }
}

impl<'a, D: Device> Scope<'a, D> {
    fn open(alloc: &'a Allocator<D>, stream: StreamId, name: Option<String>) -> Scope<'a, D> {
        let (learned, region) = match &name {
            Some(n) => alloc.shared.plan_for(n, stream),
            None => (None, None),
        };
        Scope {
            alloc,
            stream,
            name,
            run: Arc::new(ScopeRun {
                state: Mutex::new(RunState {
                    open: true,
                    steps: Vec::new(),
                    allocs: 0,
                    learned,
                    diverged: false,
                    live: Vec::new(),
                    live_count: 0,
                    local: HashMap::new(),
                }),
            }),
            region: Mutex::new(RegionSlot::Unclaimed(region)),
        }
    }

    /// The scope's stream.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Marks a buffer as used on `stream` too (see [`Allocator::record_stream`]): its block is
    /// no longer reused locally, and its reuse is ordered after `stream`'s work.
    pub fn record_stream(&self, buffer: &Buffer<D>, stream: StreamId) {
        self.alloc.record_stream(buffer, stream);
    }

    /// Allocates `bytes` of transient memory for this scope; the buffer cannot outlive it.
    pub fn alloc(&self, bytes: u64) -> Result<ScopedBuffer<'_, D>, AllocError> {
        Ok(ScopedBuffer { buf: self.alloc_inner(bytes, true)?, _scope: PhantomData })
    }

    /// Allocates `bytes` through this scope as an ordinary [`Buffer`] that may outlive it, for
    /// callers that cannot express lifetimes (the trace replayer, framework bridges). One still
    /// live at scope exit is an *escape*: counted, kept correct, and planned like any other
    /// allocation (its slice stays pinned until it is freed).
    pub fn alloc_unbound(&self, bytes: u64) -> Result<Buffer<D>, AllocError> {
        self.alloc_inner(bytes, false)
    }

    fn alloc_inner(&self, bytes: u64, local_reuse: bool) -> Result<Buffer<D>, AllocError> {
        let sh = &self.alloc.shared;
        if bytes == 0 {
            return Ok(self.alloc.hand_out(
                DevicePtr::NULL,
                0,
                0,
                self.stream,
                None,
                0,
                TRANSIENT,
                0,
            ));
        }
        let config = sh.config.load();
        let rounded =
            config.sizing.round(bytes).ok_or(AllocError::InvalidSize { requested: bytes })?;
        let mut run = lock(&self.run.state);
        let index = run.allocs;
        run.allocs += 1;
        let on_plan = run.record(Step::Alloc(rounded));
        let mut buf = None;
        let mut region_offset = None;
        if on_plan && let Some(learned) = run.learned.clone() {
            let offset = learned.offsets[index as usize];
            match self.planned_slice(&learned, offset, rounded)? {
                Some(region) => {
                    let ptr = DevicePtr(region.base + offset);
                    sh.device.note_handout(ptr, rounded, self.stream);
                    sh.scope_counters.plan_hits.fetch_add(1, Ordering::Relaxed);
                    region_offset = Some(offset);
                    let q = quadrant(config.sizing.kind(rounded), TRANSIENT);
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
                    b.origin = Origin::Region(region, offset);
                    buf = Some(b);
                }
                None => {
                    sh.scope_counters.plan_misses.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if buf.is_none()
            && let Some((b, ptr)) = run.local.get_mut(&rounded).and_then(Vec::pop)
        {
            let mut reused = self.alloc.hand_out(
                ptr,
                bytes,
                b.size,
                self.stream,
                Some(b.block),
                rounded,
                TRANSIENT,
                b.quadrant,
            );
            // The statistics still account the block with the request it was first made for.
            reused.accounted = b.requested;
            buf = Some(reused);
        }
        let mut buf = match buf {
            Some(b) => b,
            None => {
                drop(run);
                let b = self.alloc.alloc_in(bytes, self.stream, Residency::Transient)?;
                run = lock(&self.run.state);
                b
            }
        };
        debug_assert_eq!(run.live.len(), index as usize);
        run.live.push(Some(LiveEntry { size: buf.size, region_offset }));
        run.live_count += 1;
        buf.scope = Some(ScopeTag {
            run: self.run.clone(),
            index,
            local_reuse: AtomicBool::new(local_reuse),
            uses: Mutex::new(Vec::new()),
            has_uses: AtomicBool::new(false),
        });
        Ok(buf)
    }

    /// The region to serve a planned slice from, if the slice is free: made on first use (the
    /// stream's cached transient segments are trimmed first so the region replaces them), and
    /// `None` when an escaped buffer of an earlier run still holds part of the slice.
    fn planned_slice(
        &self,
        learned: &Learned,
        offset: u64,
        size: u64,
    ) -> Result<Option<Arc<Region>>, AllocError> {
        let mut slot = lock(&self.region);
        if let RegionSlot::Unclaimed(existing) = &*slot {
            let Some(name) = self.name.as_deref() else { return Ok(None) };
            let region = match existing {
                Some(r) => r.clone(),
                None => match self.alloc.shared.make_region(name, self.stream, learned.region_size)
                {
                    Ok(r) => r,
                    Err(AllocError::OutOfMemory(_)) => {
                        *slot = RegionSlot::Denied;
                        return Ok(None);
                    }
                    Err(e) => return Err(e),
                },
            };
            *slot =
                if region.try_claim() { RegionSlot::Claimed(region) } else { RegionSlot::Denied };
        }
        match &*slot {
            RegionSlot::Claimed(region) => {
                Ok((!region.overlaps_pinned(offset, size)).then(|| region.clone()))
            }
            _ => Ok(None),
        }
    }
}

impl<D: Device> Drop for Scope<'_, D> {
    /// Ends the run: escapes are counted (planned ones pinned), the local cache goes back to the
    /// pool in one batch, and a named scope learns the run unless it followed its plan exactly.
    fn drop(&mut self) {
        let sh: &Shared<D> = &self.alloc.shared;
        let mut run = lock(&self.run.state);
        run.open = false;
        let escapes = run.live_count as u64;
        if let RegionSlot::Claimed(region) = &*lock(&self.region) {
            for e in run.live.iter().flatten() {
                if let Some(off) = e.region_offset {
                    region.pin(off, e.size);
                }
            }
            region.unclaim();
        }
        sh.scope_counters.escapes.fetch_add(escapes, Ordering::Relaxed);
        let blocks: Vec<BatchBlock> =
            run.local.drain().flat_map(|(_, v)| v.into_iter().map(|(b, _)| b)).collect();
        let followed =
            run.learned.as_ref().is_some_and(|l| !run.diverged && l.steps.len() == run.steps.len());
        if run.learned.is_some() && !followed {
            sh.scope_counters.plan_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        let steps = if followed { Vec::new() } else { std::mem::take(&mut run.steps) };
        drop(run);
        sh.free_blocks(self.stream, &blocks);
        if let Some(name) = &self.name
            && !followed
        {
            let align = sh.config.load().sizing.min_block_size;
            sh.learn(name, self.stream, Learned::from_steps(steps, align));
        }
    }
}
