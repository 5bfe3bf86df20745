//! The `tidepool` command line, on clap (derive):
//!
//! ```text
//! tidepool replay TRACE [--policy NAME]... [--json] [--svg FILE] [--repeats N]
//!                 [--config KEY:VAL,...|from-snapshot] [--device N] [--max-input-size SIZE]
//! tidepool demo [--steps N] [--two-streams] [--sim] [--snapshot FILE]
//! ```
//!
//! Exit codes: 0 success (and `--help`, `--version`), 1 runtime error (unreadable trace, failed
//! replay, an SVG or snapshot file that cannot be written: checked before any work), 2 usage
//! error (unknown flag or policy, bad value). Errors print `tidepool: <message>` (or clap's
//! usage error) on stderr, the message being the error's whole chain (`outer: inner: …`, each
//! `source()` once: [`tidepool::ErrorChain`]).

mod demo;
mod replay;

use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::io::Write;
use tidepool_trace::echo_path;

/// Replays allocation traces through tidepool and baselines; runs the eager demo.
#[derive(Parser, Debug)]
#[command(name = "tidepool", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replays an allocation trace (tidepool CSV, RMM log CSV or PyTorch snapshot pickle; gzip or
    /// plain) through allocator policies and reports peak memory, fragmentation and speed.
    Replay(replay::ReplayArgs),
    /// Trains a small MLP with the eager tensor layer (CUDA with feature `cuda` and a GPU, else
    /// the simulated device) and prints per step the loss, memory, plan hits and device calls.
    Demo(demo::DemoArgs),
}

/// Runs the CLI with `args` (including the program name); returns the exit code.
fn run<I, T>(args: I, out: &mut dyn Write, err: &mut dyn Write) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let code = e.exit_code();
            let text = e.render().to_string();
            let _ = if code == 0 {
                out.write_all(text.as_bytes())
            } else {
                err.write_all(text.as_bytes())
            };
            return code;
        }
    };
    match cli.command {
        Command::Replay(args) => replay::run(&args, out, err),
        Command::Demo(args) => demo::run(&args, out, err),
    }
}

/// Checks, before any work, that the run's output file (`replay --svg`, `demo --snapshot`) can
/// be written: it was found unwritable only once every replay (or the training) had run, and
/// the report was lost to the error. An existing file is opened for writing, not truncated; a
/// new one is created and removed again. The error is the one the write would have met.
pub(crate) fn check_output(path: &std::path::Path) -> Result<(), String> {
    let cannot = |e: std::io::Error| format!("cannot write {}: {e}", echo_path(path));
    // BROKEN (`cli_output_checked_late`, CLI only): nothing checked before the work.
    if cfg!(tidepool_broken = "cli_output_checked_late") {
        return Ok(());
    }
    match std::fs::OpenOptions::new().write(true).open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            match std::fs::File::create_new(path) {
                Ok(_) => {
                    let _ = std::fs::remove_file(path);
                    Ok(())
                }
                // A dangling link (the write creates its target) or a file made meanwhile: the
                // write will say.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
                Err(e) => Err(cannot(e)),
            }
        }
        Err(e) => Err(cannot(e)),
    }
}

fn main() {
    let code =
        run(std::env::args_os(), &mut std::io::stdout().lock(), &mut std::io::stderr().lock());
    std::process::exit(code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Exit code of a usage error.
    const USAGE_ERROR: i32 = 2;

    fn run_str(s: &str) -> (i32, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = run(s.split_whitespace(), &mut out, &mut err);
        (code, String::from_utf8(out).unwrap(), String::from_utf8(err).unwrap())
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn usage_errors_are_exit_2_and_help_is_exit_0() {
        let (code, _, err) = run_str("tidepool replay t.csv --bogus");
        assert_eq!(code, USAGE_ERROR);
        assert!(err.contains("unexpected argument '--bogus'"), "{err}");
        let (code, _, err) = run_str("tidepool");
        assert_eq!(code, USAGE_ERROR);
        assert!(err.contains("Usage: tidepool <COMMAND>"), "{err}");
        let (code, out, _) = run_str("tidepool replay --help");
        assert_eq!(code, 0);
        assert!(out.contains("Usage: tidepool replay [OPTIONS] <TRACE>"), "{out}");
        let (code, _, err) = run_str("tidepool frobnicate");
        assert_eq!(code, USAGE_ERROR);
        assert!(err.contains("unrecognized subcommand 'frobnicate'"), "{err}");
    }

    /// `demo --snapshot FILE` writes the memory history, which `replay FILE` replays with each
    /// training step as a scope; an unwritable file is a runtime error.
    #[test]
    fn the_demos_snapshot_replays_with_its_steps_as_scopes() {
        let scratch = tempfile::Builder::new().prefix("tidepool-demo-").tempdir().unwrap();
        let dir = scratch.path();
        let file = dir.join("demo.pickle");
        let (code, out, err) =
            run_str(&format!("tidepool demo --steps 3 --sim --snapshot {}", file.display()));
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("memory history written to"), "{out}");
        let (code, out, err) = run_str(&format!("tidepool replay {} --repeats 1", file.display()));
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("scopes: 3 from external_annotations"), "{out}");
        let bad = dir.join("no-such-dir").join("x.pickle");
        let (code, _, err) =
            run_str(&format!("tidepool demo --steps 1 --sim --snapshot {}", bad.display()));
        assert_eq!(code, 1);
        assert!(err.contains("cannot write"), "{err}");
    }
}
