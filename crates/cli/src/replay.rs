//! `tidepool replay TRACE`: runs a trace through allocator policies and prints the report.
//! A PyTorch snapshot holds one trace per device: each is replayed on its own simulated device
//! and reported on its own (`--device N` keeps one). A progress bar is drawn on stderr only
//! when stderr is a terminal.
//!
//! `--config from-snapshot` replays a snapshot under tidepool's equivalent of the snapshot's
//! `allocator_settings` (see [`tidepool_trace::snapshot::AllocatorSettings::to_config`]); what
//! cannot be mapped is said in the report's notes.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tidepool_trace::plot::write_svg;
use tidepool_trace::policy::{Policy, ReplayOptions, named_only, registry};
use tidepool_trace::read::{DEFAULT_MAX_INPUT, ReadOptions, read_traces};
use tidepool_trace::report::Report;
use tidepool_trace::runner::run_policies;
use tidepool_trace::{Trace, echo_path};

/// The `--config` value that maps a snapshot's `allocator_settings`.
pub const FROM_SNAPSHOT: &str = "from-snapshot";

/// The `replay` subcommand's arguments.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct ReplayArgs {
    /// The trace file.
    pub trace: PathBuf,
    /// Run only this policy (repeatable; default: all but `pytorch`, which runs when named).
    #[arg(long = "policy", value_name = "NAME")]
    pub policies: Vec<String>,
    /// Print one JSON object per device (one line each) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Draw the memory timeline into FILE (SVG; FILE.deviceN.svg per device when a snapshot
    /// has several).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Replays per policy; the median ns/op is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Allocator configuration, key:value,key:value (as TIDEPOOL_ALLOC_CONF), or
    /// `from-snapshot`: the equivalent of a PyTorch snapshot's allocator_settings.
    #[arg(long, value_name = "KEY:VAL,...")]
    pub config: Option<String>,
    /// Replay only this device of a PyTorch snapshot (default: every device, each reported on
    /// its own).
    #[arg(long, value_name = "N")]
    pub device: Option<u32>,
    /// Refuse gzip input that decompresses to more than SIZE, and pickles larger than SIZE
    /// (e.g. 4GiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes,
          default_value_t = DEFAULT_MAX_INPUT)]
    pub max_input_size: u64,
}

impl ReplayArgs {
    fn config_from_snapshot(&self) -> bool {
        self.config.as_deref() == Some(FROM_SNAPSHOT)
    }

    /// Replay options with `config` as the allocator configuration.
    fn options(&self, config: Option<String>) -> ReplayOptions {
        ReplayOptions { repeats: self.repeats as usize, config, timeline: self.svg.is_some() }
    }
}

/// Runs the subcommand; returns the exit code (1 runtime error, 2 usage error).
pub fn run(cmd: &ReplayArgs, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    // Usage errors (unknown policy, bad configuration) before reading anything.
    let config = if cmd.config_from_snapshot() { None } else { cmd.config.clone() };
    if let Some(text) = &config
        && let Err(e) = tidepool::Config::parse(text)
    {
        return usage_error(err, &config_error(&format!("--config {text}"), &e));
    }
    let all = match policies(&cmd.options(config)) {
        Ok(all) => all,
        Err(e) => return usage_error(err, &tidepool::ErrorChain(&e).to_string()),
    };
    let n_policies = match select(all, &cmd.policies) {
        Ok(p) => p.len(),
        Err(msg) => return usage_error(err, &msg),
    };
    match replay(cmd, n_policies, out) {
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

/// The default policies, then those run only when named.
type Policies = (Vec<Box<dyn Policy>>, Vec<Box<dyn Policy>>);

fn policies(options: &ReplayOptions) -> Result<Policies, tidepool_trace::ReplayError> {
    Ok((registry(options)?, named_only(options)?))
}

/// Keeps the policies named in `names` (the default ones when empty), in the order asked.
fn select((defaults, named): Policies, names: &[String]) -> Result<Vec<Box<dyn Policy>>, String> {
    if names.is_empty() {
        return Ok(defaults);
    }
    let all: Vec<Box<dyn Policy>> = defaults.into_iter().chain(named).collect();
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

/// The traces to replay: every device, or the one `--device` names.
fn pick_device(cmd: &ReplayArgs, traces: Vec<Trace>) -> Result<Vec<Trace>, String> {
    let Some(want) = cmd.device else { return Ok(traces) };
    let devices: Vec<u32> =
        traces.iter().filter_map(|t| t.snapshot.as_ref()).map(|s| s.device).collect();
    if devices.is_empty() {
        return Err(format!(
            "{}: --device applies to PyTorch snapshots; this trace has no devices",
            echo_path(&cmd.trace)
        ));
    }
    let kept: Vec<Trace> = traces
        .into_iter()
        .filter(|t| t.snapshot.as_ref().is_some_and(|s| s.device == want))
        .collect();
    if kept.is_empty() {
        let list: Vec<String> = devices.iter().map(u32::to_string).collect();
        return Err(format!(
            "{}: no device {want} in the snapshot (devices with allocations: {})",
            echo_path(&cmd.trace),
            list.join(", ")
        ));
    }
    Ok(kept)
}

/// The configuration one trace replays under, and notes saying where it came from.
fn config_for(cmd: &ReplayArgs, trace: &Trace) -> Result<(Option<String>, Vec<String>), String> {
    if !cmd.config_from_snapshot() {
        // The report says what it ran under: the same trace gives other figures under
        // another configuration, and a saved report did not say which.
        // BROKEN (`config_unsaid`): nothing said.
        let notes = match &cmd.config {
            Some(text) if !cfg!(tidepool_broken = "config_unsaid") => {
                vec![format!(
                    "--config {text} (the allocator rows; the baselines have no configuration)"
                )]
            }
            _ => Vec::new(),
        };
        return Ok((cmd.config.clone(), notes));
    }
    let Some(info) = &trace.snapshot else {
        return Err(format!(
            "{}: --config {FROM_SNAPSHOT} needs a PyTorch snapshot; this is a CSV trace",
            echo_path(&cmd.trace)
        ));
    };
    let Some(settings) = &info.settings else {
        return Ok((
            None,
            vec![format!(
                "--config {FROM_SNAPSHOT}: the snapshot records no allocator_settings (older \
                 PyTorch); tidepool's defaults apply"
            )],
        ));
    };
    let mapping = settings.to_config();
    let mut notes = vec![if mapping.config.is_empty() {
        format!("--config {FROM_SNAPSHOT}: tidepool's defaults (nothing to map)")
    } else {
        format!("--config {FROM_SNAPSHOT}: `{}`", mapping.config)
    }];
    notes.extend(mapping.notes);
    Ok((Some(mapping.config), notes))
}

/// A configuration error said as the flag's (`what`), not as `TIDEPOOL_ALLOC_CONF`'s, which
/// the replayer does not read, nor as the first policy's (it was every policy's).
fn config_error(what: &str, e: &tidepool::ConfigError) -> String {
    use tidepool::ConfigError as E;
    // BROKEN (`cli_config_error_as_env`, CLI only): the core's message, naming the variable.
    if cfg!(tidepool_broken = "cli_config_error_as_env") {
        return format!("policy caching: {e}");
    }
    let why = match e {
        // The core's message: both key lists, tidepool's and PyTorch's accepted with no effect.
        // BROKEN (`cli_unknown_key_own_list`): a list of its own, tidepool's keys only.
        E::UnknownKey(k) if cfg!(tidepool_broken = "cli_unknown_key_own_list") => {
            let keys: Vec<&str> = tidepool::CONFIG_KEYS.iter().map(|(k, _)| *k).collect();
            format!("unknown key `{k}`; valid keys: {}", keys.join(", "))
        }
        E::UnknownKey(_) => e.to_string(),
        E::BadValue { key, value, expected } => {
            format!("bad value `{value}` for `{key}`: expected {expected}")
        }
        E::Malformed(entry) => format!("malformed entry `{entry}`: expected key:value"),
        E::Inconsistent(why) => format!("inconsistent values: {why}"),
        other => tidepool::ErrorChain(other).to_string(),
    };
    format!("{what}: {why}")
}

/// Parses a byte count: a whole number with an optional unit, binary (`KiB`, `MiB`, `GiB`,
/// `TiB`, or `K`, `M`, `G`, `T`) or `B`; no unit means bytes. `512MiB`, `4 GiB`, `1073741824`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || format!("`{text}` is not a byte count (e.g. 4GiB, 512MiB, 1048576)");
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("`{text}` is more than 2^64 bytes"))
}

/// Whether `a` and `b` name one existing file, by another spelling or another link too.
fn same_file(a: &Path, b: &Path) -> bool {
    let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        x.dev() == y.dev() && x.ino() == y.ino()
    }
    #[cfg(not(unix))]
    {
        let _ = (x, y);
        std::fs::canonicalize(a).ok().is_some_and(|p| std::fs::canonicalize(b).ok() == Some(p))
    }
}

/// `path` for one device of several: `out.svg` → `out.device1.svg`.
fn svg_path(path: &Path, device: Option<u32>, several: bool) -> PathBuf {
    match device {
        Some(d) if several => {
            let stem =
                path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let ext = path.extension().map(|e| e.to_string_lossy().into_owned());
            let name = match ext {
                Some(ext) => format!("{stem}.device{d}.{ext}"),
                None => format!("{stem}.device{d}"),
            };
            path.with_file_name(name)
        }
        _ => path.to_path_buf(),
    }
}

fn replay(cmd: &ReplayArgs, n_policies: usize, out: &mut dyn Write) -> Result<(), String> {
    let read = ReadOptions { max_input_bytes: cmd.max_input_size };
    let traces = read_traces(&cmd.trace, &read)
        .map_err(|e| format!("{}: {}", echo_path(&cmd.trace), tidepool::ErrorChain(&e)))?;
    let traces = pick_device(cmd, traces)?;
    let several = traces.len() > 1;
    if let Some(svg) = &cmd.svg {
        for trace in &traces {
            let path = svg_path(svg, trace.snapshot.as_ref().map(|s| s.device), several);
            // BROKEN (`cli_svg_over_trace`, CLI only): the trace drawn over itself.
            if same_file(&path, &cmd.trace) && !cfg!(tidepool_broken = "cli_svg_over_trace") {
                return Err(format!(
                    "--svg {} is the trace being replayed; the plot would be written over it",
                    echo_path(&path)
                ));
            }
            crate::check_output(&path)?;
        }
    }
    let per_policy = cmd.repeats.max(1) as usize + usize::from(cmd.svg.is_some());
    let bar = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new((traces.len() * n_policies * per_policy) as u64);
        if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} replays  {msg}") {
            bar.set_style(style);
        }
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut reports: Vec<Report> = Vec::new();
    for trace in &traces {
        let (config, notes) = config_for(cmd, trace)?;
        let options = cmd.options(config);
        let policies = policies(&options)
            .map_err(|e| tidepool::ErrorChain(&e).to_string())
            .and_then(|all| select(all, &cmd.policies))?;
        let device = trace.snapshot.as_ref().map(|s| s.device);
        let mut report = run_policies(trace, &policies, &options, &mut |name| {
            match device {
                Some(d) => bar.set_message(format!("device {d}: {name}")),
                None => bar.set_message(name.to_string()),
            }
            bar.inc(1);
        })
        .map_err(|e| match device {
            Some(d) => format!("device {d}: {}", tidepool::ErrorChain(&e)),
            None => tidepool::ErrorChain(&e).to_string(),
        })?;
        report.notes = notes;
        // BROKEN (`cli_svg_before_all_replayed`, CLI only): each device drawn as it ends.
        if let Some(svg) = &cmd.svg
            && cfg!(tidepool_broken = "cli_svg_before_all_replayed")
        {
            write_svg(&report, &svg_path(svg, device, several))?;
        }
        reports.push(report);
    }
    bar.finish_and_clear();
    // The plots once every device has replayed: a later device's failure (exit 1, no report)
    // left the earlier devices' plots written, over whatever files of those names held.
    if let Some(svg) = &cmd.svg
        && !cfg!(tidepool_broken = "cli_svg_before_all_replayed")
    {
        for report in &reports {
            write_svg(report, &svg_path(svg, report.device(), several))?;
        }
    }
    let text = if cmd.json {
        reports.iter().map(|r| r.to_json() + "\n").collect::<String>()
    } else {
        reports.iter().map(Report::to_table).collect::<Vec<_>>().join("\n")
    };
    out.write_all(text.as_bytes()).map_err(|e| format!("cannot write output: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("1073741824"), Ok(1 << 30));
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2k"), Ok(2048));
        assert_eq!(parse_bytes("7B"), Ok(7));
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("1.5GiB").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("99999999999T").unwrap_err().contains("more than 2^64"));
    }

    #[test]
    fn svg_names_per_device() {
        let p = Path::new("/tmp/out.svg");
        assert_eq!(svg_path(p, Some(1), true), Path::new("/tmp/out.device1.svg"));
        assert_eq!(svg_path(p, Some(1), false), p);
        assert_eq!(svg_path(p, None, true), p);
        assert_eq!(svg_path(Path::new("plot"), Some(0), true), Path::new("plot.device0"));
    }
}
