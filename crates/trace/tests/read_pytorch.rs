//! PyTorch memory snapshot reader: the committed fixture (made by
//! tests/fixtures/make_pytorch_snapshot.py) and malformed snapshots built in Rust.

use std::collections::BTreeMap;
use std::path::Path;

use serde_pickle::{HashableValue, SerOptions, Value};
use tidepool_trace::read::read_pytorch_snapshot;
use tidepool_trace::{ErrorKind, Event, Location, Tag, TraceError, read_trace, read_trace_bytes};

fn fixture() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pytorch_snapshot.pickle")
}

#[test]
fn fixture_round_trip() {
    let t = read_trace(&fixture()).unwrap();
    assert_eq!(t.name, "pytorch_snapshot");
    // segment_alloc, 3 unused free_requested, oom, snapshot, segment_free.
    assert_eq!(t.skipped_records, 7);
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
    // Gzipped snapshots are sniffed too.
    let raw = std::fs::read(fixture()).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &raw).unwrap();
    let mut from_gz = read_trace_bytes(&gz.finish().unwrap()).unwrap();
    from_gz.name = t.name.clone();
    assert_eq!(from_gz, t);
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

fn snapshot(devices: Vec<Vec<Value>>) -> Vec<u8> {
    let v =
        dict(vec![("device_traces", Value::List(devices.into_iter().map(Value::List).collect()))]);
    serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap()
}

fn read(devices: Vec<Vec<Value>>) -> Result<tidepool_trace::Trace, TraceError> {
    read_pytorch_snapshot(&snapshot(devices)[..], "t")
}

fn at(device: usize, index: usize, kind: ErrorKind) -> TraceError {
    TraceError::new(Location::Entry { device, index }, kind)
}

#[test]
fn free_requested_is_used_when_there_is_no_free_completed() {
    let t =
        read(vec![vec![entry("alloc", 0x100, 10), entry("free_requested", 0x100, 10)]]).unwrap();
    assert_eq!(t.events, vec![Event::alloc(0, 10, 0, Tag::Act), Event::free(0, 10, 0, Tag::Act)]);
    assert_eq!(t.skipped_records, 0);
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
    let t = read(vec![
        vec![entry("alloc", 0x100, 10)],
        vec![on_side("alloc", 0x100, 7), on_side("free_completed", 0x100, 7)],
    ])
    .unwrap();
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 10, 0, Tag::Act),
            Event::alloc(1, 7, 1, Tag::Act),
            Event::free(1, 7, 1, Tag::Act),
        ]
    );
}

#[test]
fn malformed_snapshots() {
    let structure = |m: &str| ErrorKind::BadStructure(m.into());
    // Not a pickle at all / truncated pickle.
    let e = read_trace_bytes(&[0x80, 0x04, 0x95]).unwrap_err();
    assert_eq!(e.location, Location::Input);
    assert!(matches!(e.kind, ErrorKind::BadPickle(_)), "{e}");
    // Nesting that would overflow the decoder's stack is refused before decoding.
    let mut deep = b"\x80\x04".to_vec();
    deep.extend(std::iter::repeat_n(b']', 100_000));
    deep.extend(std::iter::repeat_n(b'a', 99_999));
    deep.push(b'.');
    assert_eq!(
        read_trace_bytes(&deep).unwrap_err(),
        TraceError::input(ErrorKind::BadPickle("pickle nests deeper than 128 levels".into()))
    );
    // Wrong top-level shapes.
    let list = serde_pickle::value_to_vec(&Value::List(vec![]), SerOptions::new()).unwrap();
    assert_eq!(
        read_trace_bytes(&list).unwrap_err(),
        TraceError::input(structure("the pickle is not a dict"))
    );
    let no_traces = serde_pickle::value_to_vec(
        &dict(vec![("segments", Value::List(vec![]))]),
        SerOptions::new(),
    )
    .unwrap();
    let e = read_trace_bytes(&no_traces).unwrap_err();
    assert!(
        matches!(e.kind, ErrorKind::BadStructure(ref m) if m.starts_with("no `device_traces` key"))
    );
    let bad_list = serde_pickle::value_to_vec(
        &dict(vec![("device_traces", Value::I64(3))]),
        SerOptions::new(),
    )
    .unwrap();
    assert_eq!(
        read_trace_bytes(&bad_list).unwrap_err(),
        TraceError::input(structure("`device_traces` is not a list"))
    );
    assert_eq!(
        read_pytorch_snapshot(
            &serde_pickle::value_to_vec(
                &dict(vec![("device_traces", Value::List(vec![Value::I64(1)]))]),
                SerOptions::new()
            )
            .unwrap()[..],
            "t"
        )
        .unwrap_err(),
        TraceError::input(structure("device_traces[0] is not a list"))
    );
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
        read(vec![vec![], vec![entry("teleport", 1, 1)]]).unwrap_err(),
        at(1, 0, ErrorKind::UnknownOp("teleport".into()))
    );
    assert_eq!(
        read(vec![vec![dict(vec![("action", s("alloc")), ("addr", Value::I64(1))])]]).unwrap_err(),
        at(0, 0, structure("missing key `size`"))
    );
    assert_eq!(
        read(vec![vec![entry("alloc", 1, -5)]]).unwrap_err(),
        at(0, 0, structure("`size` is not a non-negative integer below 2^64"))
    );
    let e = read(vec![vec![entry("alloc", 16, 1), entry("alloc", 16, 1)]]).unwrap_err();
    assert_eq!(e, at(0, 1, ErrorKind::AllocOfLiveAddress(16)));
    assert_eq!(e.to_string(), "device 0 entry 1: allocate at live address 0x10");
}
