//! Trains a small MLP on a synthetic classification data set (Gaussian clusters) with the eager
//! layer on a SimDevice (host kernels on asynchronous streams), and prints per step the loss,
//! memory, device mallocs and plan hits. The loss must fall: the example exits 1 otherwise.
//!
//! Run: `cargo run --release --example mlp_train [-- --two-streams] [-- --adamw] [-- --unscoped]
//! [-- --trace FILE]`. With `--trace`, the allocation trace is written as tidepool CSV, ready for
//! `tidepool replay FILE`.

use std::process::ExitCode;
use tidepool::ErrorChain;
use tidepool_eager::Eager;
use tidepool_eager::models::train::{OptimizerKind, TrainConfig, train_mlp};

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("mlp_train: error: {}", ErrorChain(&*e));
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cfg = TrainConfig::default();
    let mut trace = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--two-streams" => cfg.two_streams = true,
            "--adamw" => cfg.optimizer = OptimizerKind::AdamW(0.01),
            "--unscoped" => cfg.scoped = false,
            "--trace" => trace = Some(it.next().ok_or("--trace needs a file")?.clone()),
            other => return Err(format!("unknown argument `{other}`").into()),
        }
    }
    let eager = Eager::sim(256 << 20)?;
    if trace.is_some() {
        eager.start_trace();
    }
    println!("MLP {:?}, batch {}, {:?}, on {}", cfg.sizes, cfg.batch, cfg.optimizer, {
        use tidepool_eager::Backend;
        eager.backend().name()
    });
    println!("step      loss  peak alloc    reserved  mallocs  plan hits/allocs  kernels");
    let reports = train_mlp(&eager, &cfg, |r| {
        println!(
            "{:>4}  {:>8.4}  {:>10}  {:>10}  {:>7}  {:>9}/{:<6}  {:>7}",
            r.step,
            r.loss,
            r.peak_allocated_bytes,
            r.reserved_bytes,
            r.device_mallocs,
            r.plan_hits,
            r.scoped_allocs,
            r.kernels
        );
    })?;
    println!("{}", eager.allocator().memory_summary());
    if let (Some(path), Some(rec)) = (trace, eager.recorder()) {
        rec.write_csv(std::path::Path::new(&path))?;
        println!("trace: {} rows in {path}", rec.len());
    }
    let (first, last) = (reports[0].loss, reports[reports.len() - 1].loss);
    let fell = last < 0.5 * first; // false for NaN too
    if !fell {
        eprintln!("mlp_train: the loss did not fall enough ({first} → {last})");
        return Ok(ExitCode::FAILURE);
    }
    println!("loss {first:.4} → {last:.4}");
    Ok(ExitCode::SUCCESS)
}
