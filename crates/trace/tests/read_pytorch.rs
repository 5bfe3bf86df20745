//! PyTorch memory snapshot reader: the real snapshots of data/snapshots against the figures of
//! their truth.json, the committed fixtures (made by tests/fixtures/make_pytorch_snapshot.py and
//! make_multi_device_snapshot.py) and malformed snapshots built in Rust.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_pickle::{HashableValue, SerOptions, Value};
use tidepool_trace::read::read_pytorch_snapshot;
use tidepool_trace::{
    ErrorKind, Event, Location, Op, PreWindow, ReadOptions, Tag, Trace, TraceError, read_trace,
    read_trace_bytes, read_traces, read_traces_bytes,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn counts(items: &[(&str, u64)]) -> BTreeMap<String, u64> {
    items.iter().map(|&(k, n)| (k.to_string(), n)).collect()
}

/// One real snapshot's figures, as truth.json gives them for device 0 (computed independently
/// with Python's pickle module).
struct Truth {
    file: &'static str,
    entries: u64,
    /// `peak_live_incl_pre_window_blocks_bytes`.
    peak_live: u64,
    /// `trace_only_peak_live_bytes` (blocks freed in the window but allocated before it count
    /// from its start; blocks still live at the snapshot do not).
    trace_only_peak_live: u64,
    /// `live_at_snapshot_not_allocated_in_trace_bytes`.
    pre_window_live: u64,
    /// `pytorch_reserved_at_snapshot_bytes`.
    reserved_at_snapshot: u64,
    /// `pytorch_peak_reserved_in_window_bytes`.
    peak_reserved: u64,
}

const REAL: [Truth; 3] = [
    Truth {
        file: "cs336_wedsonlin_medium128_training.pickle",
        entries: 19136,
        peak_live: 7_013_335_044,
        trace_only_peak_live: 5_303_480_324,
        pre_window_live: 1_709_854_720,
        reserved_at_snapshot: 7_235_174_400,
        peak_reserved: 7_235_174_400,
    },
    Truth {
        file: "ftcourse_memory_snapshot.pickle",
        entries: 10307,
        peak_live: 5_876_132_840,
        trace_only_peak_live: 4_780_407_592,
        pre_window_live: 1_095_725_248,
        reserved_at_snapshot: 6_471_811_072,
        peak_reserved: 6_471_811_072,
    },
    Truth {
        file: "layoutediting_dump_snapshot_emptytraces.pickle",
        entries: 0,
        peak_live: 10_637_601_344,
        trace_only_peak_live: 0,
        pre_window_live: 10_637_601_344,
        reserved_at_snapshot: 11_276_386_304,
        peak_reserved: 11_276_386_304,
    },
];

fn snapshots_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/snapshots")
}

/// The constants above are truth.json's.
#[test]
fn real_snapshot_figures_are_truth_json() {
    let text = std::fs::read_to_string(snapshots_dir().join("truth.json")).unwrap();
    let truth: serde_json::Value = serde_json::from_str(&text).unwrap();
    for t in &REAL {
        let devices = truth[t.file].as_array().unwrap();
        assert_eq!(devices.len(), 1, "{}", t.file);
        let d = &devices[0];
        let n = |k: &str| d[k].as_u64().unwrap();
        assert_eq!(n("device"), 0);
        assert_eq!(n("entries"), t.entries, "{}", t.file);
        assert_eq!(n("peak_live_incl_pre_window_blocks_bytes"), t.peak_live, "{}", t.file);
        assert_eq!(n("trace_only_peak_live_bytes"), t.trace_only_peak_live, "{}", t.file);
        assert_eq!(
            n("live_at_snapshot_not_allocated_in_trace_bytes"),
            t.pre_window_live,
            "{}",
            t.file
        );
        assert_eq!(n("pytorch_reserved_at_snapshot_bytes"), t.reserved_at_snapshot, "{}", t.file);
        assert_eq!(n("pytorch_peak_reserved_in_window_bytes"), t.peak_reserved, "{}", t.file);
    }
}

/// Peak live and PyTorch's recorded reserved memory, to the byte, on the three real snapshots.
#[test]
fn real_snapshots_read_right() {
    for t in &REAL {
        let traces = read_traces(&snapshots_dir().join(t.file), &ReadOptions::default()).unwrap();
        // layoutediting's second device has neither entries nor segments.
        assert_eq!(traces.len(), 1, "{}", t.file);
        let trace = &traces[0];
        trace.validate().unwrap();
        let info = trace.snapshot.as_ref().unwrap();
        assert_eq!(info.device, 0);
        assert_eq!(info.entries, t.entries, "{}", t.file);
        assert_eq!(info.history, t.entries > 0, "{}", t.file);
        assert_eq!(trace.peak_live_bytes(), t.peak_live, "{}", t.file);
        assert_eq!(trace.pre_window.live_bytes, t.pre_window_live, "{}", t.file);
        // Blocks still live at the snapshot are live throughout: the rest is the trace's own.
        assert_eq!(trace.peak_live_bytes() - t.pre_window_live, t.trace_only_peak_live);
        assert_eq!(info.reserved.at_snapshot, t.reserved_at_snapshot, "{}", t.file);
        assert_eq!(info.reserved.peak, t.peak_reserved, "{}", t.file);
        assert!(info.reserved.consistent);
        assert_eq!(info.reserved.timeline.len(), trace.events.len());
        // Blocks live at the start and at the end of the window are the persistent ones.
        let persistent: u64 =
            trace.events.iter().filter(|e| e.tag == Tag::Param).map(|e| e.bytes).sum();
        assert_eq!(persistent, t.pre_window_live, "{}", t.file);
    }
}

/// What else the real snapshots hold, exactly.
#[test]
fn real_snapshot_details() {
    let read = |file: &str| {
        let mut v = read_traces(&snapshots_dir().join(file), &ReadOptions::default()).unwrap();
        v.remove(0)
    };
    // Recent PyTorch: time_us, allocator_settings (its PYTORCH_CUDA_ALLOC_CONF is an empty
    // string shared with frames: it must not decode as None), an optimizer-step annotation.
    let t = read(REAL[0].file);
    assert_eq!(t.skipped, counts(&[("free_requested", 6305)]));
    assert_eq!(
        t.pre_window,
        PreWindow {
            freed_blocks: 438,
            freed_bytes: 3_385_466_880,
            live_blocks: 226,
            live_bytes: 1_709_854_720
        }
    );
    assert_eq!(t.events.len(), 226 + 438 + 6526 + 6305 + 2);
    assert_eq!(t.scope_names, vec!["Optimizer.step#AdamW.step".to_string()]);
    let info = t.snapshot.as_ref().unwrap();
    assert_eq!((info.annotation_scopes, info.reordered, info.reserved.segment_events), (1, 0, 0));
    let set = info.settings.as_ref().unwrap();
    assert_eq!(set.conf, "");
    assert_eq!(
        set.summary(),
        "PYTORCH_CUDA_ALLOC_CONF \"\", expandable_segments False, garbage_collection_threshold 0, \
         graph_capture_record_stream_reuse False, max_split_size -1, \
         pinned_num_register_threads 1, pinned_use_cuda_host_register False, \
         release_lock_on_cudamalloc False, roundup_power2_divisions 0"
    );
    assert_eq!(set.to_config().config, "");
    // Older PyTorch: no time_us, no allocator_settings; 152 segment_alloc entries, so PyTorch
    // reserved 1400897536 B at the start of the window.
    let t = read(REAL[1].file);
    assert_eq!(t.skipped, counts(&[("free_requested", 3325), ("segment_alloc", 152)]));
    let info = t.snapshot.as_ref().unwrap();
    assert!(info.settings.is_none());
    assert_eq!((info.reserved.at_start, info.reserved.segment_events), (1_400_897_536, 152));
    // No history: the static picture, every block persistent, and a note on how to record.
    let t = read(REAL[2].file);
    let info = t.snapshot.as_ref().unwrap();
    assert!(!info.history);
    assert_eq!(t.events.len(), 6241);
    assert!(t.events.iter().all(|e| e.op == Op::Alloc && e.tag == Tag::Param));
    assert!(info.notes[0].starts_with("no allocation history"), "{:?}", info.notes);
}

#[test]
fn fixture_round_trip() {
    let t = read_trace(&fixture("pytorch_snapshot.pickle")).unwrap();
    assert_eq!(t.name, "pytorch_snapshot");
    assert_eq!(
        t.skipped,
        counts(&[
            ("free_requested", 3),
            ("oom", 1),
            ("segment_alloc", 1),
            ("segment_free", 1),
            ("snapshot", 1)
        ])
    );
    assert_eq!(t.skipped_records(), 7);
    assert!(t.scope_names.is_empty());
    assert_eq!(
        t.events,
        vec![
            // Freed in the window but allocated before it: synthetic alloc up front.
            Event::alloc(4, 256, 0, Tag::Act),
            Event::alloc(0, 512, 0, Tag::Act),
            Event::alloc(1, 1024, 0, Tag::Act),
            Event::free(0, 512, 0, Tag::Act),
            Event::alloc(2, 512, 0, Tag::Act), // same address again: new id
            Event::alloc(3, 4 << 20, 1, Tag::Act),
            Event::free(4, 256, 0, Tag::Act),
            Event::free(3, 4 << 20, 1, Tag::Act),
        ]
    );
    assert_eq!(t.peak_live_bytes(), 256 + 1024 + 512 + (4 << 20));
    assert_eq!(
        t.pre_window,
        PreWindow { freed_blocks: 1, freed_bytes: 256, live_blocks: 0, live_bytes: 0 }
    );
    // Reserved: 2 MiB of segments at the snapshot; a 2 MiB segment_alloc and a 20 MiB
    // segment_free in the window, so 20 MiB at its start and 22 MiB at the peak.
    let s = t.snapshot.as_ref().unwrap();
    assert_eq!((s.device, s.history, s.entries), (0, true, 14));
    assert_eq!(
        (s.reserved.at_start, s.reserved.peak, s.reserved.at_snapshot),
        (20 << 20, 22 << 20, 2 << 20)
    );
    assert_eq!(s.reserved.timeline.len(), t.events.len());
    assert_eq!(s.reserved.timeline[0], 20 << 20);
    // After the last event; the 20 MiB segment_free comes after it.
    assert_eq!(s.reserved.timeline.last(), Some(&(22 << 20)));
    // The empty second device is not a trace.
    assert_eq!(
        read_traces(&fixture("pytorch_snapshot.pickle"), &ReadOptions::default()).unwrap().len(),
        1
    );
    // Gzipped snapshots are sniffed too.
    let raw = std::fs::read(fixture("pytorch_snapshot.pickle")).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &raw).unwrap();
    let mut from_gz = read_trace_bytes(&gz.finish().unwrap()).unwrap();
    from_gz.name = t.name.clone();
    assert_eq!(from_gz, t);
}

/// The synthetic multi-device, multi-stream snapshot: every figure of the generator's docstring.
#[test]
fn multi_device_fixture() {
    const MIB: u64 = 1 << 20;
    let path = fixture("multi_device_snapshot.pickle");
    let traces = read_traces(&path, &ReadOptions::default()).unwrap();
    assert_eq!(traces.len(), 2, "device 2 has neither entries nor segments");
    let (d0, d1) = (&traces[0], &traces[1]);

    // Device 0: W1 (persistent) and EARLY (freed in the window) first, then the window with
    // the `train_step` scope around Z. Streams: S1 -> 1 (first seen), default 0, S2 -> 2.
    let i0 = d0.snapshot.as_ref().unwrap();
    assert_eq!((i0.device, i0.history, i0.entries, i0.reordered), (0, true, 15, 0));
    let enter =
        Event { op: Op::ScopeEnter, id: 0, bytes: 0, stream: 0, tag: Tag::Act, scope: Some(0) };
    let exit = Event { op: Op::ScopeExit, ..enter.clone() };
    assert_eq!(
        d0.events,
        vec![
            Event::alloc(5, 4_000_000, 0, Tag::Param), // W1: live at the start and the end
            Event::alloc(3, MIB, 0, Tag::Act),         // EARLY: freed in the window
            Event::alloc(0, 500, 1, Tag::Act),         // Y on S1
            Event::alloc(1, 2 * MIB, 0, Tag::Act),     // X
            enter,
            Event::alloc(2, 6_000_000, 2, Tag::Act), // Z on S2 (segment_map before it)
            Event::free(2, 6_000_000, 2, Tag::Act),  // free_completed
            Event::free(3, MIB, 0, Tag::Act),
            exit,
            Event::alloc(4, 3 * MIB, 0, Tag::Act), // Q
            Event::free(4, 3 * MIB, 0, Tag::Act),  // a plain `free`
        ]
    );
    assert_eq!(d0.scope_names, vec!["train_step".to_string()]);
    assert_eq!(i0.annotation_scopes, 1);
    assert_eq!(d0.peak_live_bytes(), 13_146_228);
    assert_eq!(
        d0.pre_window,
        PreWindow { freed_blocks: 1, freed_bytes: MIB, live_blocks: 1, live_bytes: 4_000_000 }
    );
    assert_eq!(
        d0.skipped,
        counts(&[
            ("external_annotations (nested)", 1),
            ("free_requested", 2),
            ("oom", 1),
            ("segment_alloc", 1),
            ("segment_map", 1),
            ("segment_unmap", 1),
            ("snapshot", 1),
            ("user_defined", 1),
        ])
    );
    // PyTorch reserved 20 MiB at the start, +2 MiB (segment_alloc), +8 MiB (segment_map),
    // -8 MiB (segment_unmap): 30 MiB at the peak, 22 MiB at the snapshot.
    assert_eq!(
        (i0.reserved.at_start, i0.reserved.peak, i0.reserved.at_snapshot),
        (20 * MIB, 30 * MIB, 22 * MIB)
    );
    assert_eq!(i0.reserved.segment_events, 3);
    assert!(i0.reserved.consistent);
    assert_eq!(
        i0.reserved.timeline,
        [20, 20, 22, 22, 22, 30, 30, 30, 30, 30, 30].map(|m| m * MIB).to_vec()
    );

    // Device 1: listed out of time order; in time order G and H overlap on V.
    let i1 = d1.snapshot.as_ref().unwrap();
    assert_eq!((i1.device, i1.history, i1.entries, i1.reordered), (1, true, 6, 1));
    assert_eq!(
        d1.events,
        vec![
            Event::alloc(2, 1_000_000, 1, Tag::Param), // V, on S3 -> stream 1 of device 1
            Event::alloc(0, 1_500_000, 1, Tag::Act),
            Event::alloc(1, 400_000, 1, Tag::Act),
            Event::free(0, 1_500_000, 1, Tag::Act),
            Event::free(1, 400_000, 1, Tag::Act),
        ]
    );
    assert_eq!(d1.peak_live_bytes(), 2_900_000);
    assert_eq!(d1.skipped, counts(&[("segment_alloc", 1), ("segment_free", 1)]));
    assert_eq!(
        (i1.reserved.at_start, i1.reserved.peak, i1.reserved.at_snapshot),
        (4 * MIB, 6 * MIB, 4 * MIB)
    );
    assert!(i1.notes[0].contains("out of time_us order"), "{:?}", i1.notes);

    // allocator_settings, read and mapped; floats come from the configuration string.
    let set = i0.settings.as_ref().unwrap();
    assert_eq!(set.expandable_segments, Some(true));
    assert_eq!(set.max_split_size, Some(64 << 20));
    assert!(set.summary().contains("garbage_collection_threshold 0.8"), "{}", set.summary());
    assert!(set.summary().contains("roundup_power2_divisions 4"), "{}", set.summary());
    let m = set.to_config();
    assert_eq!(
        m.config,
        "max_split_size_mb:64,roundup_power2_divisions:4,expandable_segments:true,\
         garbage_collection_threshold:0.8"
    );
    assert_eq!(m.notes.len(), 2, "{:?}", m.notes);
    assert!(m.notes[0].starts_with("garbage_collection_threshold 0.8"));
    assert!(m.notes[1].contains("release_lock_on_cudamalloc"));

    // A single trace cannot be asked of it.
    let e = read_trace(&path).unwrap_err();
    assert_eq!(e, TraceError::input(ErrorKind::SeveralDevices(vec![0, 1])));
    assert!(e.to_string().contains("--device N"), "{e}");
}

fn s(x: &str) -> Value {
    Value::String(x.into())
}

fn dict(items: Vec<(&str, Value)>) -> Value {
    Value::Dict(
        items
            .into_iter()
            .map(|(k, v)| (HashableValue::String(k.into()), v))
            .collect::<BTreeMap<_, _>>(),
    )
}

fn entry(action: &str, addr: i64, size: i64) -> Value {
    dict(vec![
        ("action", s(action)),
        ("addr", Value::I64(addr)),
        ("size", Value::I64(size)),
        ("stream", Value::I64(0)),
    ])
}

fn timed(action: &str, addr: i64, size: i64, time: i64) -> Value {
    let mut e = entry(action, addr, size);
    if let Value::Dict(m) = &mut e {
        m.insert(HashableValue::String("time_us".into()), Value::I64(time));
    }
    e
}

fn pickle(v: &Value) -> Vec<u8> {
    serde_pickle::value_to_vec(v, SerOptions::new()).unwrap()
}

fn snapshot(devices: Vec<Vec<Value>>) -> Vec<u8> {
    pickle(&dict(vec![(
        "device_traces",
        Value::List(devices.into_iter().map(Value::List).collect()),
    )]))
}

fn read_all(devices: Vec<Vec<Value>>) -> Result<Vec<Trace>, TraceError> {
    read_pytorch_snapshot(&snapshot(devices)[..], "t")
}

fn read(devices: Vec<Vec<Value>>) -> Result<Trace, TraceError> {
    read_trace_bytes(&snapshot(devices))
}

fn at(device: usize, index: usize, kind: ErrorKind) -> TraceError {
    TraceError::new(Location::Entry { device, index }, kind)
}

#[test]
fn free_requested_is_used_when_there_is_no_free_completed() {
    let t =
        read(vec![vec![entry("alloc", 0x100, 10), entry("free_requested", 0x100, 10)]]).unwrap();
    assert_eq!(t.events, vec![Event::alloc(0, 10, 0, Tag::Act), Event::free(0, 10, 0, Tag::Act)]);
    assert_eq!(t.skipped_records(), 0);
}

#[test]
fn plain_free_user_defined_and_oom_are_accepted() {
    let t = read(vec![vec![
        entry("alloc", 0x100, 10),
        entry("user_defined", 0, 0),
        dict(vec![("action", s("oom")), ("device_free", Value::I64(5)), ("size", Value::I64(1))]),
        entry("free", 0x100, 10),
    ]])
    .unwrap();
    assert_eq!(t.events, vec![Event::alloc(0, 10, 0, Tag::Act), Event::free(0, 10, 0, Tag::Act)]);
    assert_eq!(t.skipped, counts(&[("oom", 1), ("user_defined", 1)]));
}

#[test]
fn devices_have_separate_address_spaces_and_streams() {
    let on_side = |action, addr, size| {
        let mut e = entry(action, addr, size);
        if let Value::Dict(m) = &mut e {
            m.insert(HashableValue::String("stream".into()), Value::I64(99));
        }
        e
    };
    let t = read_all(vec![
        vec![on_side("alloc", 0x200, 3), entry("alloc", 0x100, 10)],
        vec![on_side("alloc", 0x100, 7), on_side("free_completed", 0x100, 7)],
    ])
    .unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(
        t[0].events,
        vec![Event::alloc(0, 3, 1, Tag::Act), Event::alloc(1, 10, 0, Tag::Act)]
    );
    // Stream handle 99 is stream 1 on device 1 as well: ids are per device.
    assert_eq!(t[1].events, vec![Event::alloc(0, 7, 1, Tag::Act), Event::free(0, 7, 1, Tag::Act)]);
    assert_eq!(t[1].snapshot.as_ref().map(|s| s.device), Some(1));
}

#[test]
fn entries_are_put_in_time_order_only_when_all_have_a_time() {
    // In list order the two blocks never overlap; in time order they do.
    let listed = vec![
        timed("alloc", 0x100, 10, 1),
        timed("free_completed", 0x100, 10, 4),
        timed("alloc", 0x200, 20, 2),
        timed("free_completed", 0x200, 20, 5),
    ];
    let t = read(vec![listed.clone()]).unwrap();
    assert_eq!(t.peak_live_bytes(), 30);
    assert_eq!(t.snapshot.as_ref().unwrap().reordered, 1);
    let mut untimed = listed;
    untimed[3] = entry("free_completed", 0x200, 20);
    let t = read(vec![untimed]).unwrap();
    assert_eq!(t.peak_live_bytes(), 20);
    assert_eq!(t.snapshot.as_ref().unwrap().reordered, 0);
}

fn segment(device: i64, address: i64, total: i64, blocks: Vec<Value>) -> Value {
    dict(vec![
        ("device", Value::I64(device)),
        ("address", Value::I64(address)),
        ("total_size", Value::I64(total)),
        ("stream", Value::I64(0)),
        ("blocks", Value::List(blocks)),
    ])
}

fn block(size: i64, requested: i64, state: &str) -> Value {
    dict(vec![
        ("size", Value::I64(size)),
        ("requested_size", Value::I64(requested)),
        ("state", s(state)),
    ])
}

#[test]
fn history_less_snapshot_is_the_static_picture() {
    // Blocks without `address` (older snapshots) follow each other from the segment's address.
    let snap = dict(vec![
        ("device_traces", Value::List(vec![Value::List(vec![]), Value::List(vec![])])),
        (
            "segments",
            Value::List(vec![segment(
                0,
                0x1000,
                4096,
                vec![
                    block(1024, 1000, "active_allocated"),
                    block(1024, 1024, "inactive"),
                    block(512, 500, "active_pending_free"),
                    block(1536, 1536, "active_allocated"),
                ],
            )]),
        ),
    ]);
    let traces = read_traces_bytes(&pickle(&snap), &ReadOptions::default()).unwrap();
    assert_eq!(traces.len(), 1);
    let t = &traces[0];
    // The block pending its free holds its memory too (tests/read_pytorch_versions.rs).
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 1000, 0, Tag::Param),
            Event::alloc(1, 500, 0, Tag::Param),
            Event::alloc(2, 1536, 0, Tag::Param)
        ]
    );
    assert_eq!(t.peak_live_bytes(), 3036);
    let info = t.snapshot.as_ref().unwrap();
    assert!(!info.history);
    assert_eq!((info.reserved.at_start, info.reserved.peak), (4096, 4096));
    assert!(info.notes[0].starts_with("no allocation history"), "{:?}", info.notes);
    assert!(info.notes[0].contains("_record_memory_history("), "{:?}", info.notes);
}

#[test]
fn snapshots_with_nothing_in_them_are_refused_with_how_to_record() {
    let e = read_all(vec![vec![], vec![]]).unwrap_err();
    assert_eq!(e.location, Location::Input);
    let text = e.to_string();
    assert!(text.contains("holds no allocations"), "{text}");
    assert!(text.contains("torch.cuda.memory._record_memory_history(max_entries"), "{text}");
    assert!(text.contains("_dump_snapshot("), "{text}");
}

#[test]
fn a_segment_list_says_what_it_is_and_what_to_record() {
    // What pickle.dump(torch.cuda.memory_snapshot(), f) writes: a list of segments.
    let list =
        Value::List(vec![segment(0, 0x1000, 4096, vec![block(4096, 4000, "active_allocated")])]);
    let e = read_trace_bytes(&pickle(&list)).unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("input: not a PyTorch memory snapshot: the pickle is a list of 1 segment, as torch.cuda.memory_snapshot() returns"),
        "{text}"
    );
    assert!(text.contains("torch.cuda.memory._record_memory_history("), "{text}");
    let e = read_trace_bytes(&pickle(&Value::List(vec![Value::I64(1)]))).unwrap_err();
    assert!(e.to_string().contains("the pickle is a list of 1 item, not a dict"), "{e}");
}

#[test]
fn reserved_that_goes_below_zero_is_raised_and_said() {
    // The window allocates a 100-byte segment but the snapshot holds no segment at all.
    let t = read(vec![vec![entry("segment_alloc", 0x100, 100), entry("alloc", 1, 1)]]).unwrap();
    let info = t.snapshot.as_ref().unwrap();
    assert!(!info.reserved.consistent);
    assert_eq!((info.reserved.at_start, info.reserved.peak), (0, 100));
    assert_eq!(info.reserved.timeline, vec![100]);
    assert!(info.notes.iter().any(|n| n.contains("lowest point is 0")), "{:?}", info.notes);
}

#[test]
fn annotations_become_scopes_only_when_they_pair_up() {
    let ann = |stage: &str, name: &str, time: i64| {
        dict(vec![
            ("stage", s(stage)),
            ("name", s(name)),
            ("device", Value::I64(0)),
            ("time_us", Value::I64(time)),
        ])
    };
    let entries = Value::List(vec![Value::List(vec![
        timed("alloc", 0x100, 10, 10),
        timed("alloc", 0x200, 10, 20),
        timed("free_completed", 0x200, 10, 30),
    ])]);
    let snap = |anns: Vec<Value>| {
        pickle(&dict(vec![
            ("device_traces", entries.clone()),
            ("external_annotations", Value::List(anns)),
        ]))
    };
    // START at 15, END at 30: the scope holds the alloc at 20 and the free at 30.
    let t =
        read_trace_bytes(&snap(vec![ann("START", "step", 15), ann("END", "step", 30)])).unwrap();
    let ops: Vec<Op> = t.events.iter().map(|e| e.op).collect();
    assert_eq!(ops, [Op::Alloc, Op::ScopeEnter, Op::Alloc, Op::Free, Op::ScopeExit]);
    // An END without START is skipped; a START without END runs to the end.
    let t = read_trace_bytes(&snap(vec![ann("END", "x", 5), ann("START", "step", 25)])).unwrap();
    let ops: Vec<Op> = t.events.iter().map(|e| e.op).collect();
    assert_eq!(ops, [Op::Alloc, Op::Alloc, Op::ScopeEnter, Op::Free, Op::ScopeExit]);
    assert_eq!(t.skipped, counts(&[("external_annotations (END without START)", 1)]));
    assert!(t.snapshot.as_ref().unwrap().notes[0].contains("has no END"));
    t.validate().unwrap();
}

#[test]
fn malformed_snapshots() {
    let structure = |m: &str| ErrorKind::BadStructure(m.into());
    // Not a pickle at all / truncated pickle.
    let e = read_trace_bytes(&[0x80, 0x04, 0x95]).unwrap_err();
    assert_eq!(e.location, Location::Input);
    assert!(matches!(e.kind, ErrorKind::BadPickle(_)), "{e}");
    // Nesting deeper than 128 levels is refused.
    let mut deep = b"\x80\x04".to_vec();
    deep.extend(std::iter::repeat_n(b']', 100_000));
    deep.extend(std::iter::repeat_n(b'a', 99_999));
    deep.push(b'.');
    assert_eq!(
        read_trace_bytes(&deep).unwrap_err(),
        TraceError::input(ErrorKind::BadPickle("pickle nests deeper than 128 levels".into()))
    );
    // Wrong top-level shapes.
    let list = pickle(&Value::List(vec![]));
    let e = read_trace_bytes(&list).unwrap_err();
    assert!(
        matches!(e.kind, ErrorKind::BadStructure(ref m) if m.starts_with("the pickle is a list of 0 items, not a dict")),
        "{e}"
    );
    assert_eq!(
        read_trace_bytes(&pickle(&Value::I64(3))).unwrap_err(),
        TraceError::input(structure("the pickle is not a dict"))
    );
    let no_traces = pickle(&dict(vec![("segments", Value::List(vec![]))]));
    let e = read_trace_bytes(&no_traces).unwrap_err();
    assert!(
        matches!(e.kind, ErrorKind::BadStructure(ref m) if m.starts_with("no `device_traces` key")),
        "{e}"
    );
    let bad_list = pickle(&dict(vec![("device_traces", Value::I64(3))]));
    assert_eq!(
        read_trace_bytes(&bad_list).unwrap_err(),
        TraceError::input(structure("`device_traces` is not a list"))
    );
    assert_eq!(
        read_pytorch_snapshot(
            &pickle(&dict(vec![("device_traces", Value::List(vec![Value::I64(1)]))]))[..],
            "t"
        )
        .unwrap_err(),
        TraceError::input(structure("device_traces[0] is not a list"))
    );
    let bad_segments = |segs: Value| {
        read_trace_bytes(&pickle(&dict(vec![
            ("device_traces", Value::List(vec![])),
            ("segments", segs),
        ])))
        .unwrap_err()
    };
    assert_eq!(
        bad_segments(Value::I64(1)),
        TraceError::input(structure("`segments` is not a list"))
    );
    assert_eq!(
        bad_segments(Value::List(vec![dict(vec![("device", Value::I64(0))])])),
        TraceError::input(structure("segments[0]: missing key `address`"))
    );
    assert_eq!(
        bad_segments(Value::List(vec![segment(-1, 0, 0, vec![])])),
        TraceError::input(structure(
            "segments[0]: `device` is not a non-negative integer below 2^64"
        ))
    );
    assert_eq!(
        bad_segments(Value::List(vec![segment(0, 0, 8, vec![Value::I64(2)])])),
        TraceError::input(structure("segments[0].blocks[0]: not a dict"))
    );
    assert_eq!(
        bad_segments(Value::List(vec![segment(0, -2, 8, vec![])])),
        TraceError::input(structure(
            "segments[0]: `address` is not a non-negative integer below 2^64"
        ))
    );
    let mut past_end = block(16, 16, "inactive");
    if let Value::Dict(m) = &mut past_end {
        m.insert(HashableValue::String("address".into()), Value::Int((u64::MAX - 7).into()));
    }
    assert_eq!(
        bad_segments(Value::List(vec![segment(0, 0, 8, vec![past_end])])),
        TraceError::input(structure("segments[0].blocks[0]: block ends past 2^64"))
    );
    let e = read_trace_bytes(&pickle(&dict(vec![
        ("device_traces", Value::List(vec![Value::List(vec![entry("alloc", 1, 1)])])),
        ("allocator_settings", Value::I64(1)),
    ])))
    .unwrap_err();
    assert_eq!(e, TraceError::input(structure("`allocator_settings` is not a dict")));
    // Entry-level problems name device and entry.
    assert_eq!(
        read(vec![vec![entry("alloc", 1, 1), Value::I64(5)]]).unwrap_err(),
        at(0, 1, structure("entry is not a dict"))
    );
    assert_eq!(
        read(vec![vec![dict(vec![("addr", Value::I64(1))])]]).unwrap_err(),
        at(0, 0, structure("missing key `action`"))
    );
    assert_eq!(
        read(vec![vec![dict(vec![("action", Value::I64(1))])]]).unwrap_err(),
        at(0, 0, structure("`action` is not a string"))
    );
    assert_eq!(
        read(vec![vec![dict(vec![("action", s("alloc")), ("addr", Value::I64(1))])]]).unwrap_err(),
        at(0, 0, structure("missing key `size`"))
    );
    assert_eq!(
        read(vec![vec![entry("alloc", 1, -5)]]).unwrap_err(),
        at(0, 0, structure("`size` is not a non-negative integer below 2^64"))
    );
    let mut bad_time = entry("alloc", 1, 1);
    if let Value::Dict(m) = &mut bad_time {
        m.insert(HashableValue::String("time_us".into()), s("noon"));
    }
    assert_eq!(
        read(vec![vec![bad_time]]).unwrap_err(),
        at(0, 0, structure("`time_us` is not an integer"))
    );
    let e = read(vec![vec![entry("alloc", 16, 1), entry("alloc", 16, 1)]]).unwrap_err();
    assert_eq!(e, at(0, 1, ErrorKind::AllocOfLiveAddress(16)));
    assert_eq!(e.to_string(), "device 0 entry 1: allocate at live address 0x10");
}

/// A gzip bomb ends at the cap with an error naming it and how to raise it; a pickle larger
/// than the cap is refused before it is decoded.
#[test]
fn input_is_capped() {
    let raw = std::fs::read(fixture("multi_device_snapshot.pickle")).unwrap();
    let small = ReadOptions { max_input_bytes: 1000 };
    let e = read_traces_bytes(&raw, &small).unwrap_err();
    assert_eq!(e, TraceError::input(ErrorKind::InputTooLarge { cap: 1000, decompressed: false }));
    assert_eq!(
        e.to_string(),
        "input: input is larger than the cap of 1000 B; raise the cap with \
         `tidepool replay --max-input-size SIZE` (library: ReadOptions::max_input_bytes)"
    );
    // 8 MiB of CSV (blank rows) in a gzip of a few KiB, read with a 1 MiB cap.
    let mut csv = b"seq,op,id,bytes,stream,tag\n".to_vec();
    csv.resize(8 << 20, b'\n');
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, &csv).unwrap();
    let bomb = gz.finish().unwrap();
    assert!(bomb.len() < 100 << 10, "{}", bomb.len());
    let e = read_traces_bytes(&bomb, &ReadOptions { max_input_bytes: 1 << 20 }).unwrap_err();
    assert_eq!(e, TraceError::input(ErrorKind::InputTooLarge { cap: 1 << 20, decompressed: true }));
    assert!(
        e.to_string().starts_with("input: decompressed input is larger than the cap of 1.00 MiB"),
        "{e}"
    );
    // Exactly at the cap is fine.
    let csv = b"seq,op,id,bytes,stream,tag\n0,alloc,1,1,0,act\n";
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, csv).unwrap();
    let gz = gz.finish().unwrap();
    let exact = ReadOptions { max_input_bytes: csv.len() as u64 };
    assert_eq!(read_traces_bytes(&gz, &exact).unwrap().len(), 1);
    let under = ReadOptions { max_input_bytes: csv.len() as u64 - 1 };
    assert!(matches!(
        read_traces_bytes(&gz, &under).unwrap_err().kind,
        ErrorKind::InputTooLarge { .. }
    ));
}

/// A PyTorch-style pickle written by hand: `n` allocations of 512 bytes on device 0, then their
/// frees, every entry's `frames` one shared list of `frames` frame dicts — written once and
/// referenced by memo id 0 after that, as Python's pickler writes a traceback many entries
/// share (real snapshots share them so: 7.9 million decoded values from the 2.6 MB ftcourse
/// snapshot when every reference was copied).
fn shared_traceback_snapshot(n: u32, frames: u32) -> Vec<u8> {
    let text = |p: &mut Vec<u8>, t: &str| {
        p.extend([0x8c, u8::try_from(t.len()).unwrap()]);
        p.extend(t.as_bytes());
    };
    let int = |p: &mut Vec<u8>, v: u32| {
        p.push(b'J');
        p.extend(i32::try_from(v).unwrap().to_le_bytes());
    };
    let mut p = b"\x80\x04}(".to_vec();
    text(&mut p, "device_traces");
    p.extend(b"]]("); // all devices, device 0's entries, a mark
    for i in 0..2 * n {
        let (action, k) = if i < n { ("alloc", i) } else { ("free_completed", i - n) };
        p.extend(b"}(");
        for (key, value) in [("action", action), ("addr", ""), ("size", ""), ("stream", "")] {
            text(&mut p, key);
            match key {
                "action" => text(&mut p, value),
                "addr" => int(&mut p, 0x1000_0000 + k * 512),
                "size" => int(&mut p, 512),
                _ => p.extend(b"K\x00"),
            }
        }
        text(&mut p, "frames");
        if i == 0 {
            p.extend(b"]r\x00\x00\x00\x00("); // the list, memo id 0, a mark
            for line in 0..frames {
                p.extend(b"}(");
                text(&mut p, "filename");
                text(&mut p, "train.py");
                text(&mut p, "line");
                int(&mut p, line);
                text(&mut p, "name");
                text(&mut p, "forward");
                p.push(b'u');
            }
            p.push(b'e');
        } else {
            p.extend(b"j\x00\x00\x00\x00");
        }
        p.push(b'u');
    }
    p.extend(b"eau.");
    p
}

/// Regression: a long snapshot whose entries share one traceback read as copies of it at every
/// reference (serde-pickle rebuilds no sharing), 20 000 entries × 300 frames × 7 values = 42
/// million values, refused as "expands to more than 10000000 values" — a real snapshot a
/// little longer than ftcourse was. The decoder shares a memoized container, so this reads, to
/// the byte.
#[test]
fn a_long_snapshot_sharing_its_tracebacks_reads() {
    let data = shared_traceback_snapshot(10_000, 300);
    let trace = read_trace_bytes(&data).unwrap();
    trace.validate().unwrap();
    assert_eq!(trace.events.len(), 20_000);
    assert_eq!(trace.peak_live_bytes(), 10_000 * 512);
    assert_eq!(trace.events[0].bytes, 512);
    assert_eq!(trace.events[0].op, Op::Alloc);
    assert_eq!(trace.events[10_000].op, Op::Free);
    // No bound on values but the input's size: a traceback of 1.5 million frames (10.5
    // million values, once refused) reads.
    let trace = read_trace_bytes(&shared_traceback_snapshot(1, 1_500_000)).unwrap();
    assert_eq!(trace.events.len(), 2);
}

/// serde-pickle parsed the decimal text of `INT`/`LONG` in time quadratic in its length (4
/// million digits took 32 s, and a 15 KB gzip file of 16 million many minutes): refused past
/// 1024 digits (found in review).
#[test]
fn long_decimal_integers_are_refused_before_decoding() {
    let mut p = b"\x80\x02(L".to_vec();
    p.extend(std::iter::repeat_n(b'7', 2_000_000));
    p.extend(b"L\nl.");
    let e = read_trace_bytes(&p).unwrap_err();
    assert!(e.to_string().contains("decimal integer longer than 1024 digits"), "{e}");
    // 1000 digits decode (and the reader then finds no snapshot in a list).
    let mut p = b"\x80\x02(L".to_vec();
    p.extend(std::iter::repeat_n(b'7', 1000));
    p.extend(b"L\nl.");
    let e = read_trace_bytes(&p).unwrap_err();
    assert!(!e.to_string().contains("decimal integer"), "{e}");
}

/// serde-pickle allocated a 128-value stack per open `MARK`: `(` × n then `1` × n cost ~4 KB
/// of memory per input byte, and a 9.7 KB gzip file aborted the process under a 4 GB limit.
/// Open marks nest as containers do: refused past `MAX_DEPTH` (found in review).
#[test]
fn runs_of_marks_are_refused() {
    let mut p = b"\x80\x04".to_vec();
    p.extend(std::iter::repeat_n(b'(', 300_000));
    p.extend(std::iter::repeat_n(b'1', 300_000));
    p.extend(b"N.");
    let e = read_trace_bytes(&p).unwrap_err();
    assert!(e.to_string().contains("nests deeper than 128 levels"), "{e}");
}

/// PyTorch appends entries in list order under its allocator lock; a clock that steps back
/// between a free and the alloc that reuses its address made time order allocate a live
/// address, and the whole snapshot was refused. Such a device is read in list order, with a
/// note (found in review).
#[test]
fn a_clock_stepping_back_falls_back_to_the_lists_order() {
    let a = 0x7f00_0000_0000;
    let t = read(vec![vec![
        timed("alloc", a, 1 << 20, 1),
        timed("free_requested", a, 1 << 20, 10),
        timed("free_completed", a, 1 << 20, 10),
        timed("alloc", a, 1 << 20, 9),
        timed("free_completed", a, 1 << 20, 11),
    ]])
    .unwrap();
    assert_eq!(t.peak_live_bytes(), 1 << 20);
    let ops: Vec<Op> = t.events.iter().map(|e| e.op).collect();
    assert_eq!(ops, [Op::Alloc, Op::Free, Op::Alloc, Op::Free]);
    let info = t.snapshot.unwrap();
    assert_eq!(info.reordered, 0);
    assert!(info.notes.iter().any(|n| n.contains("in the order of the list")), "{:?}", info.notes);
    // A real double alloc is still refused (named as time order found it).
    let e = read(vec![vec![timed("alloc", a, 1, 2), timed("alloc", a, 1, 1)]]).unwrap_err();
    assert_eq!(e, at(0, 0, ErrorKind::AllocOfLiveAddress(a as u64)));
}

/// torch_npu (Ascend) writes the same snapshot with a `workspace_snapshot` action: a marker,
/// skipped and counted, not an unknown action that refuses the file (found in review).
#[test]
fn workspace_snapshot_entries_are_markers() {
    let t = read(vec![vec![
        entry("alloc", 0x1000, 512),
        entry("workspace_snapshot", 0, 0),
        entry("free_completed", 0x1000, 512),
    ]])
    .unwrap();
    assert_eq!(t.skipped.get("workspace_snapshot"), Some(&1));
    assert_eq!(t.events.len(), 2);
}

/// PyTorch keeps adding trace actions (`annotate` came late); `MemoryViz.js` ignores any it does
/// not know (`default: break`). An unknown action refused the whole snapshot; it is now skipped,
/// counted by name (at most 8 names, then together) and said in a note that the replay shows,
/// while the known memory actions around it stay exact (found in review).
#[test]
fn unknown_actions_are_skipped_counted_and_noted() {
    let bare = |action: &str| dict(vec![("action", s(action))]);
    let t = read(vec![vec![
        entry("alloc", 0x100, 10),
        bare("future_marker"),
        entry("future_marker", 0x100, 10),
        entry("alloc", 0x200, 30),
        entry("free_completed", 0x100, 10),
        entry("free_completed", 0x200, 30),
    ]])
    .unwrap();
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 10, 0, Tag::Act),
            Event::alloc(1, 30, 0, Tag::Act),
            Event::free(0, 10, 0, Tag::Act),
            Event::free(1, 30, 0, Tag::Act),
        ]
    );
    assert_eq!(t.peak_live_bytes(), 40);
    assert_eq!(t.skipped, counts(&[("future_marker (unknown action)", 2)]));
    let note = "2 entries of action `future_marker` unknown to this reader were skipped (as \
                PyTorch's viewer skips them); if such an entry allocates or frees memory, the \
                replay misses it";
    assert_eq!(t.snapshot.as_ref().unwrap().notes, vec![note.to_string()]);
    let lines = tidepool_trace::Report::new(&t, vec![]).header_lines();
    assert!(lines.contains(&"skipped: future_marker (unknown action) 2".to_string()), "{lines:?}");
    assert!(lines.contains(&format!("note: {note}")), "{lines:?}");

    // Ten names: eight counted by name, the others together.
    let mut entries = vec![entry("alloc", 0x100, 10)];
    entries.extend((0..10).map(|i| bare(&format!("new{i}"))));
    entries.push(bare("new9"));
    let t = read(vec![entries]).unwrap();
    let mut want: Vec<(String, u64)> =
        (0..8).map(|i| (format!("new{i} (unknown action)"), 1)).collect();
    want.push(("other unknown actions".into(), 3));
    assert_eq!(t.skipped, want.into_iter().collect::<BTreeMap<_, _>>());
    assert_eq!(
        t.snapshot.as_ref().unwrap().notes,
        vec![
            "11 entries of actions `new0`, `new1`, `new2`, `new3`, `new4`, `new5`, `new6`, \
             `new7` and others unknown to this reader were skipped (as PyTorch's viewer skips \
             them); if such an entry allocates or frees memory, the replay misses it"
                .to_string()
        ]
    );
    assert_eq!(t.events, vec![Event::alloc(0, 10, 0, Tag::Act)]);
}

/// An `external_annotations` record of a stage other than START or END (one PyTorch may add)
/// refused the whole snapshot; it is skipped and counted on its device. A missing or
/// non-string stage is still malformed (found in review).
#[test]
fn annotations_of_another_stage_are_skipped_and_counted() {
    let ann = |stage: Value, name: &str, time: i64| {
        dict(vec![
            ("stage", stage),
            ("name", s(name)),
            ("device", Value::I64(0)),
            ("time_us", Value::I64(time)),
        ])
    };
    let snap = |anns: Vec<Value>| {
        pickle(&dict(vec![
            (
                "device_traces",
                Value::List(vec![Value::List(vec![
                    timed("alloc", 0x100, 10, 10),
                    timed("alloc", 0x200, 10, 20),
                    timed("free_completed", 0x200, 10, 30),
                ])]),
            ),
            ("external_annotations", Value::List(anns)),
        ]))
    };
    let t = read_trace_bytes(&snap(vec![
        ann(s("START"), "step", 15),
        dict(vec![("stage", s("MIDDLE")), ("device", Value::I64(0))]),
        ann(s("END"), "step", 30),
    ]))
    .unwrap();
    let ops: Vec<Op> = t.events.iter().map(|e| e.op).collect();
    assert_eq!(ops, [Op::Alloc, Op::ScopeEnter, Op::Alloc, Op::Free, Op::ScopeExit]);
    assert_eq!(t.skipped, counts(&[("external_annotations (stage neither START nor END)", 1)]));
    assert_eq!(t.snapshot.as_ref().unwrap().annotation_scopes, 1);
    assert_eq!(
        read_trace_bytes(&snap(vec![ann(Value::I64(1), "x", 5)])).unwrap_err(),
        TraceError::input(ErrorKind::BadStructure(
            "external_annotations[0]: missing or non-string `stage`".into()
        ))
    );
}

/// PyTorch frees a block once (its `free` of an unknown pointer is an error), and its history
/// is a window of consecutive entries: a free of an address the window freed already, with no
/// alloc of it in between, is no block from before the window (it would have overlapped the
/// window's own) but a double free, refused as the RMM reader refuses one. Frees of unseen
/// blocks at the start of a window, `free_requested` then `free_completed` of one block, and
/// segment entries of the address still read (found in review).
#[test]
fn a_second_free_of_an_address_is_a_double_free_not_a_block_from_before_the_window() {
    let a = 0x7f00_0000_0000i64;
    let e = read(vec![vec![
        entry("alloc", a, 512),
        entry("free_requested", a, 512),
        entry("free_completed", a, 512),
        entry("free_completed", a, 512),
    ]])
    .unwrap_err();
    assert_eq!(e, at(0, 3, ErrorKind::FreeOfUnknownAddress(a as u64)));
    assert_eq!(
        e.to_string(),
        "device 0 entry 3: free of address 0x7f0000000000, which was freed already and not \
         allocated since"
    );
    // The first free of a block from before the window, then a second.
    assert_eq!(
        read(vec![vec![
            entry("free_completed", a, 512),
            entry("alloc", a + 4096, 8),
            entry("free_completed", a, 512),
        ]])
        .unwrap_err(),
        at(0, 2, ErrorKind::FreeOfUnknownAddress(a as u64))
    );
    // Where `free_requested` is the free, the same.
    assert_eq!(
        read(vec![vec![
            entry("alloc", a, 512),
            entry("free_requested", a, 512),
            entry("free_requested", a, 512),
        ]])
        .unwrap_err(),
        at(0, 2, ErrorKind::FreeOfUnknownAddress(a as u64))
    );
    // A valid window: a block from before it freed, its segment freed and mapped again, the
    // address allocated and freed again.
    let t = read(vec![vec![
        entry("free_requested", a, 512),
        entry("free_completed", a, 512),
        entry("segment_free", a, 2 << 20),
        entry("segment_alloc", a, 2 << 20),
        entry("alloc", a, 256),
        entry("free_requested", a, 256),
        entry("free_completed", a, 256),
    ]])
    .unwrap();
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 512, 0, Tag::Act),
            Event::free(0, 512, 0, Tag::Act),
            Event::alloc(1, 256, 0, Tag::Act),
            Event::free(1, 256, 0, Tag::Act),
        ]
    );
    assert_eq!(t.pre_window.freed_blocks, 1);
    assert_eq!(t.pre_window.freed_bytes, 512);
    // No `alloc` recorded at all (`skip_actions=["alloc"]`): every free is of an unseen block.
    let t =
        read(vec![vec![entry("free_completed", a, 512), entry("free_completed", a, 512)]]).unwrap();
    assert_eq!(t.pre_window.freed_blocks, 2);
    assert_eq!(t.pre_window.freed_bytes, 1024);
    // Nor where an action the reader does not know may have allocated the address again.
    let t = read(vec![vec![
        entry("alloc", a, 512),
        entry("free_completed", a, 512),
        entry("alloc_from_the_future", a, 512),
        entry("free_completed", a, 512),
    ]])
    .unwrap();
    assert_eq!(t.pre_window.freed_blocks, 1);
    assert_eq!(t.skipped, counts(&[("alloc_from_the_future (unknown action)", 1)]));
    // A clock stepping back that makes time order free an address twice falls back to the
    // list's order.
    let t = read(vec![vec![
        timed("free_completed", a, 512, 10),
        timed("alloc", a, 256, 11),
        timed("free_completed", a, 256, 2),
    ]])
    .unwrap();
    assert_eq!(t.pre_window.freed_blocks, 1);
    assert_eq!(t.peak_live_bytes(), 512);
    assert!(t.snapshot.unwrap().notes.iter().any(|n| n.contains("in the order of the list")));
}

/// A `time_us` beyond ±2^127 was "not an integer"; it is an integer out of range, and so said
/// (entries and annotations; found in review).
#[test]
fn a_huge_time_us_is_named_out_of_range() {
    let mut huge = entry("alloc", 1, 1);
    if let Value::Dict(m) = &mut huge {
        m.insert(HashableValue::String("time_us".into()), Value::Int(u128::MAX.into()));
    }
    assert_eq!(
        read(vec![vec![huge]]).unwrap_err(),
        at(
            0,
            0,
            ErrorKind::BadStructure("`time_us` is an integer outside ±2^127 microseconds".into())
        )
    );
    let ann = dict(vec![
        ("stage", s("START")),
        ("name", s("x")),
        ("device", Value::I64(0)),
        ("time_us", Value::Int(u128::MAX.into())),
    ]);
    let e = read_trace_bytes(&pickle(&dict(vec![
        ("device_traces", Value::List(vec![Value::List(vec![entry("alloc", 1, 1)])])),
        ("external_annotations", Value::List(vec![ann])),
    ])))
    .unwrap_err();
    assert_eq!(
        e,
        TraceError::input(ErrorKind::BadStructure(
            "external_annotations[0]: `time_us` is an integer outside ±2^127 microseconds".into()
        ))
    );
}

/// Hand-written pickle pieces for the sharing tests below (serde-pickle writes no memo).
struct Pickler(Vec<u8>);

impl Pickler {
    fn new() -> Self {
        Pickler(b"\x80\x04".to_vec())
    }

    fn text(&mut self, t: &str) -> &mut Self {
        self.0.extend([0x8c, u8::try_from(t.len()).unwrap()]);
        self.0.extend(t.as_bytes());
        self
    }

    fn int(&mut self, v: u32) -> &mut Self {
        self.0.push(b'J');
        self.0.extend(i32::try_from(v).unwrap().to_le_bytes());
        self
    }

    fn ops(&mut self, ops: &[u8]) -> &mut Self {
        self.0.extend(ops);
        self
    }

    /// A dict of string keys (`EMPTY_DICT MARK … SETITEMS`); `value` writes each value.
    fn dict(&mut self, keys: &[&str], mut value: impl FnMut(&mut Self, &str)) -> &mut Self {
        self.ops(b"}(");
        for k in keys {
            self.text(k);
            value(self, k);
        }
        self.ops(b"u")
    }
}

/// `copies` devices whose `device_traces` lists are one list of `pairs` allocs and frees of 512
/// bytes, written once (memo id 0) and referenced again by the others, as a pickler writes an
/// object it meets twice.
fn shared_entries_snapshot(copies: u32, pairs: u32) -> Vec<u8> {
    let mut p = Pickler::new();
    p.ops(b"}(").text("device_traces").ops(b"](").ops(b"]r\x00\x00\x00\x00(");
    for i in 0..2 * pairs {
        let action = if i % 2 == 0 { "alloc" } else { "free_completed" };
        p.dict(&["action", "addr", "size"], |p, k| {
            match k {
                "action" => p.text(action),
                "addr" => p.int(0x1000),
                _ => p.int(512),
            };
        });
    }
    p.ops(b"e");
    for _ in 1..copies {
        p.ops(b"j\x00\x00\x00\x00");
    }
    p.ops(b"eu.");
    p.0
}

/// `copies` segments of device 0 at one address whose `blocks` are one list of `blocks`
/// allocated blocks of 512 bytes, written once (memo id 0) and referenced by the others.
fn shared_blocks_snapshot(copies: u32, blocks: u32) -> Vec<u8> {
    let mut p = Pickler::new();
    p.ops(b"}(").text("device_traces").ops(b"]").text("segments").ops(b"](");
    for s in 0..copies {
        p.dict(&["device", "address", "total_size", "blocks"], |p, k| {
            match k {
                "device" => p.ops(b"K\x00"),
                "address" => p.int(0x10_0000),
                "total_size" => p.int(blocks * 512),
                _ if s > 0 => p.ops(b"j\x00\x00\x00\x00"),
                _ => {
                    p.ops(b"]r\x00\x00\x00\x00(");
                    for b in 0..blocks {
                        p.dict(&["address", "size", "requested_size", "state"], |p, k| {
                            match k {
                                "address" => p.int(0x10_0000 + b * 512),
                                "state" => p.text("active_allocated"),
                                _ => p.int(512),
                            };
                        });
                    }
                    p.ops(b"e")
                }
            };
        });
    }
    p.ops(b"eu.");
    p.0
}

/// A pickle shares an object it meets twice, and the decoder keeps it shared (one value per
/// input byte at most), and the reader reads a shared `device_traces` list once per device and a
/// shared `blocks` list once per segment, as Python sees them; but unbounded, 5 000 devices
/// over one list of 10 000 entries (a 30 KB pickle) became 5 000 traces of 10 000 events
/// (2.7 GB, 31 s of `tidepool replay`), and 8 000 segments over one list of 8 000 blocks
/// (32 KB) asked for a 1 GB vector and aborted. The entries and blocks read are at most one per
/// byte of pickle (found by review of the reader for hostile input).
#[test]
fn lists_shared_between_devices_or_segments_are_read_within_the_input_size() {
    let read = |data: &[u8]| read_traces_bytes(data, &ReadOptions::default());
    // Shared by two devices or two segments: read for each.
    let two = read(&shared_entries_snapshot(2, 3)).unwrap();
    assert_eq!(two.len(), 2);
    for (d, t) in two.iter().enumerate() {
        assert_eq!(t.events.len(), 6);
        assert_eq!(t.peak_live_bytes(), 512);
        assert_eq!(t.snapshot.as_ref().unwrap().device, d as u32);
    }
    let segs = read(&shared_blocks_snapshot(1, 3)).unwrap();
    assert_eq!(segs[0].events.len(), 3);
    assert_eq!(segs[0].peak_live_bytes(), 3 * 512);
    // Two segments at one address, their blocks the same list: the blocks overlap.
    let e = read(&shared_blocks_snapshot(2, 3)).unwrap_err();
    assert!(e.to_string().contains("two blocks that hold memory on device 0 overlap"), "{e}");

    let message = |place: &str, bytes: usize| {
        TraceError::input(ErrorKind::BadStructure(format!(
            "{place}: the pickle's lists of entries and blocks, each read once per reference to \
             it, hold more than one record per byte of its {bytes} B (a list shared between \
             devices or segments: PyTorch writes one per device and per segment)"
        )))
    };
    let entries = shared_entries_snapshot(1000, 1000);
    assert_eq!(entries.len(), 94_027);
    // 2 000 entries per device: the budget runs out at the 48th.
    assert_eq!(read(&entries).unwrap_err(), message("device_traces[47]", 94_027));
    let blocks = shared_blocks_snapshot(1000, 1000);
    assert_eq!(blocks.len(), 131_038);
    assert_eq!(read(&blocks).unwrap_err(), message("segments[131]", 131_038));
}

/// A dict of `action: oom` and then `keys` items `"x": "x"` (one `DUP` byte each), as the
/// entries of one device, `entries` times (one `DUP` each): a wide record the pickle shares.
fn wide_entries_snapshot(keys: u32, entries: u32) -> Vec<u8> {
    let mut p = Pickler::new();
    p.ops(b"}(").text("device_traces").ops(b"](").ops(b"](").ops(b"}(");
    p.text("action").text("oom").text("x");
    p.0.extend(std::iter::repeat_n(b'2', 2 * keys as usize - 1));
    p.ops(b"u");
    p.0.extend(std::iter::repeat_n(b'2', entries as usize - 1));
    p.ops(b"eeu.");
    p.0
}

/// A snapshot's record (entry, segment, block, annotation) is a dict whose keys are looked up
/// one by one, by a scan of its items; a wide dict shared by every entry made reading quadratic
/// in the input: 16 001 items shared by 32 000 entries (a 64 KB pickle) took 1.3 s, 256 KB 19 s,
/// and a 1 GiB input (the cap) would take years. PyTorch's records have about a dozen keys:
/// more than 256 items are refused (found by review of the reader for hostile input).
#[test]
fn records_wider_than_256_items_are_refused() {
    let wide = |items: usize| {
        ErrorKind::BadStructure(format!(
            "a dict of {items} items; this reader takes at most 256 (PyTorch writes about a dozen)"
        ))
    };
    // 255 items of junk beside `action`: read, the entries counted as `oom` markers.
    let t = read_trace_bytes(&wide_entries_snapshot(255, 3)).unwrap();
    assert_eq!(t.events.len(), 0);
    assert_eq!(t.skipped, counts(&[("oom", 3)]));
    let data = wide_entries_snapshot(16_000, 32_000);
    assert!(data.len() < 64 << 10, "{}", data.len());
    for (data, items) in [(wide_entries_snapshot(256, 3), 257), (data, 16_001)] {
        assert_eq!(read_trace_bytes(&data).unwrap_err(), at(0, 0, wide(items)));
    }

    // Segments, blocks and annotations alike (serde-pickle writes the wide dicts in full).
    let junk = |mut v: Value, n: usize| {
        if let Value::Dict(m) = &mut v {
            m.extend((0..n).map(|i| (HashableValue::String(format!("k{i}")), Value::I64(0))));
        }
        v
    };
    let seg = |blocks| segment(0, 0x10_0000, 2 << 20, blocks);
    let blk = block(512, 512, "active_allocated");
    // PyTorch 1.13: no `requested_size`, the first `history` record's `real_size`.
    let legacy = dict(vec![
        ("size", Value::I64(512)),
        ("state", s("active_allocated")),
        ("history", Value::List(vec![junk(dict(vec![("real_size", Value::I64(500))]), 256)])),
    ]);
    let ann = dict(vec![
        ("stage", s("START")),
        ("name", s("x")),
        ("device", Value::I64(0)),
        ("time_us", Value::I64(0)),
    ]);
    let cases = [
        (junk(seg(vec![blk.clone()]), 252), "segments[0]: ", 257),
        (seg(vec![junk(blk.clone(), 254)]), "segments[0].blocks[0]: ", 257),
        (seg(vec![legacy]), "segments[0].blocks[0]: history[0]: ", 257),
        (junk(ann, 253), "external_annotations[0]: ", 257),
    ];
    for (i, (v, place, items)) in cases.into_iter().enumerate() {
        let key = if i == 3 { "external_annotations" } else { "segments" };
        let data = pickle(&dict(vec![
            ("device_traces", Value::List(vec![Value::List(vec![entry("alloc", 1, 1)])])),
            (key, Value::List(vec![v])),
        ]));
        let ErrorKind::BadStructure(m) = wide(items) else { unreachable!() };
        assert_eq!(
            read_trace_bytes(&data).unwrap_err(),
            TraceError::input(ErrorKind::BadStructure(format!("{place}{m}")))
        );
    }
    // The settings and their roundup dict: 256 items read, 257 refused.
    let settings = |n: usize, roundup: usize| {
        let roundup = Value::Dict(
            (0..roundup).map(|i| (HashableValue::I64(i as i64 + 1), Value::I64(4))).collect(),
        );
        let mut m = BTreeMap::new();
        m.insert(HashableValue::String("roundup_power2_divisions".into()), roundup);
        m.extend((1..n).map(|i| (HashableValue::String(format!("k{i}")), s("v"))));
        read_trace_bytes(&pickle(&dict(vec![
            ("device_traces", Value::List(vec![Value::List(vec![entry("alloc", 1, 1)])])),
            ("allocator_settings", Value::Dict(m)),
        ])))
    };
    let t = settings(256, 256).unwrap();
    assert_eq!(t.snapshot.unwrap().settings.unwrap().entries.len(), 256);
    let ErrorKind::BadStructure(m) = wide(257) else { unreachable!() };
    assert_eq!(
        settings(257, 1).unwrap_err(),
        TraceError::input(ErrorKind::BadStructure(format!("allocator_settings: {m}")))
    );
    assert_eq!(
        settings(1, 257).unwrap_err(),
        TraceError::input(ErrorKind::BadStructure(format!(
            "allocator_settings.roundup_power2_divisions: {m}"
        )))
    );
    // A list of wide dicts is no list of segments (`torch.cuda.memory_snapshot()`), whatever
    // their keys: they are not looked into.
    let e = read_trace_bytes(&pickle(&Value::List(vec![junk(seg(vec![]), 252)]))).unwrap_err();
    assert!(e.to_string().contains("the pickle is a list of 1 item, not a dict"), "{e}");
    let e = read_trace_bytes(&pickle(&Value::List(vec![junk(seg(vec![]), 251)]))).unwrap_err();
    assert!(e.to_string().contains("the pickle is a list of 1 segment, as"), "{e}");
}

/// The snapshot's `allocator_settings` are one value shared by every device's trace: a copy per
/// device made a 220 KB pickle (a 200 KB `PYTORCH_CUDA_ALLOC_CONF`, 20 000 devices sharing one
/// list of one entry) take 3.9 GB and 10 s (found by review of the reader for hostile input).
#[test]
fn allocator_settings_are_shared_by_the_devices_not_copied() {
    let conf = "x".repeat(1000);
    let data = pickle(&dict(vec![
        (
            "device_traces",
            Value::List(vec![
                Value::List(vec![entry("alloc", 16, 16)]),
                Value::List(vec![entry("alloc", 16, 16)]),
                Value::List(vec![entry("oom", 0, 0)]),
            ]),
        ),
        ("allocator_settings", dict(vec![("PYTORCH_CUDA_ALLOC_CONF", s(&conf))])),
    ]));
    let traces = read_traces_bytes(&data, &ReadOptions::default()).unwrap();
    assert_eq!(traces.len(), 3);
    let settings: Vec<_> =
        traces.iter().map(|t| t.snapshot.as_ref().unwrap().settings.clone().unwrap()).collect();
    assert_eq!(settings[0].conf, conf);
    for s in &settings[1..] {
        assert!(std::sync::Arc::ptr_eq(&settings[0], s));
    }
}

/// PyTorch records a free with its allocation's requested size. A free recorded with another
/// size (a fork's recorder, a broken file) frees the block its allocation made: it is replayed
/// at the allocation's size, and a note says how many frees were recorded so and which was the
/// first, so that the reader of the report knows the file is not what PyTorch writes.
#[test]
fn a_free_recorded_with_another_size_is_replayed_at_its_allocations_and_noted() {
    let a = 0x7f00_0000_0000i64;
    let t = read(vec![vec![
        entry("alloc", a, 512),
        entry("alloc", a + 512, 1024),
        entry("free_completed", a, 700),
        entry("free_completed", a + 512, 1024),
        entry("alloc", a, 256),
        entry("free_completed", a, 4096),
    ]])
    .unwrap();
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 512, 0, Tag::Act),
            Event::alloc(1, 1024, 0, Tag::Act),
            Event::free(0, 512, 0, Tag::Act),
            Event::free(1, 1024, 0, Tag::Act),
            Event::alloc(2, 256, 0, Tag::Act),
            Event::free(2, 256, 0, Tag::Act),
        ]
    );
    let notes = &t.snapshot.as_ref().unwrap().notes;
    assert_eq!(
        notes,
        &vec![
            "2 frees were recorded with another size than its allocation's (the first, entry 2: \
             700 B freed, 512 B allocated); each is replayed as a free of the block its \
             allocation made"
                .to_string()
        ]
    );
    // One such free, and frees of the right size note nothing.
    let one = read(vec![vec![entry("alloc", a, 512), entry("free_completed", a, 511)]]).unwrap();
    assert_eq!(
        one.snapshot.as_ref().unwrap().notes,
        vec![
            "1 free was recorded with another size than its allocation's (entry 1: 511 B freed, \
             512 B allocated); it is replayed as a free of the block its allocation made"
                .to_string()
        ]
    );
    let right = read(vec![vec![entry("alloc", a, 512), entry("free_completed", a, 512)]]).unwrap();
    assert!(right.snapshot.as_ref().unwrap().notes.is_empty());
}

/// PyTorch records the history of every device at once: in a snapshot where device 0 has
/// entries, device 1 with segments and no entries did nothing while the history was recorded.
/// Its note said the snapshot was taken without `_record_memory_history()` and told how to
/// record one. Broken build `history_note_per_device`.
#[test]
fn a_device_without_entries_in_a_recorded_snapshot_is_not_called_unrecorded() {
    let block = dict(vec![
        ("address", Value::I64(1 << 30)),
        ("size", Value::I64(1 << 20)),
        ("requested_size", Value::I64(1 << 20)),
        ("state", s("active_allocated")),
    ]);
    let segment = |device: i64| {
        dict(vec![
            ("device", Value::I64(device)),
            ("address", Value::I64(1 << 30)),
            ("total_size", Value::I64(2 << 20)),
            ("stream", Value::I64(0)),
            ("blocks", Value::List(vec![block.clone()])),
        ])
    };
    let with = |traces: Vec<Vec<Value>>| {
        pickle(&dict(vec![
            ("segments", Value::List(vec![segment(1)])),
            ("device_traces", Value::List(traces.into_iter().map(Value::List).collect())),
        ]))
    };
    let recorded =
        vec![vec![entry("alloc", 4096, 512), entry("free_completed", 4096, 512)], vec![]];
    let traces = read_pytorch_snapshot(&with(recorded)[..], "t").unwrap();
    assert_eq!(traces.len(), 2);
    let i1 = traces[1].snapshot.as_ref().unwrap();
    assert_eq!((i1.device, i1.history), (1, false));
    assert_eq!(
        i1.notes,
        vec![
            "no entries on this device: the history was recorded (other devices have entries), \
             and this device allocated and freed nothing while it was (or its entries were cut); \
             this is the static picture at the snapshot (1 block live, tagged persistent)"
                .to_string()
        ]
    );
    // With no entries anywhere, the snapshot was taken without a history: as before.
    let traces = read_pytorch_snapshot(&with(vec![vec![], vec![]])[..], "t").unwrap();
    let i1 = traces[0].snapshot.as_ref().unwrap();
    assert_eq!(i1.device, 1);
    assert!(i1.notes[0].starts_with("no allocation history"), "{:?}", i1.notes);
}
