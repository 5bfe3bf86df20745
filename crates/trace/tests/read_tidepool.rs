//! Tidepool CSV reader: every malformed case names its line and reason; gzip and plain
//! inputs read the same; the shipped traces have the figures stated in their README.

use std::io::Write;
use std::path::Path;

use flate2::Compression;
use flate2::write::GzEncoder;
use tidepool_trace::read::{MAX_LINE, read_tidepool_csv};
use tidepool_trace::{
    ErrorKind, Event, Location, Op, Tag, TraceError, read_trace, read_trace_bytes,
};

const HEADER: &str = "seq,op,id,bytes,stream,tag\n";

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn err(body: &str) -> TraceError {
    read_trace_bytes(format!("{HEADER}{body}").as_bytes()).unwrap_err()
}

fn at(line: u64, kind: ErrorKind) -> TraceError {
    TraceError::new(Location::Line(line), kind)
}

const GOOD: &str = "\
seq,op,id,bytes,stream,tag
0,alloc,0,1024,0,param
1,scope_enter,0,0,0,step0
2,alloc,1,512,1,act
3,free,1,512,1,act
4,scope_exit,0,0,0,step0
5,scope_enter,7,0,0,step1
6,scope_exit,7,0,0,step1
";

#[test]
fn reads_events_exactly() {
    let t = read_trace_bytes(GOOD.as_bytes()).unwrap();
    assert_eq!(t.name, "trace");
    assert_eq!(t.scope_names, vec!["step0", "step1"]);
    let marker =
        |op, id, scope| Event { op, id, bytes: 0, stream: 0, tag: Tag::Act, scope: Some(scope) };
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 1024, 0, Tag::Param),
            marker(Op::ScopeEnter, 0, 0),
            Event::alloc(1, 512, 1, Tag::Act),
            Event::free(1, 512, 1, Tag::Act),
            marker(Op::ScopeExit, 0, 0),
            marker(Op::ScopeEnter, 7, 1),
            marker(Op::ScopeExit, 7, 1),
        ]
    );
    assert_eq!(t.peak_live_bytes(), 1536);
    assert_eq!(t.num_allocs(), 2);
    t.validate().unwrap();
}

#[test]
fn gzip_plain_and_crlf_agree() {
    let plain = read_trace_bytes(GOOD.as_bytes()).unwrap();
    assert_eq!(read_trace_bytes(&gzip(GOOD.as_bytes())).unwrap(), plain);
    let crlf = GOOD.replace('\n', "\r\n");
    assert_eq!(read_trace_bytes(crlf.as_bytes()).unwrap(), plain);
    assert_eq!(read_tidepool_csv(GOOD.as_bytes(), "trace").unwrap(), plain);
}

#[test]
fn header_only_is_an_empty_trace() {
    let t = read_trace_bytes(HEADER.as_bytes()).unwrap();
    assert!(t.events.is_empty());
    assert_eq!(t.peak_live_bytes(), 0);
}

#[test]
fn input_level_errors() {
    assert_eq!(read_trace_bytes(b"").unwrap_err(), TraceError::input(ErrorKind::Empty));
    assert_eq!(read_trace_bytes(b"\n\n").unwrap_err(), TraceError::input(ErrorKind::Empty));
    let e = read_trace_bytes(b"seq,op,id,bytes,stream\n0,alloc,0,1,0\n").unwrap_err();
    assert_eq!(e.location, Location::Line(1));
    assert!(
        matches!(e.kind, ErrorKind::WrongHeader { ref found, .. } if found == "seq,op,id,bytes,stream")
    );
    let e = read_tidepool_csv(&b"Thread,Time,Action,Pointer,Size,Stream\n"[..], "x").unwrap_err();
    assert_eq!(e.location, Location::Line(1));
    assert!(
        matches!(e.kind, ErrorKind::WrongHeader { expected, .. } if expected == "seq,op,id,bytes,stream,tag")
    );
    // Truncated gzip stream.
    let gz = gzip(GOOD.as_bytes());
    let e = read_trace_bytes(&gz[..gz.len() / 2]).unwrap_err();
    assert!(matches!(e.kind, ErrorKind::Io(_)), "{e}");
    // A binary file.
    let e = read_trace_bytes(&[0xff, 0xfe, 0x00, 0x01, b'\n']).unwrap_err();
    assert_eq!(e, at(1, ErrorKind::NotUtf8));
}

#[test]
fn row_errors_name_line_and_reason() {
    assert_eq!(err("0,alloc,1,100,0\n"), at(2, ErrorKind::MissingColumn("tag")));
    assert_eq!(err("0,alloc\n"), at(2, ErrorKind::MissingColumn("id")));
    assert_eq!(err("0,alloc,1,100,0,act,x\n"), at(2, ErrorKind::ExtraColumn));
    let bad = |column, text: &str| ErrorKind::BadNumber { column, text: text.into() };
    assert_eq!(err("x,alloc,1,100,0,act\n"), at(2, bad("seq", "x")));
    assert_eq!(err("0,alloc,-1,100,0,act\n"), at(2, bad("id", "-1")));
    assert_eq!(err("0,alloc,1,12x,0,act\n"), at(2, bad("bytes", "12x")));
    assert_eq!(
        err("0,alloc,1,18446744073709551616,0,act\n"),
        at(2, bad("bytes", "18446744073709551616"))
    );
    assert_eq!(err("0,alloc,1,1,4294967296,act\n"), at(2, bad("stream", "4294967296")));
    assert_eq!(err("0,malloc,1,1,0,act\n"), at(2, ErrorKind::UnknownOp("malloc".into())));
    assert_eq!(err("0,alloc,1,1,0,weights\n"), at(2, ErrorKind::UnknownTag("weights".into())));
    assert_eq!(err("0,alloc,1,1,0,act\n1,alloc,1,1,0,act\n"), at(3, ErrorKind::DoubleAlloc(1)));
    assert_eq!(
        err("0,alloc,1,1,0,act\n1,free,1,1,0,act\n2,alloc,1,1,0,act\n"),
        at(4, ErrorKind::DoubleAlloc(1))
    );
    assert_eq!(err("0,alloc,1,1,0,act\n1,free,7,1,0,act\n"), at(3, ErrorKind::FreeOfUnknownId(7)));
    assert_eq!(
        err("0,alloc,1,1,0,act\n1,free,1,1,0,act\n2,free,1,1,0,act\n"),
        at(4, ErrorKind::DoubleFree(1))
    );
    assert_eq!(
        err("0,alloc,1,10,0,act\n1,free,1,11,0,act\n"),
        at(3, ErrorKind::FreeSizeMismatch { id: 1, allocated: 10, freed: 11 })
    );
    // A free may leave bytes at 0.
    let t = read_trace_bytes(format!("{HEADER}0,alloc,1,10,0,act\n1,free,1,0,0,act\n").as_bytes())
        .unwrap();
    assert_eq!(t.events.len(), 2);
}

#[test]
fn scope_errors() {
    let unbalanced = |s: &str| ErrorKind::UnbalancedScope(s.into());
    assert_eq!(
        err("0,scope_exit,0,0,0,s\n"),
        at(2, unbalanced("scope_exit of scope 0 that was never entered"))
    );
    assert_eq!(
        err("0,scope_enter,0,0,0,s\n1,scope_exit,0,0,0,s\n2,scope_exit,0,0,0,s\n"),
        at(4, unbalanced("scope_exit of scope 0 with no open scope"))
    );
    assert_eq!(
        err("0,scope_enter,0,0,0,s\n1,alloc,1,1,0,act\n"),
        at(3, unbalanced("1 scope(s) still open at end of trace"))
    );
    assert_eq!(
        err("0,scope_enter,0,0,0,s\n1,scope_enter,0,0,0,s\n"),
        at(3, unbalanced("scope 0 entered while already open"))
    );
    assert_eq!(
        err("0,scope_enter,0,0,0,a\n1,scope_enter,1,0,0,b\n2,scope_exit,0,0,0,a\n"),
        at(4, unbalanced("scope_exit of scope 0 while an inner scope is open"))
    );
    assert_eq!(
        err(
            "0,scope_enter,0,0,0,a\n1,scope_enter,1,0,0,b\n2,scope_exit,1,0,0,b\n3,scope_exit,0,0,0,a\n4,scope_enter,5,0,0,c\n5,scope_exit,1,0,0,b\n"
        ),
        at(7, unbalanced("scope_exit of scope 1 that is not open"))
    );
    assert_eq!(
        err("0,scope_enter,0,0,0,a\n1,scope_exit,0,0,0,b\n"),
        at(3, unbalanced("scope 0 named `b` here but `a` before"))
    );
    // Nested scopes and re-entering a closed scope are fine.
    let t = read_trace_bytes(
        format!("{HEADER}0,scope_enter,0,0,0,a\n1,scope_enter,1,0,0,b\n2,scope_exit,1,0,0,b\n3,scope_exit,0,0,0,a\n4,scope_enter,0,0,0,a\n5,scope_exit,0,0,0,a\n").as_bytes(),
    )
    .unwrap();
    assert_eq!(t.scope_names, vec!["a", "b"]);
}

#[test]
fn error_messages_read_well() {
    assert_eq!(
        err("0,alloc,1,1,0,act\n1,free,7,1,0,act\n").to_string(),
        "line 3: free of unknown id 7"
    );
    assert_eq!(
        err("0,alloc,1,12x,0,act\n").to_string(),
        "line 2: bad number `12x` in column `bytes`"
    );
    let long = "x".repeat(100);
    let e = err(&format!("0,{long},1,1,0,act\n"));
    assert_eq!(e.to_string(), format!("line 2: unknown op `{}…`", &long[..48]));
}

#[test]
fn long_lines_are_rejected_without_buffering_them() {
    let mut data = HEADER.as_bytes().to_vec();
    data.extend(std::iter::repeat_n(b'1', MAX_LINE * 4));
    assert_eq!(read_trace_bytes(&data).unwrap_err(), at(2, ErrorKind::LineTooLong(MAX_LINE)));
}

#[test]
fn huge_sizes_are_numbers_not_allocations() {
    let t = read_trace_bytes(
        format!(
            "{HEADER}0,alloc,1,9223372036854775808,0,act\n1,alloc,2,18446744073709551615,0,act\n"
        )
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(t.events[0].bytes, 1 << 63);
    assert_eq!(t.peak_live_bytes(), u64::MAX);
}

#[test]
fn missing_file_is_an_io_error() {
    let e = read_trace(Path::new("/nonexistent/trace.csv")).unwrap_err();
    assert_eq!(e.location, Location::Input);
    assert!(
        matches!(e.kind, ErrorKind::Io(ref m) if m.starts_with("cannot open /nonexistent/trace.csv"))
    );
}

/// Scope marker indices (enter, exit) per scope, in order.
fn scope_spans(t: &tidepool_trace::Trace) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut open = None;
    for (i, e) in t.events.iter().enumerate() {
        match e.op {
            Op::ScopeEnter => open = Some(i),
            Op::ScopeExit => spans.push((open.take().unwrap(), i)),
            _ => {}
        }
    }
    spans
}

fn check_shipped(file: &str, rows: usize, scopes: usize, peak: u64, outliving: (usize, u64)) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/traces").join(file);
    let t = read_trace(&path).unwrap();
    assert_eq!(t.name, file.trim_end_matches(".csv.gz"));
    assert_eq!(t.events.len(), rows);
    assert_eq!(t.scope_names.len(), scopes);
    assert_eq!(t.scope_names, (0..scopes).map(|i| format!("step{i}")).collect::<Vec<_>>());
    assert_eq!(t.peak_live_bytes(), peak);
    let lifetimes = t.lifetimes();
    assert!(lifetimes.iter().all(|l| l.is_freed(&t)), "every id is freed");
    assert_eq!(lifetimes.len(), t.num_allocs());
    // Act blocks allocated inside a scope and freed after it ends.
    let spans = scope_spans(&t);
    let out: Vec<_> = lifetimes
        .iter()
        .filter(|l| l.tag == Tag::Act)
        .filter(|l| spans.iter().any(|&(a, b)| a < l.alloc && l.alloc < b && l.free > b))
        .collect();
    assert_eq!((out.len(), out.iter().map(|l| l.bytes).sum::<u64>()), outliving);
}

#[test]
fn shipped_gpt2_trace() {
    check_shipped("gpt2_train.csv.gz", 10652, 4, 3911787528, (592, 1991036928));
}

#[test]
fn shipped_mlp_trace() {
    check_shipped("mlp_train.csv.gz", 484, 6, 1367670784, (48, 1611005952));
}

/// Peak live bytes per step: a window runs from the start (or the previous scope exit) to the
/// next scope exit, inclusive, as the replayer's calls per step do; what is live across an
/// exit counts in the next window from its start; events after the last exit are in none.
#[test]
fn step_peaks_follow_the_windows_of_the_calls_per_step() {
    let t = read_trace_bytes(
        format!(
            "{HEADER}0,alloc,0,100,0,param\n1,scope_enter,0,0,0,step0\n2,alloc,1,50,0,act\n\
             3,free,1,50,0,act\n4,alloc,2,30,0,act\n5,scope_exit,0,0,0,step0\n\
             6,scope_enter,1,0,0,step1\n7,free,2,30,0,act\n8,alloc,3,10,0,act\n\
             9,scope_exit,1,0,0,step1\n10,alloc,4,500,0,act\n11,free,4,500,0,act\n\
             12,free,3,10,0,act\n13,free,0,100,0,param\n"
        )
        .as_bytes(),
    )
    .unwrap();
    // Step 0: 100 + 50 at its highest. Step 1 starts with 130 live (the 30 outlive step 0),
    // then 110. The 600 after the last exit belong to no step.
    assert_eq!(t.step_peak_live_bytes(), vec![150, 130]);
    assert_eq!(t.peak_live_bytes(), 610);
    let none =
        read_trace_bytes(format!("{HEADER}0,alloc,0,100,0,act\n1,free,0,100,0,act\n").as_bytes());
    assert_eq!(none.unwrap().step_peak_live_bytes(), Vec::<u64>::new());
}

/// The shipped traces' steps: the training traces whose second step holds more live bytes
/// than their first (AdamW's state and the first step's gradients), and those flat from the
/// first step on.
#[test]
fn step_peaks_of_the_shipped_traces() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/traces");
    let cases: [(&str, &[u64]); 6] = [
        ("gpt2_train", &[2916269064, 3911787528, 3911787528, 3911787528]),
        ("llama_decode", &[635808056; 3]),
        ("mlp_train", &[1367670784; 6]),
        ("mobilenetv2_train", &[1278644072, 1292663560, 1292663560, 1292663560]),
        ("t5_train", &[1278048260, 1653325832, 1653325832, 1653325832]),
        ("vit_train", &[1733761604; 4]),
    ];
    for (name, peaks) in cases {
        let t = read_trace(&dir.join(format!("{name}.csv.gz"))).unwrap();
        assert_eq!(t.step_peak_live_bytes(), peaks, "{name}");
        assert_eq!(t.step_peak_live_bytes().iter().max(), Some(&t.peak_live_bytes()), "{name}");
    }
}

/// A free written with 0 bytes (accepted: the size is the allocation's) still frees its
/// allocation's bytes in peak live and the live timeline: ten 1 MiB blocks, never two live at
/// once, gave a peak live (the lower bound) of 10 MiB (found in review).
#[test]
fn a_free_with_zero_bytes_frees_its_allocations_bytes() {
    let mut csv = String::from("seq,op,id,bytes,stream,tag\n");
    for i in 0..10 {
        csv += &format!("{},alloc,{i},1048576,0,act\n{},free,{i},0,0,act\n", 2 * i, 2 * i + 1);
    }
    let t = read_trace_bytes(csv.as_bytes()).unwrap();
    assert_eq!(t.peak_live_bytes(), 1 << 20);
    let timeline = t.live_bytes_timeline();
    assert_eq!(&timeline[..4], &[1 << 20, 0, 1 << 20, 0]);
    assert_eq!(*timeline.last().unwrap(), 0);
}

/// A byte-order mark before the header reads through `read_tidepool_csv` as through the
/// format sniffing (it was refused as a wrong header; found in review).
#[test]
fn a_byte_order_mark_reads_directly_as_when_sniffed() {
    let csv = format!("\u{feff}{HEADER}0,alloc,0,8,0,act\n1,free,0,8,0,act\n");
    let direct = read_tidepool_csv(csv.as_bytes(), "trace").unwrap();
    assert_eq!(
        direct.events,
        vec![Event::alloc(0, 8, 0, Tag::Act), Event::free(0, 8, 0, Tag::Act)]
    );
    assert_eq!(read_trace_bytes(csv.as_bytes()).unwrap().events, direct.events);
    // After blank lines the header is not the first line: no mark is taken off there.
    let late = format!("\n\u{feff}{HEADER}");
    assert!(matches!(
        read_tidepool_csv(late.as_bytes(), "trace").unwrap_err().kind,
        ErrorKind::WrongHeader { .. }
    ));
}
