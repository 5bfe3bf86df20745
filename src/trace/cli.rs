//! The `tidepool` command line (hand-rolled parsing, no dependencies):
//!
//! ```text
//! tidepool replay TRACE [--policy NAME]... [--json] [--svg FILE] [--repeats N]
//!                       [--config KEY:VAL,...]
//! tidepool demo [--steps N] [--two-streams] [--sim]     (handled by the binary's demo.rs)
//! ```
//!
//! Exit codes: 0 success, 1 runtime error (unreadable trace, failed replay, unwritable SVG),
//! 2 usage error (unknown flag or policy, bad value). Errors print `tidepool: <message>` on
//! stderr. A progress bar is drawn on stderr only when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};

use super::plot::write_svg;
use super::policy::{Policy, ReplayOptions, registry};
use super::read::read_trace;
use super::runner::run_policies;

/// Usage text.
pub const USAGE: &str = "\
usage: tidepool replay TRACE [--policy NAME]... [--json] [--svg FILE] [--repeats N] [--config KEY:VAL,...]

Replays an allocation trace (tidepool CSV, RMM log CSV or PyTorch snapshot pickle; gzip or
plain) through allocator policies and reports peak memory, fragmentation and speed.

options:
  --policy NAME    run only this policy (repeatable; default: all)
  --json           print one JSON object instead of the table
  --svg FILE       draw the memory timeline into FILE
  --repeats N      replays per policy; the median ns/op is reported (default 5)
  --config CONF    allocator configuration, key:value,key:value
  -h, --help       show this help

tidepool demo [--steps N] [--two-streams] [--sim]   trains the eager layer's MLP (see demo --help)";

/// A parsed `replay` command.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayCommand {
    /// The trace file.
    pub trace: PathBuf,
    /// Policies asked for (empty = all).
    pub policies: Vec<String>,
    /// JSON output.
    pub json: bool,
    /// SVG output file.
    pub svg: Option<PathBuf>,
    /// Options handed to the policies.
    pub options: ReplayOptions,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Print the usage.
    Help,
    /// Replay a trace.
    Replay(ReplayCommand),
}

/// Parses arguments (without the program name). Errors are usage errors.
pub fn parse_args(args: &[String]) -> Result<Command, String> {
    let mut it = args.iter();
    match it.next().map(String::as_str) {
        None => return Err("missing command".into()),
        Some("-h" | "--help" | "help") => return Ok(Command::Help),
        Some("replay") => {}
        Some(other) => return Err(format!("unknown command `{other}`")),
    }
    let mut trace = None;
    let mut cmd = ReplayCommand {
        trace: PathBuf::new(),
        policies: Vec::new(),
        json: false,
        svg: None,
        options: ReplayOptions::default(),
    };
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it.next().cloned().ok_or_else(|| format!("{name} needs a value")),
            }
        };
        match flag {
            "-h" | "--help" => return Ok(Command::Help),
            "--json" if inline.is_none() => cmd.json = true,
            "--policy" => cmd.policies.push(value("--policy")?),
            "--svg" => cmd.svg = Some(PathBuf::from(value("--svg")?)),
            "--config" => cmd.options.config = Some(value("--config")?),
            "--repeats" => {
                let v = value("--repeats")?;
                cmd.options.repeats = match v.parse::<usize>() {
                    Ok(n) if n >= 1 => n,
                    _ => return Err(format!("--repeats needs a positive integer, got `{v}`")),
                };
            }
            f if f.starts_with('-') && f != "-" => return Err(format!("unknown flag `{arg}`")),
            _ if trace.is_none() => trace = Some(PathBuf::from(arg)),
            _ => return Err(format!("unexpected argument `{arg}`")),
        }
    }
    cmd.trace = trace.ok_or("missing TRACE")?;
    cmd.options.timeline = cmd.svg.is_some();
    Ok(Command::Replay(cmd))
}

/// Runs the CLI with `args` (without the program name); returns the exit code.
pub fn run(args: &[String], out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let cmd = match parse_args(args) {
        Ok(Command::Help) => {
            let _ = writeln!(out, "{USAGE}");
            return 0;
        }
        Ok(Command::Replay(cmd)) => cmd,
        Err(msg) => return usage_error(err, &msg),
    };
    let all = match registry(&cmd.options) {
        Ok(all) => all,
        Err(e) => return usage_error(err, &e.to_string()),
    };
    let policies = match select(all, &cmd.policies) {
        Ok(p) => p,
        Err(msg) => return usage_error(err, &msg),
    };
    match replay(&cmd, &policies, out) {
        Ok(()) => 0,
        Err(msg) => {
            let _ = writeln!(err, "tidepool: {msg}");
            1
        }
    }
}

fn usage_error(err: &mut dyn Write, msg: &str) -> i32 {
    let _ = writeln!(err, "tidepool: {msg}\n{USAGE}");
    2
}

/// Keeps the policies named in `names` (all when empty), in the order asked.
fn select(all: Vec<Box<dyn Policy>>, names: &[String]) -> Result<Vec<Box<dyn Policy>>, String> {
    if names.is_empty() {
        return Ok(all);
    }
    let known: Vec<&'static str> = all.iter().map(|p| p.name()).collect();
    for n in names {
        if !known.contains(&n.as_str()) {
            return Err(format!("unknown policy `{n}` (known: {})", known.join(", ")));
        }
    }
    let mut slots: Vec<Option<Box<dyn Policy>>> = all.into_iter().map(Some).collect();
    let mut chosen = Vec::new();
    for n in names {
        if let Some(p) = known.iter().position(|k| k == n).and_then(|i| slots[i].take()) {
            chosen.push(p);
        }
    }
    Ok(chosen)
}

fn replay(
    cmd: &ReplayCommand,
    policies: &[Box<dyn Policy>],
    out: &mut dyn Write,
) -> Result<(), String> {
    let trace = read_trace(&cmd.trace).map_err(|e| format!("{}: {e}", cmd.trace.display()))?;
    let per_policy = cmd.options.repeats.max(1) + usize::from(cmd.options.timeline);
    let bar = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new((policies.len() * per_policy) as u64);
        if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} replays  {msg}") {
            bar.set_style(style);
        }
        bar
    } else {
        ProgressBar::hidden()
    };
    let report = run_policies(&trace, policies, &cmd.options, &mut |name| {
        bar.set_message(name.to_string());
        bar.inc(1);
    })
    .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    if let Some(svg) = &cmd.svg {
        write_svg(&report, svg)?;
    }
    let text = if cmd.json { report.to_json() + "\n" } else { report.to_table() };
    out.write_all(text.as_bytes()).map_err(|e| format!("cannot write output: {e}"))
}

/// The binary's entry point: runs with the process arguments and exits.
pub fn main() -> ! {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = run(&args, &mut std::io::stdout().lock(), &mut std::io::stderr().lock());
    std::process::exit(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_all_flags() {
        let Ok(Command::Replay(c)) = parse_args(&args(
            "replay t.csv --policy planned --policy=range-alloc --json --svg o.svg --repeats 3 --config a:1,b:2",
        )) else {
            panic!("did not parse");
        };
        assert_eq!(c.trace, PathBuf::from("t.csv"));
        assert_eq!(c.policies, vec!["planned", "range-alloc"]);
        assert!(c.json);
        assert_eq!(c.svg, Some(PathBuf::from("o.svg")));
        assert_eq!(c.options.repeats, 3);
        assert_eq!(c.options.config.as_deref(), Some("a:1,b:2"));
        assert!(c.options.timeline);
    }

    #[test]
    fn usage_errors() {
        assert_eq!(parse_args(&args("replay t --bogus")), Err("unknown flag `--bogus`".into()));
        assert_eq!(parse_args(&args("replay")), Err("missing TRACE".into()));
        assert_eq!(
            parse_args(&args("replay t --repeats 0")),
            Err("--repeats needs a positive integer, got `0`".into())
        );
        assert_eq!(parse_args(&args("replay t --svg")), Err("--svg needs a value".into()));
        assert_eq!(parse_args(&args("frobnicate")), Err("unknown command `frobnicate`".into()));
        assert_eq!(parse_args(&args("--help")), Ok(Command::Help));
    }

    #[test]
    fn unknown_policy_is_exit_2() {
        let mut out = Vec::new();
        let mut err = Vec::new();
        let code = run(&args("replay x.csv --policy nope"), &mut out, &mut err);
        assert_eq!(code, 2);
        let err = String::from_utf8(err).unwrap();
        assert!(err.starts_with("tidepool: unknown policy `nope` (known: caching, residency, scoped, offset-allocator, range-alloc, planned)\nusage:"));
    }
}
