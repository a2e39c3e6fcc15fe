//! `checkpoint` on its own: arguments, grad mode, parents, and gradients against finite
//! differences.

use std::cell::Cell;
use std::rc::Rc;
use std::slice::from_ref;
use std::sync::Arc;

use tl_recompute::checkpoint;
use tl_tensor::ndarray::arr1;
use tl_tensor::testing::{
    GradcheckOptions, check_gradients, check_parameter_gradients, random_array,
};
use tl_tensor::{Generator, MatmulHook, Tensor, no_grad, set_matmul_hook};

use crate::common::data;

fn param(values: &[f64]) -> Tensor<f64> {
    Tensor::param(arr1(values).into_dyn())
}

#[test]
fn a_tensor_passed_twice_gets_one_gradient_per_use() {
    // f(a, b) = a ⊙ b² with a = b = x: d/dx = x² + 2x·x = 3x².
    let x = param(&[1.5, -2.0]);
    let y = checkpoint(
        |xs| &xs[0] * &(&xs[1] * &xs[1]),
        &[x.clone(), x.clone()],
        &[],
        &[],
    );
    y.sum_all().backward();
    // 3 · 1.5² = 6.75, 3 · (−2)² = 12 (one shared leaf copy would give twice that).
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[6.75, 12.0]);
}

#[test]
fn a_number_argument_lives_in_the_closure() {
    let x = param(&[1.0, 4.0]);
    let scale = 2.5;
    let y = checkpoint(move |xs| xs[0].mul_scalar(scale), from_ref(&x), &[], &[]);
    assert_eq!(y.to_vec(), [2.5, 10.0]);
    y.sum_all().backward();
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[2.5, 2.5]);
}

#[test]
fn under_no_grad_it_is_one_plain_call() {
    let calls = Rc::new(Cell::new(0));
    let counter = Rc::clone(&calls);
    let x = param(&[3.0]);
    let y = {
        let _off = no_grad();
        checkpoint(
            move |xs| {
                counter.set(counter.get() + 1);
                xs[0].mul_scalar(2.0)
            },
            from_ref(&x),
            &[],
            &[],
        )
    };
    assert_eq!(y.item(), 6.0);
    assert!(!y.requires_grad());
    assert_eq!(calls.get(), 1);
}

#[test]
fn a_plain_call_returns_what_f_returns() {
    // Under no_grad, or with nothing requiring grad, no node is made: the result is f's own
    // output (here its input itself), not a copy behind a checkpoint node.
    let x = param(&[1.0, 2.0]);
    let y = {
        let _off = no_grad();
        checkpoint(|xs| xs[0].clone(), from_ref(&x), &[], &[])
    };
    assert!(y.same(&x));
    let data = data::<f64>(&[2], 8);
    assert!(checkpoint(|xs| xs[0].clone(), from_ref(&data), &[], &[]).same(&data));
}

#[test]
fn with_nothing_requiring_grad_it_is_one_plain_call() {
    let calls = Rc::new(Cell::new(0));
    let counter = Rc::clone(&calls);
    let x = data::<f64>(&[2], 1);
    let y = checkpoint(
        move |xs| {
            counter.set(counter.get() + 1);
            xs[0].tanh()
        },
        from_ref(&x),
        &[],
        &[],
    );
    assert!(!y.requires_grad());
    assert_eq!(calls.get(), 1);
    assert_eq!(y.to_vec(), x.tanh().to_vec());
}

#[test]
fn parameters_read_by_f_learn_from_a_data_input() {
    // y = tanh(x·w) with data x: only w can make the node require grad.
    let x = data::<f64>(&[3, 2], 2);
    let w = Tensor::param(random_array(&[2, 2], &Generator::new(3)));
    let weight = w.clone();
    let y = checkpoint(
        move |xs| xs[0].matmul(&weight).tanh(),
        from_ref(&x),
        from_ref(&w),
        &[],
    );
    assert!(y.requires_grad());
    y.sum_all().backward();
    let checkpointed = w.grad().unwrap();
    w.zero_grad();
    x.matmul(&w).tanh().sum_all().backward();
    assert_eq!(checkpointed, w.grad().unwrap());
}

#[test]
fn input_gradients_match_finite_differences() {
    let rng = Generator::new(4);
    let inputs = [random_array(&[3, 2], &rng), random_array(&[2, 4], &rng)];
    let result = check_gradients(
        |p| {
            checkpoint(
                |xs| xs[0].matmul(&xs[1]).tanh(),
                &[p[0].clone(), p[1].clone()],
                &[],
                &[],
            )
        },
        &inputs,
        GradcheckOptions::default(),
    );
    assert!(result.is_ok(), "{}", result.unwrap_err());
}

#[test]
fn parameter_gradients_match_finite_differences() {
    let rng = Generator::new(5);
    let x = Tensor::from_array(random_array(&[4, 3], &rng));
    let (w1, w2) = (
        Tensor::param(random_array(&[3, 3], &rng)),
        Tensor::param(random_array(&[3, 2], &rng)),
    );
    let forward = || {
        let (a, b) = (w1.clone(), w2.clone());
        checkpoint(
            move |xs| xs[0].matmul(&a).tanh().matmul(&b),
            from_ref(&x),
            &[w1.clone(), w2.clone()],
            &[],
        )
    };
    let result = check_parameter_gradients(
        forward,
        &[w1.clone(), w2.clone()],
        GradcheckOptions::default(),
    );
    assert!(result.is_ok(), "{}", result.unwrap_err());
}

#[test]
fn the_rerun_stops_at_the_leaf_copy_of_an_op_output() {
    // h = 2x is the output of an op that also feeds the loss directly:
    // L = Σ tanh(h) + Σ h, dL/dx = 2(1 − tanh²(2x)) + 2.
    let x = param(&[0.25, -0.5]);
    let h = x.mul_scalar(2.0);
    let y = checkpoint(|xs| xs[0].tanh(), from_ref(&h), &[], &[]);
    (&y.sum_all() + &h.sum_all()).backward();
    let expected: Vec<f64> = [0.25f64, -0.5]
        .iter()
        .map(|x| 2.0 * (1.0 - (2.0 * x).tanh().powi(2)) + 2.0)
        .collect();
    let grad = x.grad().unwrap();
    for (g, e) in grad.iter().zip(&expected) {
        assert!((g - e).abs() < 1e-12, "{g} vs {e}");
    }
}

#[test]
fn a_segment_ignoring_what_requires_grad_passes_no_gradient() {
    let x = param(&[1.0, 2.0]);
    let y = checkpoint(|xs| Tensor::ones(&xs[0].shape()), from_ref(&x), &[], &[]);
    (&y * &x).sum_all().backward();
    // Only the product contributes: d(Σ 1·x)/dx = 1.
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[1.0, 1.0]);
}

/// Halves every product: a stand-in for autocast's rounding matmul.
struct HalvingMatmul;

impl MatmulHook for HalvingMatmul {
    fn matmul_f32(&self, lhs: &Tensor<f32>, rhs: &Tensor<f32>) -> Tensor<f32> {
        lhs.matmul_plain(rhs).mul_scalar(0.5)
    }
    fn matmul_f64(&self, lhs: &Tensor<f64>, rhs: &Tensor<f64>) -> Tensor<f64> {
        lhs.matmul_plain(rhs).mul_scalar(0.5)
    }
}

#[test]
fn the_rerun_uses_the_forward_passs_matmul_override() {
    // Forward under the override, backward outside it (as with autocast): the rerun must
    // halve its products too, or its tanh' is evaluated at the wrong points.
    let x = data::<f64>(&[2, 3], 6);
    let w = Tensor::param(random_array(&[3, 3], &Generator::new(7)));
    let run = |checkpointed: bool| {
        w.zero_grad();
        let previous = set_matmul_hook(Some(Arc::new(HalvingMatmul)));
        let weight = w.clone();
        let f = move |xs: &[Tensor<f64>]| xs[0].matmul(&weight).tanh();
        let y = if checkpointed {
            checkpoint(f, from_ref(&x), from_ref(&w), &[])
        } else {
            f(from_ref(&x))
        };
        set_matmul_hook(previous);
        y.sum_all().backward();
        w.grad().unwrap()
    };
    assert_eq!(run(true), run(false));
}
