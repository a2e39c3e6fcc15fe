//! Megatron's parallel linear layers: [`ColumnParallelLinear`] splits the weight over its
//! output features, [`RowParallelLinear`] over its input features; a column layer followed
//! by a row layer (an MLP, attention's projections) communicates once each way, at the
//! row layer's end and the column layer's start.
//!
//! Both are built from the whole layer's weights, which every rank holds alike (from one
//! seed, or a checkpoint), each rank keeping its slice as a parameter of its own. tl-tensor's
//! [`Linear`] stores its weight as `[in_features, out_features]` (`y = x·W + b`, no
//! transpose; PyTorch stores `[out, in]`), so rank `r` of `t` keeps the *columns*
//! `W[:, r·out/t..(r + 1)·out/t]` of a column layer and the *rows*
//! `W[r·in/t..(r + 1)·in/t, :]` of a row layer.

use std::ops::Range;

use tl_tensor::memory;
use tl_tensor::ndarray::{ArrayD, Axis, Slice as Span, concatenate};
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Tensor, meta};

use crate::ddp::GradElement;
use crate::error::Result;

use super::group::TensorParallel;

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
/// See [`ColumnParallelLinear`] for an example.
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
        let local = param_joined(&[slice_of(weight, 0, rows)], 0, weight);
        let bias = bias.map(|bias| {
            check_bias("RowParallelLinear", bias, outputs);
            param_joined(&[slice_of(bias, 0, 0..outputs)], 0, bias)
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

/// A weight's `[in, out]`.
///
/// # Panics
/// If it is not 2-D, naming `layer`.
fn check_weight<E: GradElement>(layer: &str, weight: &Tensor<E>) -> [usize; 2] {
    let shape = weight.shape();
    match shape[..] {
        [inputs, outputs] => [inputs, outputs],
        _ => panic!("{layer}: the weight must be [in_features, out_features], got {shape:?}"),
    }
}

/// # Panics
/// If `bias` is not `[outputs]`, naming `layer`.
fn check_bias<E: GradElement>(layer: &str, bias: &Tensor<E>, outputs: usize) {
    assert_eq!(
        bias.shape(),
        [outputs],
        "{layer}: the bias must be [out_features] = [{outputs}]"
    );
}

/// The values `range` along `axis` of `full`, or `None` when it runs on shapes.
fn slice_of<E: GradElement>(
    full: &Tensor<E>,
    axis: usize,
    range: Range<usize>,
) -> (Option<ArrayD<E>>, Vec<usize>) {
    let mut shape = full.shape();
    shape[axis] = range.len();
    let values = meta::computes(&[full]).then(|| {
        full.value()
            .slice_axis(Axis(axis), Span::from(range))
            .to_owned()
    });
    (values, shape)
}

/// A parameter of `pieces` joined along `axis`, owned by `full`'s unit of the model (a
/// meta parameter when the pieces have no values).
fn param_joined<E: GradElement>(
    pieces: &[(Option<ArrayD<E>>, Vec<usize>)],
    axis: usize,
    full: &Tensor<E>,
) -> Tensor<E> {
    let _owner = memory::owner_scope(full.memory_tag().owner);
    let mut shape = pieces[0].1.clone();
    shape[axis] = pieces.iter().map(|(_, shape)| shape[axis]).sum();
    let values: Option<Vec<_>> = pieces.iter().map(|(values, _)| values.as_ref()).collect();
    match values {
        Some(values) => {
            let views: Vec<_> = values.iter().map(|v| v.view()).collect();
            Tensor::param(concatenate(Axis(axis), &views).expect("pieces that fit"))
        }
        None => Tensor::meta_param(&shape),
    }
}
