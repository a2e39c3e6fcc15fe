//! [`Dropout`]: zeroes random elements while training, from a replayable generator.

use std::cell::Cell;

use ndarray::{ArrayD, IxDyn, Zip};

use super::Module;
use crate::{Element, Generator, Result, Tensor, TensorError};

/// Inverted dropout: while training, each element is kept with probability `1 − p` and
/// scaled by `1/(1 − p)`, or set to zero; in evaluation mode, or when `p = 0`, the layer is
/// the identity.
///
/// The keep-mask comes from the layer's [`Generator`], one uniform draw per element in
/// row-major order (kept when the draw is `≥ p`), so after a forward pass the stream has
/// advanced by exactly the number of elements. Setting the generator back to a saved
/// [`state`](Generator::state) and running the same input again draws the same mask: what
/// activation checkpointing does when it reruns a segment. Nothing is drawn in evaluation
/// mode or when `p = 0`.
///
/// A new layer is in training mode.
///
/// ```
/// use tl_tensor::nn::{Dropout, Module};
/// use tl_tensor::{Generator, Tensor};
/// let dropout = Dropout::new(0.5, Generator::new(0))?;
/// let y: Tensor<f32> = dropout.forward(&Tensor::ones(&[1000]));
/// // Kept elements are scaled by 1/(1 − 0.5) = 2, the others are 0.
/// assert!(y.to_vec().iter().all(|&v| v == 0.0 || v == 2.0));
/// Module::<f32>::set_training(&dropout, false);
/// assert_eq!(dropout.forward(&Tensor::<f32>::ones(&[3])).to_vec(), vec![1.0; 3]);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
#[derive(Debug)]
pub struct Dropout {
    p: f64,
    rng: Generator,
    training: Cell<bool>,
}

impl Dropout {
    /// A dropout layer zeroing elements with probability `p`, drawing from `rng` (a shared
    /// handle: the caller may keep a clone to save and restore its state).
    ///
    /// # Errors
    /// [`TensorError::InvalidArgument`] unless `0 ≤ p < 1`.
    pub fn new(p: f64, rng: Generator) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(TensorError::InvalidArgument {
                name: "dropout p",
                value: p.to_string(),
                reason: "must be in [0, 1)".into(),
            });
        }
        Ok(Self {
            p,
            rng,
            training: Cell::new(true),
        })
    }

    /// The probability of zeroing an element.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// The generator the masks are drawn from (a handle on the same stream).
    pub fn generator(&self) -> &Generator {
        &self.rng
    }

    /// Whether the layer is in training mode (drawing masks).
    pub fn is_training(&self) -> bool {
        self.training.get()
    }

    /// Dropout of rows `first_row..first_row + x.shape()[0]` of a tensor of `total_rows`
    /// rows (each row shaped as the rest of `x`'s axes): the mask is those rows of the mask
    /// [`forward`](Module::forward) would draw for the whole tensor, and the stream
    /// advances past the whole tensor's draws. The rows of the whole tensor can so be
    /// spread over several callers holding handles on copies of one stream (sequence
    /// parallelism's ranks, each holding its rows of the tokens): each applies the whole
    /// tensor's mask to its rows, and their streams stay in step.
    ///
    /// The draws before and after this caller's rows are made and discarded (xoshiro has
    /// no jump by an arbitrary count): as many draws as the whole tensor's, no memory for
    /// the rows of others.
    ///
    /// # Panics
    /// If `x` has no axis, or its rows do not fit in `total_rows` from `first_row`.
    ///
    /// ```
    /// use tl_tensor::nn::{Dropout, Module};
    /// use tl_tensor::{Generator, Tensor};
    /// let whole = Dropout::new(0.5, Generator::new(3))?;
    /// let mask: Tensor<f32> = whole.forward(&Tensor::ones(&[4, 2]));
    /// let part = Dropout::new(0.5, Generator::new(3))?;
    /// let rows = part.forward_rows(&Tensor::<f32>::ones(&[2, 2]), 1, 4);
    /// assert_eq!(rows.to_vec(), mask.to_vec()[2..6]);
    /// assert_eq!(part.generator().state(), whole.generator().state());
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn forward_rows<E: Element>(
        &self,
        x: &Tensor<E>,
        first_row: usize,
        total_rows: usize,
    ) -> Tensor<E> {
        let shape = x.shape();
        let (&rows, row_shape) = shape
            .split_first()
            .expect("Dropout::forward_rows: a 0-dimensional tensor has no rows");
        assert!(
            first_row + rows <= total_rows,
            "Dropout::forward_rows: rows {first_row}..{} of a tensor of {total_rows} rows",
            first_row + rows
        );
        if !self.training.get() || self.p == 0.0 || !crate::meta::computes(&[x]) {
            return Module::forward(self, x);
        }
        let row_len: usize = row_shape.iter().product();
        let skip = |rows: usize| self.rng.skip((rows * row_len) as u64);
        skip(first_row);
        let output = Module::forward(self, x);
        skip(total_rows - first_row - rows);
        output
    }

    /// Advances the stream past the draws a training [`forward`](Module::forward) of a
    /// tensor of `elements` elements makes, without drawing a mask: nothing in evaluation
    /// mode, when `p = 0` or in meta mode, one draw per element otherwise. A caller that
    /// runs only the later layers of a model whose layers share one stream (a pipeline
    /// stage) so finds the masks those layers draw when the whole model runs.
    ///
    /// ```
    /// use tl_tensor::nn::{Dropout, Module};
    /// use tl_tensor::{Generator, Tensor};
    /// let whole = Dropout::new(0.5, Generator::new(3))?;
    /// let _first: Tensor<f32> = whole.forward(&Tensor::ones(&[4, 2]));
    /// let second: Tensor<f32> = whole.forward(&Tensor::ones(&[4, 2]));
    /// let later = Dropout::new(0.5, Generator::new(3))?;
    /// later.skip(8);
    /// assert_eq!(later.forward(&Tensor::<f32>::ones(&[4, 2])).to_vec(), second.to_vec());
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn skip(&self, elements: usize) {
        if self.training.get() && self.p > 0.0 && !crate::meta::is_meta_mode() {
            self.rng.skip(elements as u64);
        }
    }
}

/// The memory meter's label of a dropout mask.
pub const DROPOUT_MASK_LABEL: &str = "dropout mask";

impl<E: Element> Module<E> for Dropout {
    /// `x · mask / (1 − p)` while training with `p > 0`; `x` itself otherwise.
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        if !self.training.get() || self.p == 0.0 {
            return x.clone();
        }
        let scale = E::from_f64(1.0 / (1.0 - self.p));
        let shape = x.shape();
        // Kept as a tensor so the memory meter counts it among the saved activations. No
        // draws for a meta input.
        let mask_label = crate::memory::label_scope(DROPOUT_MASK_LABEL);
        let mask = if crate::meta::computes(&[x]) {
            // A standard-layout mask: `from_shape_simple_fn` fills it in row-major order,
            // which fixes which draw lands on which element.
            Tensor::from_array(ArrayD::from_shape_simple_fn(IxDyn(&shape), || {
                if self.rng.next_f64() >= self.p {
                    scale
                } else {
                    E::zero()
                }
            }))
        } else {
            Tensor::meta(&shape)
        };
        drop(mask_label);
        let applied = mask.clone();
        let value = || &*x.value() * &*applied.value();
        Tensor::from_op_shaped(&shape, value, &[x], move |mut grad_out| {
            Zip::from(&mut grad_out)
                .and(&*mask.value())
                .for_each(|g, &m| *g *= m);
            vec![Some(grad_out)]
        })
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        Vec::new()
    }

    fn set_training(&self, training: bool) {
        self.training.set(training);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forward(dropout: &Dropout, x: &Tensor<f32>) -> Vec<f32> {
        dropout.forward(x).to_vec()
    }

    #[test]
    fn p_outside_zero_to_one_is_rejected() {
        for p in [-0.1, 1.0, 1.5, f64::NAN] {
            assert!(
                matches!(
                    Dropout::new(p, Generator::new(0)),
                    Err(TensorError::InvalidArgument {
                        name: "dropout p",
                        ..
                    })
                ),
                "p = {p}"
            );
        }
        assert!(Dropout::new(0.0, Generator::new(0)).is_ok());
    }

    #[test]
    fn masks_replay_from_a_saved_state() {
        let dropout = Dropout::new(0.3, Generator::new(5)).unwrap();
        let x = Tensor::ones(&[4, 8]);
        let saved = dropout.generator().state();
        let first = forward(&dropout, &x);
        let second = forward(&dropout, &x);
        assert_ne!(first, second, "consecutive calls draw new masks");
        dropout.generator().set_state(&saved);
        assert_eq!(forward(&dropout, &x), first);
        assert_eq!(forward(&dropout, &x), second);
    }

    #[test]
    fn the_stream_advances_by_the_element_count() {
        let dropout = Dropout::new(0.5, Generator::new(9)).unwrap();
        let reference = Generator::new(9);
        forward(&dropout, &Tensor::ones(&[3, 7]));
        for _ in 0..21 {
            reference.next_u64();
        }
        assert_eq!(dropout.generator().next_u64(), reference.next_u64());
    }

    #[test]
    fn rows_of_a_whole_mask_tile_it_and_keep_the_streams_in_step() {
        let whole = Dropout::new(0.3, Generator::new(8)).unwrap();
        let expected = forward(&whole, &Tensor::ones(&[6, 5]));
        let mut tiled = Vec::new();
        for first_row in [0, 2, 4] {
            let part = Dropout::new(0.3, Generator::new(8)).unwrap();
            tiled.extend(
                part.forward_rows(&Tensor::<f32>::ones(&[2, 5]), first_row, 6)
                    .to_vec(),
            );
            assert_eq!(part.generator().state(), whole.generator().state());
        }
        assert_eq!(tiled, expected);
    }

    #[test]
    fn eval_mode_and_p_zero_are_the_identity_and_draw_nothing() {
        let x = Tensor::<f32>::from_vec(vec![1.0, -2.0, 3.0], &[3]).unwrap();
        let rng = Generator::new(1);
        let before = rng.state();
        let dropout = Dropout::new(0.5, rng.clone()).unwrap();
        Module::<f32>::set_training(&dropout, false);
        assert!(!dropout.is_training());
        assert_eq!(forward(&dropout, &x), vec![1.0, -2.0, 3.0]);
        let no_drop = Dropout::new(0.0, rng.clone()).unwrap();
        assert_eq!(forward(&no_drop, &x), vec![1.0, -2.0, 3.0]);
        assert_eq!(rng.state(), before);
    }

    #[test]
    fn skipping_draws_what_a_forward_draws_and_only_while_it_would() {
        let x = Tensor::<f32>::ones(&[3, 7]);
        let (whole, later) = (
            Dropout::new(0.4, Generator::new(6)).unwrap(),
            Dropout::new(0.4, Generator::new(6)).unwrap(),
        );
        forward(&whole, &x);
        later.skip(21);
        assert_eq!(later.generator().state(), whole.generator().state());
        assert_eq!(forward(&later, &x), forward(&whole, &x));
        // In evaluation mode, at p = 0 and in meta mode, a forward draws nothing: neither
        // does a skip.
        let before = later.generator().state();
        Module::<f32>::set_training(&later, false);
        later.skip(21);
        Module::<f32>::set_training(&later, true);
        Dropout::new(0.0, later.generator().clone())
            .unwrap()
            .skip(21);
        {
            let _meta = crate::meta::meta_mode();
            later.skip(21);
        }
        assert_eq!(later.generator().state(), before);
    }

    #[test]
    fn kept_fraction_and_mean_are_preserved() {
        let dropout = Dropout::new(0.25, Generator::new(2)).unwrap();
        let y = forward(&dropout, &Tensor::ones(&[20_000]));
        let kept = y.iter().filter(|&&v| v != 0.0).count() as f64 / 20_000.0;
        // Binomial standard deviation: sqrt(0.75·0.25/20000) ≈ 0.003.
        assert!((kept - 0.75).abs() < 0.015, "kept fraction {kept}");
        let scale = 1.0 / 0.75f32;
        assert!(y.iter().all(|&v| v == 0.0 || v == scale));
    }

    #[test]
    fn the_gradient_is_the_mask() {
        let dropout = Dropout::new(0.5, Generator::new(4)).unwrap();
        let x = Tensor::<f64>::param(ArrayD::from_elem(ndarray::IxDyn(&[50]), 3.0));
        let y = dropout.forward(&x);
        y.sum_all().backward();
        // dy/dx = mask: 2 where kept (y = 6), 0 where dropped (y = 0).
        let grad = x.grad().unwrap();
        for (&g, &v) in grad.iter().zip(y.to_vec().iter()) {
            assert_eq!(g, if v == 0.0 { 0.0 } else { 2.0 });
        }
    }
}
