//! [`RowParallelLinear`]: a linear layer split over its input features, whose ranks add
//! their partial outputs.

use tl_tensor::Tensor;
use tl_tensor::nn::{Linear, Module};

use crate::ddp::GradElement;
use crate::error::Result;

use super::group::TensorParallel;
use super::slices::{check_bias, check_weight, slice_param};

/// A linear layer whose weight is split over its input features: each rank takes its
/// columns of the input (a column-parallel layer's output) and makes a partial sum of the
/// whole output, which the ranks add.
///
/// Forward: `x_r·W_r` (`[.., in/t] → [.., out]`), then
/// [`reduce_from`](TensorParallel::reduce_from) (all-reduced forward, identity backward),
/// or under sequence parallelism [`scatter_sequence`](TensorParallel::scatter_sequence)
/// (reduce-scattered into each rank's rows of the sequence forward, all-gathered
/// backward); the bias, which every rank holds whole, is added after the sum, so it is
/// added once.
///
/// Under sequence parallelism each rank adds the bias to its own rows only, so its gradient
/// there is this rank's share: sum it over the group
/// ([`TensorParallel::all_reduce_gradients`] of
/// [`sequence_parallel_parameters`](Self::sequence_parallel_parameters)) before the update.
///
/// See [`ColumnParallelLinear`](super::ColumnParallelLinear) for an example.
pub struct RowParallelLinear<E: GradElement> {
    tp: TensorParallel,
    local: Linear<E>,
    bias: Option<Tensor<E>>,
    sequence_parallel: bool,
}

impl<E: GradElement> RowParallelLinear<E> {
    /// This rank's slice of the whole layer `weight` (`[in, out]`, as [`Linear`] stores
    /// it): rows [`split`](TensorParallel::split)`(in)`; and a copy of the whole `bias`
    /// (`[out]`).
    ///
    /// # Errors
    /// [`ParallelError::Indivisible`](crate::ParallelError::Indivisible) if `t` does not
    /// divide `in`.
    ///
    /// # Panics
    /// If `weight` is not 2-D or `bias` is not `[out]`.
    pub fn from_full(
        weight: &Tensor<E>,
        bias: Option<&Tensor<E>>,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let [inputs, outputs] = check_weight("RowParallelLinear", weight);
        let rows = tp.split("input features", inputs)?;
        let local = slice_param(weight, 0, rows);
        let bias = bias.map(|bias| {
            check_bias("RowParallelLinear", bias, outputs);
            slice_param(bias, 0, 0..outputs)
        });
        Ok(Self {
            tp: tp.clone(),
            local: Linear::from_parts(local, None),
            bias,
            sequence_parallel: false,
        })
    }

    /// Reduce-scatters the output into each rank's rows of the sequence (sequence
    /// parallelism), or all-reduces it whole (the default).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// The sum over the ranks of `x_r·W_r`, plus the bias (see the type's docs).
    ///
    /// # Errors
    /// [`ParallelError::Collective`](crate::ParallelError::Collective) if a forward
    /// collective fails; under sequence parallelism
    /// [`ParallelError::Indivisible`](crate::ParallelError::Indivisible) if `t` does not
    /// divide the sequence length (axis 0 of `x`).
    ///
    /// # Panics
    /// If the last axis of `x` is not `in/t`.
    pub fn forward(&self, x: &Tensor<E>) -> Result<Tensor<E>> {
        let partial = self.local.forward(x);
        let output = match self.sequence_parallel {
            true => self.tp.scatter_sequence(&partial)?,
            false => self.tp.reduce_from(&partial)?,
        };
        Ok(match &self.bias {
            Some(bias) => output.add(bias),
            None => output,
        })
    }

    /// This rank's weight, `[in/t, out]`.
    pub fn weight(&self) -> &Tensor<E> {
        self.local.weight()
    }

    /// The bias, `[out]`, the same on every rank.
    pub fn bias(&self) -> Option<&Tensor<E>> {
        self.bias.as_ref()
    }

    /// The parameters this rank trains: its weight and the bias.
    pub fn parameters(&self) -> Vec<Tensor<E>> {
        self.local
            .parameters()
            .into_iter()
            .chain(self.bias.clone())
            .collect()
    }

    /// The parameters whose gradient on this rank is a share to sum over the group: the
    /// bias under sequence parallelism, none otherwise.
    pub fn sequence_parallel_parameters(&self) -> Vec<Tensor<E>> {
        match self.sequence_parallel {
            true => self.bias.iter().cloned().collect(),
            false => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor_parallel::slices::tests::rank_1_of_2;

    #[test]
    #[should_panic(
        expected = "RowParallelLinear: the weight must be [in_features, out_features], got [6]"
    )]
    fn a_weight_must_be_a_matrix() {
        let _ = RowParallelLinear::from_full(&Tensor::<f64>::zeros(&[6]), None, &rank_1_of_2());
    }
}
