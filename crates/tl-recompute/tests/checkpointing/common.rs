//! Layers and runs shared by the tests: a block that logs its calls, a dropout that logs its
//! masks, and plain and checkpointed training steps whose gradients are compared bit for bit.

use std::cell::RefCell;
use std::rc::Rc;

use tl_recompute::checkpoint_sequential_with;
use tl_tensor::losses::mse;
use tl_tensor::nn::{Dropout, Linear, Module};
use tl_tensor::testing::random_array;
use tl_tensor::{Element, Generator, Tensor, is_grad_enabled};

/// Layers of mixed kinds, as a model holds them.
pub type Stack<E> = Vec<Rc<dyn Module<E>>>;

/// `tanh(x·W + b)`, remembering for each forward call whether grad mode was on.
pub struct Block<E: Element> {
    linear: Linear<E>,
    calls: RefCell<Vec<bool>>,
}

impl<E: Element> Block<E> {
    pub fn new(width: usize, init: &Generator) -> Self {
        Self {
            linear: Linear::new(width, width, true, init),
            calls: RefCell::new(Vec::new()),
        }
    }

    /// Grad mode of each forward call so far, in order.
    pub fn calls(&self) -> Vec<bool> {
        self.calls.borrow().clone()
    }

    pub fn forget_calls(&self) {
        self.calls.borrow_mut().clear();
    }
}

impl<E: Element> Module<E> for Block<E> {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        self.calls.borrow_mut().push(is_grad_enabled());
        self.linear.forward(x).tanh()
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        self.linear.parameters()
    }
}

/// `n` blocks of `width` features, initialised from `seed`.
pub fn blocks<E: Element>(n: usize, width: usize, seed: u64) -> Vec<Rc<Block<E>>> {
    let init = Generator::new(seed);
    (0..n).map(|_| Rc::new(Block::new(width, &init))).collect()
}

/// A constant (data) tensor of standard normal draws.
pub fn data<E: Element>(shape: &[usize], seed: u64) -> Tensor<E> {
    let array = random_array(shape, &Generator::new(seed));
    Tensor::from_array(array.mapv(E::from_f64))
}

/// Every parameter of `layers`, in layer order.
pub fn parameters<E: Element, L: Module<E>>(layers: &[L]) -> Vec<Tensor<E>> {
    layers.iter().flat_map(L::parameters).collect()
}

/// The bits of a tensor's gradient, `None` when it has none: equal means bit-for-bit equal.
pub fn grad_bits<E: Element>(tensor: &Tensor<E>) -> Option<Vec<u64>> {
    tensor
        .grad()
        .map(|grad| grad.iter().map(|&x| Element::to_f64(x).to_bits()).collect())
}

pub fn value_bits<E: Element>(tensor: &Tensor<E>) -> Vec<u64> {
    tensor
        .to_vec()
        .iter()
        .map(|&x| Element::to_f64(x).to_bits())
        .collect()
}

/// One training step's results: the loss bits and the gradient bits of each watched tensor.
#[derive(Debug, PartialEq)]
pub struct Step {
    pub loss: u64,
    pub grads: Vec<Option<Vec<u64>>>,
}

/// Forward through `layers` (checkpointed on `schedule`, or plain for `None`), MSE against
/// `target`, backward; returns the loss and the gradients of `watched`, which it zeroes
/// first.
pub fn step<E: Element, L: Module<E> + Clone + 'static>(
    layers: &[L],
    x: &Tensor<E>,
    target: &Tensor<E>,
    schedule: Option<&[usize]>,
    rngs: &[Generator],
    watched: &[Tensor<E>],
) -> Step {
    for tensor in watched {
        tensor.zero_grad();
    }
    let output = match schedule {
        Some(schedule) => checkpoint_sequential_with(layers, x, schedule, rngs, false).unwrap(),
        None => layers.iter().fold(x.clone(), |h, layer| layer.forward(&h)),
    };
    let loss = mse(&output, target);
    loss.backward();
    Step {
        loss: loss.item().to_f64().to_bits(),
        grads: watched.iter().map(grad_bits).collect(),
    }
}

/// Dropout that logs the keep-mask of every call (an element is kept when it is not zeroed;
/// inputs are tanh outputs of random data, never exactly 0).
pub struct LoggedDropout {
    dropout: Dropout,
    masks: RefCell<Vec<Vec<bool>>>,
}

impl LoggedDropout {
    pub fn new(p: f64, rng: Generator) -> Self {
        Self {
            dropout: Dropout::new(p, rng).unwrap(),
            masks: RefCell::new(Vec::new()),
        }
    }

    pub fn masks(&self) -> Vec<Vec<bool>> {
        self.masks.borrow().clone()
    }

    pub fn forget_masks(&self) {
        self.masks.borrow_mut().clear();
    }
}

impl<E: Element> Module<E> for LoggedDropout {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let y = self.dropout.forward(x);
        let mask = y.to_vec().iter().map(|&v| v != E::zero()).collect();
        self.masks.borrow_mut().push(mask);
        y
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        Vec::new()
    }
}

/// Adds a fresh uniform draw to every element on every call: randomness that checkpointing
/// can replay only if the generator is passed as an rng.
pub struct Noise {
    rng: Generator,
}

impl Noise {
    pub fn new(rng: Generator) -> Self {
        Self { rng }
    }
}

impl<E: Element> Module<E> for Noise {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let noise = x.value().mapv(|_| E::from_f64(self.rng.next_f64()));
        x + &Tensor::from_array(noise)
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        Vec::new()
    }
}
