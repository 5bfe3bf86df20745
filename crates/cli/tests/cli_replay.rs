//! The `tidepool` binary: JSON output on the shipped MLP trace, the SVG, and exit codes and
//! messages for usage and input errors.

use std::path::Path;
use std::process::Output;

mod common;

use common::{scratch, stderr, tidepool};

fn mlp() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/traces/mlp_train.csv.gz")
        .display()
        .to_string()
}

#[test]
fn json_on_the_mlp_trace() {
    let o = tidepool(&[
        "replay",
        &mlp(),
        "--policy",
        "planned",
        "--policy",
        "range-alloc",
        "--repeats",
        "2",
        "--config",
        "max_split_size_mb:64",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(o.stderr.is_empty(), "no progress bar when stderr is not a terminal");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["trace"], "mlp_train");
    assert_eq!(v["events"].as_u64(), Some(484));
    assert_eq!(v["peak_live_bytes"].as_u64(), Some(1367670784));
    assert_eq!(v["step_peak_live_bytes"], serde_json::json!(vec![1367670784u64; 6]));
    let p = v["policies"].as_array().unwrap();
    assert_eq!(p.len(), 2);
    assert_eq!(p[0]["name"], "planned");
    assert_eq!(p[0]["peak_reserved_bytes"].as_u64(), Some(1367670784));
    assert_eq!(p[0]["fragmentation"].as_f64(), Some(0.0));
    assert_eq!(p[1]["name"], "range-alloc");
    assert_eq!(p[1]["peak_reserved_bytes"].as_u64(), Some(1476477184));
    assert_eq!(p[1]["device_mallocs"].as_u64(), Some(1));
    assert_eq!(p[1]["host_syncs"].as_u64(), Some(0));
    // The report says which configuration it ran under (broken build `config_unsaid`: no note).
    assert_eq!(
        v["notes"],
        serde_json::json!([
            "--config max_split_size_mb:64 (the allocator rows; the baselines have no configuration)"
        ])
    );
}

/// `pytorch` (PyTorch's placement: `caching` without the stream caches) runs when named, in
/// the order asked; on the MLP trace it and `caching` agree with `scripts/pytorch_model.py`.
#[test]
fn pytorch_policy_when_named() {
    let o = tidepool(&["replay", &mlp(), "--policy", "pytorch", "--policy", "caching", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let p = v["policies"].as_array().unwrap();
    let names: Vec<_> = p.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["pytorch", "caching"]);
    assert_eq!(v["notes"], serde_json::json!([]), "no --config, nothing to say");
    for p in p {
        assert_eq!(p["peak_reserved_bytes"].as_u64(), Some(1428160512), "{p}");
        assert_eq!(p["peak_allocated_bytes"].as_u64(), Some(1367670784), "{p}");
        assert_eq!(p["device_mallocs"].as_u64(), Some(25), "{p}");
    }
    assert_eq!(p[0]["notes"]["lock-free hits"], "0 of 236 allocations (0.0 %)");
}

#[test]
fn table_and_svg() {
    let dir = scratch("table-and-svg");
    let svg = dir.path().join("mlp.svg");
    let o = tidepool(&["replay", &mlp(), "--repeats=1", "--svg", svg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    assert!(table.starts_with(
        "trace mlp_train: 484 events, peak live 1.27 GiB (1367670784 B)\n  peak live per step \
         (the windows of the calls per step): 1.27 GiB, 1.27 GiB, 1.27 GiB, 1.27 GiB, 1.27 GiB, \
         1.27 GiB\n"
    ));
    for name in ["expandable", "offset-allocator", "range-alloc", "planned", "lower bound"] {
        assert!(table.contains(name), "{table}");
    }
    assert!(!table.contains("pytorch"), "named-only policies run only when named: {table}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg"));
    for label in [
        "memory timeline: mlp_train",
        "event index",
        "bytes (GiB)",
        "live (requested)",
        "reserved: expandable",
        "reserved: offset-allocator",
        "reserved: range-alloc",
        "reserved: planned",
    ] {
        assert!(svg.contains(label), "missing {label}");
    }
}

#[test]
fn usage_errors_exit_2() {
    let o = tidepool(&["replay", &mlp(), "--bogus"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.starts_with("error: unexpected argument '--bogus' found"), "{e}");
    assert!(e.contains("Usage: tidepool replay <TRACE>"), "{e}");

    let o = tidepool(&["replay", &mlp(), "--policy", "magic"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).starts_with(
        "tidepool: unknown policy `magic` (known: caching, residency, scoped, expandable, offset-allocator, range-alloc, planned, pytorch)\n"
    ));

    let o = tidepool(&["replay", &mlp(), "--config", "max_split_size_mb:1"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.starts_with("tidepool: --config max_split_size_mb:1: inconsistent values: "), "{e}");
    assert!(!e.contains("TIDEPOOL_ALLOC_CONF"), "the flag, not the variable: {e}");
    let o = tidepool(&["replay", &mlp(), "--config", "warp_speed:9"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("unknown key `warp_speed`"), "{}", stderr(&o));

    let o = tidepool(&["replay", &mlp(), "--repeats", "many"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.starts_with("error: invalid value 'many' for '--repeats <REPEATS>'"), "{e}");
    let o = tidepool(&["replay", &mlp(), "--repeats", "0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("0 is not in 1.."), "{}", stderr(&o));

    let o = tidepool(&[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("Usage: tidepool <COMMAND>"), "{}", stderr(&o));

    let o = tidepool(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let help = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(help.contains("Usage: tidepool <COMMAND>"), "{help}");
    assert!(help.contains("replay") && help.contains("demo"), "{help}");
    let o = tidepool(&["replay", "--help"]);
    assert_eq!(o.status.code(), Some(0));
    let help = String::from_utf8_lossy(&o.stdout).into_owned();
    for flag in [
        "--policy <NAME>",
        "--json",
        "--svg <FILE>",
        "--repeats <REPEATS>",
        "--config",
        "--device <N>",
        "--max-input-size <SIZE>",
    ] {
        assert!(help.contains(flag), "{flag} missing from {help}");
    }
}

#[test]
fn input_errors_exit_1() {
    let dir = scratch("input-errors");
    let o = tidepool(&["replay", "/nonexistent/t.csv"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with(
            "tidepool: /nonexistent/t.csv: input: I/O error: cannot open /nonexistent/t.csv:"
        ),
        "{}",
        stderr(&o)
    );

    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "seq,op,id,bytes,stream,tag\n0,alloc,1,10,0,act\n1,free,2,10,0,act\n")
        .unwrap();
    let o = tidepool(&["replay", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stderr(&o), format!("tidepool: {}: line 3: free of unknown id 2\n", bad.display()));

    let huge = dir.path().join("huge.csv");
    std::fs::write(&huge, "seq,op,id,bytes,stream,tag\n0,alloc,1,18446744073709551615,0,act\n")
        .unwrap();
    let o = tidepool(&["replay", huge.to_str().unwrap(), "--policy", "range-alloc"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("tidepool: policy range-alloc: needs a heap of at least"),
        "{}",
        stderr(&o)
    );
}

fn repo(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path).display().to_string()
}

fn snapshot(name: &str) -> String {
    repo(&format!("data/snapshots/{name}.pickle"))
}

fn multi_device() -> String {
    repo("crates/trace/tests/fixtures/multi_device_snapshot.pickle")
}

fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

/// The real snapshots: peak live and PyTorch's recorded peak reserved to the byte (truth.json),
/// the recorded row in the table, the history-less one as a static picture with how to record.
#[test]
fn real_snapshots() {
    for (name, live, recorded) in [
        ("cs336_wedsonlin_medium128_training", 7_013_335_044u64, 7_235_174_400u64),
        ("ftcourse_memory_snapshot", 5_876_132_840, 6_471_811_072),
        ("layoutediting_dump_snapshot_emptytraces", 10_637_601_344, 11_276_386_304),
    ] {
        let o = tidepool(&[
            "replay",
            &snapshot(name),
            "--policy",
            "caching",
            "--repeats",
            "1",
            "--json",
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v = json_lines(&o);
        assert_eq!(v.len(), 1, "{name}: one device");
        assert_eq!(v[0]["device"], 0);
        assert_eq!(v[0]["peak_live_bytes"].as_u64(), Some(live), "{name}");
        assert_eq!(v[0]["pytorch_recorded"]["peak_reserved_bytes"].as_u64(), Some(recorded));
    }
    let o = tidepool(&[
        "replay",
        &snapshot("layoutediting_dump_snapshot_emptytraces"),
        "--policy",
        "caching",
        "--repeats=1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        table.starts_with(
            "trace layoutediting_dump_snapshot_emptytraces, device 0: 6241 events, peak live \
             9.91 GiB (10637601344 B)\n"
        ),
        "{table}"
    );
    assert!(table.contains("  note: no allocation history: the snapshot was taken without"));
    assert!(table.contains("torch.cuda.memory._record_memory_history(max_entries=100000) before"));
    assert!(table.contains("\npytorch (recorded)  "), "{table}");
}

/// Every device reported on its own, `--device` picks one, skipped kinds in text and JSON.
#[test]
fn devices_of_a_snapshot() {
    let dir = scratch("devices");
    let o = tidepool(&["replay", &multi_device(), "--policy", "caching", "--repeats=1", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json_lines(&o);
    let devices: Vec<_> = v.iter().map(|r| r["device"].as_u64()).collect();
    assert_eq!(devices, [Some(0), Some(1)]);
    assert_eq!(v[0]["peak_live_bytes"].as_u64(), Some(13_146_228));
    assert_eq!(v[1]["peak_live_bytes"].as_u64(), Some(2_900_000));
    assert_eq!(v[0]["policies"][0]["peak_reserved_bytes"].as_u64(), Some(44 << 20));
    assert_eq!(v[1]["policies"][0]["peak_reserved_bytes"].as_u64(), Some(22 << 20));
    assert_eq!(v[0]["skipped"]["oom"], 1);
    assert_eq!(v[0]["skipped"]["segment_map"], 1);
    assert_eq!(v[1]["skipped"]["segment_free"], 1);

    let o = tidepool(&[
        "replay",
        &multi_device(),
        "--device",
        "1",
        "--policy",
        "planned",
        "--repeats=1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(table.starts_with("trace multi_device_snapshot, device 1: 5 events"), "{table}");
    assert!(!table.contains("device 0"), "{table}");
    assert!(table.contains("  skipped: segment_alloc 1, segment_free 1\n"), "{table}");
    assert!(table.contains("  note: 1 entry was out of time_us order and was put in order\n"));

    let o = tidepool(&["replay", &multi_device(), "--device", "2"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).ends_with("no device 2 in the snapshot (devices with allocations: 0, 1)\n"),
        "{}",
        stderr(&o)
    );
    let o = tidepool(&["replay", &mlp(), "--device", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--device applies to PyTorch snapshots"), "{}", stderr(&o));

    // One SVG per device, with PyTorch's reserved line.
    let svg = dir.path().join("multi.svg");
    let o = tidepool(&[
        "replay",
        &multi_device(),
        "--policy",
        "caching",
        "--repeats=1",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for d in [0, 1] {
        let text =
            std::fs::read_to_string(dir.path().join(format!("multi.device{d}.svg"))).unwrap();
        assert!(text.contains(&format!("memory timeline: multi_device_snapshot, device {d}")));
        assert!(text.contains("reserved: pytorch (recorded)"));
    }
}

#[test]
fn config_from_snapshot() {
    let o = tidepool(&[
        "replay",
        &multi_device(),
        "--config",
        "from-snapshot",
        "--policy",
        "caching",
        "--repeats=1",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json_lines(&o);
    let notes: Vec<&str> =
        v[0]["notes"].as_array().unwrap().iter().filter_map(|n| n.as_str()).collect();
    assert_eq!(
        notes[0],
        "--config from-snapshot: `max_split_size_mb:64,roundup_power2_divisions:4,\
         expandable_segments:true,garbage_collection_threshold:0.8`"
    );
    assert!(notes[1].starts_with("garbage_collection_threshold 0.8: the snapshot records no"));
    assert_eq!(v[0]["policies"][0]["peak_allocated_bytes"].as_u64(), Some(13_632_000));
    // No allocator_settings (older PyTorch): the defaults, and a note.
    let o = tidepool(&[
        "replay",
        &snapshot("ftcourse_memory_snapshot"),
        "--config",
        "from-snapshot",
        "--policy",
        "planned",
        "--repeats=1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("records no allocator_settings"));
    // Not a snapshot.
    let o = tidepool(&["replay", &mlp(), "--config", "from-snapshot"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--config from-snapshot needs a PyTorch snapshot"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn input_errors_of_snapshots() {
    let dir = scratch("snapshot-input-errors");
    let o = tidepool(&["replay", &multi_device(), "--max-input-size", "1KiB"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(
            "input: input is larger than the cap of 1.00 KiB (1024 B); raise the cap with \
             `tidepool replay --max-input-size SIZE`"
        ),
        "{}",
        stderr(&o)
    );
    let o = tidepool(&["replay", &multi_device(), "--max-input-size", "lots"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("is not a byte count"), "{}", stderr(&o));

    // What pickle.dump(torch.cuda.memory_snapshot(), f) writes: a list of segments.
    let list = dir.path().join("segments.pickle");
    std::fs::write(
        &list,
        b"\x80\x04]\x94}\x94(\x8c\x0atotal_size\x94K\x10\x8c\x06blocks\x94]\x94ua.",
    )
    .unwrap();
    let o = tidepool(&["replay", list.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("the pickle is a list of 1 segment, as torch.cuda.memory_snapshot() returns"),
        "{e}"
    );
    assert!(e.contains("torch.cuda.memory._record_memory_history("), "{e}");
}
