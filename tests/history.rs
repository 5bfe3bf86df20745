//! Memory history and the snapshot pickle: exact entries for scripted programs (stream-ordered
//! frees included), the ring bound, and the dump read back by Python's `pickle` with the structure
//! PyTorch's `_memory_viz.py` reads.

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
    assert_eq!(
        entries(&alloc),
        vec![
            (Alloc, 0, 4096, 0),
            (SegmentAlloc, 2 * MIB, 20 * MIB, 0),
            (Alloc, 2 * MIB, 3 * MIB, 0),
            (FreeRequested, 0, 4096, 0),
            (FreeCompleted, 0, 4096, 0),
            (FreeRequested, 2 * MIB, 3 * MIB, 0),
            (FreeCompleted, 2 * MIB, 3 * MIB, 0),
        ]
    );
    alloc.empty_cache().unwrap();
    let tail: Vec<_> = entries(&alloc).split_off(7);
    assert_eq!(tail, vec![(SegmentFree, 0, 2 * MIB, 0), (SegmentFree, 2 * MIB, 20 * MIB, 0)]);
    let times: Vec<u64> = alloc.history().iter().map(|e| e.time_us).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "times never go back: {times:?}");
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
    assert!(alloc.alloc(1 << 40, StreamId::DEFAULT).is_err());
    let h = alloc.history();
    assert_eq!(h.len(), 1);
    assert_eq!((h[0].action, h[0].addr, h[0].size), (Action::Oom, DeviceAddr::NULL, 1 << 40));
    assert!(h[0].stack.is_some(), "stacks were asked for");
    // The allocator works on.
    drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap());
    alloc.check_invariants().unwrap();
}

/// Python reads the dump; the script checks what `_memory_viz.py` reads and prints figures.
const CHECK_PY: &str = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], 'rb'))
assert set(d) == {'segments', 'device_traces', 'allocator_settings'}, d.keys()
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
    let dir = std::env::temp_dir().join(format!("tidepool-history-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
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
    std::fs::remove_dir_all(&dir).unwrap();
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
