//! The `tidepool` binary: JSON output on the shipped MLP trace, the SVG, and exit codes and
//! messages for usage and input errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tidepool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tidepool")).args(args).output().expect("run tidepool")
}

fn mlp() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/traces/mlp_train.csv.gz")
        .display()
        .to_string()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tidepool-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
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
    let p = v["policies"].as_array().unwrap();
    assert_eq!(p.len(), 2);
    assert_eq!(p[0]["name"], "planned");
    assert_eq!(p[0]["peak_reserved_bytes"].as_u64(), Some(1367670784));
    assert_eq!(p[0]["fragmentation"].as_f64(), Some(0.0));
    assert_eq!(p[1]["name"], "range-alloc");
    assert_eq!(p[1]["peak_reserved_bytes"].as_u64(), Some(1476477184));
    assert_eq!(p[1]["device_mallocs"].as_u64(), Some(1));
    assert_eq!(p[1]["host_syncs"].as_u64(), Some(0));
}

#[test]
fn table_and_svg() {
    let svg = tmp("mlp.svg");
    let o = tidepool(&["replay", &mlp(), "--repeats=1", "--svg", svg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    assert!(table.starts_with("trace mlp_train: 484 events, peak live 1.27 GiB (1367670784 B)\n"));
    for name in ["expandable", "offset-allocator", "range-alloc", "planned", "lower bound"] {
        assert!(table.contains(name), "{table}");
    }
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
        "tidepool: unknown policy `magic` (known: caching, residency, scoped, expandable, offset-allocator, range-alloc, planned)\n"
    ));

    let o = tidepool(&["replay", &mlp(), "--config", "max_split_size_mb:1"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.starts_with("tidepool: policy caching: inconsistent TIDEPOOL_ALLOC_CONF"), "{e}");
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
    for flag in ["--policy <NAME>", "--json", "--svg <FILE>", "--repeats <REPEATS>", "--config"] {
        assert!(help.contains(flag), "{flag} missing from {help}");
    }
}

#[test]
fn input_errors_exit_1() {
    let o = tidepool(&["replay", "/nonexistent/t.csv"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with(
            "tidepool: /nonexistent/t.csv: input: I/O error: cannot open /nonexistent/t.csv:"
        ),
        "{}",
        stderr(&o)
    );

    let bad = tmp("bad.csv");
    std::fs::write(&bad, "seq,op,id,bytes,stream,tag\n0,alloc,1,10,0,act\n1,free,2,10,0,act\n")
        .unwrap();
    let o = tidepool(&["replay", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stderr(&o), format!("tidepool: {}: line 3: free of unknown id 2\n", bad.display()));

    let huge = tmp("huge.csv");
    std::fs::write(&huge, "seq,op,id,bytes,stream,tag\n0,alloc,1,9223372036854775808,0,act\n")
        .unwrap();
    let o = tidepool(&["replay", huge.to_str().unwrap(), "--policy", "range-alloc"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("tidepool: policy range-alloc: needs a heap of"),
        "{}",
        stderr(&o)
    );
}
