//! Replaying a trace through a fixed-heap sub-allocator crate, growing the heap until the
//! whole trace fits.
//!
//! Sizes are counted in granules of [`GRANULE`] bytes (CUDA's `cudaMalloc` alignment): each
//! request takes `max(1, ceil(bytes / 256))` granules, so a zero-byte request takes one
//! granule, and every request is padded to a multiple of 256 bytes. This also lets the
//! offset-allocator crate (u32 sizes) address heaps of up to 1 TiB.
//!
//! Heap sizing: the first heap is 2 × the peak of live granules; if an allocation fails
//! (no free range large enough — fragmentation, or the crate's size-class rounding), the
//! whole replay restarts with a heap 1.5 × larger, until it fits; the heaps are capped at the
//! largest the crate can address, and a trace is refused when that one does not fit it.
//! Reserved bytes = the high-water mark of (offset + size) over the successful run (so the
//! heap's slack is not counted); allocated = live granule bytes. The heap is one device
//! malloc, held to the end (its free at teardown is not counted, as the allocator policies'
//! are not); a trace with no allocation takes no heap.

use super::slots::{Slotted, Step};
use super::{PolicyResult, ReplayError};
use crate::clock::Stopwatch;
use crate::event::Trace;

/// Bytes per granule for the sub-allocator baselines (and the planner's alignment).
pub const GRANULE: u64 = 256;
/// Give up after this many heap sizes.
const MAX_ATTEMPTS: u32 = 64;

/// A sub-allocator over a heap counted in granules.
pub(super) trait SubAllocator: Sized {
    /// What `alloc` hands back for `free`.
    type Handle: Copy;
    /// Policy name.
    const NAME: &'static str;
    /// Largest heap, in granules, the crate can manage.
    const MAX_HEAP: u64;
    /// A heap of `granules`, able to hold `max_live` allocations at once.
    fn with_heap(granules: u64, max_live: usize) -> Result<Self, ReplayError>;
    /// Allocates `granules` (≤ the heap size); the offset in granules and a handle.
    fn alloc(&mut self, granules: u64) -> Option<(u64, Self::Handle)>;
    /// Frees an allocation.
    fn free(&mut self, handle: Self::Handle);
}

/// Granules for a request of `bytes`.
fn granules(bytes: u64) -> u64 {
    bytes.div_ceil(GRANULE).max(1)
}

struct Run {
    hwm: u64,
    peak_live: u64,
    elapsed_ns: u128,
    timeline: Option<Vec<u64>>,
}

/// Replays `trace` through `A`, growing the heap as described in the module docs.
pub(super) fn replay<A: SubAllocator>(
    trace: &Trace,
    timeline: bool,
) -> Result<PolicyResult, ReplayError> {
    let slotted = Slotted::new(trace);
    // Peak of live granules and of live allocation count.
    let (mut live, mut peak, mut count, mut max_count) = (0u128, 0u128, 0usize, 0usize);
    let mut sizes = vec![0u64; slotted.slots];
    for step in &slotted.steps {
        match *step {
            Step::Alloc { slot, bytes } => {
                sizes[slot] = granules(bytes);
                live += u128::from(sizes[slot]);
                peak = peak.max(live);
                count += 1;
                max_count = max_count.max(count);
            }
            Step::Free { slot } => {
                live -= u128::from(sizes[slot]);
                count -= 1;
            }
            Step::Marker => {}
        }
    }
    let too_big = |heap: u128| {
        ReplayError::new(
            A::NAME,
            format!(
                "needs a heap of {heap} granules of {GRANULE} B, more than the {} the crate can address",
                A::MAX_HEAP
            ),
        )
    };
    let max_heap = u128::from(A::MAX_HEAP);
    // BROKEN (`heap_cap_refused`): a heap past the largest refused, though the largest may fit.
    let capped = !cfg!(tidepool_broken = "heap_cap_refused");
    if capped && peak > max_heap {
        return Err(ReplayError::new(
            A::NAME,
            format!(
                "needs a heap of at least {peak} granules of {GRANULE} B, more than the {} the \
                 crate can address",
                A::MAX_HEAP
            ),
        ));
    }
    // A trace with no allocation needs no heap: no device call, 0 B (a one-granule heap made
    // an empty trace look like a 256 B allocation).
    // BROKEN (`empty_trace_heap`): the one-granule heap of an empty trace.
    if peak == 0 && !cfg!(tidepool_broken = "empty_trace_heap") {
        return Ok(PolicyResult {
            reserved_timeline: timeline.then(|| vec![0; slotted.steps.len()]),
            extra: vec![
                ("heap".into(), "0 B (no allocation)".into()),
                ("granule".into(), format!("{GRANULE} B")),
            ],
            ..PolicyResult::nothing(A::NAME)
        });
    }
    // The heaps tried are capped at the largest the crate can address: twice the peak, or
    // the next size up, may be past it where the largest still holds the trace.
    let cap = |heap: u128| if capped { heap.min(max_heap) } else { heap };
    let mut heap = cap((peak * 2).max(1));
    for attempt in 1..=MAX_ATTEMPTS {
        let heap_granules =
            u64::try_from(heap).ok().filter(|&h| h <= A::MAX_HEAP).ok_or_else(|| too_big(heap))?;
        if let Some(run) = run_once::<A>(&slotted, &sizes, heap_granules, max_count, timeline)? {
            let events = trace.events.len().max(1) as f64;
            return Ok(PolicyResult {
                name: A::NAME.to_string(),
                peak_reserved_bytes: run.hwm * GRANULE,
                peak_allocated_bytes: run.peak_live * GRANULE,
                device_mallocs: 1,
                // The heap is held to the end, as the allocator policies hold their segments:
                // frees during the replay, not at its teardown, in every row alike.
                // BROKEN (`baseline_teardown_free`): the teardown's free counted here only.
                device_frees: u64::from(cfg!(tidepool_broken = "baseline_teardown_free")),
                device_maps: 0,
                device_unmaps: 0,
                host_syncs: 0,
                ns_per_op: run.elapsed_ns as f64 / events,
                reserved_timeline: run.timeline,
                extra: vec![
                    ("heap".into(), format!("{} B (attempt {attempt})", heap_granules * GRANULE)),
                    ("granule".into(), format!("{GRANULE} B")),
                ],
            });
        }
        if capped && heap == max_heap {
            return Err(ReplayError::new(
                A::NAME,
                format!(
                    "the trace does not fit the largest heap the crate can address ({} granules \
                     of {GRANULE} B)",
                    A::MAX_HEAP
                ),
            ));
        }
        heap = cap((heap * 3).div_ceil(2));
    }
    Err(ReplayError::new(
        A::NAME,
        format!("no heap size fit the trace after {MAX_ATTEMPTS} attempts"),
    ))
}

/// One replay with a fixed heap; `None` if an allocation did not fit.
fn run_once<A: SubAllocator>(
    slotted: &Slotted,
    sizes: &[u64],
    heap: u64,
    max_live: usize,
    timeline: bool,
) -> Result<Option<Run>, ReplayError> {
    let mut alloc = A::with_heap(heap, max_live)?;
    let mut handles: Vec<Option<A::Handle>> = vec![None; slotted.slots];
    let mut tl = if timeline { Some(Vec::with_capacity(slotted.steps.len())) } else { None };
    let start = Stopwatch::start();
    let Some((hwm, peak_live)) = timed_loop(&mut alloc, slotted, sizes, &mut handles, &mut tl)
    else {
        return Ok(None);
    };
    let elapsed_ns = start.elapsed_ns();
    Ok(Some(Run { hwm, peak_live, elapsed_ns, timeline: tl }))
}

/// The timed part of a run: every step through the sub-allocator; (high-water mark, peak live
/// granules), or `None` if an allocation did not fit. A function of its own so that instruction
/// counts (`scripts/replay-instructions`) cover exactly what `ns_per_op` times.
#[inline(never)]
fn timed_loop<A: SubAllocator>(
    alloc: &mut A,
    slotted: &Slotted,
    sizes: &[u64],
    handles: &mut [Option<A::Handle>],
    tl: &mut Option<Vec<u64>>,
) -> Option<(u64, u64)> {
    let (mut hwm, mut live, mut peak_live) = (0u64, 0u64, 0u64);
    for step in &slotted.steps {
        match *step {
            Step::Alloc { slot, .. } => {
                let size = sizes[slot];
                let (offset, handle) = alloc.alloc(size)?;
                handles[slot] = Some(handle);
                hwm = hwm.max(offset + size);
                live += size;
                peak_live = peak_live.max(live);
            }
            Step::Free { slot } => {
                if let Some(handle) = handles[slot].take() {
                    alloc.free(handle);
                    live -= sizes[slot];
                }
            }
            Step::Marker => {}
        }
        if let Some(tl) = tl.as_mut() {
            tl.push(hwm * GRANULE);
        }
    }
    Some((hwm, peak_live))
}
