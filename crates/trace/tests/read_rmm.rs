//! RMM `logging_resource_adaptor` CSV reader.

use std::collections::BTreeMap;

use tidepool_trace::read::read_rmm_log;
use tidepool_trace::{ErrorKind, Event, Location, PreWindow, Tag, TraceError, read_trace_bytes};

const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream\n";

fn at(line: u64, kind: ErrorKind) -> TraceError {
    TraceError::new(Location::Line(line), kind)
}

fn err(body: &str) -> TraceError {
    read_trace_bytes(format!("{HEADER}{body}").as_bytes()).unwrap_err()
}

#[test]
fn reads_log_with_pointer_reuse_streams_and_failures() {
    let log = format!(
        "{HEADER}\
1979932,14:21:19.998533,allocate,0x7f8a40000000,1024,0x0
1979932,14:21:19.998601,allocate,0x7f8a40000400,2048,0x5633c0ffee00
1979932,14:21:19.998700,allocate failure,0x0,1099511627776,0x0
1980043,14:21:32.661875,free,0x7f8a40000000,1024,0x0
1980043,14:21:32.661900,allocate,0x7f8a40000000,512,0x7f00aa
1980043,14:21:32.662000,deallocate,0x7f8a40000400,2048,0x5633c0ffee00
1980043,14:21:32.662100,allocate,0x7f8a40000800,64,0
"
    );
    let t = read_trace_bytes(log.as_bytes()).unwrap();
    assert_eq!(t.skipped_records(), 1);
    assert_eq!(t.skipped, BTreeMap::from([("allocate failure".to_string(), 1)]));
    assert_eq!(t.pre_window, PreWindow::default());
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 1024, 0, Tag::Act),
            Event::alloc(1, 2048, 1, Tag::Act),
            Event::free(0, 1024, 0, Tag::Act),
            Event::alloc(2, 512, 2, Tag::Act), // reused pointer -> fresh id
            Event::free(1, 2048, 1, Tag::Act),
            Event::alloc(3, 64, 0, Tag::Act),
        ]
    );
    assert_eq!(t.peak_live_bytes(), 3072);
    assert_eq!(read_rmm_log(log.as_bytes(), "trace").unwrap(), t);
}

#[test]
fn malformed_rows() {
    assert_eq!(err("1,t,allocate,0x10,8\n"), at(2, ErrorKind::MissingColumn("Stream")));
    assert_eq!(err("1,t,allocate,0x10,8,0,9\n"), at(2, ErrorKind::ExtraColumn));
    assert_eq!(
        err("1,t,allocate,0xzz,8,0\n"),
        at(2, ErrorKind::BadNumber { column: "Pointer", text: "0xzz".into() })
    );
    assert_eq!(
        err("1,t,allocate,0x10,eight,0\n"),
        at(2, ErrorKind::BadNumber { column: "Size", text: "eight".into() })
    );
    assert_eq!(
        err("1,t,allocate,0x10,8,stream\n"),
        at(2, ErrorKind::BadNumber { column: "Stream", text: "stream".into() })
    );
    assert_eq!(err("1,t,reallocate,0x10,8,0\n"), at(2, ErrorKind::UnknownOp("reallocate".into())));
    assert_eq!(
        err("1,t,allocate,0x10,8,0\n1,t,allocate,0x10,8,0\n"),
        at(3, ErrorKind::AllocOfLiveAddress(0x10))
    );
    let e = read_rmm_log(&b"Thread,Time,Action\n"[..], "x").unwrap_err();
    assert_eq!(e.location, Location::Line(1));
    assert!(matches!(e.kind, ErrorKind::WrongHeader { .. }));
}

/// A free whose allocation precedes the log: live from the start of the trace (a synthetic
/// alloc of the free's size first), and counted, as the PyTorch reader does.
#[test]
fn frees_of_blocks_allocated_before_the_log_are_live_from_the_start() {
    let log = format!(
        "{HEADER}\
1,t,allocate,0x10,8,0x0
1,t,free,0x20,100,0x7
1,t,allocate,0x30,50,0x7
1,t,free,0x40,1000,0x0
1,t,free,0x10,8,0x0
1,t,free,0x30,50,0x7
"
    );
    let t = read_trace_bytes(log.as_bytes()).unwrap();
    assert_eq!(
        t.events,
        vec![
            Event::alloc(1, 100, 1, Tag::Act), // 0x20, allocated before the log
            Event::alloc(3, 1000, 0, Tag::Act), // 0x40
            Event::alloc(0, 8, 0, Tag::Act),
            Event::free(1, 100, 1, Tag::Act),
            Event::alloc(2, 50, 1, Tag::Act),
            Event::free(3, 1000, 0, Tag::Act),
            Event::free(0, 8, 0, Tag::Act),
            Event::free(2, 50, 1, Tag::Act),
        ]
    );
    assert_eq!(
        t.pre_window,
        PreWindow { freed_blocks: 2, freed_bytes: 1100, live_blocks: 0, live_bytes: 0 }
    );
    assert_eq!(t.peak_live_bytes(), 1108);
    t.validate().unwrap();
}

/// A zero-byte allocation gets a null pointer from every RMM resource
/// (`stream_ordered_memory_resource`, `cuda_async`, `arena`, ...: `if (bytes == 0) return
/// nullptr`), and the logging adaptor logs it and its free like any other: RMM today writes
/// the pointer with `%p` (glibc: `(nil)`) and the stream with `std::hex` (`0` for the default
/// stream), RMM before rapids-logger with fmt (`0x0`). Such rows hold no memory and are
/// skipped and counted, however many are live at once, and give their stream no id (the
/// 256 B block's stream is the first after the default's); a log of RMM's own zero-byte
/// harness test reads.
#[test]
fn zero_byte_allocations_with_null_pointers_are_skipped_and_counted() {
    for null in ["(nil)", "0x0"] {
        let log = format!(
            "{HEADER}\
140573312345856,14:21:19.998533,allocate,{null},0,0x99
140573312345856,14:21:19.998540,allocate,0x7f8a40000000,1024,0
140573312345856,14:21:19.998601,allocate,{null},0,0x55d0c0ffee00
140573312345856,14:21:19.998700,allocate failure,{null},1125899906842624,0x55d0c0ffee00
140573312345856,14:21:19.998800,free,{null},0,0x99
140573312345856,14:21:19.998900,allocate,0x7f8a40000400,256,0x55d0c0ffee00
140573312345856,14:21:19.999000,free,{null},0,0x55d0c0ffee00
140573312345856,14:21:19.999100,free,0x7f8a40000000,1024,0
140573312345856,14:21:19.999200,free,0x7f8a40000400,256,0x55d0c0ffee00
"
        );
        let t = read_trace_bytes(log.as_bytes()).unwrap_or_else(|e| panic!("{null}: {e}"));
        assert_eq!(
            t.skipped,
            BTreeMap::from([
                ("allocate (null pointer)".to_string(), 2),
                ("allocate failure".to_string(), 1),
                ("free (null pointer)".to_string(), 2),
            ]),
            "{null}"
        );
        assert_eq!(
            t.events,
            vec![
                Event::alloc(0, 1024, 0, Tag::Act),
                Event::alloc(1, 256, 1, Tag::Act),
                Event::free(0, 1024, 0, Tag::Act),
                Event::free(1, 256, 1, Tag::Act),
            ],
            "{null}"
        );
        assert_eq!(t.pre_window, PreWindow::default(), "{null}");
        assert_eq!(t.peak_live_bytes(), 1280, "{null}");
        t.validate().unwrap();
    }
}

/// The header as RMM writes it, then rows as `logging_resource_adaptor` writes them with
/// rapids-logger (`%t,%H:%M:%S.%f,` then `allocate,%p,%zu,<stream in hex>`): a non-null
/// pointer is `0x`-prefixed lowercase hex, the default stream `0`, `cudaStreamPerThread`
/// `0x2`; a failed allocation's pointer is `(nil)`. Every stream handle gets its own id.
#[test]
fn reads_the_rows_rapids_logger_writes() {
    let log = format!(
        "{HEADER}\
2731614,09:05:01.000001,allocate,0x7f3c1e000000,4096,0x2
2731614,09:05:01.000002,allocate failure,(nil),1125899906842624,0x2
2731615,09:05:01.000003,allocate,0x7f3c1e001000,100,0
2731615,09:05:01.000004,free,0x7f3c1e000000,4096,0x2
2731614,09:05:01.000005,free,0x7f3c1e001000,100,0
"
    );
    let t = read_trace_bytes(log.as_bytes()).unwrap();
    assert_eq!(t.skipped, BTreeMap::from([("allocate failure".to_string(), 1)]));
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 4096, 1, Tag::Act),
            Event::alloc(1, 100, 0, Tag::Act),
            Event::free(0, 4096, 1, Tag::Act),
            Event::free(1, 100, 0, Tag::Act),
        ]
    );
}

/// A second free of an address with no allocation of it in between is a double free (the
/// logging adaptor logs a free before it passes it on, so a program's double free is in the
/// log), not a block allocated before the log: such a block could not have shared the address
/// with the log's own. Reported at its line, whether the first free was of the log's block or
/// of one from before the log; an address allocated again may be freed again.
#[test]
fn a_second_free_of_an_address_is_a_double_free_not_a_block_from_before_the_log() {
    assert_eq!(
        err("1,t,allocate,0x10,8,0\n1,t,free,0x10,8,0\n1,t,free,0x10,8,0\n"),
        at(4, ErrorKind::FreeOfUnknownAddress(0x10))
    );
    assert_eq!(
        err("1,t,free,0x20,100,0x7\n1,t,allocate,0x30,8,0\n1,t,free,0x20,100,0x7\n"),
        at(4, ErrorKind::FreeOfUnknownAddress(0x20))
    );
    assert_eq!(
        at(4, ErrorKind::FreeOfUnknownAddress(0x20)).to_string(),
        "line 4: free of address 0x20, which was freed already and not allocated since"
    );
    let log = format!(
        "{HEADER}\
1,t,free,0x20,100,0x7
1,t,allocate,0x20,64,0x7
1,t,free,0x20,64,0x7
"
    );
    let t = read_trace_bytes(log.as_bytes()).unwrap();
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 100, 1, Tag::Act),
            Event::free(0, 100, 1, Tag::Act),
            Event::alloc(1, 64, 1, Tag::Act),
            Event::free(1, 64, 1, Tag::Act),
        ]
    );
    assert_eq!(
        t.pre_window,
        PreWindow { freed_blocks: 1, freed_bytes: 100, live_blocks: 0, live_bytes: 0 }
    );
    assert_eq!(t.peak_live_bytes(), 100);
}

/// `0x1` is `cudaStreamLegacy` (`rmm::cuda_stream_legacy`): the legacy default stream named
/// explicitly, the stream handle 0 names in a program built with CUDA's default (legacy)
/// default stream, where RMM's `cuda_stream_view::is_default()` holds for both. It was a
/// stream of its own, so a block freed on one and reused on the other crossed streams in the
/// replay; it is now stream 0. `0x2` (`cudaStreamPerThread`, one stream per thread) keeps an id
/// of its own (found in review).
#[test]
fn the_legacy_default_stream_is_the_default_stream() {
    let log = format!(
        "{HEADER}\
1,t,allocate,0x10,8,0x1
1,t,allocate,0x20,8,0
1,t,allocate,0x30,8,0x2
1,t,free,0x10,8,0
1,t,free,0x20,8,0x1
1,t,free,0x30,8,0x2
"
    );
    let t = read_trace_bytes(log.as_bytes()).unwrap();
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 8, 0, Tag::Act),
            Event::alloc(1, 8, 0, Tag::Act),
            Event::alloc(2, 8, 1, Tag::Act),
            Event::free(0, 8, 0, Tag::Act),
            Event::free(1, 8, 0, Tag::Act),
            Event::free(2, 8, 1, Tag::Act),
        ]
    );
}

/// A byte-order mark before the header (a log saved by a Windows editor) was accepted when the
/// format was sniffed but refused by `read_rmm_log` called directly (found in review).
#[test]
fn a_byte_order_mark_reads_directly_as_when_sniffed() {
    let log = format!("\u{feff}{HEADER}1,t,allocate,0x10,8,0\n1,t,free,0x10,8,0\n");
    let direct = read_rmm_log(log.as_bytes(), "trace").unwrap();
    let sniffed = read_trace_bytes(log.as_bytes()).unwrap();
    assert_eq!(
        direct.events,
        vec![Event::alloc(0, 8, 0, Tag::Act), Event::free(0, 8, 0, Tag::Act)]
    );
    assert_eq!(direct.events, sniffed.events);
    // Only before the first line: inside a later one it is part of the field.
    let later = format!("{HEADER}\u{feff}1,t,allocate,0x10,8,0\n");
    assert!(read_rmm_log(later.as_bytes(), "trace").is_ok());
    let in_field = format!("{HEADER}1,t,allocate,\u{feff}0x10,8,0\n");
    assert_eq!(
        read_rmm_log(in_field.as_bytes(), "trace").unwrap_err(),
        at(2, ErrorKind::BadNumber { column: "Pointer", text: "\u{feff}0x10".into() })
    );
}

/// A free of a live address must name the allocation's size: RMM's resources trust the size
/// given to `deallocate` (a pool returns that many bytes), so a row with another size is a
/// broken log or program. Reported at its line with both sizes; the replay does not go on as
/// if the allocation's size had been freed. (A free of an address from before the log has no
/// allocation to compare with: its own size is read, as before.)
#[test]
fn a_free_with_another_size_than_its_allocation_is_an_error() {
    assert_eq!(
        err("1,t,allocate,0x10,4096,0\n1,t,free,0x10,1024,0\n"),
        at(3, ErrorKind::FreeSizeMismatchAt { addr: 0x10, allocated: 4096, freed: 1024 })
    );
    assert_eq!(
        err("1,t,allocate,0x10,8,0\n1,t,free,0x10,0,0\n").to_string(),
        "line 3: free of address 0x10 with 0 bytes, but it was allocated with 8"
    );
    // The same sizes (and an address from before the log) read as before.
    let t = read_trace_bytes(
        format!("{HEADER}1,t,allocate,0x10,8,0\n1,t,free,0x10,8,0\n1,t,free,0x40,16,0\n")
            .as_bytes(),
    )
    .unwrap();
    assert_eq!(
        t.events,
        vec![
            Event::alloc(1, 16, 0, Tag::Act),
            Event::alloc(0, 8, 0, Tag::Act),
            Event::free(0, 8, 0, Tag::Act),
            Event::free(1, 16, 0, Tag::Act),
        ]
    );
}
