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
//!
//! Here: the model, the device pool, [`run`] and the steps; the `Harness`'s checks are in
//! `check.rs`, captures in `capture.rs`, scope steps in `scope_ops.rs`, injected faults in
//! `faults.rs` and the end of a program in `teardown.rs`.

use super::program::{
    BURST_SIZES, CAPACITIES, CONFIGS, EventFault, NthFault, Op, Program, SLEEPS_US, STREAM_SLOTS,
};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tidepool::device::{
    Access, AccessKind, Device, DeviceAddr, DeviceError, EventId, Kernel, Launch, SimConfig,
    SimCounters, SimDevice, StreamId,
};
use tidepool::{AllocError, Scope, ScopedBuffer, SegmentInfo};
use tidepool::{Allocator, Buffer, Config};
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

// (After `ensure!`: macro_rules are in scope only below their definition.)
mod capture;
mod check;
mod faults;
mod scope_ops;
mod teardown;

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
mod tests;
