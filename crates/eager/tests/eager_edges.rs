//! Edges of the eager layer a user reaches (found in review): shapes whose sizes overflow, ops
//! over zero rows, class and token ids out of range, a left operand repeated over a batch, an
//! optimiser whose first step runs out of memory, and attention that must not see the future.
//! Each fails on the code before its fix (and under its broken build, `cfg(tidepool_broken)`).

use tidepool::StreamId;
use tidepool_eager::models::data::Rng;
use tidepool_eager::models::transformer::{BlockConfig, TransformerBlock};
use tidepool_eager::{AdamW, Eager, Optimizer, SimEager, Tensor};

const S: StreamId = StreamId::DEFAULT;

fn eager() -> SimEager {
    Eager::sim(64 << 20).unwrap()
}

/// After a synchronisation the engine's allocator holds no buffer and keeps its invariants,
/// and once its cache is emptied (its persistent memory too, with `persistent`) the device
/// holds no segment.
fn assert_holds_nothing(e: &SimEager, persistent: bool) {
    e.synchronize().unwrap();
    let alloc = e.allocator();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.allocated_bytes(), 0);
    alloc.empty_cache().unwrap();
    if persistent {
        alloc.release_persistent().unwrap();
    }
    assert_eq!(e.device().live_segments(), vec![]);
}

/// A shape whose element count, bytes or rows overflow is an error, not a panic (debug) or a
/// wrapped size (release).
#[test]
fn shapes_whose_sizes_overflow_are_errors() {
    let e = eager();
    let cx = e.ctx(S);
    for dims in [&[1usize << 32, 1 << 32][..], &[1 << 62], &[1 << 40, 1 << 40, 0]] {
        let r = cx.zeros(dims);
        let e = r.err().unwrap_or_else(|| panic!("{dims:?} accepted"));
        assert!(e.to_string().contains("the element count overflows"), "{dims:?}: {e}");
    }
    // Two empty operands whose product would be 2^80 elements.
    let a = cx.tensor(&[], &[1 << 40, 0]).unwrap();
    let b = cx.tensor(&[], &[0, 1 << 40]).unwrap();
    assert!(cx.matmul(&a, &b).is_err());
}

/// Over zero rows the outputs are still written: the loss is NaN (the mean of nothing), the
/// layer norm's parameter gradients zeros — not whatever the memory held before.
#[test]
fn ops_over_zero_rows_write_their_outputs() {
    let e = eager();
    let cx = e.ctx(S);
    drop(cx.full(&[1], 7.0).unwrap().to_host().unwrap()); // leaves 7.0 in a freed block
    let logits = cx.tensor(&[], &[0, 3]).unwrap();
    let targets = cx.tensor(&[], &[0]).unwrap();
    let loss = cx.cross_entropy(&logits, &targets).unwrap().to_host().unwrap();
    assert!(loss[0].is_nan(), "{loss:?}");
    drop((cx.full(&[4], 7.0).unwrap(), cx.full(&[4], 9.0).unwrap()));
    let x = cx.tensor(&[], &[0, 4]).unwrap();
    let g = cx.tensor(&[1.0; 4], &[4]).unwrap();
    let (_dx, dg, db) = cx.layer_norm_backward(&cx, &x, &g, &x, 1e-5).unwrap();
    assert_eq!((dg.to_host().unwrap(), db.to_host().unwrap()), (vec![0.0; 4], vec![0.0; 4]));
    assert_eq!(e.device().violations(), vec![]);
}

/// A class or token id out of range (negative: a common "ignore" id; past the end; NaN) gives
/// NaN where it is used and a failed kernel, as the CUDA kernels do — never class 0 or row 0,
/// and never the stale bytes of a kernel that stopped before writing.
#[test]
fn ids_out_of_range_give_nan_and_a_failed_kernel() {
    for bad in [-1.0f32, 3.0, f32::NAN] {
        let e = eager();
        let cx = e.ctx(S);
        drop(cx.full(&[1], 3.25).unwrap().to_host().unwrap());
        let logits = cx.tensor(&[5.0, 0.0, 0.0, 0.0, 5.0, 0.0], &[2, 3]).unwrap();
        let targets = cx.tensor(&[0.0, bad], &[2]).unwrap();
        let loss = cx.cross_entropy(&logits, &targets).unwrap().to_host().unwrap();
        assert!(loss[0].is_nan(), "target {bad}: {loss:?}");
        let dl = cx.cross_entropy_backward(&logits, &targets).unwrap().to_host().unwrap();
        assert!(dl[3..].iter().all(|v| v.is_nan()), "target {bad}: {dl:?}");
        let table = cx.tensor(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]).unwrap();
        let ids = cx.tensor(&[bad], &[1]).unwrap();
        let row = cx.embedding(&table, &ids).unwrap().to_host().unwrap();
        assert!(row.iter().all(|v| v.is_nan()), "id {bad}: {row:?}");
        e.synchronize().unwrap();
        assert_eq!(e.device().kernel_failures().len(), 3, "id {bad}");
        assert_eq!(e.device().violations(), vec![]);
    }
}

/// The gradient of a left operand repeated over the right operand's batch is shaped as that
/// operand: the batches' gradients summed (`matmul_backward_lhs_of`).
#[test]
fn the_gradient_of_a_repeated_left_operand_sums_its_batches() {
    let e = eager();
    let cx = e.ctx(S);
    let a = cx.tensor(&[1.0; 12], &[3, 4]).unwrap();
    let b = cx.tensor(&[1.0; 16], &[2, 4, 2]).unwrap();
    assert_eq!(cx.matmul(&a, &b).unwrap().shape(), &[2, 3, 2]);
    let dy = cx.full(&[2, 3, 2], 1.0).unwrap();
    let da = cx.matmul_backward_lhs_of(&a, &b, &dy).unwrap();
    assert_eq!(da.shape(), a.shape());
    assert_eq!(da.to_host().unwrap(), vec![4.0; 12], "2 batches × 2 columns of ones");
    // Not repeated: the plain gradient.
    let a3 = cx.tensor(&[1.0; 24], &[2, 3, 4]).unwrap();
    let da3 = cx.matmul_backward_lhs_of(&a3, &b, &dy).unwrap();
    assert_eq!((da3.shape(), da3.to_host().unwrap()), (a3.shape(), vec![2.0; 24]));
}

/// AdamW's first step making its moments runs out of memory: nothing half made stays, and the
/// next step, with memory back, makes them all and succeeds.
#[test]
fn adamw_retries_its_first_step_after_running_out_of_memory() {
    let e: SimEager = Eager::sim(16 << 20).unwrap();
    let n = 1 << 18; // 1 MiB of f32
    let mut ps: Vec<Tensor<'static, _>> =
        (0..2).map(|_| Tensor::persistent_zeros(&e, &[n], S).unwrap()).collect();
    let gs: Vec<Tensor<'static, _>> = (0..2).map(|_| e.ctx(S).zeros(&[n]).unwrap()).collect();
    let mut hogs = Vec::new();
    while let Ok(t) = e.ctx(S).zeros(&[n]) {
        hogs.push(t);
    }
    hogs.truncate(hogs.len() - 2); // room for two of the four moments
    let mut opt = AdamW::new(0.01);
    let mut step = |opt: &mut AdamW<_>| {
        let mut refs: Vec<&mut Tensor<'static, _>> = ps.iter_mut().collect();
        opt.step(&mut refs, &gs.iter().collect::<Vec<_>>())
    };
    assert!(step(&mut opt).is_err());
    drop(hogs);
    step(&mut opt).unwrap();
    assert_eq!(opt.steps(), 1);
}

/// Next-token prediction on independent random tokens: nothing can beat ln V, so a block whose
/// attention saw the target (the next position) would learn to; with the causal mask its
/// held-out loss stays at ln V.
#[test]
fn attention_does_not_see_the_next_token() {
    let e = eager();
    let cfg = BlockConfig { vocab: 8, dim: 16, hidden: 32, batch: 4, seq: 8, eps: 1e-5 };
    let mut block = TransformerBlock::new(&e, cfg, 7, S).unwrap();
    let mut opt = AdamW::new(0.01);
    let mut rng = Rng::new(1);
    let n = cfg.batch * cfg.seq;
    let batch = |rng: &mut Rng| {
        let (mut ids, mut targets) = (Vec::new(), Vec::new());
        for _ in 0..cfg.batch {
            let seq: Vec<f32> = (0..=cfg.seq).map(|_| rng.below(cfg.vocab) as f32).collect();
            ids.extend_from_slice(&seq[..cfg.seq]);
            targets.extend_from_slice(&seq[1..]);
        }
        let cx = e.ctx(S);
        (cx.tensor(&ids, &[n]).unwrap(), cx.tensor(&targets, &[n]).unwrap())
    };
    for _ in 0..300 {
        let (ids, targets) = batch(&mut rng);
        let grads = {
            let step = e.step("step", S);
            block.forward_backward(&step.ctx(), &step.unscoped(), &ids, &targets).unwrap().grads
        };
        let refs: Vec<&Tensor<'static, _>> = grads.iter().collect();
        opt.step(&mut block.params_mut(), &refs).unwrap();
    }
    let mut total = 0.0;
    for _ in 0..20 {
        let (ids, targets) = batch(&mut rng);
        total += block.loss(&e.ctx(S), &ids, &targets).unwrap().to_host().unwrap()[0];
    }
    let (held_out, floor) = (total / 20.0, (cfg.vocab as f32).ln());
    assert!(held_out > 0.98 * floor, "held-out loss {held_out} below ln V = {floor}");
}

/// A tensor of another device (another engine, over a device of its own) given to an op is
/// refused with `AllocError::ForeignBuffer` — it was read at whatever this device held at its
/// address (`add` of 1s and 2s gave 2s: this device's own 1s twice). The engine works on
/// afterwards, and nothing leaks.
#[test]
fn tensors_of_another_device_are_refused() {
    use tidepool::AllocError;
    use tidepool_eager::{EagerError, Sgd};
    let foreign = |r: Result<(), EagerError>| {
        assert!(matches!(r, Err(EagerError::Alloc(AllocError::ForeignBuffer))), "{r:?}");
    };
    let (e1, e2) = (eager(), eager());
    let (c1, c2) = (e1.ctx(S), e2.ctx(S));
    let ones = c1.full(&[2, 2], 1.0).unwrap();
    let twos = c2.full(&[2, 2], 2.0).unwrap();
    foreign(c1.add(&ones, &twos).map(drop));
    foreign(c1.add(&twos, &ones).map(drop));
    foreign(c1.relu(&twos).map(drop));
    foreign(c1.matmul(&ones, &twos).map(drop));
    foreign(c1.cross_entropy(&twos, &c2.full(&[2], 0.0).unwrap()).map(drop));
    foreign(c1.wait_for(&twos));
    let mut p = Tensor::parameter(&e1, &[1.0; 4], &[2, 2], S).unwrap();
    foreign(Sgd::new(0.1).step(&mut [&mut p], &[&twos]));
    assert_eq!(p.to_host().unwrap(), vec![1.0; 4], "the parameter was updated");
    // This engine works on: its own operands are taken.
    assert_eq!(c1.add(&ones, &ones).unwrap().to_host().unwrap(), vec![2.0; 4]);
    drop((ones, p));
    assert_holds_nothing(&e1, false);
}

/// A step count is not reserved up front: `usize::MAX` steps overflowed the reports' capacity
/// (a panic; `tidepool demo --steps 4294967295` aborted asking for 480 GiB). The steps run —
/// here the first runs out of memory (its batch does not fit the device) and says so — and
/// the engine holds nothing but the model it made.
#[test]
fn a_huge_step_count_reserves_nothing_up_front() {
    use tidepool::AllocError;
    use tidepool_eager::EagerError;
    use tidepool_eager::models::train::{TrainConfig, train_mlp};
    let e = Eager::sim(3 << 20).unwrap();
    let cfg = TrainConfig { steps: usize::MAX, batch: 1 << 16, ..TrainConfig::default() };
    let mut steps = 0;
    let r = train_mlp(&e, &cfg, |_| steps += 1);
    assert!(matches!(r, Err(EagerError::Alloc(AllocError::OutOfMemory(_)))), "{r:?}");
    assert_eq!(steps, 0);
    assert_holds_nothing(&e, true);
}

/// `layer_norm_backward` with a gradient context of another engine (over a device of its own)
/// is refused with `AllocError::ForeignBuffer`: its `dgamma` and `dbeta` are that device's
/// addresses, which this device's kernel wrote as its own (memory it never handed out, or a
/// live tensor of its own at the same address). Nothing is written, nothing leaks.
#[test]
fn layer_norm_gradients_of_another_engine_are_refused() {
    use tidepool::AllocError;
    use tidepool_eager::EagerError;
    let (e1, e2) = (eager(), eager());
    let (c1, c2) = (e1.ctx(S), e2.ctx(S));
    let x = c1.tensor(&[1.0, 2.0, 3.0, 4.0], &[1, 4]).unwrap();
    let g = c1.full(&[4], 1.0).unwrap();
    let dy = c1.full(&[1, 4], 1.0).unwrap();
    // Both devices hand out the same addresses: e2's first blocks (the foreign dgamma and
    // dbeta) are where e1 keeps `x` and `g`, whose values must survive.
    let r = c1.layer_norm_backward(&c2, &x, &g, &dy, 1e-5);
    assert!(matches!(r, Err(EagerError::Alloc(AllocError::ForeignBuffer))), "{:?}", r.err());
    e1.synchronize().unwrap();
    e2.synchronize().unwrap();
    assert_eq!(x.to_host().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(g.to_host().unwrap(), vec![1.0; 4]);
    assert_eq!(e1.device().violations(), vec![]);
    assert_eq!(e1.device().kernel_failures(), vec![]);
    // The same call with this engine's own gradient context works.
    let (dx, dg, db) = c1.layer_norm_backward(&c1, &x, &g, &dy, 1e-5).unwrap();
    assert_eq!(db.to_host().unwrap(), vec![1.0; 4]);
    drop((dx, dg, db, x, g, dy));
    for e in [&e1, &e2] {
        assert_holds_nothing(e, false);
    }
}

/// `embedding_backward` whose gradient size (ids × the table's width) overflows is a shape
/// error, not an overflow panic (debug) or a wrapped size that matches an empty gradient
/// (release).
#[test]
fn an_embedding_gradient_whose_size_overflows_is_an_error() {
    let e = eager();
    let cx = e.ctx(S);
    let table = cx.tensor(&[], &[0, 1 << 42]).unwrap(); // no rows: nothing allocated
    let ids = cx.zeros(&[1 << 22]).unwrap(); // 2^22 · 2^42 = 2^64 gradient elements
    let dy = cx.tensor(&[], &[0]).unwrap();
    let r = cx.embedding_backward(&table, &ids, &dy);
    let err = r.expect_err("an overflowing gradient size was accepted");
    assert!(err.to_string().contains("embedding backward"), "{err}");
    e.synchronize().unwrap();
    assert_eq!(e.device().violations(), vec![]);
}

/// AdamW given a parameter whose shape is not its moments' (another model's, say) refuses the
/// step before updating anything: the parameters before the mismatch were updated and the step
/// counted, those after it not — half a step, with no way to tell from the error.
#[test]
fn adamw_refuses_a_mismatched_parameter_before_updating_any() {
    let e = eager();
    let mut p1 = Tensor::parameter(&e, &[1.0; 4], &[4], S).unwrap();
    let mut p2 = Tensor::parameter(&e, &[1.0; 2], &[2], S).unwrap();
    let g1 = e.ctx(S).full(&[4], 1.0).unwrap();
    let g2 = e.ctx(S).full(&[2], 1.0).unwrap();
    let mut opt = AdamW::new(0.1);
    opt.step(&mut [&mut p1, &mut p2], &[&g1, &g2]).unwrap();
    let after_one = p1.to_host().unwrap();
    assert_ne!(after_one, vec![1.0; 4]);
    let mut p3 = Tensor::parameter(&e, &[1.0; 3], &[3], S).unwrap();
    let g3 = e.ctx(S).full(&[3], 1.0).unwrap();
    let err = opt.step(&mut [&mut p1, &mut p3], &[&g1, &g3]).unwrap_err();
    assert_eq!(p1.to_host().unwrap(), after_one, "parameter 0 was updated");
    assert_eq!(opt.steps(), 1);
    assert_eq!(p3.to_host().unwrap(), vec![1.0; 3]);
    assert!(err.to_string().contains("parameter 1 is [3], its moments [2]"), "{err}");
    // The model it was set up for steps on.
    opt.step(&mut [&mut p1, &mut p2], &[&g1, &g2]).unwrap();
    assert_eq!(opt.steps(), 2);
    e.synchronize().unwrap();
    assert_eq!(e.device().violations(), vec![]);
}

/// `train_mlp` with a copy stream that fails (out of memory loading the first batch, or in the
/// first step's forward pass) destroys the stream it made before returning the error: it was
/// left on the device, with the allocator's cache for it, until the device went.
#[test]
fn training_that_fails_destroys_its_copy_stream() {
    use tidepool::AllocError;
    use tidepool_eager::EagerError;
    use tidepool_eager::models::train::{TrainConfig, train_mlp};
    // A batch too big to load; one that loads but whose activations do not fit.
    for batch in [1 << 16, 1 << 13] {
        let e = Eager::sim(3 << 20).unwrap();
        let cfg = TrainConfig { steps: 3, batch, two_streams: true, ..TrainConfig::default() };
        let mut steps = 0;
        let r = train_mlp(&e, &cfg, |_| steps += 1);
        assert!(matches!(r, Err(EagerError::Alloc(AllocError::OutOfMemory(_)))), "{r:?}");
        assert_eq!(steps, 0);
        assert_eq!(e.device().live_streams(), vec![S], "batch {batch}: the copy stream was left");
        assert_holds_nothing(&e, true);
        assert_eq!(e.device().violations(), vec![]);
    }
}

/// A product over an empty inner dimension (`[m, 0] · [0, n]`, each operand possibly stored
/// transposed) is `m × n` zeros on every back end. On CUDA, cuBLAS refused it
/// (`CUBLAS_STATUS_INVALID_VALUE`): a leading dimension of `k = 0` is below the `max(1, ·)` it
/// requires, though it is never used when `k` is 0.
#[test]
fn a_product_over_an_empty_inner_dimension_is_zeros() {
    fn check<B: tidepool_eager::Backend>(e: &Eager<B>) {
        let cx = e.ctx(S);
        drop(cx.full(&[6], 7.0).unwrap().to_host().unwrap()); // stale 7s in a freed block
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let a = cx.tensor(&[], if ta { &[0, 2] } else { &[2, 0] }).unwrap();
            let b = cx.tensor(&[], if tb { &[3, 0] } else { &[0, 3] }).unwrap();
            let y = cx.matmul_t(&a, &b, ta, tb).unwrap();
            assert_eq!(y.shape(), &[2, 3]);
            assert_eq!(y.to_host().unwrap(), vec![0.0; 6], "transposed: {ta}, {tb}");
        }
    }
    let e = eager();
    check(&e);
    assert_eq!(e.device().violations(), vec![]);
    assert_eq!(e.device().kernel_failures(), vec![]);
    #[cfg(feature = "cuda")]
    {
        use tidepool::{Config, CudaDevice};
        use tidepool_eager::CudaBackend;
        if let Some(reason) = CudaDevice::unavailable_reason() {
            println!("skipping the CUDA half: {reason}");
            return;
        }
        match CudaBackend::new(CudaDevice::new(0).unwrap()) {
            Ok(backend) => check(&Eager::new(backend, Config::default()).unwrap()),
            Err(err) => println!("skipping the CUDA half: {err}"),
        }
    }
}

/// An op refused for an operand of another device allocates nothing: its output was allocated
/// first and dropped, which in a step took a slot of the learned plan, so the step's next runs
/// fell back and learned again (two new device segments for one refused `add`). The step's plan
/// serves every later run as before, with no fallback and no device malloc.
#[test]
fn a_refused_op_allocates_nothing() {
    use tidepool::AllocError;
    use tidepool_eager::EagerError;
    let e = eager();
    let other = eager();
    let f = other.ctx(S).full(&[4, 4], 1.0).unwrap(); // another device's tensor
    let fc = other.ctx(S).full(&[4], 1.0).unwrap();
    let mut learned = None;
    for i in 0..8 {
        let step = e.step("step", S);
        let cx = step.ctx();
        let x = cx.full(&[4, 4], 1.0).unwrap();
        let g = cx.full(&[4], 1.0).unwrap();
        if i == 3 {
            let plan = |e: &SimEager| {
                let s = e.allocator().stats();
                (e.stats().scoped_allocs, s.plan_hits, s.plan_misses, s.plan_fallbacks)
            };
            let before = plan(&e);
            let refused = [
                cx.add(&x, &f).map(drop),
                cx.relu(&f).map(drop),
                cx.matmul(&x, &f).map(drop),
                cx.transpose(&f).map(drop),
                cx.softmax(&f).map(drop),
                cx.sum(&f).map(drop),
                cx.layer_norm(&x, &fc, &g, 1e-5).map(drop),
                cx.embedding(&x, &fc).map(drop),
                cx.cross_entropy(&x, &fc).map(drop),
            ];
            for (k, r) in refused.into_iter().enumerate() {
                assert!(matches!(r, Err(EagerError::Alloc(AllocError::ForeignBuffer))), "{k}");
            }
            assert_eq!(plan(&e), before, "a refused op allocated");
        }
        let y = cx.relu(&x).unwrap();
        let z = cx.add(&x, &y).unwrap();
        assert_eq!(z.to_host().unwrap(), vec![2.0; 16]);
        drop((x, g, y, z));
        drop(step);
        let s = e.allocator().stats();
        if i == 2 {
            learned = Some(s.num_device_alloc);
        }
        if i >= 2 {
            assert_eq!(s.plan_fallbacks, 0, "step {i}");
            assert_eq!(Some(s.num_device_alloc), learned, "step {i}");
        }
    }
    e.synchronize().unwrap();
    assert_eq!(e.device().violations(), vec![]);
}

/// AdamW given, after its first step, a parameter of another device or stream than the moments
/// it made for that position refuses the step before updating anything. Another device's
/// moments are addresses that mean nothing to the parameter's device: its kernel updated the
/// tensors that device keeps there (here two live parameters of the second engine, 5.0 and 6.0,
/// became 4.6 and 5.995). Moments of another stream were written on the parameter's stream with
/// no order against their own: freed with the optimizer, their blocks went to the next
/// allocations of their stream while the update still ran (the sanitizer's handouts and fills).
#[test]
fn adamw_refuses_a_parameter_of_another_device_or_stream_than_its_moments() {
    use tidepool::AllocError;
    use tidepool::device::{Device, Kernel, Launch};
    use tidepool_eager::EagerError;
    let (e1, e2) = (eager(), eager());
    let mut p1 = Tensor::parameter(&e1, &[1.0; 4], &[4], S).unwrap();
    let g1 = e1.ctx(S).full(&[4], 1.0).unwrap();
    let mut opt = AdamW::new(0.1);
    opt.step(&mut [&mut p1], &[&g1]).unwrap();
    let (m, v) = opt.moments(0).map(|(m, v)| (m.ptr(), v.ptr())).unwrap();

    // Another device: both devices hand out the same addresses, so the second engine's next
    // two parameters are where the first keeps the moments.
    let mut p2 = Tensor::parameter(&e2, &[1.0; 4], &[4], S).unwrap();
    let g2 = e2.ctx(S).full(&[4], 1.0).unwrap();
    let a = Tensor::parameter(&e2, &[5.0; 4], &[4], S).unwrap();
    let b = Tensor::parameter(&e2, &[6.0; 4], &[4], S).unwrap();
    assert_eq!((a.ptr(), b.ptr()), (m, v));
    let r = opt.step(&mut [&mut p2], &[&g2]);
    assert!(matches!(r, Err(EagerError::Alloc(AllocError::ForeignBuffer))), "{r:?}");
    assert_eq!((a.to_host().unwrap(), b.to_host().unwrap()), (vec![5.0; 4], vec![6.0; 4]));
    assert_eq!(p2.to_host().unwrap(), vec![1.0; 4]);
    assert_eq!(opt.steps(), 1);

    // Another stream of the same device, held by a gate so that its update cannot have run.
    let s2 = e1.device().create_stream().unwrap();
    let mut p3 = Tensor::parameter(&e1, &[1.0; 4], &[4], s2).unwrap();
    let g3 = e1.ctx(s2).full(&[4], 1.0).unwrap();
    e1.synchronize().unwrap();
    let (open, gate) = std::sync::mpsc::channel::<()>();
    let held = Kernel::new("gate", vec![], move |_| {
        let _ = gate.recv();
    });
    e1.device().launch(s2, held).unwrap();
    let err = opt.step(&mut [&mut p3], &[&g3]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "shape error: AdamW: parameter 0 is on stream 1, its moments on stream 0"
    );
    assert_eq!(opt.steps(), 1);
    drop(opt);
    // The moments' blocks, back in their stream's cache, go to its next two allocations.
    let next: Vec<_> = (0..2).map(|_| Tensor::persistent_zeros(&e1, &[4], S).unwrap()).collect();
    let mut got: Vec<_> = next.iter().map(|t| t.ptr()).collect();
    got.sort();
    assert_eq!(got, vec![m, v]);
    open.send(()).unwrap();
    e1.synchronize().unwrap();
    assert_eq!(e1.device().violations(), vec![]);
    assert_eq!(p3.to_host().unwrap(), vec![1.0; 4]);
    assert_eq!(next[0].to_host().unwrap(), vec![0.0; 4]);
    drop((p1, g1, p3, g3, next));
    e1.allocator().destroy_stream(s2).unwrap();
    assert_holds_nothing(&e1, true);
    drop((p2, g2, a, b));
    assert_holds_nothing(&e2, true);
}

/// The engine's counters count what was done: an allocation that ran out of memory (through a
/// step's scope or not), and a kernel, an upload or a download refused for a stream that is
/// gone, count nothing. Each was counted before it was tried, so a step that failed reported
/// allocations and kernels it never made.
#[test]
fn refused_work_is_not_counted() {
    use tidepool::device::Device;
    use tidepool_eager::{EagerStats, Sgd};
    let e = eager();
    let s2 = e.device().create_stream().unwrap();
    let mut p = Tensor::parameter(&e, &[1.0; 4], &[4], s2).unwrap();
    let g = e.ctx(s2).full(&[4], 1.0).unwrap();
    e.synchronize().unwrap();
    e.allocator().destroy_stream(s2).unwrap();
    let before = e.stats();
    assert_eq!(
        before,
        EagerStats { kernels: 1, uploads: 1, unscoped_allocs: 1, persistent_allocs: 1, ..before }
    );
    assert!(p.to_host().is_err());
    assert!(p.copy_from_host(&[2.0; 4]).is_err());
    assert!(Sgd::new(0.1).step(&mut [&mut p], &[&g]).is_err());
    assert!(e.ctx(S).zeros(&[1 << 30]).is_err(), "4 GiB on a 64 MiB device");
    {
        let step = e.step("step", S);
        assert!(step.ctx().zeros(&[1 << 30]).is_err());
    }
    assert_eq!(e.stats(), EagerStats { steps: 1, ..before });
    // What is done is counted.
    let x = e.ctx(S).full(&[4], 1.0).unwrap();
    assert_eq!(x.to_host().unwrap(), vec![1.0; 4]);
    let want = EagerStats { steps: 1, kernels: 2, downloads: 1, unscoped_allocs: 2, ..before };
    assert_eq!(e.stats(), want);
    drop((p, g, x));
    assert_holds_nothing(&e, true);
}

/// A `CudaBackend` holds one cuBLAS handle per stream that ran a product, and each handle holds
/// its CUDA stream: the handles of streams destroyed since go at the next stream's first
/// product (stream ids are never reused, so a kept one only leaked, with its stream). GPU only.
#[cfg(feature = "cuda")]
#[test]
fn cublas_handles_of_destroyed_streams_go() {
    use tidepool::{Config, CudaDevice, Device};
    use tidepool_eager::CudaBackend;
    if let Some(reason) = CudaDevice::unavailable_reason() {
        println!("skipping: {reason}");
        return;
    }
    let backend = match CudaBackend::new(CudaDevice::new(0).unwrap()) {
        Ok(backend) => backend,
        Err(err) => return println!("skipping: {err}"),
    };
    let e = Eager::new(backend, Config::default()).unwrap();
    for round in 0..4 {
        let s = e.device().create_stream().unwrap();
        {
            let cx = e.ctx(s);
            let a = cx.full(&[2, 3], 1.0).unwrap();
            let b = cx.full(&[3, 2], 2.0).unwrap();
            assert_eq!(cx.matmul(&a, &b).unwrap().to_host().unwrap(), vec![6.0; 4]);
        }
        // This round's stream's handle, and none of the streams destroyed before.
        assert_eq!(e.backend().blas_handles(), 1, "round {round}");
        e.allocator().synchronize().unwrap();
        e.allocator().destroy_stream(s).unwrap();
    }
    e.allocator().check_invariants().unwrap();
    assert_eq!(e.allocator().allocated_bytes(), 0);
}
