//! [`Embedding`]: a learnable table of vectors, looked up by integer id.

use ndarray::{ArrayD, IxDyn};

use crate::{Element, Generator, Tensor};

/// A table of `num_embeddings` learnable vectors of size `dim`, looked up by id (token
/// embeddings).
///
/// It is not a [`Module`](super::Module): its input is a list of ids, not a float tensor,
/// so it has [`forward_ids`](Self::forward_ids) instead of `forward`, and its own
/// [`parameters`](Self::parameters). The lookup's VJP adds each output row's gradient into
/// the table row it came from ([`Tensor::gather_rows`]).
///
/// ```
/// use tl_tensor::nn::Embedding;
/// use tl_tensor::Generator;
/// let embedding = Embedding::<f32>::new(256, 8, &Generator::new(0));
/// // Two sequences of three tokens.
/// let x = embedding.forward_ids(&[104, 105, 33, 104, 111, 33], &[2, 3]);
/// assert_eq!(x.shape(), vec![2, 3, 8]);
/// ```
pub struct Embedding<E: Element = f32> {
    weight: Tensor<E>,
}

impl<E: Element> Embedding<E> {
    /// A table initialised as PyTorch's `nn.Embedding`: independent standard normal draws,
    /// row-major.
    pub fn new(num_embeddings: usize, dim: usize, rng: &Generator) -> Self {
        let shape = [num_embeddings, dim];
        let table =
            || ArrayD::from_shape_simple_fn(IxDyn(&shape), || E::from_f64(rng.next_normal()));
        Self {
            weight: Tensor::param_with(&shape, table),
        }
    }

    /// A table from a given `[num_embeddings, dim]` tensor, used as it is (pass a parameter
    /// to train it).
    ///
    /// # Panics
    /// If `weight` is not 2-dimensional.
    pub fn from_weight(weight: Tensor<E>) -> Self {
        let shape = weight.shape();
        assert_eq!(
            shape.len(),
            2,
            "Embedding::from_weight: the table must be [num_embeddings, dim], got {shape:?}"
        );
        Self { weight }
    }

    /// The table, `[num_embeddings, dim]`.
    pub fn weight(&self) -> &Tensor<E> {
        &self.weight
    }

    /// The number of rows (the vocabulary size).
    pub fn num_embeddings(&self) -> usize {
        self.weight.shape()[0]
    }

    /// The size of each vector.
    pub fn dim(&self) -> usize {
        self.weight.shape()[1]
    }

    /// The vectors of `ids`, shaped `[batch_shape.., dim]`; `ids` lists the batch in
    /// row-major order.
    ///
    /// # Panics
    /// If `ids.len()` is not the product of `batch_shape`, or an id is not below
    /// `num_embeddings` (naming it).
    pub fn forward_ids(&self, ids: &[usize], batch_shape: &[usize]) -> Tensor<E> {
        assert_eq!(
            ids.len(),
            batch_shape.iter().product::<usize>(),
            "Embedding: {} ids cannot fill a batch of shape {batch_shape:?}",
            ids.len()
        );
        let rows = self.weight.gather_rows(ids);
        if batch_shape.len() == 1 {
            return rows;
        }
        let mut shape = batch_shape.to_vec();
        shape.push(self.dim());
        rows.reshape(&shape)
    }

    /// The trainable parameters: the table.
    pub fn parameters(&self) -> Vec<Tensor<E>> {
        vec![self.weight.clone()]
    }

    /// The number of trainable scalars, `num_embeddings · dim`.
    pub fn num_parameters(&self) -> usize {
        self.weight.numel()
    }

    /// Drops the table's accumulated gradient.
    pub fn zero_grad(&self) {
        self.weight.zero_grad();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr2;

    #[test]
    fn rows_are_looked_up_and_shaped_by_the_batch() {
        let table =
            Tensor::<f64>::param(arr2(&[[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]]).into_dyn());
        let embedding = Embedding::from_weight(table);
        let x = embedding.forward_ids(&[2, 0, 1, 2], &[2, 2]);
        assert_eq!(x.shape(), vec![2, 2, 2]);
        assert_eq!(
            x.to_vec(),
            vec![20.0, 21.0, 0.0, 1.0, 10.0, 11.0, 20.0, 21.0]
        );
    }

    #[test]
    fn a_repeated_id_gets_the_sum_of_its_gradients() {
        let embedding = Embedding::<f64>::new(3, 2, &Generator::new(0));
        let x = embedding.forward_ids(&[2, 0, 2], &[3]);
        let weights = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]).unwrap();
        (&x * &weights).sum_all().backward();
        // Row 2 is used at positions 0 and 2: [1 + 5, 2 + 6]; row 1 is never used.
        assert_eq!(
            embedding.weight().grad().unwrap(),
            arr2(&[[3.0, 4.0], [0.0, 0.0], [6.0, 8.0]]).into_dyn()
        );
        embedding.zero_grad();
        assert!(embedding.weight().grad().is_none());
    }

    #[test]
    fn init_is_standard_normal() {
        let embedding = Embedding::<f64>::new(100, 50, &Generator::new(1));
        let values = embedding.weight().to_vec();
        let mean = values.iter().sum::<f64>() / 5000.0;
        let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5000.0;
        // Standard errors: 1/sqrt(5000) ≈ 0.014 for the mean, ≈ 0.02 for the variance.
        assert!(
            mean.abs() < 0.05 && (variance - 1.0).abs() < 0.08,
            "{mean} {variance}"
        );
        assert_eq!(embedding.num_parameters(), 5000);
    }

    #[test]
    #[should_panic(expected = "Embedding: 3 ids cannot fill a batch of shape [2, 2]")]
    fn the_batch_shape_must_fit_the_ids() {
        Embedding::<f32>::new(4, 2, &Generator::new(0)).forward_ids(&[0, 1, 2], &[2, 2]);
    }

    #[test]
    #[should_panic(expected = "id 7 out of range for a table of 4 rows")]
    fn an_id_outside_the_table_is_named() {
        Embedding::<f32>::new(4, 2, &Generator::new(0)).forward_ids(&[1, 7], &[2]);
    }
}
