//! The fused causal attention kernel, `softmax(q·kᵀ·scale + M)·v` for every head, forward
//! and backward, as flash attention computes it but for a CPU's caches:
//!
//! - **One task per (sequence, head).** Each reads its head's columns of `q`, `k` and `v`
//!   (`[B, T, d]`, heads side by side) where they are, and writes its columns of the
//!   `[B, T, d]` result: no head-split or merge copies. The `B·H` tasks go to the rayon pool;
//!   each runs its products on one thread ([`gemm_serial_into`]).
//! - **Grouped-query attention without copies.** With fewer key/value heads than query
//!   heads (`n_kv_heads` dividing `n_heads`, as Llama 2 70B and Llama 3 have them), query
//!   head `h` reads key/value head `h / (n_heads / n_kv_heads)` where it is, instead of a
//!   `repeat_kv` copy. Backward runs one task per (sequence, key/value head), which walks
//!   its group's query heads in order and adds their key and value gradients in that order
//!   (each rounded first under autocast, as a copy's backward would sum the rounded
//!   gradients of the repeated heads, then the sum rounded once): the same bits on any
//!   number of threads.
//! - **Blocks of query rows.** Rows `r0..r1` only see keys `0..r1`, so a block multiplies
//!   `q[r0..r1]` by `k[..r1]ᵀ` — the upper triangle past the block is never computed — and its
//!   `(r1−r0)×r1` scores stay in cache through the softmax and the product with `v[..r1]`.
//! - **Nothing of size `T×T` is kept.** The forward pass returns each row's maximum and sum;
//!   the backward pass recomputes the probabilities from them, with the same products on the
//!   same operands and the same formula, so they are the forward pass's bits exactly.
//! - **Where it rounds is a parameter.** This crate knows nothing of number formats: a
//!   [`Rounding`] says how to round values and gradients, and the kernel applies it exactly
//!   where the separate ops' casts would stand under autocast (see tinyllm's model for the
//!   op that wires it to tl-precision).
//!
//! Every split is a function of the shape, so the result has the same bits on any number of
//! threads.

use ndarray::{Array2, ArrayD, ArrayView2, ArrayViewMut2, Axis, Ix2, s};
use rayon::prelude::*;

use super::gemm::gemm_serial_into;
use super::rows::{contiguous, copy_rows};
use crate::ops::elementwise::zeros_array_on_pool;
use crate::ops::matmul_with::kernel_product_into;
use crate::{Element, Finisher, PreparedRhs, ProductKernel};

/// Query rows per block: 64 rows of up to 512 scores (128 KiB in f32) and their gradient
/// fit in a core's L2 cache next to the head's keys and values.
pub const ROW_BLOCK: usize = 64;

/// How the kernel rounds, when it emulates 16-bit products: `values` rounds operands, scores,
/// probabilities and the output in place; `gradients` rounds a gradient in place and returns
/// how many of its values it flushed to zero. Both are called from the pool's threads, on
/// blocks the kernel has in cache.
pub struct Rounding<'a, E> {
    /// Rounds values in place.
    pub values: &'a Finisher<'a, E>,
    /// Rounds gradient values in place; returns how many became zero.
    pub gradients: &'a (dyn Fn(&mut [E]) -> u64 + Sync + 'a),
    /// Computes every product (forward and backward) when the hardware's inner sums are not
    /// the element type's (a tensor core's); `None` for the plain GEMM.
    pub products: Option<&'a dyn ProductKernel>,
}

/// The geometry of one fused attention: `batch` sequences of `time` positions, `n_heads`
/// heads of `head_dim` columns each, scores multiplied by `scale` (usually `1/√head_dim`)
/// before the causal mask and the softmax.
///
/// ```
/// use tl_tensor::kernels::attention::CausalAttention;
/// use tl_tensor::ndarray::{ArrayD, IxDyn};
///
/// let kernel = CausalAttention {
///     batch: 1, time: 2, n_heads: 1, n_kv_heads: 1, head_dim: 1, scale: 1.0_f64,
/// };
/// let q = ArrayD::from_shape_vec(IxDyn(&[1, 2, 1]), vec![0.0, 0.0]).unwrap();
/// let v = ArrayD::from_shape_vec(IxDyn(&[1, 2, 1]), vec![1.0, 3.0]).unwrap();
/// let (out, _row_stats) = kernel.forward(&q, &q, &v, None);
/// // Equal scores: row 0 sees v₀, row 1 the mean of v₀ and v₁.
/// assert_eq!(out.iter().copied().collect::<Vec<_>>(), [1.0, 2.0]);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct CausalAttention<E> {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence.
    pub time: usize,
    /// Query heads, side by side in the last axis of `q` and of the result.
    pub n_heads: usize,
    /// Key/value heads, side by side in the last axis of `k` and `v`: `n_heads` for
    /// multi-head attention, fewer (a divisor of `n_heads`) for grouped-query attention.
    pub n_kv_heads: usize,
    /// Columns per head.
    pub head_dim: usize,
    /// The factor applied to every score.
    pub scale: E,
}

impl<E: Element> CausalAttention<E> {
    /// The attention of every head of `q` (`[B, T, H·hd]`, heads side by side) against its
    /// key/value head of `k`, `v` (`[B, T, H_kv·hd]`), `[B, T, H·hd]` laid out as `q`, and
    /// each row's softmax maximum and sum for [`backward`](Self::backward) (`[B, H, T, 2]`
    /// flattened). With `rounding`, the operands, the scores, the probabilities and the
    /// output are rounded where 16-bit products would round them.
    ///
    /// # Panics
    /// If an array is not of this geometry, or `n_kv_heads` does not divide `n_heads`.
    pub fn forward(
        &self,
        q: &ArrayD<E>,
        k: &ArrayD<E>,
        v: &ArrayD<E>,
        rounding: Option<&Rounding<'_, E>>,
    ) -> (ArrayD<E>, Vec<E>) {
        self.check_shapes([q, k, v]);
        let mut out = zeros_array_on_pool(&[self.batch, self.time, self.n_heads * self.head_dim]);
        let mut row_stats = vec![E::zero(); self.batch * self.n_heads * self.time * 2];
        self.columns_mut(&mut out)
            .into_par_iter()
            .zip(row_stats.par_chunks_mut(self.stats_per_head()))
            .enumerate()
            .for_each(|(task, (out, stats))| {
                let q = self.head(q, task);
                let [k, v] = [k, v].map(|x| self.kv_head(x, task / self.group()));
                self.forward_head([q, k, v], out, stats, rounding);
            });
        (out, row_stats)
    }

    /// The gradients of `q`, `k` and `v` for the output gradient `d_out`, from the inputs
    /// and the row statistics of [`forward`](Self::forward), and how many gradient values
    /// `rounding` flushed to zero. The probabilities are recomputed with the forward pass's
    /// products and formula, so they are its bits; with `rounding`, every gradient is rounded
    /// where a cast stands in the separate ops' graph (`dO`, `dP`, `dS`, `dq`, `dk`, `dv`).
    ///
    /// # Panics
    /// If an array is not of this geometry, or `row_stats` not the forward pass's.
    pub fn backward(
        &self,
        [q, k, v]: [&ArrayD<E>; 3],
        row_stats: &[E],
        d_out: &ArrayD<E>,
        rounding: Option<&Rounding<'_, E>>,
    ) -> ([ArrayD<E>; 3], u64) {
        self.check_shapes([q, k, v]);
        let (hd, group) = (self.head_dim, self.group());
        let shape = |heads: usize| [self.batch, self.time, heads * hd];
        let mut grads = [self.n_heads, self.n_kv_heads, self.n_kv_heads]
            .map(|heads| zeros_array_on_pool(&shape(heads)));
        let [dq, dk, dv] = &mut grads;
        // One task per (sequence, key/value head): its group's query heads' columns of dq.
        let tasks: Vec<_> = columns_mut(dq, self.n_kv_heads, group * hd)
            .into_iter()
            .zip(columns_mut(dk, self.n_kv_heads, hd))
            .zip(columns_mut(dv, self.n_kv_heads, hd))
            .collect();
        let flushed = tasks
            .into_par_iter()
            .zip(row_stats.par_chunks(group * self.stats_per_head()))
            .enumerate()
            .map(|(task, (((dq, dk), dv), stats))| {
                let kv = [k, v].map(|x| self.kv_head(x, task));
                let queries = (0..group).map(|j| {
                    let head = task * group + j;
                    let stats = &stats[j * self.stats_per_head()..][..self.stats_per_head()];
                    (self.head(q, head), self.head(d_out, head), stats)
                });
                self.backward_group(queries, kv, [dq, dk, dv], rounding)
            })
            .sum();
        (grads, flushed)
    }

    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Checks `q`, `k`, `v` against the geometry.
    fn check_shapes(&self, [q, k, v]: [&ArrayD<E>; 3]) {
        assert!(
            self.n_kv_heads > 0 && self.n_heads.is_multiple_of(self.n_kv_heads),
            "CausalAttention: {} key/value heads do not divide {} query heads",
            self.n_kv_heads,
            self.n_heads
        );
        let (b, t, hd) = (self.batch, self.time, self.head_dim);
        let expected = [self.n_heads, self.n_kv_heads, self.n_kv_heads].map(|h| [b, t, h * hd]);
        let shapes = [q, k, v].map(|x| x.shape().to_vec());
        assert!(
            (shapes.iter().zip(&expected)).all(|(shape, expected)| shape == expected),
            "CausalAttention: expected q, k, v of shapes {expected:?}, got {shapes:?}"
        );
    }

    /// One key/value head's backward pass (task `(b, g)`): each query head of its group in
    /// order, writing its columns of `dq`; the key and value gradients of the group's heads
    /// added in that order into `dk`, `dv`. Returns the number of gradient values rounded to
    /// zero.
    fn backward_group<'q>(
        &self,
        queries: impl Iterator<Item = (ArrayView2<'q, E>, ArrayView2<'q, E>, &'q [E])>,
        [k, v]: [ArrayView2<'_, E>; 2],
        [mut dq, dk, dv]: [ArrayViewMut2<'_, E>; 3],
        rounding: Option<&Rounding<'_, E>>,
    ) -> u64 {
        let [k, v] = [k, v].map(|x| operand(x, rounding));
        let shared = [k.t(), v.t(), k.view()].map(|x| Shared::new(x, rounding));
        let mut flushed = 0;
        let mut sums: Option<[Array2<E>; 2]> = None;
        for (j, (q, d_out, stats)) in queries.enumerate() {
            let columns = s![.., j * self.head_dim..(j + 1) * self.head_dim];
            let (head_sums, head_flushed) =
                self.backward_head([q, d_out], &shared, stats, dq.slice_mut(columns), rounding);
            flushed += head_flushed;
            sums = Some(match sums {
                None => head_sums,
                Some([mut dk_sum, mut dv_sum]) => {
                    dk_sum += &head_sums[0];
                    dv_sum += &head_sums[1];
                    [dk_sum, dv_sum]
                }
            });
        }
        let [mut dk_sum, mut dv_sum] = sums.expect("a group has a query head");
        if self.group() > 1
            && let Some(rounding) = rounding
        {
            // The sum of the group's rounded gradients, rounded once.
            for sum in [&mut dk_sum, &mut dv_sum] {
                flushed += (rounding.gradients)(sum.as_slice_mut().expect("standard layout"));
            }
        }
        copy_rows(dk, dk_sum.view());
        copy_rows(dv, dv_sum.view());
        flushed
    }

    /// One head's forward pass; `stats` receives each row's maximum and sum.
    fn forward_head(
        &self,
        inputs: [ArrayView2<'_, E>; 3],
        mut out: ArrayViewMut2<'_, E>,
        stats: &mut [E],
        rounding: Option<&Rounding<'_, E>>,
    ) {
        let [q, k, v] = inputs.map(|x| operand(x, rounding));
        let [keys_t, values] = [k.t(), v.view()].map(|x| Shared::new(x, rounding));
        let mut scratch = self.block_scratch();
        for (start, end) in self.row_blocks() {
            let mut probs = self.scores(&mut scratch, &q, &keys_t, start, end, rounding);
            let rows = probs.as_slice_mut().expect("contiguous block");
            for (i, row) in rows.chunks_exact_mut(end).enumerate() {
                let t = start + i;
                let (live, masked) = row.split_at_mut(t + 1);
                let max = E::scaled_max(live, self.scale);
                let sum = E::scaled_exp(live, self.scale, max, None);
                self.normalize(live, sum);
                masked.fill(E::zero());
                stats[2 * t] = max;
                stats[2 * t + 1] = sum;
            }
            if let Some(rounding) = rounding {
                (rounding.values)(rows);
            }
            let mut out_rows = out.slice_mut(s![start..end, ..]);
            values.product(&mut out_rows, probs.view(), rounding);
            if let Some(rounding) = rounding {
                // A head's output rows are slices of the `[T, d]` result, `hd` apart.
                for mut row in out_rows.rows_mut() {
                    (rounding.values)(row.as_slice_mut().expect("a row of a head"));
                }
            }
        }
    }

    /// One query head's backward pass against its key/value head's operands `kᵀ`, `vᵀ` and
    /// `k` (already rounded): writes the gradient of its columns of `q`; returns this head's
    /// gradients of `k` and `v` (rounded), and the number of gradient values rounded to
    /// zero.
    fn backward_head(
        &self,
        [q, d_out]: [ArrayView2<'_, E>; 2],
        [keys_t, values_t, keys]: &[Shared<'_, E>; 3],
        stats: &[E],
        mut dq: ArrayViewMut2<'_, E>,
        rounding: Option<&Rounding<'_, E>>,
    ) -> ([Array2<E>; 2], u64) {
        let q = operand(q, rounding);
        let mut flushed = 0;
        // One head's blocks are small and this runs on a pool thread already: round on it.
        let mut round_grad = |values: &mut [E]| {
            if let Some(rounding) = rounding {
                flushed += (rounding.gradients)(values);
            }
        };
        let mut d_out = contiguous(d_out);
        round_grad(d_out.as_slice_mut().expect("standard layout"));
        let mut dk_sum = Array2::zeros((self.time, self.head_dim));
        let mut dv_sum = Array2::zeros((self.time, self.head_dim));
        let mut dq_block = Array2::zeros((ROW_BLOCK.min(self.time), self.head_dim));
        let (mut scratch, mut d_scratch) = (self.block_scratch(), self.block_scratch());
        for (start, end) in self.row_blocks() {
            let d_out_rows = d_out.slice(s![start..end, ..]);
            let mut probs = self.scores(&mut scratch, &q, keys_t, start, end, rounding);
            let mut d_scores = ArrayViewMut2::from_shape(
                (end - start, end),
                &mut d_scratch[..(end - start) * end],
            )
            .expect("the scratch holds a block");
            // dP = dO·vᵀ, then dS = scale·P ⊙ (dP − Σ_j dP_j P_j), row by row.
            values_t.product(&mut d_scores, d_out_rows, rounding);
            let p_rows = probs.as_slice_mut().expect("contiguous block");
            let d_rows = d_scores.as_slice_mut().expect("contiguous block");
            for (t, (p_row, d_row)) in row_pairs(p_rows, d_rows, start, end) {
                let (max, sum) = (stats[2 * t], stats[2 * t + 1]);
                let (p_live, p_masked) = p_row.split_at_mut(t + 1);
                // The forward pass's formula on the forward pass's scores: the same bits.
                E::scaled_exp(p_live, self.scale, max, Some(reciprocal(sum)));
                p_masked.fill(E::zero());
                d_row[t + 1..].fill(E::zero());
            }
            round_grad(d_rows); // dP (its masked zeros flush nothing)
            for (t, (p_row, d_row)) in row_pairs(p_rows, d_rows, start, end) {
                E::scaled_grad(&mut d_row[..=t], &p_row[..=t], self.scale);
            }
            round_grad(d_rows); // dS
            if let Some(rounding) = rounding {
                (rounding.values)(p_rows); // P·V read rd(P)
            }
            let (probs, d_scores) = (probs.view(), d_scores.view());
            // dv[..end] += Pᵀ·dO, dk[..end] += dSᵀ·q, dq[rows] = dS·k.
            let seen = s![..end, ..];
            product(
                &mut dv_sum.slice_mut(seen),
                probs.t(),
                d_out_rows,
                true,
                rounding,
            );
            product(
                &mut dk_sum.slice_mut(seen),
                d_scores.t(),
                q.slice(s![start..end, ..]),
                true,
                rounding,
            );
            let mut dq_rows = dq_block.slice_mut(s![..end - start, ..]);
            keys.product(&mut dq_rows, d_scores, rounding);
            round_grad(dq_rows.as_slice_mut().expect("the front rows of a matrix"));
            copy_rows(dq.slice_mut(s![start..end, ..]), dq_rows.view());
        }
        round_grad(dk_sum.as_slice_mut().expect("standard layout"));
        round_grad(dv_sum.as_slice_mut().expect("standard layout"));
        ([dk_sum, dv_sum], flushed)
    }

    /// The softmax's probabilities from its numerators and their `sum`: each multiplied by
    /// [`reciprocal`]`(sum)`, as the backward pass's recomputation does in the same pass as
    /// its exponentials, so the two agree bit for bit.
    fn normalize(&self, numerators: &mut [E], sum: E) {
        let reciprocal = reciprocal(sum);
        for p in numerators.iter_mut() {
            *p *= reciprocal;
        }
    }

    /// `S = q[start..end]·k[..end]ᵀ` (rounded under autocast) in the front of `scratch`.
    fn scores<'s>(
        &self,
        scratch: &'s mut [E],
        q: &Array2<E>,
        keys_t: &Shared<'_, E>,
        start: usize,
        end: usize,
        rounding: Option<&Rounding<'_, E>>,
    ) -> ArrayViewMut2<'s, E> {
        let mut block =
            ArrayViewMut2::from_shape((end - start, end), &mut scratch[..(end - start) * end])
                .expect("the scratch holds a block");
        keys_t.product(&mut block, q.slice(s![start..end, ..]), rounding);
        if let Some(rounding) = rounding {
            (rounding.values)(block.as_slice_mut().expect("contiguous block"));
        }
        block
    }

    /// The row statistics of one head: a maximum and a sum per position (at least 1, so that
    /// chunking an empty sequence's statistics is well defined).
    fn stats_per_head(&self) -> usize {
        (2 * self.time).max(1)
    }

    /// Room for one block of scores.
    fn block_scratch(&self) -> Vec<E> {
        vec![E::zero(); ROW_BLOCK.min(self.time) * self.time]
    }

    /// The `(start, end)` of each block of query rows.
    fn row_blocks(&self) -> impl Iterator<Item = (usize, usize)> + use<E> {
        let time = self.time;
        (0..time)
            .step_by(ROW_BLOCK)
            .map(move |start| (start, (start + ROW_BLOCK).min(time)))
    }

    /// Query head `task`'s `[T, hd]` columns of a `[B, T, H·hd]` array: sequence
    /// `task / H`, head `task % H`.
    fn head<'a>(&self, x: &'a ArrayD<E>, task: usize) -> ArrayView2<'a, E> {
        head_of(x, task, self.n_heads, self.head_dim)
    }

    /// Key/value head `task`'s `[T, hd]` columns of a `[B, T, H_kv·hd]` array: sequence
    /// `task / H_kv`, head `task % H_kv`.
    fn kv_head<'a>(&self, x: &'a ArrayD<E>, task: usize) -> ArrayView2<'a, E> {
        head_of(x, task, self.n_kv_heads, self.head_dim)
    }

    /// Every query head of a `[B, T, H·hd]` array, writable, in task order.
    fn columns_mut<'a>(&self, x: &'a mut ArrayD<E>) -> Vec<ArrayViewMut2<'a, E>> {
        columns_mut(x, self.n_heads, self.head_dim)
    }
}

/// Head `task % heads` of sequence `task / heads` of a `[B, T, heads·width]` array.
fn head_of<E>(x: &ArrayD<E>, task: usize, heads: usize, width: usize) -> ArrayView2<'_, E> {
    let (b, h) = (task / heads, task % heads);
    x.slice(s![b, .., h * width..(h + 1) * width])
        .into_dimensionality::<Ix2>()
        .expect("a sequence's head is 2-D")
}

/// The `heads` column blocks of `width` of every sequence of a `[B, T, heads·width]` array,
/// writable, sequence by sequence.
fn columns_mut<E>(x: &mut ArrayD<E>, heads: usize, width: usize) -> Vec<ArrayViewMut2<'_, E>> {
    let mut blocks = Vec::with_capacity(x.shape()[0] * heads);
    for sequence in x.axis_iter_mut(Axis(0)) {
        let mut rest = sequence
            .into_dimensionality::<Ix2>()
            .expect("a sequence is 2-D");
        for _ in 1..heads {
            let (block, tail) = rest.split_at(Axis(1), width);
            blocks.push(block);
            rest = tail;
        }
        blocks.push(rest);
    }
    blocks
}

/// The rows of a block of probabilities and of their gradient, side by side, with the
/// position `t` of each (rows `start..end`, each `end` wide).
fn row_pairs<'a, E>(
    probs: &'a mut [E],
    grads: &'a mut [E],
    start: usize,
    end: usize,
) -> impl Iterator<Item = (usize, (&'a mut [E], &'a mut [E]))> {
    probs
        .chunks_exact_mut(end)
        .zip(grads.chunks_exact_mut(end))
        .enumerate()
        .map(move |(i, rows)| (start + i, rows))
}

/// `1/sum`, the factor of a softmax row: probabilities are multiplied by it, as PyTorch's
/// CPU softmax and flash attention do, rather than divided by `sum`. A division per score
/// cost about as much as the exponential (the divider takes some 16 values per 8 cycles,
/// whatever the vector width); the reciprocal rounds once more, so a probability may differ
/// from the quotient in its last bit.
fn reciprocal<E: Element>(sum: E) -> E {
    E::one() / sum
}

/// `out = lhs · rhs` (or `out += lhs · rhs` with `accumulate`) on this thread: a head's
/// products run in one pool task each.
fn product<E: Element>(
    out: &mut ArrayViewMut2<'_, E>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
    rounding: Option<&Rounding<'_, E>>,
) {
    rounded_product(out, (lhs, rhs), accumulate, rounding, true);
}

/// `out = lhs · rhs` (or `out += lhs · rhs` with `accumulate`) for a fused kernel: by the
/// rounding's product kernel when it has one (on row-major copies of the operands, on this
/// thread), by the plain GEMM otherwise, on this thread when `serial`, else split across the
/// pool. Either way the bits depend on the shapes only.
pub(super) fn rounded_product<E: Element>(
    out: &mut ArrayViewMut2<'_, E>,
    (lhs, rhs): (ArrayView2<'_, E>, ArrayView2<'_, E>),
    accumulate: bool,
    rounding: Option<&Rounding<'_, E>>,
    serial: bool,
) {
    match rounding.and_then(|r| r.products) {
        Some(kernel) => kernel_product_into(kernel, out, lhs, rhs, accumulate),
        None if serial => gemm_serial_into(out, lhs, rhs, accumulate),
        None => super::gemm::gemm_into(out, lhs, rhs, accumulate),
    }
}

/// A head's operand that every block of query rows multiplies by, as far as the block's
/// last row reaches (`k[..end]ᵀ`, `v[..end]`, …): laid out once by the rounding's product
/// kernel where it gains from that ([`PreparedRhs`]: the bf16 units' packing), instead of
/// once per block. The same bits either way.
struct Shared<'a, E: Element> {
    view: ArrayView2<'a, E>,
    prepared: Option<Box<dyn PreparedRhs<E> + 'a>>,
}

impl<'a, E: Element> Shared<'a, E> {
    fn new(view: ArrayView2<'a, E>, rounding: Option<&Rounding<'_, E>>) -> Self {
        let prepared = rounding
            .and_then(|r| r.products)
            .and_then(|kernel| E::kernel_prepare_rhs(kernel, view));
        Shared { view, prepared }
    }

    /// `out = lhs · view[..k, ..n]` on this thread, with k the columns of `lhs` and n those
    /// of `out`.
    fn product(
        &self,
        out: &mut ArrayViewMut2<'_, E>,
        lhs: ArrayView2<'_, E>,
        rounding: Option<&Rounding<'_, E>>,
    ) {
        match &self.prepared {
            Some(prepared) => prepared.product_into(out, lhs, false),
            None => {
                let leading = self.view.slice(s![..lhs.ncols(), ..out.ncols()]);
                product(out, lhs, leading, false, rounding);
            }
        }
    }
}

/// A head's `[T, hd]` operand as a contiguous matrix, rounded if asked.
///
/// Copied row by row, then rounded in one call: rounding each `hd`-element row as it is
/// copied saves a pass over cached data but pays a call per row, and measured slower.
fn operand<E: Element>(x: ArrayView2<'_, E>, rounding: Option<&Rounding<'_, E>>) -> Array2<E> {
    let mut owned = contiguous(x);
    if let Some(rounding) = rounding {
        (rounding.values)(owned.as_slice_mut().expect("standard layout"));
    }
    owned
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Generator;
    use crate::testing::random_array;
    use ndarray::IxDyn;

    /// `softmax(q·kᵀ·scale + M)·v` one row at a time, the textbook way.
    fn naive(kernel: &CausalAttention<f64>, [q, k, v]: [&ArrayD<f64>; 3]) -> ArrayD<f64> {
        let mut out = ArrayD::zeros(q.raw_dim());
        let hd = kernel.head_dim;
        for (b, h, t) in (0..kernel.batch).flat_map(|b| {
            (0..kernel.n_heads).flat_map(move |h| (0..kernel.time).map(move |t| (b, h, t)))
        }) {
            let cols = h * hd..(h + 1) * hd;
            let score = |j: usize| {
                cols.clone()
                    .map(|c| q[[b, t, c]] * k[[b, j, c]])
                    .sum::<f64>()
                    * kernel.scale
            };
            let scores: Vec<f64> = (0..=t).map(score).collect();
            let max = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            for c in cols.clone() {
                out[[b, t, c]] = (0..=t).map(|j| weights[j] / sum * v[[b, j, c]]).sum();
            }
        }
        out
    }

    #[test]
    fn the_blocked_forward_pass_is_the_textbook_attention() {
        let rng = Generator::new(7);
        // 70 positions: a full block of 64 rows and a partial one.
        let kernel = CausalAttention {
            batch: 2,
            time: ROW_BLOCK + 6,
            n_heads: 2,
            n_kv_heads: 2,
            head_dim: 4,
            scale: 0.5,
        };
        let shape = [2, ROW_BLOCK + 6, 8];
        let [q, k, v] = [(); 3].map(|()| random_array(&shape, &rng));
        let (out, _) = kernel.forward(&q, &k, &v, None);
        let expected = naive(&kernel, [&q, &k, &v]);
        for (x, y) in out.iter().zip(&expected) {
            assert!((x - y).abs() < 1e-12, "{x} vs {y}");
        }
    }

    /// `x`'s `[B, T, H_kv·hd]` heads each repeated `group` times side by side (`repeat_kv`).
    fn repeat_heads(x: &ArrayD<f64>, group: usize, hd: usize) -> ArrayD<f64> {
        let [b, t, width] = [0, 1, 2].map(|axis| x.shape()[axis]);
        ArrayD::from_shape_fn(IxDyn(&[b, t, width * group]), |i| {
            let (head, c) = (i[2] / hd, i[2] % hd);
            x[[i[0], i[1], head / group * hd + c]]
        })
    }

    /// Grouped-query attention is multi-head attention on repeated keys and values, bit for
    /// bit: the same output, the same query gradients, and key and value gradients that are
    /// the repeated heads' summed in head order (rounded, then the sum rounded, under a
    /// rounding), on 1 and 3 threads.
    #[test]
    fn grouped_query_attention_is_attention_on_repeated_keys_and_values() {
        let rng = Generator::new(11);
        let (batch, time, hd, n_heads) = (2, ROW_BLOCK + 3, 4, 6);
        let quarter = |xs: &mut [f64]| xs.iter_mut().for_each(|x| *x = (*x * 4.0).round() / 4.0);
        // A "format" of 4 significant bits that flushes magnitudes below 2⁻⁶: the sum of
        // two of its values is often not one of them, so where the sum is rounded shows.
        let flush_small = |xs: &mut [f64]| {
            let mut flushed = 0;
            for x in xs.iter_mut() {
                let rounded = if x.abs() < 1.0 / 64.0 {
                    0.0
                } else {
                    let unit = 2f64.powi(x.abs().log2().floor() as i32 - 3);
                    (*x / unit).round() * unit
                };
                flushed += u64::from(rounded == 0.0 && *x != 0.0);
                *x = rounded;
            }
            flushed
        };
        let rounding = Rounding {
            values: &quarter,
            gradients: &flush_small,
            products: None,
        };
        for n_kv_heads in [1, 2, 3, 6] {
            let group = n_heads / n_kv_heads;
            let gqa = CausalAttention {
                batch,
                time,
                n_heads,
                n_kv_heads,
                head_dim: hd,
                scale: 0.5,
            };
            let mha = CausalAttention {
                n_kv_heads: n_heads,
                ..gqa
            };
            let q = random_array(&[batch, time, n_heads * hd], &rng);
            let d_out = random_array(&[batch, time, n_heads * hd], &rng);
            let [k, v] = [(); 2].map(|()| random_array(&[batch, time, n_kv_heads * hd], &rng));
            let [k_rep, v_rep] = [&k, &v].map(|x| repeat_heads(x, group, hd));
            for rounding in [None, Some(&rounding)] {
                let (expected, stats) = mha.forward(&q, &k_rep, &v_rep, rounding);
                let ([dq, dk_rep, dv_rep], expected_flushed) =
                    mha.backward([&q, &k_rep, &v_rep], &stats, &d_out, rounding);
                // The repeated heads' gradients summed in order, then rounded once.
                let mut second_flushes = 0;
                let mut summed = |rep: &ArrayD<f64>| {
                    let mut sum =
                        ArrayD::from_shape_fn(IxDyn(&[batch, time, n_kv_heads * hd]), |i| {
                            let (head, c) = (i[2] / hd, i[2] % hd);
                            let column = |j: usize| rep[[i[0], i[1], (head * group + j) * hd + c]];
                            (1..group).fold(column(0), |acc, j| acc + column(j))
                        });
                    if group > 1
                        && let Some(rounding) = rounding
                    {
                        second_flushes += (rounding.gradients)(sum.as_slice_mut().unwrap());
                    }
                    sum
                };
                let (dk, dv) = (summed(&dk_rep), summed(&dv_rep));
                for threads in [1, 3] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let (out, gqa_stats) = pool.install(|| gqa.forward(&q, &k, &v, rounding));
                    let (grads, flushed) =
                        pool.install(|| gqa.backward([&q, &k, &v], &gqa_stats, &d_out, rounding));
                    let what = format!(
                        "{n_kv_heads} kv heads, rounding {}, {threads} threads",
                        rounding.is_some()
                    );
                    assert_eq!(out, expected, "{what}");
                    assert_eq!(gqa_stats, stats, "{what}");
                    assert_eq!(grads, [dq.clone(), dk.clone(), dv.clone()], "{what}");
                    assert_eq!(flushed, expected_flushed + second_flushes, "{what}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "4 key/value heads do not divide 6 query heads")]
    fn key_value_heads_must_divide_the_query_heads() {
        let kernel = CausalAttention {
            batch: 1,
            time: 2,
            n_heads: 6,
            n_kv_heads: 4,
            head_dim: 2,
            scale: 1.0,
        };
        let q = ArrayD::zeros(IxDyn(&[1, 2, 12]));
        let kv = ArrayD::zeros(IxDyn(&[1, 2, 8]));
        kernel.forward(&q, &kv, &kv, None);
    }

    #[test]
    fn rounding_is_applied_and_gradient_flushes_are_counted() {
        let rng = Generator::new(8);
        let kernel = CausalAttention {
            batch: 1,
            time: 5,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 3,
            scale: 1.0,
        };
        let shape = [1, 5, 3];
        let [q, k, v, d_out] = [(); 4].map(|()| random_array(&shape, &rng));
        // A "format" that keeps only whole numbers, and flushes every gradient to zero.
        let values = |xs: &mut [f64]| xs.iter_mut().for_each(|x| *x = x.round());
        let gradients = |xs: &mut [f64]| {
            xs.fill(0.0);
            xs.len() as u64
        };
        let rounding = Rounding {
            products: None,
            values: &values,
            gradients: &gradients,
        };
        let (out, stats) = kernel.forward(&q, &k, &v, Some(&rounding));
        assert!(out.iter().all(|x| x.fract() == 0.0));
        let (grads, flushed) = kernel.backward([&q, &k, &v], &stats, &d_out, Some(&rounding));
        assert!(grads.iter().flatten().all(|&g| g == 0.0));
        // dO first (15 values), then per block dP and dS (the 5×5 block twice), dq (15),
        // and dk, dv (15 each).
        assert_eq!(flushed, 15 + 2 * 25 + 15 + 2 * 15);
    }

    /// A product kernel that sums in plain f64 order and counts its calls.
    #[derive(Debug, Default)]
    struct Counting(std::sync::atomic::AtomicUsize);

    impl ProductKernel for Counting {
        fn product_f32(
            &self,
            _: usize,
            _: usize,
            _: usize,
            _: &[f32],
            _: &[f32],
            _: &mut [f32],
            _: bool,
        ) {
            unreachable!("f64 only")
        }
        fn product_f64(
            &self,
            m: usize,
            k: usize,
            n: usize,
            lhs: &[f64],
            rhs: &[f64],
            out: &mut [f64],
            accumulate: bool,
        ) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            for i in 0..m {
                for j in 0..n {
                    let start = if accumulate { out[i * n + j] } else { 0.0 };
                    out[i * n + j] =
                        start + (0..k).map(|p| lhs[i * k + p] * rhs[p * n + j]).sum::<f64>();
                }
            }
        }
    }

    #[test]
    fn every_product_goes_through_the_rounding_s_kernel_when_it_has_one() {
        let rng = Generator::new(9);
        let kernel = CausalAttention {
            batch: 2,
            time: ROW_BLOCK + 6,
            n_heads: 2,
            n_kv_heads: 2,
            head_dim: 4,
            scale: 0.5,
        };
        let shape = [2, ROW_BLOCK + 6, 8];
        let [q, k, v, d_out] = [(); 4].map(|()| random_array(&shape, &rng));
        let identity = |_: &mut [f64]| {};
        let no_flush = |_: &mut [f64]| 0;
        let counting = Counting::default();
        let with = Rounding {
            values: &identity,
            gradients: &no_flush,
            products: Some(&counting),
        };
        let (out, stats) = kernel.forward(&q, &k, &v, Some(&with));
        let (plain, plain_stats) = kernel.forward(&q, &k, &v, None);
        // Two products per block of rows of each of the 4 (sequence, head) tasks.
        assert_eq!(
            counting.0.load(std::sync::atomic::Ordering::Relaxed),
            4 * 2 * 2
        );
        let (grads, _) = kernel.backward([&q, &k, &v], &stats, &d_out, Some(&with));
        let (plain_grads, _) = kernel.backward([&q, &k, &v], &plain_stats, &d_out, None);
        // Backward: the scores again, dP, dv, dk and dq per block.
        assert_eq!(
            counting.0.load(std::sync::atomic::Ordering::Relaxed),
            4 * 2 * (2 + 5)
        );
        let pairs = out
            .iter()
            .zip(&plain)
            .chain(grads.iter().flatten().zip(plain_grads.iter().flatten()));
        for (x, y) in pairs {
            assert!((x - y).abs() < 1e-12, "{x} vs {y}");
        }
    }

    /// The bf16 product kernel with its right operands prepared once per head
    /// ([`Shared`]), against the same kernel multiplying by views block after block: the
    /// same bits in every output, statistic and gradient, with heads of 32 and of 5
    /// columns, grouped queries, and a last block that ends on an odd row.
    #[test]
    fn operands_prepared_once_per_head_give_the_bits_of_products_by_views() {
        use crate::kernels::bf16_dot::Bf16Products;
        use tl_numerics::{Format, round_slice, round_slice_counting_flushes};

        /// Bf16Products without its preparation: every product by row-major copies of the
        /// views (the trait's default), which the bf16 product's bits do not depend on.
        #[derive(Debug)]
        struct ByViews;
        impl ProductKernel for ByViews {
            fn product_f32(
                &self,
                m: usize,
                k: usize,
                n: usize,
                lhs: &[f32],
                rhs: &[f32],
                out: &mut [f32],
                accumulate: bool,
            ) {
                Bf16Products.product_f32(m, k, n, lhs, rhs, out, accumulate);
            }
            fn product_f64(
                &self,
                _: usize,
                _: usize,
                _: usize,
                _: &[f64],
                _: &[f64],
                _: &mut [f64],
                _: bool,
            ) {
                unreachable!("f32 only")
            }
        }

        let rng = Generator::new(41);
        let values = |xs: &mut [f32]| round_slice(xs, Format::Bf16);
        let gradients = |xs: &mut [f32]| round_slice_counting_flushes(xs, Format::Bf16);
        let geometries = [(2, 2, 32, 2 * ROW_BLOCK + 6), (4, 2, 5, ROW_BLOCK + 3)];
        for (n_heads, n_kv_heads, head_dim, time) in geometries {
            let kernel = CausalAttention {
                batch: 2,
                time,
                n_heads,
                n_kv_heads,
                head_dim,
                scale: 0.25f32,
            };
            let [q, d_out] = [(); 2]
                .map(|()| random_array(&[2, time, n_heads * head_dim], &rng).mapv(|x| x as f32));
            let [k, v] = [(); 2]
                .map(|()| random_array(&[2, time, n_kv_heads * head_dim], &rng).mapv(|x| x as f32));
            let run = |products: &dyn ProductKernel| {
                let rounding = Rounding {
                    values: &values,
                    gradients: &gradients,
                    products: Some(products),
                };
                let (out, stats) = kernel.forward(&q, &k, &v, Some(&rounding));
                let (grads, flushed) =
                    kernel.backward([&q, &k, &v], &stats, &d_out, Some(&rounding));
                let bits = |x: &ArrayD<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let stats: Vec<u32> = stats.iter().map(|v| v.to_bits()).collect();
                (bits(&out), stats, grads.each_ref().map(bits), flushed)
            };
            let prepared = run(&Bf16Products);
            let by_views = run(&ByViews);
            assert!(prepared.0.iter().any(|&b| b != 0), "a real output");
            assert_eq!(
                prepared, by_views,
                "{n_heads} heads of {head_dim}, T = {time}"
            );
        }
    }
}
