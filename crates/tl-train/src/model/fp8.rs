//! fp8 projections: the model's linear layers through tl-precision's [`fp8_matmul`] when the
//! model trains in fp8, each with its own delayed scales.
//!
//! Every block has seven fp8 layers, in the order of its parameters: `wq`, `wk`, `wv`, `wo`,
//! `w1`, `w3`, `w2`; block `i`'s are layers `7i..7i + 7` of the run's [`Fp8State`]. The
//! embedding and the head stay in the run's precision, as Transformer Engine leaves the
//! first and last layers in higher precision.

use std::cell::RefCell;
use std::rc::Rc;

use tl_precision::{Fp8State, fp8_matmul};
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Element, Tensor};

/// The fp8 layers of one block.
pub const LAYERS_PER_BLOCK: usize = 7;
/// Their names, in layer order.
pub const LAYER_NAMES: [&str; LAYERS_PER_BLOCK] = ["wq", "wk", "wv", "wo", "w1", "w3", "w2"];

/// Where a module's projections find their scales: the run's state and the index of the
/// module's first layer, or nothing (plain projections).
#[derive(Default)]
pub(crate) struct Fp8Slot(RefCell<Option<(Rc<RefCell<Fp8State>>, usize)>>);

impl Fp8Slot {
    /// Points the module's projections at layers `first..` of `state` (or back to plain).
    pub(crate) fn set(&self, state: Option<(Rc<RefCell<Fp8State>>, usize)>) {
        *self.0.borrow_mut() = state;
    }

    /// `linear(x)`: in fp8 as the module's `j`-th layer when the slot is set, the plain (or
    /// autocast) product otherwise.
    pub(crate) fn project<E: Element>(
        &self,
        j: usize,
        linear: &Linear<E>,
        x: &Tensor<E>,
    ) -> Tensor<E> {
        match &*self.0.borrow() {
            Some((state, first)) => fp8_matmul(x, linear.weight(), state, first + j),
            None => linear.forward(x),
        }
    }
}
