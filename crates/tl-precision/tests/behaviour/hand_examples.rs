//! The worked examples of the chapter's section 3, number for number.

use tl_precision::{DynamicLossScaler, Format, autocast_bf16, cast, grad_accumulate};
use tl_tensor::Tensor;
use tl_tensor::losses::mse;
use tl_tensor::ndarray::{arr1, arr2};
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::Sgd;

use crate::common::{assert_close, grad_of};

const TIE: f32 = 0.00390625; // 2^-8

#[test]
fn bf16_matmul_rounds_the_tie_to_even_and_its_gradients_are_bf16() {
    // A = [1, 1], B = [1, 2^-8]ᵀ: both already bf16 values.
    let a = Tensor::<f32>::param(arr2(&[[1.0, 1.0]]).into_dyn());
    let b = Tensor::<f32>::param(arr2(&[[1.0], [TIE]]).into_dyn());
    let y = {
        let _bf16 = autocast_bf16();
        a.matmul(&b)
    };
    // The f32 product 1 + 2^-8 lies halfway between the bf16 values 1 and 1 + 2^-7: the
    // tie goes to the even significand, 1.
    assert_eq!(y.item(), 1.0);
    // L = sum(Y), Ȳ = 1: Ā = rd(Ȳ)·rd(B)ᵀ = [1, 2^-8], B̄ = rd(A)ᵀ·rd(Ȳ) = [1, 1]ᵀ. The
    // backward runs after the guard dropped: the rounding is part of the recorded graph.
    y.sum_all().backward();
    assert_eq!(grad_of(&a), [1.0, TIE]);
    assert_eq!(grad_of(&b), [1.0, 1.0]);
    // Outside autocast, the same product is the f32 1.00390625.
    assert_eq!(a.matmul(&b).item(), 1.00390625);
    // 1.01 is stored as the nearest bf16 value, 1 + 2^-7.
    assert_eq!(
        cast(&Tensor::<f32>::scalar(1.01), Format::Bf16).item(),
        1.0078125
    );
}

#[test]
fn bf16_matmul_gradient_of_an_unrounded_upstream_is_rounded() {
    // Same A and B, Ȳ = 1.01: the cast of Y rounds Ȳ to 1.0078125 before the backward
    // matmul, so Ā = [1.0078125, 1.0078125·2^-8] and B̄ = [1.0078125, 1.0078125]ᵀ.
    let a = Tensor::<f32>::param(arr2(&[[1.0, 1.0]]).into_dyn());
    let b = Tensor::<f32>::param(arr2(&[[1.0], [TIE]]).into_dyn());
    let y = {
        let _bf16 = autocast_bf16();
        a.matmul(&b)
    };
    y.backward_with(arr2(&[[1.01_f32]]).into_dyn());
    assert_eq!(grad_of(&a), [1.0078125, 1.0078125 * TIE]);
    assert_eq!(grad_of(&b), [1.0078125, 1.0078125]);
}

/// One weight w = 1 and the rows x with targets 2x: the residuals are −x.
fn line() -> Linear<f64> {
    Linear::from_parts(Tensor::param(arr2(&[[1.0]]).into_dyn()), None)
}

fn rows(xs: &[f64]) -> (Tensor<f64>, Tensor<f64>) {
    let x = Tensor::from_vec(xs.to_vec(), &[xs.len(), 1]).unwrap();
    let target = x.mul_scalar(2.0);
    (x, target)
}

fn mean_squared_error(
    model: &Linear<f64>,
    (x, target): &(Tensor<f64>, Tensor<f64>),
) -> Tensor<f64> {
    mse(&model.forward(x), target)
}

/// The loss and dL/dw that `grad_accumulate` gives for these micro-batches, from w = 1.
fn accumulate(micro_batches: &[(Tensor<f64>, Tensor<f64>)]) -> (f64, f64) {
    let model = line();
    let loss = grad_accumulate(&model, micro_batches, mean_squared_error, None).unwrap();
    (loss, grad_of(model.weight())[0])
}

#[test]
fn accumulation_weights_micro_batches_by_their_rows() {
    // One batch {1, 2, 3, 4}: L = (1 + 4 + 9 + 16)/4 = 7.5, dL/dw = 2(−1 −4 −9 −16)/4 = −15.
    let (loss, grad) = accumulate(&[rows(&[1.0, 2.0, 3.0, 4.0])]);
    assert_close(&[loss, grad], &[7.5, -15.0], 1e-12);
    // The two micro-batches alone: {1} gives L₁ = 1, g₁ = −2; {2, 3, 4} gives
    // L₂ = 29/3, g₂ = 2(−4 −9 −16)/3 = −58/3.
    let (l1, g1) = accumulate(&[rows(&[1.0])]);
    let (l2, g2) = accumulate(&[rows(&[2.0, 3.0, 4.0])]);
    assert_close(
        &[l1, g1, l2, g2],
        &[1.0, -2.0, 29.0 / 3.0, -58.0 / 3.0],
        1e-12,
    );
    // Weighted by rows, 1/4 and 3/4: L = 1/4 + 29/4 = 7.5 and g = −0.5 − 14.5 = −15.
    let (loss, grad) = accumulate(&[rows(&[1.0]), rows(&[2.0, 3.0, 4.0])]);
    assert_close(&[loss, grad], &[7.5, -15.0], 1e-12);
    // The wrong weightings are far off: 1/k gives (−2 − 58/3)/2 = −10.67, no weighting
    // −21.33 (and the unweighted mean of the losses (1 + 29/3)/2 = 5.33).
    assert!((grad - (g1 + g2) / 2.0).abs() > 4.0);
    assert!((grad - (g1 + g2)).abs() > 6.0);
    assert!((loss - (l1 + l2) / 2.0).abs() > 2.0);
}

#[test]
fn accumulation_does_not_depend_on_the_order_of_micro_batches() {
    let (loss, grad) = accumulate(&[rows(&[2.0, 3.0, 4.0]), rows(&[1.0])]);
    assert_close(&[loss, grad], &[7.5, -15.0], 1e-12);
}

#[test]
fn accumulation_with_a_scaler_scales_the_gradient_not_the_loss() {
    // S = 8: the backward starts from 8·(n_i/N)·L_i, so dL/dw arrives as 8·(−15) = −120;
    // the reported loss stays the true 7.5.
    let model = line();
    let scaler = DynamicLossScaler::new(8.0, 2.0, 0.5, 2).unwrap();
    let micro_batches = [rows(&[1.0]), rows(&[2.0, 3.0, 4.0])];
    let loss = grad_accumulate(&model, &micro_batches, mean_squared_error, Some(&scaler)).unwrap();
    assert_close(&[loss, grad_of(model.weight())[0]], &[7.5, -120.0], 1e-12);
}

#[test]
fn loss_scaler_follows_the_five_step_trace() {
    // S = 8, growth 2, backoff 1/2, interval 2; SGD with lr 0.5 on one weight from 0.
    // Columns: scaled gradient, stepped?, w after, S after, good steps after.
    let trace = [
        (8.0, true, -0.5, 8.0, 1),            // unscaled 1: w = 0 − 0.5·1
        (f32::INFINITY, false, -0.5, 4.0, 0), // overflow: skip, halve, restart the count
        (4.0, true, -1.0, 4.0, 1),            // unscaled 4/4 = 1
        (8.0, true, -2.0, 8.0, 0),            // unscaled 8/4 = 2; second good step: S grows
        (16.0, true, -3.0, 8.0, 1),           // unscaled 16/8 = 2
    ];
    let w = Tensor::<f32>::param(arr1(&[0.0]).into_dyn());
    let mut sgd = Sgd::new(vec![w.clone()], 0.5).unwrap();
    let mut scaler = DynamicLossScaler::new(8.0, 2.0, 0.5, 2).unwrap();
    for (step, (scaled_grad, stepped, w_after, scale_after, good_after)) in
        trace.into_iter().enumerate()
    {
        w.set_grad(Some(arr1(&[scaled_grad]).into_dyn()));
        let outcome = scaler
            .step(&mut sgd, std::slice::from_ref(&w), None)
            .unwrap();
        assert_eq!(
            (
                outcome.stepped,
                w.item(),
                outcome.scale,
                scaler.good_steps()
            ),
            (stepped, w_after, scale_after, good_after),
            "step {}",
            step + 1
        );
        assert_eq!(scaler.loss_scale(), scale_after);
    }
}
