//! Rotary position embedding (Su et al., 2021), as one op with its VJP.

use ndarray::{ArrayD, IxDyn};
use rayon::prelude::*;
use tl_tensor::kernels::rotary::pair_tables;
use tl_tensor::kernels::written::{write_rows, written_on_pool};
use tl_tensor::ops::elementwise::PARALLEL_MIN_LEN;
use tl_tensor::{Element, Tensor};

/// The rotary tables of a model: for position `t` and pair `i` of a head of size `hd`, the
/// angle `θ = t · base^(−2i/hd)`.
///
/// Pairs are interleaved, as in Meta's Llama and `llama_ref.py`: elements `2i` and `2i + 1` of
/// each head form one pair, rotated by `θ`:
///
/// ```text
/// y[2i]     = x[2i]·cos θ − x[2i+1]·sin θ
/// y[2i + 1] = x[2i]·sin θ + x[2i+1]·cos θ
/// ```
///
/// A rotation is orthogonal, so the VJP rotates the gradient by `−θ`. Both directions are
/// one pass over memory and save nothing but the tables, which the model shares.
///
/// The angles are computed in `f64` and rounded once to the element type. They are kept as
/// tl-tensor's [pair tables](tl_tensor::kernels::rotary::pair_tables), a head's length per
/// position, so that a rotation is one vector pass.
pub struct Rope<E: Element> {
    cos: Vec<E>,
    sin: Vec<E>,
    /// The pair tables' `sin` for `−θ`, for the VJP.
    sin_inverse: Vec<E>,
    head_dim: usize,
    context: usize,
}

impl<E: Element> Rope<E> {
    /// Tables for heads of size `head_dim` (even) and positions `0..context`.
    ///
    /// # Panics
    /// If `head_dim` is odd or zero.
    pub fn new(head_dim: usize, context: usize, base: f64) -> Self {
        assert!(
            head_dim > 0 && head_dim.is_multiple_of(2),
            "Rope: the head size must be even and positive, got {head_dim}"
        );
        let angles: Vec<f64> = (0..context)
            .flat_map(|t| {
                (0..head_dim / 2)
                    .map(move |i| t as f64 * base.powf(-((2 * i) as f64) / head_dim as f64))
            })
            .collect();
        let (cos, sin) = pair_tables(&angles, false);
        // −θ has the same cosines and the sines negated (exactly).
        let sin_inverse = sin.iter().map(|&s: &E| -s).collect();
        Self {
            cos,
            sin,
            sin_inverse,
            head_dim,
            context,
        }
    }

    /// Rotates `x` of shape `[batch, time, heads, head_dim]`, or `[batch, time, heads·head_dim]`
    /// with the heads side by side; position `t` is the index on the time axis.
    ///
    /// # Panics
    /// If `x` is neither, for this head size, or `time` exceeds the tables' context.
    pub fn apply(self: &std::rc::Rc<Self>, x: &Tensor<E>) -> Tensor<E> {
        let shape = x.shape();
        let head_dim = self.head_dim;
        let heads_last = match shape.len() {
            4 => shape[3] == head_dim,
            3 => shape[2].is_multiple_of(head_dim),
            _ => false,
        };
        assert!(
            heads_last && shape[1] <= self.context,
            "Rope: expected [batch, time <= {}, heads, {head_dim}] or [batch, time, heads·{head_dim}], \
             got {shape:?}",
            self.context,
        );
        let value = || self.rotate(&x.value(), false);
        let tables = std::rc::Rc::clone(self);
        Tensor::from_op_shaped(&shape, value, &[x], move |grad_out| {
            vec![Some(tables.rotate(&grad_out, true))]
        })
    }

    /// Rotates every pair of `x` by `+θ`, or by `−θ` when `inverse`. Each position is one
    /// task for the rayon pool when the array is large; an element's value never depends on
    /// the split.
    fn rotate(&self, x: &ArrayD<E>, inverse: bool) -> ArrayD<E> {
        let shape = x.shape().to_vec();
        let x = x.as_standard_layout();
        let input = x.as_slice().expect("standard layout");
        let head_dim = self.head_dim;
        let sin = if inverse {
            &self.sin_inverse
        } else {
            &self.sin
        };
        // A row is one position of one sequence (at least 1 wide, so an empty tensor chunks).
        let (time, row) = (shape[1], shape[2..].iter().product::<usize>().max(1));
        // One task per position when the array is large, else one task for all.
        let rows_per_task = if input.len() >= PARALLEL_MIN_LEN {
            1
        } else {
            input.len().div_ceil(row).max(1)
        };
        let chunk = rows_per_task * row;
        let tasks = input.par_chunks(chunk).enumerate();
        let (out, _) = written_on_pool(input.len(), chunk, tasks, |out, (task, src)| {
            let out = write_rows(out, row, |i, dst| {
                let t = (task * rows_per_task + i) % time;
                let tables = t * head_dim..(t + 1) * head_dim;
                let src = &src[i * row..(i + 1) * row];
                E::rotate_pairs(src, dst, &self.cos[tables.clone()], &sin[tables])
            });
            (out, ())
        });
        ArrayD::from_shape_vec(IxDyn(&shape), out).expect("same count")
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;
    use tl_tensor::testing::assert_gradients;

    #[test]
    fn position_zero_is_the_identity_and_position_one_rotates_by_one_radian() {
        // Head size 2: one pair with frequency base^0 = 1, so θ = t radians.
        let rope = Rc::new(Rope::<f64>::new(2, 2, 10_000.0));
        let x = Tensor::from_vec(vec![1.0, 0.0, 1.0, 0.0], &[1, 2, 1, 2]).unwrap();
        let y = rope.apply(&x).to_vec();
        assert_eq!(&y[..2], &[1.0, 0.0]);
        assert_eq!(&y[2..], &[1f64.cos(), 1f64.sin()]);
    }

    #[test]
    fn the_second_pair_turns_base_to_the_minus_half_times_slower() {
        // Head size 4: pair 1 has frequency 100^(−2/4) = 0.1, so at t = 1 it turns 0.1 rad.
        let rope = Rc::new(Rope::<f64>::new(4, 2, 100.0));
        let x = Tensor::from_vec(
            vec![0.0; 4]
                .into_iter()
                .chain([0.0, 0.0, 1.0, 0.0])
                .collect(),
            &[1, 2, 1, 4],
        )
        .unwrap();
        let y = rope.apply(&x).to_vec();
        assert!((y[6] - 0.1f64.cos()).abs() < 1e-15);
        assert!((y[7] - 0.1f64.sin()).abs() < 1e-15);
    }

    #[test]
    fn a_long_input_with_heads_side_by_side_rotates_every_position() {
        // 32 sequences of 40 positions, 4 heads of 8 side by side: 40,960 elements, enough
        // for the rayon pool. Each output pair is checked against the formula.
        let (batch, time, heads, head_dim) = (32, 40, 4, 8);
        let len = batch * time * heads * head_dim;
        assert!(len >= PARALLEL_MIN_LEN);
        let data: Vec<f64> = (0..len)
            .map(|i| ((i * 37 % 101) as f64 - 50.0) / 7.0)
            .collect();
        let rope = Rc::new(Rope::<f64>::new(head_dim, time, 10_000.0));
        let x = Tensor::from_vec(data.clone(), &[batch, time, heads * head_dim]).unwrap();
        let y = rope.apply(&x).to_vec();
        for (index, pair) in y.chunks(2).enumerate() {
            let i = index % (head_dim / 2);
            let t = index / (heads * head_dim / 2) % time;
            let angle = t as f64 * 10_000f64.powf(-((2 * i) as f64) / head_dim as f64);
            let (x1, x2) = (data[2 * index], data[2 * index + 1]);
            assert_eq!(pair[0], x1 * angle.cos() - x2 * angle.sin(), "pair {index}");
            assert_eq!(pair[1], x1 * angle.sin() + x2 * angle.cos(), "pair {index}");
        }
    }

    #[test]
    fn rotation_keeps_norms_and_the_vjp_matches_finite_differences() {
        let rope = Rc::new(Rope::<f64>::new(4, 5, 10_000.0));
        let data: Vec<f64> = (0..2 * 5 * 3 * 4)
            .map(|i| ((i * 37 % 11) as f64 - 5.0) / 3.0)
            .collect();
        let x = ArrayD::from_shape_vec(IxDyn(&[2, 5, 3, 4]), data.clone()).unwrap();
        let y = rope.apply(&Tensor::from_array(x.clone())).to_vec();
        for (a, b) in data.chunks(2).zip(y.chunks(2)) {
            let (norm_in, norm_out) = (a[0].hypot(a[1]), b[0].hypot(b[1]));
            assert!((norm_in - norm_out).abs() < 1e-14);
        }
        assert_gradients(|xs| rope.apply(&xs[0]), &[x]);
    }
}
