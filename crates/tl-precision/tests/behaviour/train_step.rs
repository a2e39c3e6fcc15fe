//! `train_step_mixed`: bf16 and fp16 training track f32, and a bad step never updates.

use tl_precision::{
    DynamicLossScaler, Precision, PrecisionError, autocast_format, train_step_mixed,
};
use tl_tensor::losses::mse;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::{AdamW, Sgd};
use tl_tensor::{Generator, Tensor};

use crate::common::normal;

type Batch = (Tensor<f32>, Tensor<f32>);

/// A two-layer perceptron with a tanh between the layers.
struct Mlp {
    hidden: Linear<f32>,
    out: Linear<f32>,
}

impl Mlp {
    fn new(seed: u64) -> Self {
        let rng = Generator::new(seed);
        Self {
            hidden: Linear::new(8, 16, true, &rng),
            out: Linear::new(16, 1, true, &rng),
        }
    }
}

impl Module<f32> for Mlp {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        self.out.forward(&self.hidden.forward(x).tanh())
    }

    fn parameters(&self) -> Vec<Tensor<f32>> {
        let mut params = self.hidden.parameters();
        params.extend(self.out.parameters());
        params
    }
}

/// 32 rows labelled by another, fixed network, in micro-batches of 8.
fn data() -> Vec<Batch> {
    let rng = Generator::new(100);
    let teacher = Mlp::new(101);
    (0..4)
        .map(|_| {
            let x = Tensor::from_array(normal(&[8, 8], 1.0, &rng));
            let target = teacher.forward(&x).detach();
            (x, target)
        })
        .collect()
}

fn loss_fn(model: &Mlp, (x, target): &Batch) -> Tensor<f32> {
    mse(&model.forward(x), target)
}

/// The loss after `steps` AdamW steps from the same initial weights.
fn train(precision: Precision, mut scaler: Option<DynamicLossScaler>, steps: usize) -> f64 {
    let model = Mlp::new(7);
    let micro_batches = data();
    let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
    let mut last = f64::NAN;
    for _ in 0..steps {
        let report = train_step_mixed(
            &model,
            &micro_batches,
            loss_fn,
            &mut opt,
            precision,
            scaler.as_mut(),
            Some(1.0),
        )
        .unwrap();
        last = report.loss;
    }
    last
}

#[test]
fn sixty_bf16_adamw_steps_end_within_two_percent_of_f32() {
    let f32_loss = train(Precision::Fp32, None, 60);
    let bf16_loss = train(Precision::Bf16, None, 60);
    let first = train(Precision::Fp32, None, 1);
    assert!(
        f32_loss < 0.5 * first,
        "training makes progress: {first} → {f32_loss}"
    );
    assert!(
        (bf16_loss - f32_loss).abs() <= 0.02 * f32_loss,
        "bf16 {bf16_loss} vs f32 {f32_loss}"
    );
    assert_ne!(bf16_loss, f32_loss, "bf16 does round");
}

#[test]
fn sixty_fp16_steps_with_a_scaler_track_f32() {
    let f32_loss = train(Precision::Fp32, None, 60);
    let scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 20).unwrap();
    let fp16_loss = train(Precision::Fp16, Some(scaler), 60);
    assert!(
        (fp16_loss - f32_loss).abs() <= 0.02 * f32_loss,
        "fp16 {fp16_loss} vs f32 {f32_loss}"
    );
}

/// Parameters' values, for checking that nothing moved.
fn snapshot(model: &Mlp) -> Vec<Vec<f32>> {
    model.parameters().iter().map(Tensor::to_vec).collect()
}

#[test]
fn a_nan_loss_without_a_scaler_is_an_error_before_any_update() {
    let model = Mlp::new(3);
    let micro_batches = data();
    let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
    train_step_mixed(
        &model,
        &micro_batches,
        loss_fn,
        &mut opt,
        Precision::Bf16,
        None,
        None,
    )
    .unwrap();
    let (params, state) = (snapshot(&model), opt.state_dict());

    // A NaN that reaches the loss but no gradient (a logged term): only the loss check can
    // catch it.
    let nan_term = |m: &Mlp, b: &Batch| loss_fn(m, b).add(&Tensor::scalar(f32::NAN));
    let result = train_step_mixed(
        &model,
        &micro_batches,
        nan_term,
        &mut opt,
        Precision::Bf16,
        None,
        Some(1.0),
    );
    assert!(matches!(result, Err(PrecisionError::NonFiniteLoss { loss }) if loss.is_nan()));
    assert_eq!(
        (snapshot(&model), opt.state_dict()),
        (params.clone(), state.clone())
    );

    // A NaN target poisons the loss and the gradients: still reported as the loss.
    let mut poisoned = data();
    poisoned[2].1 = Tensor::full(&[8, 1], f32::NAN);
    let result = train_step_mixed(
        &model,
        &poisoned,
        loss_fn,
        &mut opt,
        Precision::Fp32,
        None,
        None,
    );
    assert!(matches!(result, Err(PrecisionError::NonFiniteLoss { .. })));
    assert_eq!((snapshot(&model), opt.state_dict()), (params, state));
    assert_eq!(autocast_format(), None);
}

#[test]
fn a_non_finite_gradient_without_a_scaler_is_an_error_before_any_update() {
    // The loss is finite, but its derivative through this op is infinite.
    let model = Mlp::new(3);
    let micro_batches = data();
    let mut opt = Sgd::new(model.parameters(), 0.1).unwrap();
    let params = snapshot(&model);
    let steep = |m: &Mlp, b: &Batch| loss_fn(m, b).map_with_derivative(|v| v, |_| f32::INFINITY);
    let result = train_step_mixed(
        &model,
        &micro_batches,
        steep,
        &mut opt,
        Precision::Fp32,
        None,
        None,
    );
    assert!(matches!(
        result,
        Err(PrecisionError::NonFiniteGradient { index: Some(0) })
    ));
    assert_eq!(snapshot(&model), params);
}

/// An observer whose other processes saw a non-finite gradient.
struct ElsewhereNonFinite;

impl tl_precision::StepObserver<f32> for ElsewhereNonFinite {
    fn all_finite(&mut self, _local: bool) -> bool {
        false
    }
}

#[test]
fn without_a_scaler_a_non_finite_gradient_elsewhere_refuses_the_step_here_too() {
    // Data parallelism with sharded gradients: this process's gradients are finite, another
    // process's shard is not. The observer says so; the step must refuse here as well, or
    // this process would go on to the update's collectives alone.
    let model = Mlp::new(3);
    let mut opt = Sgd::new(model.parameters(), 0.1).unwrap();
    let params = snapshot(&model);
    let result = tl_precision::train_step_mixed_observed(
        &model,
        &data(),
        loss_fn,
        &mut opt,
        Precision::Fp32,
        None,
        None,
        &mut ElsewhereNonFinite,
    );
    assert!(
        matches!(
            result,
            Err(PrecisionError::NonFiniteGradient { index: None })
        ),
        "{result:?}"
    );
    assert_eq!(snapshot(&model), params);
}

#[test]
fn with_a_scaler_a_nan_loss_skips_the_step_instead() {
    let model = Mlp::new(3);
    let micro_batches = data();
    let mut opt = Sgd::new(model.parameters(), 0.1).unwrap();
    let mut scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 10).unwrap();
    let params = snapshot(&model);
    let mut poisoned = data();
    poisoned[0].1 = Tensor::full(&[8, 1], f32::NAN);
    let report = train_step_mixed(
        &model,
        &poisoned,
        loss_fn,
        &mut opt,
        Precision::Fp16,
        Some(&mut scaler),
        None,
    )
    .unwrap();
    assert!(report.skipped && report.loss.is_nan());
    assert_eq!((report.scale, snapshot(&model)), (Some(512.0), params));
    let report = train_step_mixed(
        &model,
        &micro_batches,
        loss_fn,
        &mut opt,
        Precision::Fp16,
        Some(&mut scaler),
        None,
    )
    .unwrap();
    assert!(!report.skipped && report.loss.is_finite());
}

#[test]
fn stale_gradients_are_zeroed_first_and_the_report_describes_the_step() {
    let micro_batches = data();
    let step = |stale: bool| {
        let model = Mlp::new(5);
        let mut opt = Sgd::new(model.parameters(), 0.1).unwrap();
        if stale {
            for p in model.parameters() {
                p.set_grad(Some(p.to_array().mapv(|_| 100.0)));
            }
        }
        let report = train_step_mixed(
            &model,
            &micro_batches,
            loss_fn,
            &mut opt,
            Precision::Bf16,
            None,
            Some(0.5),
        )
        .unwrap();
        (report, snapshot(&model))
    };
    let (clean, clean_params) = step(false);
    let (stale, stale_params) = step(true);
    assert_eq!((stale, stale_params), (clean, clean_params));
    assert!(!clean.skipped && clean.scale.is_none());
    assert!(clean.grad_norm.unwrap() > 0.0);
    assert_eq!(autocast_format(), None);
    // The reported loss is the loss of all 32 rows before the update.
    let model = Mlp::new(5);
    let x = Tensor::concat(&micro_batches.iter().map(|b| &b.0).collect::<Vec<_>>(), 0);
    let t = Tensor::concat(&micro_batches.iter().map(|b| &b.1).collect::<Vec<_>>(), 0);
    let whole = {
        let _bf16 = Precision::Bf16.autocast();
        loss_fn(&model, &(x, t)).item()
    };
    assert!(
        (clean.loss - f64::from(whole)).abs() < 1e-6,
        "{} vs {whole}",
        clean.loss
    );
}
