//! Allocator policies: the trace replayed through tidepool's [`Allocator`] on an unbacked
//! [`SimDevice`] (no memory touched, so multi-GiB traces replay anywhere).
//!
//! | name        | what it is                                                               |
//! |-------------|--------------------------------------------------------------------------|
//! | `caching`   | default config, every block transient, one stream per trace stream       |
//! | `residency` | as `caching`, but `param` blocks persistent and `act` blocks transient    |
//! | `scoped`    | as `residency`, plus a named scope per `scope_enter`/`scope_exit` pair,   |
//! |             | with learned plans; `act` blocks inside a scope are allocated through it  |
//! | `expandable`| as `caching`, with `expandable_segments:true` on top of the configuration |
//! | `pytorch`   | as `caching`, with `fast_cache:false,cross_stream:never` on top: PyTorch's |
//! |             | algorithm exactly                                                        |
//!
//! `pytorch` runs only when named (`--policy pytorch`, [`super::named_only`]). `caching` runs
//! the default configuration, whose stream caches hold freed small blocks back from
//! coalescing and hand them out again by class (the last freed first) instead of by best fit,
//! so its placement drifts from PyTorch's (llama_decode and mobilenetv2 reserve 2 and 6 MiB
//! more); with the caches off every block lands where PyTorch's allocator puts it
//! (`scripts/pytorch_model.py`, an independent model, gives the same figures on every shipped
//! trace and snapshot, address for address).
//!
//! (`residency` and `scoped` run over expandable segments with `--config expandable_segments:true`.)
//! With expandable segments the notes give the map and unmap calls made in each step (between
//! two exits of an outermost scope, [`Trace::step_ends`]), so a steady state with none shows.
//!
//! Scope names have their trailing digits removed (`step0`, `step1` → `step`), so the steps
//! of a training loop are runs of one named scope. Only outermost scopes are runs: a scope
//! nested in another (`fwd` inside `step`) is part of the outer run. An `act` block allocated in a scope and
//! freed after its exit is an *escape*: it stays correct (it is an ordinary buffer that keeps
//! its memory) and is counted.
//!
//! The trace is first rewritten into [`AllocStep`]s (dense slots, device streams resolved) so
//! the timed loop only calls the allocator. Device calls and host syncs come from the
//! allocator's own counters; peaks from its statistics.

use std::collections::HashMap;
use std::sync::Arc;

use super::slots::{Slotted, Step};
use super::{Policy, PolicyResult, ReplayError};
use crate::clock::Stopwatch;
use crate::event::{Op, Tag, Trace};
use tidepool::Residency;
use tidepool::Scope;
use tidepool::device::{Device, SimConfig, SimDevice, StreamId};
use tidepool::{AllocError, Allocator, Buffer, Config, CrossStream, ErrorChain};

/// Capacity of the simulated device: far above any trace, so replays never run out.
const SIM_CAPACITY: u64 = 1 << 46;

/// The most trace streams an allocator replay takes. Each is a simulated stream, whose worker
/// is an OS thread: a trace naming tens of thousands of streams (an RMM log is a line per
/// stream handle away from one) would run the process into the system's thread and mapping
/// limits, where a thread that cannot set up its stack aborts the whole process. Real traces
/// use a handful.
pub const MAX_REPLAY_STREAMS: usize = 1024;

/// Which residency rule a replay applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every block transient (`caching`).
    Caching,
    /// `param` persistent, `act` transient (`residency`).
    Residency,
    /// As `Residency`, with named scopes and learned plans (`scoped`).
    Scoped,
    /// As `Caching`, with expandable segments forced on (`expandable`).
    Expandable,
    /// As `Caching`, with the stream caches forced off (`pytorch`): PyTorch's placement.
    PyTorch,
}

/// One replay step with everything resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocStep {
    /// Allocate `bytes` into `slot` on device stream `stream` with `residency`.
    Alloc {
        /// Dense slot of the buffer.
        slot: usize,
        /// Requested bytes.
        bytes: u64,
        /// Index into the replay's device streams.
        stream: usize,
        /// Persistent or transient.
        residency: Residency,
    },
    /// Free `slot`.
    Free {
        /// Dense slot.
        slot: usize,
    },
    /// Enter the scope named `scope_names[name]` on device stream `stream` (`scoped` only).
    Enter {
        /// Index into the normalized scope names.
        name: usize,
        /// Index into the replay's device streams.
        stream: usize,
    },
    /// Leave the current scope (`scoped` only).
    Exit,
    /// Scope markers and anything else the policy ignores.
    Marker,
}

/// A scope name without its trailing digits (`step12` → `step`): the runs of a loop share a
/// plan.
pub fn scope_family(name: &str) -> &str {
    let t = name.trim_end_matches(|c: char| c.is_ascii_digit());
    if t.is_empty() { name } else { t }
}

/// The trace rewritten for an allocator replay: steps, number of slots, number of streams.
pub fn alloc_steps(trace: &Trace, mode: Mode) -> (Vec<AllocStep>, usize, Vec<u32>) {
    let slotted = Slotted::new(trace);
    let mut streams: Vec<u32> = vec![0];
    // Trace streams to device streams through a map: a search of the list per event took
    // time quadratic in the number of streams, which the input sets (a trace with a stream per
    // row took minutes to reach the error that refuses more than `MAX_REPLAY_STREAMS`).
    // BROKEN (`stream_index_quadratic`): the list searched for every event.
    let mut index: HashMap<u32, usize> = HashMap::from([(0, 0)]);
    let mut stream_index = |s: u32| {
        if cfg!(tidepool_broken = "stream_index_quadratic") {
            let found = streams.iter().position(|&x| x == s);
            crate::cost::looked_at(found.map_or(streams.len(), |i| i + 1));
            if let Some(i) = found {
                return i;
            }
        } else {
            crate::cost::looked_at(1);
            if let Some(&i) = index.get(&s) {
                return i;
            }
        }
        streams.push(s);
        index.insert(s, streams.len() - 1);
        streams.len() - 1
    };
    // Only outermost scopes are runs of a named scope (as the snapshot reader makes scopes of
    // outermost annotations only): the markers of a scope nested in another are no-ops, so
    // the outer run goes on through them. Opening the inner scope dropped the outer one, whose
    // run ended there, was never counted, and left the rest of the step with no scope.
    // BROKEN (`scoped_nested_drops_outer`): every marker entered or left a scope.
    let nested = !cfg!(tidepool_broken = "scoped_nested_drops_outer");
    let mut depth = 0usize;
    let steps = trace
        .events
        .iter()
        .zip(&slotted.steps)
        .map(|(e, step)| match (*step, e.op) {
            (Step::Marker, Op::ScopeEnter) if nested && mode == Mode::Scoped && depth > 0 => {
                depth += 1;
                AllocStep::Marker
            }
            (Step::Marker, Op::ScopeExit) if nested && mode == Mode::Scoped && depth > 1 => {
                depth -= 1;
                AllocStep::Marker
            }
            (Step::Alloc { slot, bytes }, _) => {
                let residency = match (mode, e.tag) {
                    (Mode::Residency | Mode::Scoped, Tag::Param) => Residency::Persistent,
                    _ => Residency::Transient,
                };
                AllocStep::Alloc { slot, bytes, stream: stream_index(e.stream), residency }
            }
            (Step::Free { slot }, _) => AllocStep::Free { slot },
            (Step::Marker, Op::ScopeEnter) if mode == Mode::Scoped => {
                depth += 1;
                AllocStep::Enter {
                    name: e.scope.unwrap_or(0) as usize,
                    stream: stream_index(e.stream),
                }
            }
            (Step::Marker, Op::ScopeExit) if mode == Mode::Scoped => {
                depth = depth.saturating_sub(1);
                AllocStep::Exit
            }
            (Step::Marker, _) => AllocStep::Marker,
        })
        .collect();
    (steps, slotted.slots, streams)
}

/// What the timed loop reads.
struct Loop<'a> {
    steps: &'a [AllocStep],
    /// Whether each event ends a step ([`Trace::step_ends`]).
    exits: &'a [bool],
    /// Scope families by scope name index.
    families: &'a [&'a str],
    /// Device stream of each trace stream.
    streams: &'a [StreamId],
}

/// The peaks a replay reports, as the allocator's statistics hold them.
#[derive(Default, Clone, Copy)]
struct Peaks {
    reserved: u64,
    allocated: u64,
    reserved_persistent: u64,
    reserved_transient: u64,
}

impl Peaks {
    fn of(s: &tidepool::MemoryStats) -> Peaks {
        let b = &s.blocks;
        Peaks {
            reserved: b.reserved_bytes.all.peak,
            allocated: b.allocated_bytes.all.peak,
            reserved_persistent: b.reserved_bytes.persistent.peak,
            reserved_transient: b.reserved_bytes.transient.peak,
        }
    }

    /// The higher of each: the whole replay's peaks, from those before and after a reset.
    fn max(self, o: Peaks) -> Peaks {
        Peaks {
            reserved: self.reserved.max(o.reserved),
            allocated: self.allocated.max(o.allocated),
            reserved_persistent: self.reserved_persistent.max(o.reserved_persistent),
            reserved_transient: self.reserved_transient.max(o.reserved_transient),
        }
    }
}

/// What the timed loop measures besides the allocator's own figures.
#[derive(Default)]
struct LoopOut {
    /// CPU time of the loop, in nanoseconds.
    elapsed: u128,
    /// Device mallocs and best-fit searches made during each scope run.
    runs: Vec<(u64, u64)>,
    /// Peaks at the end of the first scope run, where they are reset.
    first_peaks: Peaks,
    /// Map, unmap and malloc calls made in each step (between two step ends).
    step_vm: Vec<(u64, u64, u64)>,
    /// Reserved bytes after each event, when asked for.
    timeline: Option<Vec<u64>>,
}

/// The timed part of a replay: every step through the allocator. A function of its own so that
/// instruction counts (`scripts/replay-instructions`) cover exactly what `ns_per_op` times.
/// An allocation that fails ends it with the event's index and the allocator's error.
#[inline(never)]
fn timed_loop(
    lp: &Loop<'_>,
    device: &SimDevice,
    alloc: &Allocator<SimDevice>,
    live: &mut [Option<Buffer<SimDevice>>],
    out: &mut LoopOut,
) -> Result<(), (usize, AllocError)> {
    let Loop { steps, exits, families, streams } = *lp;
    let mut scope = None;
    let mut run_start = (0, 0);
    let mut vm_mark = (0, 0, 0);
    let start = Stopwatch::start();
    for (i, step) in steps.iter().enumerate() {
        match *step {
            AllocStep::Alloc { slot, bytes, stream, residency } => {
                let got = match &scope {
                    Some(s)
                        if residency == Residency::Transient
                            && streams[stream] == Scope::stream(s) =>
                    {
                        s.alloc_unbound(bytes)
                    }
                    _ => acquire(alloc, bytes, streams[stream], residency),
                };
                // A slot is filled once (slots are per allocation): storing into the empty
                // slot skips the drop glue an assignment would call for its old value, as the
                // baselines' plain handles do. The result is matched where it is stored, so
                // the buffer is moved once, into its slot (`?` with `map_err` moved it through
                // two temporaries first: ~35 instructions per allocation).
                let s = &mut live[slot];
                assert!(s.is_none(), "slot {slot} filled twice");
                match got {
                    Ok(buf) => std::mem::forget(s.replace(buf)), // (the old value is `None`)
                    Err(e) => return Err((i, e)),
                }
            }
            AllocStep::Free { slot } => release(&mut live[slot]),
            AllocStep::Enter { name, stream } => {
                drop(scope.take());
                run_start = (device.counters().mallocs, alloc.stats().best_fit_searches);
                let family = families.get(name).copied().unwrap_or("scope");
                scope = Some(alloc.named_scope(family, streams[stream]));
            }
            AllocStep::Exit => {
                if scope.take().is_some() {
                    let st = alloc.stats();
                    let now = (device.counters().mallocs, st.best_fit_searches);
                    out.runs.push((now.0 - run_start.0, now.1 - run_start.1));
                    if out.runs.len() == 1 {
                        // Peaks from here on are the steady state after the learning run.
                        out.first_peaks = Peaks::of(&st);
                        alloc.reset_peak_stats();
                    }
                }
            }
            AllocStep::Marker => {}
        }
        if exits[i] {
            // The device's own counts of these calls, which the allocator's statistics repeat
            // (`shipped_traces_exact_figures` checks both), read without collecting those
            // statistics: that is no allocator operation, and `ns_per_op` times only those.
            let now = step_calls(device);
            out.step_vm.push((now.0 - vm_mark.0, now.1 - vm_mark.1, now.2 - vm_mark.2));
            vm_mark = now;
        }
        if let Some(tl) = out.timeline.as_mut() {
            tl.push(alloc.reserved_bytes());
        }
    }
    drop(scope);
    out.elapsed = start.elapsed_ns();
    Ok(())
}

/// Why a replay stopped: the allocation that failed (its event's index, id, bytes and stream,
/// so that the record can be found in the input), then the allocator's error.
#[cold]
fn failed_at(trace: &Trace, i: usize, e: &AllocError) -> String {
    let e = ErrorChain(e).to_string();
    // BROKEN (`replay_error_unplaced`): the allocator's error alone.
    match trace.events.get(i) {
        Some(ev) if !cfg!(tidepool_broken = "replay_error_unplaced") => format!(
            "event {i} (alloc of id {}, {} B on trace stream {}): {e}",
            ev.id, ev.bytes, ev.stream
        ),
        _ => e,
    }
}

/// Map, unmap and malloc calls the device has answered so far.
fn step_calls(device: &SimDevice) -> (u64, u64, u64) {
    let vm = device.vm_counters();
    (vm.maps, vm.unmaps, device.counters().mallocs)
}

/// A replay through tidepool's allocator.
#[derive(Debug, Clone)]
pub struct AllocatorPolicy {
    mode: Mode,
    config: Config,
}

impl AllocatorPolicy {
    /// A policy of `mode` with the allocator configured by `config` (`key:value,...`).
    pub fn from_config(mode: Mode, config: Option<&str>) -> Result<Self, ReplayError> {
        let name = Self::name_of(mode);
        let mut config = Config::parse(config.unwrap_or(""))
            .map_err(|e| ReplayError::new(name, ErrorChain(&e).to_string()))?;
        if mode == Mode::Expandable {
            config = config.with_expandable_segments(true);
        }
        // BROKEN (`pytorch_lanes`): the stream caches left on, as `caching` has them.
        if mode == Mode::PyTorch && !cfg!(tidepool_broken = "pytorch_lanes") {
            config = config.with_fast_cache(false);
        }
        // PyTorch reuses a cached block on its own stream only: another stream reserves anew
        // (`caching`'s `strict` takes the other stream's idle segment).
        // BROKEN (`pytorch_cross_stream`): the configuration's cross-stream reuse kept.
        if mode == Mode::PyTorch && !cfg!(tidepool_broken = "pytorch_cross_stream") {
            config = config.with_cross_stream(CrossStream::Never);
        }
        Ok(AllocatorPolicy { mode, config })
    }

    fn name_of(mode: Mode) -> &'static str {
        match mode {
            Mode::Caching => "caching",
            Mode::Residency => "residency",
            Mode::Scoped => "scoped",
            Mode::Expandable => "expandable",
            Mode::PyTorch => "pytorch",
        }
    }
}

/// The device side of one allocator replay.
pub struct ReplayDevice {
    /// The unbacked simulated device (sanitizer off: no kernels run in a replay).
    pub device: Arc<SimDevice>,
    /// The allocator under test.
    pub alloc: Allocator<SimDevice>,
    /// One device stream per trace stream, in order of first use.
    pub streams: Vec<StreamId>,
}

/// A fresh simulated device and allocator for one replay, with one device stream per trace
/// stream (trace stream 0 on the default stream). More than [`MAX_REPLAY_STREAMS`] trace
/// streams are refused before anything is made.
pub fn replay_device(
    config: &Config,
    trace_streams: usize,
    name: &str,
) -> Result<ReplayDevice, ReplayError> {
    let err = |e: &dyn std::error::Error| ReplayError::new(name, ErrorChain(e).to_string());
    // BROKEN (`streams_unbounded`): one thread per trace stream, however many.
    if trace_streams > MAX_REPLAY_STREAMS && !cfg!(tidepool_broken = "streams_unbounded") {
        return Err(ReplayError::new(
            name,
            format!(
                "the trace has {trace_streams} streams; an allocator replay makes one simulated \
                 stream (a thread) per trace stream and takes at most {MAX_REPLAY_STREAMS}"
            ),
        ));
    }
    let dev = Arc::new(SimDevice::with_config(SimConfig {
        capacity: SIM_CAPACITY,
        backed: false,
        sanitize: false,
    }));
    let mut streams = vec![StreamId::DEFAULT];
    for _ in 1..trace_streams {
        streams.push(dev.create_stream().map_err(|e| err(&e))?);
    }
    let alloc = Allocator::new(dev.clone(), config.clone()).map_err(|e| err(&e))?;
    Ok(ReplayDevice { device: dev, alloc, streams })
}

/// `Allocator::alloc_in`. With feature `count-calls` (`scripts/replay-instructions --calls`
/// builds with it) never inlined, as [`release`] is, so that callgrind can count it: the hit
/// path is inlined into its caller, so no function of the allocator's own covers every
/// allocation. Without it inlined, so that `ns_per_op` pays no call and no move of the result.
#[cfg_attr(feature = "count-calls", inline(never))]
#[cfg_attr(not(feature = "count-calls"), inline(always))]
fn acquire(
    alloc: &Allocator<SimDevice>,
    bytes: u64,
    stream: tidepool::StreamId,
    residency: Residency,
) -> Result<Buffer<SimDevice>, AllocError> {
    alloc.alloc_in(bytes, stream, residency)
}

/// Frees the buffer in `slot`. With feature `count-calls` (`scripts/replay-instructions --calls`)
/// never inlined, so that callgrind can count the free's instructions (it toggles collection on
/// a function's entry and exit, which an inlined `Buffer::drop` does not have); without it
/// inlined, as [`acquire`] is, so that `ns_per_op` pays no call (~9 instructions per free).
#[cfg_attr(feature = "count-calls", inline(never))]
#[cfg_attr(not(feature = "count-calls"), inline(always))]
fn release(slot: &mut Option<Buffer<SimDevice>>) {
    *slot = None;
}

impl Policy for AllocatorPolicy {
    fn name(&self) -> &'static str {
        Self::name_of(self.mode)
    }

    fn replay(&self, trace: &Trace, timeline: bool) -> Result<PolicyResult, ReplayError> {
        let name = self.name();
        let (steps, slots, trace_streams) = alloc_steps(trace, self.mode);
        let ReplayDevice { device, alloc, streams } =
            replay_device(&self.config, trace_streams.len(), name)?;
        let families: Vec<&str> = trace.scope_names.iter().map(|n| scope_family(n)).collect();
        let exits = trace.step_ends();
        let mut live: Vec<Option<Buffer<SimDevice>>> = (0..slots).map(|_| None).collect();
        let mut out = LoopOut {
            timeline: timeline.then(|| Vec::with_capacity(steps.len())),
            ..LoopOut::default()
        };
        let lp = Loop { steps: &steps, exits: &exits, families: &families, streams: &streams };
        timed_loop(&lp, &device, &alloc, &mut live, &mut out)
            .map_err(|(i, e)| ReplayError::new(name, failed_at(trace, i, &e)))?;
        let LoopOut { elapsed, runs, first_peaks, step_vm, timeline: tl } = out;
        let s = alloc.stats();
        drop(live);
        // The peaks of the whole replay: those of the first scope run (reset at its end) count.
        // BROKEN (`scoped_split_peaks_reset`): persistent / transient after the reset only.
        let peaks = match cfg!(tidepool_broken = "scoped_split_peaks_reset") {
            false => Peaks::of(&s).max(first_peaks),
            true => Peaks::of(&s).max(Peaks {
                reserved_persistent: 0,
                reserved_transient: 0,
                ..first_peaks
            }),
        };
        let mut extra = self.extras(&s, &peaks, &runs, &step_vm);
        if runs.len() > 1 {
            extra.push((
                "peak reserved after the first scope run".into(),
                s.blocks.reserved_bytes.all.peak.to_string(),
            ));
        }
        Ok(PolicyResult {
            name: name.to_string(),
            peak_reserved_bytes: peaks.reserved,
            peak_allocated_bytes: peaks.allocated,
            device_mallocs: s.num_device_alloc,
            device_frees: s.num_device_free,
            device_maps: s.num_device_map,
            device_unmaps: s.num_device_unmap,
            host_syncs: s.num_host_syncs,
            ns_per_op: elapsed as f64 / trace.events.len().max(1) as f64,
            reserved_timeline: tl,
            extra,
        })
    }
}

impl AllocatorPolicy {
    fn extras(
        &self,
        s: &tidepool::MemoryStats,
        peaks: &Peaks,
        runs: &[(u64, u64)],
        step_vm: &[(u64, u64, u64)],
    ) -> Vec<(String, String)> {
        // Allocations no stream cache served lock-free took the whole path: the share of
        // lock-free hits is what sets a replay's ns/op.
        let (all, lock_free) = (s.blocks.allocation.all.allocated, s.lock_free_allocations());
        let mut extra = vec![
            ("alloc retries".into(), s.num_alloc_retries.to_string()),
            ("lock-free hits".into(), lock_free_note(lock_free, all, s.plan_hits)),
            (
                "peak reserved persistent / transient".into(),
                format!("{} / {}", peaks.reserved_persistent, peaks.reserved_transient),
            ),
        ];
        if s.expandable_segments {
            let steps: Vec<String> = step_vm.iter().map(|(m, u, _)| format!("{m}/{u}")).collect();
            extra.extend([
                ("virtual reserved".into(), s.virtual_reserved_bytes.to_string()),
                (
                    "physical creates / releases / pages moved".into(),
                    format!(
                        "{} / {} / {}",
                        s.num_physical_create, s.num_physical_release, s.num_pages_moved
                    ),
                ),
                ("maps/unmaps per step".into(), format!("[{}]", steps.join(", "))),
            ]);
        }
        if !s.expandable_segments && step_vm.len() > 1 {
            let steps: Vec<String> = step_vm.iter().map(|s| s.2.to_string()).collect();
            extra.push(("device mallocs per step".into(), format!("[{}]", steps.join(", "))));
        }
        if self.mode == Mode::Scoped {
            let list = |f: fn(&(u64, u64)) -> u64| {
                runs.iter().map(|r| f(r).to_string()).collect::<Vec<_>>().join(", ")
            };
            extra.extend([
                (
                    "plan hits / misses / fallbacks".into(),
                    format!("{} / {} / {}", s.plan_hits, s.plan_misses, s.plan_fallbacks),
                ),
                ("escapes".into(), s.scope_escapes.to_string()),
                ("plan region bytes".into(), s.plan_region_bytes.to_string()),
                ("device mallocs per scope run".into(), format!("[{}]", list(|r| r.0))),
                ("best-fit searches per scope run".into(), format!("[{}]", list(|r| r.1))),
            ]);
        }
        extra
    }
}

/// The lock-free hits among the allocations that reached the pool. A plan hit (`scoped`) is
/// served from its region and is no pool allocation, and a region is one: where plans served
/// any, "of N allocations" was not the trace's allocations (mlp_train: 64 of its 236), and the
/// rest did not all take the whole path. So the plan hits are named beside them; the share
/// stays that of the pool's allocations (`scripts/bench-report` reads it).
fn lock_free_note(lock_free: u64, all: u64, plan_hits: u64) -> String {
    let share = percent(lock_free, all);
    // BROKEN (`lock_free_of_unqualified`): the pool's allocations said as all of them.
    if plan_hits == 0 || cfg!(tidepool_broken = "lock_free_of_unqualified") {
        return format!("{lock_free} of {all} allocations ({share:.1} %)");
    }
    format!("{lock_free} of {all} pool allocations, {plan_hits} plan hits besides ({share:.1} %)")
}

/// `part` as a percentage of `whole` (0 for an empty whole).
fn percent(part: u64, whole: u64) -> f64 {
    match whole {
        0 => 0.0,
        _ => part as f64 * 100.0 / whole as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::{Mode, alloc_steps};
    use crate::event::{Event, Tag, Trace};

    /// A trace with a stream per event: each event's stream is found in constant time, so the
    /// 4 000 events look at 4 000 entries where a search of the streams met so far looked at
    /// n²/2 (a 400 000-stream trace took minutes before its error; `tests/trace_review.rs`
    /// checks that error). Counted, not timed. Broken build `stream_index_quadratic`
    /// (8 002 000 here).
    #[test]
    fn each_event_finds_its_stream_in_constant_time() {
        const N: u32 = 4_000;
        let t = Trace {
            events: (1..=N).map(|i| Event::alloc(u64::from(i), 512, i, Tag::Act)).collect(),
            ..Trace::default()
        };
        crate::cost::take();
        let (steps, _, streams) = alloc_steps(&t, Mode::Caching);
        let looked_at = crate::cost::take();
        assert_eq!((steps.len(), streams.len()), (N as usize, N as usize + 1));
        assert_eq!(streams[N as usize], N);
        assert_eq!(looked_at, u64::from(N), "{looked_at} streams looked at");
    }
}
