//! The dynamic loss scaler's step: arguments, skipping, unscaling and clipping, fp16
//! underflow and its telemetry.

use tl_precision::{DynamicLossScaler, Format, PrecisionError, autocast};
use tl_tensor::ndarray::{ArrayD, arr1};
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::clip_grad_norm;
use tl_tensor::{Generator, Tensor};

use crate::common::{assert_close, grad_of, normal, sgd, weight, widen};

#[test]
fn bad_arguments_are_typed_errors() {
    let bad = [
        (0.0, 2.0, 0.5, 10, "init"),
        (-8.0, 2.0, 0.5, 10, "init"),
        (f64::INFINITY, 2.0, 0.5, 10, "init"),
        (f64::NAN, 2.0, 0.5, 10, "init"),
        (8.0, 1.0, 0.5, 10, "growth"),
        (8.0, 0.5, 0.5, 10, "growth"),
        (8.0, f64::INFINITY, 0.5, 10, "growth"),
        (8.0, 2.0, 0.0, 10, "backoff"),
        (8.0, 2.0, 1.0, 10, "backoff"),
        (8.0, 2.0, f64::NAN, 10, "backoff"),
        (8.0, 2.0, 0.5, 0, "interval"),
    ];
    for (init, growth, backoff, interval, which) in bad {
        match DynamicLossScaler::new(init, growth, backoff, interval) {
            Err(PrecisionError::InvalidScalerArgument { name, .. }) => assert_eq!(name, which),
            other => panic!("{which}: expected an error, got {other:?}"),
        }
    }
}

#[test]
fn the_default_is_pytorchs() {
    let state = DynamicLossScaler::default().state_dict();
    assert_eq!(
        (
            state.scale,
            state.growth_factor,
            state.backoff_factor,
            state.growth_interval
        ),
        (65536.0, 2.0, 0.5, 2000)
    );
    assert_eq!(
        (state.good_steps, state.floor, state.ceiling),
        (0, None, None)
    );
}

#[test]
fn an_overflow_changes_no_weight_drops_the_gradients_and_halves_the_scale() {
    let (w, v) = (weight(&[1.0, 2.0]), weight(&[3.0]));
    let mut opt = sgd(&[w.clone(), v.clone()], 0.1);
    let mut scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 3).unwrap();
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        w.set_grad(Some(arr1(&[1.0, bad]).into_dyn()));
        v.set_grad(Some(arr1(&[5.0]).into_dyn()));
        let before = scaler.loss_scale();
        let outcome = scaler
            .step(&mut opt, &[w.clone(), v.clone()], None)
            .unwrap();
        assert!(!outcome.stepped);
        assert_eq!((w.to_vec(), v.to_vec()), (vec![1.0, 2.0], vec![3.0]));
        assert_eq!(
            (w.grad(), v.grad()),
            (None, None),
            "every gradient is dropped"
        );
        assert_eq!((outcome.scale, scaler.good_steps()), (before / 2.0, 0));
    }
}

#[test]
fn overflowing_steps_halve_the_scale_until_one_succeeds() {
    // Under fp16 autocast, L = sum(x·w) with x = 4: the scaled gradient S·4 overflows fp16
    // (largest finite 65504) for S = 2^16, 2^15 and 2^14 (S·4 = 65536 rounds to inf), and
    // fits for S = 2^13. The loop never zeroes the gradients: the scaler drops bad ones, so
    // the fourth backward starts from nothing rather than from infinity.
    let w = Tensor::<f32>::param(ArrayD::zeros(tl_tensor::ndarray::IxDyn(&[1, 1])));
    let x = Tensor::<f32>::full(&[1, 1], 4.0);
    let mut opt = sgd(std::slice::from_ref(&w), 0.5);
    let mut scaler = DynamicLossScaler::default();
    let mut outcomes = Vec::new();
    for _ in 0..4 {
        {
            let _fp16 = autocast(Format::Fp16);
            scaler.scale(&x.matmul(&w).sum_all()).backward();
        }
        let outcome = scaler
            .step(&mut opt, std::slice::from_ref(&w), None)
            .unwrap();
        outcomes.push((outcome.stepped, outcome.scale, w.item()));
    }
    let expected = [
        (false, 32768.0, 0.0),
        (false, 16384.0, 0.0),
        (false, 8192.0, 0.0),
        (true, 8192.0, -2.0), // 8192·4 unscaled to 4: w = 0 − 0.5·4
    ];
    assert_eq!(outcomes, expected);
}

#[test]
fn the_clip_bound_is_in_true_gradient_units() {
    // g = [3, 4] (norm 5) arrives scaled by S = 1024. Unscaled first, then clipped to 1:
    // g = [0.6, 0.8]/(1 + 2e-7), and SGD with lr 1 moves w by exactly that.
    let w = weight(&[0.0, 0.0]);
    let mut opt = sgd(std::slice::from_ref(&w), 1.0);
    let mut scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 100).unwrap();
    w.set_grad(Some(arr1(&[3.0 * 1024.0, 4.0 * 1024.0]).into_dyn()));
    let outcome = scaler
        .step(&mut opt, std::slice::from_ref(&w), Some(1.0))
        .unwrap();
    assert_eq!(outcome.grad_norm, Some(5.0));
    assert_close(&widen(&w.to_vec()), &[-0.6, -0.8], 1e-6);
    // The same as clip_grad_norm applied to the unscaled gradient.
    let reference = weight(&[0.0, 0.0]);
    reference.set_grad(Some(arr1(&[3.0, 4.0]).into_dyn()));
    clip_grad_norm(std::slice::from_ref(&reference), 1.0).unwrap();
    assert_eq!(grad_of(&w), grad_of(&reference));
    // A gradient already within the bound is only unscaled.
    w.set_grad(Some(arr1(&[0.3 * 1024.0, 0.4 * 1024.0]).into_dyn()));
    let outcome = scaler
        .step(&mut opt, std::slice::from_ref(&w), Some(1.0))
        .unwrap();
    assert_close(&[outcome.grad_norm.unwrap()], &[0.5], 1e-6);
    assert_close(&widen(&grad_of(&w)), &[0.3, 0.4], 1e-7);
}

#[test]
fn an_invalid_clip_is_rejected_before_anything_changes() {
    let w = weight(&[0.0]);
    let mut opt = sgd(std::slice::from_ref(&w), 1.0);
    let mut scaler = DynamicLossScaler::new(4.0, 2.0, 0.5, 1).unwrap();
    w.set_grad(Some(arr1(&[4.0]).into_dyn()));
    for clip in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            scaler.step(&mut opt, std::slice::from_ref(&w), Some(clip)),
            Err(PrecisionError::InvalidScalerArgument { name: "clip", .. })
        ));
    }
    assert_eq!(
        (w.item(), grad_of(&w), scaler.loss_scale()),
        (0.0, vec![4.0], 4.0)
    );
}

/// A tiny-gradient problem: y = x·W with the loss multiplied by 2^-28, like a mean over
/// many millions of tokens. Returns the layer and its input.
fn tiny_gradient_problem() -> (Linear<f32>, Tensor<f32>) {
    let rng = Generator::new(5);
    let layer = Linear::<f32>::new(4, 3, false, &rng);
    let x = Tensor::from_array(normal::<f32>(&[8, 4], 1.0, &rng));
    (layer, x)
}

fn tiny_loss(layer: &Linear<f32>, x: &Tensor<f32>) -> Tensor<f32> {
    layer
        .forward(x)
        .powi(2)
        .sum_all()
        .mul_scalar(2f32.powi(-28))
}

#[test]
fn fp16_gradients_vanish_without_scaling_and_match_f32_once_scaled() {
    // f32 reference: no rounding at all.
    let (layer, x) = tiny_gradient_problem();
    tiny_loss(&layer, &x).backward();
    let reference = grad_of(layer.weight());
    assert!(reference.iter().all(|&g| g != 0.0 && g.abs() < 1e-6));

    // fp16 without scaling: Ȳ = 2^-27·y lies below half of fp16's smallest subnormal 2^-24
    // (for |y| < 4), so Ȳ and with it every weight gradient flush to zero.
    layer.zero_grad();
    tl_precision::take_underflow_count();
    {
        let _fp16 = autocast(Format::Fp16);
        tiny_loss(&layer, &x).backward();
    }
    let unscaled = grad_of(layer.weight());
    assert_eq!(unscaled, vec![0.0; 12]);
    assert!(tl_precision::underflow_count() > 0);

    // fp16 with the default scale 2^16: S·Ȳ = 2^-11·y is in fp16's normal range, and the
    // unscaled gradients match f32 to fp16's precision (relative to the largest gradient,
    // as entries that are sums of cancelling terms have larger relative errors).
    layer.zero_grad();
    tl_precision::take_underflow_count();
    let mut scaler = DynamicLossScaler::default();
    {
        let _fp16 = autocast(Format::Fp16);
        scaler.scale(&tiny_loss(&layer, &x)).backward();
    }
    let mut opt = sgd(&layer.parameters(), 0.0);
    let outcome = scaler.step(&mut opt, &layer.parameters(), None).unwrap();
    assert!(outcome.stepped);
    assert_eq!(outcome.underflows, 0);
    let largest = reference.iter().fold(0.0f32, |m, g| m.max(g.abs()));
    for (g, r) in grad_of(layer.weight()).iter().zip(&reference) {
        assert!((g - r).abs() <= 1e-2 * largest, "{g} vs {r}");
    }
}

#[test]
fn the_underflow_count_of_a_step_is_reported_and_reset() {
    let (layer, x) = tiny_gradient_problem();
    let mut opt = sgd(&layer.parameters(), 0.0);
    let mut scaler = DynamicLossScaler::new(1.0, 2.0, 0.5, 100).unwrap();
    tl_precision::take_underflow_count();
    {
        let _fp16 = autocast(Format::Fp16);
        scaler.scale(&tiny_loss(&layer, &x)).backward();
    }
    let outcome = scaler.step(&mut opt, &layer.parameters(), None).unwrap();
    assert!(outcome.underflows > 0);
    assert_eq!(tl_precision::underflow_count(), 0);
}

#[test]
fn an_overflow_restarts_the_count_of_good_steps() {
    // Interval 3: two good steps, an overflow, two good steps: no growth yet (the count is
    // 2, not 4); the third good step after the overflow grows the halved scale back.
    let w = weight(&[0.0]);
    let mut opt = sgd(std::slice::from_ref(&w), 0.1);
    let mut scaler = DynamicLossScaler::new(64.0, 2.0, 0.5, 3).unwrap();
    let mut trace = Vec::new();
    for grad in [1.0, 1.0, f32::INFINITY, 1.0, 1.0, 1.0] {
        w.set_grad(Some(arr1(&[grad]).into_dyn()));
        scaler
            .step(&mut opt, std::slice::from_ref(&w), None)
            .unwrap();
        trace.push((scaler.loss_scale(), scaler.good_steps()));
    }
    assert_eq!(
        trace,
        [
            (64.0, 1),
            (64.0, 2),
            (32.0, 0),
            (32.0, 1),
            (32.0, 2),
            (64.0, 0)
        ]
    );
}

#[test]
fn floor_and_ceiling_must_bracket_the_scale() {
    let scaler = || DynamicLossScaler::new(8.0, 2.0, 0.5, 10).unwrap();
    // The floor may equal the scale but not exceed it, and must be positive and finite.
    assert!(scaler().with_floor(8.0, 1).is_ok());
    assert!(scaler().with_floor(2.0, 3).is_ok());
    for bad in [0.0, -1.0, 16.0, f64::NAN, f64::INFINITY] {
        assert!(
            matches!(
                scaler().with_floor(bad, 1),
                Err(PrecisionError::InvalidScalerArgument { .. })
            ),
            "floor {bad} accepted"
        );
    }
    assert!(scaler().with_floor(2.0, 0).is_err(), "patience 0 accepted");
    // The ceiling may equal the scale but not lie below it, and must be finite.
    assert!(scaler().with_ceiling(8.0).is_ok());
    assert!(scaler().with_ceiling(64.0).is_ok());
    for bad in [4.0, f64::INFINITY, f64::NAN] {
        assert!(
            scaler().with_ceiling(bad).is_err(),
            "ceiling {bad} accepted"
        );
    }
    // Both together: the scale sits between them.
    let both = scaler()
        .with_floor(2.0, 1)
        .unwrap()
        .with_ceiling(8.0)
        .unwrap();
    assert_eq!(both.loss_scale(), 8.0);
}
