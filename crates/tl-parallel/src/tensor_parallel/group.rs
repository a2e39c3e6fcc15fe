//! [`TensorParallel`]: the handle on a tensor-parallel group that every tensor-parallel op
//! and layer holds, and the even splits they make.

use std::ops::Range;
use std::rc::Rc;

use tl_collective::{CommStats, Communicator, ReduceOp, shard_range};
use tl_precision::{Format, autocast_format};
use tl_tensor::memory::{self, Stage};
use tl_tensor::ndarray::{ArrayD, ArrayViewD, IxDyn};
use tl_tensor::{Tensor, meta};

use crate::ddp::GradElement;
use crate::error::{ParallelError, Result};
use crate::link::{Link, SharedLink};
use crate::metered::{Metered, communication, labels};

use super::views::{with_view, with_view_mut};

/// A tensor-parallel group: the communicator its ranks share, and the first error a
/// collective met inside a backward sweep (a VJP cannot return one), kept until
/// [`take_error`](Self::take_error). Cheap to clone: clones share the communicator.
///
/// Every rank of the group runs the same model on the same batch, each holding a slice of
/// the layers' weights; the ops of this module ([`copy_to`](Self::copy_to),
/// [`reduce_from`](Self::reduce_from), [`gather_sequence`](Self::gather_sequence),
/// [`scatter_sequence`](Self::scatter_sequence)) move activations and gradients between
/// them. Every rank must run the same ops in the same order: each is a collective, forward
/// or backward.
///
/// ```
/// use tl_collective::Single;
/// use tl_parallel::TensorParallel;
/// use tl_tensor::Tensor;
///
/// let tp = TensorParallel::new(Box::new(Single::new())); // or the group's communicator
/// let x = Tensor::<f64>::param(tl_tensor::ndarray::arr1(&[1.0, 2.0]).into_dyn());
/// let y = tp.reduce_from(&tp.copy_to(&x))?; // a world of one: both are the identity
/// assert_eq!(y.to_vec(), vec![1.0, 2.0]);
/// y.sum_all().backward();
/// assert!(tp.take_error().is_none());
/// assert_eq!((tp.rank(), tp.world_size(), tp.stats().collectives), (0, 1, 2));
/// # Ok::<(), tl_parallel::ParallelError>(())
/// ```
#[derive(Clone)]
pub struct TensorParallel {
    link: SharedLink,
    reduce_in: ReduceIn,
}

/// How a tensor-parallel group adds its ranks' partial results under autocast: the partial
/// outputs of a row-parallel layer ([`reduce_from`](TensorParallel::reduce_from),
/// [`scatter_sequence`](TensorParallel::scatter_sequence)) and the partial input gradients
/// of a column-parallel one (the backward of [`copy_to`](TensorParallel::copy_to) and of
/// [`gather_sequence`](TensorParallel::gather_sequence)). Outside autocast, and under an
/// fp8 autocast (tl-collective has no sum in 8 bits), both are the plain sum in the element
/// type.
///
/// See `docs/mixed-precision.md` ("Tensor parallelism: the partial sums") for the numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReduceIn {
    /// In autocast's 16-bit format, as a GPU's NCCL ring all-reduce of a bf16 tensor adds
    /// it: each rank's partial result rounded to the format (a rounded matmul's output is
    /// already), each addition of the ring rounded, 2 bytes an element on the wire
    /// ([`ReduceOp::SumIn`]). The default: what the hardware does.
    #[default]
    AutocastFormat,
    /// In f32 (the element type: f64 for an f64 model), unrounded, 4 bytes an element:
    /// Megatron's option to reduce in fp32, at twice the bytes, with the error of one
    /// rounding per partial result instead of one per hop.
    F32,
}

impl TensorParallel {
    /// The group whose communicator is `comm` (the tensor-parallel group's, not the whole
    /// world's, once a mesh has several axes). Under autocast it adds partial results in
    /// autocast's format ([`ReduceIn::AutocastFormat`]).
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        Self {
            link: Link::shared(comm),
            reduce_in: ReduceIn::default(),
        }
    }

    /// This handle, adding partial results as `reduce_in` says; the layers built from it
    /// (from clones of it) do too. Every rank of the group must choose alike: ranks that
    /// differ fail their next sum with a mismatch.
    ///
    /// ```
    /// use tl_collective::{Phantom, ReduceOp};
    /// use tl_parallel::{ReduceIn, TensorParallel};
    /// use tl_precision::{Format, autocast};
    ///
    /// let tp = TensorParallel::new(Box::new(Phantom::new(0, 2)?));
    /// assert_eq!(tp.partial_sum_op(), ReduceOp::Sum); // no autocast
    /// let _bf16 = autocast(Format::Bf16);
    /// assert_eq!(tp.partial_sum_op(), ReduceOp::SumIn(Format::Bf16));
    /// let tp = tp.with_reduce_in(ReduceIn::F32);
    /// assert_eq!(tp.partial_sum_op(), ReduceOp::Sum);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_reduce_in(mut self, reduce_in: ReduceIn) -> Self {
        self.reduce_in = reduce_in;
        self
    }

    /// How this handle adds partial results under autocast.
    pub fn reduce_in(&self) -> ReduceIn {
        self.reduce_in
    }

    /// The reduction a sum of partial results made now, on this thread, uses:
    /// [`ReduceOp::SumIn`] of autocast's format under a bf16 or fp16 autocast with
    /// [`ReduceIn::AutocastFormat`], [`ReduceOp::Sum`] otherwise. The ops read it when their
    /// forward runs, so a backward that runs after the autocast guard has dropped still
    /// sums its gradients as the forward's autocast says (as a cast rounds them).
    pub fn partial_sum_op(&self) -> ReduceOp {
        match (self.reduce_in, autocast_format()) {
            (ReduceIn::AutocastFormat, Some(format @ (Format::Bf16 | Format::Fp16))) => {
                ReduceOp::SumIn(format)
            }
            (ReduceIn::AutocastFormat, Some(Format::E4M3 | Format::E5M2) | None)
            | (ReduceIn::F32, _) => ReduceOp::Sum,
        }
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.link.borrow().rank()
    }

    /// Ranks in the group, `t`.
    pub fn world_size(&self) -> usize {
        self.link.borrow().world_size()
    }

    /// The communicator's counters (collectives called, bytes sent).
    pub fn stats(&self) -> CommStats {
        self.link.borrow().stats()
    }

    /// Wall-clock time this rank has spent inside the group's collectives (waiting for its
    /// peers included), forward and backward, as
    /// [`DataParallel::communication_time`](crate::DataParallel::communication_time) counts
    /// the data-parallel group's.
    pub fn communication_time(&self) -> std::time::Duration {
        self.link.borrow().busy()
    }

    /// The first collective error met since the last call, if any: a collective of a
    /// backward sweep that failed (its gradient was made NaN, so the step refuses it).
    pub fn take_error(&self) -> Option<ParallelError> {
        let mut link = self.link.borrow_mut();
        let rank = link.rank();
        link.take_error()
            .map(|source| ParallelError::Collective { rank, source })
    }

    /// This rank's share of `size` things split evenly over the group:
    /// [`shard_range`]`(size, t, rank)`, the layout of the sharded collectives.
    ///
    /// # Errors
    /// [`ParallelError::Indivisible`] naming `what`, `size` and `t` when `t` does not
    /// divide `size`.
    ///
    /// ```
    /// use tl_collective::Phantom;
    /// use tl_parallel::TensorParallel;
    /// let tp = TensorParallel::new(Box::new(Phantom::new(2, 4)?));
    /// assert_eq!(tp.split("output features", 12)?, 6..9);
    /// assert!(tp.split("output features", 10).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn split(&self, what: &'static str, size: usize) -> Result<Range<usize>> {
        let (rank, tensor_parallel) = (self.rank(), self.world_size());
        if !size.is_multiple_of(tensor_parallel) {
            return Err(ParallelError::Indivisible {
                what,
                size,
                tensor_parallel,
            });
        }
        Ok(shard_range(size, tensor_parallel, rank))
    }

    /// The whole array from every rank's part `local` of it along `axis`: the parts joined
    /// along `axis` in rank order (rank `q`'s at `q·n..(q + 1)·n` for parts of `n`), on every
    /// rank. A collective of the group: every rank calls it, with parts of the same shape.
    /// The inverse of [`slice_values`](super::slice_values) and
    /// [`slice_param`](super::slice_param), for a checkpoint that holds whole tensors.
    ///
    /// Plain values, no autograd op: one all-gather into a communication buffer labelled
    /// `label` (one of [`labels`](crate::labels)) on the memory meter, as the rest of the
    /// group's buffers are, then the parts put in place, in standard (row-major) layout.
    ///
    /// # Errors
    /// [`ParallelError::Collective`] if the all-gather fails (ranks whose parts differ in
    /// size make it fail on every rank), or an earlier collective of the group did.
    ///
    /// # Panics
    /// If `axis` is not one of `local`'s.
    ///
    /// ```
    /// use tl_collective::Single;
    /// use tl_parallel::{TensorParallel, labels};
    /// use tl_tensor::ndarray::arr2;
    ///
    /// let tp = TensorParallel::new(Box::new(Single::new())); // a group of one: its own part
    /// let part = arr2(&[[1.0f64, 2.0], [3.0, 4.0]]).into_dyn();
    /// let whole = tp.gather_values(part.view(), 1, labels::GATHERED_MOMENTS)?;
    /// assert_eq!(whole, part);
    /// # Ok::<(), tl_parallel::ParallelError>(())
    /// ```
    pub fn gather_values<E: GradElement>(
        &self,
        local: ArrayViewD<'_, E>,
        axis: usize,
        label: &'static str,
    ) -> Result<ArrayD<E>> {
        let shape = local.shape().to_vec();
        assert!(
            axis < shape.len(),
            "gather_values: no axis {axis} in a part of shape {shape:?}"
        );
        let t = self.world_size();
        let local = local.as_standard_layout();
        let local = local.as_slice().expect("standard layout");
        let mut buffer = Metered::<E>::zeros(t * local.len(), false, communication(label, None));
        self.call(|comm| {
            comm.all_gather(
                <E as tl_collective::Element>::view(local),
                buffer.view_mut(),
            )
        })?;
        // The buffer holds [t, shape..]: the rank axis moved just before `axis` and merged
        // with it puts rank q's part at q·n..(q + 1)·n along `axis`.
        let blocks_shape: Vec<usize> = std::iter::once(t).chain(shape.iter().copied()).collect();
        let values = buffer.values().expect("a buffer with values");
        let blocks = ArrayViewD::from_shape(IxDyn(&blocks_shape), values).expect("t parts");
        let order: Vec<usize> = (1..=axis)
            .chain([0])
            .chain(axis + 1..=shape.len())
            .collect();
        let mut whole_shape = shape;
        whole_shape[axis] *= t;
        Ok(blocks
            .permuted_axes(IxDyn(&order))
            .as_standard_layout()
            .into_owned()
            .into_shape_with_order(IxDyn(&whole_shape))
            .expect("the parts joined along the axis"))
    }

    /// Sums the gradients of `params` over the group, in place, in one all-reduce: for the
    /// parameters that every rank holds whole but, under sequence parallelism, trains on its
    /// own rows of the sequence only (a row-parallel layer's bias, a norm's weight), as
    /// Megatron does once per step before the optimizer. A parameter without a gradient
    /// adds zeros and receives the sum.
    ///
    /// # Errors
    /// [`ParallelError::Collective`] if the all-reduce fails (the gradients are then left
    /// as they were).
    pub fn all_reduce_gradients<E: GradElement>(&self, params: &[Tensor<E>]) -> Result<()> {
        let meta = params
            .iter()
            .any(|p| !meta::computes(&[p]) || p.grad_is_meta());
        let len = params.iter().map(Tensor::numel).sum();
        let _reduction = memory::stage_scope(Stage::Reduction);
        let tag = communication(labels::SEQUENCE_PARALLEL_GRADIENTS, None);
        let mut sums = Metered::<E>::zeros(len, meta, tag);
        if let Some(values) = sums.values_mut() {
            let mut offset = 0;
            for param in params {
                let run = &mut values[offset..offset + param.numel()];
                param.with_grad(|grad| {
                    if let Some(grad) = grad {
                        run.iter_mut().zip(grad.iter()).for_each(|(v, &g)| *v = g);
                    }
                });
                offset += param.numel();
            }
        }
        // Labelled for whoever records the group's calls (the plan names this one).
        let label = memory::label_scope(labels::SEQUENCE_PARALLEL_GRADIENTS);
        self.call(|comm| comm.all_reduce_sum(sums.view_mut()))?;
        drop(label);
        // Written back in place where a gradient exists, so the meter sees nothing move
        // (and a meta gradient has nothing to write).
        let mut offset = 0;
        for param in params {
            let len = param.numel();
            let has_grad = param.with_grad(|grad| grad.is_some()) || param.grad_is_meta();
            match (sums.values(), has_grad) {
                (Some(values), true) => {
                    let run = &values[offset..offset + len];
                    param.update_grad(|grad| grad.iter_mut().zip(run).for_each(|(g, &v)| *g = v));
                }
                // A parameter without a gradient receives a new one, the same way in both
                // modes, so that a meta run sees what a real one does.
                (values, false) => {
                    let gradient = match values {
                        Some(values) => {
                            let run = values[offset..offset + len].to_vec();
                            let array = ArrayD::from_shape_vec(param.shape(), run);
                            Tensor::from_array(array.expect("the parameter's count"))
                        }
                        None => Tensor::meta(&param.shape()),
                    };
                    param.set_grad_tensor(Some(gradient));
                }
                (None, true) => {}
            }
            offset += len;
        }
        Ok(())
    }

    /// Runs a forward collective: its error (or an earlier one still kept) comes back.
    pub(crate) fn call(
        &self,
        collective: impl FnOnce(&mut dyn Communicator) -> tl_collective::Result<()>,
    ) -> Result<()> {
        let done = self.link.borrow_mut().call(collective);
        match done {
            Some(()) => Ok(()),
            None => Err(self
                .take_error()
                .expect("a failed collective keeps its error")),
        }
    }

    /// The shared communicator, for a VJP to capture.
    pub(super) fn link(&self) -> SharedLink {
        Rc::clone(&self.link)
    }
}

/// Runs a backward collective writing into `output`: on failure (this one or an earlier
/// one) the error stays in `link` and `output`'s values become NaN, so that the step sees
/// a non-finite gradient and refuses it.
pub(super) fn call_in_backward<E: GradElement>(
    link: &SharedLink,
    output: &Tensor<E>,
    collective: impl FnOnce(&mut dyn Communicator) -> tl_collective::Result<()>,
) {
    let done = link.borrow_mut().call(collective);
    if done.is_none() && !output.is_meta() {
        output.update_value(|values| values.fill(E::nan()));
    }
}

/// An all-reduce (a sum, `op`) of `tensor`'s values in place, in a backward sweep.
pub(super) fn all_reduce_in_backward<E: GradElement>(
    link: &SharedLink,
    tensor: &Tensor<E>,
    op: ReduceOp,
) {
    call_in_backward(link, tensor, |comm| {
        with_view_mut(tensor, |values| comm.all_reduce(values, op))
    });
}

/// Runs `collective` with `input`'s values and `output`'s as the buffers (shape-only for
/// meta tensors).
pub(super) fn between<E: GradElement>(
    input: &Tensor<E>,
    output: &Tensor<E>,
    collective: impl FnOnce(
        tl_collective::Slice<'_>,
        tl_collective::SliceMut<'_>,
    ) -> tl_collective::Result<()>,
) -> tl_collective::Result<()> {
    with_view(input, |input| {
        with_view_mut(output, |output| collective(input, output))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_collective::{Collective, Phantom, Single, ring_bytes_sent};
    use tl_tensor::memory::{self, EventKind};
    use tl_tensor::meta_mode;
    use tl_tensor::ndarray::arr1;

    fn rank_of(rank: usize, world_size: usize) -> TensorParallel {
        TensorParallel::new(Box::new(Phantom::new(rank, world_size).unwrap()))
    }

    #[test]
    fn the_ranks_shares_tile_the_size_in_rank_order() {
        let shares: Vec<_> = (0..4)
            .map(|rank| rank_of(rank, 4).split("vocabulary", 12).unwrap())
            .collect();
        assert_eq!(shares, [0..3, 3..6, 6..9, 9..12]);
        let alone = TensorParallel::new(Box::new(Single::new()));
        assert_eq!(alone.split("heads", 7).unwrap(), 0..7);
    }

    #[test]
    fn a_size_the_group_does_not_divide_is_named_with_the_group_size() {
        let error = rank_of(0, 3).split("heads", 10).unwrap_err();
        assert_eq!(
            error.to_string(),
            "heads of 10 does not split evenly over 3 tensor-parallel ranks"
        );
    }

    /// Rank 0 of 2 (whose all-reduce leaves the values as they are) sums the gradients of
    /// `[3]` with one and `[2]` without one: the meter's events, the counters, both
    /// gradients.
    #[allow(clippy::type_complexity)]
    fn sum_two_gradients(
        meta: bool,
    ) -> (
        Vec<(EventKind, usize)>,
        CommStats,
        Option<ArrayD<f32>>,
        Option<ArrayD<f32>>,
    ) {
        let _meta = meta.then(meta_mode);
        let tp = rank_of(0, 2);
        let with = Tensor::<f32>::param(arr1(&[1.0, 2.0, 3.0]).into_dyn());
        let without = Tensor::<f32>::param(arr1(&[5.0, 6.0]).into_dyn());
        with.mul_scalar(2.0).sum_all().backward();
        let params = [with.clone(), without.clone()];
        let ((), events) = memory::record(|| tp.all_reduce_gradients(&params).unwrap());
        assert_eq!(without.grad_is_meta(), meta);
        let events = events.iter().map(|e| (e.kind, e.bytes)).collect();
        (events, tp.stats(), with.grad(), without.grad())
    }

    #[test]
    fn gradients_are_summed_in_one_all_reduce_and_written_back_in_place() {
        let (events, stats, with, without) = sum_two_gradients(false);
        assert_eq!(with.unwrap().as_slice().unwrap(), [2.0, 2.0, 2.0]);
        assert_eq!(
            without.unwrap().as_slice().unwrap(),
            [0.0, 0.0],
            "zeros summed"
        );
        let bytes_sent = ring_bytes_sent(Collective::AllReduce, 5, 4, 2, 0);
        assert_eq!(
            stats,
            CommStats {
                collectives: 1,
                bytes_sent,
                ..CommStats::default()
            }
        );
        // The buffer of 5 floats, the missing gradient made and landed in its leaf, the
        // buffer freed: the existing gradient is written in place.
        use EventKind::{Alloc, Free, Retag};
        assert_eq!(events, [(Alloc, 20), (Alloc, 8), (Retag, 8), (Free, 20)]);
        let (meta_events, meta_stats, ..) = sum_two_gradients(true);
        assert_eq!((meta_events, meta_stats), (events, stats));
    }
}
