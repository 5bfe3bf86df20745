//! Differential: the same seeded sequence of operations on two allocators, each over its own
//! `SimDevice` of the same capacity, one with a configuration X and one with X +
//! `global_lock:true` (PyTorch's one lock: no stream caches, no large-block reuse check). The
//! fast path must hand out the block the locked path would, and every statistic must be the
//! locked path's, after every step.

//! Cases marked `ignore` differ by design (the reason is in the attribute): run one with
//! `--ignored`. `DIFF_SEED=n DIFF_MIN=1 DIFF_TRACE_MIN=1` minimises a seed and traces both
//! sides; `DIFF_SEEDS`, `DIFF_SEED_FROM`, `DIFF_STEPS` set how many seeds, the first, and the
//! steps (a sweep: `DIFF_SEEDS=1000 DIFF_SEED_FROM=1000`); `DIFF_TRACE_MIN=segments` prints the
//! segments too, but a snapshot flushes the stream caches, which can hide a difference.
//! Intended differences are left out of the comparison where they are made (`addr`,
//! `comparable`, `Gen::op`, `Case::cap_drift`).
//!
//! Kernels (`Op::Kernel`) stay unfinished until an `Op::Complete` opens their gates, on both
//! sides at the same step. A step that waits on the host for one is run again (`run_ops`).

mod common;

use common::Rng;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use tidepool::MIB;
use tidepool::device::{AccessKind, Launch, SimDevice};
use tidepool::{
    AllocError, Allocator, BlockState, Buffer, Config, Device, MemPool, MemoryStats, PoolKind,
    PoolOptions, Residency, SegmentInfo, StreamId,
};

struct Side {
    dev: Arc<SimDevice>,
    alloc: Allocator<SimDevice>,
    streams: Vec<StreamId>,
    live: Vec<Buffer<SimDevice>>,
    pools: Vec<MemPool<SimDevice>>,
    gates: Arc<Mutex<Vec<mpsc::Sender<()>>>>,
    lock: bool,
}

/// `config` (no case sets `global_lock` itself), with the one lock or without.
fn with_lock(config: &str, lock: bool) -> Config {
    Config::parse(config).unwrap().with_global_lock(lock)
}

impl Side {
    fn new(config: &str, capacity: u64, lock: bool) -> Side {
        let dev = Arc::new(SimDevice::new(capacity));
        let streams =
            vec![StreamId::DEFAULT, dev.create_stream().unwrap(), dev.create_stream().unwrap()];
        let alloc = Allocator::new(dev.clone(), with_lock(config, lock)).unwrap();
        Side {
            dev,
            alloc,
            streams,
            live: Vec::new(),
            pools: Vec::new(),
            gates: Default::default(),
            lock,
        }
    }
}

fn kind(e: &AllocError) -> String {
    let d = format!("{e:?}");
    d.split(|c: char| !c.is_alphanumeric()).next().unwrap_or("").to_string()
}

/// A large block's address; a small block's placement is the lanes' (last freed first, not
/// best fit: `docs/design-notes.md`, "`caching` against an independent model of PyTorch"), so
/// only its size is compared.
/// Where small requests are made, the drift reaches segment addresses too (a small segment
/// more or less moves the device's next reservation), so then only sizes are compared.
fn addr(b: &Buffer<SimDevice>) -> u64 {
    if b.block_size() > MIB && !SMALL.with(|s| s.get()) { b.ptr().0 } else { b.block_size() }
}

thread_local! {
    static SMALL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// What a step did on one side: addresses handed out, errors by kind.
type Outcome = Vec<Result<u64, String>>;

#[derive(Clone, Debug)]
enum Op {
    Alloc { s: usize, bytes: u64, persistent: bool },
    Free(usize),
    FreeBatch(Vec<usize>),
    Record { b: usize, s: usize },
    UseOn { b: usize, s: usize, write: bool },
    Kernel { b: usize },
    Complete,
    EmptyCache,
    ReleaseStream(usize),
    DestroyStream(usize),
    ResetPeaks,
    SetConfig(usize),
    PoolRun { s: usize, sizes: Vec<u64>, new: bool },
    ScopeRun { s: usize, name: Option<u8>, sizes: Vec<u64>, unbound: Vec<bool> },
    Synchronize,
}

struct Gen {
    rng: Rng,
    small: bool,
    large: bool,
    kernels: bool,
    records: bool,
    configs: usize,
    capacity: u64,
}

impl Gen {
    fn size(&mut self) -> u64 {
        let r = &mut self.rng;
        let pick = r.below(100);
        if self.small && (!self.large || pick < 45) {
            return match r.below(4) {
                0 => 512 * (1 + r.below(8)),
                1 => 1 + r.below(MIB),
                2 => MIB,
                _ => 4096 * (1 + r.below(64)),
            };
        }
        match r.below(10) {
            // Near the capacity, where small segments do not drift (see `addr`).
            0 if !self.small => self.capacity / 2 + r.below(self.capacity / 2),
            0 => MIB * (1 + r.below(60)),
            1 => MIB + 1 + r.below(MIB),
            2..=4 => MIB * (2 + r.below(8)),
            5..=7 => MIB * (1 + r.below(40)) + 512 * r.below(4),
            _ => 2 * MIB * (1 + r.below(12)),
        }
    }

    fn op(&mut self, live: usize) -> Op {
        let n = live.max(1) as u64;
        let x = self.rng.below(100);
        let s = self.rng.below(3) as usize;
        match x {
            0..=39 => {
                let bytes = self.size();
                Op::Alloc { s, bytes, persistent: self.rng.below(8) == 0 }
            }
            40..=64 => Op::Free(self.rng.below(n) as usize),
            65..=67 => {
                let k = 1 + self.rng.below(4);
                Op::FreeBatch((0..k).map(|_| self.rng.below(n) as usize).collect())
            }
            68..=71 if self.records => Op::Record { b: self.rng.below(n) as usize, s },
            72..=74 if self.records => {
                Op::UseOn { b: self.rng.below(n) as usize, s, write: self.rng.below(2) == 0 }
            }
            75..=77 if self.kernels => Op::Kernel { b: self.rng.below(n) as usize },
            78..=79 if self.kernels => Op::Complete,
            80 => Op::EmptyCache,
            81 => Op::ReleaseStream(s),
            82 => Op::DestroyStream(1 + self.rng.below(2) as usize),
            83..=84 => Op::ResetPeaks,
            85 if self.configs > 1 => Op::SetConfig(self.rng.below(self.configs as u64) as usize),
            86..=88 => {
                let k = 1 + self.rng.below(4);
                let sizes = (0..k).map(|_| self.size()).collect();
                Op::PoolRun { s, sizes, new: self.rng.below(3) == 0 }
            }
            89..=93 => {
                let k = 1 + self.rng.below(5);
                let sizes: Vec<u64> = (0..k).map(|_| self.size()).collect();
                let unbound = sizes.iter().map(|_| self.rng.below(3) == 0).collect();
                // A learning run's region is adopted from its segments, blocks and all: where
                // small placement drifts, so do the region's block counts.
                let name = match self.rng.below(3) {
                    _ if self.small => None,
                    0 => None,
                    _ => Some(self.rng.below(2) as u8),
                };
                Op::ScopeRun { s, name, sizes, unbound }
            }
            94 => Op::Synchronize,
            _ => Op::Free(self.rng.below(n) as usize),
        }
    }
}

fn res(
    r: Result<Buffer<SimDevice>, AllocError>,
    out: &mut Outcome,
    live: &mut Vec<Buffer<SimDevice>>,
) {
    match r {
        Ok(b) => {
            out.push(Ok(addr(&b)));
            live.push(b);
        }
        Err(e) => out.push(Err(kind(&e))),
    }
}

fn unit(r: Result<(), AllocError>) -> Result<u64, String> {
    r.map(|()| 0).map_err(|e| kind(&e))
}

impl Side {
    fn complete(&mut self) {
        for g in self.gates.lock().unwrap().drain(..) {
            let _ = g.send(());
        }
        self.dev.synchronize().unwrap();
    }

    /// Whether `op` may reach the out-of-memory ladder (or a collection), which waits on the
    /// host: then the gated kernels are completed first. Decided on the locked side and applied
    /// to both (`run_once`), so both see the same completion state.
    fn near_room(&self, op: &Op, room: u64) -> bool {
        let need = match op {
            Op::Alloc { bytes, .. } => *bytes,
            Op::PoolRun { sizes, .. } | Op::ScopeRun { sizes, .. } => sizes.iter().sum(),
            _ => 0,
        };
        need > 0
            && self.alloc.stats().blocks.reserved_bytes.all.current + 2 * need + 64 * MIB > room
    }

    fn run(&mut self, op: &Op, configs: &[&str]) -> Outcome {
        let mut out = Vec::new();
        match op {
            Op::Alloc { s, bytes, persistent } => {
                let r = if *persistent { Residency::Persistent } else { Residency::Transient };
                let r = self.alloc.alloc_in(*bytes, self.streams[*s], r);
                res(r, &mut out, &mut self.live);
            }
            Op::Free(i) => {
                if !self.live.is_empty() {
                    let i = i % self.live.len();
                    drop(self.live.swap_remove(i));
                }
            }
            Op::FreeBatch(is) => {
                let mut batch = Vec::new();
                for i in is {
                    if !self.live.is_empty() {
                        let i = i % self.live.len();
                        batch.push(self.live.swap_remove(i));
                    }
                }
                out.push(unit(self.alloc.free_batch(batch)));
            }
            Op::Record { b, s } => {
                if !self.live.is_empty() {
                    let b = &self.live[b % self.live.len()];
                    out.push(unit(b.record_stream(self.streams[*s])));
                }
            }
            Op::UseOn { b, s, write } => {
                if !self.live.is_empty() {
                    let b = &self.live[b % self.live.len()];
                    let k = if *write { AccessKind::Write } else { AccessKind::Read };
                    out.push(unit(b.use_on(self.streams[*s], k)));
                }
            }
            Op::Kernel { b } => {
                if !self.live.is_empty() {
                    let b = &self.live[b % self.live.len()];
                    let (k, g) = common::gated(b.ptr(), b.len().max(1), AccessKind::Write);
                    out.push(
                        self.dev.launch(b.stream(), k).map(|()| 0).map_err(|e| format!("{e}")),
                    );
                    self.gates.lock().unwrap().push(g);
                }
            }
            Op::Complete => self.complete(),
            Op::EmptyCache => {
                self.complete();
                out.push(unit(self.alloc.empty_cache()));
            }
            Op::ReleaseStream(s) => {
                self.complete();
                out.push(unit(self.alloc.release_stream(self.streams[*s])));
            }
            Op::DestroyStream(s) => {
                self.complete();
                let old = self.streams[*s];
                // Buffers of the stream are freed first (destroying a stream in use is refused).
                let mut keep = Vec::new();
                for b in self.live.drain(..) {
                    if b.stream() == old {
                        drop(b);
                    } else {
                        keep.push(b);
                    }
                }
                self.live = keep;
                out.push(unit(self.alloc.destroy_stream(old)));
                self.streams[*s] = self.dev.create_stream().unwrap();
                out.push(Ok(self.streams[*s].0 as u64));
            }
            Op::ResetPeaks => self.alloc.reset_peak_stats(),
            Op::SetConfig(i) => {
                self.complete();
                self.alloc.set_config(with_lock(configs[*i], self.lock)).unwrap();
            }
            Op::PoolRun { s, sizes, new } => {
                if *new || self.pools.is_empty() {
                    self.pools.push(self.alloc.new_pool(PoolOptions::default()).unwrap());
                }
                let pool = self.pools.last().unwrap().clone();
                let guard = self.alloc.use_pool(&pool, self.streams[*s]).unwrap();
                for &b in sizes {
                    let r = self.alloc.alloc(b, self.streams[*s]);
                    res(r, &mut out, &mut self.live);
                }
                drop(guard);
                if self.pools.len() > 2 {
                    self.pools.remove(0);
                }
            }
            Op::ScopeRun { s, name, sizes, unbound } => {
                let stream = self.streams[*s];
                let names = ["a", "b"];
                let scope = match name {
                    Some(n) => self.alloc.named_scope(names[*n as usize], stream),
                    None => self.alloc.scope(stream),
                };
                let mut held = Vec::new();
                for (i, (&b, &u)) in sizes.iter().zip(unbound).enumerate() {
                    if u {
                        match scope.alloc_unbound(b) {
                            Ok(buf) => {
                                out.push(Ok(addr(&buf)));
                                self.live.push(buf);
                            }
                            Err(e) => out.push(Err(kind(&e))),
                        }
                    } else {
                        match scope.alloc(b) {
                            Ok(buf) => {
                                out.push(Ok(if b > MIB && !SMALL.with(|s| s.get()) {
                                    buf.ptr().0
                                } else {
                                    b
                                }));
                                if i % 2 == 0 {
                                    held.push(buf);
                                }
                            }
                            Err(e) => out.push(Err(kind(&e))),
                        }
                    }
                }
                drop(held);
                drop(scope);
            }
            Op::Synchronize => {
                self.complete();
                out.push(unit(self.alloc.synchronize()));
            }
        }
        out
    }
}

/// The statistics the two paths must agree on: all but the lock's own counters and the
/// lanes' held bytes.
fn comparable(mut s: MemoryStats, active: bool, small: bool) -> MemoryStats {
    if small {
        // Small blocks waiting in lanes do not coalesce, so small placement drifts and the
        // small pool may reserve another segment ("What the stream caches cost in memory").
        s.blocks.reserved_bytes.small_pool = Default::default();
        s.blocks.segment.small_pool = Default::default();
        for g in [&mut s.blocks.reserved_bytes, &mut s.blocks.segment] {
            g.all = g.large_pool;
            g.transient = Default::default();
            g.persistent = Default::default();
        }
        s.num_device_alloc = 0;
        s.num_device_free = 0;
        s.num_host_syncs = 0; // segments released
        s.cached_free_bytes_per_stream.clear();
    }
    s.locked_allocations = 0;
    s.best_fit_searches = 0;
    s.cached_fast_bytes = 0;
    // A block waiting in a lane is allocated in the pool's view, kept from coalescing
    // (`tests/large_reuse.rs` pins the split remainder this leaves).
    s.blocks.inactive_split_bytes = Default::default();
    s.blocks.inactive_split = Default::default();
    if !active {
        s.blocks.active_bytes = Default::default();
        s.blocks.active = Default::default();
    }
    s
}

/// What moves when an allocation climbs the out-of-memory ladder: its retry, its failure, its
/// wait for every event (a routed request's call on the general allocator waits too), and its
/// first rung, the release of cached oversize segments (PyTorch's
/// `release_available_cached_blocks`, which counts in no counter of its own and may serve the
/// request with no retry: seed 723 of `switching_sizing_mixed`, where a 40 MiB oversize
/// segment went on the side whose small segments had left less room).
fn ladder_mark(s: &MemoryStats) -> u64 {
    s.num_alloc_retries + s.num_ooms + s.num_sync_all_streams + s.oversize_segments.freed
}

/// A side's segments, the general allocator's (owner 0) and its private pools' (1, 2).
fn segments(side: &Side) -> Vec<(usize, SegmentInfo)> {
    let pools = side.pools.iter().enumerate().map(|(i, p)| (i + 1, p.snapshot()));
    std::iter::once((0, side.alloc.snapshot()))
        .chain(pools)
        .flat_map(|(owner, snap)| snap.into_iter().map(move |s| (owner, s)))
        .collect()
}

/// The large segments, each with its blocks' sizes and states (no addresses: small drift moves
/// them), sorted.
fn large_layout(segs: &[(usize, SegmentInfo)]) -> Vec<String> {
    let mut out: Vec<String> = segs
        .iter()
        .filter(|(_, s)| s.pool == PoolKind::Large)
        .map(|(owner, s)| {
            let blocks: Vec<_> = s.blocks.iter().map(|b| (b.size, b.state)).collect();
            format!("{owner} {:?} {:?} {} {blocks:?}", s.stream, s.residency, s.size)
        })
        .collect();
    out.sort();
    out
}

/// What of the small segments can decide a step at the capacity, by owner, stream and
/// residency: how many there are (the device's free memory), how many are wholly free (what
/// the ladder can release), and the largest free block (whether a small request needs a new
/// segment).
fn small_room(segs: &[(usize, SegmentInfo)]) -> BTreeMap<String, (u64, u64, u64)> {
    let mut out = BTreeMap::new();
    for (owner, s) in segs.iter().filter(|(_, s)| s.pool == PoolKind::Small) {
        let free = s.blocks.iter().filter(|b| b.state == BlockState::Free).map(|b| b.size);
        let e: &mut (u64, u64, u64) =
            out.entry(format!("{owner} {:?} {:?}", s.stream, s.residency)).or_default();
        e.0 += 1;
        e.1 += u64::from(free.clone().sum::<u64>() == s.size);
        e.2 = e.2.max(free.max().unwrap_or(0));
    }
    out
}

/// Whether the lanes' small placement explains a difference that arose where the ladder ran
/// (`Case::cap_drift`) at `op`: `ops` (the steps before) replayed, both sides hold the same
/// large segments block for block, and either the small ones leave different room, or the
/// fast side's lanes hold small blocks back from coalescing: `op` run again after a flush of
/// those lanes (a snapshot's) gives both sides the same outcome and statistics. (Replayed: a
/// snapshot flushes the lanes, which would move what follows.)
fn small_drift(case: &Case, ops: &[Op], op: &Op) -> Result<(), String> {
    let mut fast = Side::new(case.configs[0], case.capacity, false);
    let mut locked = Side::new(case.configs[0], case.capacity, true);
    for op in ops {
        if locked.near_room(op, case.capacity.min(case.room)) {
            fast.complete();
            locked.complete();
        }
        fast.run(op, case.configs);
        locked.run(op, case.configs);
    }
    let (a, b) = (segments(&fast), segments(&locked));
    let r = if large_layout(&a) != large_layout(&b) {
        Err("the large segments differed before it".to_string())
    } else if small_room(&a) != small_room(&b) {
        Ok(())
    } else {
        // The same room once flushed: was it the lanes' holding back? Run the step after the
        // flush (the snapshots above, both sides alike) and compare.
        if locked.near_room(op, case.capacity.min(case.room)) {
            fast.complete();
            locked.complete();
        }
        let (x, y) = (fast.run(op, case.configs), locked.run(op, case.configs));
        // The statistics the run compares: the allocator's, then each private pool's.
        let compared = |s: &Side| {
            let active = !case.records;
            let pools = s.pools.iter().map(|p| comparable(p.stats(), active, case.small));
            std::iter::once(comparable(s.alloc.stats(), active, case.small))
                .chain(pools)
                .collect::<Vec<_>>()
        };
        if x == y && compared(&fast) == compared(&locked) {
            Ok(())
        } else {
            Err("the small segments left the same room before it, and the step differs after a \
                 flush of the lanes too"
                .to_string())
        }
    };
    fast.complete();
    locked.complete();
    r
}

/// Whether `fast` differs from `locked` only in peaks that a lock-free hit's unpolled events
/// can raise (`run_once`): those of active bytes, active blocks and requested bytes, each at
/// least the locked side's and above it by no more than what was pending on the fast side
/// before the step (`pending`: bytes, blocks).
fn lag_peaks_alone(fast: &MemoryStats, locked: &MemoryStats, pending: (u64, u64)) -> bool {
    let mut f = fast.clone();
    let (x, y) = (&mut f.blocks, &locked.blocks);
    for (g, h, bound) in [
        (&mut x.active_bytes, &y.active_bytes, pending.0),
        (&mut x.active, &y.active, pending.1),
        (&mut x.requested_bytes, &y.requested_bytes, pending.0),
    ] {
        for (a, b) in [
            (&mut g.all, &h.all),
            (&mut g.small_pool, &h.small_pool),
            (&mut g.large_pool, &h.large_pool),
            (&mut g.persistent, &h.persistent),
            (&mut g.transient, &h.transient),
        ] {
            if a.peak < b.peak || a.peak - b.peak > bound {
                return false;
            }
            a.peak = b.peak;
        }
    }
    f == *locked
}

/// The bytes and blocks freed but pending (waiting on events): active, not allocated.
fn pending(s: &MemoryStats) -> (u64, u64) {
    let b = &s.blocks;
    (
        b.active_bytes.all.current.saturating_sub(b.allocated_bytes.all.current),
        b.active.all.current.saturating_sub(b.allocation.all.current),
    )
}

fn diff(a: &MemoryStats, b: &MemoryStats) -> String {
    let (a, b) = (format!("{a:#?}"), format!("{b:#?}"));
    let (a, b): (Vec<_>, Vec<_>) = (a.lines().collect(), b.lines().collect());
    let mut ctx = Vec::new();
    let mut out = String::new();
    for (x, y) in a.iter().zip(&b) {
        let t = x.trim();
        if t.ends_with('{') || t.ends_with('[') || t.ends_with('(') {
            ctx.push(t.split(':').next().unwrap_or("").to_string());
        }
        if x != y {
            out += &format!("{}: fast {} / locked {}\n", ctx.join("."), t, y.trim());
        }
        if t.starts_with('}') || t.starts_with(']') || t.starts_with(')') {
            ctx.pop();
        }
    }
    out
}

struct Case<'a> {
    configs: &'a [&'a str],
    capacity: u64,
    /// What the configuration lets the allocator reserve (a memory limit).
    room: u64,
    small: bool,
    large: bool,
    kernels: bool,
    records: bool,
    steps: usize,
    /// Small placement drifts (see `addr`), and at the device's capacity that decides steps:
    /// whether a small request needs a new segment, whether a new segment fits, what the
    /// out-of-memory ladder can release (wholly free small segments), so whether it runs, what
    /// it frees and whether the request is served ("What the stream caches cost in memory").
    /// Where set, a difference that arises at a step where either side climbed the ladder ends
    /// the seed's comparison (the two sides part there, legitimately), provided a replay shows
    /// the large segments alike and the small ones leaving different room before that step,
    /// or the step itself alike once the fast side's lanes are flushed before it (small blocks
    /// a lane holds do not coalesce: seed 4132, `small_drift`); any other difference still
    /// fails. The cost: a bug in the ladder itself is caught by these cases on fewer seeds
    /// (`Broken::LadderUncounted`, 100 seeds of `default_mixed`: 8 instead of 13, with or
    /// without the flushed rerun), by the `_large` cases on every seed.
    cap_drift: bool,
}

fn run_case(case: &Case, seed: u64) -> Result<(), String> {
    let mut g = Gen {
        rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
        small: case.small,
        large: case.large,
        kernels: case.kernels,
        records: case.records,
        configs: case.configs.len(),
        capacity: case.capacity,
    };
    let r = run_ops(case, &mut |_, live| Some(g.op(live)), case.steps);
    match r {
        Ok(()) => Ok(()),
        Err((ops, e)) => {
            if std::env::var("DIFF_MIN").is_ok() {
                let min = minimise(case, ops);
                if let Ok(t) = std::env::var("DIFF_TRACE_MIN") {
                    unsafe { std::env::set_var("DIFF_TRACE", t) };
                }
                let r = match run_ops(case, &mut |i, _| min.get(i).cloned(), min.len()) {
                    Err(r) => r.1,
                    // (The trace's snapshots flush the stream caches.)
                    Ok(()) => "passes when replayed (traced with segments?)".to_string(),
                };
                return Err(format!("seed {seed}, minimised to {} steps: {r}", min.len()));
            }
            Err(format!("seed {seed}: {e}"))
        }
    }
}

/// Drops operations while the sequence still fails.
fn minimise(case: &Case, mut ops: Vec<Op>) -> Vec<Op> {
    let mut chunk = ops.len() / 2;
    while chunk >= 1 {
        let mut i = 0;
        while i < ops.len() {
            let mut trial = ops.clone();
            trial.drain(i..(i + chunk).min(ops.len()));
            let n = trial.len();
            if let Err((done, _)) = run_ops(case, &mut |k, _| trial.get(k).cloned(), n) {
                ops = done;
            } else {
                i += chunk;
            }
        }
        chunk /= 2;
    }
    ops
}

type Failure = (Vec<Op>, String);

/// How long a step's host wait may stay blocked before the watchdog takes it for a wait on a
/// gated kernel (an ungated kernel completes in well under a millisecond).
const STALL: std::time::Duration = std::time::Duration::from_millis(100);

/// Runs the sequence; where a step waits on the host for a gated kernel (a segment release,
/// `synchronize_event`, a ladder's sync: which steps do is the allocator's business), the
/// sequence is run again from the start with an `Op::Complete` before that step, until no
/// step stalls. The watchdog's opening of the gates mid-step is never compared: both sides
/// see the same kernels complete at the same step, and the log returned on a failure replays
/// the failing sequence (its added `Complete`s included) without the watchdog.
fn run_ops(
    case: &Case,
    next: &mut dyn FnMut(usize, usize) -> Option<Op>,
    steps: usize,
) -> Result<(), Failure> {
    // The operations to replay first (every one drawn from `next` but the added `Complete`s),
    // and how many of them were drawn.
    let (mut prefix, mut drawn) = (Vec::new(), 0);
    loop {
        match run_once(case, &prefix, drawn, next, steps) {
            Run::Done(r) => return r,
            Run::Stalled(mut log, taken) => {
                let stalled = log.pop().expect("a stalled step was logged");
                log.push(Op::Complete);
                log.push(stalled);
                (prefix, drawn) = (log, taken);
            }
        }
    }
}

enum Run {
    Done(Result<(), Failure>),
    /// A step waited on the host for a gated kernel: the log, the stalled step last, and how
    /// many of its operations were drawn from `next`.
    Stalled(Vec<Op>, usize),
}

fn run_once(
    case: &Case,
    prefix: &[Op],
    drawn: usize,
    next: &mut dyn FnMut(usize, usize) -> Option<Op>,
    steps: usize,
) -> Run {
    SMALL.with(|s| s.set(case.small));
    let mut fast = Side::new(case.configs[0], case.capacity, false);
    let mut locked = Side::new(case.configs[0], case.capacity, true);
    let mut log: Vec<Op> = Vec::new();
    // Step counter (two ticks a step, one a side), whether the watchdog had to open the
    // gates, and the end of the run.
    let watch = Arc::new((AtomicUsize::new(0), AtomicBool::new(false), AtomicBool::new(false)));
    let dog = {
        let (watch, gates) = (watch.clone(), [fast.gates.clone(), locked.gates.clone()]);
        let devs = [fast.dev.clone(), locked.dev.clone()];
        std::thread::spawn(move || {
            let mut last = (0, std::time::Instant::now());
            while !watch.2.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(5));
                let tick = watch.0.load(Ordering::Relaxed);
                // The clock runs only while the step's host thread is blocked in a
                // synchronisation: a step that is merely slow (a loaded machine preempting
                // it) is never taken for a stalled one, so a seed's sequence does not depend
                // on the machine's load.
                let blocked = devs.iter().any(|d| d.blocked_host_waits() > 0);
                if tick != last.0 || !blocked {
                    last = (tick, std::time::Instant::now());
                } else if last.1.elapsed() >= STALL
                    // With no gated kernel pending, no host wait can stall: a slow step.
                    && gates.iter().any(|g| !g.lock().unwrap().is_empty())
                {
                    watch.1.store(true, Ordering::Relaxed);
                    for g in &gates {
                        for g in g.lock().unwrap().drain(..) {
                            let _ = g.send(());
                        }
                    }
                }
            }
        })
    };
    let trace = std::env::var("DIFF_TRACE").is_ok();
    let mut stalled = false;
    let mut taken = drawn;
    // Each side's out-of-memory ladder counters after the last step, by pool (`ladder_mark`).
    let mut marks: [Vec<(u64, u64)>; 2] = Default::default();
    // What the fast side's allocator (0) and pools (by id) held pending after the last step.
    let mut held: Vec<(u64, (u64, u64))> = Vec::new();
    let r = (|| {
        let room = case.capacity.min(case.room);
        for step in 0.. {
            let op = match prefix.get(step) {
                Some(op) => op.clone(),
                None if taken >= steps => break,
                None => match next(taken, fast.live.len()) {
                    Some(op) => {
                        taken += 1;
                        op
                    }
                    None => break,
                },
            };
            log.push(op.clone());
            // One decision for both sides (the locked side's view), so both see the same
            // kernels complete.
            if locked.near_room(&op, room) {
                fast.complete();
                locked.complete();
            }
            watch.0.store(2 * step + 1, Ordering::Relaxed);
            let a = fast.run(&op, case.configs);
            watch.0.store(2 * step + 2, Ordering::Relaxed);
            if watch.1.load(Ordering::Relaxed) {
                stalled = true;
                return Ok(());
            }
            let b = locked.run(&op, case.configs);
            if watch.1.load(Ordering::Relaxed) {
                stalled = true;
                return Ok(());
            }
            if trace {
                for (w, side, o) in [("fast", &fast, &a), ("locked", &locked, &b)] {
                    let st = side.alloc.stats();
                    println!(
                        "{step} {w} {op:?} -> {o:x?} allocated {} reserved {} lanes {}",
                        st.blocks.allocated_bytes.all.current,
                        st.blocks.reserved_bytes.all.current,
                        st.cached_fast_bytes
                    );
                    // A snapshot flushes the stream caches, which moves later placement:
                    // only where asked for (`DIFF_TRACE=segments`).
                    if std::env::var("DIFF_TRACE").is_ok_and(|t| t != "segments") {
                        continue;
                    }
                    for seg in side.alloc.snapshot() {
                        let blocks: Vec<_> = seg
                            .blocks
                            .iter()
                            .map(|b| format!("{:x}+{:x}:{:?}", b.address.0, b.size, b.state))
                            .collect();
                        println!(
                            "   seg {:x} {:?} {:?} {blocks:?}",
                            seg.address.0, seg.stream, seg.residency
                        );
                    }
                }
            }
            // The first difference of outcomes or statistics; the invariants are checked
            // whatever it is (a `cap_drift` case may let it pass, below).
            let mut differs = None;
            if a != b {
                differs = Some(format!("outcomes differ: fast {a:?} locked {b:?}"));
            }
            if let Err(e) = fast.alloc.check_invariants() {
                return Err(format!("fast invariants: {e}"));
            }
            if let Err(e) = locked.alloc.check_invariants() {
                return Err(format!("locked invariants: {e}"));
            }
            let active = !case.records;
            let mut raw = fast.alloc.stats();
            let (mut sa, mut sb) = (
                comparable(raw.clone(), active, case.small),
                comparable(locked.alloc.stats(), active, case.small),
            );
            // Intended: a lock-free stream-cache hit polls no events, where every allocation
            // under the one lock polls them first, so a free pending behind another stream's
            // completed work joins the pool later on the fast path (its active and requested
            // bytes, its stream's free bytes lag until the next lock section that polls:
            // design notes, "A lock-free hit polls no events"). Where an allocation step's
            // statistics differ and a poll of the fast side frees a pending block, both sides
            // poll and everything is compared again.
            let allocates =
                matches!(op, Op::Alloc { .. } | Op::ScopeRun { .. } | Op::PoolRun { .. });
            if sa != sb && a == b && allocates && fast.alloc.poll_events() > 0 {
                locked.alloc.poll_events();
                if trace {
                    println!(
                        "step {step}: the fast side's lock-free hit had not polled: both polled"
                    );
                }
                raw = fast.alloc.stats();
                sa = comparable(raw.clone(), active, case.small);
                sb = comparable(locked.alloc.stats(), active, case.small);
            }
            // The lagging block, counted while a hit added its own, can have raised the fast
            // side's peaks of the figures the lag holds up (active and requested bytes, active
            // blocks: seed 60 of `switching_lanes_mixed`, a 1536-byte hit over a block pending
            // behind a completed kernel), also where a later request of the same step polled
            // (seed 1646 of `switching_passthrough_mixed`: a pool run's 1 MiB hit, then an
            // 8 MiB request under the lock). Where those peaks alone still differ, the fast
            // side's higher by no more than it held pending before the step, both sides' peaks
            // are reset (from the same current values), so later steps compare peaks again.
            let before = |id: u64| held.iter().find(|h| h.0 == id).map_or((0, 0), |h| h.1);
            if sa != sb && a == b && allocates && lag_peaks_alone(&sa, &sb, before(0)) {
                fast.alloc.reset_peak_stats();
                locked.alloc.reset_peak_stats();
                raw = fast.alloc.stats();
                sa = comparable(raw.clone(), active, case.small);
                sb = comparable(locked.alloc.stats(), active, case.small);
            }
            let mut now_held = vec![(0, pending(&raw))];
            let mut now = [vec![(0, ladder_mark(&sa))], vec![(0, ladder_mark(&sb))]];
            if sa != sb && differs.is_none() {
                differs = Some(format!(
                    "stats differ:\n{}per stream: fast {:?} locked {:?}",
                    diff(&sa, &sb),
                    sa.cached_free_bytes_per_stream,
                    sb.cached_free_bytes_per_stream
                ));
            }
            for (i, (p, q)) in fast.pools.iter().zip(&locked.pools).enumerate() {
                // A lock section on both sides, as the allocators' own checks above: its end
                // lets pages retired behind a completed event go on both alike (a lock-free
                // free on the fast path ends no section: design notes, "Retired pages wait
                // for a lock section").
                if let Err(e) = p.check_invariants() {
                    return Err(format!("fast pool {i} invariants: {e}"));
                }
                if let Err(e) = q.check_invariants() {
                    return Err(format!("locked pool {i} invariants: {e}"));
                }
                let mut raw = p.stats();
                let (mut pa, mut pb) = (
                    comparable(raw.clone(), active, case.small),
                    comparable(q.stats(), active, case.small),
                );
                // The same lag in a private pool: a pool run's hit from one of the pool's own
                // stream caches polls none of its pending frees (seed 182 of
                // `switching_passthrough_mixed`: a 6 MiB pool block freed after a
                // `record_stream`, then a 3.5 KiB hit in a pool run).
                if pa != pb && a == b && allocates && p.poll_events() > 0 {
                    q.poll_events();
                    raw = p.stats();
                    pa = comparable(raw.clone(), active, case.small);
                    pb = comparable(q.stats(), active, case.small);
                }
                if pa != pb && a == b && allocates && lag_peaks_alone(&pa, &pb, before(p.id())) {
                    p.reset_peak_stats();
                    q.reset_peak_stats();
                    raw = p.stats();
                    pa = comparable(raw.clone(), active, case.small);
                    pb = comparable(q.stats(), active, case.small);
                }
                now_held.push((p.id(), pending(&raw)));
                now[0].push((p.id(), ladder_mark(&pa)));
                now[1].push((q.id(), ladder_mark(&pb)));
                if pa != pb && differs.is_none() {
                    differs = Some(format!("pool {i} stats differ:\n{}", diff(&pa, &pb)));
                }
            }
            let climbed = matches!(op, Op::Alloc { .. } | Op::PoolRun { .. } | Op::ScopeRun { .. })
                && (0..2).any(|k| {
                    now[k].iter().any(|(id, n)| {
                        *n > marks[k].iter().find(|(j, _)| j == id).map_or(0, |m| m.1)
                    })
                });
            marks = now;
            held = now_held;
            if let Some(e) = differs {
                if case.cap_drift && climbed {
                    let before = &log[..log.len() - 1];
                    match small_drift(case, before, &op) {
                        Ok(()) => {
                            if trace {
                                println!(
                                    "step {step}: the ladder ran where small placement had \
                                     drifted: the rest is not compared\n{e}"
                                );
                            }
                            return Ok(());
                        }
                        Err(why) => return Err(format!("{e} (the ladder ran, but {why})")),
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    })();
    fast.complete();
    locked.complete();
    watch.2.store(true, Ordering::Relaxed);
    dog.join().unwrap();
    if stalled {
        if trace {
            let (i, op) = (log.len() - 1, log.last().expect("logged"));
            println!("step {i} {op:?} waited on a gated kernel: run again, completed first");
        }
        return Run::Stalled(log, taken);
    }
    Run::Done(r.map_err(|e| {
        let tail = log
            .iter()
            .enumerate()
            .rev()
            .take(60)
            .rev()
            .map(|(i, op)| format!("{i}: {op:?}"))
            .collect::<Vec<_>>()
            .join("\n");
        (log.clone(), format!("step {}: {e}\n{tail}", log.len() - 1))
    }))
}

fn run_seeds(case: &Case, seeds: std::ops::Range<u64>) {
    let mut failures = Vec::new();
    for seed in seeds {
        if let Err(e) = run_case(case, seed) {
            failures.push((seed, e));
        }
    }
    if !failures.is_empty() {
        let which: Vec<u64> = failures.iter().map(|f| f.0).collect();
        panic!("{} seeds differ ({which:?}); first:\n{}", which.len(), failures.swap_remove(0).1);
    }
}

fn room(configs: &[&str]) -> u64 {
    let mut room = u64::MAX;
    for c in configs {
        let c = Config::parse(c).unwrap();
        for l in [c.limit(512 * MIB), c.gc_limit(512 * MIB)].into_iter().flatten() {
            room = room.min(l);
        }
    }
    room
}

fn seeds() -> std::ops::Range<u64> {
    if let Some(k) = std::env::var("DIFF_SEED").ok().and_then(|s| s.parse::<u64>().ok()) {
        return k..k + 1;
    }
    let n = std::env::var("DIFF_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let from = std::env::var("DIFF_SEED_FROM").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    from..from + n
}

fn steps() -> usize {
    std::env::var("DIFF_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(300)
}

macro_rules! diff_test {
    ($name:ident, $configs:expr, $small:expr, $kernels:expr, $records:expr) => {
        diff_test!(#[test] $name, $configs, $small, $kernels, $records);
    };
    // (`Case::cap_drift`.)
    ($name:ident, $configs:expr, $small:expr, $kernels:expr, $records:expr, cap_drift) => {
        diff_test!(@case [#[test]] $name, $configs, $small, $kernels, $records, true);
    };
    (#[$($attr:meta),*] $name:ident, $configs:expr, $small:expr, $kernels:expr, $records:expr) => {
        diff_test!(@case [$(#[$attr])*] $name, $configs, $small, $kernels, $records, false);
    };
    (@case [$($attr:tt)*] $name:ident, $configs:expr, $small:expr, $kernels:expr, $records:expr,
     $cap_drift:expr) => {
        $($attr)*
        fn $name() {
            let case = Case {
                configs: $configs,
                capacity: 512 * MIB,
                room: room($configs),
                small: $small,
                large: true,
                kernels: $kernels,
                records: $records,
                steps: steps(),
                cap_drift: $cap_drift,
            };
            run_seeds(&case, seeds());
        }
    };
}

diff_test!(default_large, &[""], false, false, false);
diff_test!(default_mixed, &[""], true, false, false, cap_drift);

diff_test!(default_records, &[""], false, false, true);
diff_test!(default_kernels, &[""], false, true, true);
diff_test!(exp_large, &["expandable_segments:true"], false, false, false);
diff_test!(
    // Intended: small blocks waiting in lanes do not coalesce, so the small range may grow a
    // page more ("What the stream caches cost in memory"); that page, once free, moves to
    // another stream's range (`num_pages_moved`, and its large pool's reserved bytes), so no
    // exclusion narrower than the large pool's figures would hide it.
    #[test, ignore = "intended: small-lane drift reaches the large pool through page moves"]
    exp_mixed, &["expandable_segments:true"], true, false, false);
diff_test!(exp_kernels, &["expandable_segments:true"], false, true, true);
diff_test!(
    exp_trim_large,
    &["expandable_segments:true,release_threshold_mb:0"],
    false,
    false,
    false
);
diff_test!(
    exp_trim_kernels,
    &["expandable_segments:true,release_threshold_mb:0"],
    false,
    true,
    true
);
diff_test!(
    exp_trim_mixed,
    &["expandable_segments:true,release_threshold_mb:0"],
    true,
    false,
    false
);
diff_test!(
    stitch_large,
    &["expandable_segments:true,expandable_stitching:true"],
    false,
    false,
    false
);
diff_test!(
    stitch_kernels,
    &["expandable_segments:true,expandable_stitching:true"],
    false,
    true,
    true
);
diff_test!(wait_event_large, &["cross_stream:wait_event"], false, false, false);
diff_test!(wait_event_kernels, &["cross_stream:wait_event"], false, true, true);
diff_test!(
    exp_wait_event_kernels,
    &["expandable_segments:true,cross_stream:wait_event"],
    false,
    true,
    true
);
diff_test!(divisions_large, &["roundup_power2_divisions:4"], false, false, false);
diff_test!(divisions_mixed, &["roundup_power2_divisions:4"], true, false, false, cap_drift);
diff_test!(split20_large, &["max_split_size_mb:20"], false, false, false);
diff_test!(split20_kernels, &["max_split_size_mb:20"], false, true, true);
diff_test!(
    exp_split20_large,
    &["expandable_segments:true,max_split_size_mb:20"],
    false,
    false,
    false
);
diff_test!(
    gc_large,
    &["garbage_collection_threshold:0.6,memory_limit_mb:256"],
    false,
    false,
    false
);
// Intended: small blocks waiting in lanes do not coalesce, and a lane hands out the last freed
// (not the best fit), so a small segment fragments otherwise than under the one lock (see
// `addr`); at the memory cap, where no new small segment fits, that decides whether a small
// request is served (seed 6: a 1 MiB request, 1.03 MiB free in one piece on the locked side,
// at most 0.5 MiB on the fast side after the ladder's flush).
diff_test!(
    #[test, ignore = "intended: small placement drift decides small requests at the memory cap (seed 6)"]
    gc_mixed, &["garbage_collection_threshold:0.6,memory_limit_mb:256"], true, false, false);
diff_test!(limit_large, &["memory_limit_mb:200"], false, false, false);
diff_test!(
    switching_large,
    &[
        "",
        "max_split_size_mb:20",
        "roundup_power2_divisions:4",
        "garbage_collection_threshold:0.6,memory_limit_mb:256",
        "cross_stream:wait_event",
        "fast_cache_entries:1",
    ],
    false,
    true,
    true
);
diff_test!(
    switching_exp_large,
    &[
        "expandable_segments:true",
        "expandable_segments:true,release_threshold_mb:0",
        "expandable_segments:true,expandable_stitching:true",
        "expandable_segments:true,max_split_size_mb:20",
        "",
    ],
    false,
    true,
    true
);
diff_test!(
    exp_gc_large,
    &["expandable_segments:true,garbage_collection_threshold:0.6,memory_limit_mb:256"],
    false,
    false,
    false
);
diff_test!(exp_limit_kernels, &["expandable_segments:true,memory_limit_mb:200"], false, true, true);
diff_test!(
    exp_divisions_large,
    &["expandable_segments:true,roundup_power2_divisions:4"],
    false,
    false,
    false
);
diff_test!(
    stitch_trim_kernels,
    &["expandable_segments:true,expandable_stitching:true,release_threshold_mb:0"],
    false,
    true,
    true
);
diff_test!(
    exp_split20_kernels,
    &["expandable_segments:true,max_split_size_mb:20"],
    false,
    true,
    true
);
diff_test!(
    switching_exp_off_large,
    &[
        "expandable_segments:true",
        "release_threshold_mb:0",
        "expandable_segments:true,release_threshold_mb:0",
        "",
    ],
    false,
    false,
    false
);
diff_test!(
    exp_trim4_mixed,
    &["expandable_segments:true,release_threshold_mb:4"],
    true,
    false,
    false
);
// The keys the other switching cases leave alone, switched at run time with blocks live,
// cached in the stream caches and pending behind other streams' work.
diff_test!(
    switching_lanes_mixed,
    &[
        "",
        "fast_cache:false",
        "fast_cache_bytes_mb:1",
        "fast_cache_entries:2,fast_cache_bytes_mb:4,biased_lanes:false",
        "graph_capture_record_stream_reuse:true",
    ],
    true,
    true,
    true,
    cap_drift
);
// Passthrough switched on and off with small blocks live and cached (no kernels: with them,
// every passthrough free's wait on the device stalls on a gated kernel, and the case takes
// seconds; `switching_limits_large` switches it under kernels).
diff_test!(
    switching_passthrough_mixed,
    &[
        "",
        "caching:false",
        "fast_cache_bytes_mb:1,biased_lanes:false",
        "caching:false,fast_cache:false"
    ],
    true,
    false,
    true,
    cap_drift
);
diff_test!(
    switching_limits_large,
    &[
        "",
        "memory_limit_mb:128",
        "memory_limit_mb:300",
        "per_process_memory_fraction:0.3",
        "max_pool_size_mb:200",
        "initial_pool_size_mb:64",
        "garbage_collection_threshold:0.5",
        "garbage_collection_threshold:0.8,memory_limit_mb:256",
        "caching:false",
    ],
    false,
    true,
    true
);
// Intended, and so not switched here: `min_block_size` raised (512 → 4096 bytes) leaves free
// small blocks of the old granularity, whose tail past a request may be under the new minimum
// and is then handed out with it (not split, as PyTorch's `kMinBlockSize`), so a small
// block's size, not only its place, follows the lanes' drift (seed 1: a 12288-byte request
// gets 15360 bytes from a 15360-byte tail under the one lock, 12288 from the small segment
// the fast side reserved a step before). `switching_sizing_large` switches it.
diff_test!(
    switching_sizing_mixed,
    &[
        "",
        "small_size_mb:2,small_segment_mb:4",
        "large_segment_mb:40,min_large_alloc_mb:20",
        "round_large_mb:4",
        "max_non_split_rounding_mb:64,max_split_size_mb:40",
        "small_segment_mb:8,large_segment_mb:10",
    ],
    true,
    true,
    true,
    cap_drift
);
diff_test!(
    switching_sizing_large,
    &[
        "",
        "large_segment_mb:40,min_large_alloc_mb:20",
        "round_large_mb:4",
        "min_block_size:4096",
        "max_non_split_rounding_mb:64,max_split_size_mb:40",
        "large_segment_mb:10",
    ],
    false,
    true,
    true
);
diff_test!(
    switching_exp_keys_large,
    &[
        "expandable_segments:true",
        "expandable_segments:true,expandable_segments_reserve:0.25",
        "expandable_segments:true,garbage_collection_threshold:0.6",
        "expandable_segments:true,memory_limit_mb:160",
        "expandable_segments:true,large_segment_mb:40,min_large_alloc_mb:20",
        "expandable_segments:true,fast_cache:false",
        "expandable_segments:true,per_process_memory_fraction:0.4,round_large_mb:4",
        "expandable_segments:true,min_block_size:4096,expandable_segments_reserve:1G",
    ],
    false,
    true,
    true
);
