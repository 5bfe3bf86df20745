//! The eager layer driving the allocator: the MLP learns, a repeated step is served from its
//! learned plan with no device malloc, the two-stream variant is sanitizer-clean and gives the
//! same numbers, scoped tensors cannot outlive their step, and the recorded trace replays.

use tidepool::device::{Device, Kernel, Launch};
use tidepool::{Residency, StreamId};
use tidepool_eager::models::data::Rng;
use tidepool_eager::models::train::{OptimizerKind, StepReport, TrainConfig, train_mlp};
use tidepool_eager::models::transformer::{BlockConfig, TransformerBlock, token_batch};
use tidepool_eager::{AdamW, Eager, Optimizer, SimEager, Tensor};
use tidepool_trace::{Op, ReplayOptions, Tag, read_trace_bytes, registry};

/// Scoped allocations of one MLP step with 3 layers: forward 2·3 (matmul, bias add) + 2 relu,
/// loss, loss gradient, 2 · (dh, relu backward).
const MLP_SCOPED_ALLOCS: u64 = 14;
/// Unscoped allocations of one step: the batch (x, y) and 6 parameter gradients.
const MLP_UNSCOPED_ALLOCS: u64 = 8;

fn eager() -> SimEager {
    Eager::sim(64 << 20).unwrap()
}

fn clean(e: &SimEager) {
    e.synchronize().unwrap();
    assert_eq!(e.device().violations(), vec![]);
    assert_eq!(e.device().kernel_failures(), vec![]);
}

fn run(cfg: &TrainConfig) -> (SimEager, Vec<StepReport>) {
    let e = eager();
    let r = train_mlp(&e, cfg, |_| {}).unwrap();
    clean(&e);
    (e, r)
}

fn losses(r: &[StepReport]) -> Vec<f32> {
    r.iter().map(|s| s.loss).collect()
}

/// From `first_clean` on: no device malloc and a plan hit for every allocation of the step.
fn assert_planned_from(r: &[StepReport], first_clean: usize, two_streams: bool) {
    for s in r {
        assert_eq!(s.scoped_allocs, MLP_SCOPED_ALLOCS, "step {}", s.step);
        // With a copy stream the last step prefetches no next batch.
        let last_two_stream = two_streams && s.step + 1 == r.len();
        let unscoped = MLP_UNSCOPED_ALLOCS - if last_two_stream { 2 } else { 0 };
        assert_eq!(s.unscoped_allocs, unscoped, "step {}", s.step);
        assert_eq!((s.plan_misses, s.plan_fallbacks), (0, 0), "step {}", s.step);
        if s.step >= first_clean {
            assert_eq!(s.device_mallocs, 0, "step {}: {s:?}", s.step);
            assert_eq!(s.device_frees, 0, "step {}: {s:?}", s.step);
        }
        if s.step >= 1 {
            assert_eq!(s.plan_hits, s.scoped_allocs, "step {}", s.step);
        }
    }
    assert_eq!(r[0].plan_hits, 0, "the first step learns the plan");
    // Activations may use free space in the weights' segments (`residency.rs`): this small
    // model's first step fits there and reserves nothing.
    assert_eq!(r[0].device_mallocs, 0, "the first step fits the weights' segments");
}

#[test]
fn mlp_loss_falls_and_steady_steps_are_planned() {
    let (e, r) = run(&TrainConfig::default());
    let l = losses(&r);
    assert_eq!(l.len(), 20);
    assert!(l[19] < 0.5 * l[0], "loss {} → {}", l[0], l[19]);
    assert!(l.iter().all(|x| x.is_finite()));
    // One stream: the plan's region fits the segments the first step ran in, so already the
    // second step (index 1) makes no device malloc.
    assert_planned_from(&r, 1, false);
    let s = e.allocator().stats();
    assert_eq!(s.plan_hits, 19 * MLP_SCOPED_ALLOCS);
    assert_eq!(s.scope_escapes, 0, "scoped tensors cannot escape a step");
}

#[test]
fn two_streams_are_clean_and_give_the_same_numbers() {
    let (_, one) = run(&TrainConfig::default());
    let (e, two) = run(&TrainConfig { two_streams: true, ..TrainConfig::default() });
    assert_eq!(losses(&one), losses(&two), "bit-identical losses");
    // Step 0 runs in the free space of the weights' segments and its plan's region is made
    // there as it ends: no device call in any step.
    assert_planned_from(&two, 1, true);
    assert_eq!((two[0].device_mallocs, two[0].device_frees), (0, 0));
    assert!(e.device().live_streams().len() == 1, "the copy stream was destroyed");
}

#[test]
fn unscoped_training_gives_the_same_numbers_without_plans() {
    let (_, scoped) = run(&TrainConfig { steps: 5, ..TrainConfig::default() });
    let (e, plain) = run(&TrainConfig { steps: 5, scoped: false, ..TrainConfig::default() });
    assert_eq!(losses(&scoped), losses(&plain));
    assert!(plain.iter().all(|s| s.plan_hits == 0 && s.scoped_allocs == 0));
    assert!(plain[1..].iter().all(|s| s.device_mallocs == 0), "the cache serves later steps");
    assert_eq!(e.allocator().stats().plan_hits, 0);
}

#[test]
fn adamw_trains_and_keeps_its_state_persistent() {
    let cfg = TrainConfig { optimizer: OptimizerKind::AdamW(0.01), ..TrainConfig::default() };
    let (e, r) = run(&cfg);
    assert!(r[19].loss < 0.5 * r[0].loss, "loss {} → {}", r[0].loss, r[19].loss);
    // 6 parameters before the loop; 12 moments made by the first update.
    assert_eq!(r[0].persistent_allocs, 12);
    assert!(r[1..].iter().all(|s| s.persistent_allocs == 0));
    assert_planned_from(&r, 1, false);
    assert_eq!(e.stats().persistent_allocs, 18);
}

#[test]
fn a_missing_wait_is_caught_by_the_sanitizer() {
    let e = eager();
    let copy = e.device().create_stream().unwrap();
    // Hold the copy stream busy so the upload below is still pending when the op is launched.
    e.device().launch(copy, Kernel::sleep(std::time::Duration::from_millis(200))).unwrap();
    let x = e.ctx(copy).tensor(&[1.0, -2.0], &[2]).unwrap();
    let cx = e.ctx(StreamId::DEFAULT);
    let y = cx.relu(&x).unwrap(); // no cx.wait_for(&x)
    e.synchronize().unwrap();
    let v = e.device().violations();
    assert!(!v.is_empty() && v[0].op == "kernel relu", "{v:?}");
    assert_eq!(v[0].other, Some(copy));
    drop((x, y));
    // With the wait: clean.
    let e = eager();
    let copy = e.device().create_stream().unwrap();
    e.device().launch(copy, Kernel::sleep(std::time::Duration::from_millis(50))).unwrap();
    let x = e.ctx(copy).tensor(&[1.0, -2.0], &[2]).unwrap();
    let cx = e.ctx(StreamId::DEFAULT);
    cx.wait_for(&x).unwrap();
    assert_eq!(cx.relu(&x).unwrap().to_host().unwrap(), vec![1.0, 0.0]);
    drop(x);
    clean(&e);
}

#[test]
fn residency_follows_how_a_tensor_is_made() {
    let e = eager();
    let s = StreamId::DEFAULT;
    let w = Tensor::parameter(&e, &[1.0; 4], &[2, 2], s).unwrap();
    assert_eq!((w.residency(), w.is_scoped()), (Residency::Persistent, false));
    let g = e.ctx(s).zeros(&[2, 2]).unwrap();
    assert_eq!((g.residency(), g.is_scoped()), (Residency::Transient, false));
    let kept = {
        let step = e.step("step", s);
        let a = step.ctx().add(&w, &g).unwrap();
        assert_eq!((a.residency(), a.is_scoped()), (Residency::Transient, true));
        let grad = step.unscoped().scale(&a, 2.0).unwrap();
        assert!(!grad.is_scoped());
        grad // outlives the step: allocated through the allocator, not the scope
    };
    assert_eq!(kept.to_host().unwrap(), vec![2.0; 4]);
    let st = e.allocator().stats();
    assert_eq!(st.scope_escapes, 0);
    // Small blocks of both residencies share the small segments and count as transient
    // (`residency.rs`): w, g, the kept gradient and the step's plan region, 16 B each
    // rounded to 512 B.
    assert_eq!(st.blocks.allocated_bytes.persistent.current, 0);
    assert_eq!(st.blocks.allocated_bytes.transient.current, 4 * 512);
    assert_eq!(e.stats().persistent_allocs, 1);
    clean(&e);
}

#[test]
fn a_bad_class_id_fails_its_kernel_not_the_process() {
    let e = eager();
    let cx = e.ctx(StreamId::DEFAULT);
    let logits = cx.zeros(&[2, 3]).unwrap();
    let targets = cx.tensor(&[0.0, 3.0], &[2]).unwrap();
    let loss = cx.cross_entropy(&logits, &targets).unwrap();
    e.synchronize().unwrap();
    let f = e.device().kernel_failures();
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].kernel, "cross_entropy");
    drop(loss);
}

#[test]
fn recorded_trace_parses_and_replays() {
    let e = eager();
    e.start_trace();
    let cfg = TrainConfig { steps: 4, two_streams: true, ..TrainConfig::default() };
    train_mlp(&e, &cfg, |_| {}).unwrap();
    clean(&e);
    let csv = e.recorder().unwrap().to_csv();
    let trace = read_trace_bytes(csv.as_bytes()).unwrap();
    let count = |op: Op, tag: Option<Tag>| {
        trace.events.iter().filter(|ev| ev.op == op && tag.is_none_or(|t| ev.tag == t)).count()
    };
    assert_eq!(count(Op::ScopeEnter, None), 4);
    assert_eq!(count(Op::ScopeExit, None), 4);
    assert_eq!(trace.scope_names, vec!["step0", "step1", "step2", "step3"]);
    assert_eq!(count(Op::Alloc, Some(Tag::Param)), 6);
    // Per step: 14 scoped + 6 gradients; 4 batches of 2 tensors on the copy stream.
    assert_eq!(count(Op::Alloc, Some(Tag::Act)), 4 * (14 + 6) + 4 * 2);
    assert_eq!(count(Op::Alloc, None), count(Op::Free, None), "everything freed");
    assert!(trace.events.iter().any(|ev| ev.stream == 1), "the copy stream is in the trace");
    let opts = ReplayOptions { repeats: 1, ..ReplayOptions::default() };
    for policy in registry(&opts).unwrap() {
        let r = policy.replay(&trace, false).unwrap();
        assert!(r.peak_reserved_bytes >= r.peak_allocated_bytes, "{}", r.name);
        assert!(r.peak_allocated_bytes > 0, "{}", r.name);
    }
}

#[test]
fn transformer_block_steps_are_planned_and_clean() {
    let e = eager();
    let s = StreamId::DEFAULT;
    let cfg = BlockConfig::default();
    let mut block = TransformerBlock::new(&e, cfg, 7, s).unwrap();
    let mut opt = AdamW::new(0.003);
    let mut rng = Rng::new(3);
    let n = cfg.batch * cfg.seq;
    let mut scoped_per_step = Vec::new();
    for i in 0..4 {
        let (a0, e0) = (e.allocator().stats(), e.stats());
        let (ids, targets) = token_batch(&cfg, &mut rng);
        let (ids, targets) =
            (e.ctx(s).tensor(&ids, &[n]).unwrap(), e.ctx(s).tensor(&targets, &[n]).unwrap());
        let (loss, grads) = {
            let step = e.step("step", s);
            let p = block.forward_backward(&step.ctx(), &step.unscoped(), &ids, &targets).unwrap();
            (p.loss.to_host().unwrap()[0], p.grads)
        };
        assert!(loss.is_finite());
        let refs: Vec<&Tensor<'static, _>> = grads.iter().collect();
        opt.step(&mut block.params_mut(), &refs).unwrap();
        drop(refs);
        drop((grads, ids, targets));
        let (a1, e1) = (e.allocator().stats(), e.stats());
        let scoped = e1.scoped_allocs - e0.scoped_allocs;
        scoped_per_step.push(scoped);
        if i >= 1 {
            assert_eq!(a1.num_device_alloc - a0.num_device_alloc, 0, "step {i}");
            assert_eq!(a1.plan_hits - a0.plan_hits, scoped, "step {i}");
        }
        assert_eq!((a1.plan_misses, a1.plan_fallbacks), (0, 0));
    }
    assert!(scoped_per_step.iter().all(|&n| n == scoped_per_step[0]));
    clean(&e);
}

/// A step name holding the trace's separators (a comma, a line break) is recorded with them
/// replaced by `_`: written as given, the row had an extra column (or was cut in two), and
/// `tidepool replay` refused the whole trace. Names without them are kept as they are.
#[test]
fn step_names_with_commas_or_line_breaks_keep_the_trace_readable() {
    let e = eager();
    e.start_trace();
    for name in ["fwd,bwd", "two\nlines", "cr\r", "plain"] {
        let step = e.step(name, StreamId::DEFAULT);
        let cx = step.ctx();
        drop(cx.full(&[4], 1.0).unwrap());
    }
    clean(&e);
    let csv = e.recorder().unwrap().to_csv();
    let trace = read_trace_bytes(csv.as_bytes()).unwrap_or_else(|err| panic!("{err}\n{csv}"));
    assert_eq!(trace.scope_names, vec!["fwd_bwd0", "two_lines1", "cr_2", "plain3"]);
    assert_eq!(trace.events.len(), 4 * 4, "enter, alloc, free, exit per step");
    assert_eq!(csv.lines().count(), 1 + 4 * 4, "one line per row");
}
