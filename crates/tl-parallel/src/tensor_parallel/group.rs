//! [`TensorParallel`]: the handle on a tensor-parallel group that every tensor-parallel op
//! and layer holds, and the even splits they make.

use std::ops::Range;
use std::rc::Rc;

use tl_collective::{CommStats, Communicator, shard_range};
use tl_tensor::ndarray::ArrayD;
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
}

impl TensorParallel {
    /// The group whose communicator is `comm` (the tensor-parallel group's, not the whole
    /// world's, once a mesh has several axes).
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        Self {
            link: Link::shared(comm),
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
        self.call(|comm| comm.all_reduce_sum(sums.view_mut()))?;
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
                (Some(values), false) => {
                    let run = values[offset..offset + len].to_vec();
                    let array = ArrayD::from_shape_vec(param.shape(), run).expect("its count");
                    param.set_grad(Some(array));
                }
                (None, true) => {}
                (None, false) => param.set_grad_tensor(Some(Tensor::meta(&param.shape()))),
            }
            offset += len;
        }
        Ok(())
    }

    /// Runs a forward collective: its error (or an earlier one still kept) comes back.
    pub(super) fn call(
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

/// An all-reduce (sum) of `tensor`'s values in place, in a backward sweep.
pub(super) fn all_reduce_in_backward<E: GradElement>(link: &SharedLink, tensor: &Tensor<E>) {
    call_in_backward(link, tensor, |comm| {
        with_view_mut(tensor, |values| comm.all_reduce_sum(values))
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
