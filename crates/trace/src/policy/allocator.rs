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
//! | `pytorch`   | as `caching`, with `fast_cache:false` on top: PyTorch's algorithm exactly   |
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
//! two `scope_exit`s), so a steady state with none shows.
//!
//! Scope names have their trailing digits removed (`step0`, `step1` → `step`), so the steps
//! of a training loop are runs of one named scope. An `act` block allocated in a scope and
//! freed after its exit is an *escape*: it stays correct (it is an ordinary buffer that keeps
//! its memory) and is counted.
//!
//! The trace is first rewritten into [`AllocStep`]s (dense slots, device streams resolved) so
//! the timed loop only calls the allocator. Device calls and host syncs come from the
//! allocator's own counters; peaks from its statistics.

use std::sync::Arc;

use super::slots::{Slotted, Step};
use super::{Policy, PolicyResult, ReplayError};
use crate::clock::Stopwatch;
use crate::event::{Op, Tag, Trace};
use tidepool::Residency;
use tidepool::Scope;
use tidepool::device::{Device, SimConfig, SimDevice, StreamId};
use tidepool::{AllocError, Allocator, Buffer, Config};

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
    let mut stream_index = |s: u32| match streams.iter().position(|&x| x == s) {
        Some(i) => i,
        None => {
            streams.push(s);
            streams.len() - 1
        }
    };
    let steps = trace
        .events
        .iter()
        .zip(&slotted.steps)
        .map(|(e, step)| match (*step, e.op) {
            (Step::Alloc { slot, bytes }, _) => {
                let residency = match (mode, e.tag) {
                    (Mode::Residency | Mode::Scoped, Tag::Param) => Residency::Persistent,
                    _ => Residency::Transient,
                };
                AllocStep::Alloc { slot, bytes, stream: stream_index(e.stream), residency }
            }
            (Step::Free { slot }, _) => AllocStep::Free { slot },
            (Step::Marker, Op::ScopeEnter) if mode == Mode::Scoped => AllocStep::Enter {
                name: e.scope.unwrap_or(0) as usize,
                stream: stream_index(e.stream),
            },
            (Step::Marker, Op::ScopeExit) if mode == Mode::Scoped => AllocStep::Exit,
            (Step::Marker, _) => AllocStep::Marker,
        })
        .collect();
    (steps, slotted.slots, streams)
}

/// What the timed loop reads.
struct Loop<'a> {
    name: &'static str,
    steps: &'a [AllocStep],
    /// Whether each event is a `scope_exit` (a step ends there).
    exits: &'a [bool],
    /// Scope families by scope name index.
    families: &'a [&'a str],
    /// Device stream of each trace stream.
    streams: &'a [StreamId],
}

/// What the timed loop measures besides the allocator's own figures.
#[derive(Default)]
struct LoopOut {
    /// CPU time of the loop, in nanoseconds.
    elapsed: u128,
    /// Device mallocs and best-fit searches made during each scope run.
    runs: Vec<(u64, u64)>,
    /// Peaks (reserved, allocated) at the end of the first scope run.
    first_peaks: (u64, u64),
    /// Map, unmap and malloc calls made in each step (between two scope exits).
    step_vm: Vec<(u64, u64, u64)>,
    /// Reserved bytes after each event, when asked for.
    timeline: Option<Vec<u64>>,
}

/// The timed part of a replay: every step through the allocator. A function of its own so that
/// instruction counts (`scripts/replay-instructions`) cover exactly what `ns_per_op` times.
#[inline(never)]
fn timed_loop(
    lp: &Loop<'_>,
    device: &SimDevice,
    alloc: &Allocator<SimDevice>,
    live: &mut [Option<Buffer<SimDevice>>],
    out: &mut LoopOut,
) -> Result<(), ReplayError> {
    let Loop { name, steps, exits, families, streams } = *lp;
    let mut scope = None;
    let mut run_start = (0, 0);
    let mut vm_mark = (0, 0, 0);
    let err = |e: AllocError| ReplayError::new(name, e.to_string());
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
                    Err(e) => return Err(err(e)),
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
                        out.first_peaks =
                            (st.blocks.reserved_bytes.all.peak, st.blocks.allocated_bytes.all.peak);
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
            .map_err(|e| ReplayError::new(name, e.to_string()))?;
        if mode == Mode::Expandable {
            config = config.with_expandable_segments(true);
        }
        // BROKEN (`pytorch_lanes`): the stream caches left on, as `caching` has them.
        if mode == Mode::PyTorch && !cfg!(tidepool_broken = "pytorch_lanes") {
            config = config.with_fast_cache(false);
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
    let err = |e: &dyn std::fmt::Display| ReplayError::new(name, e.to_string());
    // BROKEN (`streams_unbounded`): one thread per trace stream, however many.
    if trace_streams > MAX_REPLAY_STREAMS && !cfg!(tidepool_broken = "streams_unbounded") {
        return Err(err(&format!(
            "the trace has {trace_streams} streams; an allocator replay makes one simulated \
             stream (a thread) per trace stream and takes at most {MAX_REPLAY_STREAMS}"
        )));
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
        let exits: Vec<bool> = trace.events.iter().map(|e| e.op == Op::ScopeExit).collect();
        let mut live: Vec<Option<Buffer<SimDevice>>> = (0..slots).map(|_| None).collect();
        let mut out = LoopOut {
            timeline: timeline.then(|| Vec::with_capacity(steps.len())),
            ..LoopOut::default()
        };
        let lp =
            Loop { name, steps: &steps, exits: &exits, families: &families, streams: &streams };
        timed_loop(&lp, &device, &alloc, &mut live, &mut out)?;
        let LoopOut { elapsed, runs, first_peaks, step_vm, timeline: tl } = out;
        let s = alloc.stats();
        drop(live);
        let mut extra = self.extras(&s, &runs, &step_vm);
        if runs.len() > 1 {
            extra.push((
                "peak reserved after the first scope run".into(),
                s.blocks.reserved_bytes.all.peak.to_string(),
            ));
        }
        Ok(PolicyResult {
            name: name.to_string(),
            peak_reserved_bytes: s.blocks.reserved_bytes.all.peak.max(first_peaks.0),
            peak_allocated_bytes: s.blocks.allocated_bytes.all.peak.max(first_peaks.1),
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
        runs: &[(u64, u64)],
        step_vm: &[(u64, u64, u64)],
    ) -> Vec<(String, String)> {
        // Allocations no stream cache served lock-free took the whole path: the share of
        // lock-free hits is what sets a replay's ns/op.
        let (all, lock_free) = (s.blocks.allocation.all.allocated, s.lock_free_allocations());
        let mut extra = vec![
            ("alloc retries".into(), s.num_alloc_retries.to_string()),
            (
                "lock-free hits".into(),
                format!("{lock_free} of {all} allocations ({:.1} %)", percent(lock_free, all)),
            ),
            (
                "peak reserved persistent / transient".into(),
                format!(
                    "{} / {}",
                    s.blocks.reserved_bytes.persistent.peak, s.blocks.reserved_bytes.transient.peak
                ),
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

/// `part` as a percentage of `whole` (0 for an empty whole).
fn percent(part: u64, whole: u64) -> f64 {
    match whole {
        0 => 0.0,
        _ => part as f64 * 100.0 / whole as f64,
    }
}
