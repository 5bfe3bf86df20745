//! The `allocator_ops` program: what a fuzz input means, decoded with [`Input`].
//!
//! ```text
//!   input = header  op op op …            (at most MAX_OPS ops; the rest is ignored)
//!   header = capacity:choice  config:choice  flags:u8 (bit 0 teardown, bit 1 late streams)
//!   op     = tag:choice(TAGS) operands…   (TAGS weights the kinds: 10/64 of tags are allocs,
//!                                          10/64 are scope operations, 2/64 the second
//!                                          allocator and foreign buffers, 1/64 graph captures)
//! ```
//!
//! Operands name *slots*, not raw values: a stream is one of [`STREAM_SLOTS`] slots (slot 0 is
//! the default stream, the others are created on first use and again after being destroyed), a
//! buffer is an index reduced modulo the number of live buffers, a configuration is an entry of
//! [`CONFIGS`]. Sizes come in classes (tiny, small, large, huge, absurd), so that mutating a byte
//! moves a request within its class. [`Program::encode`] writes a program back as bytes
//! (`decode(encode(p)) == p`), which is how the seed corpus is written.

use super::input::{Input, Output};
use tidepool::{MAX_REQUEST, MIB};

// Fault injection shares three tags with what came first (`Kind::FailNthMalloc`,
// `Kind::FailMallocsAbove`, `Kind::FailEventQueries`): the operand byte picks the fault too, and
// the bytes [`Program::encode`] wrote before (`n < 5`, a table index below 6, 0 or 1) pick the
// old operation, so the committed seeds and artifacts decode as before.

/// Most operations decoded from one input (keeps one execution well under a millisecond).
pub const MAX_OPS: usize = 64;

/// Stream slots: slot 0 is the default stream.
pub const STREAM_SLOTS: u8 = 3;

/// Device capacities a program may run on (the device is unbacked: capacity costs nothing).
pub const CAPACITIES: [u64; 4] = [64 * MIB, 256 * MIB, 1 << 30, 64 << 30];

/// Configurations a program may start with or switch to. All valid. (The expandable ones were
/// added after the first nine, the controls of issue 18 after those, stitching, then lanes
/// without the bias, then `throw_on_cudamalloc_oom`, then `cross_stream:never`. A choice
/// byte is read modulo the table's length, so an input written with choices below the old
/// length decodes as before: the seeds are, and the committed crash artifacts were re-encoded
/// with [`Program::encode`] when the stitching entries came.)
pub const CONFIGS: [&str; 23] = [
    "",
    "cross_stream:wait_event",
    "max_split_size_mb:40",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:8,cross_stream:wait_event",
    "max_split_size_mb:21,roundup_power2_divisions:2,cross_stream:wait_event",
    "memory_limit_mb:96",
    "per_process_memory_fraction:0.5,min_block_size:1024",
    "small_segment_mb:1,large_segment_mb:10,min_large_alloc_mb:10,min_block_size:256",
    "expandable_segments:true",
    "expandable_segments:true,cross_stream:wait_event,memory_limit_mb:96",
    "expandable_segments:true,release_threshold_mb:2,roundup_power2_divisions:4",
    "memory_limit_mb:96,garbage_collection_threshold:0.5",
    "caching:false",
    "initial_pool_size_mb:8,max_pool_size_mb:128,garbage_collection_threshold:0.75,max_split_size_mb:40",
    "caching:false,cross_stream:wait_event,max_pool_size_mb:96",
    "expandable_segments:true,expandable_stitching:true",
    "expandable_segments:true,expandable_stitching:true,cross_stream:wait_event,release_threshold_mb:0",
    "biased_lanes:false,cross_stream:wait_event",
    "throw_on_cudamalloc_oom:true,memory_limit_mb:96,max_split_size_mb:40",
    "throw_on_cudamalloc_oom:true,expandable_segments:true,per_process_memory_fraction:0.5",
    "cross_stream:never,memory_limit_mb:96",
    "cross_stream:never,expandable_segments:true",
];

/// Kernel and sleep durations in µs (mostly zero: a zero sleep costs nothing).
pub const SLEEPS_US: [u8; 8] = [0, 0, 0, 0, 0, 0, 1, 5];

/// Thresholds for [`Op::FailMallocsAbove`].
pub const FAIL_ABOVE: [Option<u64>; 6] =
    [None, Some(MIB), Some(2 * MIB), Some(20 * MIB), Some(64 * MIB), Some(1 << 30)];

/// Absurd request sizes; the last entry of the class is a raw `u64`.
const ABSURD: [u64; 7] =
    [u64::MAX, MAX_REQUEST, MAX_REQUEST + 1, u64::MAX - 511, 1 << 40, (64 << 30) + 1, 16 << 30];

/// One step of a program. Stream operands are slots (`0..STREAM_SLOTS`), buffer operands are
/// indexes reduced modulo the number of live buffers when the step runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `alloc_in(bytes, stream, residency)`.
    Alloc { bytes: u64, stream: u8, persistent: bool },
    /// Drop the `index`-th live buffer.
    Free { index: u8 },
    /// `record_stream(buffer, stream)` without a kernel (an announced use).
    RecordStream { index: u8, stream: u8 },
    /// A kernel over the buffer on `stream`, after the user-side protocol: wait for every stream
    /// that used the buffer, and `record_stream` when `stream` is not the owner.
    Launch { index: u8, stream: u8, write: bool, sleep_us: u8 },
    /// A kernel that only holds `stream` busy.
    Sleep { stream: u8, sleep_us: u8 },
    /// Device-side `wait_event`: `to` waits for an event recorded on `from` now.
    WaitEvent { from: u8, to: u8 },
    /// `Allocator::synchronize` (every pending event completes).
    Synchronize,
    /// `Device::synchronize` (every stream drains).
    DeviceSynchronize,
    /// `Allocator::empty_cache`.
    EmptyCache,
    /// `Allocator::release_persistent`.
    ReleasePersistent,
    /// `Allocator::release_stream`.
    ReleaseStream { stream: u8 },
    /// `Allocator::destroy_stream` (slot 0: the default stream, which must be refused).
    DestroyStream { stream: u8 },
    /// `Allocator::set_config(CONFIGS[config])`.
    SetConfig { config: u8 },
    /// `SimDevice::fail_nth_malloc`, `fail_nth_vm_create` and `fail_nth_vm_map`, all three
    /// with the same `n` (0 clears).
    FailNthMalloc { n: u8 },
    /// One device call of `fault`'s kind, the `n`th from now, is refused (0 clears that one).
    /// Decoded from the byte of [`Op::FailNthMalloc`]: `n = byte % 5`, and `byte / 5 % 6`
    /// picks [`Op::FailNthMalloc`] (0) or one of [`NTH_FAULTS`], so what was encoded before
    /// (bytes below 5) decodes as before.
    FailNth { fault: NthFault, n: u8 },
    /// `SimDevice::fail_mallocs_above`.
    FailMallocsAbove { limit: Option<u64> },
    /// `SimDevice::set_virtual_capacity`: no more than `room` bytes of virtual addresses
    /// reserved from now on besides those reserved now (`None`: the device's default).
    /// Decoded from the byte of [`Op::FailMallocsAbove`] (`byte / 6` odd), `room` from the
    /// same table.
    VirtualRoom { room: Option<u64> },
    /// `SimDevice::fail_event_queries`.
    FailEventQueries { on: bool },
    /// Every event call of `fault`'s kind is refused while `on` (or, for
    /// [`EventFault::Panic`], the refusals panic in the device instead). Decoded from the byte
    /// of [`Op::FailEventQueries`]: bit 0 is `on`, `byte >> 1 & 3` picks
    /// [`Op::FailEventQueries`] (0) or one of [`EVENT_FAULTS`].
    FailEvents { fault: EventFault, on: bool },
    /// Read-only views (`stats`, and `memory_summary` when `summary`: it is slow to format, so
    /// one Inspect in eight asks for it); then `reset_peak_stats`.
    Inspect { summary: bool },
    /// Opens `named_scope("f", stream)` (`named`) or `scope(stream)`. At most one scope is open
    /// at a time: an open one is closed first, as if by [`Op::ScopeExit`].
    ScopeEnter { stream: u8, named: bool },
    /// `alloc_unbound(bytes)` in the open scope (nothing without one): an ordinary live buffer,
    /// which escapes the scope if it is still live when the scope exits.
    ScopeAlloc { bytes: u64 },
    /// `n` bound allocations (`Scope::alloc`, `1..=MAX_BURST`) in the open scope, with sizes
    /// and an interleaved free order drawn from `seed`; all are freed before the step ends
    /// (a bound buffer borrows the scope, so it cannot outlive the step). The same `(n, seed)`
    /// makes the same sequence, so repeated runs of a named scope can follow their plan.
    ScopeBurst { n: u8, seed: u32 },
    /// Drops the open scope (nothing without one).
    ScopeExit,
    /// The second allocator (on the same device), by `action % 5`: 0 allocates
    /// `BURST_SIZES[index % 8]` on slot `index / 8 % STREAM_SLOTS`; 1 drops one of its
    /// buffers; 2 runs a kernel over one of its buffers on slot `index % STREAM_SLOTS`, ordered
    /// with `Buffer::use_on`; 3 gives a buffer to the allocator that did not make it in
    /// `free_batch` (refused: freed by its own); 4 in `record_stream` and `use_on` (refused,
    /// nothing changes).
    Other { index: u8, action: u8 },
    /// A bound allocation of `bytes` in the open scope, read by a kernel on `stream` (when
    /// `used`, announced with `Scope::record_stream`), then `mem::forget`ten: the scope takes it
    /// back at its exit, after the read.
    ScopeForget { bytes: u64, used: bool, stream: u8 },
    /// A CUDA-graph capture on `stream` (slot 0, the default stream, cannot be captured: slot 1
    /// instead), whole in this step: two allocations of `bytes` from the graph's pool, a
    /// captured kernel over each (the second reading the first), the first freed during the
    /// capture; with `fork` naming another slot, that stream joins the capture (a wait on an
    /// event recorded on the capturing stream), allocates `bytes` there, reads the last captured
    /// block (a use recorded on the joined stream) and frees its block, and is joined back. The
    /// graph is launched `launches` times (0 to 2) and dropped with what it kept.
    ///
    /// With `panics`, the same work runs as the body of `Allocator::capture`, which panics at
    /// its end (the side stream joined back when `launches` is odd, left forked otherwise); the
    /// harness catches the panic, and the capture must be over for both streams with nothing of
    /// the graph's pool left once it is emptied.
    Capture { stream: u8, fork: u8, bytes: u64, launches: u8, panics: bool },
}

/// The device calls [`Op::FailNth`] refuses once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NthFault {
    /// `SimDevice::fail_nth_malloc` alone.
    Malloc,
    /// `SimDevice::fail_nth_vm_create` alone (a physical allocation).
    VmCreate,
    /// `SimDevice::fail_nth_vm_map` alone.
    VmMap,
    /// `SimDevice::fail_nth_vm_unmap` (the mapping stays).
    VmUnmap,
    /// `SimDevice::fail_nth_event_create`.
    EventCreate,
}

/// [`Op::FailNth`]'s faults, by the selector `byte / 5 % 6` less one.
pub const NTH_FAULTS: [NthFault; 5] = [
    NthFault::Malloc,
    NthFault::VmCreate,
    NthFault::VmMap,
    NthFault::VmUnmap,
    NthFault::EventCreate,
];

/// The event calls [`Op::FailEvents`] refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventFault {
    /// `SimDevice::fail_event_records`.
    Records,
    /// `SimDevice::fail_event_waits`.
    Waits,
    /// `SimDevice::panic_on_faults`: the injected event faults panic in the device.
    Panic,
}

/// [`Op::FailEvents`]'s faults, by the selector `byte >> 1 & 3` less one.
pub const EVENT_FAULTS: [EventFault; 3] =
    [EventFault::Records, EventFault::Waits, EventFault::Panic];

/// Most bound allocations of one [`Op::ScopeBurst`].
pub const MAX_BURST: u8 = 8;

/// Request sizes of [`Op::ScopeBurst`] (a mix of small- and large-pool sizes, some that round
/// to the same block).
pub const BURST_SIZES: [u64; 8] =
    [512, 1000, 4096, 65_536, MIB - 100, 2 * MIB + 1, 5 * MIB, 12 * MIB + 3];

/// Operation kinds, without operands (an index into `TAGS` picks one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Alloc,
    Free,
    RecordStream,
    Launch,
    Sleep,
    WaitEvent,
    Synchronize,
    DeviceSynchronize,
    EmptyCache,
    ReleasePersistent,
    ReleaseStream,
    DestroyStream,
    SetConfig,
    FailNthMalloc,
    FailMallocsAbove,
    FailEventQueries,
    Inspect,
    ScopeEnter,
    ScopeAlloc,
    ScopeBurst,
    ScopeExit,
    Other,
    ScopeForget,
    Capture,
}

/// The tag table: how often each kind is decoded (64 entries, so each gets 4 of 256 bytes).
///
/// The second half mirrors the first (the table had 32 entries before scopes), except for the
/// slots given to scope operations, so most inputs found before scopes existed keep their
/// meaning: every seed (tags below 32) and the committed crash artifact decode as before.
const TAGS: [Kind; 64] = {
    use Kind::*;
    [
        // 0..32: the original table.
        Alloc,
        Alloc,
        Alloc,
        Alloc,
        Alloc,
        Alloc,
        Alloc,
        Alloc,
        Free,
        Free,
        Free,
        Free,
        Free,
        Launch,
        Launch,
        Launch,
        Launch,
        RecordStream,
        RecordStream,
        Sleep,
        WaitEvent,
        Synchronize,
        DeviceSynchronize,
        EmptyCache,
        ReleasePersistent,
        ReleaseStream,
        DestroyStream,
        SetConfig,
        FailNthMalloc,
        FailMallocsAbove,
        FailEventQueries,
        Inspect,
        // 32..64: the same, with 9 slots taken by scope operations, 3 by the second
        // allocator and forgotten scoped buffers, and 1 by graph captures.
        Alloc,
        Alloc,
        Other,
        ScopeAlloc,
        ScopeAlloc,
        ScopeAlloc,
        ScopeAlloc,
        ScopeBurst,
        Free,
        Free,
        Free,
        Free,
        Other,
        Launch,
        Launch,
        Capture,
        ScopeForget,
        RecordStream,
        RecordStream,
        ScopeEnter,
        WaitEvent,
        ScopeExit,
        DeviceSynchronize,
        EmptyCache,
        ScopeEnter,
        ReleaseStream,
        DestroyStream,
        SetConfig,
        FailNthMalloc,
        ScopeExit,
        FailEventQueries,
        Inspect,
    ]
};

// A tag byte picks `TAGS[byte % TAGS.len()]`: every kind keeps its share of the 256 bytes only
// if the length divides 256.
const _: () = assert!(256 % TAGS.len() == 0, "TAGS.len() must divide 256");

/// A decoded program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    /// Index into [`CAPACITIES`].
    pub capacity: u8,
    /// Index into [`CONFIGS`] for the allocator's first configuration.
    pub config: u8,
    /// At the end, release every cached segment explicitly (and check that it empties the
    /// allocator) before dropping it, instead of leaving it all to the allocator's `Drop`.
    pub explicit_teardown: bool,
    /// Start the program's streams past the allocator's 64 fast-path slots: before the first
    /// step, streams whose slots the program's streams then share are used and destroyed
    /// through the allocator, behind its back on the device, and through the second
    /// allocator, so the program's streams re-tag those slots' lanes (and the fourth one's
    /// first slot is the live default stream's). Bit 1 of the teardown byte: what [`Program::encode`]
    /// wrote before the flag existed decodes as before (raw fuzzer inputs with the bit set
    /// now take the head start).
    pub late_streams: bool,
    /// Run on a device with its sanitizer off, as on a real GPU: hits and frees then take the
    /// inlined paths that the sanitizer's hooks bypass (every check but the sanitizer's still
    /// applies). Bit 2 of the teardown byte, so what was encoded before decodes as before.
    pub quiet: bool,
    /// At the end, drop the allocators' handles first and then the buffers one by one: the
    /// allocators close (`closed.rs`) and each buffer's segment or pages must go back as it goes.
    /// Bit 3 of the teardown byte, so what was encoded before decodes as before.
    pub handles_first: bool,
    /// The steps, in order.
    pub ops: Vec<Op>,
}

fn slot(input: &mut Input) -> u8 {
    input.u8() % STREAM_SLOTS
}

fn sleep(input: &mut Input) -> u8 {
    SLEEPS_US[input.below(SLEEPS_US.len())]
}

fn size(input: &mut Input) -> u64 {
    match input.below(5) {
        0 => u64::from(input.u16()) % 1025,
        1 => 1 + u64::from(input.u32()) % MIB,
        2 => MIB + 1 + u64::from(input.u32()) % (9 * MIB),
        3 => 9 * MIB + u64::from(input.u32()) % (2 << 30),
        _ => match input.below(ABSURD.len() + 1) {
            i if i < ABSURD.len() => ABSURD[i],
            _ => input.u64(),
        },
    }
}

/// Writes `bytes` as the raw `u64` of the absurd class (any size decodes back this way).
fn raw_size(o: &mut Output, bytes: u64) {
    o.choice(4);
    o.choice(ABSURD.len());
    o.u64(bytes);
}

/// Writes `bytes` in the smallest size class that decodes back to it (3 to 11 bytes), so that
/// seeds with many scoped allocations stay within the fuzzer's input length.
fn compact_size(o: &mut Output, bytes: u64) {
    let class = |o: &mut Output, c: usize, v: u64| {
        o.choice(c);
        o.u32(u32::try_from(v).expect("fits its class"));
    };
    match bytes {
        0..=1024 => {
            o.choice(0);
            o.u16(bytes as u16);
        }
        _ if bytes <= MIB => class(o, 1, bytes - 1),
        _ if bytes <= 10 * MIB => class(o, 2, bytes - MIB - 1),
        _ if bytes < 9 * MIB + (2 << 30) => class(o, 3, bytes - 9 * MIB),
        _ => raw_size(o, bytes),
    }
}

fn index_of<T: PartialEq>(table: &[T], v: &T) -> usize {
    table.iter().position(|x| x == v).expect("a value from the table")
}

impl Op {
    /// Whether the step calls the allocator. Those that do not (device work, device-side waits,
    /// fault injection) cannot change its state: it has no thread of its own and only changes in
    /// its own calls.
    pub fn calls_allocator(&self) -> bool {
        !matches!(
            self,
            Op::Sleep { .. }
                | Op::WaitEvent { .. }
                | Op::DeviceSynchronize
                | Op::FailNthMalloc { .. }
                | Op::FailMallocsAbove { .. }
                | Op::FailEventQueries { .. }
                | Op::FailNth { .. }
                | Op::VirtualRoom { .. }
                | Op::FailEvents { .. }
        )
    }
}

impl Program {
    /// Decodes a program; every byte string is one.
    pub fn decode(data: &[u8]) -> Program {
        let mut input = Input::new(data);
        let capacity = input.below(CAPACITIES.len()) as u8;
        let config = input.below(CONFIGS.len()) as u8;
        let flags = input.u8();
        let (explicit_teardown, late_streams) = (flags & 1 == 1, flags & 2 == 2);
        let (quiet, handles_first) = (flags & 4 == 4, flags & 8 == 8);
        let mut ops = Vec::new();
        while !input.is_empty() && ops.len() < MAX_OPS {
            let i = &mut input;
            ops.push(match TAGS[i.below(TAGS.len())] {
                Kind::Alloc => Op::Alloc { bytes: size(i), stream: slot(i), persistent: i.bool() },
                Kind::Free => Op::Free { index: i.u8() },
                Kind::RecordStream => Op::RecordStream { index: i.u8(), stream: slot(i) },
                Kind::Launch => Op::Launch {
                    index: i.u8(),
                    stream: slot(i),
                    write: i.bool(),
                    sleep_us: sleep(i),
                },
                Kind::Sleep => Op::Sleep { stream: slot(i), sleep_us: sleep(i) },
                Kind::WaitEvent => Op::WaitEvent { from: slot(i), to: slot(i) },
                Kind::Synchronize => Op::Synchronize,
                Kind::DeviceSynchronize => Op::DeviceSynchronize,
                Kind::EmptyCache => Op::EmptyCache,
                Kind::ReleasePersistent => Op::ReleasePersistent,
                Kind::ReleaseStream => Op::ReleaseStream { stream: slot(i) },
                Kind::DestroyStream => Op::DestroyStream { stream: slot(i) },
                Kind::SetConfig => Op::SetConfig { config: i.below(CONFIGS.len()) as u8 },
                Kind::FailNthMalloc => {
                    let b = i.u8();
                    match usize::from(b / 5 % 6) {
                        0 => Op::FailNthMalloc { n: b % 5 },
                        k => Op::FailNth { fault: NTH_FAULTS[k - 1], n: b % 5 },
                    }
                }
                Kind::FailMallocsAbove => {
                    let b = usize::from(i.u8());
                    let limit = FAIL_ABOVE[b % FAIL_ABOVE.len()];
                    match b / FAIL_ABOVE.len() % 2 {
                        0 => Op::FailMallocsAbove { limit },
                        _ => Op::VirtualRoom { room: limit },
                    }
                }
                Kind::FailEventQueries => {
                    let b = i.u8();
                    let on = b & 1 == 1;
                    match usize::from(b >> 1 & 3) {
                        0 => Op::FailEventQueries { on },
                        k => Op::FailEvents { fault: EVENT_FAULTS[k - 1], on },
                    }
                }
                Kind::Inspect => Op::Inspect { summary: i.u8().is_multiple_of(8) },
                Kind::ScopeEnter => Op::ScopeEnter { stream: slot(i), named: i.bool() },
                Kind::ScopeAlloc => Op::ScopeAlloc { bytes: size(i) },
                Kind::ScopeBurst => Op::ScopeBurst { n: 1 + i.u8() % MAX_BURST, seed: i.u32() },
                Kind::ScopeExit => Op::ScopeExit,
                Kind::Other => Op::Other { index: i.u8(), action: i.u8() % 5 },
                Kind::Capture => {
                    let (stream, fork, bytes, l) = (slot(i), slot(i), size(i), i.u8());
                    // One byte for both: `launches` as before, and one in seven panics.
                    Op::Capture { stream, fork, bytes, launches: l % 3, panics: l % 7 == 6 }
                }
                Kind::ScopeForget => {
                    Op::ScopeForget { bytes: size(i), used: i.bool(), stream: slot(i) }
                }
            });
        }
        Program { capacity, config, explicit_teardown, late_streams, quiet, handles_first, ops }
    }

    /// The bytes that decode to this program. Operands must be in range (slots below
    /// [`STREAM_SLOTS`], sleeps and limits from their tables, `n` below 5 for
    /// [`Op::FailNthMalloc`] and in `1..=MAX_BURST` for [`Op::ScopeBurst`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut o = Output::new();
        o.choice(usize::from(self.capacity));
        o.choice(usize::from(self.config));
        o.u8(u8::from(self.explicit_teardown)
            | u8::from(self.late_streams) << 1
            | u8::from(self.quiet) << 2
            | u8::from(self.handles_first) << 3);
        let tag = |o: &mut Output, k: Kind| o.choice(index_of(&TAGS, &k));
        let sleep = |o: &mut Output, us: u8| o.choice(index_of(&SLEEPS_US, &us));
        for op in &self.ops {
            match *op {
                Op::Alloc { bytes, stream, persistent } => {
                    tag(&mut o, Kind::Alloc);
                    raw_size(&mut o, bytes);
                    o.u8(stream);
                    o.bool(persistent);
                }
                Op::Free { index } => {
                    tag(&mut o, Kind::Free);
                    o.u8(index);
                }
                Op::RecordStream { index, stream } => {
                    tag(&mut o, Kind::RecordStream);
                    o.u8(index);
                    o.u8(stream);
                }
                Op::Launch { index, stream, write, sleep_us } => {
                    tag(&mut o, Kind::Launch);
                    o.u8(index);
                    o.u8(stream);
                    o.bool(write);
                    sleep(&mut o, sleep_us);
                }
                Op::Sleep { stream, sleep_us } => {
                    tag(&mut o, Kind::Sleep);
                    o.u8(stream);
                    sleep(&mut o, sleep_us);
                }
                Op::WaitEvent { from, to } => {
                    tag(&mut o, Kind::WaitEvent);
                    o.u8(from);
                    o.u8(to);
                }
                Op::Synchronize => tag(&mut o, Kind::Synchronize),
                Op::DeviceSynchronize => tag(&mut o, Kind::DeviceSynchronize),
                Op::EmptyCache => tag(&mut o, Kind::EmptyCache),
                Op::ReleasePersistent => tag(&mut o, Kind::ReleasePersistent),
                Op::ReleaseStream { stream } => {
                    tag(&mut o, Kind::ReleaseStream);
                    o.u8(stream);
                }
                Op::DestroyStream { stream } => {
                    tag(&mut o, Kind::DestroyStream);
                    o.u8(stream);
                }
                Op::SetConfig { config } => {
                    tag(&mut o, Kind::SetConfig);
                    o.u8(config);
                }
                Op::FailNthMalloc { n } => {
                    tag(&mut o, Kind::FailNthMalloc);
                    o.u8(n);
                }
                Op::FailNth { fault, n } => {
                    tag(&mut o, Kind::FailNthMalloc);
                    o.u8(n + 5 * (1 + index_of(&NTH_FAULTS, &fault) as u8));
                }
                Op::FailMallocsAbove { limit } => {
                    tag(&mut o, Kind::FailMallocsAbove);
                    o.choice(index_of(&FAIL_ABOVE, &limit));
                }
                Op::VirtualRoom { room } => {
                    tag(&mut o, Kind::FailMallocsAbove);
                    o.choice(FAIL_ABOVE.len() + index_of(&FAIL_ABOVE, &room));
                }
                Op::FailEventQueries { on } => {
                    tag(&mut o, Kind::FailEventQueries);
                    o.bool(on);
                }
                Op::FailEvents { fault, on } => {
                    tag(&mut o, Kind::FailEventQueries);
                    o.u8((1 + index_of(&EVENT_FAULTS, &fault) as u8) << 1 | u8::from(on));
                }
                Op::Inspect { summary } => {
                    tag(&mut o, Kind::Inspect);
                    o.u8(if summary { 0 } else { 1 });
                }
                Op::ScopeEnter { stream, named } => {
                    tag(&mut o, Kind::ScopeEnter);
                    o.u8(stream);
                    o.bool(named);
                }
                Op::ScopeAlloc { bytes } => {
                    tag(&mut o, Kind::ScopeAlloc);
                    compact_size(&mut o, bytes);
                }
                Op::ScopeBurst { n, seed } => {
                    tag(&mut o, Kind::ScopeBurst);
                    o.u8(n.checked_sub(1).expect("a burst of at least one buffer"));
                    o.u32(seed);
                }
                Op::ScopeExit => tag(&mut o, Kind::ScopeExit),
                Op::Other { index, action } => {
                    tag(&mut o, Kind::Other);
                    o.u8(index);
                    o.u8(action);
                }
                Op::ScopeForget { bytes, used, stream } => {
                    tag(&mut o, Kind::ScopeForget);
                    compact_size(&mut o, bytes);
                    o.bool(used);
                    o.u8(stream);
                }
                Op::Capture { stream, fork, bytes, launches, panics } => {
                    tag(&mut o, Kind::Capture);
                    o.u8(stream);
                    o.u8(fork);
                    compact_size(&mut o, bytes);
                    // The byte ≡ launches (mod 3), and ≡ 6 (mod 7) exactly when it panics.
                    let l = launches % 3;
                    o.u8(if panics { [6, 13, 20][usize::from(l)] } else { l });
                }
            }
        }
        o.into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kind() -> Program {
        Program {
            capacity: 2,
            config: 5,
            explicit_teardown: true,
            late_streams: true,
            quiet: true,
            handles_first: true,
            ops: vec![
                Op::Alloc { bytes: 0, stream: 0, persistent: false },
                Op::Alloc { bytes: u64::MAX, stream: 2, persistent: true },
                Op::Alloc { bytes: 12345, stream: 1, persistent: false },
                Op::Free { index: 200 },
                Op::RecordStream { index: 1, stream: 2 },
                Op::Launch { index: 7, stream: 2, write: true, sleep_us: 5 },
                Op::Sleep { stream: 1, sleep_us: 1 },
                Op::WaitEvent { from: 1, to: 2 },
                Op::Synchronize,
                Op::DeviceSynchronize,
                Op::EmptyCache,
                Op::ReleasePersistent,
                Op::ReleaseStream { stream: 2 },
                Op::DestroyStream { stream: 2 },
                Op::SetConfig { config: 8 },
                Op::FailNthMalloc { n: 4 },
                Op::FailMallocsAbove { limit: Some(MIB) },
                Op::FailMallocsAbove { limit: None },
                Op::FailEventQueries { on: true },
                Op::FailNth { fault: NthFault::VmUnmap, n: 2 },
                Op::FailNth { fault: NthFault::EventCreate, n: 4 },
                Op::FailNth { fault: NthFault::Malloc, n: 0 },
                Op::FailNth { fault: NthFault::VmCreate, n: 1 },
                Op::FailNth { fault: NthFault::VmMap, n: 3 },
                Op::VirtualRoom { room: Some(MIB) },
                Op::VirtualRoom { room: None },
                Op::FailEvents { fault: EventFault::Records, on: true },
                Op::FailEvents { fault: EventFault::Waits, on: false },
                Op::FailEvents { fault: EventFault::Panic, on: true },
                Op::Inspect { summary: true },
                Op::Inspect { summary: false },
                Op::ScopeEnter { stream: 1, named: true },
                Op::ScopeAlloc { bytes: 3 * MIB },
                Op::ScopeBurst { n: 1, seed: 0 },
                Op::ScopeBurst { n: MAX_BURST, seed: u32::MAX },
                Op::ScopeExit,
                Op::ScopeEnter { stream: 0, named: false },
                Op::Other { index: 9, action: 0 },
                Op::Other { index: 200, action: 4 },
                Op::ScopeForget { bytes: 4096, used: true, stream: 2 },
                Op::ScopeForget { bytes: 5 * MIB, used: false, stream: 0 },
                Op::Capture { stream: 1, fork: 2, bytes: 4096, launches: 2, panics: false },
                Op::Capture { stream: 0, fork: 0, bytes: u64::MAX, launches: 0, panics: false },
                Op::Capture { stream: 2, fork: 1, bytes: 4096, launches: 1, panics: true },
                Op::Capture { stream: 1, fork: 0, bytes: 3 * MIB, launches: 2, panics: true },
            ],
        }
    }

    #[test]
    fn encode_then_decode_is_the_identity() {
        let p = every_kind();
        assert_eq!(Program::decode(&p.encode()), p);
    }

    #[test]
    fn every_byte_string_decodes_and_ops_are_capped() {
        let empty = Program::decode(&[]);
        assert_eq!(
            empty,
            Program {
                capacity: 0,
                config: 0,
                explicit_teardown: false,
                late_streams: false,
                quiet: false,
                handles_first: false,
                ops: vec![]
            }
        );
        let long = Program::decode(&[0xab; 10_000]);
        assert_eq!(long.ops.len(), MAX_OPS);
        for seed in 0..=255u8 {
            let bytes: Vec<u8> =
                (0..64u8).map(|i| seed.wrapping_mul(31).wrapping_add(i.wrapping_mul(7))).collect();
            let p = Program::decode(&bytes);
            for op in &p.ops {
                if let Op::Alloc { stream, .. }
                | Op::Launch { stream, .. }
                | Op::ScopeEnter { stream, .. } = op
                {
                    assert!(*stream < STREAM_SLOTS);
                }
                if let Op::ScopeBurst { n, .. } = op {
                    assert!((1..=MAX_BURST).contains(n));
                }
            }
        }
    }

    #[test]
    fn the_second_half_of_the_tags_mirrors_the_first_but_for_scopes() {
        use Kind::*;
        let scoped = [ScopeEnter, ScopeAlloc, ScopeBurst, ScopeExit, Other, ScopeForget, Capture];
        let (old, new) = TAGS.split_at(32);
        for (i, (o, n)) in old.iter().zip(new).enumerate() {
            assert!(!scoped.contains(o), "slot {i}");
            assert!(o == n || scoped.contains(n), "slot {} is {n:?}, not {o:?}", i + 32);
        }
        for k in scoped {
            assert!(new.contains(&k), "{k:?} has no tag");
        }
    }

    #[test]
    fn compact_sizes_decode_back() {
        for bytes in [0, 1, 1024, 1025, MIB, MIB + 1, 10 * MIB, 10 * MIB + 1, (2 << 30) + 9 * MIB]
            .into_iter()
            .chain([(2 << 30) + 9 * MIB - 1, MAX_REQUEST, u64::MAX])
        {
            let mut o = Output::new();
            compact_size(&mut o, bytes);
            let data = o.into_bytes();
            assert_eq!(size(&mut Input::new(&data)), bytes, "{bytes}");
            if bytes < 9 * MIB + (2 << 30) {
                assert!(data.len() <= 5, "{bytes} takes {} bytes", data.len());
            }
        }
    }

    #[test]
    fn size_classes_cover_their_ranges() {
        let decode = |class: u8, raw: &[u8]| {
            let mut bytes = vec![class];
            bytes.extend_from_slice(raw);
            size(&mut Input::new(&bytes))
        };
        assert_eq!(decode(0, &[0, 0]), 0);
        assert_eq!(decode(0, &[0x00, 0x04]), 1024);
        assert_eq!(decode(1, &[0xff, 0xff, 0x0f, 0x00]), MIB);
        assert_eq!(decode(2, &[0, 0, 0, 0]), MIB + 1);
        assert!(decode(3, &[0xff; 4]) < 9 * MIB + (2 << 30));
        assert_eq!(decode(4, &[0]), u64::MAX);
        assert_eq!(decode(4, &[2]), MAX_REQUEST + 1);
        assert_eq!(decode(4, &[7, 1, 0, 0, 0, 0, 0, 0, 0]), 1);
    }
}
