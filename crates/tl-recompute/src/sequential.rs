//! [`checkpoint_sequential`]: a stack of layers cut into segments by a schedule, every segment
//! but the last one checkpointed.
//!
//! A checkpoint node must own what it reruns during backward, long after the call that made
//! it returned, so the layers are taken as cheap shared handles: any `L: Module<E> + Clone`,
//! which is `Rc<dyn Module<E>>` or `Rc<Block>` (tl-tensor implements `Module` for `Rc<M>`), or
//! a [`SharedLayer`] of an `Rc<Sequential>`. Cloning a handle never copies a parameter.

use std::rc::Rc;

use tl_tensor::nn::{Module, Sequential};
use tl_tensor::{Element, Generator, Tensor};

use crate::Result;
use crate::checkpoint::{CheckpointOptions, checkpoint_with};
use crate::schedule::{checkpoint_schedule, segment_sizes};

/// Runs `x` through `layers` under [`checkpoint_schedule`]`(layers.len(), mem_budget_layers)`:
/// every segment but the last through [`checkpoint`](crate::checkpoint), with the segment's
/// layers' parameters as parents, the last one normally (checkpointing it would rerun it
/// right after its own forward pass, for nothing).
///
/// `rngs` are the generators the layers draw from (dropout), replayed in every rerun.
///
/// # Errors
/// As [`checkpoint_schedule`]: no layers, a zero budget, or a budget too small for any
/// schedule.
///
/// ```
/// use std::rc::Rc;
/// use tl_recompute::checkpoint_sequential;
/// use tl_tensor::nn::{Dropout, Linear, Module};
/// use tl_tensor::{Generator, Tensor};
///
/// let init = Generator::new(0);
/// let dropout_rng = Generator::new(1);
/// let mut layers: Vec<Rc<dyn Module<f32>>> = Vec::new();
/// for _ in 0..6 {
///     layers.push(Rc::new(Linear::new(8, 8, true, &init)));
///     layers.push(Rc::new(Dropout::new(0.1, dropout_rng.clone())?));
/// }
/// let x = Tensor::<f32>::ones(&[4, 8]); // data: no gradient
/// // 12 layers in 5 units of memory: segments [0..5), [5..9), [9..12), the last not rerun.
/// let y = checkpoint_sequential(&layers, &x, 5, &[dropout_rng])?;
/// y.sum_all().backward();
/// assert!(layers.iter().flat_map(|layer| layer.parameters()).all(|p| p.grad().is_some()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn checkpoint_sequential<E, L>(
    layers: &[L],
    x: &Tensor<E>,
    mem_budget_layers: usize,
    rngs: &[Generator],
) -> Result<Tensor<E>>
where
    E: Element,
    L: Module<E> + Clone + 'static,
{
    let schedule = checkpoint_schedule(layers.len(), mem_budget_layers)?;
    checkpoint_sequential_with(layers, x, &schedule, rngs, false)
}

/// [`checkpoint_sequential`] with an explicit schedule (segment starts, e.g. from
/// [`uniform_schedule`](crate::uniform_schedule)), and optionally in verified mode, where a
/// segment whose rerun differs from its forward pass is reported as
/// [`RecomputeMismatch`](crate::RecomputeError::RecomputeMismatch) naming
/// `"segment {index} (layers {start}..{end})"` (see
/// [`backward_verified`](crate::backward_verified)).
///
/// # Errors
/// [`InvalidSchedule`](crate::RecomputeError::InvalidSchedule) unless `schedule` starts at 0,
/// increases strictly and stays below `layers.len()`;
/// [`InvalidArgument`](crate::RecomputeError::InvalidArgument) for an empty stack.
pub fn checkpoint_sequential_with<E, L>(
    layers: &[L],
    x: &Tensor<E>,
    schedule: &[usize],
    rngs: &[Generator],
    verify: bool,
) -> Result<Tensor<E>>
where
    E: Element,
    L: Module<E> + Clone + 'static,
{
    let sizes = segment_sizes(layers.len(), schedule)?;
    let mut hidden = x.clone();
    let mut start = 0;
    for (index, &size) in sizes.iter().enumerate() {
        let end = start + size;
        let segment = &layers[start..end];
        let is_last = index + 1 == sizes.len();
        hidden = if is_last {
            run_layers(segment, &hidden)
        } else {
            let params: Vec<Tensor<E>> = segment.iter().flat_map(L::parameters).collect();
            let options = CheckpointOptions {
                verify,
                segment: format!("segment {index} (layers {start}..{end})"),
            };
            let owned = segment.to_vec();
            let f = move |inputs: &[Tensor<E>]| run_layers(&owned, &inputs[0]);
            checkpoint_with(f, &[hidden], &params, rngs, &options)
        };
        start = end;
    }
    Ok(hidden)
}

fn run_layers<E: Element, L: Module<E>>(layers: &[L], x: &Tensor<E>) -> Tensor<E> {
    layers
        .iter()
        .fold(x.clone(), |hidden, layer| layer.forward(&hidden))
}

/// A handle on one layer of a shared [`Sequential`], so the layers of a `Sequential` can be
/// checkpointed: `checkpoint_sequential(&SharedLayer::all(&model), ..)`.
///
/// ```
/// use std::rc::Rc;
/// use tl_recompute::{checkpoint_sequential, SharedLayer};
/// use tl_tensor::nn::{Linear, Module, Sequential};
/// use tl_tensor::{Generator, Tensor};
/// let rng = Generator::new(0);
/// let model = Rc::new(Sequential::<f64>::new(
///     (0..4).map(|_| Box::new(Linear::new(3, 3, true, &rng)) as Box<dyn Module<f64>>).collect(),
/// ));
/// let x = Tensor::<f64>::ones(&[2, 3]);
/// let y = checkpoint_sequential(&SharedLayer::all(&model), &x, 3, &[])?;
/// assert_eq!(y.to_vec(), model.forward(&x).to_vec());
/// # Ok::<(), tl_recompute::RecomputeError>(())
/// ```
pub struct SharedLayer<E: Element = f32> {
    model: Rc<Sequential<E>>,
    index: usize,
}

impl<E: Element> Clone for SharedLayer<E> {
    fn clone(&self) -> Self {
        Self {
            model: Rc::clone(&self.model),
            index: self.index,
        }
    }
}

impl<E: Element> SharedLayer<E> {
    /// A handle on layer `index` of `model`.
    ///
    /// # Panics
    /// If `model` has no layer `index`.
    pub fn new(model: &Rc<Sequential<E>>, index: usize) -> Self {
        assert!(
            index < model.len(),
            "SharedLayer: layer {index} of a Sequential of {} layers",
            model.len()
        );
        Self {
            model: Rc::clone(model),
            index,
        }
    }

    /// Handles on every layer of `model`, in order.
    pub fn all(model: &Rc<Sequential<E>>) -> Vec<Self> {
        (0..model.len())
            .map(|index| Self::new(model, index))
            .collect()
    }

    fn layer(&self) -> &dyn Module<E> {
        &*self.model.layers()[self.index]
    }
}

impl<E: Element> Module<E> for SharedLayer<E> {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        self.layer().forward(x)
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        self.layer().parameters()
    }

    fn set_training(&self, training: bool) {
        self.layer().set_training(training);
    }
}
