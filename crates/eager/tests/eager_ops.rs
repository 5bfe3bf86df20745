//! Every eager op on the host back end (SimDevice) against a plain CPU reference in f64, and a
//! finite-difference check of every backward op.
//!
//! Tolerances (documented, f32 device arithmetic against f64 references):
//! - forward ops: `|got − want| ≤ FWD_TOL · (1 + |want|)`, `FWD_TOL = 2e-5` (f32 rounding of
//!   sums of at most a few dozen terms);
//! - gradients: the scalar `L = Σ w ⊙ f(x)` (fixed random `w`) is differentiated by central
//!   differences of the device forward with step `FD_EPS = 1e-2` (in f64 over the downloaded
//!   outputs), and `|analytic − numeric| ≤ GRAD_TOL · (1 + |numeric|)`, `GRAD_TOL = 5e-3`
//!   (truncation O(eps²) plus f32 rounding of L divided by 2·eps).
//!
//! Every test ends by checking that the stream-order sanitizer found nothing and no kernel failed.

use tidepool::StreamId;
use tidepool_eager::models::data::Rng;
use tidepool_eager::models::transformer::{BlockConfig, TransformerBlock, token_batch};
use tidepool_eager::{AdamW, Ctx, Eager, HostBackend, Optimizer, Sgd, SimEager, Tensor};

const FWD_TOL: f64 = 2e-5;
const FD_EPS: f32 = 1e-2;
const GRAD_TOL: f64 = 5e-3;

type T<'t> = Tensor<'t, HostBackend>;
type C<'t> = Ctx<'t, HostBackend>;

fn eager() -> SimEager {
    Eager::sim(64 << 20).unwrap()
}

/// No sanitizer violation, no failed kernel.
fn clean(e: &SimEager) {
    e.synchronize().unwrap();
    assert_eq!(e.device().violations(), vec![]);
    assert_eq!(e.device().kernel_failures(), vec![]);
}

fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.range(-1.0, 1.0)).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Row-major matmul reference with optional transposes; a/b batched with strides (0 = shared).
#[allow(clippy::too_many_arguments)]
fn mm_ref(
    a: &[f32],
    b: &[f32],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    ta: bool,
    tb: bool,
    sa: usize,
    sb: usize,
) -> Vec<f64> {
    let mut out = vec![0.0; batch * m * n];
    for p in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for q in 0..k {
                    let av = if ta { a[p * sa + q * m + i] } else { a[p * sa + i * k + q] };
                    let bv = if tb { b[p * sb + j * k + q] } else { b[p * sb + q * n + j] };
                    s += av as f64 * bv as f64;
                }
                out[p * m * n + i * n + j] = s;
            }
        }
    }
    out
}

#[test]
fn elementwise_ops() {
    let e = eager();
    let cx = e.ctx(StreamId::DEFAULT);
    let (a, b, bias) = (rand(12, 1), rand(12, 2), rand(4, 3));
    let (ta, tb, tbias) = (
        cx.tensor(&a, &[3, 4]).unwrap(),
        cx.tensor(&b, &[3, 4]).unwrap(),
        cx.tensor(&bias, &[4]).unwrap(),
    );
    let want = |f: &dyn Fn(usize) -> f64| (0..12).map(f).collect::<Vec<f64>>();
    let add = cx.add(&ta, &tb).unwrap();
    close("add", &add.to_host().unwrap(), &want(&|i| a[i] as f64 + b[i] as f64), FWD_TOL);
    let addb = cx.add(&ta, &tbias).unwrap();
    close("add bias", &addb.to_host().unwrap(), &want(&|i| (a[i] + bias[i % 4]) as f64), FWD_TOL);
    let mul = cx.mul(&ta, &tb).unwrap();
    close("mul", &mul.to_host().unwrap(), &want(&|i| a[i] as f64 * b[i] as f64), FWD_TOL);
    let mulb = cx.mul(&ta, &tbias).unwrap();
    close(
        "mul bias",
        &mulb.to_host().unwrap(),
        &want(&|i| a[i] as f64 * bias[i % 4] as f64),
        FWD_TOL,
    );
    let sc = cx.scale(&ta, -2.5).unwrap();
    close("scale", &sc.to_host().unwrap(), &want(&|i| -2.5 * a[i] as f64), FWD_TOL);
    let relu = cx.relu(&ta).unwrap();
    close("relu", &relu.to_host().unwrap(), &want(&|i| (a[i] as f64).max(0.0)), FWD_TOL);
    let gelu = cx.gelu(&ta).unwrap();
    let g = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    };
    close("gelu", &gelu.to_host().unwrap(), &want(&|i| g(a[i] as f64)), FWD_TOL);
    assert_eq!(add.shape(), &[3, 4]);
    // Shape errors: a right operand that is not a suffix of the left's shape.
    let bad = cx.tensor(&[1.0, 2.0, 3.0], &[3]).unwrap();
    assert!(cx.add(&ta, &bad).is_err());
    assert!(cx.relu_backward(&ta, &bad).is_err());
    let z = cx.zeros(&[2, 2]).unwrap();
    assert_eq!(z.to_host().unwrap(), vec![0.0; 4]);
    let f = cx.full(&[3], 1.5).unwrap();
    assert_eq!(f.to_host().unwrap(), vec![1.5; 3]);
    clean(&e);
}

#[test]
fn matmul_and_transpose() {
    let e = eager();
    let cx = e.ctx(StreamId::DEFAULT);
    let (m, k, n) = (3, 5, 4);
    let a = rand(m * k, 10);
    let b = rand(k * n, 11);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let ad: &[usize] = if ta { &[k, m] } else { &[m, k] };
        let bd: &[usize] = if tb { &[n, k] } else { &[k, n] };
        let (x, y) = (cx.tensor(&a, ad).unwrap(), cx.tensor(&b, bd).unwrap());
        let c = cx.matmul_t(&x, &y, ta, tb).unwrap();
        assert_eq!(c.shape(), &[m, n]);
        let want = mm_ref(&a, &b, 1, m, k, n, ta, tb, 0, 0);
        close(&format!("matmul {ta} {tb}"), &c.to_host().unwrap(), &want, FWD_TOL);
    }
    // Batched, both operands batched.
    let (p, a3, b3) = (2, rand(2 * m * k, 12), rand(2 * k * n, 13));
    let (x, y) = (cx.tensor(&a3, &[p, m, k]).unwrap(), cx.tensor(&b3, &[p, k, n]).unwrap());
    let c = cx.matmul(&x, &y).unwrap();
    assert_eq!(c.shape(), &[p, m, n]);
    close(
        "batched",
        &c.to_host().unwrap(),
        &mm_ref(&a3, &b3, p, m, k, n, false, false, m * k, k * n),
        FWD_TOL,
    );
    // Batched left operand, shared right operand (a linear layer on [B, T, D]).
    let y2 = cx.tensor(&b, &[k, n]).unwrap();
    let c = cx.matmul(&x, &y2).unwrap();
    close(
        "broadcast rhs",
        &c.to_host().unwrap(),
        &mm_ref(&a3, &b, p, m, k, n, false, false, m * k, 0),
        FWD_TOL,
    );
    // Shared left operand, batched right operand.
    let x2 = cx.tensor(&a, &[m, k]).unwrap();
    let c = cx.matmul(&x2, &y).unwrap();
    close(
        "broadcast lhs",
        &c.to_host().unwrap(),
        &mm_ref(&a, &b3, p, m, k, n, false, false, 0, k * n),
        FWD_TOL,
    );
    // Errors.
    assert!(cx.matmul(&x2, &x2).is_err(), "inner dimensions differ");
    let y3 = cx.tensor(&rand(3 * k * n, 1), &[3, k, n]).unwrap();
    assert!(cx.matmul(&x, &y3).is_err(), "batch dimensions differ");
    // Transpose, 2-D and batched.
    let t = cx.transpose(&x).unwrap();
    assert_eq!(t.shape(), &[p, k, m]);
    let want: Vec<f64> = (0..p * k * m)
        .map(|i| {
            let (pp, r, c) = (i / (k * m), (i / m) % k, i % m);
            a3[pp * m * k + c * k + r] as f64
        })
        .collect();
    close("transpose", &t.to_host().unwrap(), &want, 0.0);
    assert!(cx.transpose(&cx.tensor(&[1.0], &[1]).unwrap()).is_err());
    clean(&e);
}

#[test]
fn softmax_layer_norm_reductions() {
    let e = eager();
    let cx = e.ctx(StreamId::DEFAULT);
    let (r, c) = (3, 5);
    let x: Vec<f32> = rand(r * c, 20).iter().map(|v| 3.0 * v).collect();
    let tx = cx.tensor(&x, &[r, c]).unwrap();
    let row = |i: usize| &x[i * c..(i + 1) * c];
    // Softmax.
    let mut want = Vec::new();
    for i in 0..r {
        let mx = row(i).iter().fold(f64::MIN, |m, &v| m.max(v as f64));
        let s: f64 = row(i).iter().map(|&v| (v as f64 - mx).exp()).sum();
        want.extend(row(i).iter().map(|&v| (v as f64 - mx).exp() / s));
    }
    close("softmax", &cx.softmax(&tx).unwrap().to_host().unwrap(), &want, FWD_TOL);
    // Layer norm.
    let (g, b) = (rand(c, 21), rand(c, 22));
    let (tg, tb) = (cx.tensor(&g, &[c]).unwrap(), cx.tensor(&b, &[c]).unwrap());
    let eps = 1e-5;
    let mut want = Vec::new();
    for i in 0..r {
        let mean = row(i).iter().map(|&v| v as f64).sum::<f64>() / c as f64;
        let var = row(i).iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
        for j in 0..c {
            want.push((row(i)[j] as f64 - mean) / (var + eps).sqrt() * g[j] as f64 + b[j] as f64);
        }
    }
    let ln = cx.layer_norm(&tx, &tg, &tb, eps as f32).unwrap();
    close("layer norm", &ln.to_host().unwrap(), &want, FWD_TOL);
    assert!(cx.layer_norm(&tx, &tx, &tb, 1e-5).is_err());
    // Sum, mean over the last dimension; sum over rows.
    let sums: Vec<f64> = (0..r).map(|i| row(i).iter().map(|&v| v as f64).sum()).collect();
    let s = cx.sum(&tx).unwrap();
    assert_eq!(s.shape(), &[r]);
    close("sum", &s.to_host().unwrap(), &sums, FWD_TOL);
    let means: Vec<f64> = sums.iter().map(|s| s / c as f64).collect();
    close("mean", &cx.mean(&tx).unwrap().to_host().unwrap(), &means, FWD_TOL);
    let cols: Vec<f64> = (0..c).map(|j| (0..r).map(|i| x[i * c + j] as f64).sum()).collect();
    close("sum_to", &cx.sum_to(&tg, &tx).unwrap().to_host().unwrap(), &cols, FWD_TOL);
    clean(&e);
}

#[test]
fn embedding_and_cross_entropy() {
    let e = eager();
    let cx = e.ctx(StreamId::DEFAULT);
    let (v, d) = (6, 3);
    let table = rand(v * d, 30);
    let ids = [4.0, 0.0, 4.0, 5.0];
    let (tt, ti) = (cx.tensor(&table, &[v, d]).unwrap(), cx.tensor(&ids, &[2, 2]).unwrap());
    let emb = cx.embedding(&tt, &ti).unwrap();
    assert_eq!(emb.shape(), &[2, 2, d]);
    let want: Vec<f64> =
        ids.iter().flat_map(|&i| f64s(&table[i as usize * d..(i as usize + 1) * d])).collect();
    close("embedding", &emb.to_host().unwrap(), &want, 0.0);
    let (r, c) = (4, 5);
    let logits: Vec<f32> = rand(r * c, 31).iter().map(|x| 2.0 * x).collect();
    let targets = [1.0, 4.0, 0.0, 1.0];
    let (tl, tt) = (cx.tensor(&logits, &[r, c]).unwrap(), cx.tensor(&targets, &[r]).unwrap());
    let mut want = 0.0;
    for i in 0..r {
        let row = &logits[i * c..(i + 1) * c];
        let lse = row.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        want += lse - row[targets[i] as usize] as f64;
    }
    let loss = cx.cross_entropy(&tl, &tt).unwrap();
    assert_eq!(loss.shape(), &[1]);
    close("cross entropy", &loss.to_host().unwrap(), &[want / r as f64], FWD_TOL);
    let t22 = cx.tensor(&targets, &[2, 2]).unwrap();
    assert!(cx.cross_entropy(&tl, &t22).is_ok(), "4 targets for 4 rows, any shape");
    assert!(cx.cross_entropy(&tl, &cx.tensor(&[0.0], &[1]).unwrap()).is_err());
    clean(&e);
}

#[test]
fn optimizers_update_in_place() {
    let e = eager();
    let s = StreamId::DEFAULT;
    let (p0, g) = (rand(6, 40), rand(6, 41));
    let mut p = Tensor::parameter(&e, &p0, &[2, 3], s).unwrap();
    let tg = e.ctx(s).tensor(&g, &[2, 3]).unwrap();
    let (before, ptr) = (e.allocator().stats().num_device_alloc, p.ptr());
    let mut sgd = Sgd { lr: 0.1, weight_decay: 0.5 };
    sgd.step(&mut [&mut p], &[&tg]).unwrap();
    let want: Vec<f64> =
        (0..6).map(|i| p0[i] as f64 - 0.1 * (g[i] as f64 + 0.5 * p0[i] as f64)).collect();
    close("sgd", &p.to_host().unwrap(), &want, FWD_TOL);
    assert_eq!((p.ptr(), e.allocator().stats().num_device_alloc), (ptr, before), "in place");
    // AdamW, two steps, against the formula in f64.
    let mut q = Tensor::parameter(&e, &p0, &[2, 3], s).unwrap();
    let mut adam = AdamW::new(0.05);
    adam.step(&mut [&mut q], &[&tg]).unwrap();
    adam.step(&mut [&mut q], &[&tg]).unwrap();
    let (b1, b2, eps, wd, lr) = (0.9f64, 0.999f64, 1e-8f64, 0.01f64, 0.05f64);
    let want: Vec<f64> = (0..6)
        .map(|i| {
            let (mut x, gi, mut m, mut v) = (p0[i] as f64, g[i] as f64, 0.0, 0.0);
            for t in 1..=2 {
                m = b1 * m + (1.0 - b1) * gi;
                v = b2 * v + (1.0 - b2) * gi * gi;
                let upd = (m / (1.0 - b1.powi(t))) / ((v / (1.0 - b2.powi(t))).sqrt() + eps);
                x -= lr * (upd + wd * x);
            }
            x
        })
        .collect();
    close("adamw", &q.to_host().unwrap(), &want, 1e-4);
    assert_eq!(adam.steps(), 2);
    let (m, _) = adam.moments(0).unwrap();
    assert_eq!(m.residency(), tidepool::Residency::Persistent, "optimizer state is persistent");
    assert_eq!(q.residency(), tidepool::Residency::Persistent);
    assert!(sgd.step(&mut [&mut q], &[]).is_err(), "one gradient per parameter");
    clean(&e);
}

/// Checks the gradient `backward` gives for input `which` against central differences of
/// `forward` (see the module docs for the scalar and the tolerance).
fn grad_check(
    name: &str,
    inputs: &[(Vec<f32>, Vec<usize>)],
    which: usize,
    forward: &dyn Fn(&C<'static>, &[T<'static>]) -> T<'static>,
    backward: &dyn Fn(&C<'static>, &[T<'static>], &T<'static>) -> T<'static>,
) {
    let e = eager();
    let cx = e.ctx(StreamId::DEFAULT);
    let make = |vals: &[(Vec<f32>, Vec<usize>)]| -> Vec<T<'static>> {
        vals.iter().map(|(d, s)| cx.tensor(d, s).unwrap()).collect()
    };
    let ts = make(inputs);
    let out = forward(&cx, &ts);
    let w = rand(out.numel(), 99);
    let scalar = |vals: &[(Vec<f32>, Vec<usize>)]| -> f64 {
        let y = forward(&cx, &make(vals)).to_host().unwrap();
        y.iter().zip(&w).map(|(&a, &b)| a as f64 * b as f64).sum()
    };
    let dy = cx.tensor(&w, out.shape()).unwrap();
    let analytic = backward(&cx, &ts, &dy).to_host().unwrap();
    assert_eq!(analytic.len(), inputs[which].0.len(), "{name}: gradient size");
    for (j, &a) in analytic.iter().enumerate() {
        let mut plus = inputs.to_vec();
        plus[which].0[j] += FD_EPS;
        let mut minus = inputs.to_vec();
        minus[which].0[j] -= FD_EPS;
        let numeric = (scalar(&plus) - scalar(&minus)) / (2.0 * FD_EPS as f64);
        let a = a as f64;
        assert!(
            (a - numeric).abs() <= GRAD_TOL * (1.0 + numeric.abs()),
            "{name}: d/dx[{j}] analytic {a}, numeric {numeric}"
        );
    }
    clean(&e);
}

/// Input values and their shape.
type Input = (Vec<f32>, Vec<usize>);

fn inp(n: &[usize], seed: u64) -> Input {
    (rand(n.iter().product(), seed), n.to_vec())
}

#[test]
fn gradients_of_elementwise_ops() {
    let ab = [inp(&[3, 4], 1), inp(&[3, 4], 2)];
    let abias = [inp(&[3, 4], 1), inp(&[4], 3)];
    grad_check("add lhs", &ab, 0, &|c, t| c.add(&t[0], &t[1]).unwrap(), &|c, _, dy| {
        c.scale(dy, 1.0).unwrap()
    });
    grad_check("add bias", &abias, 1, &|c, t| c.add(&t[0], &t[1]).unwrap(), &|c, t, dy| {
        c.add_backward_rhs(&t[1], dy).unwrap()
    });
    for (name, ins) in [("mul", &ab), ("mul bias", &abias)] {
        for which in 0..2 {
            grad_check(name, ins, which, &|c, t| c.mul(&t[0], &t[1]).unwrap(), &|c, t, dy| {
                let (da, db) = c.mul_backward(&t[0], &t[1], dy).unwrap();
                if which == 0 { da } else { db }
            });
        }
    }
    let x = [inp(&[2, 5], 4)];
    grad_check("scale", &x, 0, &|c, t| c.scale(&t[0], 0.7).unwrap(), &|c, _, dy| {
        c.scale_backward(dy, 0.7).unwrap()
    });
    // ReLU away from its kink: |x| ≥ 0.1 > FD_EPS.
    let xr = vec![(
        rand(10, 5).iter().map(|v| if *v >= 0.0 { v + 0.1 } else { v - 0.1 }).collect(),
        vec![2, 5],
    )];
    grad_check("relu", &xr, 0, &|c, t| c.relu(&t[0]).unwrap(), &|c, t, dy| {
        c.relu_backward(&t[0], dy).unwrap()
    });
    grad_check("gelu", &x, 0, &|c, t| c.gelu(&t[0]).unwrap(), &|c, t, dy| {
        c.gelu_backward(&t[0], dy).unwrap()
    });
}

#[test]
fn gradients_of_matmul_and_transpose() {
    let cases: [(&str, [Input; 2]); 3] = [
        ("2-D", [inp(&[3, 4], 1), inp(&[4, 2], 2)]),
        ("batched", [inp(&[2, 3, 4], 3), inp(&[2, 4, 2], 4)]),
        ("shared rhs", [inp(&[2, 3, 4], 5), inp(&[4, 2], 6)]),
    ];
    for (name, ins) in &cases {
        grad_check(name, ins, 0, &|c, t| c.matmul(&t[0], &t[1]).unwrap(), &|c, t, dy| {
            c.matmul_backward_lhs(&t[1], dy).unwrap()
        });
        grad_check(name, ins, 1, &|c, t| c.matmul(&t[0], &t[1]).unwrap(), &|c, t, dy| {
            c.matmul_backward_rhs(&t[0], &t[1], dy).unwrap()
        });
    }
    grad_check(
        "transpose",
        &[inp(&[2, 3, 4], 7)],
        0,
        &|c, t| c.transpose(&t[0]).unwrap(),
        &|c, _, dy| c.transpose(dy).unwrap(),
    );
}

#[test]
fn gradients_of_norms_and_reductions() {
    let x = [inp(&[3, 5], 1)];
    grad_check("softmax", &x, 0, &|c, t| c.softmax(&t[0]).unwrap(), &|c, t, dy| {
        let y = c.softmax(&t[0]).unwrap();
        c.softmax_backward(&y, dy).unwrap()
    });
    let ln = [inp(&[3, 5], 2), inp(&[5], 3), inp(&[5], 4)];
    for which in 0..3 {
        grad_check(
            "layer norm",
            &ln,
            which,
            &|c, t| c.layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap(),
            &|c, t, dy| {
                let (dx, dg, db) = c.layer_norm_backward(c, &t[0], &t[1], dy, 1e-5).unwrap();
                [dx, dg, db].into_iter().nth(which).unwrap()
            },
        );
    }
    grad_check("sum", &x, 0, &|c, t| c.sum(&t[0]).unwrap(), &|c, t, dy| {
        c.sum_backward(&t[0], dy).unwrap()
    });
    grad_check("mean", &x, 0, &|c, t| c.mean(&t[0]).unwrap(), &|c, t, dy| {
        c.mean_backward(&t[0], dy).unwrap()
    });
}

#[test]
fn gradients_of_embedding_and_cross_entropy() {
    let emb = [inp(&[5, 3], 1), (vec![4.0, 1.0, 4.0, 0.0], vec![4])];
    grad_check("embedding", &emb, 0, &|c, t| c.embedding(&t[0], &t[1]).unwrap(), &|c, t, dy| {
        c.embedding_backward(&t[0], &t[1], dy).unwrap()
    });
    // The loss is a scalar: dy = w[0] scales the gradient of the mean loss.
    let ce = [inp(&[4, 5], 2), (vec![1.0, 4.0, 0.0, 2.0], vec![4])];
    grad_check(
        "cross entropy",
        &ce,
        0,
        &|c, t| c.cross_entropy(&t[0], &t[1]).unwrap(),
        &|c, t, dy| {
            let g = c.cross_entropy_backward(&t[0], &t[1]).unwrap();
            let w = dy.to_host().unwrap()[0];
            c.scale(&g, w).unwrap()
        },
    );
}

/// The whole transformer block: the gradient of every parameter (three elements each) against
/// central differences of the block's loss.
#[test]
fn transformer_block_gradients() {
    let e = eager();
    let s = StreamId::DEFAULT;
    let cfg = BlockConfig { vocab: 7, dim: 4, hidden: 8, batch: 2, seq: 3, eps: 1e-5 };
    let mut block = TransformerBlock::new(&e, cfg, 5, s).unwrap();
    let (ids, targets) = token_batch(&cfg, &mut Rng::new(9));
    let n = cfg.batch * cfg.seq;
    let cx = e.ctx(s);
    let (ti, tt) = (cx.tensor(&ids, &[n]).unwrap(), cx.tensor(&targets, &[n]).unwrap());
    let grads: Vec<Vec<f32>> = {
        let step = e.step("check", s);
        let p = block.forward_backward(&step.ctx(), &step.unscoped(), &ti, &tt).unwrap();
        p.grads.iter().map(|g| g.to_host().unwrap()).collect()
    };
    let loss = |block: &TransformerBlock<HostBackend>| -> f64 {
        block.loss(&cx, &ti, &tt).unwrap().to_host().unwrap()[0] as f64
    };
    let mut rng = Rng::new(1);
    for (pi, grad) in grads.iter().enumerate() {
        for _ in 0..3 {
            let j = rng.below(grad.len());
            let orig = block.params_mut()[pi].to_host().unwrap();
            let mut numeric = 0.0;
            for sign in [1.0f32, -1.0] {
                let mut v = orig.clone();
                v[j] += sign * FD_EPS;
                block.params_mut()[pi].copy_from_host(&v).unwrap();
                numeric += sign as f64 * loss(&block);
            }
            numeric /= 2.0 * FD_EPS as f64;
            block.params_mut()[pi].copy_from_host(&orig).unwrap();
            let a = grad[j] as f64;
            assert!(
                (a - numeric).abs() <= GRAD_TOL * (1.0 + numeric.abs()),
                "parameter {pi}[{j}]: analytic {a}, numeric {numeric}"
            );
        }
    }
    clean(&e);
}
