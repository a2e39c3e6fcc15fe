//! End-to-end training with the layers, losses and optimizers: a small MLP learns sin(x),
//! and an optimizer restored from a saved state continues bit for bit.

use tl_tensor::losses::mse;
use tl_tensor::nn::{Linear, Module, Relu, Sequential, Tanh};
use tl_tensor::optim::{AdamW, AdamWState, Optimizer, Sgd, SgdState, clip_grad_norm};
use tl_tensor::{Generator, Tensor};

/// 64 points evenly spaced on [−π, π] and their sines, as `[64, 1]` columns.
fn sine_data() -> (Tensor<f32>, Tensor<f32>) {
    let xs: Vec<f32> = (0..64)
        .map(|i| (-std::f64::consts::PI + i as f64 * std::f64::consts::TAU / 63.0) as f32)
        .collect();
    let ys = xs.iter().map(|x| x.sin()).collect();
    (
        Tensor::from_vec(xs, &[64, 1]).unwrap(),
        Tensor::from_vec(ys, &[64, 1]).unwrap(),
    )
}

/// Linear(1, 32) – activation – Linear(32, 1), initialised from `seed`.
fn mlp(seed: u64, activation: Box<dyn Module>) -> Sequential {
    let rng = Generator::new(seed);
    Sequential::new(vec![
        Box::new(Linear::new(1, 32, true, &rng)),
        activation,
        Box::new(Linear::new(32, 1, true, &rng)),
    ])
}

/// Runs `steps` full-batch steps of `optimizer` on `model` and returns the last loss.
fn train(model: &Sequential, optimizer: &mut dyn Optimizer, steps: usize, clip: bool) -> f32 {
    let (x, y) = sine_data();
    let mut loss = f32::NAN;
    for _ in 0..steps {
        optimizer.zero_grad();
        let output = mse(&model.forward(&x), &y);
        loss = output.item();
        output.backward();
        if clip {
            clip_grad_norm(optimizer.parameters(), 1.0).unwrap();
        }
        optimizer.step();
    }
    loss
}

/// The loss of always predicting 0: mean(sin²) over the grid, about 0.49.
fn baseline_loss() -> f32 {
    let (_, y) = sine_data();
    mse(&Tensor::zeros(&[64, 1]), &y).item()
}

#[test]
fn mlp_with_adamw_fits_a_sine() {
    let model = mlp(0, Box::new(Tanh));
    let mut optimizer = AdamW::new(model.parameters(), 0.02).unwrap();
    let loss = train(&model, &mut optimizer, 300, false);
    assert!(baseline_loss() > 0.45);
    assert!(loss < 2e-3, "loss after 300 AdamW steps: {loss}");
}

#[test]
fn mlp_with_sgd_momentum_fits_a_sine() {
    let model = mlp(1, Box::new(Relu));
    let mut optimizer = Sgd::new(model.parameters(), 0.05)
        .unwrap()
        .with_momentum(0.9)
        .unwrap();
    let loss = train(&model, &mut optimizer, 400, true);
    assert!(loss < 1e-3, "loss after 400 SGD steps: {loss}");
}

fn parameter_bits(model: &Sequential) -> Vec<u32> {
    model
        .parameters()
        .iter()
        .flat_map(|p| p.to_vec())
        .map(f32::to_bits)
        .collect()
}

#[test]
fn adamw_resumed_from_json_continues_bit_for_bit() {
    // `reference` trains 20 steps without interruption. `resumed` trains 10, its optimizer is
    // saved to JSON and dropped, and a fresh optimizer loaded from the JSON does the last 10.
    let reference = mlp(2, Box::new(Tanh));
    let mut reference_opt = AdamW::new(reference.parameters(), 0.01).unwrap();
    train(&reference, &mut reference_opt, 20, false);

    let resumed = mlp(2, Box::new(Tanh));
    let json = {
        let mut first_half = AdamW::new(resumed.parameters(), 0.01).unwrap();
        train(&resumed, &mut first_half, 10, false);
        serde_json::to_string(&first_half.state_dict()).unwrap()
    };
    let state: AdamWState = serde_json::from_str(&json).unwrap();
    let mut second_half = AdamW::new(resumed.parameters(), 0.5).unwrap();
    second_half.load_state_dict(state).unwrap();
    assert_eq!(second_half.learning_rate(), 0.01);
    train(&resumed, &mut second_half, 10, false);
    assert_eq!(parameter_bits(&resumed), parameter_bits(&reference));

    // Without the saved moments the second half goes elsewhere: the comparison can fail.
    let restarted = mlp(2, Box::new(Tanh));
    train(
        &restarted,
        &mut AdamW::new(restarted.parameters(), 0.01).unwrap(),
        10,
        false,
    );
    train(
        &restarted,
        &mut AdamW::new(restarted.parameters(), 0.01).unwrap(),
        10,
        false,
    );
    assert_ne!(parameter_bits(&restarted), parameter_bits(&reference));
}

#[test]
fn sgd_resumed_from_json_continues_bit_for_bit() {
    let new_sgd = |model: &Sequential| {
        Sgd::new(model.parameters(), 0.05)
            .unwrap()
            .with_momentum(0.9)
            .unwrap()
            .with_weight_decay(1e-3)
            .unwrap()
    };
    let reference = mlp(3, Box::new(Relu));
    train(&reference, &mut new_sgd(&reference), 16, false);

    let resumed = mlp(3, Box::new(Relu));
    let mut first_half = new_sgd(&resumed);
    train(&resumed, &mut first_half, 8, false);
    let json = serde_json::to_string(&first_half.state_dict()).unwrap();
    let state: SgdState = serde_json::from_str(&json).unwrap();
    let mut second_half = Sgd::new(resumed.parameters(), 1.0).unwrap();
    second_half.load_state_dict(state).unwrap();
    train(&resumed, &mut second_half, 8, false);
    assert_eq!(parameter_bits(&resumed), parameter_bits(&reference));
}

#[test]
fn a_state_saved_for_another_model_is_rejected() {
    let small = mlp(4, Box::new(Tanh));
    let mut small_opt = AdamW::new(small.parameters(), 0.01).unwrap();
    train(&small, &mut small_opt, 1, false);
    let rng = Generator::new(4);
    let other = Sequential::<f32>::new(vec![Box::new(Linear::new(1, 16, true, &rng))]);
    let mut other_opt = AdamW::new(other.parameters(), 0.01).unwrap();
    let before = other_opt.state_dict();
    let error = other_opt
        .load_state_dict(small_opt.state_dict())
        .unwrap_err();
    assert!(error.to_string().contains("parameters"), "{error}");
    assert_eq!(other_opt.state_dict(), before);
}
