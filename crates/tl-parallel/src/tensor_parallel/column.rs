//! [`ColumnParallelLinear`]: a linear layer split over its output features. Followed by a
//! [`RowParallelLinear`](super::RowParallelLinear) (an MLP, attention's projections), it
//! communicates once each way: at its start backward, at the row layer's end forward.

use tl_tensor::Tensor;
use tl_tensor::nn::{Linear, Module};

use crate::ddp::GradElement;
use crate::error::Result;

use super::group::TensorParallel;
use super::slices::{check_bias, check_weight, param_joined, slice_of};

/// A linear layer whose weight is split over its output features: each rank computes its
/// columns of the output from the whole input.
///
/// Forward: the input passes [`copy_to`](TensorParallel::copy_to) (the gradient is
/// all-reduced backward), or under sequence parallelism
/// [`gather_sequence`](TensorParallel::gather_sequence) (each rank holds `[s/t, in]`;
/// all-gathered forward, reduce-scattered backward); then `x·W_r + b_r`, giving
/// `[.., out/t]`; with [`with_gather_output`](Self::with_gather_output) the ranks' columns
/// are gathered into `[.., out]` on every rank.
///
/// ```
/// use tl_collective::Single;
/// use tl_parallel::{ColumnParallelLinear, RowParallelLinear, TensorParallel};
/// use tl_tensor::nn::{Linear, Module};
/// use tl_tensor::{Generator, Tensor};
///
/// let tp = TensorParallel::new(Box::new(Single::new())); // each rank: its group's communicator
/// let rng = Generator::new(0);
/// let (up, down) = (Linear::<f64>::new(4, 8, true, &rng), Linear::<f64>::new(8, 4, true, &rng));
/// let column = ColumnParallelLinear::from_full(up.weight(), up.bias(), &tp)?;
/// let row = RowParallelLinear::from_full(down.weight(), down.bias(), &tp)?;
/// let x = Tensor::ones(&[3, 4]);
/// let y = row.forward(&column.forward(&x)?.tanh())?; // one all-reduce
/// assert_eq!(y.to_vec(), down.forward(&up.forward(&x).tanh()).to_vec());
/// # Ok::<(), tl_parallel::ParallelError>(())
/// ```
pub struct ColumnParallelLinear<E: GradElement> {
    tp: TensorParallel,
    local: Linear<E>,
    gather_output: bool,
    sequence_parallel: bool,
}

impl<E: GradElement> ColumnParallelLinear<E> {
    /// This rank's slice of the whole layer `weight` (`[in, out]`, as [`Linear`] stores
    /// it) and `bias` (`[out]`): columns [`split`](TensorParallel::split)`(out)` of both.
    ///
    /// # Errors
    /// [`ParallelError::Indivisible`](crate::ParallelError::Indivisible) if `t` does not
    /// divide `out`.
    ///
    /// # Panics
    /// If `weight` is not 2-D or `bias` is not `[out]`.
    pub fn from_full(
        weight: &Tensor<E>,
        bias: Option<&Tensor<E>>,
        tp: &TensorParallel,
    ) -> Result<Self> {
        Self::from_full_parts(&[(weight, bias)], tp)
    }

    /// One layer made of several whole layers side by side on the same input (the gate and
    /// up projections of a SwiGLU MLP, attention's query, key and value): this rank's slice
    /// of each, their columns concatenated in order, so that one copy-to serves them all.
    /// The output is `[.., Σ out_i/t]`: part `i`'s columns follow part `i − 1`'s (split it
    /// with [`Tensor::narrow`]).
    ///
    /// # Errors
    /// As [`from_full`](Self::from_full), for each part.
    ///
    /// # Panics
    /// If `parts` is empty, a weight is not 2-D, the weights' input sizes differ, some parts
    /// have a bias and others not, or a bias does not fit its weight.
    pub fn from_full_parts(
        parts: &[(&Tensor<E>, Option<&Tensor<E>>)],
        tp: &TensorParallel,
    ) -> Result<Self> {
        assert!(!parts.is_empty(), "ColumnParallelLinear: no weight given");
        let in_features = check_weight("ColumnParallelLinear", parts[0].0)[0];
        let with_bias = parts[0].1.is_some();
        let mut weights = Vec::new();
        let mut biases = Vec::new();
        for &(weight, bias) in parts {
            let [inputs, outputs] = check_weight("ColumnParallelLinear", weight);
            assert_eq!(
                (inputs, bias.is_some()),
                (in_features, with_bias),
                "ColumnParallelLinear: every part needs the same input size and a bias alike"
            );
            let columns = tp.split("output features", outputs)?;
            weights.push(slice_of(weight, 1, columns.clone()));
            if let Some(bias) = bias {
                check_bias("ColumnParallelLinear", bias, outputs);
                biases.push(slice_of(bias, 0, columns));
            }
        }
        let weight = param_joined(&weights, 1, parts[0].0);
        let bias = with_bias.then(|| param_joined(&biases, 0, parts[0].1.expect("a bias")));
        Ok(Self {
            tp: tp.clone(),
            local: Linear::from_parts(weight, bias),
            gather_output: false,
            sequence_parallel: false,
        })
    }

    /// Gathers the ranks' columns into the whole output (`[.., out]` on every rank), or not
    /// (the default, `[.., out/t]`, for a row-parallel layer to follow).
    pub fn with_gather_output(mut self, gather: bool) -> Self {
        self.gather_output = gather;
        self
    }

    /// Takes each rank's rows of the sequence (axis 0) and all-gathers them (sequence
    /// parallelism), or takes the whole input on every rank (the default).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// `x·W + b` restricted to this rank's columns (see the type's docs).
    ///
    /// # Errors
    /// [`ParallelError::Collective`](crate::ParallelError::Collective) if a forward
    /// collective fails.
    ///
    /// # Panics
    /// If the last axis of `x` is not `in`.
    pub fn forward(&self, x: &Tensor<E>) -> Result<Tensor<E>> {
        let input = match self.sequence_parallel {
            true => self.tp.gather_sequence(x)?,
            false => self.tp.copy_to(x),
        };
        let output = self.local.forward(&input);
        match self.gather_output {
            true => self.tp.gather_last(&output),
            false => Ok(output),
        }
    }

    /// This rank's weight, `[in, out/t]`.
    pub fn weight(&self) -> &Tensor<E> {
        self.local.weight()
    }

    /// This rank's bias, `[out/t]`, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor<E>> {
        self.local.bias()
    }

    /// The parameters this rank trains: its weight and bias.
    pub fn parameters(&self) -> Vec<Tensor<E>> {
        self.local.parameters()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor_parallel::slices::tests::{rank_1_of_2, weight};
    use tl_tensor::memory::{self, Kind};
    use tl_tensor::ndarray::{Axis, Slice as Span, concatenate};

    #[test]
    fn fused_parts_put_each_parts_columns_after_the_previous_ones() {
        let (gate, up) = (weight(0.0), weight(0.5));
        let column =
            ColumnParallelLinear::from_full_parts(&[(&gate, None), (&up, None)], &rank_1_of_2());
        let column = column.unwrap();
        let own = |w: &Tensor<f64>| w.value().slice_axis(Axis(1), Span::from(3..6)).to_owned();
        let joined = concatenate(Axis(1), &[own(&gate).view(), own(&up).view()]).unwrap();
        assert_eq!(column.weight().to_array(), joined);
        assert!(column.bias().is_none());
    }

    #[test]
    fn slices_of_meta_weights_are_meta_weights_of_the_same_unit() {
        let whole = {
            let _unit = memory::owner_scope(Some(5));
            Tensor::<f32>::meta_param(&[4, 6])
        };
        let column = ColumnParallelLinear::from_full(&whole, None, &rank_1_of_2()).unwrap();
        let weight = column.weight();
        assert!(weight.is_meta() && weight.requires_grad());
        assert_eq!(weight.shape(), [4, 3]);
        let tag = weight.memory_tag();
        assert_eq!((tag.kind, tag.owner), (Kind::Weights, Some(5)));
    }

    #[test]
    #[should_panic(expected = "ColumnParallelLinear: every part needs the same input size")]
    fn fused_parts_must_share_their_input() {
        let other = Tensor::<f64>::zeros(&[2, 6]);
        let _ = ColumnParallelLinear::from_full_parts(
            &[(&weight(0.0), None), (&other, None)],
            &rank_1_of_2(),
        );
    }
}
