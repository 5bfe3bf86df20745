//! The `allocator_ops` harness: runs a [`Program`] against an [`Allocator`] on an unbacked,
//! sanitized [`SimDevice`] (or, for a `quiet` program, one with its sanitizer off, as on a real
//! GPU: only there do hits and frees take the inlined paths that the sanitizer's hooks
//! bypass), and checks after every step that the allocator agrees with a simple reference
//! model and with the device.
//!
//! ```text
//!   Program ──▶ Harness::step(op) ──▶ Harness::check() ──▶ … ──▶ Harness::teardown()
//!                  │ model: live buffers (size, rounded size, stream, residency, pool,
//!                  │        streams that used it, the scope run that made it), stream slots,
//!                  │        armed device faults, the open scope (at most one)
//!                  ▼
//!   Allocator<SimDevice> ×2 (capacity from the program; sanitizer on unless quiet; kernels
//!                            without bodies)
//! ```
//!
//! The allocator is a local of [`run`], and the harness borrows it, so the open [`Scope`] (which
//! borrows the allocator too) can sit in the harness next to the buffers; `teardown` consumes
//! the harness before `run` drops the allocator.
//!
//! Checked after every step that calls the allocator (after the others, which cannot change
//! its state, only the device-side checks run): `check_invariants()` (tiling, no adjacent free
//! blocks, exact stats, pending bookkeeping); the allocator's segments are exactly the device's
//! live segments; reserved = Σ device segments; allocated = Σ live block sizes; every live buffer sits in an
//! allocated block of its size, request, stream and pool, in a segment of the residency it must
//! have (small blocks: transient; large ones on ordinary segments: either); live buffers never overlap;
//! stat identities (current = allocated − freed ≤ peak; all = small + large = persistent +
//! transient); device malloc/free counts match the allocator's; no sanitizer violation and no
//! failed kernel. Each operation also checks its own outcome (an out-of-memory error must be
//! explained by the device, a limit or an injected fault; `empty_cache` leaves no releasable
//! segment behind; …). At the end every buffer is dropped, the allocator is dropped, and the
//! device must hold no segment, no violation, and no other handle.
//!
//! Expandable segments (the `expandable_segments:true` configurations): the allocator's segments
//! inside the device's virtual ranges are runs of mapped pages (each wholly covered by the
//! device's mappings, checked), so the segment check compares only the others with the device's
//! segments; reserved = Σ device segments + the device's
//! physical bytes; small blocks of either residency sit in transient small runs; a release
//! leaves no wholly free run behind; `FailNthMalloc`
//! also arms the nth physical creation and the nth mapping (faults midway through a growth),
//! and an injected page fault explains an out-of-memory error; at the end nothing is mapped,
//! created or reserved on the device.
//!
//! Fault injection: every fault SimDevice offers is armed by the program at points it chooses
//! ([`Op::FailNthMalloc`] arms the nth malloc, physical creation and mapping together;
//! [`Op::FailNth`] one of malloc, physical creation, mapping, unmap or event creation alone;
//! [`Op::FailMallocsAbove`]; [`Op::VirtualRoom`] bounds the virtual address space;
//! [`Op::FailEventQueries`] and [`Op::FailEvents`] refuse every event query, record or wait, or
//! make those refusals panics in the device). The pinned host allocator's fault
//! (`fail_nth_host_alloc`) is the only one left out: no step reaches pinned host memory. An
//! allocator may answer an injected fault with an error only where SimDevice returns that
//! error for nothing but an injected fault (`injected`: a refused event record, wait, query,
//! unmap or creation, or a panic of `panic_on_faults`): the step then goes on, the usual checks
//! follow, and a release whose unmap was refused may keep free pages mapped. Any other error,
//! any panic, and any leak is a bug. The harness's own device calls never meet a fault: its
//! event (for its device-side waits) is made before the first step, and its record and wait
//! run with the event faults off; captures run with the event faults off (the counted-down
//! faults stay armed). At the end every buffer is dropped with the faults still armed; then
//! all are cleared, both allocators must serve a request, and once they are dropped the device
//! must hold no segment, mapping, physical allocation, virtual range or event, and no stream
//! past the program's slots.
//!
//! Devices are reused: starting a SimDevice and its stream workers costs more than a whole
//! program, so a device that ended a program clean (no segment, no violation, every stream idle)
//! goes back to a small pool, with its streams, for the next program of the same capacity. Fault
//! injection is reset and device counters are compared as differences, so a program sees the
//! same device either way.
//!
//! The user's side of stream order is followed as in PyTorch: before a kernel touches a buffer
//! on stream S, S waits (device-side) for every other stream that used it, and a use on a stream
//! other than the owner is announced with `record_stream`.
//!
//! A second allocator shares the device (`Op::Other`): its buffers are used on other streams
//! through `Buffer::use_on`, and buffers of each allocator are given to the other in
//! `free_batch`, `record_stream` and `use_on`, which must refuse them (`ForeignBuffer`; a refused
//! `free_batch` frees the buffer through its own allocator). The device-wide checks (segments,
//! reserved bytes, malloc and free counts, no overlap) count both allocators; both check their
//! invariants after every step; a destroyed stream is released on the second allocator, which
//! must then refuse it. `Op::ScopeForget` allocates a bound buffer, maybe reads it on another
//! stream (`Scope::record_stream`), and `mem::forget`s it: the scope takes it back at its exit,
//! after that read.
//!
//! Graph captures (`Op::Capture`) run whole in one step: allocations from the graph's pool with
//! captured kernels over them (checked by the sanitizer as they are captured and at each replay),
//! a block freed during the capture, unforked an allocation on the other stream outside the
//! capture (a growth or out-of-memory ladder while the capture refuses every host wait; the
//! buffer joins the live list), and, forked, a second stream that joins the capture, uses
//! and frees there, and is joined back (every other forked capture with
//! `graph_capture_record_stream_reuse`: the block the side stream used is freed before the join
//! and may serve the allocation after it); the graph is replayed and dropped, and its pool, emptied,
//! must hold nothing (its device calls join the counts the device's must match). A forked capture
//! replayed twice keeps the side stream's block past its graph, writes and frees it there, and
//! captures again into the same pool, forked into the same stream, replaying on both streams
//! (the pool's earlier work must be ordered before that graph). One capture in seven runs its
//! work as the body of `Allocator::capture`, which panics at its end, joined back or left
//! forked: the harness catches the panic (silencing libFuzzer's aborting panic hook meanwhile,
//! and letting any other panic go on), and the capture must be over for both streams with the
//! pool empty once emptied. Injected faults and every configuration apply to them as to any
//! step.
//!
//! Scopes (`ScopeEnter` / `ScopeAlloc` / `ScopeBurst` / `ScopeExit`): unbound scoped buffers
//! join the live list like any other buffer (so `Free`, `Launch` and `RecordStream` reach them,
//! before or after their scope exits); bound ones live inside one `ScopeBurst` step. Scopes
//! change what the allocator holds besides live buffers: a named scope's plan keeps a *region*
//! of allocated blocks (until the allocator is dropped), and an open scope keeps the blocks its
//! bound buffers freed. So once a scope was opened, allocated blocks that back no live pool
//! buffer are allowed, but only transient ones, and with no scope open at most
//! `plan_region_bytes` of them; a planned buffer must lie inside such a block of its stream;
//! and the exit of a scope must count exactly its live unbound buffers as escapes. Everything
//! else (invariants, no overlap of live buffers, planned ones included, the device's segments,
//! no sanitizer violation, an empty device at the end) holds as before.

use super::program::{
    BURST_SIZES, CAPACITIES, CONFIGS, EventFault, NthFault, Op, Program, SLEEPS_US, STREAM_SLOTS,
};
use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tidepool::BlockState;
use tidepool::device::{
    Access, AccessKind, Device, DeviceAddr, DeviceError, EventId, Kernel, Launch, SimConfig,
    SimCounters, SimDevice, StreamId,
};
use tidepool::{AllocError, OomReport, Scope, ScopedBuffer, SegmentInfo};
use tidepool::{Allocator, Buffer, Config, MemPool, PoolOptions};
use tidepool::{BlockStats, PoolKind, Residency, Stat, StatGroup};

/// Devices that ended a program clean, ready for the next one.
static DEVICES: Mutex<Vec<Arc<SimDevice>>> = Mutex::new(Vec::new());

/// Most devices kept in [`DEVICES`].
const KEEP_DEVICES: usize = 8;

/// A clean device of `capacity` bytes, its sanitizer off where `quiet`: from the pool, or new.
fn take_device(capacity: u64, quiet: bool) -> Arc<SimDevice> {
    let mut pool = DEVICES.lock().unwrap_or_else(PoisonError::into_inner);
    let fits = |d: &Arc<SimDevice>| d.config().capacity == capacity && d.config().sanitize != quiet;
    match pool.iter().position(fits) {
        Some(i) => pool.swap_remove(i),
        None => Arc::new(SimDevice::with_config(SimConfig {
            capacity,
            backed: false,
            sanitize: !quiet,
        })),
    }
}

/// Clears every fault SimDevice can inject (and gives back the whole virtual address space).
fn clear_faults(dev: &SimDevice) {
    dev.fail_nth_vm_create(None);
    dev.fail_nth_vm_map(None);
    dev.fail_nth_vm_unmap(None);
    dev.fail_nth_event_create(None);
    dev.fail_nth_malloc(None);
    dev.fail_mallocs_above(None);
    dev.fail_event_queries(false);
    dev.fail_event_records(false);
    dev.fail_event_waits(false);
    dev.panic_on_faults(false);
    dev.set_virtual_capacity(default_virtual_capacity(dev));
}

/// SimDevice's own virtual capacity for its capacity (`vmm.rs`).
fn default_virtual_capacity(dev: &SimDevice) -> u64 {
    dev.config().capacity.saturating_mul(1024).clamp(1 << 40, 1 << 60)
}

/// The message SimDevice panics with for an injected fault (`panic_on_faults`).
const INJECTED_PANIC: &str = "SimDevice: injected";

/// Keeps the panic hook (libFuzzer's aborts the process) away from the panics SimDevice
/// injects (`panic_on_faults`), which the allocator catches at the device call; every other
/// panic reaches it. Installed once per process.
fn quiet_injected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let p = info.payload();
            let msg = p.downcast_ref::<String>().map(String::as_str).or(p.downcast_ref().copied());
            if !msg.is_some_and(|m: &str| m.starts_with(INJECTED_PANIC)) {
                hook(info);
            }
        }));
    });
}

/// Whether `e` is what SimDevice answers only when a fault is injected: an allocator may
/// return it for the call the fault refused (an event call, an event creation, an unmap), and
/// must then go on working. Any other device error is a bug.
fn injected(e: &DeviceError) -> bool {
    match e {
        DeviceError::Driver { op, code } => match *op {
            "record_event" | "wait_event" | "query_event" | "cuMemUnmap" => {
                *code == DeviceError::CUDA_ERROR_UNKNOWN
            }
            "cuEventCreate" => *code == DeviceError::CUDA_ERROR_OUT_OF_MEMORY,
            _ => false,
        },
        DeviceError::Panicked { message, .. } => message.starts_with(INJECTED_PANIC),
        _ => false,
    }
}

/// [`injected`] for an allocator's error.
fn excused(e: &AllocError) -> bool {
    matches!(e, AllocError::Device(d) if injected(d))
}

thread_local! {
    /// Errors of injected faults the allocators returned on this thread, all programs together
    /// (for tests: proof that the faults were met).
    static EXCUSED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Returns a device that ended a program clean to the pool.
fn give_back(dev: Arc<SimDevice>) {
    clear_faults(&dev);
    let mut pool = DEVICES.lock().unwrap_or_else(PoisonError::into_inner);
    if pool.len() < KEEP_DEVICES {
        pool.push(dev);
    }
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// Runs `data` as an `allocator_ops` program; panics with the failure and the decoded program
/// if any check fails.
pub fn allocator_ops(data: &[u8]) {
    let program = Program::decode(data);
    if let Err(e) = run(&program, Options::default()) {
        panic!("allocator_ops: {e}\n{program:#?}");
    }
}

/// How to run a program (tests only change it).
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Turn on the allocator's deliberate stream-order bug, to prove the harness catches it.
    pub broken_skip_events: bool,
    /// Revert one soundness fix in both allocators, to prove the harness catches it.
    pub broken: Option<tidepool::hooks::Broken>,
}

/// Runs `program`; the first failed check, with the step it failed at.
pub fn run(program: &Program, options: Options) -> Result<(), String> {
    quiet_injected_panics();
    let (alloc, base) = start(program)?;
    alloc.set_broken_skip_events(options.broken_skip_events);
    let other = second(&alloc, program)?;
    if let Some(mode) = options.broken {
        alloc.set_broken(mode, true);
        other.set_broken(mode, true);
    }
    let mut h = Harness::new(&alloc, &other, base);
    if program.late_streams {
        h.head_start().map_err(|e| format!("head start: {e}"))?;
    }
    h.check().map_err(|e| format!("before the first step: {e}"))?;
    for (i, op) in program.ops.iter().enumerate() {
        h.step(op).map_err(|e| format!("step {i} {op:?}: {e}"))?;
        let checked = if op.calls_allocator() { h.check() } else { h.check_device() };
        checked.map_err(|e| format!("after step {i} {op:?}: {e}"))?;
    }
    if program.handles_first {
        let (dev, buffers) = h.hand_over().map_err(|e| format!("teardown: {e}"))?;
        drop(other);
        drop(alloc);
        closed_teardown(&dev, buffers).map_err(|e| format!("closed teardown: {e}"))?;
        return finish(dev).map_err(|e| format!("teardown: {e}"));
    }
    let dev = h.teardown(program.explicit_teardown).map_err(|e| format!("teardown: {e}"))?;
    drop(other);
    drop(alloc);
    finish(dev).map_err(|e| format!("teardown: {e}"))
}

/// A live buffer at a handles-first teardown, and whether it is an unbound scope buffer.
type HandedOver = (Buffer<SimDevice>, bool);

/// [`Program::handles_first`]'s teardown, once both allocators' handles are gone (they are
/// closed): the buffers go one at a time, and after each (and before the first) every device
/// segment and mapping must hold a live buffer — a closed allocator keeps nothing else — and
/// the sanitizer must have seen nothing. (Unbound scope buffers' plan regions stay until all of
/// them are gone: the rule waits for that.)
fn closed_teardown(dev: &SimDevice, mut buffers: Vec<HandedOver>) -> Result<(), String> {
    loop {
        let v = dev.violations();
        ensure!(v.is_empty(), "stream-order violations: {v:?}");
        let k = dev.kernel_failures();
        ensure!(k.is_empty(), "kernel failures: {k:?}");
        if !buffers.iter().any(|&(_, scoped)| scoped) {
            let held = |(a, n): (DeviceAddr, u64)| {
                buffers.iter().any(|(b, _)| {
                    b.block_size() > 0 && b.ptr().0 < a.0 + n && a.0 < b.ptr().0 + b.block_size()
                })
            };
            let segs = dev.live_segments();
            let idle: Vec<_> = segs.iter().copied().filter(|&s| !held(s)).collect();
            let live: Vec<_> = buffers.iter().map(|(b, _)| (b.ptr(), b.block_size())).collect();
            ensure!(
                idle.is_empty(),
                "segments of closed allocators hold no buffer: {idle:x?} (buffers {live:x?})"
            );
            // A mapping is held where it, or another mapping of its physical allocation (a
            // stitched block's chunk in its home range), holds a live buffer.
            let maps = dev.live_mappings_with_handles();
            let idle: Vec<_> = maps
                .iter()
                .filter(|&&(_, _, h)| !maps.iter().any(|&(a, n, g)| g == h && held((a, n))))
                .collect();
            ensure!(
                idle.is_empty(),
                "mappings of closed allocators hold no buffer: {idle:x?} (buffers {live:x?})"
            );
        }
        if buffers.is_empty() {
            return Ok(());
        }
        drop(buffers.remove(0));
    }
}

/// The second allocator of a program: on the same device, with the next configuration.
fn second(alloc: &Allocator<SimDevice>, program: &Program) -> Result<Allocator<SimDevice>, String> {
    let c = config((program.config + 1) % CONFIGS.len() as u8);
    Allocator::new(alloc.device().clone(), c).map_err(|e| format!("second Allocator::new: {e}"))
}

/// A clean device for `program` and an allocator over it, with the device's counters as the
/// program starts.
fn start(program: &Program) -> Result<(Allocator<SimDevice>, SimCounters), String> {
    let dev = take_device(CAPACITIES[usize::from(program.capacity)], program.quiet);
    clear_faults(&dev);
    let base = dev.counters();
    let v = dev.violations();
    ensure!(v.is_empty() && dev.live_segments().is_empty(), "a dirty device: {v:?}");
    let alloc =
        Allocator::new(dev, config(program.config)).map_err(|e| format!("Allocator::new: {e}"))?;
    Ok((alloc, base))
}

/// After the allocator was dropped: the device must hold no segment, no violation, and no
/// other handle; then it goes back to the pool.
fn finish(dev: Arc<SimDevice>) -> Result<(), String> {
    let segs = dev.live_segments();
    ensure!(segs.is_empty(), "segments leaked past the allocator's drop: {segs:?}");
    ensure!(dev.reserved_bytes() == 0, "device still reserves {} bytes", dev.reserved_bytes());
    let maps = dev.live_mappings();
    ensure!(maps.is_empty(), "mappings leaked past the allocator's drop: {maps:?}");
    ensure!(
        dev.physical_bytes() == 0 && dev.live_physical() == 0 && dev.virtual_bytes() == 0,
        "physical ({} bytes) or virtual ({} bytes) memory leaked past the allocator's drop",
        dev.physical_bytes(),
        dev.virtual_bytes()
    );
    ensure!(Arc::strong_count(&dev) == 1, "something still holds the device");
    ensure!(
        dev.live_events() == 0,
        "{} events leaked past the allocator's drop",
        dev.live_events()
    );
    let streams = dev.live_streams();
    ensure!(
        streams.len() <= usize::from(STREAM_SLOTS) && streams.contains(&StreamId::DEFAULT),
        "streams past the program's slots outlived the allocator: {streams:?}"
    );
    let v = dev.violations();
    ensure!(v.is_empty(), "stream-order violations: {v:?}");
    let k = dev.kernel_failures();
    ensure!(k.is_empty(), "kernel failures: {k:?}");
    give_back(dev);
    Ok(())
}

/// A captured kernel writing its second buffer after reading its first.
type CapturedKernel = dyn Fn(Option<&Buffer<SimDevice>>, &Buffer<SimDevice>) -> Kernel;

/// An allocation of `bytes` on `on` during a capture: `None` where the request is absurd, or
/// the device (or an injected fault) refuses it.
fn captured_alloc(
    a: &Allocator<SimDevice>,
    bytes: u64,
    on: StreamId,
) -> Result<Option<Buffer<SimDevice>>, String> {
    match a.alloc(bytes, on) {
        Ok(b) => Ok(Some(b)),
        Err(AllocError::OutOfMemory(_) | AllocError::InvalidSize { .. }) => Ok(None),
        Err(e) if excused(&e) => Ok(None),
        Err(e) => Err(format!("alloc of {bytes} during a capture on {on}: {e}")),
    }
}

/// The payload of the deliberate panic of [`Harness::capture_panicking`]'s capture body.
struct BodyPanic;

/// A live buffer of the model.
struct Live {
    buf: Buffer<SimDevice>,
    /// The residency its segment must have: small blocks of either residency sit in transient
    /// segments (or runs); `None` where either will do (on ordinary segments large blocks of
    /// both residencies share free space: `residency.rs`).
    residency: Option<Residency>,
    /// The pool its rounded size belongs to under the configuration it was allocated with.
    kind: PoolKind,
    /// Streams that used it (the owner first); a kernel on another stream waits for all.
    users: Vec<StreamId>,
    /// The scope run that made it (`alloc_unbound`), if any.
    run: Option<u64>,
}

/// The allocator's fast-path slots: a stream's lanes are slot `id % FAST_SLOTS`'s.
const FAST_SLOTS: u32 = 64;

/// The name of every named scope of a program (`Op::ScopeEnter { named: true }`).
const SCOPE_NAME: &str = "f";

/// The open scope of the model.
struct OpenScope<'a> {
    scope: Scope<'a, SimDevice>,
    /// Its run's number (1 for the program's first scope).
    run: u64,
    named: bool,
    /// The configuration as of opening: the scope rounds every request with it.
    config: Arc<Config>,
}

struct Harness<'a> {
    dev: Arc<SimDevice>,
    alloc: &'a Allocator<SimDevice>,
    /// A second allocator on the same device ([`Op::Other`]): its buffers (`others`) go to the
    /// first one in `free_batch`, `record_stream` and `use_on`, which must refuse them, and the
    /// first one's to it.
    other: &'a Allocator<SimDevice>,
    /// The second allocator's live buffers; their kernels are ordered with `use_on`.
    others: Vec<Buffer<SimDevice>>,
    /// The open scope, if any (at most one).
    scope: Option<OpenScope<'a>>,
    /// Scope runs opened so far.
    runs: u64,
    /// Stream of each slot (slot 0: the default stream); `None` until first use or after destroy.
    slots: [Option<StreamId>; STREAM_SLOTS as usize],
    /// Streams destroyed through the first allocator: a request on one must fail, even once its
    /// fast-path slot serves a newer stream.
    gone: Vec<StreamId>,
    live: Vec<Live>,
    /// The device reserve call (counted from 1) at which an armed `fail_nth_malloc` fires.
    nth_fires_at: Option<u64>,
    /// The armed `fail_mallocs_above` threshold.
    fail_above: Option<u64>,
    /// Device counters when the program started (a reused device has counted before).
    base: SimCounters,
    /// The finest `min_block_size` of every configuration used so far (at most 512): blocks
    /// carved under one configuration stay in the cache under the next, so pointers and block
    /// sizes are only multiples of this.
    granularity: u64,
    /// `vm_failures()` at the last check: refusals beyond it happened in the current step.
    vm_fail_mark: std::cell::Cell<u64>,
    /// The initial pool segments (`initial_pool_size_mb`) of the two allocators, kept until
    /// they are dropped: no release is expected to return them.
    initial: [Option<(DeviceAddr, u64)>; 2],
    /// Device allocations and releases made by the private pools of graphs ([`Op::Capture`]),
    /// all gone: the device's counts are the allocators' and these.
    pool_calls: (u64, u64),
    /// The harness's own event ([`Harness::order_after`]), made before any fault is armed, so
    /// that injected event creations refuse only the allocators'.
    event: EventId,
    /// The armed event faults: queries, records, waits, panics (the harness's own event calls
    /// run with them off).
    event_faults: std::cell::Cell<[bool; 4]>,
    /// Refused unmaps at the start of the current step.
    unmaps_refused: u64,
    /// An injected refusal of an event creation is armed ([`NthFault::EventCreate`], maybe
    /// already fired).
    event_create_armed: bool,
    /// Calls the device refused because a capture was underway, at the start of the step.
    refused_in_capture: u64,
}

/// The initial pool segment of an allocator just made (its only segment), if it has one.
fn initial_segment(a: &Allocator<SimDevice>) -> Option<(DeviceAddr, u64)> {
    if a.config().initial_pool_size == 0 {
        return None;
    }
    a.snapshot().first().map(|s| (s.address, s.size))
}

/// What the harness checks of a scoped buffer, bound or unbound.
#[derive(Debug)]
struct Scoped {
    ptr: DeviceAddr,
    len: u64,
    size: u64,
    stream: StreamId,
    planned: bool,
}

impl Scoped {
    fn of(b: &Buffer<SimDevice>) -> Scoped {
        let (ptr, len, size, stream) = (b.ptr(), b.len(), b.block_size(), b.stream());
        Scoped { ptr, len, size, stream, planned: b.is_planned() }
    }

    fn of_bound(b: &ScopedBuffer<'_, SimDevice>) -> Scoped {
        let (ptr, len, size, stream) = (b.ptr(), b.len(), b.block_size(), b.stream());
        Scoped { ptr, len, size, stream, planned: b.is_planned() }
    }
}

/// The xorshift generator of [`Op::ScopeBurst`]: the same seed, the same burst.
struct Burst(u64);

impl Burst {
    fn new(seed: u32) -> Burst {
        Burst((u64::from(seed) << 1) | 0x9e37_79b9_0000_0001)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 32) as usize % n
    }
}

fn config(i: u8) -> Config {
    Config::parse(CONFIGS[usize::from(i)]).expect("CONFIGS are valid")
}

fn dev_err(what: &str, e: DeviceError) -> String {
    format!("{what} failed: {e}")
}

impl<'a> Harness<'a> {
    /// A harness over `alloc`, whose device counted `base` when the program started.
    fn new(
        alloc: &'a Allocator<SimDevice>,
        other: &'a Allocator<SimDevice>,
        base: SimCounters,
    ) -> Harness<'a> {
        let dev = alloc.device().clone();
        let event = dev.create_event().expect("no fault is armed before the first step");
        let granularity = alloc.config().sizing.min_block_size.min(512);
        let initial = [initial_segment(alloc), initial_segment(other)];
        // Slot 0 is the default stream; a reused device brings its other streams along.
        let mut slots = [None; STREAM_SLOTS as usize];
        slots[0] = Some(StreamId::DEFAULT);
        let others = dev.live_streams().into_iter().filter(|&s| s != StreamId::DEFAULT);
        for (slot, s) in slots[1..].iter_mut().zip(others) {
            *slot = Some(s);
        }
        Harness {
            dev,
            alloc,
            other,
            others: Vec::new(),
            scope: None,
            runs: 0,
            slots,
            gone: Vec::new(),
            live: Vec::new(),
            nth_fires_at: None,
            fail_above: None,
            pool_calls: (0, 0),
            base,
            granularity,
            vm_fail_mark: std::cell::Cell::new(0),
            initial,
            event,
            event_faults: std::cell::Cell::new([false; 4]),
            unmaps_refused: 0,
            event_create_armed: false,
            refused_in_capture: 0,
        }
    }

    /// The stream of `slot`, creating it if the slot is empty.
    fn stream(&mut self, slot: u8) -> Result<StreamId, String> {
        let slot = &mut self.slots[usize::from(slot)];
        match *slot {
            Some(s) => Ok(s),
            None => {
                let s = self.dev.create_stream().map_err(|e| dev_err("create_stream", e))?;
                *slot = Some(s);
                Ok(s)
            }
        }
    }

    /// [`Program::late_streams`]: the device's next streams go past the 64 fast-path slots
    /// (`id % 64`) onto slots whose lanes served streams that are gone. Skipped ids (streams
    /// made and destroyed elsewhere) first bring the next id to 61 modulo 64; then three
    /// streams leave: one through the allocator, one on the device behind the allocator's
    /// back, each after two 4 KiB requests of which one was freed (cached in the stream's lane)
    /// and one stays live (a buffer that outlives its stream, for the program to use and free
    /// later), and one used through the second allocator only (the first never had lanes for
    /// it). Skipped ids fill the lap: the program's streams are numbered 61, 62, 63 and 0
    /// modulo 64 in creation order, the three slots to re-tag and then the live default
    /// stream's (where the default stream has lanes, that stream takes its second choice).
    fn head_start(&mut self) -> Result<(), String> {
        const SLOTS: u64 = FAST_SLOTS as u64;
        let dev = self.dev.clone();
        // A reused device's streams (a program before this one's) go: the program's streams
        // are made below the head start.
        for slot in &mut self.slots[1..] {
            if let Some(s) = slot.take() {
                dev.destroy_stream(s).map_err(|e| dev_err("destroy_stream", e))?;
            }
        }
        // Streams made and destroyed elsewhere: ids only.
        let next = dev.create_stream().map_err(|e| dev_err("create_stream", e))?;
        dev.destroy_stream(next).map_err(|e| dev_err("destroy_stream", e))?;
        let next = u64::from(next.0) + 1;
        dev.skip_stream_ids(((61 + SLOTS - next % SLOTS) % SLOTS) as u32);
        for k in 0..3 {
            let s = dev.create_stream().map_err(|e| dev_err("create_stream", e))?;
            let slot = u64::from(s.0) % SLOTS;
            ensure!(slot == 61 + k, "{s} is on slot {slot}, not {}", 61 + k);
            if k == 2 {
                match self.other.alloc(4096, s) {
                    Ok(b) => drop(b),
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(e) => return Err(format!("second alloc on {s}: {e}")),
                }
                self.other.destroy_stream(s).map_err(|e| format!("second destroy {s}: {e}"))?;
                continue;
            }
            let live = self.live.len();
            self.alloc_op(4096, s, Residency::Transient)?;
            self.alloc_op(4096, s, Residency::Transient)?;
            if self.live.len() > live {
                drop(self.live.remove(live)); // cached in the lane
            }
            if k == 0 {
                self.alloc.destroy_stream(s).map_err(|e| format!("destroy {s}: {e}"))?;
                self.gone.push(s);
            } else {
                // Requests on it may still succeed until the allocator learns it is gone
                // (`release_stream`, or the re-tag of its slot): not in `gone`.
                dev.destroy_stream(s).map_err(|e| dev_err("destroy_stream", e))?;
            }
            self.check()?;
        }
        dev.skip_stream_ids(FAST_SLOTS - 3);
        Ok(())
    }

    /// Device reserve calls so far (each one advances an armed `fail_nth_malloc`).
    fn reserve_calls(&self) -> u64 {
        let c = self.dev.counters();
        c.mallocs + c.failed_mallocs
    }

    /// Physical creations and mappings refused so far (injected, or the device full).
    fn vm_failures(&self) -> u64 {
        let v = self.dev.vm_counters();
        v.failed_creates + v.failed_maps + v.failed_reserves
    }

    fn live_index(&self, index: u8) -> Option<usize> {
        (!self.live.is_empty()).then(|| usize::from(index) % self.live.len())
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        self.unmaps_refused = self.unmaps_refused();
        self.refused_in_capture = self.dev.graph_counters().refused_in_capture;
        match *op {
            Op::Alloc { bytes, stream, persistent } => {
                let residency =
                    if persistent { Residency::Persistent } else { Residency::Transient };
                let s = self.stream(stream)?;
                self.alloc_op(bytes, s, residency)?;
            }
            Op::Free { index } => {
                if let Some(i) = self.live_index(index) {
                    drop(self.live.remove(i));
                }
            }
            Op::RecordStream { index, stream } => {
                if let Some(i) = self.live_index(index) {
                    let s = self.stream(stream)?;
                    let l = &self.live[i];
                    if !self.tolerate(self.alloc.record_stream(&l.buf, s), "record_stream")? {
                        // Refused: the use is not announced, so there is none (the kernel of
                        // a `Launch` is not launched either).
                        return Ok(());
                    }
                    let l = &mut self.live[i];
                    if !l.users.contains(&s) {
                        l.users.push(s);
                    }
                }
            }
            Op::Launch { index, stream, write, sleep_us } => {
                if let Some(i) = self.live_index(index) {
                    let s = self.stream(stream)?;
                    self.launch(i, s, write, sleep_us)?;
                }
            }
            Op::Sleep { stream, sleep_us } => {
                let s = self.stream(stream)?;
                let k = Kernel::sleep(Duration::from_micros(u64::from(sleep_us)));
                self.dev.launch(s, k).map_err(|e| dev_err("launch sleep", e))?;
            }
            Op::WaitEvent { from, to } => {
                let (from, to) = (self.stream(from)?, self.stream(to)?);
                self.order_after(to, from)?;
            }
            Op::Synchronize => {
                if !self.tolerate(self.alloc.synchronize(), "synchronize")? {
                    return Ok(());
                }
                let b = self.alloc.stats().blocks;
                let (allocated, active) =
                    (b.allocated_bytes.all.current, b.active_bytes.all.current);
                ensure!(
                    active == allocated,
                    "pending blocks remain: active {active} != allocated {allocated}"
                );
                let requested: u64 = self.live.iter().map(|l| l.buf.len()).sum();
                // (Scopes account a locally reused block with its first request, and regions
                // with theirs: no equality once a scope was opened.)
                ensure!(
                    self.runs > 0 || b.requested_bytes.all.current == requested,
                    "requested_bytes {} != Σ live requests {requested} with nothing pending",
                    b.requested_bytes.all.current
                );
            }
            Op::DeviceSynchronize => {
                self.dev.synchronize().map_err(|e| dev_err("device synchronize", e))?
            }
            Op::EmptyCache => {
                if self.tolerate(self.alloc.empty_cache(), "empty_cache")?
                    && !self.unmap_refused_in_step()
                {
                    let transient = |s: &SegmentInfo| s.residency == Residency::Transient;
                    self.nothing_releasable(transient, "empty_cache")?;
                }
            }
            Op::ReleasePersistent => {
                if self.tolerate(self.alloc.release_persistent(), "release_persistent")?
                    && !self.unmap_refused_in_step()
                {
                    self.nothing_releasable(
                        |s| s.residency == Residency::Persistent,
                        "release_persistent",
                    )?;
                }
            }
            Op::ReleaseStream { stream } => {
                let s = self.stream(stream)?;
                if self.tolerate(self.alloc.release_stream(s), "release_stream")?
                    && !self.unmap_refused_in_step()
                {
                    self.nothing_releasable(|seg| seg.stream == s, "release_stream")?;
                }
            }
            Op::DestroyStream { stream: 0 } => {
                let r = self.alloc.destroy_stream(StreamId::DEFAULT);
                ensure!(
                    matches!(r, Err(AllocError::Device(DeviceError::Unsupported(_)))),
                    "destroying the default stream must be refused, got {r:?}"
                );
            }
            Op::DestroyStream { stream } => {
                if let Some(s) = self.slots[usize::from(stream)]
                    && self.scope.as_ref().is_some_and(|o| o.scope.stream() == s)
                {
                    // A scope ends before its stream is destroyed.
                    self.exit_scope()?;
                }
                if let Some(s) = self.slots[usize::from(stream)].take() {
                    let r = self.alloc.destroy_stream(s);
                    if !self.tolerate(r, "destroy_stream")? && self.dev.has_stream(s) {
                        // Refused before the stream went: it stays the slot's.
                        self.slots[usize::from(stream)] = Some(s);
                        return Ok(());
                    }
                    self.gone.push(s);
                    ensure!(!self.dev.live_streams().contains(&s), "{s} still exists");
                    // The second allocator learns of it (and returns what it cached for it).
                    match self.other.release_stream(s) {
                        Ok(()) | Err(AllocError::UnknownStream(_)) => {}
                        Err(e) => return Err(format!("second release_stream: {e}")),
                    }
                    let r = self.other.alloc(4096, s);
                    ensure!(
                        matches!(r, Err(AllocError::UnknownStream(_))),
                        "the second allocator allocated on destroyed {s}: {r:?}"
                    );
                    if !self.unmap_refused_in_step() {
                        self.nothing_releasable(|seg| seg.stream == s, "destroy_stream")?;
                    }
                }
            }
            Op::SetConfig { config: i } => {
                let c = config(i);
                self.granularity = self.granularity.min(c.sizing.min_block_size);
                self.alloc.set_config(c.clone()).map_err(|e| format!("set_config: {e}"))?;
                ensure!(*self.alloc.config() == c, "set_config did not take");
            }
            Op::FailNthMalloc { n } => {
                let n = (n > 0).then_some(u64::from(n));
                self.dev.fail_nth_malloc(n);
                self.dev.fail_nth_vm_create(n);
                self.dev.fail_nth_vm_map(n);
                self.nth_fires_at = n.map(|n| self.reserve_calls() + n);
            }
            Op::FailMallocsAbove { limit } => {
                self.dev.fail_mallocs_above(limit);
                self.fail_above = limit;
            }
            Op::FailNth { fault, n } => {
                let n = (n > 0).then_some(u64::from(n));
                match fault {
                    NthFault::Malloc => {
                        self.dev.fail_nth_malloc(n);
                        self.nth_fires_at = n.map(|n| self.reserve_calls() + n);
                    }
                    NthFault::VmCreate => self.dev.fail_nth_vm_create(n),
                    NthFault::VmMap => self.dev.fail_nth_vm_map(n),
                    NthFault::VmUnmap => self.dev.fail_nth_vm_unmap(n),
                    NthFault::EventCreate => {
                        self.dev.fail_nth_event_create(n);
                        self.event_create_armed = n.is_some();
                    }
                }
            }
            Op::VirtualRoom { room } => {
                let room = match room {
                    Some(room) => self.dev.virtual_bytes().saturating_add(room),
                    None => default_virtual_capacity(&self.dev),
                };
                self.dev.set_virtual_capacity(room);
            }
            Op::FailEventQueries { on } => {
                let mut f = self.event_faults.get();
                f[0] = on;
                self.set_event_faults(f);
            }
            Op::FailEvents { fault, on } => {
                let mut f = self.event_faults.get();
                let i = match fault {
                    EventFault::Records => 1,
                    EventFault::Waits => 2,
                    EventFault::Panic => 3,
                };
                f[i] = on;
                self.set_event_faults(f);
            }
            Op::Inspect { summary } => self.inspect(summary)?,
            Op::ScopeEnter { stream, named } => {
                self.exit_scope()?;
                let s = self.stream(stream)?;
                let alloc = self.alloc;
                let scope = if named { alloc.named_scope(SCOPE_NAME, s) } else { alloc.scope(s) };
                self.runs += 1;
                let config = alloc.config();
                self.scope = Some(OpenScope { scope, run: self.runs, named, config });
            }
            Op::ScopeAlloc { bytes } => self.scope_alloc(bytes)?,
            Op::ScopeBurst { n, seed } => self.scope_burst(n, seed)?,
            Op::ScopeExit => self.exit_scope()?,
            Op::Other { index, action } => self.other_op(index, action)?,
            Op::ScopeForget { bytes, used, stream } => self.scope_forget(bytes, used, stream)?,
            Op::Capture { stream, fork, bytes, launches, panics } => {
                // The event faults are off during a capture (the refused calls' errors would
                // end it halfway); the faults counted down stay armed.
                let armed = self.event_faults.get();
                self.set_event_faults([false; 4]);
                let r = self.capture(stream, fork, bytes, launches, panics);
                self.set_event_faults(armed);
                r?;
            }
        }
        Ok(())
    }

    /// [`Op::Capture`]: a capture whole in one step, forked into a second stream or not. A
    /// forked capture replayed twice keeps the side stream's block past its graph, writes it
    /// there outside any capture and frees it, then captures again into the same pool, forked
    /// into the same stream (which may be handed that block), and replays on both streams: the
    /// sanitizer checks that the second graph's replays are ordered after that write. With
    /// `panics`, the capture's body panics instead ([`Harness::capture_panicking`]).
    fn capture(
        &mut self,
        stream: u8,
        fork: u8,
        bytes: u64,
        launches: u8,
        panics: bool,
    ) -> Result<(), String> {
        let slot = stream.max(1);
        let s = self.stream(slot)?;
        let t = match fork {
            f if f != 0 && f != slot => Some(self.stream(f)?),
            _ => None,
        };
        let a = self.alloc;
        // Every other forked capture reuses, after the join, the block the side stream used
        // (`graph_capture_record_stream_reuse`); the others hold it until the graph goes.
        let reuse = t.is_some() && (stream ^ fork) & 1 == 1;
        if a.config().graph_capture_record_stream_reuse != reuse {
            let mut c = (*a.config()).clone();
            c.graph_capture_record_stream_reuse = reuse;
            a.set_config(c).map_err(|e| format!("set_config: {e}"))?;
        }
        // One graph pool in three never splits a block (`PoolOptions::no_split`).
        let no_split = bytes.wrapping_add(u64::from(stream)) % 3 == 0;
        let options = PoolOptions::default().with_no_split(no_split);
        let pool = a.new_pool(options).map_err(|e| format!("new_pool: {e}"))?;
        if panics {
            self.capture_panicking(s, t, &pool, bytes, launches % 2 == 1)?;
            return self.graph_pool_gone(pool);
        }
        if !self.tolerate(a.begin_capture(s, Some(&pool)), &format!("begin_capture on {s}"))? {
            // Refused by an injected fault: no capture, and the pool serves nothing.
            ensure!(!a.is_capturing(s), "{s} captures after a refused begin_capture");
            return self.graph_pool_gone(pool);
        }
        let second = t.is_some() && launches == 2;
        let mut kept = None;
        let alloc = |on: StreamId| captured_alloc(a, bytes, on);
        // A captured kernel writing `dst` (after reading `src`): replayable, with no body (the
        // device is unbacked); the sanitizer checks its accesses at capture and at each replay.
        let kernel = |src: Option<&Buffer<SimDevice>>, dst: &Buffer<SimDevice>| {
            let mut acc =
                vec![Access { ptr: dst.ptr(), bytes: dst.len(), kind: AccessKind::Write }];
            acc.extend(src.map(|b| Access {
                ptr: b.ptr(),
                bytes: b.len(),
                kind: AccessKind::Read,
            }));
            Kernel::replayable("captured", acc, |_| {})
        };
        let mut bufs = Vec::new();
        for _ in 0..2 {
            let Some(b) = alloc(s)? else { break };
            self.dev
                .launch(s, kernel(bufs.last(), &b))
                .map_err(|e| dev_err("captured launch", e))?;
            bufs.push(b);
        }
        if let Some(t) = t {
            self.order_after(t, s)?; // the fork
            ensure!(
                a.is_capturing(t),
                "{t} waited on an event of {s}'s capture but is not capturing"
            );
            if let Some(b) = alloc(t)? {
                if let Some(last) = bufs.last() {
                    // Announced with `use_on` (ordered inside the capture by an event edge)
                    // or `record_stream` (recorded only: the fork ordered it).
                    let announced = match (stream ^ fork) & 2 != 0 {
                        true => last.use_on(t, AccessKind::Read),
                        false => a.record_stream(last, t),
                    };
                    if self.tolerate_in_capture(announced, "use of a captured block")? {
                        let k = kernel(Some(last), &b);
                        self.dev.launch(t, k).map_err(|e| dev_err("forked", e))?;
                    }
                }
                match second {
                    true => kept = Some(b), // outlives the graph
                    false => drop(b),       // back into the graph's pool, on `t`
                }
            }
            if reuse && bufs.len() == 2 {
                drop(bufs.pop()); // used on `t`: waits for the join
            }
            self.order_after(s, t)?; // the join
            if let Some(b) = alloc(s)? {
                // With the reuse, maybe the block `t` used: ordered after its read now.
                self.dev.launch(s, kernel(None, &b)).map_err(|e| dev_err("after the join", e))?;
                bufs.push(b);
            }
        }
        // Unforked, the other stream allocates four times the captured size meanwhile, outside
        // the capture: its growth, page moves or out-of-memory ladder run while the capture
        // refuses every host wait and event query. The buffer lives on as any other.
        if t.is_none() {
            let o = self.stream(3 - slot)?;
            self.alloc_op(bytes.saturating_mul(4), o, Residency::Transient)?;
        }
        if !bufs.is_empty() {
            drop(bufs.remove(0)); // freed during the capture: reused by the capture only
        }
        let graph = match a.end_capture(s) {
            Ok(graph) => graph,
            Err(_) if self.capture_broken_by_fault() => {
                // Invalidated: no graph. The capture is over all the same.
                self.note_excused();
                for u in std::iter::once(s).chain(t) {
                    ensure!(!a.is_capturing(u), "{u} still captures after a failed end");
                }
                drop((bufs, kept));
                return self.graph_pool_gone(pool);
            }
            Err(e) => return Err(format!("end_capture on {s}: {e}")),
        };
        ensure!(t.is_none_or(|t| !a.is_capturing(t)), "a joined stream outlived its capture");
        for _ in 0..launches {
            graph.launch(s).map_err(|e| format!("graph launch: {e}"))?;
        }
        drop(bufs);
        drop(graph); // waits for its launches, then lets go of what it held
        if let (Some(t), Some(b)) = (t, kept) {
            self.capture_again(&pool, s, t, b, &kernel)?;
        }
        self.graph_pool_gone(pool)
    }

    /// [`Op::Capture`] with `panics`: the capture's work (two allocations from the graph's
    /// pool with captured kernels, the first freed; `t` forked in, allocating and writing,
    /// joined back when `join`) as the body of `Allocator::capture`, which then panics. The
    /// panic is caught here, with the panic hook silenced meanwhile (libFuzzer's aborts): a
    /// panic of anything else goes on. The capture must be over for both streams.
    fn capture_panicking(
        &self,
        s: StreamId,
        t: Option<StreamId>,
        pool: &MemPool<SimDevice>,
        bytes: u64,
        join: bool,
    ) -> Result<(), String> {
        let a = self.alloc;
        let alloc = |on: StreamId| captured_alloc(a, bytes, on);
        let write = |b: &Buffer<SimDevice>, on: StreamId| {
            let acc = vec![Access { ptr: b.ptr(), bytes: b.len(), kind: AccessKind::Write }];
            self.dev.launch(on, Kernel::replayable("captured", acc, |_| {}))
        };
        let body = || -> Result<(), String> {
            let mut bufs = Vec::new();
            for _ in 0..2 {
                let Some(b) = alloc(s)? else { break };
                write(&b, s).map_err(|e| dev_err("captured launch", e))?;
                bufs.push(b);
            }
            if let Some(t) = t {
                self.order_after(t, s)?; // the fork
                if let Some(b) = alloc(t)? {
                    write(&b, t).map_err(|e| dev_err("forked launch", e))?;
                    bufs.push(b);
                }
                if join {
                    self.order_after(s, t)?;
                }
            }
            if !bufs.is_empty() {
                drop(bufs.remove(0)); // freed in the body; the rest as the panic unwinds
            }
            std::panic::panic_any(BodyPanic)
        };
        // One swap at a time in the process (tests run harnesses on several threads), so each
        // puts back the hook it found.
        static HOOK_SWAP: Mutex<()> = Mutex::new(());
        let swap = HOOK_SWAP.lock().unwrap_or_else(PoisonError::into_inner);
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            a.capture(s, Some(pool), body)
        }));
        std::panic::set_hook(hook);
        drop(swap);
        match caught {
            Err(p) if p.is::<BodyPanic>() => {}
            Err(p) => std::panic::resume_unwind(p),
            Ok(Err(_)) if self.capture_broken_by_fault() => self.note_excused(),
            Ok(Err(e)) => return Err(format!("capture on {s}: {e}")),
            Ok(Ok((_, r))) => r?, // the body failed before its panic
        }
        for u in std::iter::once(s).chain(t) {
            ensure!(!a.is_capturing(u), "{u} still captures after the body on {s} panicked");
        }
        Ok(())
    }

    /// The end of [`Op::Capture`]: the graph's pool serves nothing more. Emptied, it holds
    /// nothing, and its device calls join the count the device's must match.
    fn graph_pool_gone(&mut self, pool: MemPool<SimDevice>) -> Result<(), String> {
        if !self.tolerate(pool.empty_cache(), "empty_cache of a graph's pool")? {
            // A refused unmap (each fault refuses one call): the pages stay in its range,
            // and the next try gives them back.
            pool.empty_cache().map_err(|e| format!("empty_cache of a graph's pool again: {e}"))?;
        }
        let left = pool.snapshot();
        ensure!(left.is_empty(), "the graph's pool kept {left:?} once the graph was gone");
        let st = pool.stats();
        self.pool_calls.0 += st.num_device_alloc;
        self.pool_calls.1 += st.num_device_free;
        Ok(())
    }

    /// [`Op::Other`]: the second allocator, and buffers given to the wrong allocator.
    fn other_op(&mut self, index: u8, action: u8) -> Result<(), String> {
        let pick = |n: usize| (n > 0).then(|| usize::from(index) % n);
        match action % 5 {
            0 => {
                let bytes = BURST_SIZES[usize::from(index) % BURST_SIZES.len()];
                let s = self.stream(index / 8 % STREAM_SLOTS)?;
                match self.other.alloc(bytes, s) {
                    Ok(b) => self.others.push(b),
                    Err(AllocError::OutOfMemory(_)) => {} // the device is shared
                    Err(e) if excused(&e) => self.note_excused(),
                    Err(e) => return Err(format!("second alloc of {bytes} on {s}: {e}")),
                }
            }
            1 => {
                if let Some(i) = pick(self.others.len()) {
                    drop(self.others.remove(i));
                }
            }
            2 => {
                let Some(i) = pick(self.others.len()) else { return Ok(()) };
                let s = self.stream(index % STREAM_SLOTS)?;
                let b = &self.others[i];
                let kind = if index & 8 == 0 { AccessKind::Read } else { AccessKind::Write };
                if !self.tolerate(b.use_on(s, kind), "use_on")? {
                    return Ok(()); // not ordered: no kernel
                }
                let kernel = Kernel {
                    name: "touch-other",
                    accesses: vec![Access { ptr: b.ptr(), bytes: b.len(), kind }],
                    sleep: Duration::from_micros(u64::from(SLEEPS_US[usize::from(index) % 8])),
                    body: None,
                    replay: None,
                };
                self.dev.launch(s, kernel).map_err(|e| dev_err("launch", e))?;
            }
            3 => {
                // Alternately a buffer of the first allocator to the second and back.
                let (buf, wrong) = match index % 2 {
                    0 => match pick(self.live.len()) {
                        Some(i) => (self.live.remove(i).buf, self.other),
                        None => return Ok(()),
                    },
                    _ => match pick(self.others.len()) {
                        Some(i) => (self.others.remove(i), self.alloc),
                        None => return Ok(()),
                    },
                };
                let r = wrong.free_batch(vec![buf]);
                ensure!(
                    r == Err(AllocError::ForeignBuffer),
                    "free_batch of a foreign buffer: {r:?}"
                );
            }
            _ => {
                let s = self.stream(index % STREAM_SLOTS)?;
                let refused = |r: Result<(), AllocError>| r == Err(AllocError::ForeignBuffer);
                if let Some(i) = pick(self.live.len()) {
                    let b = &self.live[i].buf;
                    ensure!(refused(self.other.record_stream(b, s)), "record_stream accepted");
                    ensure!(refused(self.other.use_on(b, s, AccessKind::Read)), "use_on accepted");
                }
                if let Some(i) = pick(self.others.len()) {
                    let b = &self.others[i];
                    ensure!(refused(self.alloc.record_stream(b, s)), "record_stream accepted");
                    ensure!(refused(self.alloc.use_on(b, s, AccessKind::Write)), "use_on accepted");
                }
            }
        }
        Ok(())
    }

    /// [`Op::ScopeForget`]: a bound buffer, maybe read on another stream, then forgotten.
    fn scope_forget(&mut self, bytes: u64, used: bool, stream: u8) -> Result<(), String> {
        let other = self.stream(stream)?;
        let Some(open) = &self.scope else { return Ok(()) };
        let calls_before = self.reserve_calls();
        let ooms_before = self.alloc.stats().num_ooms;
        let b = match open.scope.alloc(bytes) {
            Ok(b) => b,
            Err(e) => return self.scope_alloc_failed(open, bytes, e, calls_before, ooms_before),
        };
        if bytes > 0 {
            self.check_scoped(open, bytes, Scoped::of_bound(&b))?;
        }
        let s = open.scope.stream();
        if used && bytes > 0 && other != s {
            self.order_after(other, s)?;
            let kernel = Kernel {
                name: "read-forgotten",
                accesses: vec![Access { ptr: b.ptr(), bytes, kind: AccessKind::Read }],
                sleep: Duration::from_micros(5),
                body: None,
                replay: None,
            };
            self.dev.launch(other, kernel).map_err(|e| dev_err("launch", e))?;
            open.scope.record_stream(&b, other).map_err(|e| format!("record_stream: {e}"))?;
        }
        std::mem::forget(b);
        Ok(())
    }

    /// Drops the open scope, if any: its live unbound buffers are counted as escapes, and an
    /// anonymous scope touches no plan counter.
    fn exit_scope(&mut self) -> Result<(), String> {
        let Some(open) = self.scope.take() else { return Ok(()) };
        let escaping =
            self.live.iter().filter(|l| l.run == Some(open.run) && l.buf.block_size() > 0).count()
                as u64;
        let before = self.alloc.stats();
        drop(open.scope);
        let after = self.alloc.stats();
        let escapes = after.scope_escapes - before.scope_escapes;
        ensure!(escapes == escaping, "{escapes} escapes counted, {escaping} unbound buffers live");
        let plan = |s: &tidepool::MemoryStats| (s.plan_hits, s.plan_misses, s.plan_fallbacks);
        ensure!(
            open.named || plan(&before) == plan(&after),
            "an anonymous scope moved the plan counters: {:?} -> {:?}",
            plan(&before),
            plan(&after)
        );
        Ok(())
    }

    /// Checks a buffer `Scope::alloc` or `alloc_unbound` made for `bytes` (not zero).
    fn check_scoped(&self, open: &OpenScope<'_>, bytes: u64, b: Scoped) -> Result<(), String> {
        let (Some(rounded), Some(now)) =
            (open.config.sizing.round(bytes), self.alloc.config().sizing.round(bytes))
        else {
            return Err(format!("a scoped request of {bytes} bytes beyond MAX_REQUEST succeeded"));
        };
        let s = open.scope.stream();
        let align = self.granularity;
        // The scope rounds with its own configuration; pool blocks come from the allocator's.
        ensure!(
            b.len == bytes
                && b.stream == s
                && b.size >= rounded.min(now)
                && b.size.is_multiple_of(align)
                && b.ptr != DeviceAddr::NULL
                && b.ptr.0.is_multiple_of(align),
            "bad scoped buffer for {bytes} bytes (rounded {rounded}) on {s}: {b:?}"
        );
        ensure!(!b.planned || open.named, "an anonymous scope served a planned buffer: {b:?}");
        ensure!(!b.planned || b.size == rounded, "a planned slice of the wrong size: {b:?}");
        Ok(())
    }

    /// `alloc_unbound` in the open scope; the buffer joins the live list.
    fn scope_alloc(&mut self, bytes: u64) -> Result<(), String> {
        let Some(open) = &self.scope else { return Ok(()) };
        let s = open.scope.stream();
        let calls_before = self.reserve_calls();
        let ooms_before = self.alloc.stats().num_ooms;
        let made = open.scope.alloc_unbound(bytes);
        let run = Some(open.run);
        match made {
            Ok(b) if bytes == 0 => {
                ensure!(
                    b.ptr() == DeviceAddr::NULL && b.block_size() == 0 && b.stream() == s,
                    "a zero-byte scoped buffer must be empty at NULL on {s}: {b:?}"
                );
                let users = vec![s];
                let (residency, kind) = (Some(Residency::Transient), PoolKind::Small);
                self.live.push(Live { buf: b, residency, kind, users, run });
            }
            Ok(b) => {
                self.check_scoped(open, bytes, Scoped::of(&b))?;
                let config = if b.is_planned() { open.config.clone() } else { self.alloc.config() };
                let kind = config.sizing.kind(config.sizing.round(bytes).unwrap_or(bytes));
                let users = vec![s];
                let residency = Self::placed(&config, kind, Residency::Transient, &self.dev);
                self.live.push(Live { buf: b, residency, kind, users, run });
            }
            Err(e) => self.scope_alloc_failed(open, bytes, e, calls_before, ooms_before)?,
        }
        Ok(())
    }

    /// A scoped allocation of `bytes` failed with `e`: it must have a reason.
    fn scope_alloc_failed(
        &self,
        open: &OpenScope<'_>,
        bytes: u64,
        e: AllocError,
        calls_before: u64,
        ooms_before: u64,
    ) -> Result<(), String> {
        let s = open.scope.stream();
        match e {
            AllocError::InvalidSize { requested } => {
                let fits = open.config.sizing.round(bytes).is_some()
                    && self.alloc.config().sizing.round(bytes).is_some();
                ensure!(
                    !fits && requested == bytes,
                    "InvalidSize({requested}) for a valid scoped request of {bytes} bytes"
                );
            }
            AllocError::OutOfMemory(report) => {
                // (Making a plan's region may fail first, and count an OOM of its own.)
                let ooms = self.alloc.stats().num_ooms;
                ensure!(
                    ooms > ooms_before || report.rejected,
                    "num_ooms went {ooms_before} -> {ooms}"
                );
                ensure!(
                    report.requested == bytes && report.stream == s,
                    "OOM report does not describe the scoped request ({bytes} on {s}): {report:?}"
                );
                self.explain_oom(&report, calls_before)?;
            }
            e if excused(&e) => self.note_excused(),
            e => return Err(format!("scoped alloc of {bytes} bytes on {s}: unexpected error {e}")),
        }
        Ok(())
    }

    /// `n` bound allocations in the open scope, freed in an order drawn from `seed` (some
    /// between the allocations, the rest at the end). Each new buffer must be inside a live
    /// device segment and an allocated transient block of the scope's stream, and overlap no
    /// live buffer, bound or not.
    fn scope_burst(&self, n: u8, seed: u32) -> Result<(), String> {
        let Some(open) = &self.scope else { return Ok(()) };
        let scope = &open.scope;
        let mut rng = Burst::new(seed);
        let outside: Vec<(u64, u64)> = self
            .live
            .iter()
            .map(|l| &l.buf)
            .chain(&self.others)
            .filter(|b| b.block_size() > 0)
            .map(|b| (b.ptr().0, b.block_size()))
            .collect();
        let mut held: Vec<ScopedBuffer<'_, SimDevice>> = Vec::new();
        for _ in 0..n {
            let bytes = BURST_SIZES[rng.below(BURST_SIZES.len())];
            let calls_before = self.reserve_calls();
            let ooms_before = self.alloc.stats().num_ooms;
            match scope.alloc(bytes) {
                Ok(b) => {
                    self.check_scoped(open, bytes, Scoped::of_bound(&b))?;
                    let (lo, hi) = (b.ptr().0, b.ptr().0 + b.block_size());
                    let segs = self.dev.live_segments();
                    ensure!(
                        segs.iter().any(|&(p, len)| p.0 <= lo && hi <= p.0 + len)
                            || mapped(&self.dev.live_mappings(), lo, hi),
                        "bound {b:?} is in no live device segment or mapping: {segs:x?}"
                    );
                    let spans = outside
                        .iter()
                        .copied()
                        .chain(held.iter().map(|h| (h.ptr().0, h.block_size())));
                    for (p, len) in spans {
                        ensure!(hi <= p || p + len <= lo, "bound {b:?} overlaps [{p:#x}, +{len})");
                    }
                    self.check_in_block(
                        b.ptr(),
                        b.block_size(),
                        b.stream(),
                        &self.alloc.snapshot(),
                    )
                    .map_err(|e| format!("bound {b:?}: {e}"))?;
                    held.push(b);
                }
                Err(e) => self.scope_alloc_failed(open, bytes, e, calls_before, ooms_before)?,
            }
            if !held.is_empty() && rng.below(3) == 0 {
                drop(held.remove(rng.below(held.len())));
            }
        }
        while !held.is_empty() {
            drop(held.remove(rng.below(held.len())));
        }
        Ok(())
    }

    /// The residency the segment of a block of `kind` asked for with `residency` must have:
    /// small blocks count as transient, large ones may sit in either residency's free space on
    /// ordinary segments and in their own residency's range over expandable segments.
    fn placed(
        config: &Config,
        kind: PoolKind,
        residency: Residency,
        dev: &SimDevice,
    ) -> Option<Residency> {
        match kind {
            PoolKind::Small => Some(Residency::Transient),
            _ if config.expandable_segments && dev.supports_virtual_memory() => Some(residency),
            _ => None,
        }
    }

    /// Allocates and checks the outcome against the request.
    fn alloc_op(&mut self, bytes: u64, s: StreamId, residency: Residency) -> Result<(), String> {
        let config = self.alloc.config();
        let sizing = &config.sizing;
        let rounded = sizing.round(bytes);
        let calls_before = self.reserve_calls();
        let ooms_before = self.alloc.stats().num_ooms;
        // One request in four (sizes ≡ 3 mod 4) asks for an alignment from 512 B to 1 MiB
        // (within every configuration's smallest segment) through `alloc_aligned_in`.
        let align = match bytes % 4 {
            3 => 1u64 << (9 + (bytes >> 2) % 12),
            _ => 0,
        };
        let made = match align {
            0 => self.alloc.alloc_in(bytes, s, residency),
            _ => self.alloc.alloc_aligned_in(bytes, align, s, residency),
        };
        match made {
            Ok(b) if bytes == 0 => {
                ensure!(
                    b.ptr() == DeviceAddr::NULL && b.block_size() == 0 && b.is_empty(),
                    "a zero-byte buffer must be empty at NULL: {b:?}"
                );
                ensure!(b.stream() == s, "zero-byte buffer on {} not {s}", b.stream());
                let (users, residency) = (vec![s], Some(Residency::Transient));
                self.live.push(Live { buf: b, residency, kind: PoolKind::Small, users, run: None });
            }
            Ok(b) => {
                let Some(rounded) = rounded else {
                    return Err(format!("a request of {bytes} bytes beyond MAX_REQUEST succeeded"));
                };
                let granularity = self.granularity;
                ensure!(
                    b.len() == bytes
                        && b.stream() == s
                        && b.block_size() >= rounded
                        && b.block_size().is_multiple_of(granularity)
                        && b.ptr() != DeviceAddr::NULL
                        && b.ptr().0.is_multiple_of(granularity.max(align)),
                    "bad buffer for {bytes} bytes (rounded {rounded}, align {align}) on {s}: {b:?}"
                );
                let kind = sizing.kind(rounded);
                let residency = Self::placed(&config, kind, residency, &self.dev);
                self.live.push(Live { buf: b, residency, kind, users: vec![s], run: None });
            }
            Err(AllocError::InvalidSize { requested }) => {
                ensure!(
                    rounded.is_none() && requested == bytes,
                    "InvalidSize({requested}) for a valid request of {bytes} bytes"
                );
            }
            Err(AllocError::OutOfMemory(report)) => {
                // A rejection (`throw_on_cudamalloc_oom`) is not counted as an out-of-memory.
                let ooms = self.alloc.stats().num_ooms;
                let counted = ooms_before + u64::from(!report.rejected);
                ensure!(ooms == counted, "num_ooms went {ooms_before} -> {ooms}: {report:?}");
                ensure!(
                    report.requested == bytes
                        && Some(report.rounded) == rounded
                        && report.stream == s,
                    "OOM report does not describe the request ({bytes} on {s}): {report:?}"
                );
                self.explain_oom(&report, calls_before)?;
            }
            Err(e) if excused(&e) => self.note_excused(),
            Err(e) => return Err(format!("alloc of {bytes} bytes on {s}: unexpected error {e}")),
        }
        Ok(())
    }

    /// An out-of-memory error must have a cause the harness can see.
    fn explain_oom(&self, r: &OomReport, calls_before: u64) -> Result<(), String> {
        if r.rejected {
            // Refused before the device was asked: only past the cap (which the private pools
            // share: `family_reserved`), and only when asked to.
            let cap = r.limit.unwrap_or(r.device_total);
            ensure!(
                self.alloc.config().throw_on_oom && r.family_reserved + r.segment > cap,
                "a rejection that throw_on_cudamalloc_oom does not explain: {r:?}"
            );
            return Ok(());
        }
        if self.vm_failures() > self.vm_fail_mark.get() {
            // A physical creation or a mapping was refused in this step (an injected fault, or
            // the device full: for expandable segments the device refuses page by page).
            return Ok(());
        }
        let calls_after = self.reserve_calls();
        let nth_fired = self.nth_fires_at.is_some_and(|c| calls_before < c && c <= calls_after);
        let above = self.fail_above.is_some_and(|limit| r.segment > limit);
        let device_full = r.segment > r.device_free;
        let limited = r.over_limit();
        ensure!(
            nth_fired || above || device_full || limited,
            "unexplained out-of-memory (no injected fault, device not full, under the limit): {r:?}"
        );
        Ok(())
    }

    /// The second capture of [`Harness::capture`]'s forked case: `b` (of `pool`, on `t`) is
    /// written on `t` outside any capture, by a kernel that takes a while, and freed; then `s`
    /// is captured into `pool` again, forked into `t`, which allocates `b`'s size and writes
    /// it, and the graph is replayed on `s` and then on `t`.
    fn capture_again(
        &mut self,
        pool: &MemPool<SimDevice>,
        s: StreamId,
        t: StreamId,
        b: Buffer<SimDevice>,
        kernel: &CapturedKernel,
    ) -> Result<(), String> {
        let a = self.alloc;
        let write = Kernel {
            name: "after the graph",
            accesses: vec![Access { ptr: b.ptr(), bytes: b.len(), kind: AccessKind::Write }],
            sleep: Duration::from_micros(200),
            body: None,
            replay: None,
        };
        self.dev.launch(t, write).map_err(|e| dev_err("launch", e))?;
        let bytes = b.len();
        drop(b); // on its own stream: cached in the pool at once
        if !self
            .tolerate(a.begin_capture(s, Some(pool)), &format!("second begin_capture on {s}"))?
        {
            ensure!(!a.is_capturing(s), "{s} captures after a refused begin_capture");
            return Ok(());
        }
        self.order_after(t, s)?; // the fork
        let made = match a.alloc(bytes.max(1), t) {
            Ok(c) => {
                self.dev.launch(t, kernel(None, &c)).map_err(|e| dev_err("forked again", e))?;
                Some(c)
            }
            Err(AllocError::OutOfMemory(_)) => None,
            Err(e) => return Err(format!("alloc of {bytes} in the second capture: {e}")),
        };
        self.order_after(s, t)?; // the join
        let graph = match a.end_capture(s) {
            Ok(graph) => graph,
            Err(_) if self.capture_broken_by_fault() => {
                self.note_excused();
                for u in [s, t] {
                    ensure!(!a.is_capturing(u), "{u} still captures after a failed end");
                }
                return Ok(());
            }
            Err(e) => return Err(format!("second end_capture on {s}: {e}")),
        };
        for on in [s, t] {
            graph.launch(on).map_err(|e| format!("second graph's launch on {on}: {e}"))?;
        }
        drop(made);
        drop(graph);
        Ok(())
    }

    /// Orders `to`'s later work after `from`'s work so far (event + device-side wait).
    /// The harness's own event (made before any fault was armed) is recorded and waited on
    /// with the event faults off: they refuse only the allocators' calls.
    fn order_after(&self, to: StreamId, from: StreamId) -> Result<(), String> {
        let e = self.event;
        let armed = self.event_faults.get();
        self.set_event_faults([false; 4]);
        let r = match self.dev.record_event(e, from) {
            Ok(()) => self.dev.wait_event(to, e).map_err(|e| dev_err("wait_event", e)),
            // A destroyed stream was drained: there is nothing to wait for.
            Err(DeviceError::UnknownStream(_)) => Ok(()),
            Err(err) => Err(dev_err("record_event", err)),
        };
        self.set_event_faults(armed);
        r
    }

    /// Arms the event faults `[queries, records, waits, panics]` on the device.
    fn set_event_faults(&self, f: [bool; 4]) {
        self.dev.fail_event_queries(f[0]);
        self.dev.fail_event_records(f[1]);
        self.dev.fail_event_waits(f[2]);
        self.dev.panic_on_faults(f[3]);
        self.event_faults.set(f);
    }

    /// Counts an allocator's error for an injected fault (each is followed by the usual
    /// checks).
    fn note_excused(&self) {
        EXCUSED.with(|c| c.set(c.get() + 1));
    }

    /// Whether a capture of this step may have been broken by an injected fault: an event
    /// creation refusal is armed, and the device refused a call because a capture was
    /// underway (the allocator, left with no event to order a use by, waited for the whole
    /// device instead, which CUDA refuses during a capture and which invalidates it).
    fn capture_broken_by_fault(&self) -> bool {
        self.event_create_armed
            && self.dev.graph_counters().refused_in_capture > self.refused_in_capture
    }

    /// [`Harness::tolerate`] in a capture: also a failure of a capture a fault broke, and the
    /// refusal of a device-wide wait that stood in for a refused event creation.
    fn tolerate_in_capture(&self, r: Result<(), AllocError>, what: &str) -> Result<bool, String> {
        // The allocator refuses a device-wide wait during a capture itself (`Guarded`).
        let unsupported = |e: &AllocError| {
            matches!(e, AllocError::Device(DeviceError::Driver { code, .. })
                if *code == DeviceError::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        };
        match r {
            Err(e)
                if self.capture_broken_by_fault() || self.event_create_armed && unsupported(&e) =>
            {
                self.note_excused();
                Ok(false)
            }
            r => self.tolerate(r, what),
        }
    }

    /// Unmaps the device refused so far (only injected).
    fn unmaps_refused(&self) -> u64 {
        self.dev.vm_counters().failed_unmaps
    }

    /// The outcome of an allocator call that changes no model state of its own: `Ok(true)` if
    /// it succeeded, `Ok(false)` if it returned the error of an injected fault (counted), the
    /// failure otherwise.
    fn tolerate(&self, r: Result<(), AllocError>, what: &str) -> Result<bool, String> {
        match r {
            Ok(()) => Ok(true),
            Err(e) if excused(&e) => {
                self.note_excused();
                Ok(false)
            }
            Err(e) => Err(format!("{what}: {e}")),
        }
    }

    /// Whether a fault refused an unmap in this step (a release may then keep what it could
    /// not unmap: pages stay mapped in their range, free, until a later release).
    fn unmap_refused_in_step(&self) -> bool {
        self.unmaps_refused() > self.unmaps_refused
    }

    /// A kernel over live buffer `i` on `s`, after the user-side stream-order protocol.
    fn launch(&mut self, i: usize, s: StreamId, write: bool, sleep_us: u8) -> Result<(), String> {
        if self.live[i].buf.is_empty() {
            return Ok(());
        }
        let others: Vec<StreamId> =
            self.live[i].users.iter().copied().filter(|&u| u != s).collect();
        for u in others {
            self.order_after(s, u)?;
        }
        if s != self.live[i].buf.stream()
            && !self.tolerate(self.alloc.record_stream(&self.live[i].buf, s), "record_stream")?
        {
            // Refused: the use cannot be announced, so the kernel is not launched.
            return Ok(());
        }
        let l = &mut self.live[i];
        if !l.users.contains(&s) {
            l.users.push(s);
        }
        let kind = if write { AccessKind::Write } else { AccessKind::Read };
        let kernel = Kernel {
            name: "touch",
            accesses: vec![Access { ptr: l.buf.ptr(), bytes: l.buf.len(), kind }],
            sleep: Duration::from_micros(u64::from(sleep_us)),
            body: None,
            replay: None,
        };
        self.dev.launch(s, kernel).map_err(|e| dev_err("launch", e))
    }

    /// After a release: no segment selected by `which` (expandable runs included) is left with
    /// only free blocks.
    fn nothing_releasable(
        &self,
        which: impl Fn(&SegmentInfo) -> bool,
        what: &str,
    ) -> Result<(), String> {
        let kept = self.initial[0].map(|(a, _)| a);
        for seg in self.alloc.snapshot().iter().filter(|s| which(s) && Some(s.address) != kept) {
            ensure!(
                seg.blocks.iter().any(|b| b.state != BlockState::Free),
                "{what} left the free segment at {} ({} bytes, {}) cached",
                seg.address,
                seg.size,
                seg.stream
            );
        }
        Ok(())
    }

    fn inspect(&self, summary: bool) -> Result<(), String> {
        if summary {
            ensure!(!self.alloc.memory_summary().is_empty(), "empty memory_summary");
        }
        let f = self.alloc.stats().fragmentation();
        ensure!((0.0..=1.0).contains(&f), "fragmentation {f} outside [0, 1]");
        self.alloc.reset_peak_stats();
        let b = self.alloc.stats().blocks;
        for g in stat_groups(&b) {
            for s in cells(g) {
                ensure!(s.peak == s.current, "reset_peak_stats left peak {} > current", s.peak);
            }
        }
        Ok(())
    }

    /// Everything that must hold between any two steps.
    fn check(&self) -> Result<(), String> {
        self.alloc.check_invariants()?;
        // A gone stream whose fast-path slot (`id % 64`) now serves a live stream of the
        // program: a request on it is refused, not served from the newer stream's lane.
        for &g in &self.gone {
            if self.slots.iter().flatten().any(|s| s.0 % FAST_SLOTS == g.0 % FAST_SLOTS) {
                let r = self.alloc.alloc(4096, g);
                ensure!(
                    matches!(r, Err(AllocError::UnknownStream(x)) if x == g),
                    "a request on {g}, which is gone, got {r:?}"
                );
            }
        }
        self.other.check_invariants().map_err(|e| format!("second allocator: {e}"))?;
        let snap = self.alloc.snapshot();
        let other_snap = self.other.snapshot();
        let device_segs = self.dev.live_segments();
        let ranges = self.dev.live_virtual_ranges();
        let in_range = |a: DeviceAddr| ranges.iter().any(|&(b, n)| b <= a && a.0 < b.0 + n);
        let mut alloc_segs: Vec<(DeviceAddr, u64)> = snap
            .iter()
            .chain(&other_snap)
            .filter(|s| !in_range(s.address))
            .map(|s| (s.address, s.size))
            .collect();
        alloc_segs.sort_unstable();
        // A segment in a virtual range is a run of pages the device maps (no view lists pages
        // its own lock section unmaps: `view_unsettled`).
        let maps = self.dev.live_mappings();
        for s in snap.iter().chain(&other_snap).filter(|s| in_range(s.address)) {
            ensure!(
                mapped(&maps, s.address.0, s.address.0 + s.size),
                "segment at {} ({} bytes, {}) of an expandable range is not wholly mapped",
                s.address,
                s.size,
                s.stream
            );
        }
        ensure!(
            alloc_segs == device_segs,
            "allocator segments {alloc_segs:?} != device live segments {device_segs:?}"
        );
        let stats = self.alloc.stats();
        let other_stats = self.other.stats();
        let b = &stats.blocks;
        let device_reserved: u64 = device_segs.iter().map(|s| s.1).sum();
        let reserved = b.reserved_bytes.all.current + other_stats.blocks.reserved_bytes.all.current;
        ensure!(
            reserved == device_reserved + self.dev.physical_bytes()
                && device_reserved == self.dev.reserved_bytes(),
            "reserved_bytes {reserved} (both allocators) != Σ device segments {device_reserved} + physical {}",
            self.dev.physical_bytes()
        );
        for o in self.others.iter().filter(|o| o.block_size() > 0) {
            let blk =
                other_snap.iter().flat_map(|seg| &seg.blocks).find(|blk| blk.address == o.ptr());
            ensure!(
                blk.is_some_and(
                    |blk| blk.size == o.block_size() && blk.state == BlockState::Allocated
                ),
                "the second allocator's {o:?} does not match its block {blk:?}"
            );
        }
        let held: Vec<&Live> = self.live.iter().filter(|l| l.buf.block_size() > 0).collect();
        // Planned buffers are slices of a region's blocks, not blocks of their own.
        let (planned, pooled): (Vec<&Live>, Vec<&Live>) =
            held.iter().partition(|l| l.buf.is_planned());
        let (other_bytes, other_blocks) = self.unowned_blocks(&snap, &pooled)?;
        ensure!(
            planned.is_empty() && other_blocks == 0 || self.runs > 0,
            "blocks or planned buffers with no scope ever opened: {other_blocks} blocks, {} \
             planned buffers",
            planned.len()
        );
        let allocated: u64 = pooled.iter().map(|l| l.buf.block_size()).sum::<u64>() + other_bytes;
        // A scope accounts a block it reused locally with the block's first request.
        let requested: u64 = pooled.iter().filter(|l| l.run.is_none()).map(|l| l.buf.len()).sum();
        ensure!(
            b.allocated_bytes.all.current == allocated,
            "allocated_bytes {} != Σ live block sizes {allocated} (of which {other_bytes} in \
             regions or a scope's cache)",
            b.allocated_bytes.all.current
        );
        ensure!(
            b.allocation.all.current == pooled.len() as u64 + other_blocks,
            "{} allocations counted, {} live pool buffers and {other_blocks} other blocks",
            b.allocation.all.current,
            pooled.len()
        );
        ensure!(
            b.requested_bytes.all.current >= requested && b.active_bytes.all.current >= allocated,
            "requested {} < {requested} or active {} < {allocated}",
            b.requested_bytes.all.current,
            b.active_bytes.all.current
        );
        ensure!(
            self.scope.is_some() || other_bytes <= stats.plan_region_bytes,
            "{other_bytes} bytes of allocated blocks back no live buffer, with no scope open and \
             {} bytes in plan regions",
            stats.plan_region_bytes
        );
        for g in stat_groups(b) {
            for s in cells(g) {
                ensure!(
                    s.allocated.checked_sub(s.freed) == Some(s.current) && s.peak >= s.current,
                    "stat identity broken: {s:?}"
                );
            }
            ensure!(
                g.all.current == g.small_pool.current + g.large_pool.current
                    && g.all.current == g.persistent.current + g.transient.current,
                "stat group does not add up: {g:?}"
            );
        }
        let c = self.dev.counters();
        let (mallocs, frees) = (c.mallocs - self.base.mallocs, c.frees - self.base.frees);
        let counted = (
            stats.num_device_alloc + other_stats.num_device_alloc + self.pool_calls.0,
            stats.num_device_free + other_stats.num_device_free + self.pool_calls.1,
        );
        ensure!(
            (mallocs, frees) == counted,
            "device counted {mallocs} mallocs / {frees} frees, the allocators {counted:?}"
        );
        for l in &pooled {
            self.check_placement(l, &snap)?;
        }
        for l in &planned {
            let b = &l.buf;
            self.check_in_block(b.ptr(), b.block_size(), b.stream(), &snap)
                .map_err(|e| format!("planned {b:?}: {e}"))?;
        }
        let mut spans: Vec<(u64, u64)> = held
            .iter()
            .map(|l| &l.buf)
            .chain(&self.others)
            .filter(|b| b.block_size() > 0)
            .map(|b| (b.ptr().0, b.block_size()))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            ensure!(w[0].0 + w[0].1 <= w[1].0, "live buffers overlap: {w:x?}");
        }
        self.vm_fail_mark.set(self.vm_failures());
        self.check_device()
    }

    /// The device-side part of [`Harness::check`]: no sanitizer violation, no failed kernel. A
    /// step that does not call the allocator leaves the rest of `check` as it was, so the
    /// harness only runs this part after one (it is most of the cost of a step).
    fn check_device(&self) -> Result<(), String> {
        let v = self.dev.violations();
        ensure!(v.is_empty(), "stream-order violations: {v:?}");
        let k = self.dev.kernel_failures();
        ensure!(k.is_empty(), "kernel failures: {k:?}");
        Ok(())
    }

    /// A live buffer sits in an allocated block of its size, in a segment of its stream,
    /// residency and pool.
    fn check_placement(&self, l: &Live, snap: &[SegmentInfo]) -> Result<(), String> {
        let b = &l.buf;
        let i = snap.partition_point(|s| s.address <= b.ptr());
        let seg = i.checked_sub(1).map(|i| &snap[i]);
        let Some(seg) = seg.filter(|s| b.ptr().0 + b.block_size() <= s.address.0 + s.size) else {
            return Err(format!("live {b:?} is in no segment"));
        };
        ensure!(
            seg.stream == b.stream()
                && l.residency.is_none_or(|r| seg.residency == r)
                && seg.pool == l.kind,
            "live {b:?} ({:?}, {:?}) sits in a segment of {}, {:?}, {:?}",
            l.residency,
            l.kind,
            seg.stream,
            seg.residency,
            seg.pool
        );
        let block = seg.blocks.iter().find(|blk| blk.address == b.ptr());
        // (A block a scope reused locally keeps the request it was first made for.)
        ensure!(
            block.is_some_and(|blk| blk.size == b.block_size()
                && (blk.requested == b.len() || l.run.is_some())
                && blk.state == BlockState::Allocated),
            "live {b:?} does not match its block {block:?}"
        );
        Ok(())
    }

    /// Whether a transient block may sit in `seg`: a transient one, or any large-pool ordinary
    /// segment (both residencies share free space there: `residency.rs`), whatever the current
    /// configuration (a `SetConfig` may turn expandable segments on after it was made); not a
    /// persistent expandable range.
    fn transient_may_use(&self, seg: &SegmentInfo) -> bool {
        let in_range = |a: u64| {
            self.alloc
                .expandable_ranges()
                .iter()
                .any(|r| r.base.0 <= a && a < r.base.0 + r.virtual_size)
        };
        seg.residency == Residency::Transient
            || (seg.pool == PoolKind::Large && !in_range(seg.address.0))
    }

    /// The allocated blocks of `snap` that back none of the live pool buffers `pooled` (a plan's
    /// region, the blocks an open scope freed and keeps): their bytes and number. All are
    /// transient (in segments a transient block may use).
    fn unowned_blocks(&self, snap: &[SegmentInfo], pooled: &[&Live]) -> Result<(u64, u64), String> {
        let owned: HashSet<u64> = pooled.iter().map(|l| l.buf.ptr().0).collect();
        let (mut bytes, mut blocks) = (0, 0);
        for seg in snap {
            for blk in &seg.blocks {
                if blk.state == BlockState::Allocated && !owned.contains(&blk.address.0) {
                    ensure!(
                        self.transient_may_use(seg),
                        "an allocated persistent block at {} backs no live buffer",
                        blk.address
                    );
                    bytes += blk.size;
                    blocks += 1;
                }
            }
        }
        Ok((bytes, blocks))
    }

    /// `[ptr, ptr + size)` lies inside one segment of `stream` that a transient block may use
    /// ([`Harness::transient_may_use`]), on allocated blocks
    /// only (a planned slice in its region, which may span several blocks of an adopted
    /// segment; a bound buffer in its pool block).
    fn check_in_block(
        &self,
        ptr: DeviceAddr,
        size: u64,
        stream: StreamId,
        snap: &[SegmentInfo],
    ) -> Result<(), String> {
        let (lo, hi) = (ptr.0, ptr.0 + size);
        let i = snap.partition_point(|s| s.address <= ptr);
        let seg = i.checked_sub(1).map(|i| &snap[i]);
        let Some(seg) = seg.filter(|s| hi <= s.address.0 + s.size) else {
            return Err("in no segment".into());
        };
        ensure!(
            seg.stream == stream && self.transient_may_use(seg),
            "in a segment of {} ({:?}), not one of {stream} a transient block may use",
            seg.stream,
            seg.residency
        );
        let mut under = seg.blocks.iter().filter(|b| b.address.0 < hi && lo < b.address.0 + b.size);
        let bad = under.find(|b| b.state != BlockState::Allocated);
        ensure!(bad.is_none(), "over a block that is not allocated: {bad:?}");
        Ok(())
    }

    /// Clears every armed fault and lets go of the harness's event: from now on no device call
    /// is refused, and the allocators must keep working (a small request on the default
    /// stream is served and freed) and give everything back.
    fn clear_faults(&mut self) -> Result<(), String> {
        clear_faults(&self.dev);
        self.event_faults.set([false; 4]);
        self.nth_fires_at = None;
        self.fail_above = None;
        self.dev.destroy_event(self.event).map_err(|e| dev_err("destroy_event", e))?;
        for a in [self.alloc, self.other] {
            match a.alloc(4096, StreamId::DEFAULT) {
                Ok(b) => drop(b),
                Err(AllocError::OutOfMemory(_)) => {}
                Err(e) => return Err(format!("a request with no fault armed: {e}")),
            }
        }
        self.check()
    }

    /// Ends the open scope and lets go of the faults armed; returns the device and every live
    /// buffer of both allocators (with whether it is an unbound scope buffer), for
    /// [`closed_teardown`] once the caller dropped the allocators.
    fn hand_over(mut self) -> Result<(Arc<SimDevice>, Vec<HandedOver>), String> {
        self.exit_scope()?;
        self.check()?;
        self.clear_faults()?;
        let mut buffers: Vec<_> =
            std::mem::take(&mut self.live).into_iter().map(|l| (l.buf, l.run.is_some())).collect();
        buffers.extend(std::mem::take(&mut self.others).into_iter().map(|b| (b, false)));
        // (Escapes are held to the strict rule too: one freed into a closed allocator with
        // uses on other streams is waited for on the host, so its region goes back at once.
        // Until 2026-12-05 the rule skipped programs with escapes, and a 2 MiB region stayed.)
        Ok((self.dev.clone(), buffers))
    }

    /// Ends the open scope and drops every buffer, checking after each; returns the device for
    /// [`finish`] once the caller dropped the allocator. Only plan regions may stay allocated,
    /// and with `explicit`, not past `empty_cache`.
    fn teardown(mut self, explicit: bool) -> Result<Arc<SimDevice>, String> {
        self.exit_scope()?;
        self.check()?;
        while !self.live.is_empty() {
            drop(self.live.remove(0));
            self.check()?;
        }
        while !self.others.is_empty() {
            drop(self.others.remove(0));
            self.check()?;
        }
        // Every buffer went with the faults still armed; from here the allocators must give
        // everything back.
        self.clear_faults()?;
        self.other.synchronize().map_err(|e| format!("second synchronize: {e}"))?;
        let a = self.other.stats().blocks.allocated_bytes.all.current;
        ensure!(a == 0, "the second allocator holds {a} bytes with no buffer left");
        self.alloc.synchronize().map_err(|e| format!("synchronize: {e}"))?;
        let stats = self.alloc.stats();
        let (b, regions) = (&stats.blocks, stats.plan_region_bytes);
        // (`check` bounds what regions hold by `plan_region_bytes`.)
        ensure!(
            b.active_bytes.all.current == b.allocated_bytes.all.current
                && (regions > 0
                    || b.allocated_bytes.all.current == 0 && b.requested_bytes.all.current == 0),
            "memory still active after every buffer was dropped ({regions} bytes in regions): \
             {b:?}"
        );
        if explicit {
            self.other.empty_cache().map_err(|e| format!("second empty_cache: {e}"))?;
            self.other.release_persistent().map_err(|e| format!("second release: {e}"))?;
            let kept = |i: usize| self.initial[i].map_or(0, |(_, size)| size);
            ensure!(self.other.reserved_bytes() == kept(1), "the second allocator kept memory");
            self.alloc.empty_cache().map_err(|e| format!("empty_cache: {e}"))?;
            self.alloc.release_persistent().map_err(|e| format!("release_persistent: {e}"))?;
            self.check()?;
            self.nothing_releasable(|_| true, "empty_cache + release_persistent")?;
            let mut initials: Vec<_> = self.initial.iter().flatten().copied().collect();
            initials.sort();
            let mut live = self.dev.live_segments();
            live.sort();
            // With no buffer live and no scope open every plan region is idle, and
            // `empty_cache` lets go of idle regions (it waits for escapes still settling).
            let regions = self.alloc.stats().plan_region_bytes;
            ensure!(regions == 0, "{regions} bytes of plan regions after empty_cache");
            ensure!(
                self.alloc.reserved_bytes() == kept(0) && live == initials,
                "an idle allocator kept {} bytes after empty_cache + release_persistent",
                self.alloc.reserved_bytes()
            );
        }
        self.dev.synchronize().map_err(|e| dev_err("device synchronize", e))?;
        Ok(self.dev)
    }
}

/// Does `[lo, hi)` lie wholly in the device's mappings `maps` (address, bytes; disjoint)?
fn mapped(maps: &[(DeviceAddr, u64)], lo: u64, hi: u64) -> bool {
    let mut cur = lo;
    while cur < hi {
        match maps.iter().find(|&&(a, n)| a.0 <= cur && cur < a.0 + n) {
            Some(&(a, n)) => cur = a.0 + n,
            None => return false,
        }
    }
    true
}

fn stat_groups(b: &BlockStats) -> [&StatGroup; 9] {
    [
        &b.allocated_bytes,
        &b.reserved_bytes,
        &b.active_bytes,
        &b.inactive_split_bytes,
        &b.requested_bytes,
        &b.allocation,
        &b.segment,
        &b.active,
        &b.inactive_split,
    ]
}

fn cells(g: &StatGroup) -> [&Stat; 5] {
    [&g.all, &g.small_pool, &g.large_pool, &g.persistent, &g.transient]
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool::MIB;
    use tidepool::hooks::Broken;

    fn program(config: u8, ops: Vec<Op>) -> Program {
        Program {
            capacity: 1,
            config,
            explicit_teardown: false,
            late_streams: false,
            quiet: false,
            handles_first: false,
            ops,
        }
    }

    /// Streams past the 64 fast-path slots: the head start leaves two 4 KiB buffers whose
    /// streams are gone (live indexes 0 and 1). Slot 1's first stream re-tags the slot of the
    /// stream destroyed through the allocator, slot 2's the slot of the one destroyed behind
    /// its back (its lane still caching a block); after a destroy, slot 1's next stream takes
    /// the slot only the second allocator used, and slot 2's next one the live default stream's.
    fn late_stream_ops() -> Vec<Op> {
        let small = |stream| Op::Alloc { bytes: 4096, stream, persistent: false };
        vec![
            small(1),
            small(2),
            Op::Free { index: 2 },
            Op::Free { index: 2 },
            small(1),
            small(2),
            Op::Launch { index: 1, stream: 2, write: true, sleep_us: 5 },
            Op::Free { index: 0 },
            small(1),
            small(1),
            Op::Free { index: 0 },
            small(2),
            small(2),
            Op::DestroyStream { stream: 1 },
            small(1),
            Op::Free { index: 3 },
            small(1),
            Op::DestroyStream { stream: 2 },
            small(2),
            small(0),
            Op::Free { index: 0 },
            small(2),
            Op::Free { index: 1 },
            small(0),
            Op::EmptyCache,
            small(2),
            small(1),
        ]
    }

    #[test]
    fn programs_on_streams_past_the_fast_slots_pass() {
        // Every configuration (plain, expandable, caching off, limits), both teardowns.
        for config in 0..CONFIGS.len() as u8 {
            for explicit_teardown in [false, true] {
                let p = Program {
                    explicit_teardown,
                    late_streams: true,
                    quiet: false,
                    handles_first: false,
                    ..program(config, late_stream_ops())
                };
                run(&p, Options::default()).unwrap_or_else(|e| panic!("config {config}: {e}"));
            }
        }
        // The flag rides in bit 1 of the teardown byte: encoded and decoded unchanged.
        let p = Program { late_streams: true, ..program(3, late_stream_ops()) };
        assert_eq!(Program::decode(&p.encode()), p);
    }

    /// Buffers of every kind outlive both allocators' handles ([`Program::handles_first`]):
    /// small and large, persistent, used on other streams (`record_stream`, a kernel still
    /// sleeping), an unbound scope buffer, the second allocator's, a capture's pool gone before.
    /// The allocators close, and after each buffer goes every device segment and mapping must
    /// hold a live one, in every configuration; the broken build
    /// `cfg(tidepool_broken = "closed_keeps_cache")` fails it (the cache stays).
    #[test]
    fn programs_torn_down_handles_first_pass() {
        let alloc = |bytes, stream, persistent| Op::Alloc { bytes, stream, persistent };
        let ops = vec![
            alloc(4096, 0, false),
            alloc(3 * MIB, 1, false),
            alloc(30 * MIB, 2, true),
            alloc(1000, 1, true),
            alloc(25 * MIB, 0, false),
            Op::Free { index: 4 },
            alloc(12 * MIB, 1, false),
            Op::RecordStream { index: 1, stream: 2 },
            Op::Launch { index: 1, stream: 2, write: false, sleep_us: 5 },
            Op::ScopeEnter { stream: 1, named: true },
            Op::ScopeAlloc { bytes: 2 * MIB },
            Op::ScopeExit,
            Op::Other { index: 1 + 8, action: 0 },
            Op::Other { index: 3 * MIB as u8, action: 0 },
            Op::Capture { stream: 1, fork: 2, bytes: 4096, launches: 1, panics: false },
            alloc(6 * MIB, 2, false),
            Op::Free { index: 0 },
            Op::Launch { index: 2, stream: 1, write: true, sleep_us: 1 },
        ];
        for config in 0..CONFIGS.len() as u8 {
            for quiet in [false, true] {
                let p = Program { handles_first: true, quiet, ..program(config, ops.clone()) };
                run(&p, Options::default()).unwrap_or_else(|e| panic!("config {config}: {e}"));
            }
        }
        let p = Program { handles_first: true, ..program(2, ops) };
        assert_eq!(Program::decode(&p.encode()), p, "bit 3 of the teardown byte");
    }

    /// A forked capture replayed twice captures again into its pool (see `Harness::capture`),
    /// in every configuration; the broken build `cfg(tidepool_broken = "capture_unordered")`
    /// (the second capture not ordered after the side stream's write) fails it.
    #[test]
    fn a_pool_captured_again_after_ordinary_work_on_its_side_stream() {
        let ops = vec![
            Op::Capture { stream: 1, fork: 2, bytes: 4096, launches: 2, panics: false },
            Op::Capture { stream: 2, fork: 1, bytes: 3 * MIB, launches: 2, panics: false },
        ];
        for config in 0..CONFIGS.len() as u8 {
            run(&program(config, ops.clone()), Options::default())
                .unwrap_or_else(|e| panic!("config {config}: {e}"));
        }
    }

    /// Captures whose bodies panic (`Allocator::capture`), forked and joined back, left forked,
    /// or not forked, then an ordinary capture, in every configuration: each is over for both
    /// streams and its pool empties. The broken build `cfg(tidepool_broken = "capture_left")`
    /// (a panicking body leaves the capture underway) fails it.
    #[test]
    fn captures_whose_bodies_panic_end_and_give_their_pools_back() {
        let ops = vec![
            Op::Capture { stream: 1, fork: 2, bytes: 4096, launches: 1, panics: true },
            Op::Capture { stream: 2, fork: 1, bytes: 3 * MIB, launches: 0, panics: true },
            Op::Capture { stream: 2, fork: 0, bytes: 700_000, launches: 2, panics: true },
            Op::Capture { stream: 1, fork: 2, bytes: 4096, launches: 2, panics: false },
        ];
        for config in 0..CONFIGS.len() as u8 {
            run(&program(config, ops.clone()), Options::default())
                .unwrap_or_else(|e| panic!("config {config}: {e}"));
        }
    }

    #[test]
    fn late_streams_reach_the_lane_re_tags() {
        // The re-tag fixes, reverted one at a time, fail the same program: a stale buffer's
        // free cached in a re-tagged lane, or a hit that does not check the lane's stream.
        let p = Program { late_streams: true, ..program(0, late_stream_ops()) };
        run(&p, Options::default()).unwrap();
        for mode in [Broken::RetaggedLaneTakesStaleFrees, Broken::RetaggedLaneServesAnyStream] {
            let r = run(&p, Options { broken: Some(mode), ..Options::default() });
            assert!(r.is_err(), "{mode:?} not caught");
        }
    }

    #[test]
    fn a_program_touching_every_operation_passes() {
        let ops = vec![
            Op::Alloc { bytes: 0, stream: 0, persistent: false },
            Op::Alloc { bytes: 1000, stream: 1, persistent: false },
            Op::Alloc { bytes: 3 * MIB, stream: 2, persistent: true },
            Op::Alloc { bytes: u64::MAX, stream: 0, persistent: false },
            Op::Alloc { bytes: 1 << 40, stream: 0, persistent: false },
            Op::Launch { index: 1, stream: 2, write: true, sleep_us: 5 },
            Op::RecordStream { index: 2, stream: 1 },
            Op::Sleep { stream: 2, sleep_us: 1 },
            Op::WaitEvent { from: 2, to: 0 },
            Op::Free { index: 1 },
            Op::Inspect { summary: true },
            Op::EmptyCache,
            Op::FailNthMalloc { n: 1 },
            Op::Alloc { bytes: 12 * MIB, stream: 1, persistent: false },
            Op::FailMallocsAbove { limit: Some(MIB) },
            Op::Alloc { bytes: 4 * MIB, stream: 1, persistent: false },
            Op::FailMallocsAbove { limit: None },
            Op::FailEventQueries { on: true },
            Op::Free { index: 1 },
            Op::Alloc { bytes: 3 * MIB, stream: 2, persistent: true },
            Op::SetConfig { config: 1 },
            Op::Synchronize,
            Op::DeviceSynchronize,
            Op::ReleasePersistent,
            Op::ReleaseStream { stream: 2 },
            Op::DestroyStream { stream: 0 },
            Op::DestroyStream { stream: 2 },
            Op::Alloc { bytes: 5000, stream: 2, persistent: false },
            Op::ScopeAlloc { bytes: 100 },
            Op::ScopeBurst { n: 3, seed: 1 },
            Op::ScopeExit,
            Op::ScopeEnter { stream: 1, named: true },
            Op::ScopeAlloc { bytes: 0 },
            Op::ScopeAlloc { bytes: u64::MAX },
            Op::ScopeAlloc { bytes: 3 * MIB },
            Op::ScopeBurst { n: 8, seed: 7 },
            Op::Launch { index: 3, stream: 2, write: true, sleep_us: 1 },
            Op::ScopeEnter { stream: 2, named: false },
            Op::ScopeAlloc { bytes: 700 },
            Op::ScopeBurst { n: 2, seed: 3 },
            Op::DestroyStream { stream: 2 },
            Op::ScopeEnter { stream: 0, named: true },
            Op::ScopeAlloc { bytes: 12 * MIB },
        ];
        for explicit_teardown in [false, true] {
            let p = Program { explicit_teardown, ..program(0, ops.clone()) };
            run(&p, Options::default()).unwrap();
        }
    }

    /// Every fault SimDevice injects, armed at points where the allocator calls what it
    /// refuses, over ordinary and expandable segments: the allocators' errors for them are
    /// excused, every check holds after each step, and nothing is left on the device.
    #[test]
    fn a_program_arming_every_fault_passes() {
        use crate::program::{EventFault, NthFault};
        let ops = vec![
            Op::Alloc { bytes: 3 * MIB, stream: 1, persistent: false },
            Op::Launch { index: 0, stream: 2, write: true, sleep_us: 5 },
            Op::FailEvents { fault: EventFault::Records, on: true },
            Op::Free { index: 0 },
            Op::Alloc { bytes: 3 * MIB, stream: 2, persistent: false },
            Op::RecordStream { index: 0, stream: 1 },
            Op::FailEvents { fault: EventFault::Panic, on: true },
            Op::Launch { index: 0, stream: 0, write: false, sleep_us: 1 },
            Op::Free { index: 0 },
            Op::FailEvents { fault: EventFault::Waits, on: true },
            Op::Alloc { bytes: 5 * MIB, stream: 1, persistent: false },
            Op::Synchronize,
            Op::FailEvents { fault: EventFault::Records, on: false },
            Op::FailEvents { fault: EventFault::Panic, on: false },
            Op::FailEvents { fault: EventFault::Waits, on: false },
            Op::FailNth { fault: NthFault::EventCreate, n: 1 },
            Op::Alloc { bytes: 2 * MIB, stream: 2, persistent: false },
            Op::Launch { index: 1, stream: 1, write: true, sleep_us: 1 },
            Op::Free { index: 1 },
            Op::FailNth { fault: NthFault::VmUnmap, n: 1 },
            Op::EmptyCache,
            Op::FailNth { fault: NthFault::VmMap, n: 2 },
            Op::Alloc { bytes: 9 * MIB, stream: 1, persistent: true },
            Op::FailNth { fault: NthFault::VmCreate, n: 1 },
            Op::Alloc { bytes: 9 * MIB, stream: 0, persistent: false },
            Op::FailNth { fault: NthFault::Malloc, n: 1 },
            Op::Alloc { bytes: 30 * MIB, stream: 0, persistent: false },
            Op::VirtualRoom { room: Some(0) },
            Op::SetConfig { config: 16 },
            Op::Alloc { bytes: 7 * MIB, stream: 2, persistent: false },
            Op::VirtualRoom { room: None },
            Op::FailNth { fault: NthFault::VmUnmap, n: 2 },
            Op::ReleaseStream { stream: 1 },
            Op::DestroyStream { stream: 2 },
            Op::ReleasePersistent,
        ];
        // (Ordinary segments meet these faults with no error; expandable ones return some.)
        for config in [0, 1, 9, 10, 17] {
            let before = EXCUSED.with(|c| c.get());
            for explicit_teardown in [false, true] {
                let p = Program { explicit_teardown, ..program(config, ops.clone()) };
                run(&p, Options::default()).unwrap_or_else(|e| panic!("config {config}: {e}"));
            }
            let excused = EXCUSED.with(|c| c.get()) - before;
            let expandable = config >= 9;
            assert!(excused > 0 || !expandable, "config {config}: no error of an injected fault");
        }
    }

    /// One run of the named scope on the default stream, with `base` older buffers at the front
    /// of the live list: three unbound buffers (one used by a kernel), a burst of bound ones
    /// between them, and a 3 MiB buffer that escapes.
    fn scope_run(base: u8) -> Vec<Op> {
        vec![
            Op::ScopeEnter { stream: 0, named: true },
            Op::ScopeAlloc { bytes: 8 * MIB },
            Op::ScopeAlloc { bytes: 4096 },
            Op::Launch { index: base + 1, stream: 0, write: true, sleep_us: 1 },
            Op::ScopeBurst { n: 6, seed: 42 },
            Op::Free { index: base },
            Op::ScopeAlloc { bytes: 2 * MIB + 1 },
            Op::Free { index: base },
            Op::ScopeAlloc { bytes: 3 * MIB },
            Op::Free { index: base },
            Op::ScopeExit,
        ]
    }

    /// Runs `ops` like [`run`] and returns the statistics before the teardown.
    fn stats_after(ops: Vec<Op>) -> tidepool::MemoryStats {
        let p = program(0, ops);
        let (alloc, base) = start(&p).unwrap();
        let other = second(&alloc, &p).unwrap();
        let mut h = Harness::new(&alloc, &other, base);
        for (i, op) in p.ops.iter().enumerate() {
            h.step(op).unwrap_or_else(|e| panic!("step {i} {op:?}: {e}"));
            h.check().unwrap_or_else(|e| panic!("after step {i} {op:?}: {e}"));
        }
        let stats = alloc.stats();
        let dev = h.teardown(false).unwrap();
        drop((other, alloc));
        finish(dev).unwrap();
        stats
    }

    #[test]
    fn repeated_named_scope_runs_are_planned() {
        // Each escape is freed before the next run begins: runs 2 and 3 follow the plan.
        let mut ops = scope_run(0);
        for _ in 0..2 {
            ops.push(Op::Free { index: 0 });
            ops.extend(scope_run(0));
        }
        let s = stats_after(ops);
        assert_eq!(s.scope_escapes, 3);
        assert!(s.plan_hits > 0, "{s:?}");
        assert_eq!((s.plan_misses, s.plan_fallbacks), (0, 0));
        // An escape still live in the next run pins its slice: that allocation misses.
        let mut ops = scope_run(0);
        ops.extend(scope_run(1));
        let s = stats_after(ops);
        assert!(s.plan_hits > 0 && s.plan_misses > 0, "{s:?}");
    }

    /// The allocator's deliberate bug (no events for `record_stream` uses) must be caught.
    fn reuse_while_another_stream_runs() -> Program {
        let mut ops = vec![Op::Alloc { bytes: 4096, stream: 1, persistent: false }];
        // Hold stream 2 busy for a while, then touch the buffer on it. 100 ms: the broken run
        // reuses the block before that work ends unless this thread is kept off a core for that
        // long (5 ms was not enough under a loaded `cargo test`: a broken run came out clean).
        ops.extend((0..400).map(|_| Op::Sleep { stream: 2, sleep_us: 250 }));
        ops.push(Op::Launch { index: 0, stream: 2, write: true, sleep_us: 0 });
        // Free it and take the same block again on its owner stream at once.
        ops.push(Op::Free { index: 0 });
        ops.push(Op::Alloc { bytes: 4096, stream: 1, persistent: false });
        program(0, ops)
    }

    #[test]
    fn the_harness_catches_premature_reuse() {
        let p = reuse_while_another_stream_runs();
        run(&p, Options::default()).unwrap();
        let err = run(&p, Options { broken_skip_events: true, ..Options::default() }).unwrap_err();
        assert!(err.contains("stream-order violations"), "{err}");
    }

    /// The second allocator and forgotten scoped buffers: buffers given to the wrong allocator
    /// are refused (a broken identity check is caught), and a forgotten planned buffer read on
    /// another stream is ordered at its scope's exit (a broken exit is caught).
    #[test]
    fn foreign_buffers_and_forgotten_scoped_buffers() {
        let mut ops = vec![
            Op::Alloc { bytes: 4096, stream: 1, persistent: false },
            Op::Other { index: 1 + 8, action: 0 }, // 1000 B on slot 1
            Op::Other { index: 3, action: 2 },
            Op::Other { index: 0, action: 4 },
            Op::Other { index: 1, action: 4 },
            Op::Other { index: 1, action: 3 }, // the second allocator's buffer to the first
            Op::Alloc { bytes: 4096, stream: 1, persistent: false },
            Op::Other { index: 0, action: 3 }, // the first's to the second
            Op::Alloc { bytes: 4096, stream: 1, persistent: false },
        ];
        let p = program(0, ops.clone());
        run(&p, Options::default()).unwrap();
        let err = run(&p, Options { broken: Some(Broken::ForeignBuffers), ..Options::default() });
        let err = err.unwrap_err();
        assert!(err.contains("accepted") || err.contains("foreign"), "not caught: {err}");
        // A named scope's planned buffer, read on slot 2 by a long kernel and forgotten; the
        // next run hands its slice out again.
        ops.clear();
        for _ in 0..3 {
            ops.push(Op::ScopeEnter { stream: 1, named: true });
            // Long enough (32 × 200 µs) that the read is still running when the next run
            // hands the slice out, even on a loaded machine.
            ops.extend((0..32).map(|_| Op::Sleep { stream: 2, sleep_us: 200 }));
            ops.push(Op::ScopeForget { bytes: 4096, used: true, stream: 2 });
            ops.push(Op::ScopeExit);
        }
        let p = program(0, ops);
        run(&p, Options::default()).unwrap();
        let err = run(&p, Options { broken: Some(Broken::ForgottenUses), ..Options::default() });
        let err = err.unwrap_err();
        assert!(err.contains("stream-order violations"), "not caught: {err}");
    }

    #[test]
    fn out_of_memory_must_be_explained() {
        // A 64 MiB device cannot hold 128 MiB: an explained OOM, so the program passes.
        let p = Program {
            capacity: 0,
            ..program(0, vec![Op::Alloc { bytes: 128 * MIB, stream: 0, persistent: false }])
        };
        run(&p, Options::default()).unwrap();
        // An OOM on a roomy device with no fault armed and no limit is a failure.
        let (alloc, base) = start(&program(0, vec![])).unwrap();
        let other = second(&alloc, &program(0, vec![])).unwrap();
        let h = Harness::new(&alloc, &other, base);
        let mut report = OomReport::default();
        report.segment = 2 * MIB;
        report.device_free = 256 * MIB;
        let before = h.reserve_calls();
        let err = h.explain_oom(&report, before).unwrap_err();
        assert!(err.contains("unexplained out-of-memory"), "{err}");
        // The same report is explained by a fault armed for the reserve call it made.
        let h = Harness { nth_fires_at: Some(before + 1), ..h };
        assert!(h.explain_oom(&report, before).is_err(), "no reserve call was made");
        h.dev.fail_nth_malloc(Some(1));
        assert!(h.dev.reserve(MIB).is_err());
        h.explain_oom(&report, before).unwrap();
    }

    #[test]
    fn devices_are_reused_only_when_clean() {
        // (The only test on the 64 GiB device, so no other test takes it from the pool.)
        let ops = vec![Op::Alloc { bytes: 4096, stream: 2, persistent: false }];
        let p = Program { capacity: 3, ..program(0, ops) };
        run(&p, Options::default()).unwrap();
        // The device (with the stream it created) went back to the pool and is picked again.
        let (alloc, base) = start(&p).unwrap();
        let other = second(&alloc, &p).unwrap();
        let h = Harness::new(&alloc, &other, base);
        assert!(h.slots[1].is_some() && h.slots[2].is_none(), "{:?}", h.slots);
        drop(h);
        drop((other, alloc));
        // A program that failed leaves its device out of the pool.
        let broken = reuse_while_another_stream_runs();
        run(&broken, Options { broken_skip_events: true, ..Options::default() }).unwrap_err();
        let pool = DEVICES.lock().unwrap();
        assert!(pool.iter().all(|d| d.violations().is_empty()));
    }
}
