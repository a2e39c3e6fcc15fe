//! Memory, measured with tl-tensor's per-thread meter of live tensor bytes.
//!
//! The layers are plain products `y = x·W` of a `[256, 16]` activation: each one keeps exactly
//! one new array for backward (its output, which the next layer saves as its input), so the
//! schedule model's unit — one layer's stored input — is exactly `UNIT` bytes here, and the
//! meter can be held to the model closely.

use std::rc::Rc;
use std::slice::from_ref;

use tl_recompute::{
    checkpoint, checkpoint_schedule, checkpoint_sequential_with, schedule_cost, segment_sizes,
    uniform_schedule,
};
use tl_tensor::memory::{live_bytes, peak_bytes, reset_peak};
use tl_tensor::ndarray::{Array2, ArrayD};
use tl_tensor::nn::Module;
use tl_tensor::testing::random_array;
use tl_tensor::{Generator, Tensor};

const ROWS: usize = 256;
const WIDTH: usize = 16;
/// Bytes of one activation, `[ROWS, WIDTH]` in f32: the model's unit.
const UNIT: usize = ROWS * WIDTH * 4;
/// Bytes of one layer's weight (and of its gradient): 1/16 of a unit.
const WEIGHT: usize = WIDTH * WIDTH * 4;

struct Product {
    weight: Tensor<f32>,
}

impl Module<f32> for Product {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x.matmul(&self.weight)
    }

    fn parameters(&self) -> Vec<Tensor<f32>> {
        vec![self.weight.clone()]
    }
}

/// `n` product layers with weights near the identity, so values stay moderate.
fn products(n: usize) -> Vec<Rc<Product>> {
    let rng = Generator::new(7);
    (0..n)
        .map(|_| {
            let noise = random_array(&[WIDTH, WIDTH], &rng).mapv(|v| (0.05 * v) as f32);
            let weight = Array2::<f32>::eye(WIDTH).into_dyn() + noise;
            Rc::new(Product {
                weight: Tensor::param(weight),
            })
        })
        .collect()
}

fn activation(seed: u64) -> ArrayD<f32> {
    random_array(&[ROWS, WIDTH], &Generator::new(seed)).mapv(|v| v as f32)
}

/// Bytes above the state before the forward pass (parameters and the data input exist):
/// held between forward and backward, the forward pass's peak, the overall peak, and what is
/// left once backward has run and the output is dropped.
#[derive(Debug)]
struct Footprint {
    held: usize,
    forward_peak: usize,
    peak: usize,
    left: usize,
}

fn footprint(layers: &[Rc<Product>], schedule: &[usize]) -> Footprint {
    layers.iter().for_each(|layer| layer.zero_grad());
    let x = Tensor::from_array(activation(3));
    let grad_out = activation(4);
    let base = live_bytes();
    reset_peak();
    let output = checkpoint_sequential_with(layers, &x, schedule, &[], false).unwrap();
    let held = live_bytes() - base;
    let forward_peak = peak_bytes() - base;
    output.backward_with(grad_out);
    let peak = peak_bytes() - base;
    drop(output);
    Footprint {
        held,
        forward_peak,
        peak,
        left: live_bytes() - base,
    }
}

#[test]
fn held_and_peak_bytes_follow_the_schedule_model() {
    let n = 15;
    let layers = products(n);
    let budgeted = checkpoint_schedule(n, 5).unwrap();
    assert_eq!(budgeted, [0, 5, 9, 12, 14]);
    let plain = footprint(&layers, &[0]);
    let checkpointed = footprint(&layers, &budgeted);

    // Between forward and backward: the stored inputs y5, y9, y12 and the last segment's
    // y14, y15 — 5 units against the plain run's y1..y15.
    assert_eq!(plain.held, 15 * UNIT);
    assert_eq!(checkpointed.held, 5 * UNIT);
    assert!(checkpointed.held * 2 < plain.held);
    assert!(
        checkpointed.peak < plain.peak,
        "{checkpointed:?} vs {plain:?}"
    );

    for schedule in [vec![0], budgeted, uniform_schedule(n).unwrap(), vec![0, 14]] {
        let measured = footprint(&layers, &schedule);
        let cost = schedule_cost(n, &schedule).unwrap();
        let sizes = segment_sizes(n, &schedule).unwrap();
        // Held: k − 1 stored inputs and the last segment's s_k inputs, exactly. (The data
        // input x is one of them but predates the measurement; the output, which the model
        // leaves out, is measured: the two cancel.)
        let last_segment_cost = sizes.len() - 1 + sizes[sizes.len() - 1];
        assert_eq!(measured.held, last_segment_cost * UNIT, "{schedule:?}");
        // The overall peak, reached while the costliest segment is rerun and backpropagated,
        // lies between the model's peak and that plus 4 units — the output the caller still
        // holds, the rerun's own output, and the gradients in flight (the incoming one and
        // the one being produced; the meter counts an incoming gradient handed on to the
        // rerun's backward once per engine) — plus the weights' gradients accumulated so far.
        // The plain run lands in the same window of its own peak, n.
        let low = cost.peak_layers * UNIT;
        let high = (cost.peak_layers + 4) * UNIT + n * WEIGHT;
        assert!(
            (low..=high).contains(&measured.peak),
            "{schedule:?}: peak {} units outside [{}, {}]",
            measured.peak as f64 / UNIT as f64,
            cost.peak_layers,
            high as f64 / UNIT as f64
        );
        assert!(measured.forward_peak <= measured.peak);
        // After backward, only the parameters' gradients remain: the checkpoint nodes and
        // their stored inputs are gone.
        assert_eq!(measured.left, n * WEIGHT, "{schedule:?}");
    }
}

#[test]
fn a_checkpointed_segment_keeps_no_activations_during_its_forward_pass() {
    // One checkpoint around 12 layers: under no_grad each activation is freed as soon as the
    // next layer has consumed it, so the forward pass never holds more than a layer's input
    // and output (2 units), where the plain forward pass builds up all 12.
    let layers = products(12);
    let params: Vec<Tensor<f32>> = layers.iter().map(|layer| layer.weight.clone()).collect();
    let x = Tensor::from_array(activation(5));
    let run = |checkpointed: bool| {
        let base = live_bytes();
        reset_peak();
        let stack = layers.clone();
        let f = move |inputs: &[Tensor<f32>]| {
            stack
                .iter()
                .fold(inputs[0].clone(), |h, layer| layer.forward(&h))
        };
        let output = if checkpointed {
            checkpoint(f, from_ref(&x), &params, &[])
        } else {
            f(from_ref(&x))
        };
        (live_bytes() - base, peak_bytes() - base, output)
    };
    let (plain_held, plain_peak, _plain) = run(false);
    let (held, peak, _output) = run(true);
    assert_eq!(plain_held, 12 * UNIT);
    assert_eq!(plain_peak, 12 * UNIT);
    assert_eq!(held, UNIT, "only the segment's output is kept");
    assert!(
        peak <= 2 * UNIT,
        "forward peak {} units",
        peak as f64 / UNIT as f64
    );
}
