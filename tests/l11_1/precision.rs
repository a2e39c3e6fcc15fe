//! The mixed-precision rows of the chapter's test table (tl-precision): casts, autocast, the
//! dynamic loss scaler, gradient accumulation and the mixed-precision training step.

// Exact binary fractions such as 1.00390625 = 1 + 2^-8 are written out in full.
#![allow(clippy::excessive_precision)]

use std::panic::catch_unwind;

use tl_numerics::{Format, Round};
use tl_precision::{
    DynamicLossScaler, Precision, PrecisionError, autocast, autocast_bf16, autocast_format, cast,
    grad_accumulate, parse_format, train_step_mixed,
};
use tl_tensor::losses::mse;
use tl_tensor::ndarray::{Array2, ArrayD, Ix2, arr1, arr2};
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::{AdamW, Optimizer, Sgd};
use tl_tensor::testing::random_array;
use tl_tensor::{Element, Generator, Tensor};

fn grad<E: Element>(t: &Tensor<E>) -> Vec<E> {
    t.grad().expect("a gradient").iter().copied().collect()
}

fn random_f32(shape: &[usize], rng: &Generator) -> ArrayD<f32> {
    random_array(shape, rng).mapv(|v| v as f32)
}

fn round_all<E: Element>(a: &ArrayD<E>, format: Format) -> ArrayD<E> {
    a.mapv(|v| v.round_to(format))
}

/// rd(rd(a)·rd(b)) for 2-D arrays, with the product in the arrays' own type.
fn rounded_product<E: Element>(a: &ArrayD<E>, b: &ArrayD<E>, format: Format) -> ArrayD<E> {
    let a = round_all(a, format).into_dimensionality::<Ix2>().unwrap();
    let b = round_all(b, format).into_dimensionality::<Ix2>().unwrap();
    round_all(&a.dot(&b).into_dyn(), format)
}

#[test]
fn test_hand_example_bf16_matmul() {
    let a = Tensor::<f32>::param(arr2(&[[1.0, 1.0]]).into_dyn());
    let b = Tensor::<f32>::param(arr2(&[[1.0], [2f32.powi(-8)]]).into_dyn());
    let guard = autocast_bf16();
    let y = a.matmul(&b);
    // 1 + 2^-8 is the midpoint of 1 and 1 + 2^-7; ties to even give 1.
    assert_eq!(y.item(), 1.0);
    y.sum_all().backward();
    drop(guard);
    assert_eq!(grad(&a), [1.0, 2f32.powi(-8)]); // rd(Ȳ)·rd(B)ᵀ
    assert_eq!(grad(&b), [1.0, 1.0]); // rd(A)ᵀ·rd(Ȳ)
    assert_eq!(a.matmul(&b).item(), 1.00390625); // plain f32
    assert_eq!(
        cast(&Tensor::<f32>::scalar(1.01), Format::Bf16).item(),
        1.0078125
    );
}

fn line_batch(xs: &[f64]) -> (Tensor<f64>, Tensor<f64>) {
    let x = Tensor::from_vec(xs.to_vec(), &[xs.len(), 1]).unwrap();
    let y = x.mul_scalar(2.0);
    (x, y)
}

fn line_loss(m: &Linear<f64>, (x, y): &(Tensor<f64>, Tensor<f64>)) -> Tensor<f64> {
    mse(&m.forward(x), y)
}

#[test]
fn test_hand_example_accumulation() {
    let model = Linear::from_parts(Tensor::<f64>::param(arr2(&[[1.0]]).into_dyn()), None);
    let micro_batches = [line_batch(&[1.0]), line_batch(&[2.0, 3.0, 4.0])];
    let loss = grad_accumulate(&model, &micro_batches, line_loss, None).unwrap();
    let g = grad(model.weight())[0];
    // (1/4)·1 + (3/4)·(29/3) = 7.5 and (1/4)·(−2) + (3/4)·(−58/3) = −15.
    assert!((loss - 7.5).abs() < 1e-12, "loss {loss}");
    assert!((g + 15.0).abs() < 1e-12, "gradient {g}");
    // 1/k weighting would give −10.67 and no weighting −21.3.
    assert!((g + 32.0 / 3.0).abs() > 1.0 && (g + 64.0 / 3.0).abs() > 1.0);
}

#[test]
fn test_hand_example_loss_scaler() {
    let w = Tensor::<f32>::param(arr1(&[0.0]).into_dyn());
    let mut opt = Sgd::new(vec![w.clone()], 0.5).unwrap();
    let mut scaler = DynamicLossScaler::new(8.0, 2.0, 0.5, 2).unwrap();
    let rows = [
        (8.0, -0.5, 8.0, 1),
        (f32::INFINITY, -0.5, 4.0, 0),
        (4.0, -1.0, 4.0, 1),
        (8.0, -2.0, 8.0, 0),
        (16.0, -3.0, 8.0, 1),
    ];
    for (i, (scaled, w_after, s_after, count)) in rows.into_iter().enumerate() {
        w.set_grad(Some(arr1(&[scaled]).into_dyn()));
        let outcome = scaler
            .step(&mut opt, std::slice::from_ref(&w), None)
            .unwrap();
        assert_eq!(outcome.stepped, scaled.is_finite(), "step {}", i + 1);
        assert_eq!(
            (w.item(), scaler.loss_scale(), scaler.good_steps()),
            (w_after, s_after, count),
            "step {}",
            i + 1
        );
    }
}

#[test]
fn test_cast_rounds_both_directions() {
    for (format, expected) in [(Format::Bf16, 1.0078125), (Format::Fp16, 1.009765625)] {
        let x = Tensor::<f32>::param(arr1(&[1.01]).into_dyn());
        let y = cast(&x, format);
        assert_eq!(y.item(), expected as f32);
        y.backward_with(arr1(&[1.01f32]).into_dyn());
        assert_eq!(grad(&x), [expected as f32]);
    }
    // f64 stays f64 and is rounded directly: these inputs sit just off a tie of the format,
    // and rounding through f32 first would put them on it.
    for (format, input, expected) in [
        (
            Format::Bf16,
            1.0 + 2f64.powi(-8) + 2f64.powi(-29),
            1.0078125,
        ),
        (
            Format::Fp16,
            1.0 + 2f64.powi(-10) + 2f64.powi(-11) - 2f64.powi(-29),
            1.0 + 2f64.powi(-10),
        ),
    ] {
        let x = Tensor::<f64>::param(arr1(&[input]).into_dyn());
        let y: Tensor<f64> = cast(&x, format);
        assert_eq!(y.item(), expected);
        y.backward_with(arr1(&[input]).into_dyn());
        assert_eq!(grad(&x), [expected]);
    }
}

#[test]
fn test_autocast_matmul_matches_rounded_reference() {
    let rng = Generator::new(2024);
    for (m, k, n) in [(1, 1, 1), (3, 5, 2), (4, 7, 6), (8, 3, 5)] {
        let a = random_array(&[m, k], &rng);
        let b = random_array(&[k, n], &rng);
        for format in [Format::Bf16, Format::Fp16] {
            let expected = rounded_product(&a, &b, format);
            let _guard = autocast(format);
            let (ta, tb) = (Tensor::from_array(a.clone()), Tensor::param(b.clone()));
            assert_eq!(ta.matmul(&tb).to_array(), expected);
            // The operands the other way round and transposed: (Bᵀ·Aᵀ)ᵀ.
            let flipped = tb
                .transpose(0, 1)
                .matmul(&ta.transpose(0, 1))
                .transpose(0, 1);
            assert_eq!(flipped.to_array(), expected);
        }
    }
    // Linear: y = rd(rd(x)·rd(W)) + b.
    let layer = Linear::<f64>::new(5, 4, true, &rng);
    let x = random_array(&[3, 5], &rng);
    let expected = rounded_product(&x, &layer.weight().to_array(), Format::Bf16)
        + layer.bias().unwrap().to_array();
    let _bf16 = autocast_bf16();
    assert_eq!(layer.forward(&Tensor::from_array(x)).to_array(), expected);
}

#[test]
fn test_autocast_grads_are_bf16_and_masters_stay_fp32() {
    let rng = Generator::new(17);
    let layer = Linear::<f32>::new(6, 3, false, &rng);
    let x = Tensor::from_array(random_f32(&[10, 6], &rng));
    let target = Tensor::from_array(random_f32(&[10, 3], &rng));
    {
        let _bf16 = autocast_bf16();
        mse(&layer.forward(&x), &target).backward();
    }
    let g = layer.weight().grad().unwrap();
    assert!(
        g.iter().all(|&v| v == v.round_to(Format::Bf16)),
        "bf16 gradients: {g:?}"
    );
    // An update of 1e-3 on a weight of 1 survives in the f32 master.
    let w = Tensor::<f32>::param(arr1(&[1.0]).into_dyn());
    w.set_grad(Some(arr1(&[1e-3]).into_dyn()));
    Sgd::new(vec![w.clone()], 1.0).unwrap().step();
    assert_eq!(w.item(), 0.999);
    assert_eq!(
        w.item().round_to(Format::Bf16),
        1.0,
        "a bf16 weight would have lost it"
    );
}

fn plain_again() -> bool {
    let a = Tensor::<f32>::from_vec(vec![1.0, 1.0], &[1, 2]).unwrap();
    let b = Tensor::<f32>::from_vec(vec![1.0, 2f32.powi(-8)], &[2, 1]).unwrap();
    autocast_format().is_none() && a.matmul(&b).item() == 1.00390625
}

#[test]
fn test_autocast_restores_matmul() {
    // An exception inside the block.
    assert!(
        catch_unwind(|| {
            let _bf16 = autocast_bf16();
            panic!("forward failed");
        })
        .is_err()
    );
    assert!(plain_again());
    // Nesting: the inner block ends, the outer one goes on.
    let a = Tensor::<f32>::from_vec(vec![1.0, 1.0], &[1, 2]).unwrap();
    let b = Tensor::<f32>::from_vec(vec![1.0, 2f32.powi(-8)], &[2, 1]).unwrap();
    {
        let _outer = autocast_bf16();
        {
            let _inner = autocast(Format::Fp16);
            assert_eq!(a.matmul(&b).item(), 1.00390625); // exact in fp16
        }
        assert_eq!(autocast_format(), Some(Format::Bf16));
        assert_eq!(a.matmul(&b).item(), 1.0);
    }
    assert!(plain_again());
    // An unknown dtype.
    assert!(matches!(
        parse_format("fp8"),
        Err(PrecisionError::Format(_))
    ));
    assert!(matches!(
        "int8".parse::<Precision>(),
        Err(PrecisionError::UnknownPrecision { .. })
    ));
}

#[test]
fn test_fp16_underflow_is_rescued_by_loss_scaling() {
    // L = 2^-30·Σ(x·W): every dL/dW = 2^-30·Σ_rows x lies far below fp16's 2^-24.
    let rng = Generator::new(8);
    let x = Tensor::from_array(random_f32(&[4, 3], &rng));
    let w0 = random_f32(&[3, 2], &rng);
    let run = |format: Option<Format>, scale: f64| {
        let w = Tensor::param(w0.clone());
        let scaler = DynamicLossScaler::new(scale, 2.0, 0.5, 100).unwrap();
        {
            let _guard = format.map(autocast);
            scaler
                .scale(&x.matmul(&w).sum_all().mul_scalar(2f32.powi(-30)))
                .backward();
        }
        grad(&w)
            .iter()
            .map(|&g| f64::from(g) / scale)
            .collect::<Vec<_>>()
    };
    let reference = run(None, 1.0);
    assert!(reference.iter().all(|&g| g != 0.0));
    assert!(
        run(Some(Format::Fp16), 1.0).iter().all(|&g| g == 0.0),
        "vanished"
    );
    // Scaled by 2^24 the gradients are normal fp16 numbers; unscaled they match f32 to
    // fp16's precision (relative to the largest, as a sum of cancelling terms can be small).
    let rescued = run(Some(Format::Fp16), 2f64.powi(24));
    let largest = reference.iter().fold(0.0f64, |m, r| m.max(r.abs()));
    for (g, r) in rescued.iter().zip(&reference) {
        assert!((g - r).abs() <= 2e-3 * largest, "{g} vs {r}");
    }
}

#[test]
fn test_scaler_skips_inf_steps() {
    let w = Tensor::<f32>::param(arr1(&[1.0, -1.0]).into_dyn());
    let mut opt = Sgd::new(vec![w.clone()], 0.25).unwrap();
    let mut scaler = DynamicLossScaler::new(2f64.powi(16), 2.0, 0.5, 1000).unwrap();
    // The true gradient is [3, 3]; a step overflows while S·3 ≥ 65520 (fp16's overflow
    // threshold), i.e. for S = 2^16 and 2^15. The loop does not zero the gradients.
    let mut scales = Vec::new();
    for _ in 0..3 {
        {
            let _fp16 = autocast(Format::Fp16);
            let loss = Tensor::<f32>::full(&[1, 2], 3.0)
                .matmul(&w.reshape(&[2, 1]))
                .sum_all();
            scaler.scale(&loss).backward();
        }
        let outcome = scaler
            .step(&mut opt, std::slice::from_ref(&w), None)
            .unwrap();
        if !outcome.stepped {
            assert_eq!(w.to_vec(), vec![1.0, -1.0], "an overflow changes nothing");
            assert!(w.grad().is_none(), "and drops the gradients");
        }
        scales.push((outcome.stepped, outcome.scale));
    }
    assert_eq!(
        scales,
        [(false, 32768.0), (false, 16384.0), (true, 16384.0)]
    );
    assert_eq!(w.to_vec(), vec![0.25, -1.75]); // one step of −0.25·3
}

#[test]
fn test_scaler_unscales_before_clipping() {
    let w = Tensor::<f32>::param(arr1(&[0.0, 0.0]).into_dyn());
    let mut opt = Sgd::new(vec![w.clone()], 1.0).unwrap();
    let mut scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 100).unwrap();
    w.set_grad(Some(arr1(&[3.0 * 1024.0, 4.0 * 1024.0]).into_dyn())); // norm 5, scaled
    let outcome = scaler
        .step(&mut opt, std::slice::from_ref(&w), Some(1.0))
        .unwrap();
    assert_eq!(outcome.grad_norm, Some(5.0));
    let moved = w.to_vec();
    assert!(
        (moved[0] + 0.6).abs() < 1e-6 && (moved[1] + 0.8).abs() < 1e-6,
        "{moved:?}"
    );
}

#[test]
fn test_scaler_state_dict_roundtrip() {
    let w = Tensor::<f32>::param(arr1(&[0.0]).into_dyn());
    let mut opt = Sgd::new(vec![w.clone()], 0.1).unwrap();
    let mut scaler = DynamicLossScaler::new(64.0, 2.0, 0.5, 4).unwrap();
    for _ in 0..3 {
        w.set_grad(Some(arr1(&[64.0]).into_dyn()));
        scaler
            .step(&mut opt, std::slice::from_ref(&w), None)
            .unwrap();
    }
    let mut resumed = DynamicLossScaler::default();
    resumed.load_state_dict(&scaler.state_dict()).unwrap();
    assert_eq!((resumed.loss_scale(), resumed.good_steps()), (64.0, 3));
    w.set_grad(Some(arr1(&[64.0]).into_dyn()));
    assert_eq!(
        resumed
            .step(&mut opt, std::slice::from_ref(&w), None)
            .unwrap()
            .scale,
        128.0
    );
    // Bad arguments raise.
    assert!(DynamicLossScaler::new(0.0, 2.0, 0.5, 4).is_err());
    assert!(DynamicLossScaler::new(64.0, 1.0, 0.5, 4).is_err());
    assert!(DynamicLossScaler::new(64.0, 2.0, 1.0, 4).is_err());
    assert!(DynamicLossScaler::new(64.0, 2.0, 0.5, 0).is_err());
    let mut bad = scaler.state_dict();
    bad.good_steps = 9;
    let before = resumed.clone();
    assert!(resumed.load_state_dict(&bad).is_err());
    assert_eq!(resumed, before);
}

#[test]
fn test_accumulation_equals_one_big_batch() {
    let rng = Generator::new(32);
    let model = Linear::<f32>::new(4, 3, true, &rng);
    let x = Tensor::from_array(random_f32(&[32, 4], &rng));
    let t = Tensor::from_array(random_f32(&[32, 3], &rng));
    let loss_fn = |m: &Linear<f32>, (x, t): &(Tensor<f32>, Tensor<f32>)| mse(&m.forward(x), t);
    let run = |micro_batches: &[(Tensor<f32>, Tensor<f32>)]| {
        model.zero_grad();
        let loss = grad_accumulate(&model, micro_batches, loss_fn, None).unwrap();
        let grads: Vec<f32> = model.parameters().iter().flat_map(grad).collect();
        (loss, grads)
    };
    let (big_loss, big_grads) = run(&[(x.clone(), t.clone())]);
    let pieces: Vec<_> = [(0, 5), (5, 11), (16, 16)]
        .iter()
        .map(|&(start, len)| (x.narrow(0, start, len), t.narrow(0, start, len)))
        .collect();
    let (loss, grads) = run(&pieces);
    assert!((loss - big_loss).abs() < 1e-6);
    for (g, b) in grads.iter().zip(&big_grads) {
        assert!((g - b).abs() < 1e-6, "{g} vs {b}");
    }
}

struct TwoLayer {
    first: Linear<f32>,
    second: Linear<f32>,
}

impl Module<f32> for TwoLayer {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        self.second.forward(&self.first.forward(x).tanh())
    }
    fn parameters(&self) -> Vec<Tensor<f32>> {
        [self.first.parameters(), self.second.parameters()].concat()
    }
}

type Batch = (Tensor<f32>, Tensor<f32>);

fn regression(seed: u64) -> (TwoLayer, Vec<Batch>) {
    let rng = Generator::new(seed);
    let model = TwoLayer {
        first: Linear::new(6, 12, true, &rng),
        second: Linear::new(12, 2, true, &rng),
    };
    let x = Array2::from_shape_fn((24, 6), |(i, j)| ((i * 6 + j) as f32 * 0.37).sin());
    // Targets a fixed linear map of the inputs: a function the network can learn.
    let map = Array2::from_shape_fn((6, 2), |(k, j)| ((k + 2 * j) as f32 * 0.3).cos());
    let t = x.dot(&map);
    let (x, t) = (
        Tensor::from_array(x.into_dyn()),
        Tensor::from_array(t.into_dyn()),
    );
    let micro_batches = [(0, 10), (10, 14)]
        .iter()
        .map(|&(s, n)| (x.narrow(0, s, n), t.narrow(0, s, n)))
        .collect();
    (model, micro_batches)
}

fn regression_loss(m: &TwoLayer, (x, t): &Batch) -> Tensor<f32> {
    mse(&m.forward(x), t)
}

#[test]
fn test_train_step_mixed_bf16_tracks_fp32() {
    // Returns the losses of the first and the 60th step.
    let run = |precision: Precision| {
        let (model, micro_batches) = regression(99);
        let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
        let mut losses = Vec::new();
        for _ in 0..60 {
            let report = train_step_mixed(
                &model,
                &micro_batches,
                regression_loss,
                &mut opt,
                precision,
                None,
                None,
            )
            .unwrap();
            losses.push(report.loss);
        }
        (losses[0], losses[59])
    };
    let ((first, fp32), (_, bf16)) = (run(Precision::Fp32), run(Precision::Bf16));
    assert!(fp32 < 0.5 * first, "the run learns: {first} → {fp32}");
    assert!(
        (bf16 - fp32).abs() <= 0.02 * fp32,
        "bf16 {bf16} vs fp32 {fp32}"
    );
}

#[test]
fn test_train_step_mixed_rejects_nan_loss() {
    let (model, micro_batches) = regression(5);
    let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
    let before: Vec<Vec<f32>> = model.parameters().iter().map(Tensor::to_vec).collect();
    let state = opt.state_dict();
    // The NaN enters the loss through a term without gradient; the gradients are finite.
    let nan_loss = |m: &TwoLayer, b: &Batch| regression_loss(m, b).add_scalar(f32::NAN);
    let result = train_step_mixed(
        &model,
        &micro_batches,
        nan_loss,
        &mut opt,
        Precision::Bf16,
        None,
        None,
    );
    assert!(
        matches!(result, Err(PrecisionError::NonFiniteLoss { .. })),
        "{result:?}"
    );
    let after: Vec<Vec<f32>> = model.parameters().iter().map(Tensor::to_vec).collect();
    assert_eq!(after, before);
    assert_eq!(opt.state_dict(), state);
    assert_eq!(autocast_format(), None);
}
