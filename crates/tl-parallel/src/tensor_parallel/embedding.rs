//! [`VocabParallelEmbedding`]: a token embedding whose table is split over the vocabulary.

use std::ops::Range;

use tl_collective::ReduceOp;
use tl_tensor::Tensor;
use tl_tensor::ndarray::{ArrayD, Axis, IxDyn};

use crate::ddp::GradElement;
use crate::error::Result;

use super::group::TensorParallel;
use super::slices::slice_param;

/// A table of `V` vectors of size `D` split over the vocabulary: rank `r` of `t` holds rows
/// [`split`](TensorParallel::split)`(V)`, `[r·V/t, (r + 1)·V/t)`, looks up the ids that fall
/// there and writes zeros for the others; the ranks' lookups are then summed
/// ([`reduce_from`](TensorParallel::reduce_from), one all-reduce forward, none backward),
/// so that every rank has every id's vector. Under sequence parallelism the sum is
/// reduce-scattered into each rank's rows of the sequence instead
/// ([`scatter_sequence`](TensorParallel::scatter_sequence)).
///
/// Backward, each rank's table gradient gets the rows of its own ids only: its slice of the
/// whole table's gradient.
///
/// ```
/// use tl_collective::Single;
/// use tl_parallel::{TensorParallel, VocabParallelEmbedding};
/// use tl_tensor::nn::Embedding;
/// use tl_tensor::Generator;
///
/// let tp = TensorParallel::new(Box::new(Single::new()));
/// let full = Embedding::<f32>::new(16, 4, &Generator::new(0));
/// let embedding = VocabParallelEmbedding::from_full(full.weight(), &tp)?;
/// let ids = [3, 15, 3];
/// let x = embedding.forward_ids(&ids, &[3])?;
/// assert_eq!(x.to_vec(), full.forward_ids(&ids, &[3]).to_vec());
/// # Ok::<(), tl_parallel::ParallelError>(())
/// ```
pub struct VocabParallelEmbedding<E: GradElement> {
    tp: TensorParallel,
    weight: Tensor<E>,
    /// The ids whose rows this rank holds.
    vocabulary: Range<usize>,
    vocab_size: usize,
    sequence_parallel: bool,
}

impl<E: GradElement> VocabParallelEmbedding<E> {
    /// This rank's rows of the whole table `table` (`[V, D]`, as
    /// [`Embedding`](tl_tensor::nn::Embedding) stores it), as a parameter of its own.
    ///
    /// # Errors
    /// [`ParallelError::Indivisible`](crate::ParallelError::Indivisible) if `t` does not
    /// divide `V`.
    ///
    /// # Panics
    /// If `table` is not 2-D.
    pub fn from_full(table: &Tensor<E>, tp: &TensorParallel) -> Result<Self> {
        let shape = table.shape();
        assert_eq!(
            shape.len(),
            2,
            "VocabParallelEmbedding: the table must be [num_embeddings, dim], got {shape:?}"
        );
        let vocabulary = tp.split("vocabulary", shape[0])?;
        let weight = slice_param(table, 0, vocabulary.clone());
        Ok(Self {
            tp: tp.clone(),
            weight,
            vocabulary,
            vocab_size: shape[0],
            sequence_parallel: false,
        })
    }

    /// Reduce-scatters the vectors into each rank's rows of the sequence (axis 0 of the
    /// batch), or all-reduces them whole (the default).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// The vectors of `ids`, shaped `[batch_shape.., D]` (`ids` lists the batch in
    /// row-major order), the same on every rank; under sequence parallelism this rank's
    /// rows of axis 0 only.
    ///
    /// # Errors
    /// [`ParallelError::Collective`](crate::ParallelError::Collective) if the reduction
    /// fails; under sequence parallelism
    /// [`ParallelError::Indivisible`](crate::ParallelError::Indivisible) if `t` does not
    /// divide `batch_shape[0]`.
    ///
    /// # Panics
    /// If `ids.len()` is not the product of `batch_shape`, `batch_shape` is empty, or an id
    /// is not below `V` (naming it).
    pub fn forward_ids(&self, ids: &[usize], batch_shape: &[usize]) -> Result<Tensor<E>> {
        assert!(
            !batch_shape.is_empty() && ids.len() == batch_shape.iter().product::<usize>(),
            "VocabParallelEmbedding: {} ids cannot fill a batch of shape {batch_shape:?}",
            ids.len()
        );
        if let Some(&bad) = ids.iter().find(|&&id| id >= self.vocab_size) {
            panic!(
                "VocabParallelEmbedding: id {bad} out of range for a vocabulary of {}",
                self.vocab_size
            );
        }
        let mut shape = batch_shape.to_vec();
        shape.push(self.weight.shape()[1]);
        let local = self.lookup(ids).reshape(&shape);
        // Summed in the element type even under autocast: a lookup is no product, so its
        // rows are not rounded (one process would not round them), and each sum adds one
        // row to zeros, exactly.
        match self.sequence_parallel {
            true => self.tp.scatter_sequence_with(&local, ReduceOp::Sum),
            false => self.tp.reduce_from_with(&local, ReduceOp::Sum),
        }
    }

    /// Rows `ids` of the table where this rank holds them, zeros elsewhere, `[ids, D]`.
    /// Backward, each row's gradient is added into the table row it came from.
    fn lookup(&self, ids: &[usize]) -> Tensor<E> {
        let dim = self.weight.shape()[1];
        let start = self.vocabulary.start;
        // Each id's row in this rank's table, if it holds it.
        let local_rows: Vec<Option<usize>> = ids
            .iter()
            .map(|id| self.vocabulary.contains(id).then(|| id - start))
            .collect();
        let value = || {
            let table = self.weight.value();
            let mut value = ArrayD::zeros(IxDyn(&[ids.len(), dim]));
            for (mut out, row) in value.outer_iter_mut().zip(&local_rows) {
                if let Some(row) = *row {
                    out.assign(&table.index_axis(Axis(0), row));
                }
            }
            value
        };
        let (table_shape, saved_rows) = (self.weight.shape(), local_rows.clone());
        Tensor::from_op_shaped(&[ids.len(), dim], value, &[&self.weight], move |grad| {
            let mut table_grad = ArrayD::<E>::zeros(IxDyn(&table_shape));
            for (grad_row, row) in grad.outer_iter().zip(&saved_rows) {
                if let Some(row) = *row {
                    let mut target = table_grad.index_axis_mut(Axis(0), row);
                    target += &grad_row;
                }
            }
            vec![Some(table_grad)]
        })
    }

    /// This rank's rows of the table, `[V/t, D]`.
    pub fn weight(&self) -> &Tensor<E> {
        &self.weight
    }

    /// The ids whose rows this rank holds.
    pub fn vocabulary(&self) -> Range<usize> {
        self.vocabulary.clone()
    }

    /// The parameters this rank trains: its rows of the table.
    pub fn parameters(&self) -> Vec<Tensor<E>> {
        vec![self.weight.clone()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_collective::{Phantom, Single};
    use tl_tensor::Generator;
    use tl_tensor::ndarray::arr2;
    use tl_tensor::nn::Embedding;

    #[test]
    fn on_a_world_of_one_it_is_the_embedding() {
        let tp = TensorParallel::new(Box::new(Single::new()));
        let full = Embedding::<f64>::new(6, 3, &Generator::new(1));
        let embedding = VocabParallelEmbedding::from_full(full.weight(), &tp).unwrap();
        let ids = [5, 0, 5, 2];
        let (ours, theirs) = (
            embedding.forward_ids(&ids, &[2, 2]).unwrap(),
            full.forward_ids(&ids, &[2, 2]),
        );
        assert_eq!(
            (ours.shape(), ours.to_vec()),
            (theirs.shape(), theirs.to_vec())
        );
        ours.mul_scalar(3.0).sum_all().backward();
        theirs.mul_scalar(3.0).sum_all().backward();
        assert_eq!(embedding.weight().grad(), full.weight().grad());
    }

    #[test]
    fn a_rank_looks_up_its_own_rows_and_writes_zeros_for_the_others() {
        // Rank 1 of 2 holds ids 2 and 3; the Phantom's all-reduce leaves the lookup as it is.
        let tp = TensorParallel::new(Box::new(Phantom::new(1, 2).unwrap()));
        let table = Tensor::<f64>::param(
            arr2(&[[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]).into_dyn(),
        );
        let embedding = VocabParallelEmbedding::from_full(&table, &tp).unwrap();
        assert_eq!(embedding.vocabulary(), 2..4);
        let x = embedding.forward_ids(&[0, 3, 2, 3], &[4]).unwrap();
        assert_eq!(x.to_vec(), [0.0, 0.0, 4.0, 4.0, 3.0, 3.0, 4.0, 4.0]);
        x.sum_all().backward();
        // Id 2 once, id 3 twice; ids 0 and 1 are another rank's.
        let grad = arr2(&[[1.0, 1.0], [2.0, 2.0]]).into_dyn();
        assert_eq!(embedding.weight().grad().unwrap(), grad);
    }

    #[test]
    #[should_panic(expected = "VocabParallelEmbedding: id 8 out of range for a vocabulary of 8")]
    fn an_id_outside_the_whole_vocabulary_is_named() {
        let tp = TensorParallel::new(Box::new(Phantom::new(0, 2).unwrap()));
        let table = Tensor::<f32>::zeros(&[8, 2]);
        let _ = VocabParallelEmbedding::from_full(&table, &tp)
            .unwrap()
            .forward_ids(&[1, 8], &[2]);
    }
}
