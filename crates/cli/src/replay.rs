//! `tidepool replay TRACE`: runs a trace through allocator policies and prints the report.
//! A progress bar is drawn on stderr only when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tidepool_trace::plot::write_svg;
use tidepool_trace::policy::{Policy, ReplayOptions, registry};
use tidepool_trace::read::read_trace;
use tidepool_trace::runner::run_policies;

/// The `replay` subcommand's arguments.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct ReplayArgs {
    /// The trace file.
    pub trace: PathBuf,
    /// Run only this policy (repeatable; default: all).
    #[arg(long = "policy", value_name = "NAME")]
    pub policies: Vec<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Draw the memory timeline into FILE (SVG).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Replays per policy; the median ns/op is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Allocator configuration, key:value,key:value (as TIDEPOOL_ALLOC_CONF).
    #[arg(long, value_name = "KEY:VAL,...")]
    pub config: Option<String>,
}

impl ReplayArgs {
    fn options(&self) -> ReplayOptions {
        ReplayOptions {
            repeats: self.repeats as usize,
            config: self.config.clone(),
            timeline: self.svg.is_some(),
        }
    }
}

/// Runs the subcommand; returns the exit code (1 runtime error, 2 usage error).
pub fn run(cmd: &ReplayArgs, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let options = cmd.options();
    let all = match registry(&options) {
        Ok(all) => all,
        Err(e) => return usage_error(err, &e.to_string()),
    };
    let policies = match select(all, &cmd.policies) {
        Ok(p) => p,
        Err(msg) => return usage_error(err, &msg),
    };
    match replay(cmd, &options, &policies, out) {
        Ok(()) => 0,
        Err(msg) => {
            let _ = writeln!(err, "tidepool: {msg}");
            1
        }
    }
}

fn usage_error(err: &mut dyn Write, msg: &str) -> i32 {
    let _ = writeln!(err, "tidepool: {msg}\n\nFor more information, try 'tidepool replay --help'.");
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
    cmd: &ReplayArgs,
    options: &ReplayOptions,
    policies: &[Box<dyn Policy>],
    out: &mut dyn Write,
) -> Result<(), String> {
    let trace = read_trace(&cmd.trace).map_err(|e| format!("{}: {e}", cmd.trace.display()))?;
    let per_policy = options.repeats.max(1) + usize::from(options.timeline);
    let bar = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new((policies.len() * per_policy) as u64);
        if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} replays  {msg}") {
            bar.set_style(style);
        }
        bar
    } else {
        ProgressBar::hidden()
    };
    let report = run_policies(&trace, policies, options, &mut |name| {
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
