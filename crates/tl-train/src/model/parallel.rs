//! How the Llama splits over a tensor-parallel group (Megatron-LM's layout): which
//! parameters are split along which axis, and the group the split layers talk through.
//!
//! ```text
//! block, rank r of t        [B, T, d] on every rank
//!   norm1                   replicated
//!   copy-to ─┬─ x·Wq[:, r]  heads r·H/t .. (r+1)·H/t     column-parallel
//!            ├─ x·Wk[:, r]
//!            └─ x·Wv[:, r]  attention over the rank's heads
//!   ·Wo[r, :]  → reduce-from (all-reduce)                row-parallel
//!   norm2                   replicated
//!   copy-to ─┬─ x·W1[:, r]  SwiGLU over the rank's hidden units
//!            └─ x·W3[:, r]
//!   ·W2[r, :]  → reduce-from (all-reduce)
//! embedding: rows r·V/t .. (r+1)·V/t of the table, lookups summed (one all-reduce)
//! head:      copy-to, columns r·V/t .. of W; the vocabulary-parallel cross-entropy
//! ```
//!
//! Forward, a block makes two all-reduces (attention's and the MLP's reduce-from) and
//! backward two (their copy-to's); the norms see the whole activations on every rank, and
//! their gradients are the same on every rank without a reduction. [`placement`] is the one
//! table of which parameter splits how: the split model is cut from the whole one by it, and
//! a checkpoint is assembled whole by it, so a run saved at any `t` resumes at any other.
//!
//! **Sequence parallelism** (Korthikanti et al. 2022) splits what lies between the
//! tensor-parallel regions too: the residual stream is each rank's rows of the batch's
//! flattened tokens, `[B·T/t, d]` (rank `r` holds tokens `r·BT/t .. (r+1)·BT/t`), and the
//! norms, dropout and residual adds run on those rows only.
//!
//! ```text
//! block, rank r of t        [B·T/t, d]: this rank's rows of the tokens
//!   norm1, on the rows      replicated gain, trained on the rows (its gradient a share)
//!   all-gather → [B, T, d] ─┬─ x·Wq[:, r] ...            column-parallel
//!   ·Wo[r, :]  → reduce-scatter → [B·T/t, d]             row-parallel
//!   dropout, + residual     the rows of the whole model's mask
//!   norm2, the MLP between an all-gather and a reduce-scatter, the same way
//! embedding: the rows' lookups reduce-scattered; head: the final norm's rows all-gathered
//! ```
//!
//! Forward, a block makes two all-gathers and two reduce-scatters, each moving what one of
//! the all-reduces it replaces moves (an all-reduce is a reduce-scatter and an all-gather),
//! and backward the same; the activations between the regions take `1/t` of the memory. The
//! gains' gradients are each rank's share: they are summed over the group once a step
//! ([`Llama::sequence_parallel_parameters`](super::Llama::sequence_parallel_parameters)).

use std::cell::RefCell;
use std::ops::Range;

use tl_parallel::tensor_parallel::{slice_param, slice_values};
use tl_parallel::{GradElement, ParallelError, TensorParallel, labels};
use tl_tensor::Tensor;
use tl_tensor::ndarray::{ArrayViewD, IxDyn};
use tl_tensor::optim::AdamWState;

use crate::error::{Result, TrainError};

/// How one parameter of the Llama is laid out over a tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Every rank holds it whole (the norms' gains).
    Replicated,
    /// Rank `r` holds the `r`-th of `t` equal slices along this axis.
    Split {
        /// The axis cut: 1 for a column-parallel weight (`[in, out]`, split by outputs), 0
        /// for a row-parallel weight and the embedding's table (split by rows).
        axis: usize,
    },
}

/// Where the parameter named `name` (as [`Llama::named_parameters`] names it) lives.
///
/// [`Llama::named_parameters`]: super::Llama::named_parameters
pub fn placement(name: &str) -> Placement {
    let leaf = name.rsplit_once("blocks.").map_or(name, |(_, rest)| {
        rest.split_once('.').map_or(rest, |(_, leaf)| leaf)
    });
    match leaf {
        "wq.weight" | "wk.weight" | "wv.weight" | "w1.weight" | "w3.weight" | "head.weight" => {
            Placement::Split { axis: 1 }
        }
        "wo.weight" | "w2.weight" | "emb.weight" => Placement::Split { axis: 0 },
        _ => Placement::Replicated,
    }
}

/// The shape `[B, T]` of the batch of token ids a forward pass runs on.
pub(crate) type BatchShape = [usize; 2];

/// A model's tensor-parallel group, shared by its split layers, whether the residual stream
/// is split over it too (sequence parallelism), and the first error a forward collective
/// met (a module's forward cannot return one: the failed op gives NaNs and the error waits
/// here for [`Llama::loss`](super::Llama::loss) to return it).
pub struct TensorSplit {
    tp: TensorParallel,
    sequence_parallel: bool,
    failed: RefCell<Option<ParallelError>>,
}

impl TensorSplit {
    /// The split over `tp`'s group, with the residual stream whole on every rank.
    pub fn new(tp: TensorParallel) -> Self {
        Self::with_sequence_parallel(tp, false)
    }

    /// The split over `tp`'s group, with the residual stream split over it as rows of the
    /// tokens when `sequence_parallel` (see the [module docs](self)).
    pub fn with_sequence_parallel(tp: TensorParallel, sequence_parallel: bool) -> Self {
        Self {
            tp,
            sequence_parallel,
            failed: RefCell::new(None),
        }
    }

    /// Whether the residual stream is split over the group (sequence parallelism).
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// Under sequence parallelism, this rank's rows of a batch of `tokens` tokens
    /// (`B·T`): tl-collective's `shard_range` layout, `r·BT/t .. (r+1)·BT/t`.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] naming the batch's `rows × time` when `t` does not
    /// divide the tokens.
    pub fn token_rows(&self, rows: usize, time: usize) -> Result<Range<usize>> {
        let t = self.world_size();
        self.tp
            .split("tokens", rows * time)
            .map_err(|_| TrainError::InvalidArgument {
                name: "batch",
                value: format!("{rows} x {time} tokens"),
                reason: format!(
                    "sequence parallelism over {t} ranks gives each rank {}/{t} of the \
                     batch's tokens, so their number ({}) must be divisible by {t}",
                    rows * time,
                    rows * time
                ),
            })
    }

    /// The group.
    pub fn group(&self) -> &TensorParallel {
        &self.tp
    }

    /// Ranks in the group, `t`.
    pub fn world_size(&self) -> usize {
        self.tp.world_size()
    }

    /// This rank's part of the `size` things that the config's `field` counts, split `t`
    /// ways, checked to divide.
    ///
    /// # Errors
    /// [`TrainError::InvalidConfig`] naming the field, its value and `t`.
    pub fn part(&self, field: &'static str, size: usize) -> Result<Range<usize>> {
        let t = self.world_size();
        self.tp
            .split(field, size)
            .map_err(|_| TrainError::InvalidConfig {
                field,
                value: size.to_string(),
                reason: match field {
                    "n_kv_heads" => format!(
                        "tensor parallelism over {t} ranks divides the key/value heads among \
                         them with their query heads (it does not replicate them), so their \
                         number must be divisible by {t}"
                    ),
                    _ => format!(
                        "tensor parallelism over {t} ranks splits it into {t} equal parts, so \
                         it must be divisible by {t}"
                    ),
                },
            })
    }

    /// This rank's slice of the whole parameter `whole` placed as `placement`, as a
    /// parameter of its own, owned on the memory meter by the whole one's unit (a meta
    /// slice of a meta parameter): tl-parallel's [`slice_param`].
    ///
    /// # Errors
    /// As [`part`](Self::part), for the split axis.
    pub fn slice<E: GradElement>(
        &self,
        what: &'static str,
        whole: &Tensor<E>,
        placement: Placement,
    ) -> Result<Tensor<E>> {
        let Placement::Split { axis } = placement else {
            return Ok(whole.clone());
        };
        let part = self.part(what, whole.shape()[axis])?;
        Ok(slice_param(whole, axis, part))
    }

    /// This rank's slice of a whole optimizer state, parameter by parameter as `names`
    /// (the model's [`named_parameters`](super::Llama::named_parameters)) place them: the
    /// moments of a split parameter are split as it is ([`slice_values`]).
    ///
    /// # Errors
    /// As [`part`](Self::part).
    pub fn slice_state(&self, mut state: AdamWState, names: &[String]) -> Result<AdamWState> {
        for ((name, shape), param) in names.iter().zip(&mut state.shapes).zip(&mut state.params) {
            let Placement::Split { axis } = placement(name) else {
                continue;
            };
            let part = self.part(field_of(name), shape[axis])?;
            if let Some(moments) = param {
                for values in [&mut moments.exp_avg, &mut moments.exp_avg_sq] {
                    *values = slice_values(values, shape, axis, part.clone());
                }
            }
            shape[axis] = part.len();
        }
        Ok(state)
    }

    /// The whole optimizer state from every rank's slices (a collective of the group:
    /// every rank calls it, and every rank gets the whole state).
    ///
    /// # Errors
    /// [`ParallelError`] if a gather fails.
    pub fn gather_state(&self, mut state: AdamWState, names: &[String]) -> Result<AdamWState> {
        for ((name, shape), param) in names.iter().zip(&mut state.shapes).zip(&mut state.params) {
            let Placement::Split { axis } = placement(name) else {
                continue;
            };
            if let Some(moments) = param {
                for values in [&mut moments.exp_avg, &mut moments.exp_avg_sq] {
                    let local = ArrayViewD::from_shape(IxDyn(shape), values)
                        .expect("a moment of its parameter's shape");
                    let whole = self
                        .tp
                        .gather_values(local, axis, labels::GATHERED_MOMENTS)?;
                    *values = whole.into_raw_vec_and_offset().0;
                }
            }
            shape[axis] *= self.world_size();
        }
        Ok(state)
    }

    /// The whole parameter from every rank's slice `local`, placed as `placement` (a
    /// collective of the group; a replicated one is copied), as a constant.
    ///
    /// # Errors
    /// [`ParallelError`] if the gather fails.
    pub fn gather_whole<E: GradElement>(
        &self,
        local: &Tensor<E>,
        placement: Placement,
    ) -> Result<Tensor<E>> {
        Ok(Tensor::from_array(match placement {
            Placement::Replicated => local.to_array(),
            Placement::Split { axis } => {
                let local = local.value();
                (self.tp).gather_values(local.view(), axis, labels::GATHERED_WEIGHTS)?
            }
        }))
    }

    /// Into a column-parallel region that takes every position: `x` itself, its gradient
    /// all-reduced backward (Megatron's copy-to); under sequence parallelism every rank's
    /// rows `[n/t, d]` all-gathered into `[n, d]`, the gradient reduce-scattered backward.
    pub(crate) fn enter<E: GradElement>(&self, x: &Tensor<E>) -> Tensor<E> {
        if !self.sequence_parallel {
            return self.tp.copy_to(x);
        }
        let mut whole = x.shape();
        whole[0] *= self.world_size();
        self.kept(self.tp.gather_sequence(x), &whole)
    }

    /// Into a column-parallel region that takes the batch `[B, T, d]` (the attention, which
    /// needs its sequences): as [`enter`](Self::enter), the ranks' rows of the tokens,
    /// `[B·T/t, d]`, gathered straight into `[B, T, d]` under sequence parallelism.
    pub(crate) fn enter_batch<E: GradElement>(
        &self,
        x: &Tensor<E>,
        batch: BatchShape,
    ) -> Tensor<E> {
        if !self.sequence_parallel {
            return self.tp.copy_to(x);
        }
        let features = *x.shape().last().expect("activations have a feature axis");
        let whole = [batch[0], batch[1], features];
        self.kept(self.tp.gather_sequence_as(x, &whole), &whole)
    }

    /// Out of a row-parallel layer: the ranks' partial sums all-reduced forward; under
    /// sequence parallelism reduce-scattered into this rank's rows, `[B·T/t, d]`.
    pub(crate) fn leave<E: GradElement>(&self, x: &Tensor<E>) -> Tensor<E> {
        let shape = x.shape();
        if !self.sequence_parallel {
            return self.kept(self.tp.reduce_from(x), &shape);
        }
        let features = *shape.last().expect("activations have a feature axis");
        let rows = x.numel() / features / self.world_size();
        self.kept(
            self.tp.scatter_sequence_as(x, &[rows, features]),
            &[rows, features],
        )
    }

    /// The vocabulary-parallel cross-entropy of this rank's logits.
    pub(crate) fn cross_entropy<E: GradElement>(
        &self,
        logits: &Tensor<E>,
        targets: &[usize],
    ) -> Tensor<E> {
        self.kept(self.tp.vocab_parallel_cross_entropy(logits, targets), &[])
    }

    /// The ranks' columns of `x` side by side: whole logits from the head's slices.
    pub(crate) fn gather_columns<E: GradElement>(&self, x: &Tensor<E>) -> Tensor<E> {
        let mut shape = x.shape();
        if let Some(last) = shape.last_mut() {
            *last *= self.world_size();
        }
        self.kept(self.tp.gather_last(x), &shape)
    }

    /// `result`, or NaNs of `shape` with the error kept (the first one).
    pub(crate) fn kept<E: GradElement>(
        &self,
        result: tl_parallel::Result<Tensor<E>>,
        shape: &[usize],
    ) -> Tensor<E> {
        result.unwrap_or_else(|error| {
            self.failed.borrow_mut().get_or_insert(error);
            Tensor::full(shape, E::from_f64(f64::NAN))
        })
    }

    /// The first error of a collective since the last call: a forward's, else a backward's.
    pub fn take_error(&self) -> Option<ParallelError> {
        let forward = self.failed.borrow_mut().take();
        forward.or_else(|| self.tp.take_error())
    }
}

/// The config's field that sizes the split axis of the parameter named `name`.
fn field_of(name: &str) -> &'static str {
    if name.contains("emb.") || name.contains("head.") {
        "vocab"
    } else if name.contains(".w1.") || name.contains(".w3.") || name.contains(".w2.") {
        "hidden"
    } else if name.contains(".wk.") || name.contains(".wv.") {
        "n_kv_heads"
    } else {
        "d_model"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_of_a_block_has_its_place() {
        let split = |axis| Placement::Split { axis };
        for (name, place) in [
            ("emb.weight", split(0)),
            ("blocks.3.n1.w", Placement::Replicated),
            ("blocks.3.wq.weight", split(1)),
            ("blocks.3.wk.weight", split(1)),
            ("blocks.3.wv.weight", split(1)),
            ("blocks.3.wo.weight", split(0)),
            ("blocks.11.n2.w", Placement::Replicated),
            ("blocks.11.w1.weight", split(1)),
            ("blocks.11.w3.weight", split(1)),
            ("blocks.11.w2.weight", split(0)),
            ("norm.w", Placement::Replicated),
            ("head.weight", split(1)),
        ] {
            assert_eq!(placement(name), place, "{name}");
        }
    }
}
