//! `tidepool demo`: trains the eager layer's MLP on the best device available — a GPU through
//! `CudaBackend` when the binary is built with feature `cuda` and one is present, else a
//! SimDevice with host kernels — and prints, per step, the loss, memory, plan hits and device
//! calls, then the allocator's `memory_summary()`.
//!
//! ```text
//! tidepool demo [--steps N] [--two-streams] [--sim]
//! ```

use std::io::Write;
use tidepool::eager::models::train::{StepReport, TrainConfig, train_mlp};
use tidepool::eager::{Backend, Eager};

/// Usage of the subcommand.
pub const USAGE: &str = "\
usage: tidepool demo [--steps N] [--two-streams] [--sim]

Trains a small MLP with the eager tensor layer on the best device available (CUDA with feature
`cuda` and a GPU, else the simulated device) and prints per step the loss, memory, plan hits and
device calls, then the allocator's memory summary.

options:
  --steps N        training steps (default 20)
  --two-streams    load each next batch on a copy stream while the compute stream works
  --sim            use the simulated device even where a GPU is present";

/// Capacity of the simulated device the demo runs on.
const SIM_CAPACITY: u64 = 1 << 30;

/// Parsed options.
#[derive(Debug, PartialEq)]
struct Options {
    cfg: TrainConfig,
    sim: bool,
}

fn parse(args: &[String]) -> Result<Option<Options>, String> {
    let mut o = Options { cfg: TrainConfig::default(), sim: false };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => return Ok(None),
            "--two-streams" => o.cfg.two_streams = true,
            "--sim" => o.sim = true,
            "--steps" => {
                let v = it.next().ok_or("--steps needs a value")?;
                o.cfg.steps = match v.parse::<usize>() {
                    Ok(n) if n >= 1 => n,
                    _ => return Err(format!("--steps needs a positive integer, got `{v}`")),
                };
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(Some(o))
}

/// Runs the demo with `args` (after `demo`); returns the exit code (2: usage error).
pub fn run(args: &[String], out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let opts = match parse(args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            let _ = writeln!(out, "{USAGE}");
            return 0;
        }
        Err(msg) => {
            let _ = writeln!(err, "tidepool: {msg}\n{USAGE}");
            return 2;
        }
    };
    match best_device(&opts, out) {
        Ok(()) => 0,
        Err(msg) => {
            let _ = writeln!(err, "tidepool: {msg}");
            1
        }
    }
}

/// Runs on CUDA where possible, else on the simulated device.
fn best_device(opts: &Options, out: &mut dyn Write) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    if !opts.sim {
        use tidepool::CudaDevice;
        use tidepool::eager::CudaBackend;
        match CudaDevice::unavailable_reason() {
            None => {
                let device = CudaDevice::new(0).map_err(|e| e.to_string())?;
                match CudaBackend::new(device) {
                    Ok(backend) => {
                        let eager = Eager::new(backend, tidepool::Config::default())
                            .map_err(|e| e.to_string())?;
                        return train(&eager, &opts.cfg, out);
                    }
                    Err(e) => {
                        let _ = writeln!(out, "CUDA back end unavailable ({e}); using SimDevice");
                    }
                }
            }
            Some(reason) => {
                let _ = writeln!(out, "no GPU ({reason}); using SimDevice");
            }
        }
    }
    let eager = Eager::sim(SIM_CAPACITY).map_err(|e| e.to_string())?;
    train(&eager, &opts.cfg, out)?;
    let violations = eager.device().violations();
    if !violations.is_empty() {
        return Err(format!("stream-order sanitizer: {violations:?}"));
    }
    Ok(())
}

fn train<B: Backend>(
    eager: &Eager<B>,
    cfg: &TrainConfig,
    out: &mut dyn Write,
) -> Result<(), String> {
    let _ = writeln!(
        out,
        "MLP {:?}, batch {}, {:?}, {}, on {}",
        cfg.sizes,
        cfg.batch,
        cfg.optimizer,
        if cfg.two_streams { "copy stream + compute stream" } else { "one stream" },
        eager.backend().name()
    );
    let _ = writeln!(
        out,
        "step      loss  peak alloc    reserved  mallocs  frees  plan hits/allocs  misses  kernels  copies  syncs"
    );
    let mut line = |r: &StepReport| {
        let _ = writeln!(
            out,
            "{:>4}  {:>8.4}  {:>10}  {:>10}  {:>7}  {:>5}  {:>9}/{:<6}  {:>6}  {:>7}  {:>6}  {:>5}",
            r.step,
            r.loss,
            r.peak_allocated_bytes,
            r.reserved_bytes,
            r.device_mallocs,
            r.device_frees,
            r.plan_hits,
            r.scoped_allocs,
            r.plan_misses,
            r.kernels,
            r.copies,
            r.alloc_host_syncs
        );
    };
    let reports = train_mlp(eager, cfg, &mut line).map_err(|e| e.to_string())?;
    let _ = writeln!(out, "{}", eager.allocator().memory_summary());
    if let (Some(a), Some(b)) = (reports.first(), reports.last()) {
        let _ = writeln!(out, "loss {:.4} → {:.4} over {} steps", a.loss, b.loss, reports.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_and_rejects() {
        let o = parse(&args("--steps 3 --two-streams --sim")).unwrap().unwrap();
        assert_eq!((o.cfg.steps, o.cfg.two_streams, o.sim), (3, true, true));
        assert_eq!(parse(&args("--help")), Ok(None));
        assert!(parse(&args("--steps 0")).is_err());
        assert!(parse(&args("--bogus")).is_err());
    }

    #[test]
    fn runs_on_the_simulated_device() {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(run(&args("--steps 3 --sim --two-streams"), &mut out, &mut err), 0);
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("on host kernels on SimDevice"), "{out}");
        assert!(out.contains("tidepool memory summary"), "{out}");
        assert!(out.contains("over 3 steps"), "{out}");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(run(&args("--nope"), &mut out, &mut err), 2);
    }
}
