//! Eager layer costs on the SimDevice:
//! - `eager_op/*`: host-side overhead of one tiny op (output allocation + kernel enqueue +
//!   output free), inside a planned step (the steady state of training), unscoped (allocator
//!   cache hit), and with the sanitizer off; the kernels run on the stream's worker thread
//!   meanwhile and are not what is measured (4-element tensors).
//! - `mlp_step/*`: one training step of the default MLP (forward, backward, loss read back, SGD),
//!   activations from the plain allocator vs from a named scope per step.
use criterion::{Criterion, criterion_group, criterion_main};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tidepool::{Config, SimConfig, SimDevice, StreamId};
use tidepool_eager::models::data::Clusters;
use tidepool_eager::models::mlp::Mlp;
use tidepool_eager::models::train::TrainConfig;
use tidepool_eager::{Eager, HostBackend, Optimizer, Sgd, SimEager, Tensor};

/// Ops per measured step run.
const OPS: u64 = 256;
const S: StreamId = StreamId::DEFAULT;

fn sim(sanitize: bool) -> SimEager {
    let dev = SimDevice::with_config(SimConfig { capacity: 1 << 30, backed: true, sanitize });
    Eager::new(HostBackend::new(Arc::new(dev)), Config::default()).unwrap()
}

fn per_op(c: &mut Criterion) {
    let mut g = c.benchmark_group("eager_op");
    for (name, sanitize) in [("planned_add", true), ("planned_add_no_sanitizer", false)] {
        let e = sim(sanitize);
        let a = Tensor::parameter(&e, &[1.0; 4], &[4], S).unwrap();
        let run = |e: &SimEager| {
            let step = e.step("bench", S);
            let cx = step.ctx();
            for _ in 0..OPS {
                drop(cx.add(&a, &a).unwrap());
            }
        };
        run(&e); // learn
        run(&e); // make the region
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters.div_ceil(OPS) {
                    let step = e.step("bench", S);
                    let cx = step.ctx();
                    let t = Instant::now();
                    for _ in 0..OPS {
                        drop(cx.add(&a, &a).unwrap());
                    }
                    total += t.elapsed();
                    drop(cx);
                    drop(step);
                    e.synchronize().unwrap();
                }
                total.mul_f64(iters as f64 / (iters.div_ceil(OPS) * OPS) as f64)
            })
        });
        assert!(e.allocator().stats().plan_hits > 0);
        assert_eq!(e.device().violations(), vec![]);
    }
    let e = sim(true);
    let a = Tensor::parameter(&e, &[1.0; 4], &[4], S).unwrap();
    let cx = e.ctx(S);
    g.bench_function("unscoped_add", |b| {
        b.iter_custom(|iters| {
            // Same chunks as the planned runs: the device drains between chunks, so the
            // sanitizer's pending list stays as short.
            let mut total = Duration::ZERO;
            for _ in 0..iters.div_ceil(OPS) {
                let t = Instant::now();
                for _ in 0..OPS {
                    drop(cx.add(&a, &a).unwrap());
                }
                total += t.elapsed();
                e.synchronize().unwrap();
            }
            total.mul_f64(iters as f64 / (iters.div_ceil(OPS) * OPS) as f64)
        })
    });
    g.finish();
}

fn mlp_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("mlp_step");
    for (name, scoped) in [("plain_allocator", false), ("scoped", true)] {
        let cfg = TrainConfig::default();
        let e = sim(true);
        let data = Clusters::new(cfg.samples, cfg.sizes[0], 4, cfg.noise, cfg.seed);
        let mut model = Mlp::new(&e, &cfg.sizes, 1, S).unwrap();
        let (x, y) = data.batch(0, cfg.batch);
        let x = Tensor::parameter(&e, &x, &[cfg.batch, cfg.sizes[0]], S).unwrap();
        let y = Tensor::parameter(&e, &y, &[cfg.batch], S).unwrap();
        let mut sgd = Sgd::new(0.05);
        let mut step = || {
            let gx = e.ctx(S);
            let (loss, grads) = if scoped {
                let st = e.step("step", S);
                let p = model.forward_backward(&st.ctx(), &gx, &x, &y).unwrap();
                (p.loss.to_host().unwrap()[0], p.grads)
            } else {
                let p = model.forward_backward(&gx, &gx, &x, &y).unwrap();
                (p.loss.to_host().unwrap()[0], p.grads)
            };
            let refs: Vec<&Tensor<'static, _>> = grads.iter().collect();
            sgd.step(&mut model.params_mut(), &refs).unwrap();
            loss
        };
        step();
        step();
        g.bench_function(name, |b| b.iter(&mut step));
        assert_eq!(e.device().violations(), vec![]);
    }
    g.finish();
}

criterion_group!(benches, per_op, mlp_step);
criterion_main!(benches);
