//! Memory history and the snapshot pickle: exact entries for scripted programs (stream-ordered
//! frees included), the ring bound, and the dump read back by Python's `pickle` with the structure
//! PyTorch's `_memory_viz.py` reads.

mod common;

use std::sync::Arc;
use std::sync::mpsc;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SIM_BASE, SimDevice};
use tidepool::hooks::Broken;
use tidepool::{Action, Allocator, Config, Device, DeviceAddr, HistoryOptions, MIB, StreamId};

fn setup() -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::backed(64 * MIB));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    (dev, alloc)
}

/// (action, address offset from SIM_BASE, size, stream) of every entry.
fn entries(alloc: &Allocator<SimDevice>) -> Vec<(Action, u64, u64, u32)> {
    alloc.history().iter().map(|e| (e.action, e.addr.0 - SIM_BASE, e.size, e.stream.0)).collect()
}

/// The entries of a 4 KiB and a 3 MiB allocation on the default stream (the 4 KiB one in the
/// small segment at 0, made before the recording began), then their frees in that order.
fn small_and_large_freed() -> Vec<(Action, u64, u64, u32)> {
    use Action::*;
    vec![
        (Alloc, 0, 4096, 0),
        (SegmentAlloc, 2 * MIB, 20 * MIB, 0),
        (Alloc, 2 * MIB, 3 * MIB, 0),
        (FreeRequested, 0, 4096, 0),
        (FreeCompleted, 0, 4096, 0),
        (FreeRequested, 2 * MIB, 3 * MIB, 0),
        (FreeCompleted, 2 * MIB, 3 * MIB, 0),
    ]
}

#[test]
fn a_scripted_program_is_recorded_exactly() {
    let (_dev, alloc) = setup();
    drop(alloc.alloc(512, StreamId::DEFAULT).unwrap()); // before recording: not in the history
    alloc.record_history(HistoryOptions::new(100));
    let a = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let b = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    drop(a);
    drop(b);
    use Action::*;
    assert_eq!(entries(&alloc), small_and_large_freed());
    alloc.empty_cache().unwrap();
    let tail: Vec<_> = entries(&alloc).split_off(7);
    assert_eq!(tail, vec![(SegmentFree, 0, 2 * MIB, 0), (SegmentFree, 2 * MIB, 20 * MIB, 0)]);
    let times: Vec<u64> = alloc.history().iter().map(|e| e.time_us).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "times never go back: {times:?}");
    // PyTorch's clock: microseconds since the Unix epoch, within this test's run.
    let now_us = || {
        let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        d.as_micros() as u64
    };
    let (first, last) = (times[0], *times.last().unwrap());
    assert!(now_us() - 60_000_000 < first && last <= now_us(), "{first}..{last}");
    alloc.check_invariants().unwrap();
}

/// Recording closes the stream caches to hits and frees alike (room and size bound 0), so every
/// allocation and free is recorded even where the block was cached before; `HistoryLanesOpen`
/// (the lanes left open) loses them.
#[test]
fn recording_closes_the_stream_caches_to_hits_and_frees() {
    use Action::*;
    for broken in [false, true] {
        let (_dev, alloc) = setup();
        alloc.set_broken(Broken::HistoryLanesOpen, broken);
        drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap()); // cached in this thread's lane
        alloc.record_history(HistoryOptions::new(100));
        for _ in 0..3 {
            drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap());
        }
        let pair = [(Alloc, 0, 4096, 0), (FreeRequested, 0, 4096, 0), (FreeCompleted, 0, 4096, 0)];
        let all: Vec<_> = pair.iter().copied().cycle().take(9).collect();
        assert_eq!(entries(&alloc) == all, !broken, "broken {broken}: {:?}", entries(&alloc));
        assert_eq!(alloc.stats().cached_fast_bytes == 0, !broken);
        alloc.check_invariants().unwrap();
    }
}

#[test]
fn a_free_used_on_another_stream_completes_only_after_that_stream() {
    let (dev, alloc) = setup();
    let s = dev.create_stream().unwrap();
    alloc.record_history(HistoryOptions::new(100));
    let a = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let ptr = a.ptr();
    let (open, gate) = mpsc::channel::<()>();
    let k =
        Kernel::new("read", vec![Access { ptr, bytes: 4096, kind: AccessKind::Read }], move |_| {
            let _ = gate.recv();
        });
    dev.launch(s, k).unwrap();
    alloc.record_stream(&a, s).unwrap();
    drop(a);
    use Action::*;
    let last = |alloc: &Allocator<SimDevice>| *entries(alloc).last().unwrap();
    assert_eq!(last(&alloc), (FreeRequested, 0, 4096, 0), "requested, not completed");
    open.send(()).unwrap();
    alloc.synchronize().unwrap();
    assert_eq!(last(&alloc), (FreeCompleted, 0, 4096, 0), "completed once the stream is done");
    assert_eq!(dev.violations(), vec![]);
}

#[test]
fn the_ring_keeps_the_newest_entries_and_stops_when_asked() {
    let (_dev, alloc) = setup();
    alloc.record_history(HistoryOptions::new(4));
    for _ in 0..10 {
        drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap());
    }
    use Action::*;
    // 30 entries were made (alloc, free requested, free completed, ten times): the last 4 stay.
    assert_eq!(
        entries(&alloc),
        vec![
            (FreeCompleted, 0, 4096, 0),
            (Alloc, 0, 4096, 0),
            (FreeRequested, 0, 4096, 0),
            (FreeCompleted, 0, 4096, 0),
        ]
    );
    alloc.record_history(HistoryOptions::new(0));
    assert!(alloc.history().is_empty());
    drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap());
    assert!(alloc.history().is_empty(), "off again");
}

#[test]
fn an_out_of_memory_error_is_recorded_with_the_request() {
    let (_dev, alloc) = setup();
    alloc.record_history(HistoryOptions::new(10).with_stacks(true));
    let Err(tidepool::AllocError::OutOfMemory(report)) = alloc.alloc(1 << 40, StreamId::DEFAULT)
    else {
        panic!("more than the device")
    };
    let h = alloc.history();
    assert_eq!(h.len(), 1);
    // PyTorch's `oom` entry holds the device's free bytes where others hold an address.
    assert_eq!(report.device_free, 64 * MIB);
    assert_eq!((h[0].action, h[0].addr, h[0].size), (Action::Oom, DeviceAddr(64 * MIB), 1 << 40));
    let pickle = alloc.snapshot_pickle();
    assert_eq!(pool_ids_in_dump(&pickle), vec![("oom".to_string(), (0, 0))]); // `device_free`, no `addr`
    let v = serde_pickle::value_from_slice(&pickle, serde_pickle::DeOptions::new()).unwrap();
    let text = format!("{v:?}");
    let want = format!("String(\"device_free\"): I64({})", 64 * MIB);
    assert!(text.contains(&want), "{want} not in the dump");
    assert!(h[0].stack.is_some(), "stacks were asked for");
    // The allocator works on.
    drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap());
    alloc.check_invariants().unwrap();
}

/// PyTorch's `oom` entry records the request rounded up to its block size (its
/// `record_trace(TraceEntry::OOM, device_free, params.size(), …)`, `params.size()` being
/// `round_size(size)`), on ordinary segments and on expandable ones alike: a 48 MiB + 1 byte
/// request is 48 MiB + 512 bytes. (It recorded the request as asked; broken build
/// `oom_entry_requested`.)
#[test]
fn an_out_of_memory_entry_records_the_rounded_size() {
    for conf in ["", "expandable_segments:true"] {
        let dev = Arc::new(SimDevice::backed(64 * MIB));
        let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
        let keep = alloc.alloc(40 * MIB, StreamId::DEFAULT).unwrap();
        alloc.record_history(HistoryOptions::new(10));
        let Err(tidepool::AllocError::OutOfMemory(report)) =
            alloc.alloc(48 * MIB + 1, StreamId::DEFAULT)
        else {
            panic!("{conf}: 88 MiB of 64")
        };
        let h: Vec<_> = alloc.history().iter().map(|e| (e.action, e.addr.0, e.size)).collect();
        assert_eq!(h, vec![(Action::Oom, report.device_free, 48 * MIB + 512)], "{conf}");
        assert_eq!(report.device_free, 24 * MIB, "{conf}");
        drop(keep);
    }
}

/// Python reads the dump; the script checks what `_memory_viz.py` reads and prints figures.
const CHECK_PY: &str = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], 'rb'))
assert set(d) == {'segments', 'device_traces', 'allocator_settings', 'external_annotations'}, d.keys()
assert isinstance(d['external_annotations'], list)
for s in d['segments']:
    for k, t in [('device', int), ('address', int), ('total_size', int), ('allocated_size', int),
                 ('active_size', int), ('requested_size', int), ('stream', int),
                 ('segment_type', str), ('blocks', list), ('frames', list), ('is_expandable', bool)]:
        assert isinstance(s[k], t), (k, s[k])
    assert sum(b['size'] for b in s['blocks']) == s['total_size']
    for b in s['blocks']:
        assert b['state'] in ('active_allocated', 'active_pending_free', 'inactive'), b
        assert isinstance(b['address'], int) and isinstance(b['size'], int)
        assert isinstance(b['requested_size'], int) and isinstance(b['frames'], list)
assert isinstance(d['device_traces'], list) and len(d['device_traces']) == 1
for e in d['device_traces'][0]:
    for k, t in [('action', str), ('addr', int), ('size', int), ('stream', int), ('time_us', int), ('frames', list)]:
        assert isinstance(e[k], t), (k, e)
    assert e['pool_id'] == (0, 0), e
    for f in e['frames']:
        assert isinstance(f['filename'], str) and isinstance(f['line'], int) and isinstance(f['name'], str)
assert isinstance(d['allocator_settings'], dict)
allocated = [b['size'] for s in d['segments'] for b in s['blocks'] if b['state'] == 'active_allocated']
print(len(d['segments']), sum(allocated), [e['action'] for e in d['device_traces'][0]],
      any(e['frames'] for e in d['device_traces'][0]))
"#;

#[test]
fn the_dump_is_a_pickle_python_reads_with_pytorchs_structure() {
    let (_dev, alloc) = setup();
    alloc.record_history(HistoryOptions::new(100).with_stacks(true));
    let keep = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    drop(alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap());
    let scratch = tempfile::Builder::new().prefix("tidepool-history-").tempdir().unwrap();
    let dir = scratch.path();
    let path = dir.join("snapshot.pickle");
    alloc.dump_snapshot(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..2], &[0x80, 2], "pickle protocol 2");
    let script = dir.join("check.py");
    std::fs::write(&script, CHECK_PY).unwrap();
    let out = match std::process::Command::new("python3").arg(&script).arg(&path).output() {
        Ok(out) => out,
        Err(e) => {
            println!("skipped the Python check: python3 cannot run here ({e})");
            return;
        }
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        stdout.trim(),
        "2 4096 ['segment_alloc', 'alloc', 'segment_alloc', 'alloc', 'free_requested', 'free_completed'] True"
    );
    drop(keep);
}

#[test]
fn entries_carry_the_requested_size_as_pytorch_records_it() {
    let (_dev, alloc) = setup();
    alloc.record_history(HistoryOptions::new(10));
    let a = alloc.alloc(1000, StreamId::DEFAULT).unwrap();
    assert_eq!(a.block_size(), 1024);
    drop(a);
    use Action::*;
    assert_eq!(
        entries(&alloc)[1..],
        [(Alloc, 0, 1000, 0), (FreeRequested, 0, 1000, 0), (FreeCompleted, 0, 1000, 0)]
    );
}

/// Prints `pool_id address total_size` for every segment of the dump, one line each (the
/// pool id's two numbers).
const POOLS_PY: &str = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], 'rb'))
for s in d['segments']:
    p = s['segment_pool_id']
    assert isinstance(p, tuple) and len(p) == 2 and 0 in p, p
    print(p[0], p[1], s['address'], s['total_size'])
"#;

/// The segments of `bytes` as `(pool id, address, size)`, read by Python (`None`: no python3).
#[allow(clippy::type_complexity)]
fn pools_in_dump(bytes: &[u8]) -> Option<Vec<((u64, u64), u64, u64)>> {
    let scratch = tempfile::Builder::new().prefix("tidepool-pools-").tempdir().unwrap();
    let dir = scratch.path();
    let (path, script) = (dir.join("snapshot.pickle"), dir.join("pools.py"));
    std::fs::write(&path, bytes).unwrap();
    std::fs::write(&script, POOLS_PY).unwrap();
    let out = std::process::Command::new("python3").arg(&script).arg(&path).output();
    drop(scratch);
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            println!("skipped the Python check: python3 cannot run here ({e})");
            return None;
        }
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let field = |w: Option<&str>| w.unwrap().parse::<u64>().unwrap();
    Some(
        text.lines()
            .map(|l| {
                let mut w = l.split_whitespace();
                ((field(w.next()), field(w.next())), field(w.next()), field(w.next()))
            })
            .collect(),
    )
}

/// PyTorch's snapshot lists every pool of the device, each segment with its
/// `segment_pool_id`: the general allocator's dump lists its own segments as pool (0, 0), those
/// of each `MemPool` as (0, id) — a pool whose handle is gone too, while a buffer keeps its
/// segment, and no longer once that buffer is freed — and those of the pool a capture made as
/// (id, 0), as PyTorch's graph-private pools are (`{uuid_++, 0}`, where a `MemPool` is
/// `{0, uid_++}`; broken build `graph_pool_ids_as_mempools`: (0, id)). A pool's segments are in
/// the dump exactly as `MemPool::snapshot` lists them.
#[test]
fn the_dump_lists_every_pool_of_the_family() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let s = dev.create_stream().unwrap();
    let general = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let pool = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
    let guard = alloc.use_pool(&pool, s).unwrap();
    let in_pool = [alloc.alloc(3 * MIB, s).unwrap(), alloc.alloc(1000, s).unwrap()];
    drop(guard);
    let gone = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
    let guard = alloc.use_pool(&gone, s).unwrap();
    let orphan = alloc.alloc(12 * MIB, s).unwrap();
    drop(guard);
    let gone_id = gone.id();
    drop(gone);
    let t = dev.create_stream().unwrap();
    alloc.begin_capture(t, None).unwrap();
    let captured = alloc.alloc(2 * MIB, t).unwrap();
    let graph = alloc.end_capture(t).unwrap();
    let expect = |pairs: &[((u64, u64), Vec<tidepool::SegmentInfo>)]| {
        let mut v: Vec<((u64, u64), u64, u64)> = pairs
            .iter()
            .flat_map(|(id, segs)| segs.iter().map(move |g| (*id, g.address.0, g.size)))
            .collect();
        v.sort_unstable();
        v
    };
    let sorted = |mut v: Vec<((u64, u64), u64, u64)>| {
        v.sort_unstable();
        v
    };
    let Some(listed) = pools_in_dump(&alloc.snapshot_pickle()) else { return };
    let mut want = expect(&[
        ((0, 0), alloc.snapshot()),
        ((0, pool.id()), pool.snapshot()),
        // The pool the capture made: PyTorch's graph-private pool, `(id, 0)`.
        ((graph.pool().id(), 0), graph.pool().snapshot()),
    ]);
    want.push(((0, gone_id), orphan.ptr().0, 12 * MIB));
    assert_eq!(sorted(listed), sorted(want));
    assert_eq!(pool.snapshot().len(), 2, "a small and a large segment");
    drop(orphan);
    let Some(listed) = pools_in_dump(&alloc.snapshot_pickle()) else { return };
    assert!(!listed.iter().any(|l| l.0 == (0, gone_id)), "the orphan pool's memory went");
    drop((in_pool, captured, graph, general));
    alloc.check_invariants().unwrap();
}

/// PyTorch's `test_allocation_traceback` and `test_allocation_traceback_no_recording`: with
/// history recorded with stacks, a live buffer's allocation stack names the code that
/// allocated it; a buffer read on another stream keeps it while its free waits on the event,
/// and loses it once the free completed (`empty_cache` waits); without recording there is none.
#[test]
fn allocation_traceback_names_the_allocating_code() {
    let (dev, alloc) = setup();
    let t = dev.create_stream().unwrap();
    let unrecorded = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    assert!(alloc.allocation_traceback(unrecorded.ptr()).is_none(), "not recording");
    alloc.record_history(HistoryOptions::new(100).with_context(tidepool::HistoryContext::State));
    let buf = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let stack = alloc.allocation_traceback(buf.ptr()).expect("recorded").to_string();
    assert!(stack.contains("allocation_traceback_names_the_allocating_code"), "{stack}");
    assert!(alloc.allocation_traceback(buf.ptr().offset(512)).is_none(), "a buffer's start only");
    assert!(alloc.allocation_traceback(unrecorded.ptr()).is_none(), "allocated unrecorded");
    let (gated, open) = gated_read(&buf);
    dev.launch(t, gated).unwrap();
    buf.record_stream(t).unwrap();
    let ptr = buf.ptr();
    drop(buf); // waits on t's read
    assert!(alloc.allocation_traceback(ptr).is_some(), "its free has not completed");
    open.send(()).unwrap();
    alloc.empty_cache().unwrap();
    assert!(alloc.allocation_traceback(ptr).is_none(), "freed");
    alloc.record_history(HistoryOptions::new(0));
    drop(unrecorded);
}

/// A kernel reading `buf` that ends when the returned sender is used or dropped.
fn gated_read(buf: &tidepool::Buffer<SimDevice>) -> (Kernel, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel::<()>();
    let acc = vec![Access { ptr: buf.ptr(), bytes: buf.len(), kind: AccessKind::Read }];
    (
        Kernel::new("gated", acc, move |_| {
            let _ = gate.recv();
        }),
        open,
    )
}

/// `(action, pool id, size)` of every entry.
fn pool_entries(alloc: &Allocator<SimDevice>) -> Vec<(Action, u64, u64)> {
    alloc.history().iter().map(|e| (e.action, e.pool_id, e.size)).collect()
}

/// The `pool_id` of every `device_traces` entry of the dump, as `(action, id)`, the id the
/// tuple PyTorch writes, and whether each `oom` entry has `device_free` (PyTorch's key) in
/// place of `addr`.
fn pool_ids_in_dump(bytes: &[u8]) -> Vec<(String, (u64, u64))> {
    use serde_pickle::{HashableValue as H, Value as V};
    let v = serde_pickle::value_from_slice(bytes, serde_pickle::DeOptions::new()).unwrap();
    let get = |d: &V, k: &str| match d {
        V::Dict(m) => m.get(&H::String(k.into())).cloned(),
        _ => panic!("not a dict: {d:?}"),
    };
    let Some(V::List(traces)) = get(&v, "device_traces") else { panic!("no device_traces") };
    let Some(V::List(trace)) = traces.into_iter().next() else { panic!("no device trace") };
    trace
        .iter()
        .map(|e| {
            let Some(V::String(action)) = get(e, "action") else { panic!("{e:?}") };
            let (addr, free) = (get(e, "addr").is_some(), get(e, "device_free").is_some());
            assert_eq!((addr, free), (action != "oom", action == "oom"), "{e:?}");
            match get(e, "pool_id") {
                Some(V::Tuple(t)) if t.len() == 2 => match (&t[0], &t[1]) {
                    (V::I64(a), V::I64(b)) => (action, (*a as u64, *b as u64)),
                    _ => panic!("{t:?}"),
                },
                other => panic!("pool_id {other:?} in {e:?}"),
            }
        })
        .collect()
}

/// PyTorch's `test_pool_id_in_snapshot`: the history is the device's, so what a private pool
/// does is in it — a `MemPool` made before recording began, one made while recording (its
/// stream caches closed from the start, so a same-size reuse is recorded), a CUDA graph's pool,
/// and a pool whose handle is gone (its entries stay) — each entry tagged with its pool's id,
/// written in the dump as PyTorch's `pool_id` tuple beside each segment's `segment_pool_id`
/// (`(0, id)` for the general allocator and the `MemPool`s, `(id, 0)` for the pool a capture
/// made; broken build `graph_pool_ids_as_mempools`: `(0, id)` for it too).
/// Stopping stops every pool; starting again records them again. The broken build
/// `pools_unrecorded` (the general allocator alone records) fails it.
#[test]
fn the_history_is_the_familys_each_entry_with_its_pool() {
    use Action::*;
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let s = dev.create_stream().unwrap();
    let before = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
    alloc.record_history(HistoryOptions::new(100));
    let later = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
    let (b, l) = (before.id(), later.id());
    let general = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    {
        let _guard = alloc.use_pool(&before, s).unwrap();
        drop(alloc.alloc(1000, s).unwrap());
    }
    let kept = {
        let _guard = alloc.use_pool(&later, s).unwrap();
        drop(alloc.alloc(3 * MIB, s).unwrap());
        let kept = alloc.alloc(3 * MIB, s).unwrap(); // a same-size reuse: recorded too
        assert!(alloc.alloc(1 << 40, s).is_err(), "more than the device");
        kept
    };
    drop(later); // the handle: its entries stay, its buffer keeps its memory
    let t = dev.create_stream().unwrap();
    let (graph, out) = alloc.capture(t, None, || alloc.alloc(512, t).unwrap()).unwrap();
    let g = graph.pool().id();
    assert!(![0, b, l].contains(&g));
    let seg = |id| (SegmentAlloc, id, 2 * MIB);
    let (small, large) = (|id| (Alloc, id, 1000), |id| (Alloc, id, 3 * MIB));
    let want = vec![
        (Alloc, 0, 4096),
        seg(b),
        small(b),
        (FreeRequested, b, 1000),
        (FreeCompleted, b, 1000),
        (SegmentAlloc, l, 20 * MIB),
        large(l),
        (FreeRequested, l, 3 * MIB),
        (FreeCompleted, l, 3 * MIB),
        large(l),
        (Oom, l, 1 << 40),
        seg(g),
        (Alloc, g, 512),
    ];
    // The general allocator's 4 KiB came from its own new segment: its entry is first.
    let mut got = pool_entries(&alloc);
    assert_eq!(got.remove(0), seg(0));
    assert_eq!(got, want);
    let in_dump = pool_ids_in_dump(&alloc.snapshot_pickle());
    // PyTorch's ids: `(0, id)` for the general allocator and the `MemPool`s, `(id, 0)` for the
    // pool the capture made (a graph-private pool).
    let pytorch = |id: u64| if id == g { (g, 0) } else { (0, id) };
    let names: Vec<(String, (u64, u64))> = std::iter::once(seg(0))
        .chain(want.iter().copied())
        .map(|(a, id, _)| (a.name().to_string(), pytorch(id)))
        .collect();
    assert_eq!(in_dump, names);
    let ids: Vec<(u64, u64)> = alloc.history().iter().map(|e| e.pytorch_pool_id()).collect();
    assert_eq!(ids, names.iter().map(|n| n.1).collect::<Vec<_>>());
    // Stopped: no pool records; started again: every pool does, the new ring from empty.
    alloc.record_history(HistoryOptions::new(0));
    drop(kept);
    assert!(alloc.history().is_empty());
    alloc.record_history(HistoryOptions::new(100));
    {
        let _guard = alloc.use_pool(&before, s).unwrap();
        drop(alloc.alloc(1000, s).unwrap());
    }
    drop(out);
    let want = vec![small(b), (FreeRequested, b, 1000), (FreeCompleted, b, 1000)];
    let mut want = want;
    want.extend([(FreeRequested, g, 512), (FreeCompleted, g, 512)]);
    assert_eq!(pool_entries(&alloc), want);
    drop((graph, general));
    alloc.check_invariants().unwrap();
    before.check_invariants().unwrap();
}

/// Range marks (PyTorch's `external_annotations`): `record_annotation` and every named scope's
/// open and close while recording, in order on the entries' clock, bounded as the entries are,
/// none while not recording; the dump writes them as PyTorch does (`stage`, `name`, `device`,
/// `time_us`).
#[test]
fn named_scopes_and_annotations_mark_ranges_of_the_history() {
    use serde_pickle::{HashableValue as H, Value as V};
    let (_dev, alloc) = setup();
    alloc.record_annotation("unrecorded", true);
    drop(alloc.named_scope("unrecorded", StreamId::DEFAULT));
    assert!(alloc.annotations().is_empty());
    alloc.record_history(HistoryOptions::new(100));
    alloc.record_annotation("step", true);
    {
        let fwd = alloc.named_scope("fwd", StreamId::DEFAULT);
        drop(fwd.alloc(4096).unwrap());
        drop(alloc.scope(StreamId::DEFAULT)); // anonymous: no mark
    }
    alloc.record_annotation("step", false);
    let marks: Vec<(String, bool)> =
        alloc.annotations().iter().map(|a| (a.name.to_string(), a.start)).collect();
    let want = [("step", true), ("fwd", true), ("fwd", false), ("step", false)];
    assert_eq!(marks, want.map(|(n, s)| (n.to_string(), s)));
    let times: Vec<u64> = alloc.annotations().iter().map(|a| a.time_us).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    let entries = alloc.history();
    let (first, last) = (entries.first().unwrap().time_us, entries.last().unwrap().time_us);
    assert!(times[1] <= first && last <= times[2], "the run's entries inside its range");
    // The dump.
    let v =
        serde_pickle::value_from_slice(&alloc.snapshot_pickle(), serde_pickle::DeOptions::new())
            .unwrap();
    let V::Dict(top) = v else { panic!() };
    let Some(V::List(list)) = top.get(&H::String("external_annotations".into())) else { panic!() };
    let dumped: Vec<(String, String)> = list
        .iter()
        .map(|a| {
            let V::Dict(d) = a else { panic!("{a:?}") };
            let text = |k: &str| match d.get(&H::String(k.into())) {
                Some(V::String(s)) => s.clone(),
                other => panic!("{k}: {other:?}"),
            };
            assert_eq!(d.get(&H::String("device".into())), Some(&V::I64(0)));
            (text("stage"), text("name"))
        })
        .collect();
    let want: Vec<(String, String)> =
        [("START", "step"), ("START", "fwd"), ("END", "fwd"), ("END", "step")]
            .map(|(s, n)| (s.to_string(), n.to_string()))
            .into();
    assert_eq!(dumped, want);
    // Bounded as the entries; forgotten when recording stops.
    alloc.record_history(HistoryOptions::new(3));
    assert_eq!(alloc.annotations().len(), 3);
    alloc.record_history(HistoryOptions::new(0));
    assert!(alloc.annotations().is_empty());
}

/// Recording switched on, off and on again (cleared), with metadata and dumps, while one thread
/// makes pools and allocates in them and another allocates in the general allocator: no
/// deadlock (the family's slot, the allocators' locks and the ring's are taken in one order),
/// every entry names a pool that exists, the invariants hold, and once the threads are done
/// the family records exactly what follows.
#[test]
fn recording_switched_while_threads_allocate_in_pools() {
    use std::sync::{Barrier, Mutex};
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let ids = Mutex::new(vec![0u64]);
    let pools = Mutex::new(Vec::new());
    let start = Barrier::new(3);
    std::thread::scope(|t| {
        t.spawn(|| {
            start.wait();
            for i in 0..300u64 {
                let opts = HistoryOptions::new(if i % 3 == 2 { 0 } else { 64 });
                alloc.record_history(opts.with_clear_history(i % 5 == 0));
                alloc.set_memory_metadata(&format!("round {i}"));
                if i % 7 == 0 {
                    assert!(alloc.snapshot_pickle().len() > 2);
                }
                for e in alloc.history() {
                    assert!(ids.lock().unwrap().contains(&e.pool_id), "{e:?}");
                }
            }
        });
        t.spawn(|| {
            start.wait();
            for i in 0..300u64 {
                let pool = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
                ids.lock().unwrap().push(pool.id());
                let guard = alloc.use_pool(&pool, s1).unwrap();
                drop(alloc.alloc(1000 + i, s1).unwrap());
                let kept = alloc.alloc(3 * MIB, s1).unwrap();
                drop(guard);
                let mut held = pools.lock().unwrap();
                held.push((pool, kept));
                if held.len() > 8 {
                    drop(held.remove(0)); // a pool and its buffer go
                }
            }
        });
        t.spawn(|| {
            start.wait();
            for i in 0..600u64 {
                drop(alloc.alloc(512 + i, s2).unwrap());
            }
        });
    });
    alloc.check_invariants().unwrap();
    let (pool, _kept) = pools.lock().unwrap().pop().unwrap();
    alloc.record_history(HistoryOptions::new(64).with_clear_history(true));
    let guard = alloc.use_pool(&pool, s1).unwrap();
    drop(alloc.alloc(1000, s1).unwrap());
    drop(guard);
    drop(alloc.alloc(1000, s2).unwrap());
    use Action::*;
    let got: Vec<(Action, u64)> = alloc.history().iter().map(|e| (e.action, e.pool_id)).collect();
    let (p, g) = (pool.id(), 0);
    let want = [Alloc, FreeRequested, FreeCompleted];
    let want: Vec<(Action, u64)> =
        want.iter().map(|&a| (a, p)).chain(want.iter().map(|&a| (a, g))).collect();
    assert_eq!(got, want);
    pool.check_invariants().unwrap();
}

/// Scopes across a switch of the recording (found in review): a scope opened before recording
/// started keeps nothing from the history once it records — its frees go through the allocator
/// (recorded), not into its local cache, and its later allocations are not served from that
/// cache unseen — so every recorded allocation has its recorded free; and a named scope whose
/// start went into a ring ends in that ring, never as an end without a start in a ring
/// recording began again since. Broken builds `local_while_recording` and `end_in_new_ring`.
#[test]
fn scopes_across_a_recording_switch_keep_the_history_whole() {
    use Action::*;
    let (_dev, alloc) = setup();
    for named in [false, true] {
        let s = match named {
            true => alloc.named_scope("first", StreamId::DEFAULT),
            false => alloc.scope(StreamId::DEFAULT),
        };
        drop(s.alloc(4096).unwrap()); // into the scope's local cache: before recording
        alloc.record_history(HistoryOptions::new(100).with_clear_history(true));
        drop(s.alloc(4096).unwrap());
        drop(s.alloc(4096).unwrap());
        drop(s);
        let h = alloc.history();
        let count = |a: Action| h.iter().filter(|e| e.action == a).count();
        // (The third free: the block cached before recording, returned as the scope ends.)
        assert_eq!((count(Alloc), count(FreeCompleted)), (2, 3), "named {named}: {h:?}");
        assert_eq!(count(SegmentFree), 0, "named {named}: no plan adopted while recording");
        alloc.record_history(HistoryOptions::new(0));
    }
    alloc.record_history(HistoryOptions::new(100));
    let s = alloc.named_scope("fwd", StreamId::DEFAULT);
    alloc.record_history(HistoryOptions::new(100).with_clear_history(true));
    drop(s);
    let t = alloc.named_scope("bwd", StreamId::DEFAULT);
    alloc.record_history(HistoryOptions::new(0));
    alloc.record_history(HistoryOptions::new(100));
    drop(t);
    assert!(alloc.annotations().is_empty(), "{:?}", alloc.annotations());
    alloc.check_invariants().unwrap();
}

/// A named scope that follows its plan when recording starts: from then on its allocations go
/// through the allocator, which records them (alloc, free_requested, free_completed, none of
/// them in the plan's region), both where the planned path is inlined (no sanitizer) and
/// where every allocation takes the general path (a backed device); once recording stops, the
/// next run follows the plan again at the plan's addresses. Broken build
/// `planned_while_recording`: the plan serves on, unrecorded.
#[test]
fn a_planned_run_records_its_allocations_once_the_history_records() {
    use Action::*;
    for backed in [false, true] {
        let dev = Arc::new(match backed {
            true => SimDevice::backed(64 * MIB),
            false => SimDevice::new(64 * MIB),
        });
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        let run = |record_after_first: bool| {
            let s = alloc.named_scope("step", StreamId::DEFAULT);
            let a = s.alloc(MIB).unwrap();
            if record_after_first {
                alloc.record_history(HistoryOptions::new(100).with_clear_history(true));
            }
            let b = s.alloc(MIB).unwrap();
            let (pb, planned_b) = (b.ptr(), b.is_planned());
            drop(b);
            let c = s.alloc(MIB).unwrap();
            let (pc, planned_c) = (c.ptr(), c.is_planned());
            drop(c);
            let out = ([a.ptr(), pb, pc], [a.is_planned(), planned_b, planned_c]);
            drop(a);
            out
        };
        run(false); // learns
        let (plan, planned) = run(false);
        assert_eq!(planned, [true; 3], "backed {backed}");
        let region = alloc.stats().plan_region_bytes;
        let (ptrs, planned) = run(true);
        assert_eq!(planned, [true, false, false], "backed {backed}: the pool serves b and c");
        assert_eq!(ptrs[0], plan[0]);
        let got: Vec<(Action, u64, u64)> =
            alloc.history().iter().map(|e| (e.action, e.addr.0, e.size)).collect();
        let (b, c) = (ptrs[1].0, ptrs[2].0);
        // (The learning run's segment became the plan's region: the pool makes one.)
        let want = [
            (SegmentAlloc, b, 2 * MIB),
            (Alloc, b, MIB),
            (FreeRequested, b, MIB),
            (FreeCompleted, b, MIB),
            (Alloc, c, MIB),
            (FreeRequested, c, MIB),
            (FreeCompleted, c, MIB),
        ];
        assert_eq!(got, want, "backed {backed}");
        for p in [b, c] {
            assert!(!(plan[0].0..plan[0].0 + region).contains(&p), "backed {backed}: {p:#x}");
        }
        alloc.record_history(HistoryOptions::new(0));
        assert_eq!(run(false), (plan, [true; 3]), "backed {backed}: the plan serves again");
        assert_eq!(alloc.stats().plan_region_bytes, region);
        alloc.check_invariants().unwrap();
        assert_eq!(dev.violations(), vec![]);
    }
}

/// `free_batch` while recording: each buffer's free is in the history as a dropped buffer's
/// is (requested, then completed: the batch frees straight into the pool), so the entries stay
/// complete, also for a buffer allocated before the recording began. Before, the batch's frees were missing: the trace showed its blocks allocated for
/// good (broken build `batch_frees_unrecorded`).
#[test]
fn a_batch_free_is_recorded_as_each_buffers_free() {
    use Action::*;
    let (dev, alloc) = setup();
    let s = dev.create_stream().unwrap();
    let early = alloc.alloc(512, s).unwrap(); // before recording: its free is recorded still
    alloc.record_history(HistoryOptions::new(100));
    let a = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let b = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    alloc.free_batch(vec![b, early, a]).unwrap();
    let pairs =
        |at, size, stream| [(FreeRequested, at, size, stream), (FreeCompleted, at, size, stream)];
    // (Stream order, then the batch's order within a stream; `s`'s segment came first.)
    let mut want = vec![(SegmentAlloc, 2 * MIB, 2 * MIB, 0), (Alloc, 2 * MIB, 4096, 0)];
    want.extend([(SegmentAlloc, 4 * MIB, 20 * MIB, 0), (Alloc, 4 * MIB, 3 * MIB, 0)]);
    want.extend(pairs(4 * MIB, 3 * MIB, 0));
    want.extend(pairs(2 * MIB, 4096, 0));
    want.extend(pairs(0, 512, s.0));
    assert_eq!(entries(&alloc), want);
    let st = alloc.stats();
    assert_eq!(st.blocks.allocated_bytes.all.current, 0);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// Blocks that go back to the pool in a batch while the history records — `free_batch`'s
/// buffers, a scope's locally cached blocks, an idle plan region — are frees of allocated
/// blocks (the snapshot showed them `active_allocated`): each is a `free_requested` and a
/// `free_completed`, as PyTorch records every free, and its allocation stack goes with it.
/// (They were recorded as nothing: `_memory_viz.py`'s timeline kept `free_batch`'s buffers
/// live to the end, and a region's bytes left the allocated figure with only its segment's
/// `segment_free` in the history.) Broken build `batch_frees_unrecorded`.
#[test]
fn blocks_returned_in_a_batch_are_recorded_as_frees() {
    use Action::*;
    let (_dev, alloc) = setup();
    drop(alloc.alloc(512, StreamId::DEFAULT).unwrap()); // the small segment, before recording
    let opts = HistoryOptions::new(100).with_context(tidepool::HistoryContext::State);
    alloc.record_history(opts.clone());
    let a = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let b = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    let (pa, pb) = (a.ptr(), b.ptr());
    alloc.free_batch(vec![a, b]).unwrap();
    assert_eq!(entries(&alloc), small_and_large_freed());
    assert!(alloc.allocation_traceback(pa).is_none() && alloc.allocation_traceback(pb).is_none());
    alloc.record_history(HistoryOptions::new(0));
    alloc.empty_cache().unwrap();

    // A scope's locally cached block, cached before recording, returned at the scope's end;
    // then a named scope's plan region (4 MiB in the 20 MiB segment its learning run made),
    // idle, given back by `empty_cache`.
    let s = alloc.scope(StreamId::DEFAULT);
    drop(s.alloc(4096).unwrap());
    alloc.record_history(opts.clone());
    let snap = alloc.snapshot();
    let live: Vec<(u64, u64)> = snap
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == tidepool::BlockState::Allocated)
        .map(|b| (b.address.0 - SIM_BASE, b.size))
        .collect();
    let [(cached, 4096)] = live[..] else { panic!("the scope's cached block shows allocated") };
    drop(s);
    let want = [(FreeRequested, cached, 4096, 0), (FreeCompleted, cached, 4096, 0)];
    assert_eq!(entries(&alloc), want);
    alloc.record_history(HistoryOptions::new(0));
    for _ in 0..3 {
        let s = alloc.named_scope("step", StreamId::DEFAULT);
        drop((s.alloc(3 * MIB).unwrap(), s.alloc(MIB).unwrap()));
    }
    assert_eq!(alloc.stats().plan_region_bytes, 4 * MIB);
    alloc.record_history(opts);
    let region = alloc.snapshot().into_iter().find(|s| s.size == 20 * MIB).unwrap();
    let base = region.address.0 - SIM_BASE;
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().blocks.allocated_bytes.all.current, 0);
    assert_eq!(
        entries(&alloc),
        vec![
            (FreeRequested, base, 4 * MIB, 0),
            (FreeCompleted, base, 4 * MIB, 0),
            (SegmentFree, base, 20 * MIB, 0),
        ]
    );
    alloc.check_invariants().unwrap();
}

/// `(address, total_size)` of every segment of a dump, and `(action, address, size)` of every
/// entry of its first device's trace, addresses as offsets from `SIM_BASE`.
#[allow(clippy::type_complexity)]
fn dump_contents(bytes: &[u8]) -> (Vec<(u64, u64)>, Vec<(String, u64, u64)>) {
    use common::pickle::{first_trace, get, list, read, string, uint};
    let v = read(bytes);
    let segments = list(get(&v, "segments"))
        .iter()
        .map(|s| (uint(get(s, "address")) - SIM_BASE, uint(get(s, "total_size"))))
        .collect();
    let trace = first_trace(&v)
        .iter()
        .map(|e| (string(get(e, "action")), uint(get(e, "addr")) - SIM_BASE, uint(get(e, "size"))))
        .collect();
    (segments, trace)
}

/// The segments `(address, size, stream)` a viewer that undoes a dump's history from its
/// segments back, as MemoryViz.js does (`simulate_memory`), finds before the first entry, and
/// the entries it could not undo: a `segment_alloc` (or `segment_map`) of no segment of its
/// stream there, an `alloc` outside every segment of its stream.
#[allow(clippy::type_complexity)]
fn undone_from_dump(bytes: &[u8]) -> (Vec<(u64, u64, u64)>, Vec<String>) {
    use common::pickle::{first_trace, get, list, read, string, uint};
    let v = read(bytes);
    let mut segs: Vec<(u64, u64, u64)> = list(get(&v, "segments"))
        .iter()
        .map(|s| {
            let (a, size) = (uint(get(s, "address")), uint(get(s, "total_size")));
            (a - SIM_BASE, size, uint(get(s, "stream")))
        })
        .collect();
    let mut wrong = Vec::new();
    for e in first_trace(&v).iter().rev() {
        let action = string(get(e, "action"));
        if action == "oom" {
            continue;
        }
        let (a, size, stream) =
            (uint(get(e, "addr")) - SIM_BASE, uint(get(e, "size")), uint(get(e, "stream")));
        match action.as_str() {
            "segment_free" | "segment_unmap" => segs.push((a, size, stream)),
            "segment_alloc" | "segment_map" => {
                match segs.iter().position(|&(sa, ss, st)| sa == a && ss == size && st == stream) {
                    Some(i) => {
                        segs.remove(i);
                    }
                    None => wrong.push(format!("{action} {a} {size} on {stream}")),
                }
            }
            "alloc"
                if !segs
                    .iter()
                    .any(|&(sa, ss, st)| sa <= a && a + size <= sa + ss && st == stream) =>
            {
                wrong.push(format!("{action} {a} {size} on {stream}"));
            }
            _ => {}
        }
    }
    segs.sort_unstable();
    (segs, wrong)
}

/// A free segment another stream takes over (`cross_stream`) changes stream with no device
/// call; PyTorch never moves one, so its viewers know segments by stream from their entries.
/// The move is noted as a `segment_free` on the old stream and a `segment_alloc` on the new one
/// (no device call counted), so a viewer undoing the history from the dump's segments back meets
/// every segment on the stream its entries name and ends on the segments, streams included, of
/// the dump taken as recording began. (Nothing was noted: undone, the segment was the new
/// stream's from the start, its allocation's segment on the new stream had no `segment_alloc`
/// and the start differed from the first dump; broken build `takeover_unrecorded`.)
#[test]
fn a_segment_taken_over_by_another_stream_is_recorded_as_its_move() {
    let (dev, alloc) = setup();
    let s = dev.create_stream().unwrap();
    drop(alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap()); // a free 20 MiB segment, stream 0
    alloc.record_history(HistoryOptions::new(100));
    let start = alloc.snapshot_pickle();
    assert_eq!(undone_from_dump(&start), (vec![(0, 20 * MIB, 0)], vec![]));
    let mallocs = alloc.stats().num_device_alloc;
    let b = alloc.alloc(3 * MIB, s).unwrap(); // takes stream 0's segment over
    assert_eq!(b.ptr().0 - SIM_BASE, 0);
    assert_eq!(alloc.stats().num_device_alloc, mallocs, "no device call");
    drop(b);
    use Action::*;
    let s32 = s.0;
    assert_eq!(
        entries(&alloc),
        vec![
            (SegmentFree, 0, 20 * MIB, 0),
            (SegmentAlloc, 0, 20 * MIB, s32),
            (Alloc, 0, 3 * MIB, s32),
            (FreeRequested, 0, 3 * MIB, s32),
            (FreeCompleted, 0, 3 * MIB, s32),
        ]
    );
    let end = alloc.snapshot_pickle();
    assert_eq!(undone_from_dump(&end), (vec![(0, 20 * MIB, 0)], vec![]), "undone to the start");
    alloc.check_invariants().unwrap();
}

/// A dump taken while another thread allocates, frees and empties the cache is one moment's
/// picture: its history ends where the segments were read, so that PyTorch's viewer, undoing
/// the entries from the segments back, meets every segment and block it undoes. (The history
/// was read after the segments, in a lock section of its own: this dump held a
/// `segment_alloc` of a segment it did not list — which MemoryViz.js undoes by removing the
/// last segment of its list — and a `segment_free` of one it still listed.) Broken build
/// `dump_apart`.
#[test]
fn a_dump_is_one_moment_while_other_threads_allocate() {
    let (_dev, alloc) = setup();
    alloc.record_history(HistoryOptions::new(100));
    let keep = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    let gone = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (other, held2) = (alloc.clone(), held.clone());
    alloc.after_next_view(move || {
        // Another thread, between the dump's reading of the segments and the rest.
        held2.lock().unwrap().push(other.alloc(30 * MIB, StreamId::DEFAULT).unwrap());
        drop(gone);
        other.empty_cache().unwrap();
    });
    let during = dump_contents(&alloc.snapshot_pickle());
    let after = dump_contents(&alloc.snapshot_pickle());
    let e = |a: &str, addr: u64, size: u64| (a.to_string(), addr, size);
    assert_eq!(during.0, vec![(0, 20 * MIB), (20 * MIB, 2 * MIB)]);
    let recorded = vec![
        e("segment_alloc", 0, 20 * MIB),
        e("alloc", 0, 3 * MIB),
        e("segment_alloc", 20 * MIB, 2 * MIB),
        e("alloc", 20 * MIB, 4096),
    ];
    assert_eq!(during.1, recorded, "the history as the segments were read");
    // The next dump has what the other thread did, and its segments.
    assert_eq!(after.0, vec![(0, 20 * MIB), (22 * MIB, 30 * MIB)]);
    let mut all = recorded;
    all.extend([
        e("segment_alloc", 22 * MIB, 30 * MIB),
        e("alloc", 22 * MIB, 30 * MIB),
        e("free_requested", 20 * MIB, 4096),
        e("free_completed", 20 * MIB, 4096),
        e("segment_free", 20 * MIB, 2 * MIB),
    ]);
    assert_eq!(after.1, all);
    drop((keep, held));
}

/// The `(stage, name)` of every `external_annotations` entry of a dump.
fn marks_in_dump(bytes: &[u8]) -> Vec<(String, String)> {
    use common::pickle::{get, list, read, string};
    let marks = list(get(&read(bytes), "external_annotations"));
    marks.iter().map(|m| (string(get(m, "stage")), string(get(m, "name")))).collect()
}

/// A dump's range marks are those of the moment its segments and entries were read: a range
/// opened and an allocation made by another thread meanwhile show in neither (the marks were
/// read as the dump ended, so that dump held a `START` whose range's allocations it did not;
/// a reader merging marks and entries by time saw an empty range where there was none).
/// Broken build `marks_after_cut`.
#[test]
fn a_dumps_range_marks_are_of_its_moment() {
    let (_dev, alloc) = setup();
    alloc.record_history(HistoryOptions::new(100));
    alloc.record_annotation("before", true);
    let keep = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (other, held2) = (alloc.clone(), held.clone());
    alloc.after_next_view(move || {
        // Another thread, between the dump's reading of the segments and the rest.
        other.record_annotation("during", true);
        held2.lock().unwrap().push(other.alloc(3 * MIB, StreamId::DEFAULT).unwrap());
    });
    let during = alloc.snapshot_pickle();
    let after = alloc.snapshot_pickle();
    let m = |stage: &str, name: &str| (stage.to_string(), name.to_string());
    assert_eq!(
        marks_in_dump(&during),
        vec![m("START", "before")],
        "the marks as the segments were read"
    );
    assert_eq!(dump_contents(&during).1.len(), 2, "the segment and the 4 KiB allocation");
    assert_eq!(marks_in_dump(&after), vec![m("START", "before"), m("START", "during")]);
    assert_eq!(dump_contents(&after).1.len(), 4, "and the 3 MiB allocation's two entries");
    drop((keep, held));
}
