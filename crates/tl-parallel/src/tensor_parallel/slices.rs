//! A rank's slice of a whole layer's weights, as a parameter of its own, and of any
//! row-major array of values (an optimizer's moment): the one place that cuts them.
//!
//! [`slice_param`] and [`slice_values`] are public, for code that splits a whole model by a
//! table of its own (tl-train's Llama, its optimizer state on resume); the parallel layers are built from the whole layer's weights, which every rank holds
//! alike (from one seed, or a checkpoint). tl-tensor's [`Linear`](tl_tensor::nn::Linear)
//! stores its weight as `[in_features, out_features]` (`y = x·W + b`, no transpose; PyTorch
//! stores `[out, in]`), so rank `r` of `t` keeps the *columns* `W[:, r·out/t..(r + 1)·out/t]`
//! of a column-parallel layer and the *rows* `W[r·in/t..(r + 1)·in/t, :]` of a row-parallel
//! one.

use std::ops::Range;

use tl_tensor::memory;
use tl_tensor::ndarray::{ArrayD, ArrayViewD, Axis, IxDyn, Slice as Span, concatenate};
use tl_tensor::{Tensor, meta};

use crate::ddp::GradElement;

/// The part `part` along `axis` of the whole parameter `whole`, as a parameter of its own
/// (a copy, not a view), owned on the memory meter by `whole`'s unit of the model; a meta
/// parameter of the part's shape when `whole` is meta. `part` is a rank's share of the axis,
/// as [`TensorParallel::split`](super::TensorParallel::split) gives it.
///
/// # Panics
/// If `axis` is not one of `whole`'s, or `part` runs past its end.
///
/// ```
/// use tl_collective::Phantom;
/// use tl_parallel::TensorParallel;
/// use tl_parallel::tensor_parallel::slice_param;
/// use tl_tensor::{Tensor, ndarray::arr2};
///
/// let tp = TensorParallel::new(Box::new(Phantom::new(1, 2)?)); // rank 1 of 2
/// let whole = Tensor::<f32>::param(arr2(&[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]).into_dyn());
/// let columns = slice_param(&whole, 1, tp.split("columns", 4)?);
/// assert_eq!((columns.shape(), columns.to_vec()), (vec![2, 2], vec![3.0, 4.0, 7.0, 8.0]));
/// assert!(columns.is_leaf() && !columns.shares_storage(&whole));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn slice_param<E: GradElement>(
    whole: &Tensor<E>,
    axis: usize,
    part: Range<usize>,
) -> Tensor<E> {
    let mut shape = whole.shape();
    shape[axis] = part.len();
    let _owner = memory::owner_scope(whole.memory_tag().owner);
    match meta::computes(&[whole]) {
        true => Tensor::param(
            whole
                .value()
                .slice_axis(Axis(axis), Span::from(part))
                .to_owned(),
        ),
        false => Tensor::meta_param(&shape),
    }
}

/// The part `part` along `axis` of the row-major values `values` of an array shaped `shape`
/// (a flat AdamW moment of a parameter of that shape), in row-major order: what
/// [`slice_param`] keeps of the parameter, for the values that go with it.
///
/// # Panics
/// If `values` does not hold `shape`'s elements, `axis` is not one of `shape`'s, or `part`
/// runs past its end.
///
/// ```
/// use tl_parallel::tensor_parallel::slice_values;
///
/// // [[1, 2, 3, 4], [5, 6, 7, 8]]: rank 1 of 2 keeps columns 2..4, rank 0 row 0.
/// let moment = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
/// assert_eq!(slice_values(&moment, &[2, 4], 1, 2..4), [3.0, 4.0, 7.0, 8.0]);
/// assert_eq!(slice_values(&moment, &[2, 4], 0, 0..1), [1.0, 2.0, 3.0, 4.0]);
/// ```
pub fn slice_values<T: Clone>(
    values: &[T],
    shape: &[usize],
    axis: usize,
    part: Range<usize>,
) -> Vec<T> {
    let whole = ArrayViewD::from_shape(IxDyn(shape), values).unwrap_or_else(|_| {
        panic!(
            "slice_values: {} values cannot be shaped {shape:?}",
            values.len()
        )
    });
    whole
        .slice_axis(Axis(axis), Span::from(part))
        .iter()
        .cloned()
        .collect()
}

/// A weight's `[in, out]`.
///
/// # Panics
/// If it is not 2-D, naming `layer`.
pub(super) fn check_weight<E: GradElement>(layer: &str, weight: &Tensor<E>) -> [usize; 2] {
    let shape = weight.shape();
    match shape[..] {
        [inputs, outputs] => [inputs, outputs],
        _ => panic!("{layer}: the weight must be [in_features, out_features], got {shape:?}"),
    }
}

/// # Panics
/// If `bias` is not `[outputs]`, naming `layer`.
pub(super) fn check_bias<E: GradElement>(layer: &str, bias: &Tensor<E>, outputs: usize) {
    assert_eq!(
        bias.shape(),
        [outputs],
        "{layer}: the bias must be [out_features] = [{outputs}]"
    );
}

/// The values `range` along `axis` of `full`, or `None` when it runs on shapes.
pub(super) fn slice_of<E: GradElement>(
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
pub(super) fn param_joined<E: GradElement>(
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::tensor_parallel::{ColumnParallelLinear, RowParallelLinear, TensorParallel};
    use tl_collective::Phantom;
    use tl_tensor::ndarray::{Array, arr1};

    /// `[4, 6]` with `w[i][j] = 10·i + j + offset`.
    pub(in crate::tensor_parallel) fn weight(offset: f64) -> Tensor<f64> {
        Tensor::param(
            Array::from_shape_fn((4, 6), |(i, j)| (10 * i + j) as f64 + offset).into_dyn(),
        )
    }

    pub(in crate::tensor_parallel) fn rank_1_of_2() -> TensorParallel {
        TensorParallel::new(Box::new(Phantom::new(1, 2).unwrap()))
    }

    #[test]
    fn each_rank_keeps_its_columns_or_rows_of_the_whole_weight() {
        let tp = rank_1_of_2();
        let (w, bias) = (
            weight(0.0),
            Tensor::param(arr1(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).into_dyn()),
        );
        let column = ColumnParallelLinear::from_full(&w, Some(&bias), &tp).unwrap();
        let columns = w.value().slice_axis(Axis(1), Span::from(3..6)).to_owned();
        assert_eq!(column.weight().to_array(), columns);
        assert_eq!(column.bias().unwrap().to_vec(), [3.0, 4.0, 5.0]);
        let row = RowParallelLinear::from_full(&w, Some(&bias), &tp).unwrap();
        let rows = w.value().slice_axis(Axis(0), Span::from(2..4)).to_owned();
        assert_eq!(row.weight().to_array(), rows);
        assert_eq!(
            row.bias().unwrap().to_vec(),
            bias.to_vec(),
            "the whole bias"
        );
        // Parameters of their own, not views of the whole layer.
        for param in column.parameters().iter().chain(&row.parameters()) {
            assert!(param.requires_grad() && param.is_leaf());
            assert!(!param.shares_storage(&w) && !param.shares_storage(&bias));
        }
        assert_eq!(row.sequence_parallel_parameters().len(), 0);
        let row = row.with_sequence_parallel(true);
        assert!(row.sequence_parallel_parameters()[0].same(row.bias().unwrap()));
    }
}
