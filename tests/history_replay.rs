//! The memory history replayed against the snapshot, for seeded random programs: allocations
//! on three streams, frees (some after a use on another stream, so they wait on an event),
//! `empty_cache`, private pools made, used and dropped (buffers outliving them), and
//! out-of-memory failures, with the history recording from step `RECORD_FROM` on.
//!
//! The replay starts from the snapshot pickle taken when recording started (its segments are
//! the mapped memory, its allocated and pending blocks the live ones) and applies the history
//! entry by entry: a segment is mapped only over unmapped memory and unmapped only where
//! mapped and under no live block; a block is handed out only inside mapped memory and over no
//! live block, and freed only where one lives with its size. At the end, the replay's mapped
//! memory and live blocks are the final pickle's, and the device saw no stream-order
//! violation. After every step, `snapshot()` agrees with `stats()` for the general allocator
//! and each private pool, in all and per pool kind. A seed runs the same way whatever the
//! machine's load (the gated kernels open only as [`Gates`] says).
//!
//! `HISTORY_SEEDS=n` runs seeds 0..n of every configuration (default 2), `HISTORY_SEED=n`
//! seed n alone.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};
use tidepool::device::{AccessKind, Launch, SimDevice};
use tidepool::{
    Action, Allocator, BlockState, Config, Device, HistoryOptions, MIB, MemPool, MemoryStats,
    PoolKind, PoolOptions, SegmentInfo, StatGroup, StreamId,
};

const STEPS: usize = 400;
/// The step at which recording starts: the replay's start holds live, pending and cached
/// blocks of the unrecorded steps.
const RECORD_FROM: usize = 100;
const SIZES: [u64; 8] = [512, 3000, 700_000, 2 * MIB + 7, 5 * MIB, 12 * MIB, 21 * MIB, 40 * MIB];

/// Address ranges, `start -> end`, none overlapping another (touching ones stay apart).
#[derive(Default, PartialEq, Debug)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    fn overlaps(&self, a: u64, b: u64) -> bool {
        self.0.range(..b).next_back().is_some_and(|(_, &e)| e > a)
    }

    /// Whether `[a, b)` is covered, across touching ranges.
    fn covers(&self, a: u64, b: u64) -> bool {
        let mut at = a;
        for (&s, &e) in self.0.range(..b) {
            if e > at {
                if s > at {
                    return false;
                }
                at = e;
            }
        }
        at >= b
    }

    /// `[a, b)` cut out of every range.
    fn remove(&mut self, a: u64, b: u64) {
        let hit: Vec<(u64, u64)> =
            self.0.range(..b).filter(|&(_, &e)| e > a).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in hit {
            self.0.remove(&s);
            if s < a {
                self.0.insert(s, a);
            }
            if e > b {
                self.0.insert(b, e);
            }
        }
    }

    /// The ranges with touching ones merged.
    fn merged(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (&s, &e) in &self.0 {
            match out.last_mut() {
                Some(last) if last.1 == s => last.1 = e,
                _ => out.push((s, e)),
            }
        }
        out
    }
}

/// Device memory as the replay sees it: the mapped ranges, the same by stream (a segment's, or
/// mapped pages', as MemoryViz.js takes it from the `segment_alloc`/`segment_map` entries), and
/// the live blocks (allocated or pending), each `start -> start + requested bytes`.
#[derive(Default)]
struct Memory {
    mapped: Ranges,
    by_stream: BTreeMap<u64, Ranges>,
    live: Ranges,
}

impl Memory {
    /// The memory of a snapshot pickle: every segment of the family and its live blocks.
    fn of_pickle(pickle: &[u8]) -> Memory {
        use common::pickle::{get, list, read, string, uint};
        let mut m = Memory::default();
        for s in list(get(&read(pickle), "segments")) {
            let (a, size) = (uint(get(&s, "address")), uint(get(&s, "total_size")));
            m.mapped.0.insert(a, a + size);
            m.by_stream.entry(uint(get(&s, "stream"))).or_default().0.insert(a, a + size);
            for b in list(get(&s, "blocks")) {
                if string(get(&b, "state")) != "inactive" {
                    let a = uint(get(&b, "address"));
                    m.live.0.insert(a, a + uint(get(&b, "requested_size")));
                }
            }
        }
        m
    }

    /// Applies one history entry of `stream`, or says what it breaks.
    fn apply(
        &mut self,
        action: Action,
        a: u64,
        size: u64,
        stream: u64,
    ) -> Result<(), &'static str> {
        let b = a + size;
        let own = self.by_stream.entry(stream).or_default();
        match action {
            Action::SegmentAlloc | Action::SegmentMap if self.mapped.overlaps(a, b) => {
                Err("maps mapped memory")
            }
            Action::SegmentAlloc | Action::SegmentMap => {
                self.mapped.0.insert(a, b);
                own.0.insert(a, b);
                Ok(())
            }
            Action::SegmentFree | Action::SegmentUnmap if !self.mapped.covers(a, b) => {
                Err("unmaps unmapped memory")
            }
            Action::SegmentFree | Action::SegmentUnmap if !own.covers(a, b) => {
                Err("unmaps another stream's memory")
            }
            Action::SegmentFree | Action::SegmentUnmap if self.live.overlaps(a, b) => {
                Err("unmaps a live block")
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                self.mapped.remove(a, b);
                own.remove(a, b);
                Ok(())
            }
            Action::Alloc if !self.mapped.covers(a, b) => Err("hands out unmapped memory"),
            Action::Alloc if !own.covers(a, b) => Err("hands out another stream's memory"),
            Action::Alloc if self.live.overlaps(a, b) => Err("hands out a live block"),
            Action::Alloc => {
                self.live.0.insert(a, b);
                Ok(())
            }
            Action::FreeRequested if self.live.0.get(&a) != Some(&b) => {
                Err("frees no live block of its size")
            }
            Action::FreeCompleted if self.live.0.remove(&a) != Some(b) => {
                Err("completes the free of no live block of its size")
            }
            // (`Action` is non-exhaustive: an action added later needs its rule here.)
            Action::FreeRequested | Action::FreeCompleted | Action::Oom => Ok(()),
            other => panic!("no replay rule for {other:?}"),
        }
    }
}

/// `[reserved bytes, segments, allocated bytes, allocations, active bytes, active blocks,
/// requested bytes]` of `kind` (all kinds: `None`) as `snap` lists them.
fn listed(snap: &[SegmentInfo], kind: Option<PoolKind>) -> [u64; 7] {
    let segs: Vec<&SegmentInfo> =
        snap.iter().filter(|s| kind.is_none_or(|k| s.pool == k)).collect();
    let blocks = || segs.iter().flat_map(|s| &s.blocks);
    let allocated = || blocks().filter(|b| b.state == BlockState::Allocated);
    let active = || blocks().filter(|b| b.state != BlockState::Free);
    [
        segs.iter().map(|s| s.size).sum(),
        segs.len() as u64,
        allocated().map(|b| b.size).sum(),
        allocated().count() as u64,
        active().map(|b| b.size).sum(),
        active().count() as u64,
        active().map(|b| b.requested).sum(),
    ]
}

/// The same figures as `stats` counts them.
fn counted(stats: &MemoryStats, kind: Option<PoolKind>) -> [u64; 7] {
    let cell = |g: &StatGroup| kind.map_or(g.all, |k| *g.pool(k)).current;
    let s = &stats.blocks;
    [
        cell(&s.reserved_bytes),
        cell(&s.segment),
        cell(&s.allocated_bytes),
        cell(&s.allocation),
        cell(&s.active_bytes),
        cell(&s.active),
        cell(&s.requested_bytes),
    ]
}

/// `snapshot` (taken first: it flushes the stream caches) and `stats` agree.
#[track_caller]
fn agree(at: &str, snap: Vec<SegmentInfo>, stats: MemoryStats) {
    for kind in [None, Some(PoolKind::Small), Some(PoolKind::Large)] {
        let what = "[reserved, segments, allocated, allocations, active, active blocks, requested]";
        assert_eq!(listed(&snap, kind), counted(&stats, kind), "{at}, {kind:?}: {what}");
    }
}

/// Gated kernels, and a watchdog that opens them all when a step's host wait has stayed
/// blocked for `STALL` (the allocator waiting for one of them: a release, an out-of-memory
/// ladder's synchronisation), as a program's kernels would end: no step hangs. The clock runs
/// only while the host is blocked, so a slow step is never taken for a stalled one.
struct Gates {
    shared: Arc<Watch>,
    dog: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct Watch {
    closed: Mutex<Vec<mpsc::Sender<()>>>,
    step: AtomicUsize,
    opened: AtomicBool,
    done: AtomicBool,
}

const STALL: Duration = Duration::from_millis(10);

impl Gates {
    fn new(dev: &Arc<SimDevice>) -> Gates {
        let shared = Arc::new(Watch::default());
        let (w, dev) = (shared.clone(), dev.clone());
        let dog = std::thread::spawn(move || {
            let mut last = (usize::MAX, Instant::now());
            while !w.done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
                let step = w.step.load(Ordering::Relaxed);
                if step != last.0 || dev.blocked_host_waits() == 0 {
                    last = (step, Instant::now());
                } else if last.1.elapsed() >= STALL {
                    let opened = std::mem::take(&mut *w.closed.lock().unwrap());
                    w.opened.fetch_or(!opened.is_empty(), Ordering::Relaxed);
                    opened.into_iter().for_each(|g| {
                        let _ = g.send(());
                    });
                }
            }
        });
        Gates { shared, dog: Some(dog) }
    }

    /// `buf` read on `stream` by a kernel that waits for its gate, and its free then ordered
    /// after that read.
    fn use_on(&self, dev: &SimDevice, buf: &tidepool::Buffer<SimDevice>, stream: StreamId) {
        let (k, gate) = common::gated(buf.ptr(), buf.len(), AccessKind::Read);
        dev.launch(stream, k).unwrap();
        buf.record_stream(stream).unwrap();
        self.shared.closed.lock().unwrap().push(gate);
    }

    /// Every kernel ended and completed.
    fn open_all(&self, dev: &SimDevice) {
        self.shared.closed.lock().unwrap().drain(..).for_each(|g| {
            let _ = g.send(());
        });
        dev.synchronize().unwrap();
    }

    /// Ends a step: where the watchdog opened gates, their kernels complete now, so the next
    /// step starts from the same state whatever the machine's load.
    fn step_done(&self, dev: &SimDevice) {
        self.shared.step.fetch_add(1, Ordering::Relaxed);
        if self.shared.opened.swap(false, Ordering::Relaxed) {
            dev.synchronize().unwrap();
        }
    }
}

impl Drop for Gates {
    fn drop(&mut self) {
        self.shared.closed.lock().unwrap().clear();
        self.shared.done.store(true, Ordering::Relaxed);
        self.dog.take().map(|d| d.join());
    }
}

/// One seeded program under `conf`, checked as the file's head says.
fn run(conf: &str, seed: u64) {
    let at = |what: &str| format!("{conf:?} seed {seed}: {what}");
    let dev = Arc::new(SimDevice::new(256 * MIB));
    let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
    let streams = [StreamId::DEFAULT, dev.create_stream().unwrap(), dev.create_stream().unwrap()];
    let gates = Gates::new(&dev);
    let mut rng = common::Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut live: Vec<tidepool::Buffer<SimDevice>> = Vec::new();
    let mut pools: Vec<MemPool<SimDevice>> = Vec::new();
    let mut start = None;
    for step in 0..STEPS {
        if step == RECORD_FROM {
            start = Some(Memory::of_pickle(&alloc.snapshot_pickle()));
            alloc.record_history(HistoryOptions::new(100_000));
        }
        let r = rng.below(100);
        let mut pick = |n: usize| rng.below(n as u64) as usize;
        match r {
            0..45 => {
                let (bytes, s) = (SIZES[pick(SIZES.len())], streams[pick(3)]);
                live.extend(alloc.alloc(bytes, s).ok());
            }
            45..80 if !live.is_empty() => {
                let b = live.swap_remove(pick(live.len()));
                let other = streams[pick(3)];
                if pick(4) == 0 && other != b.stream() {
                    gates.use_on(&dev, &b, other);
                }
                drop(b);
            }
            80..85 => gates.open_all(&dev),
            85..88 => alloc.empty_cache().unwrap(),
            88..91 if pools.len() < 3 => {
                pools.push(alloc.new_pool(PoolOptions::default()).unwrap())
            }
            91..95 if !pools.is_empty() => {
                let (p, s) = (&pools[pick(pools.len())], streams[1 + pick(2)]);
                let _guard = alloc.use_pool(p, s).unwrap();
                live.extend(alloc.alloc(SIZES[pick(SIZES.len())], s).ok());
            }
            95..97 if !pools.is_empty() => {
                let p = pools.swap_remove(pick(pools.len()));
                if pick(2) == 0 {
                    p.empty_cache().unwrap();
                }
            }
            _ => {}
        }
        gates.step_done(&dev);
        let at = at(&format!("step {step}"));
        agree(&at, alloc.snapshot(), alloc.stats());
        for p in &pools {
            agree(&format!("{at}, pool {}", p.id()), p.snapshot(), p.stats());
        }
    }
    gates.open_all(&dev);
    let end = Memory::of_pickle(&alloc.snapshot_pickle());
    let history = alloc.history();
    assert!(history.len() < 100_000, "{}", at("the ring kept every entry"));
    let mut m = start.unwrap();
    for (i, e) in history.iter().enumerate() {
        if let Err(what) = m.apply(e.action, e.addr.0, e.size, u64::from(e.stream.0)) {
            panic!("{}", at(&format!("entry {i} {:?} {what}", (e.action, e.addr, e.size))));
        }
    }
    assert_eq!(m.mapped.merged(), end.mapped.merged(), "{}", at("mapped at the end"));
    assert_eq!(m.live, end.live, "{}", at("live blocks at the end"));
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![], "{}", at("stream order"));
}

/// The seeds to run: `HISTORY_SEED`, or 0..`HISTORY_SEEDS` (default 2).
fn seeds() -> std::ops::Range<u64> {
    let var = |name| std::env::var(name).ok().map(|v| v.parse::<u64>().unwrap());
    match (var("HISTORY_SEED"), var("HISTORY_SEEDS")) {
        (Some(s), _) => s..s + 1,
        (None, n) => 0..n.unwrap_or(2),
    }
}

fn run_seeds(conf: &str) {
    for seed in seeds() {
        run(conf, seed);
    }
}

#[test]
fn the_history_replays_onto_the_snapshot() {
    run_seeds("");
}

#[test]
fn the_history_replays_onto_the_snapshot_with_expandable_segments() {
    run_seeds("expandable_segments:true");
}

#[test]
fn the_history_replays_onto_the_snapshot_with_stitching() {
    run_seeds("expandable_segments:true,expandable_stitching:true");
}

#[test]
fn the_history_replays_onto_the_snapshot_under_the_global_lock() {
    run_seeds("global_lock:true");
    run_seeds("global_lock:true,expandable_segments:true");
}

#[test]
fn the_history_replays_onto_the_snapshot_with_frees_ordered_by_events() {
    run_seeds("expandable_segments:true,cross_stream:wait_event");
}
