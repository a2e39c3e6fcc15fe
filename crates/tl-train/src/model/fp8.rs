//! The projections of a block: each a named product for checkpoint keep policies, through
//! tl-precision's [`fp8_matmul`] when the model trains in fp8, each with its own delayed
//! scales.
//!
//! Every block has seven fp8 layers, in the order of its parameters: `wq`, `wk`, `wv`, `wo`,
//! `w1`, `w3`, `w2`; block `i`'s are layers `7i..7i + 7` of the run's [`Fp8State`]. The
//! embedding and the head stay in the run's precision, as Transformer Engine leaves the
//! first and last layers in higher precision.

use std::cell::RefCell;
use std::rc::Rc;

use tl_precision::{Fp8State, fp8_matmul};
use tl_recompute::keep_product;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Element, Tensor};

/// The fp8 layers of one block.
pub const LAYERS_PER_BLOCK: usize = 7;
/// Their names, in layer order.
pub const LAYER_NAMES: [&str; LAYERS_PER_BLOCK] = ["wq", "wk", "wv", "wo", "w1", "w3", "w2"];

/// A module's projections: where in the block they stand (`offset` into [`LAYER_NAMES`]),
/// and where they find their fp8 scales: the run's state and the index of the block's first
/// layer, or nothing (plain projections).
pub(crate) struct Fp8Slot {
    offset: usize,
    state: RefCell<Option<(Rc<RefCell<Fp8State>>, usize)>>,
}

impl Fp8Slot {
    /// The slot of a module whose first projection is the block's `offset`-th.
    pub(crate) fn new(offset: usize) -> Self {
        Self {
            offset,
            state: RefCell::new(None),
        }
    }

    /// Points the module's projections at the layers of `state` of the block whose first
    /// layer is `first` (or back to plain).
    pub(crate) fn set(&self, state: Option<(Rc<RefCell<Fp8State>>, usize)>) {
        *self.state.borrow_mut() = state;
    }

    /// `linear(x)` for the module's `j`-th projection: in fp8 when the slot is set, the plain
    /// (or autocast) product otherwise. The result is named as the layer is in
    /// [`LAYER_NAMES`] for a checkpoint's keep policy (tl-recompute's `keep_product`): a
    /// checkpointed block whose policy names it keeps the product, and its rerun records the
    /// product's node without multiplying.
    pub(crate) fn project<E: Element>(
        &self,
        j: usize,
        linear: &Linear<E>,
        x: &Tensor<E>,
    ) -> Tensor<E> {
        let layer = self.offset + j;
        // The product's output is labelled on the memory meter by the projection's name.
        let _label = tl_tensor::memory::label_scope(LAYER_NAMES[layer]);
        keep_product(LAYER_NAMES[layer], || match &*self.state.borrow() {
            Some((state, first)) => fp8_matmul(x, linear.weight(), state, first + layer),
            None => linear.forward(x),
        })
    }
}
