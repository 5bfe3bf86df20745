//! `tidepool replay` reviewed from the command line (2026-12-06): what reaches the terminal.

mod common;

use common::{scratch, stderr, tidepool};

const USAGE_TAIL: &str = "\n\nFor more information, try 'tidepool replay --help'.\n";

/// A bad `--config` was reported as the first policy's error about `TIDEPOOL_ALLOC_CONF`
/// (`tidepool: policy caching: malformed entry `x` in TIDEPOOL_ALLOC_CONF: …`): the replayer
/// reads no such variable, and the value was every policy's. The error now names the flag and
/// its value; still a usage error (exit 2), before the trace is read. Broken build (CLI only)
/// `cli_config_error_as_env`.
#[test]
fn a_bad_config_is_the_flags_error() {
    let dir = scratch("config");
    let trace = dir.path().join("t.csv");
    std::fs::write(&trace, "seq,op,id,bytes,stream,tag\n0,alloc,0,1024,0,act\n").unwrap();
    let trace = trace.to_str().unwrap();
    let cases = [
        ("garbage", "malformed entry `garbage`: expected key:value"),
        (
            "cross_stream:lazy",
            "bad value `lazy` for `cross_stream`: expected strict, wait_event or never",
        ),
        (
            "max_split_size_mb:1",
            "inconsistent values: max_split_size_mb (1 MiB) must be at least large_segment_mb (20 MiB)",
        ),
    ];
    for (config, why) in cases {
        let o = tidepool(&["replay", trace, "--config", config]);
        assert_eq!(o.status.code(), Some(2), "{config}");
        assert_eq!(stderr(&o), format!("tidepool: --config {config}: {why}{USAGE_TAIL}"));
        assert!(o.stdout.is_empty());
    }
    let o = tidepool(&["replay", trace, "--config", "warp_speed:9"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.starts_with("tidepool: --config warp_speed:9: unknown key `warp_speed`; valid keys: max_split_size_mb, "), "{e}");
    assert!(!e.contains("TIDEPOOL_ALLOC_CONF") && e.contains(", cross_stream, "), "{e}");
    // PyTorch's keys that tidepool accepts with no effect are listed too, as the library's
    // message lists them (broken build `cli_unknown_key_own_list`: tidepool's keys only).
    let ignored: Vec<&str> = tidepool::CONFIG_NO_EFFECT_KEYS.iter().map(|(k, _)| *k).collect();
    let tail = format!("; accepted with no effect (PyTorch's): {}{USAGE_TAIL}", ignored.join(", "));
    assert!(!ignored.is_empty() && e.ends_with(&tail), "{e}");
    // Checked before the trace is read: a missing trace is not what is said.
    let o = tidepool(&["replay", "/no/such/trace.csv", "--config", "garbage"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).starts_with("tidepool: --config garbage: malformed entry"));
}

/// Escape sequences in a trace (here an op of `ESC]0;…BEL`, which retitles a terminal, and a
/// snapshot's unknown action of `ESC[2J`, which clears it) reached the terminal through the
/// error and the report; both are written as escapes now (`echo_control_raw` in the trace
/// crate is the broken build).
#[test]
fn input_escapes_reach_no_terminal() {
    let dir = scratch("escapes");
    let csv = dir.path().join("t.csv");
    std::fs::write(&csv, b"seq,op,id,bytes,stream,tag\n0,\x1b]0;pwned\x07,0,1,0,act\n").unwrap();
    let o = tidepool(&["replay", csv.to_str().unwrap(), "--repeats", "1"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        format!("tidepool: {}: line 2: unknown op `\\u{{1b}}]0;pwned\\u{{7}}`\n", csv.display())
    );
    // A protocol-2 pickle of {"device_traces": [[{"action": "\x1b[2J"},
    //   {"action": "alloc", "addr": 4096, "size": 512}]]}.
    let p = b"\x80\x02}q\x00X\x0d\x00\x00\x00device_tracesq\x01]q\x02]q\x03(}q\x04X\x06\x00\x00\x00actionq\x05X\x04\x00\x00\x00\x1b[2Jq\x06s}q\x07(h\x05X\x05\x00\x00\x00allocq\x08X\x04\x00\x00\x00addrq\tM\x00\x10X\x04\x00\x00\x00sizeq\nM\x00\x02ueas.";
    let snap = dir.path().join("s.pickle");
    std::fs::write(&snap, p).unwrap();
    let o = tidepool(&["replay", snap.to_str().unwrap(), "--repeats", "1", "--policy", "planned"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("  skipped: \\u{1b}[2J (unknown action) 1\n"), "{out}");
    assert!(!out.contains('\x1b'), "{out:?}");
}

/// `replay t.csv --svg t.csv` (a slip of the shell's completion) wrote the plot over the
/// trace, which was lost. The same file under any spelling or link is now refused before any
/// replay, and the trace is left as it was. Broken build (CLI only) `cli_svg_over_trace`.
#[test]
fn the_svg_is_never_the_trace() {
    let dir = scratch("svg-over-trace");
    let text = "seq,op,id,bytes,stream,tag\n0,alloc,0,1024,0,act\n";
    let trace = dir.path().join("t.csv");
    std::fs::write(&trace, text).unwrap();
    let link = dir.path().join("link.csv");
    std::fs::hard_link(&trace, &link).unwrap();
    let dotted = dir.path().join(".").join("t.csv");
    let replay_to = |svg: &std::path::Path| {
        tidepool(&[
            "replay",
            trace.to_str().unwrap(),
            "--repeats",
            "1",
            "--svg",
            svg.to_str().unwrap(),
        ])
    };
    for svg in [&trace, &link, &dotted] {
        let o = replay_to(svg);
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert_eq!(
            stderr(&o),
            format!(
                "tidepool: --svg {} is the trace being replayed; the plot would be written over it\n",
                svg.display()
            )
        );
        assert!(o.stdout.is_empty());
        assert_eq!(std::fs::read_to_string(&trace).unwrap(), text);
    }
    // Another file is drawn as before.
    let plot = dir.path().join("t.svg");
    let o = replay_to(&plot);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"));
}

/// An error that wraps another prints every layer once: the policy, the allocator's refusal
/// (`AllocError::Config`) and the configuration's reason (its `source()`). The allocator's
/// message used to hold the reason too, so a reader of the chain printed it twice; the CLI
/// printed `to_string()` alone, which now says the allocator's layer only, so it prints the
/// chain. Here `caching:false` is a valid `--config`, but the expandable policy turns
/// expandable segments on over it, which `Allocator::new` refuses. Broken build
/// `error_text_doubled` (the wrappers' messages repeat their source).
#[test]
fn a_wrapped_error_prints_each_layer_once() {
    let dir = scratch("chain");
    let trace = dir.path().join("t.csv");
    std::fs::write(&trace, "seq,op,id,bytes,stream,tag\n0,alloc,0,1024,0,act\n").unwrap();
    let args = ["replay", trace.to_str().unwrap(), "--config", "caching:false", "--repeats", "1"];
    let o = tidepool(&[&args[..], &["--policy", "expandable"]].concat());
    assert_eq!(o.status.code(), Some(1));
    assert!(o.stdout.is_empty());
    let layers = [
        "policy expandable",
        "the allocator refused its configuration",
        "inconsistent configuration: caching:false (every free returns its memory to the device) \
         cannot be combined with expandable_segments",
    ];
    let e = stderr(&o);
    assert_eq!(e, format!("tidepool: {}\n", layers.join(": ")));
    for layer in layers {
        assert_eq!(e.matches(layer).count(), 1, "{layer:?} in {e}");
    }
    // The caching policy takes the same configuration; with the default policies the run
    // stops at the expandable one, with the same one-line chain.
    let o = tidepool(&args);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stderr(&o), format!("tidepool: {}\n", layers.join(": ")));
}
