//! The checkpointing rows of the chapter's test table (tl-recompute).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::slice::from_ref;

use tl_recompute::{
    checkpoint, checkpoint_schedule, checkpoint_sequential, schedule_cost, segment_sizes,
};
use tl_tensor::losses::mse;
use tl_tensor::memory::{live_bytes, peak_bytes, reset_peak};
use tl_tensor::ndarray::{Array2, arr1};
use tl_tensor::nn::{Dropout, Linear, Module};
use tl_tensor::testing::random_array;
use tl_tensor::{Element, Generator, Tensor, no_grad};

/// `tanh(Linear(x))`, counting its forward calls.
struct CountedBlock<E: Element> {
    linear: Linear<E>,
    calls: Cell<usize>,
}

impl<E: Element> Module<E> for CountedBlock<E> {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        self.calls.set(self.calls.get() + 1);
        self.linear.forward(x).tanh()
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        self.linear.parameters()
    }
}

fn blocks<E: Element>(n: usize, width: usize, seed: u64) -> Vec<Rc<CountedBlock<E>>> {
    let init = Generator::new(seed);
    (0..n)
        .map(|_| {
            Rc::new(CountedBlock {
                linear: Linear::new(width, width, true, &init),
                calls: Cell::new(0),
            })
        })
        .collect()
}

fn data<E: Element>(shape: &[usize], seed: u64) -> Tensor<E> {
    Tensor::from_array(random_array(shape, &Generator::new(seed)).mapv(E::from_f64))
}

fn parameters<E: Element, L: Module<E>>(layers: &[L]) -> Vec<Tensor<E>> {
    layers.iter().flat_map(L::parameters).collect()
}

/// Gradient bits of each tensor (`None` without a gradient): equal means bit for bit.
fn grad_bits<E: Element>(tensors: &[Tensor<E>]) -> Vec<Option<Vec<u64>>> {
    tensors
        .iter()
        .map(|t| {
            t.grad()
                .map(|g| g.iter().map(|&v| Element::to_f64(v).to_bits()).collect())
        })
        .collect()
}

/// An MSE training step through `layers`, plain (`budget = None`) or checkpointed; returns the
/// output's bits and the gradient bits of `watched` (zeroed first).
fn train_step<E: Element, L: Module<E> + Clone + 'static>(
    layers: &[L],
    x: &Tensor<E>,
    budget: Option<usize>,
    rngs: &[Generator],
    watched: &[Tensor<E>],
) -> (Vec<u64>, Vec<Option<Vec<u64>>>) {
    watched.iter().for_each(Tensor::zero_grad);
    let output = match budget {
        Some(budget) => checkpoint_sequential(layers, x, budget, rngs).unwrap(),
        None => layers.iter().fold(x.clone(), |h, layer| layer.forward(&h)),
    };
    let target = data(&output.shape(), 99);
    mse(&output, &target).backward();
    let bits = output
        .to_vec()
        .iter()
        .map(|&v| Element::to_f64(v).to_bits())
        .collect();
    (bits, grad_bits(watched))
}

#[test]
fn test_hand_example_checkpoint_schedule() {
    assert_eq!(checkpoint_schedule(6, 4).unwrap(), vec![0, 3]);
    let layers = blocks::<f64>(6, 4, 1);
    let x = data(&[3, 4], 2);
    let params = parameters(&layers);
    let plain = train_step(&layers, &x, None, &[], &params);
    layers.iter().for_each(|layer| layer.calls.set(0));
    let checkpointed = train_step(&layers, &x, Some(4), &[], &params);
    // Layers 0..3 run under no_grad and again during backward; layers 3..6 run once.
    let counts: Vec<usize> = layers.iter().map(|layer| layer.calls.get()).collect();
    assert_eq!(counts, [2, 2, 2, 1, 1, 1]);
    assert_eq!(checkpointed, plain);
}

fn grads_bitwise_equal<E: Element>() {
    let layers = blocks::<E>(7, 5, 10);
    // An input that requires grad: its gradient comes back through the first checkpoint.
    let x = Tensor::param(data::<E>(&[4, 5], 11).to_array());
    let mut watched = parameters(&layers);
    watched.push(x.clone());
    let plain = train_step(&layers, &x, None, &[], &watched);
    assert!(plain.1.iter().all(Option::is_some));
    for budget in [4, 5, 6] {
        let checkpointed = train_step(&layers, &x, Some(budget), &[], &watched);
        assert_eq!(checkpointed, plain, "{} budget {budget}", E::NAME);
    }
}

/// A segment whose input also feeds a branch outside it: `y = h + seg(h)`, `h = layer₀(x)`.
/// The rerun must start from its own leaf for `h`: a rerun on `h` itself runs its backward on
/// into layer 0 from inside the node, and the outer sweep then runs layer 0 again with the
/// residual's share, a sum in another order (or over freed saved values).
fn residual_grads_bitwise_equal<E: Element>() {
    let layers = blocks::<E>(4, 5, 12);
    let x = Tensor::param(data::<E>(&[4, 5], 13).to_array());
    let mut watched = parameters(&layers);
    watched.push(x.clone());
    let step = |checkpointed: bool| {
        watched.iter().for_each(Tensor::zero_grad);
        let h = layers[0].forward(&x);
        let segment = layers[1..].to_vec();
        let run = move |xs: &[Tensor<E>]| segment.iter().fold(xs[0].clone(), |h, l| l.forward(&h));
        let branch = if checkpointed {
            checkpoint(run, from_ref(&h), &parameters(&layers[1..]), &[])
        } else {
            run(from_ref(&h))
        };
        let y = &h + &branch;
        mse(&y, &data(&y.shape(), 98)).backward();
        grad_bits(&watched)
    };
    let plain = step(false);
    assert!(plain.iter().all(Option::is_some));
    assert_eq!(step(true), plain, "{} residual", E::NAME);
}

#[test]
fn test_checkpoint_grads_bitwise_equal() {
    grads_bitwise_equal::<f64>();
    grads_bitwise_equal::<f32>();
    residual_grads_bitwise_equal::<f64>();
    residual_grads_bitwise_equal::<f32>();
}

/// Dropout logging the keep-mask of each call.
struct LoggedDropout {
    dropout: Dropout,
    masks: RefCell<Vec<Vec<bool>>>,
}

impl Module<f64> for LoggedDropout {
    fn forward(&self, x: &Tensor<f64>) -> Tensor<f64> {
        let y = self.dropout.forward(x);
        self.masks
            .borrow_mut()
            .push(y.to_vec().iter().map(|&v| v != 0.0).collect());
        y
    }

    fn parameters(&self) -> Vec<Tensor<f64>> {
        Vec::new()
    }
}

#[test]
fn test_checkpoint_replays_dropout_rng() {
    let rng = Generator::new(20);
    let blocks = blocks::<f64>(4, 6, 21);
    let dropouts: Vec<Rc<LoggedDropout>> = (0..4)
        .map(|_| {
            Rc::new(LoggedDropout {
                dropout: Dropout::new(0.5, rng.clone()).unwrap(),
                masks: RefCell::new(Vec::new()),
            })
        })
        .collect();
    let mut layers: Vec<Rc<dyn Module<f64>>> = Vec::new();
    for (block, dropout) in blocks.iter().zip(&dropouts) {
        layers.push(Rc::clone(block) as Rc<dyn Module<f64>>);
        layers.push(Rc::clone(dropout) as Rc<dyn Module<f64>>);
    }
    let x = data(&[5, 6], 22);
    let params = parameters(&blocks);
    let start = rng.state();
    let plain = train_step(&layers, &x, None, &[], &params);
    let plain_end = rng.state();
    let plain_masks: Vec<Vec<bool>> = dropouts
        .iter()
        .map(|d| d.masks.borrow()[0].clone())
        .collect();

    rng.set_state(&start);
    dropouts.iter().for_each(|d| d.masks.borrow_mut().clear());
    // 8 layers in 5 units: [0, 4] — dropouts 0, 1 (layers 1, 3) are in the checkpointed
    // segment, dropouts 2 and 3 (layers 5, 7) draw after it.
    assert_eq!(checkpoint_schedule(8, 5).unwrap(), vec![0, 4]);
    let checkpointed = train_step(&layers, &x, Some(5), from_ref(&rng), &params);
    for (i, dropout) in dropouts.iter().enumerate() {
        let masks = dropout.masks.borrow();
        assert_eq!(masks.len(), if i < 2 { 2 } else { 1 }, "dropout {i}");
        assert!(
            masks.iter().all(|m| *m == plain_masks[i]),
            "dropout {i}: a different mask"
        );
    }
    assert_eq!(checkpointed, plain);
    // The stream ends where it ends without checkpointing: the next draws agree.
    assert_eq!(rng.state(), plain_end);
}

#[test]
fn test_checkpoint_params_get_grads_from_data_input() {
    let layers = blocks::<f32>(6, 4, 30);
    let x = data::<f32>(&[3, 4], 31);
    assert!(!x.requires_grad());
    let params = parameters(&layers);
    let plain = train_step(&layers, &x, None, &[], &params);
    let checkpointed = train_step(&layers, &x, Some(4), &[], &params);
    // The first segment (layers 0..3, 6 parameters) is fed only by data.
    assert!(checkpointed.1[..6].iter().all(Option::is_some));
    assert_eq!(checkpointed, plain);
}

#[test]
fn test_checkpoint_function_and_no_grad() {
    // The same tensor twice: f(a, b) = a ⊙ b², d/dx at a = b = x is x² + 2x² = 3x².
    let x = Tensor::<f64>::param(arr1(&[1.5, -2.0]).into_dyn());
    let y = checkpoint(
        |xs| &xs[0] * &(&xs[1] * &xs[1]),
        &[x.clone(), x.clone()],
        &[],
        &[],
    );
    y.sum_all().backward();
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[6.75, 12.0]);

    // A number argument, captured by the closure: d(2.5x)/dx = 2.5.
    x.zero_grad();
    let scale = 2.5;
    let y = checkpoint(move |xs| xs[0].mul_scalar(scale), from_ref(&x), &[], &[]);
    assert_eq!(y.to_vec(), [3.75, -5.0]);
    y.sum_all().backward();
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[2.5, 2.5]);

    // Under no_grad: one plain call, no node.
    let calls = Rc::new(Cell::new(0));
    let counter = Rc::clone(&calls);
    let y = {
        let _off = no_grad();
        checkpoint(
            move |xs| {
                counter.set(counter.get() + 1);
                xs[0].tanh()
            },
            from_ref(&x),
            &[],
            &[],
        )
    };
    assert!(!y.requires_grad());
    assert_eq!(calls.get(), 1);
}

/// `y = x·W`: keeps exactly one new activation (its output) per layer.
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

#[test]
fn test_checkpoint_lowers_peak_memory() {
    const ROWS: usize = 256;
    const WIDTH: usize = 16;
    // The schedule's unit, one layer's stored input: a [256, 16] f32 activation.
    const UNIT: usize = ROWS * WIDTH * 4;
    const WEIGHT: usize = WIDTH * WIDTH * 4;
    let n = 15;
    let rng = Generator::new(40);
    let layers: Vec<Rc<Product>> = (0..n)
        .map(|_| {
            let noise = random_array(&[WIDTH, WIDTH], &rng).mapv(|v| (0.05 * v) as f32);
            Rc::new(Product {
                weight: Tensor::param(Array2::<f32>::eye(WIDTH).into_dyn() + noise),
            })
        })
        .collect();
    let x = data::<f32>(&[ROWS, WIDTH], 41);
    // Bytes above the start: (held after forward, forward peak, overall peak).
    let measure = |budget: usize| {
        layers.iter().for_each(|layer| layer.zero_grad());
        let base = live_bytes();
        reset_peak();
        let output = checkpoint_sequential(&layers, &x, budget, &[]).unwrap();
        let (held, forward_peak) = (live_bytes() - base, peak_bytes() - base);
        output.sum_all().backward();
        (held, forward_peak, peak_bytes() - base)
    };
    let (plain_held, plain_forward, plain_peak) = measure(n);
    let (held, forward_peak, peak) = measure(5);
    assert!(2 * held < plain_held, "held {held} vs plain {plain_held}");
    assert!(2 * forward_peak < plain_forward);
    assert!(peak < plain_peak, "peak {peak} vs plain {plain_peak}");

    // Agreement with the model, in units of one stored input. Held: the k − 1 stored inputs
    // and the last segment's inputs (x predates the measurement, the output is counted: they
    // cancel), exactly. Peak: between the model's peak and 4 units more — the output, the
    // rerun's output, the gradients in flight — plus the weights' gradients.
    let schedule = checkpoint_schedule(n, 5).unwrap();
    let sizes = segment_sizes(n, &schedule).unwrap();
    let predicted_peak = schedule_cost(n, &schedule).unwrap().peak_layers;
    assert_eq!(held, (sizes.len() - 1 + sizes[sizes.len() - 1]) * UNIT);
    assert_eq!(plain_held, n * UNIT);
    let window = |model: usize| model * UNIT..=(model + 4) * UNIT + n * WEIGHT;
    assert!(
        window(predicted_peak).contains(&peak),
        "peak {} units",
        peak / UNIT
    );
    assert!(
        window(n).contains(&plain_peak),
        "plain peak {} units",
        plain_peak / UNIT
    );

    // One checkpoint around the whole stack: its forward pass keeps no activations, at most
    // one layer's input and output at a time, where the plain forward pass keeps all 15.
    let base = live_bytes();
    reset_peak();
    let stack = layers.clone();
    let f = move |xs: &[Tensor<f32>]| stack.iter().fold(xs[0].clone(), |h, l| l.forward(&h));
    let _output = checkpoint(f, from_ref(&x), &parameters(&layers), &[]);
    assert!(
        peak_bytes() - base <= 2 * UNIT,
        "{} bytes",
        peak_bytes() - base
    );
}
