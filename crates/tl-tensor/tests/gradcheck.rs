//! Every differentiable op of tl-tensor, checked against f64 central finite differences on
//! random inputs (several seeds, broadcasting shapes), through `tl_tensor::testing`.
//!
//! Inputs are placed where the op is smooth: positive for log/sqrt/rsqrt, away from 0 for
//! relu/abs and for divisors; random normals make ties of `max_axis` improbable.

use ndarray::{ArrayD, IxDyn};
use tl_tensor::testing::{assert_gradients, random_array, random_away_from_zero, random_uniform};
use tl_tensor::{Generator, Tensor};

const SEEDS: [u64; 3] = [1, 2, 3];

/// The broadcasting pairs every binary op is checked on.
const BROADCAST_PAIRS: [(&[usize], &[usize]); 6] = [
    (&[2, 3, 4], &[2, 3, 4]),
    (&[2, 3, 4], &[3, 1]),
    (&[2, 3, 4], &[4]),
    (&[2, 3, 4], &[1, 1, 4]),
    (&[3, 1], &[2, 1, 4]),
    (&[], &[2, 3]),
];

/// A one-input slice without cloning the input.
fn one(input: &ArrayD<f64>) -> &[ArrayD<f64>] {
    std::slice::from_ref(input)
}

type BinaryOp = fn(&Tensor<f64>, &Tensor<f64>) -> Tensor<f64>;

#[test]
fn binary_arithmetic_with_broadcasting() {
    let ops: [(&str, BinaryOp); 4] = [
        ("add", |a, b| a + b),
        ("sub", |a, b| a - b),
        ("mul", |a, b| a * b),
        ("div", |a, b| a / b),
    ];
    for seed in SEEDS {
        let rng = Generator::new(seed);
        for (lhs_shape, rhs_shape) in BROADCAST_PAIRS {
            for (name, op) in ops {
                let lhs = random_array(lhs_shape, &rng);
                // Divisors stay away from 0, where 1/x explodes.
                let rhs = random_away_from_zero(rhs_shape, 0.5, &rng);
                eprintln!("{name} {lhs_shape:?} {rhs_shape:?} seed {seed}");
                assert_gradients(|x| op(&x[0], &x[1]), &[lhs.clone(), rhs.clone()]);
                // Swapped, so the broadcast operand is also the left one.
                assert_gradients(|x| op(&x[1], &x[0]), &[lhs, rhs]);
            }
        }
    }
}

#[test]
fn a_tensor_combined_with_itself() {
    // x·x, x/x and x−x route two gradients into one input.
    let x = random_away_from_zero(&[3, 2], 0.5, &Generator::new(4));
    assert_gradients(|x| &(&x[0] * &x[0]) + &(&x[0] / &x[0]), one(&x));
    assert_gradients(|x| (&x[0] - &x[0]).mul_scalar(2.0), &[x]);
}

#[test]
fn scalar_forms_and_negation() {
    let rng = Generator::new(5);
    let x = random_array(&[2, 3], &rng);
    assert_gradients(|x| -&x[0], one(&x));
    assert_gradients(|x| x[0].add_scalar(1.5), one(&x));
    assert_gradients(|x| x[0].mul_scalar(-2.5), one(&x));
    assert_gradients(|x| x[0].div_scalar(4.0), one(&x));
    assert_gradients(|x| x[0].rsub_scalar(3.0), one(&x));
    assert_gradients(|x| 2.0 * &(3.0 - &(&x[0] / 2.0)), &[x]);
}

#[test]
fn smooth_unary_functions_on_the_real_line() {
    type Unary = fn(&Tensor<f64>) -> Tensor<f64>;
    let ops: [(&str, Unary); 5] = [
        ("exp", Tensor::exp),
        ("tanh", Tensor::tanh),
        ("sigmoid", Tensor::sigmoid),
        ("silu", Tensor::silu),
        ("gelu", Tensor::gelu),
    ];
    for seed in SEEDS {
        let x = random_array(&[3, 4], &Generator::new(seed)).mapv(|v| 2.0 * v);
        for (name, op) in ops {
            eprintln!("{name} seed {seed}");
            assert_gradients(|x| op(&x[0]), one(&x));
        }
    }
}

#[test]
fn unary_functions_of_positive_inputs() {
    for seed in SEEDS {
        let x = random_uniform(&[3, 4], 0.3, 3.0, &Generator::new(seed));
        assert_gradients(|x| x[0].log(), one(&x));
        assert_gradients(|x| x[0].sqrt(), one(&x));
        assert_gradients(|x| x[0].rsqrt(), one(&x));
        for n in [-2, 0, 1, 2, 3] {
            assert_gradients(|x| x[0].powi(n), one(&x));
        }
    }
}

#[test]
fn kinked_functions_away_from_their_kink() {
    for seed in SEEDS {
        let x = random_away_from_zero(&[3, 4], 0.1, &Generator::new(seed));
        assert_gradients(|x| x[0].relu(), one(&x));
        assert_gradients(|x| x[0].abs(), one(&x));
        // Integer powers cross 0 smoothly.
        assert_gradients(|x| x[0].powi(3), &[x]);
    }
}

#[test]
fn sums_and_means() {
    for seed in SEEDS {
        let x = random_array(&[2, 3, 4], &Generator::new(seed));
        assert_gradients(|x| x[0].sum_all(), one(&x));
        assert_gradients(|x| x[0].mean_all(), one(&x));
        for keep_dims in [false, true] {
            for axes in [&[0][..], &[1], &[2], &[0, 2], &[2, 0, 1]] {
                assert_gradients(|x| x[0].sum_axes(axes, keep_dims), one(&x));
                assert_gradients(|x| x[0].mean_axes(axes, keep_dims), one(&x));
            }
        }
    }
}

#[test]
fn max_along_each_axis() {
    for seed in SEEDS {
        let x = random_array(&[2, 3, 4], &Generator::new(seed));
        for axis in 0..3 {
            for keep_dims in [false, true] {
                assert_gradients(|x| x[0].max_axis(axis, keep_dims), one(&x));
            }
        }
    }
}

#[test]
fn reshape_permute_and_transpose() {
    let x = random_array(&[2, 3, 4], &Generator::new(6));
    assert_gradients(|x| x[0].reshape(&[6, 4]), one(&x));
    assert_gradients(|x| x[0].reshape(&[24]), one(&x));
    assert_gradients(|x| x[0].permute(&[2, 0, 1]), one(&x));
    assert_gradients(|x| x[0].transpose(0, 2), one(&x));
    // A layout change followed by an op that sees the new layout.
    let weights = Tensor::from_array(random_array(&[4, 2, 3], &Generator::new(7)));
    assert_gradients(|x| &x[0].permute(&[2, 0, 1]) * &weights, &[x]);
}

#[test]
fn matmul_with_batches_and_transposes() {
    let cases: [(&[usize], &[usize]); 6] = [
        (&[2, 3], &[3, 4]),
        (&[2, 3, 4], &[4, 5]),
        (&[3, 4], &[2, 4, 5]),
        (&[2, 1, 3, 4], &[5, 4, 2]),
        (&[1, 3], &[3, 1]),
        (&[2, 2, 3], &[2, 3, 2]),
    ];
    for seed in SEEDS {
        let rng = Generator::new(seed);
        for (lhs_shape, rhs_shape) in cases {
            let (lhs, rhs) = (random_array(lhs_shape, &rng), random_array(rhs_shape, &rng));
            assert_gradients(|x| x[0].matmul(&x[1]), &[lhs, rhs]);
        }
        // Transposed operands: Aᵀ·B, A·Bᵀ, and batched Aᵀ·Bᵀ.
        let a = random_array(&[4, 3], &rng);
        let b = random_array(&[4, 5], &rng);
        assert_gradients(|x| x[0].transpose(0, 1).matmul(&x[1]), &[a, b]);
        let a = random_array(&[3, 4], &rng);
        let b = random_array(&[5, 4], &rng);
        assert_gradients(|x| x[0].matmul(&x[1].transpose(0, 1)), &[a, b]);
        let a = random_array(&[2, 4, 3], &rng);
        let b = random_array(&[2, 5, 4], &rng);
        assert_gradients(
            |x| x[0].transpose(1, 2).matmul(&x[1].transpose(1, 2)),
            &[a, b],
        );
    }
}

#[test]
fn matmul_plain_matches_its_gradients() {
    let rng = Generator::new(8);
    let (a, b) = (random_array(&[2, 3, 4], &rng), random_array(&[4, 2], &rng));
    assert_gradients(|x| x[0].matmul_plain(&x[1]), &[a, b]);
}

#[test]
fn softmax_and_log_softmax_along_each_axis() {
    for seed in SEEDS {
        let x = random_array(&[2, 3, 4], &Generator::new(seed)).mapv(|v| 3.0 * v);
        for axis in 0..3 {
            assert_gradients(|x| x[0].softmax(axis), one(&x));
            assert_gradients(|x| x[0].log_softmax(axis), one(&x));
        }
    }
}

#[test]
fn narrow_and_concat() {
    for seed in SEEDS {
        let rng = Generator::new(seed);
        let x = random_array(&[3, 4, 5], &rng);
        for (axis, start, len) in [(0, 1, 2), (1, 0, 1), (2, 2, 3), (1, 0, 4)] {
            assert_gradients(|x| x[0].narrow(axis, start, len), one(&x));
        }
        let pieces = [
            random_array(&[2, 1, 3], &rng),
            random_array(&[2, 4, 3], &rng),
            random_array(&[2, 2, 3], &rng),
        ];
        assert_gradients(|x| Tensor::concat(&[&x[0], &x[1], &x[2]], 1), &pieces);
        // One tensor twice, and a single piece.
        assert_gradients(|x| Tensor::concat(&[&x[0], &x[0]], 2), &pieces[..1]);
        assert_gradients(|x| Tensor::concat(&[&x[0]], 0), &pieces[..1]);
    }
}

#[test]
fn masked_fill_with_a_broadcast_causal_mask() {
    let causal = ArrayD::from_shape_fn(IxDyn(&[3, 3]), |ix| ix[1] > ix[0]);
    for seed in SEEDS {
        let scores = random_array(&[2, 3, 3], &Generator::new(seed));
        assert_gradients(|x| x[0].masked_fill(&causal, -1e9), one(&scores));
        // The attention pattern: masked to −∞, then softmax over the keys.
        assert_gradients(
            |x| x[0].masked_fill(&causal, f64::NEG_INFINITY).softmax(2),
            &[scores],
        );
    }
}

#[test]
fn gather_rows_with_repeated_ids() {
    for seed in SEEDS {
        let table = random_array(&[5, 3], &Generator::new(seed));
        assert_gradients(|x| x[0].gather_rows(&[4, 0, 4, 2, 4]), one(&table));
        assert_gradients(|x| x[0].gather_rows(&[]), &[table]);
    }
}

#[test]
fn composite_transformer_pieces() {
    let rng = Generator::new(9);
    // RMSNorm: x · rsqrt(mean(x², last axis) + ε) · w.
    let x = random_array(&[2, 3, 4], &rng);
    let w = random_array(&[4], &rng);
    assert_gradients(
        |p| {
            let scale = p[0].powi(2).mean_axes(&[2], true).add_scalar(1e-5).rsqrt();
            &(&p[0] * &scale) * &p[1]
        },
        &[x, w],
    );
    // Causal single-head attention: softmax(mask(q·kᵀ/√d)) · v.
    let (q, k, v) = (
        random_array(&[2, 3, 4], &rng),
        random_array(&[2, 3, 4], &rng),
        random_array(&[2, 3, 4], &rng),
    );
    let causal = ArrayD::from_shape_fn(IxDyn(&[3, 3]), |ix| ix[1] > ix[0]);
    assert_gradients(
        |p| {
            let scores = p[0].matmul(&p[1].transpose(1, 2)).div_scalar(2.0);
            let weights = scores.masked_fill(&causal, f64::NEG_INFINITY).softmax(2);
            weights.matmul(&p[2])
        },
        &[q, k, v],
    );
    // SwiGLU: (silu(x·W₁) ⊙ x·W₃)·W₂.
    let x = random_array(&[3, 4], &rng);
    let (w1, w2, w3) = (
        random_array(&[4, 5], &rng),
        random_array(&[5, 4], &rng),
        random_array(&[4, 5], &rng),
    );
    assert_gradients(
        |p| (&p[0].matmul(&p[1]).silu() * &p[0].matmul(&p[3])).matmul(&p[2]),
        &[x, w1, w2, w3],
    );
    // Cross-entropy of an embedding lookup: −mean(log_softmax(E[ids]·Wᵀ)[targets]).
    let (table, head) = (random_array(&[6, 4], &rng), random_array(&[6, 4], &rng));
    let targets = ArrayD::from_shape_fn(IxDyn(&[3, 6]), |ix| ix[1] == [2, 5, 0][ix[0]]);
    let picked = Tensor::from_array(targets.mapv(|t| if t { 1.0 } else { 0.0 }));
    assert_gradients(
        |p| {
            let logits = p[0].gather_rows(&[1, 3, 1]).matmul(&p[1].transpose(0, 1));
            (&logits.log_softmax(1) * &picked)
                .sum_all()
                .neg()
                .div_scalar(3.0)
        },
        &[table, head],
    );
}
