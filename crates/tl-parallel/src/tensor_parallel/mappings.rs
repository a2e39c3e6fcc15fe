//! Megatron's conjugate operations, as autograd ops: each a collective one way and its
//! conjugate the other way, so that the gradients of a model split over the group are
//! those of the whole model.
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`copy_to`](TensorParallel::copy_to) | identity | all-reduce (sum) |
//! | [`reduce_from`](TensorParallel::reduce_from) | all-reduce (sum) | identity |
//! | [`gather_sequence`](TensorParallel::gather_sequence) | all-gather along axis 0 | reduce-scatter along axis 0 |
//! | [`scatter_sequence`](TensorParallel::scatter_sequence) | reduce-scatter along axis 0 | all-gather along axis 0 |
//! | [`gather_last`](TensorParallel::gather_last) | all-gather along the last axis | this rank's columns |
//!
//! Every op records its backward over tensors ([`Tensor::from_op_tensors`]), so that on
//! [meta](tl_tensor::meta) tensors the backward's collective runs too, on a shape-only
//! buffer, and the meter sees the same buffers as in a real run. A collective of the
//! forward that fails returns its error; one of the backward keeps it in the group (see
//! [`TensorParallel::take_error`]) and makes the gradient NaN.

use tl_tensor::Tensor;
use tl_tensor::ndarray::{ArrayD, Axis, IxDyn, Slice as Span};

use crate::ddp::GradElement;
use crate::error::Result;
use crate::metered::{Metered, communication, labels};

use super::group::{TensorParallel, all_reduce_in_backward, between, call_in_backward};
use super::views::{copy_of, fresh, is_meta};

impl TensorParallel {
    /// Megatron's "copy to the tensor-parallel region" (`f` in the paper): the identity
    /// forward (the output shares `x`'s storage), and an all-reduce of the gradient
    /// backward, in place: every rank's partial gradient with respect to its copy of `x`
    /// becomes the whole one. It goes before a column-parallel layer, whose input every
    /// rank holds whole.
    ///
    /// Nothing is recorded, and no all-reduce happens backward, when `x` requires no
    /// gradient (a model's input).
    pub fn copy_to<E: GradElement>(&self, x: &Tensor<E>) -> Tensor<E> {
        let link = self.link();
        Tensor::from_op_tensors(x, &[x], move |grad| {
            all_reduce_in_backward(&link, &grad);
            vec![Some(grad)]
        })
    }

    /// Megatron's "reduce from the tensor-parallel region" (`g` in the paper): the sum of
    /// every rank's `x` forward (one all-reduce), and the identity backward. It ends a
    /// row-parallel layer, whose ranks each hold a partial sum of the output.
    ///
    /// # Errors
    /// [`ParallelError::Collective`](crate::ParallelError::Collective) if the all-reduce
    /// fails (or an earlier collective of the group did).
    pub fn reduce_from<E: GradElement>(&self, x: &Tensor<E>) -> Result<Tensor<E>> {
        let sum = copy_of(x, labels::TENSOR_PARALLEL_SUM);
        self.call(|comm| super::views::with_view_mut(&sum, |values| comm.all_reduce_sum(values)))?;
        Ok(Tensor::from_op_tensors(&sum, &[x], |grad| vec![Some(grad)]))
    }

    /// Sequence parallelism's gather: every rank's rows of the sequence (axis 0 of `x`,
    /// `[s/t, ..]`), concatenated in rank order into the whole sequence (`[s, ..]`) on
    /// every rank, one all-gather forward; the gradient reduce-scattered back to each
    /// rank's rows. It replaces [`copy_to`](Self::copy_to) before a column-parallel layer.
    ///
    /// # Errors
    /// As [`reduce_from`](Self::reduce_from), for the all-gather (ranks whose `x` have
    /// different shapes make it fail on every rank).
    ///
    /// # Panics
    /// If `x` has no axis.
    pub fn gather_sequence<E: GradElement>(&self, x: &Tensor<E>) -> Result<Tensor<E>> {
        let local_shape = x.shape();
        assert!(
            !local_shape.is_empty(),
            "gather_sequence: a 0-dimensional tensor has no sequence axis"
        );
        let mut shape = local_shape.clone();
        shape[0] *= self.world_size();
        let gathered = fresh(&shape, is_meta(&[x]), labels::SEQUENCE_GATHERED);
        self.call(|comm| between(x, &gathered, |x, out| comm.all_gather(x, out)))?;
        let link = self.link();
        Ok(Tensor::from_op_tensors(&gathered, &[x], move |grad| {
            let shard = fresh(&local_shape, is_meta(&[&grad]), labels::SEQUENCE_SCATTERED);
            call_in_backward(&link, &shard, |comm| {
                between(&grad, &shard, |grad, shard| {
                    comm.reduce_scatter_sum(grad, shard)
                })
            });
            vec![Some(shard)]
        }))
    }

    /// Sequence parallelism's reduce-scatter: the sum of every rank's `x` (`[s, ..]`, a
    /// row-parallel layer's partial output) of which each rank keeps its rows of the
    /// sequence (`[s/t, ..]`, [`split`](Self::split) of `s`), one reduce-scatter forward;
    /// the gradient all-gathered backward. It replaces [`reduce_from`](Self::reduce_from)
    /// after a row-parallel layer.
    ///
    /// # Errors
    /// [`ParallelError::Indivisible`](crate::ParallelError::Indivisible) if `t` does not
    /// divide the sequence length `s`; as [`reduce_from`](Self::reduce_from) for the
    /// reduce-scatter.
    ///
    /// # Panics
    /// If `x` has no axis.
    pub fn scatter_sequence<E: GradElement>(&self, x: &Tensor<E>) -> Result<Tensor<E>> {
        let shape = x.shape();
        assert!(
            !shape.is_empty(),
            "scatter_sequence: a 0-dimensional tensor has no sequence axis"
        );
        let rows = self.split("sequence length", shape[0])?;
        let mut local_shape = shape.clone();
        local_shape[0] = rows.len();
        let shard = fresh(&local_shape, is_meta(&[x]), labels::SEQUENCE_SCATTERED);
        self.call(|comm| between(x, &shard, |x, shard| comm.reduce_scatter_sum(x, shard)))?;
        let link = self.link();
        Ok(Tensor::from_op_tensors(&shard, &[x], move |grad| {
            let gathered = fresh(&shape, is_meta(&[&grad]), labels::SEQUENCE_GATHERED);
            call_in_backward(&link, &gathered, |comm| {
                between(&grad, &gathered, |grad, out| comm.all_gather(grad, out))
            });
            vec![Some(gathered)]
        }))
    }

    /// Megatron's "gather from the tensor-parallel region": every rank's columns (the last
    /// axis of `x`, `[.., c]`) concatenated in rank order into `[.., t·c]` on every rank, one
    /// all-gather forward (through a communication buffer, since the ranks' columns
    /// interleave in memory); backward, each rank keeps its own columns of the gradient,
    /// no collective. A column-parallel layer's output gathered whole.
    ///
    /// # Errors
    /// As [`gather_sequence`](Self::gather_sequence).
    ///
    /// # Panics
    /// If `x` has no axis.
    pub fn gather_last<E: GradElement>(&self, x: &Tensor<E>) -> Result<Tensor<E>> {
        let local_shape = x.shape();
        let (&columns, leading) = local_shape
            .split_last()
            .expect("gather_last: a 0-dimensional tensor has no last axis");
        let (t, rank) = (self.world_size(), self.rank());
        let rows: usize = leading.iter().product();
        let meta = is_meta(&[x]);
        let mut buffer = Metered::<E>::zeros(
            t * x.numel(),
            meta,
            communication(labels::OUTPUT_GATHERED, None),
        );
        self.call(|comm| super::views::with_view(x, |x| comm.all_gather(x, buffer.view_mut())))?;
        let mut shape = local_shape.clone();
        *shape.last_mut().expect("an axis") = t * columns;
        // The buffer holds [t, rows, c]: rank q's block lands in columns q·c..(q + 1)·c.
        let interleave = || {
            let values = buffer.values().expect("a real run").to_vec();
            let blocks = ArrayD::from_shape_vec(IxDyn(&[t, rows, columns]), values)
                .expect("t blocks of rows × c");
            let mut whole = blocks.permuted_axes(IxDyn(&[1, 0, 2]));
            whole = whole.as_standard_layout().into_owned();
            whole
                .into_shape_with_order(IxDyn(&shape))
                .expect("rows × t·c")
        };
        let own = Span::from(rank * columns..(rank + 1) * columns);
        let last = Axis(local_shape.len() - 1);
        Ok(Tensor::from_op_shaped(
            &shape.clone(),
            interleave,
            &[x],
            move |grad| vec![Some(grad.slice_axis(last, own).to_owned())],
        ))
    }
}
