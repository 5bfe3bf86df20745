//! Forward and backward of one transformer block (attention + MLP, layer norms, residuals,
//! between an embedding and an output projection) for a few AdamW steps with the eager layer on a
//! SimDevice, printing per step the loss, memory, device mallocs and plan hits.
//!
//! Run: `cargo run --release --example transformer_block [-- STEPS]`.

use std::process::ExitCode;
use tidepool::{ErrorChain, StreamId};
use tidepool_eager::models::data::Rng;
use tidepool_eager::models::transformer::{BlockConfig, TransformerBlock, token_batch};
use tidepool_eager::{AdamW, Eager, Optimizer, Tensor};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("transformer_block: error: {}", ErrorChain(&*e));
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let steps: usize = match std::env::args().nth(1) {
        Some(s) => s.parse()?,
        None => 8,
    };
    let eager = Eager::sim(256 << 20)?;
    let cfg = BlockConfig::default();
    let stream = StreamId::DEFAULT;
    let mut block = TransformerBlock::new(&eager, cfg, 7, stream)?;
    let mut opt = AdamW::new(0.01);
    let mut rng = Rng::new(3);
    println!("transformer block {cfg:?}");
    println!("step      loss  peak alloc    reserved  mallocs  plan hits/allocs  kernels");
    for i in 0..steps {
        eager.allocator().reset_peak_stats();
        let (a0, e0) = (eager.allocator().stats(), eager.stats());
        let (ids, targets) = token_batch(&cfg, &mut rng);
        let lx = eager.ctx(stream);
        let n = cfg.batch * cfg.seq;
        let (ids, targets) = (lx.tensor(&ids, &[n])?, lx.tensor(&targets, &[n])?);
        let (loss, grads) = {
            let step = eager.step("step", stream);
            let pass = block.forward_backward(&step.ctx(), &step.unscoped(), &ids, &targets)?;
            (pass.loss.to_host()?[0], pass.grads)
        };
        let refs: Vec<&Tensor<'static, _>> = grads.iter().collect();
        opt.step(&mut block.params_mut(), &refs)?;
        drop(refs);
        drop((grads, ids, targets));
        let (a1, e1) = (eager.allocator().stats(), eager.stats());
        println!(
            "{i:>4}  {loss:>8.4}  {:>10}  {:>10}  {:>7}  {:>9}/{:<6}  {:>7}",
            a1.blocks.allocated_bytes.all.peak,
            a1.blocks.reserved_bytes.all.current,
            a1.num_device_alloc - a0.num_device_alloc,
            a1.plan_hits - a0.plan_hits,
            e1.scoped_allocs - e0.scoped_allocs,
            e1.kernels - e0.kernels
        );
    }
    println!("{}", eager.allocator().memory_summary());
    Ok(())
}
