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
//! Every sum in the table adds partial results (a row-parallel layer's outputs, a
//! column-parallel layer's input gradients) with the group's
//! [`partial_sum_op`](TensorParallel::partial_sum_op): under a 16-bit autocast, in its
//! format, rounded at each hop as a GPU's ring rounds it ([`ReduceIn`](super::group::ReduceIn)).
//! A backward sum uses the op its forward read.
//!
//! Every op records its backward over tensors ([`Tensor::from_op_tensors`]), so that on
//! [meta](tl_tensor::meta) tensors the backward's collective runs too, on a shape-only
//! buffer, and the meter sees the same buffers as in a real run. A collective of the
//! forward that fails returns its error; one of the backward keeps it in the group (see
//! [`TensorParallel::take_error`]) and makes the gradient NaN.

use tl_collective::ReduceOp;
use tl_tensor::Tensor;
use tl_tensor::ndarray::{ArrayD, Axis, IxDyn, Slice as Span};

use crate::ddp::GradElement;
use crate::error::Result;
use crate::metered::{Metered, communication, labels};

use super::group::{TensorParallel, all_reduce_in_backward, between, call_in_backward};
use super::views::{copy_of, fresh, is_meta, with_view, with_view_mut};

impl TensorParallel {
    /// Megatron's "copy to the tensor-parallel region" (`f` in the paper): the identity
    /// forward (the output shares `x`'s storage), and an all-reduce of the gradient
    /// backward, in place: every rank's partial gradient with respect to its copy of `x`
    /// becomes the whole one. It goes before a column-parallel layer, whose input every
    /// rank holds whole.
    ///
    /// Nothing is recorded, and no all-reduce happens backward, when `x` requires no
    /// gradient (a model's input).
    ///
    /// Under a 16-bit autocast the gradients are summed in its format, rounded at each hop
    /// ([`partial_sum_op`](Self::partial_sum_op), read now): each rank's is the output of a
    /// rounded backward product, a 16-bit tensor on a GPU, which NCCL adds in 16 bits. (A
    /// gradient that several products' gradients were added into, in f32 here, is rounded
    /// to the format before the sum, where a GPU would have rounded each addition.)
    pub fn copy_to<E: GradElement>(&self, x: &Tensor<E>) -> Tensor<E> {
        let link = self.link();
        let op = self.partial_sum_op();
        Tensor::from_op_tensors(x, &[x], move |grad| {
            all_reduce_in_backward(&link, &grad, op);
            vec![Some(grad)]
        })
    }

    /// Megatron's "reduce from the tensor-parallel region" (`g` in the paper): the sum of
    /// every rank's `x` forward (one all-reduce), and the identity backward. It ends a
    /// row-parallel layer, whose ranks each hold a partial sum of the output.
    ///
    /// Under a 16-bit autocast the sum is in its format, rounded at each hop of the ring
    /// ([`partial_sum_op`](Self::partial_sum_op)); each rank's `x` is rounded to the format
    /// first, which changes nothing for a rounded matmul's output.
    ///
    /// # Errors
    /// [`ParallelError::Collective`](crate::ParallelError::Collective) if the all-reduce
    /// fails (or an earlier collective of the group did).
    pub fn reduce_from<E: GradElement>(&self, x: &Tensor<E>) -> Result<Tensor<E>> {
        self.reduce_from_with(x, self.partial_sum_op())
    }

    /// [`reduce_from`](Self::reduce_from) with the reduction `op`.
    pub(super) fn reduce_from_with<E: GradElement>(
        &self,
        x: &Tensor<E>,
        op: ReduceOp,
    ) -> Result<Tensor<E>> {
        let sum = copy_of(x, labels::TENSOR_PARALLEL_SUM);
        self.call(|comm| with_view_mut(&sum, |values| comm.all_reduce(values, op)))?;
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
        let mut shape = x.shape();
        assert!(
            !shape.is_empty(),
            "gather_sequence: a 0-dimensional tensor has no sequence axis"
        );
        shape[0] *= self.world_size();
        self.gather_sequence_as(x, &shape)
    }

    /// [`gather_sequence`](Self::gather_sequence) whose result has the shape `shape`: the
    /// same elements in the same order (every rank's `x` in row-major order, in rank
    /// order), seen under another shape at no cost. A rank's rows of a batch's flattened
    /// tokens, `[B·T/t, d]`, gathered as the batch `[B, T, d]`.
    ///
    /// # Errors
    /// As [`gather_sequence`](Self::gather_sequence).
    ///
    /// # Panics
    /// If `shape` does not hold `t` times `x`'s elements.
    pub fn gather_sequence_as<E: GradElement>(
        &self,
        x: &Tensor<E>,
        shape: &[usize],
    ) -> Result<Tensor<E>> {
        let local_shape = x.shape();
        assert_eq!(
            shape.iter().product::<usize>(),
            self.world_size() * x.numel(),
            "gather_sequence: {} ranks' {local_shape:?} cannot be gathered as {shape:?}",
            self.world_size()
        );
        let gathered = fresh(shape, is_meta(&[x]), labels::SEQUENCE_GATHERED);
        self.call(|comm| between(x, &gathered, |x, out| comm.all_gather(x, out)))?;
        let link = self.link();
        // The gradients are partial sums, as copy_to's are: summed as its are.
        let op = self.partial_sum_op();
        Ok(Tensor::from_op_tensors(&gathered, &[x], move |grad| {
            let shard = fresh(&local_shape, is_meta(&[&grad]), labels::SEQUENCE_SCATTERED);
            call_in_backward(&link, &shard, |comm| {
                between(&grad, &shard, |grad, shard| {
                    comm.reduce_scatter(grad, shard, op)
                })
            });
            vec![Some(shard)]
        }))
    }

    /// Sequence parallelism's reduce-scatter: the sum of every rank's `x` (`[s, ..]`, a
    /// row-parallel layer's partial output) of which each rank keeps its rows of the
    /// sequence (`[s/t, ..]`, [`split`](Self::split) of `s`), one reduce-scatter forward;
    /// the gradient all-gathered backward. It replaces [`reduce_from`](Self::reduce_from)
    /// after a row-parallel layer, and sums as it does.
    ///
    /// # Errors
    /// [`ParallelError::Indivisible`](crate::ParallelError::Indivisible) if `t` does not
    /// divide the sequence length `s`; as [`reduce_from`](Self::reduce_from) for the
    /// reduce-scatter.
    ///
    /// # Panics
    /// If `x` has no axis.
    pub fn scatter_sequence<E: GradElement>(&self, x: &Tensor<E>) -> Result<Tensor<E>> {
        self.scatter_sequence_with(x, self.partial_sum_op())
    }

    /// [`scatter_sequence`](Self::scatter_sequence) with the reduction `op`.
    pub(super) fn scatter_sequence_with<E: GradElement>(
        &self,
        x: &Tensor<E>,
        op: ReduceOp,
    ) -> Result<Tensor<E>> {
        let mut local_shape = x.shape();
        assert!(
            !local_shape.is_empty(),
            "scatter_sequence: a 0-dimensional tensor has no sequence axis"
        );
        local_shape[0] = self.split("sequence length", local_shape[0])?.len();
        self.scatter_sequence_as_with(x, &local_shape, op)
    }

    /// [`scatter_sequence`](Self::scatter_sequence) of `x` seen as rows of its elements in
    /// row-major order: this rank's share of the sum, elements `r·n/t..(r + 1)·n/t`, shaped
    /// `shape`. A batch's partial output `[B, T, d]` reduce-scattered into the rank's rows
    /// of the flattened tokens, `[B·T/t, d]`, at no cost for the change of shape.
    ///
    /// # Errors
    /// As [`scatter_sequence`](Self::scatter_sequence), for the reduce-scatter.
    ///
    /// # Panics
    /// If `t` times `shape`'s elements are not `x`'s.
    pub fn scatter_sequence_as<E: GradElement>(
        &self,
        x: &Tensor<E>,
        shape: &[usize],
    ) -> Result<Tensor<E>> {
        self.scatter_sequence_as_with(x, shape, self.partial_sum_op())
    }

    fn scatter_sequence_as_with<E: GradElement>(
        &self,
        x: &Tensor<E>,
        local_shape: &[usize],
        op: ReduceOp,
    ) -> Result<Tensor<E>> {
        let shape = x.shape();
        assert_eq!(
            self.world_size() * local_shape.iter().product::<usize>(),
            x.numel(),
            "scatter_sequence: {shape:?} cannot be scattered into {} ranks' {local_shape:?}",
            self.world_size()
        );
        let shard = fresh(local_shape, is_meta(&[x]), labels::SEQUENCE_SCATTERED);
        self.call(|comm| between(x, &shard, |x, shard| comm.reduce_scatter(x, shard, op)))?;
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
        self.call(|comm| with_view(x, |x| comm.all_gather(x, buffer.view_mut())))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use tl_collective::{Collective, CommStats, Phantom, Single, ring_bytes_sent};
    use tl_precision::Format;
    use tl_tensor::ndarray::arr2;

    type Op = fn(&TensorParallel, &Tensor<f64>) -> Tensor<f64>;

    const OPS: [(&str, Op); 5] = [
        ("copy_to", |tp, x| tp.copy_to(x)),
        ("reduce_from", |tp, x| tp.reduce_from(x).unwrap()),
        ("gather_sequence", |tp, x| tp.gather_sequence(x).unwrap()),
        ("scatter_sequence", |tp, x| tp.scatter_sequence(x).unwrap()),
        ("gather_last", |tp, x| tp.gather_last(x).unwrap()),
    ];

    #[test]
    fn on_a_world_of_one_every_op_is_the_identity_both_ways() {
        let tp = TensorParallel::new(Box::new(Single::new()));
        for (name, op) in OPS {
            let x = Tensor::param(arr2(&[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).into_dyn());
            let y = op(&tp, &x);
            assert_eq!((y.shape(), y.to_vec()), (x.shape(), x.to_vec()), "{name}");
            let weights =
                Tensor::from_array(arr2(&[[1.0, -2.0, 3.0], [0.5, 7.0, -1.0]]).into_dyn());
            (&y * &weights).sum_all().backward();
            assert_eq!(x.grad().unwrap(), weights.to_array(), "{name}");
        }
        assert!(tp.take_error().is_none());
    }

    /// Rank 1 of 4 runs `op` forward and backward on a meta `[rows, 3]` input: the output's
    /// shape, and what the forward and the backward cost.
    fn on_meta(op: Op, rows: usize) -> (Vec<usize>, [CommStats; 2]) {
        let tp = TensorParallel::new(Box::new(Phantom::new(1, 4).unwrap()));
        let x = Tensor::<f64>::meta_param(&[rows, 3]);
        let y = op(&tp, &x);
        let forward = tp.stats();
        y.sum_all().backward();
        assert!(y.is_meta() && x.grad_is_meta());
        let backward = tp.stats();
        let backward = backward - forward;
        (y.shape(), [forward, backward])
    }

    #[test]
    fn on_meta_tensors_every_op_states_its_shape_and_costs_its_collectives() {
        // Under a bf16 autocast the sums of partial results (all-reduce, reduce-scatter)
        // send 2 bytes an element; the gathers move f64s, 8 bytes, as outside it.
        for (format, sum_bytes) in [(None, 8), (Some(Format::Bf16), 2)] {
            let _autocast = format.map(tl_precision::autocast);
            every_op_costs_its_collectives(sum_bytes);
        }
    }

    fn every_op_costs_its_collectives(sum_bytes: u64) {
        let cost = |calls: &[(Collective, u64)]| CommStats {
            collectives: calls.len() as u64,
            bytes_sent: calls
                .iter()
                .map(|&(c, n)| {
                    let bytes = if c == Collective::AllGather {
                        8
                    } else {
                        sum_bytes
                    };
                    ring_bytes_sent(c, n, bytes, 4, 1)
                })
                .sum(),
            ..CommStats::default()
        };
        use Collective::{AllGather, AllReduce, ReduceScatter};
        let expected: [(&str, usize, Vec<usize>, [CommStats; 2]); 5] = [
            (
                "copy_to",
                2,
                vec![2, 3],
                [cost(&[]), cost(&[(AllReduce, 6)])],
            ),
            (
                "reduce_from",
                2,
                vec![2, 3],
                [cost(&[(AllReduce, 6)]), cost(&[])],
            ),
            (
                "gather_sequence",
                2,
                vec![8, 3],
                [cost(&[(AllGather, 24)]), cost(&[(ReduceScatter, 24)])],
            ),
            (
                "scatter_sequence",
                8,
                vec![2, 3],
                [cost(&[(ReduceScatter, 24)]), cost(&[(AllGather, 24)])],
            ),
            (
                "gather_last",
                2,
                vec![2, 12],
                [cost(&[(AllGather, 24)]), cost(&[])],
            ),
        ];
        for ((name, op), (expected_name, rows, shape, stats)) in OPS.into_iter().zip(expected) {
            assert_eq!(name, expected_name);
            assert_eq!(on_meta(op, rows), (shape, stats), "{name}");
        }
    }

    #[test]
    fn gather_last_puts_each_ranks_columns_in_its_place() {
        // Rank 1 of 2 over a Phantom, whose all-gather writes this rank's shard and leaves
        // the other as it was (zeros): rank 1's columns are columns 3..6 of every row.
        let tp = TensorParallel::new(Box::new(Phantom::new(1, 2).unwrap()));
        let x = Tensor::param(arr2(&[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).into_dyn());
        let y = tp.gather_last(&x).unwrap();
        let whole = arr2(&[
            [0.0, 0.0, 0.0, 1.0, 2.0, 3.0],
            [0.0, 0.0, 0.0, 4.0, 5.0, 6.0],
        ]);
        assert_eq!(y.to_array(), whole.into_dyn());
        let weights = Tensor::from_array(
            arr2(&[
                [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
                [7.0, 8.0, 9.0, 10.0, 11.0, 12.0],
            ])
            .into_dyn(),
        );
        (&y * &weights).sum_all().backward();
        // Backward keeps this rank's columns of the gradient.
        let own = arr2(&[[4.0, 5.0, 6.0], [10.0, 11.0, 12.0]]).into_dyn();
        assert_eq!(x.grad().unwrap(), own);
    }

    #[test]
    fn a_ranks_rows_of_the_tokens_gather_as_the_batch_and_scatter_back() {
        // Rank 1 of 2 over a Phantom (the others' parts stay zeros): its rows [3, 2] of the
        // 6 tokens of a [2, 3] batch are the second sequence of the gathered [2, 3, 2].
        let tp = TensorParallel::new(Box::new(Phantom::new(1, 2).unwrap()));
        let rows = Tensor::param(arr2(&[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).into_dyn());
        let batch = tp.gather_sequence_as(&rows, &[2, 3, 2]).unwrap();
        assert_eq!(batch.shape(), [2, 3, 2]);
        let expected = [0.0; 6]
            .into_iter()
            .chain(rows.to_vec())
            .collect::<Vec<_>>();
        assert_eq!(batch.to_vec(), expected);
        // Backward: the gradient's second half, rank 1's share of the reduce-scatter.
        let weights: Vec<f64> = (0..12).map(f64::from).collect();
        let weights = Tensor::from_vec(weights, &[2, 3, 2]).unwrap();
        (&batch * &weights).sum_all().backward();
        assert_eq!(
            rows.grad().unwrap().iter().copied().collect::<Vec<_>>(),
            [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
        );

        // And back: a [2, 3, 2] partial output into rank 1's rows [3, 2].
        let partial = Tensor::param(
            ArrayD::from_shape_vec(IxDyn(&[2, 3, 2]), (0..12).map(f64::from).collect()).unwrap(),
        );
        let own = tp.scatter_sequence_as(&partial, &[3, 2]).unwrap();
        assert_eq!(own.shape(), [3, 2]);
        assert_eq!(own.to_vec(), [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
        own.sum_all().backward();
        let grad: Vec<f64> = partial.grad().unwrap().iter().copied().collect();
        assert_eq!(grad, [[0.0; 6], [1.0; 6]].concat());
        assert!(tp.take_error().is_none());
    }

    #[test]
    #[should_panic(expected = "gather_sequence: 2 ranks' [3, 2] cannot be gathered as [3, 3, 2]")]
    fn a_gathered_shape_must_hold_every_ranks_elements() {
        let tp = TensorParallel::new(Box::new(Phantom::new(0, 2).unwrap()));
        let _ = tp.gather_sequence_as(&Tensor::<f32>::zeros(&[3, 2]), &[3, 3, 2]);
    }

    #[test]
    #[should_panic(expected = "gather_sequence: a 0-dimensional tensor has no sequence axis")]
    fn a_scalar_has_no_sequence_to_gather() {
        let tp = TensorParallel::new(Box::new(Single::new()));
        let _ = tp.gather_sequence(&Tensor::<f32>::scalar(1.0));
    }
}
