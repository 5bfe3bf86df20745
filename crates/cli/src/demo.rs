//! `tidepool demo`: trains the eager layer's MLP on the best device available — a GPU through
//! `CudaBackend` when the binary is built with feature `cuda` and one is present, else a
//! SimDevice with host kernels — and prints, per step, the loss, memory, plan hits and device
//! calls, then the allocator's `memory_summary()`. With `--snapshot FILE` it records the
//! memory history and writes it as PyTorch's snapshot pickle, which `tidepool replay FILE`
//! replays with each training step as a scope (and PyTorch's memory viewer draws).
//!
//! ```text
//! tidepool demo [--steps N] [--two-streams] [--sim] [--snapshot FILE]
//! ```

use clap::Args;
use std::io::Write;
use tidepool_eager::models::train::{StepReport, TrainConfig, train_mlp};
use tidepool_eager::{Backend, Eager};
use tidepool_trace::echo_path;

/// Capacity of the simulated device the demo runs on.
const SIM_CAPACITY: u64 = 1 << 30;

/// The `demo` subcommand's arguments.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct DemoArgs {
    /// Training steps.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub steps: u32,
    /// Load each next batch on a copy stream while the compute stream works.
    #[arg(long)]
    pub two_streams: bool,
    /// Use the simulated device even where a GPU is present.
    #[arg(long)]
    pub sim: bool,
    /// Record the memory history and write it to FILE as a snapshot pickle (for `tidepool
    /// replay FILE` and PyTorch's memory viewer). While recording, named scopes take no plan.
    #[arg(long, value_name = "FILE")]
    pub snapshot: Option<std::path::PathBuf>,
}

/// Runs the demo; returns the exit code (1: runtime error, an output that could not be written
/// among them, as `replay`'s).
pub fn run(args: &DemoArgs, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let cfg = TrainConfig {
        steps: args.steps as usize,
        two_streams: args.two_streams,
        ..TrainConfig::default()
    };
    if let Some(Err(msg)) = args.snapshot.as_deref().map(crate::check_output) {
        let _ = writeln!(err, "tidepool: {msg}");
        return 1;
    }
    let mut checked = Checked { out, error: None };
    let mut result = best_device(&cfg, args, &mut checked);
    let _ = checked.flush();
    if let (Ok(()), Some(e)) = (&result, checked.error) {
        result = Err(format!("cannot write output: {e}"));
    }
    match result {
        Ok(()) => 0,
        Err(msg) => {
            let _ = writeln!(err, "tidepool: {msg}");
            1
        }
    }
}

/// The output, keeping its first write error (the lines are written as training goes, where an
/// error cannot stop it; the run fails with it at the end) and writing nothing after it.
struct Checked<'a> {
    out: &'a mut dyn Write,
    error: Option<std::io::Error>,
}

impl Write for Checked<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.error.is_none()
            && let Err(e) = self.out.write_all(buf)
        {
            self.error = Some(e);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.error.is_none()
            && let Err(e) = self.out.flush()
        {
            self.error = Some(e);
        }
        Ok(())
    }
}

/// Runs on CUDA where possible, else on the simulated device.
fn best_device(cfg: &TrainConfig, args: &DemoArgs, out: &mut dyn Write) -> Result<(), String> {
    let snapshot = args.snapshot.as_deref();
    #[cfg(feature = "cuda")]
    if !args.sim {
        use tidepool::CudaDevice;
        use tidepool_eager::CudaBackend;
        match CudaDevice::unavailable_reason() {
            None => {
                let device =
                    CudaDevice::new(0).map_err(|e| tidepool::ErrorChain(&e).to_string())?;
                match CudaBackend::new(device) {
                    Ok(backend) => {
                        let eager = Eager::new(backend, tidepool::Config::default())
                            .map_err(|e| tidepool::ErrorChain(&e).to_string())?;
                        return train(&eager, cfg, snapshot, out);
                    }
                    Err(e) => {
                        let e = tidepool::ErrorChain(&e).to_string();
                        let _ = writeln!(out, "CUDA back end unavailable ({e}); using SimDevice");
                    }
                }
            }
            Some(reason) => {
                let _ = writeln!(out, "no GPU ({reason}); using SimDevice");
            }
        }
    }
    let eager = Eager::sim(SIM_CAPACITY).map_err(|e| tidepool::ErrorChain(&e).to_string())?;
    train(&eager, cfg, snapshot, out)?;
    let violations = eager.device().violations();
    if !violations.is_empty() {
        return Err(format!("stream-order sanitizer: {violations:?}"));
    }
    Ok(())
}

fn train<B: Backend>(
    eager: &Eager<B>,
    cfg: &TrainConfig,
    snapshot: Option<&std::path::Path>,
    out: &mut dyn Write,
) -> Result<(), String> {
    if snapshot.is_some() {
        eager.allocator().record_history(tidepool::HistoryOptions::default());
    }
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
    let reports =
        train_mlp(eager, cfg, &mut line).map_err(|e| tidepool::ErrorChain(&e).to_string())?;
    if let Some(path) = snapshot {
        eager
            .allocator()
            .dump_snapshot(path)
            .map_err(|e| format!("cannot write {}: {e}", echo_path(path)))?;
        let _ = writeln!(out, "memory history written to {}", echo_path(path));
    }
    let _ = writeln!(out, "{}", eager.allocator().memory_summary());
    if let (Some(a), Some(b)) = (reports.first(), reports.last()) {
        let _ = writeln!(out, "loss {:.4} → {:.4} over {} steps", a.loss, b.loss, reports.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_on_the_simulated_device() {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let args = DemoArgs { steps: 3, two_streams: true, sim: true, snapshot: None };
        assert_eq!(run(&args, &mut out, &mut err), 0, "{}", String::from_utf8_lossy(&err));
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("on host kernels on SimDevice"), "{out}");
        assert!(out.contains("tidepool memory summary"), "{out}");
        assert!(out.contains("over 3 steps"), "{out}");
    }
}
