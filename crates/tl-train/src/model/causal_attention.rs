//! The core of causal self-attention, `softmax(q·kᵀ/√hd + M)·v` for every head, as one op.
//!
//! Built from separate ops, attention splits q, k and v into heads (copies), multiplies
//! `B·H` pairs of `T×hd` matrices into a `B·H·T·T` tensor of scores, takes its masked
//! softmax into a second such tensor — which the backward pass keeps — multiplies again and
//! copies the heads back together. At the capstone's shapes the two `T×T` tensors are
//! 84 MB each per block, and half of every product is spent on entries the mask throws away.
//!
//! This op does what flash attention does on a GPU, for a CPU's caches:
//!
//! - **One task per (sequence, head).** Each reads its head's columns of `q`, `k` and `v`
//!   (`[B, T, d]`, heads side by side) straight from the projections' output, and writes its
//!   columns of the `[B, T, d]` result: no head-split or merge copies. The `B·H` tasks go to
//!   the rayon pool; each runs its products on one thread ([`gemm_serial_into`]).
//! - **Blocks of query rows.** Rows `r0..r1` only see keys `0..r1`, so a block multiplies
//!   `q[r0..r1]` by `k[..r1]ᵀ` — the upper triangle past the block is never computed — and its
//!   `(r1−r0)×r1` scores stay in cache through the softmax and the product with `v[..r1]`.
//! - **Nothing of size `T×T` is saved.** The forward pass keeps only each row's maximum and
//!   sum; the backward pass recomputes the probabilities from them. It recomputes them with
//!   the same products on the same operands and the same formula, so they are the forward
//!   pass's bits exactly.
//! - **Computed once under checkpointing.** The op's result is marked with tl-recompute's
//!   `keep_for_rerun`: a checkpointed block keeps it (`N·d` values, a sixteenth of what a
//!   capstone block saves without checkpointing) and its rerun during backward takes it
//!   back instead of running this forward pass again.
//!
//! # Under autocast
//!
//! A tensor core multiplies 16-bit operands, so the separate ops compute, with `rd` rounding
//! into the autocast format,
//!
//! ```text
//! S = rd(rd(q)·rd(k)ᵀ)     P = softmax(scale·S + M) in f32     O = rd(rd(P)·rd(v))
//! ```
//!
//! and the backward pass rounds each gradient where a `cast` stands in that graph:
//! `dO`, `dP`, `dS`, and the gradients of `q`, `k` and `v`. This op rounds at exactly those
//! points, and adds the gradient values each rounding flushes to zero to tl-precision's
//! underflow count, as `cast` does. What differs from the separate ops is only the order in
//! which the f32 products accumulate (blocks instead of whole rows), and that masked entries
//! are never computed, so never counted.
//!
//! Its result `O` is a rounded product, so the op marks it with tl-precision's
//! `mark_rounded`: the output projection that reads it next takes it as its rounded operand
//! as it is, instead of rounding a copy that would equal it.

use std::rc::Rc;

use ndarray::{Array2, ArrayD, ArrayView2, ArrayViewMut2, Axis, Ix2, IxDyn, s};
use rayon::prelude::*;
use tl_numerics::{Format, round_slice, round_slice_counting_flushes};
use tl_precision::{autocast_format, mark_rounded, record_underflows};
use tl_recompute::keep_for_rerun;
use tl_tensor::kernels::gemm::gemm_serial_into;
use tl_tensor::{Element, Tensor};

/// Query rows per block: 64 rows of up to 512 scores (128 KiB in f32) and their gradient
/// fit in a core's L2 cache next to the head's keys and values.
const ROW_BLOCK: usize = 64;

/// `softmax(q·kᵀ/√hd + M)·v` for each of `n_heads` heads, where `q`, `k`, `v` are `[B, T, d]`
/// with head `h` in columns `h·hd..(h+1)·hd` (`hd = d / n_heads`), `M = −∞` above the
/// diagonal, and the result is `[B, T, d]` laid out the same way.
///
/// Saves `q`, `k` and `v` (shared, not copied) and two numbers per row; see the module
/// documentation for how it computes, how a checkpointed block keeps its result, and for its
/// rounding under autocast.
///
/// # Panics
/// If the three shapes differ, are not 3-D, or `d` is not a multiple of `n_heads`.
pub fn causal_attention<E: Element>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    n_heads: usize,
) -> Tensor<E> {
    let shape = q.shape();
    assert!(
        shape.len() == 3
            && k.shape() == shape
            && v.shape() == shape
            && n_heads > 0
            && shape[2].is_multiple_of(n_heads),
        "causal_attention: expected q, k, v of one shape [B, T, d] with d a multiple of \
         {n_heads} heads, got {shape:?}, {:?}, {:?}",
        k.shape(),
        v.shape()
    );
    let head_dim = shape[2] / n_heads;
    let heads = Heads {
        batch: shape[0],
        time: shape[1],
        n_heads,
        head_dim,
        scale: E::from_f64(1.0 / (head_dim as f64).sqrt()),
        format: autocast_format(),
    };
    // The most expensive part of a block's forward pass for one `[B, T, d]` result: a
    // checkpointed block keeps it rather than computing it again in its rerun.
    let (output, row_stats) = keep_for_rerun(|| {
        let (value, row_stats) = heads.forward(&q.value(), &k.value(), &v.value());
        (Tensor::from_array(value), Rc::new(row_stats))
    });
    let saved = [q.clone(), k.clone(), v.clone()];
    let result = Tensor::from_op_shared(&output, &[q, k, v], move |grad| {
        let [q, k, v] = &saved;
        let (grads, flushed) =
            heads.backward(&q.value(), &k.value(), &v.value(), &row_stats, &grad);
        record_underflows(flushed);
        saved
            .iter()
            .zip(grads)
            .map(|(input, grad)| input.requires_grad().then_some(grad))
            .collect()
    });
    // Its last product was rounded: the output projection can read it as it is.
    if let Some(format) = heads.format {
        mark_rounded(&result, format);
    }
    result
}

/// The geometry and numerics of one call.
#[derive(Clone, Copy)]
struct Heads<E> {
    batch: usize,
    time: usize,
    n_heads: usize,
    head_dim: usize,
    scale: E,
    /// The autocast format in force when the forward pass ran.
    format: Option<Format>,
}

/// Each row's softmax maximum and sum, `[B, H, T, 2]` flattened.
type RowStats<E> = Vec<E>;

impl<E: Element> Heads<E> {
    fn forward(&self, q: &ArrayD<E>, k: &ArrayD<E>, v: &ArrayD<E>) -> (ArrayD<E>, RowStats<E>) {
        let mut out = ArrayD::zeros(IxDyn(&[
            self.batch,
            self.time,
            self.n_heads * self.head_dim,
        ]));
        let mut row_stats = vec![E::zero(); self.batch * self.n_heads * self.time * 2];
        self.columns_mut(&mut out)
            .into_par_iter()
            .zip(row_stats.par_chunks_mut(self.stats_per_head()))
            .enumerate()
            .for_each(|(task, (out, stats))| {
                let [q, k, v] = [q, k, v].map(|x| self.head(x, task));
                self.forward_head(q, k, v, out, stats);
            });
        (out, row_stats)
    }

    /// The gradients of `q`, `k` and `v`, and how many values their rounding flushed to zero.
    fn backward(
        &self,
        q: &ArrayD<E>,
        k: &ArrayD<E>,
        v: &ArrayD<E>,
        row_stats: &[E],
        d_out: &ArrayD<E>,
    ) -> ([ArrayD<E>; 3], u64) {
        let shape = IxDyn(&[self.batch, self.time, self.n_heads * self.head_dim]);
        let mut grads = [(); 3].map(|()| ArrayD::zeros(shape.clone()));
        let [dq, dk, dv] = &mut grads;
        let heads: Vec<_> = self
            .columns_mut(dq)
            .into_iter()
            .zip(self.columns_mut(dk))
            .zip(self.columns_mut(dv))
            .collect();
        let flushed = heads
            .into_par_iter()
            .zip(row_stats.par_chunks(self.stats_per_head()))
            .enumerate()
            .map(|(task, (((dq, dk), dv), stats))| {
                let [q, k, v, d_out] = [q, k, v, d_out].map(|x| self.head(x, task));
                self.backward_head([q, k, v], d_out, stats, [dq, dk, dv])
            })
            .sum();
        (grads, flushed)
    }

    /// One head's forward pass; `stats` receives each row's maximum and sum.
    fn forward_head(
        &self,
        q: ArrayView2<'_, E>,
        k: ArrayView2<'_, E>,
        v: ArrayView2<'_, E>,
        mut out: ArrayViewMut2<'_, E>,
        stats: &mut [E],
    ) {
        let [q, k, v] = [q, k, v].map(|x| self.operand(x));
        let mut scratch = self.block_scratch();
        for (start, end) in self.row_blocks() {
            let mut probs = self.scores(&mut scratch, &q, &k, start, end);
            let rows = probs.as_slice_mut().expect("contiguous block");
            for (i, row) in rows.chunks_exact_mut(end).enumerate() {
                let t = start + i;
                let (live, masked) = row.split_at_mut(t + 1);
                let max = live
                    .iter()
                    .fold(E::neg_infinity(), |m, &s| m.max(s * self.scale));
                self.exponentials(live, max);
                let sum = lane_sum(live);
                for p in live.iter_mut() {
                    *p /= sum;
                }
                masked.fill(E::zero());
                stats[2 * t] = max;
                stats[2 * t + 1] = sum;
            }
            if let Some(format) = self.format {
                round_slice(rows, format);
            }
            let mut out_rows = out.slice_mut(s![start..end, ..]);
            gemm_serial_into(&mut out_rows, probs.view(), v.slice(s![..end, ..]), false);
            if let Some(format) = self.format {
                out_rows.map_inplace(|o| *o = o.round_to(format));
            }
        }
    }

    /// One head's backward pass, writing the gradients of its columns of `q`, `k` and `v`;
    /// returns the number of gradient values rounded to zero.
    fn backward_head(
        &self,
        inputs: [ArrayView2<'_, E>; 3],
        d_out: ArrayView2<'_, E>,
        stats: &[E],
        [mut dq, dk, dv]: [ArrayViewMut2<'_, E>; 3],
    ) -> u64 {
        let [q, k, v] = inputs.map(|x| self.operand(x));
        let mut flushed = 0;
        // One head's blocks are small and this runs on a pool thread already: round on it.
        let mut round_grad = |values: &mut [E]| {
            if let Some(format) = self.format {
                flushed += round_slice_counting_flushes(values, format);
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
            let mut probs = self.scores(&mut scratch, &q, &k, start, end);
            let mut d_scores = ArrayViewMut2::from_shape(
                (end - start, end),
                &mut d_scratch[..(end - start) * end],
            )
            .expect("the scratch holds a block");
            // dP = dO·vᵀ, then dS = scale·P ⊙ (dP − Σ_j dP_j P_j), row by row.
            gemm_serial_into(&mut d_scores, d_out_rows, v.slice(s![..end, ..]).t(), false);
            let p_rows = probs.as_slice_mut().expect("contiguous block");
            let d_rows = d_scores.as_slice_mut().expect("contiguous block");
            for (t, (p_row, d_row)) in row_pairs(p_rows, d_rows, start, end) {
                let (max, sum) = (stats[2 * t], stats[2 * t + 1]);
                let (p_live, p_masked) = p_row.split_at_mut(t + 1);
                // The forward pass's formula on the forward pass's scores: the same bits.
                self.exponentials(p_live, max);
                for p in p_live.iter_mut() {
                    *p /= sum;
                }
                p_masked.fill(E::zero());
                d_row[t + 1..].fill(E::zero());
            }
            round_grad(d_rows); // dP (its masked zeros flush nothing)
            for (t, (p_row, d_row)) in row_pairs(p_rows, d_rows, start, end) {
                let (p_live, d_live) = (&p_row[..=t], &mut d_row[..=t]);
                let dot = lane_dot(d_live, p_live);
                for (d, &p) in d_live.iter_mut().zip(p_live) {
                    *d = self.scale * p * (*d - dot);
                }
            }
            round_grad(d_rows); // dS
            if let Some(format) = self.format {
                round_slice(p_rows, format); // P·V read rd(P)
            }
            let (probs, d_scores) = (probs.view(), d_scores.view());
            // dv[..end] += Pᵀ·dO, dk[..end] += dSᵀ·q, dq[rows] = dS·k.
            let keys = s![..end, ..];
            gemm_serial_into(&mut dv_sum.slice_mut(keys), probs.t(), d_out_rows, true);
            gemm_serial_into(
                &mut dk_sum.slice_mut(keys),
                d_scores.t(),
                q.slice(s![start..end, ..]),
                true,
            );
            let mut dq_rows = dq_block.slice_mut(s![..end - start, ..]);
            gemm_serial_into(&mut dq_rows, d_scores, k.slice(keys), false);
            round_grad(dq_rows.as_slice_mut().expect("the front rows of a matrix"));
            copy_rows(dq.slice_mut(s![start..end, ..]), dq_rows.view());
        }
        round_grad(dk_sum.as_slice_mut().expect("standard layout"));
        round_grad(dv_sum.as_slice_mut().expect("standard layout"));
        copy_rows(dk, dk_sum.view());
        copy_rows(dv, dv_sum.view());
        flushed
    }

    /// `e^(scale·s − max)` for each score `s` of a row, in place: the softmax's numerators.
    fn exponentials(&self, row: &mut [E], max: E) {
        for s in row.iter_mut() {
            *s = *s * self.scale - max;
        }
        E::exp_in_place(row);
    }

    /// `S = q[start..end]·k[..end]ᵀ` (rounded under autocast) in the front of `scratch`.
    fn scores<'s>(
        &self,
        scratch: &'s mut [E],
        q: &Array2<E>,
        k: &Array2<E>,
        start: usize,
        end: usize,
    ) -> ArrayViewMut2<'s, E> {
        let mut block =
            ArrayViewMut2::from_shape((end - start, end), &mut scratch[..(end - start) * end])
                .expect("the scratch holds a block");
        gemm_serial_into(
            &mut block,
            q.slice(s![start..end, ..]),
            k.slice(s![..end, ..]).t(),
            false,
        );
        if let Some(format) = self.format {
            round_slice(block.as_slice_mut().expect("contiguous block"), format);
        }
        block
    }

    /// A head's `[T, hd]` operand as a contiguous matrix, rounded under autocast.
    ///
    /// Copied row by row, then rounded in one call: rounding each `hd`-element row as it is
    /// copied saves a pass over cached data but pays a call per row, and measured slower.
    fn operand(&self, x: ArrayView2<'_, E>) -> Array2<E> {
        let mut owned = contiguous(x);
        if let Some(format) = self.format {
            round_slice(owned.as_slice_mut().expect("standard layout"), format);
        }
        owned
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

    /// Task `task`'s `[T, hd]` head of a `[B, T, d]` array: sequence `task / H`, head
    /// `task % H`.
    fn head<'a>(&self, x: &'a ArrayD<E>, task: usize) -> ArrayView2<'a, E> {
        let (b, h) = (task / self.n_heads, task % self.n_heads);
        let columns = h * self.head_dim..(h + 1) * self.head_dim;
        x.slice(s![b, .., columns])
            .into_dimensionality::<Ix2>()
            .expect("a sequence's head is 2-D")
    }

    /// Every task's head of a `[B, T, d]` array, writable, in task order.
    fn columns_mut<'a>(&self, x: &'a mut ArrayD<E>) -> Vec<ArrayViewMut2<'a, E>> {
        let mut heads = Vec::with_capacity(self.batch * self.n_heads);
        for sequence in x.axis_iter_mut(Axis(0)) {
            let mut rest = sequence
                .into_dimensionality::<Ix2>()
                .expect("a sequence is 2-D");
            for _ in 1..self.n_heads {
                let (head, tail) = rest.split_at(Axis(1), self.head_dim);
                heads.push(head);
                rest = tail;
            }
            heads.push(rest);
        }
        heads
    }
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

/// A copy of a head's columns as a contiguous matrix, a row at a time (nothing is written
/// twice: the buffer is not zeroed first).
fn contiguous<E: Element>(x: ArrayView2<'_, E>) -> Array2<E> {
    let mut data = Vec::with_capacity(x.len());
    for row in x.rows() {
        match row.as_slice() {
            Some(row) => data.extend_from_slice(row),
            None => data.extend(row.iter().copied()),
        }
    }
    Array2::from_shape_vec(x.raw_dim(), data).expect("one value per element")
}

/// `dst = src` for matrices whose rows are contiguous (a head's `hd` columns of a `[T, d]`
/// matrix, or a whole matrix): one `copy_from_slice` per row. At the capstone's shapes
/// ndarray's general copies of such views cost far more: `as_standard_layout` (an element
/// iterator) took about 30% of the attention's time, and `assign` still 9% in a profile.
fn copy_rows<E: Element>(mut dst: ArrayViewMut2<'_, E>, src: ArrayView2<'_, E>) {
    assert_eq!(dst.dim(), src.dim(), "copy_rows: shapes differ");
    for (mut to, from) in dst.rows_mut().into_iter().zip(src.rows()) {
        match (to.as_slice_mut(), from.as_slice()) {
            (Some(to), Some(from)) => to.copy_from_slice(from),
            _ => to.assign(&from),
        }
    }
}

/// Independent partial sums in [`lane_sum`] and [`lane_dot`]. One running sum is a chain of
/// dependent additions, one every four cycles, and was half of the forward task's own time
/// in a profile; eight independent ones fill the vector registers.
const LANES: usize = 8;

/// `Σ_j a_j·b_j` in a fixed order: the `j`-th product of each full group of [`LANES`] goes
/// to partial sum `j`, the partial sums are added in order, then the tail. The result
/// depends on the inputs alone (never on which thread runs the row).
fn lane_dot<E: Element>(a: &[E], b: &[E]) -> E {
    assert_eq!(a.len(), b.len(), "lane_dot: lengths differ");
    let mut lanes = [E::zero(); LANES];
    let (a_groups, b_groups) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (a_tail, b_tail) = (a_groups.remainder(), b_groups.remainder());
    for (a_group, b_group) in a_groups.zip(b_groups) {
        for ((lane, &x), &y) in lanes.iter_mut().zip(a_group).zip(b_group) {
            *lane += x * y;
        }
    }
    let sum = lanes.iter().fold(E::zero(), |sum, &lane| sum + lane);
    a_tail
        .iter()
        .zip(b_tail)
        .fold(sum, |sum, (&x, &y)| sum + x * y)
}

/// `Σ_j x_j`, in the order of [`lane_dot`].
fn lane_sum<E: Element>(xs: &[E]) -> E {
    let mut lanes = [E::zero(); LANES];
    let groups = xs.chunks_exact(LANES);
    let tail = groups.remainder();
    for group in groups {
        for (lane, &x) in lanes.iter_mut().zip(group) {
            *lane += x;
        }
    }
    let sum = lanes.iter().fold(E::zero(), |sum, &lane| sum + lane);
    tail.iter().fold(sum, |sum, &x| sum + x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_numerics::Round;
    use tl_precision::{autocast, take_underflow_count};
    use tl_tensor::testing::{assert_gradients, random_array};
    use tl_tensor::{Generator, ndarray::ArrayD};

    /// The same attention from the library's separate ops: head split, `q·kᵀ`, scale, mask,
    /// softmax, `·v`, heads merged.
    fn separate_ops<E: Element>(
        q: &Tensor<E>,
        k: &Tensor<E>,
        v: &Tensor<E>,
        n_heads: usize,
    ) -> Tensor<E> {
        let shape = q.shape();
        let (batch, time, d) = (shape[0], shape[1], shape[2]);
        let head_dim = d / n_heads;
        let heads = |x: &Tensor<E>| {
            x.reshape(&[batch, time, n_heads, head_dim])
                .permute(&[0, 2, 1, 3])
        };
        let mask = ArrayD::from_shape_fn(IxDyn(&[time, time]), |i| i[1] > i[0]);
        heads(q)
            .matmul(&heads(k).transpose(2, 3))
            .mul_scalar(E::from_f64(1.0 / (head_dim as f64).sqrt()))
            .masked_fill(&mask, E::neg_infinity())
            .softmax(3)
            .matmul(&heads(v))
            .permute(&[0, 2, 1, 3])
            .reshape(&[batch, time, d])
    }

    /// The output and the gradients of q, k, v for the upstream gradient `d_out`.
    fn run<E: Element>(
        attention: impl Fn(&Tensor<E>, &Tensor<E>, &Tensor<E>) -> Tensor<E>,
        inputs: &[ArrayD<E>; 3],
        d_out: &ArrayD<E>,
    ) -> [Vec<E>; 4] {
        let [q, k, v] = inputs.clone().map(Tensor::param);
        let out = attention(&q, &k, &v);
        out.backward_with(d_out.clone());
        let grad = |x: &Tensor<E>| x.grad().expect("a gradient").iter().copied().collect();
        [out.to_vec(), grad(&q), grad(&k), grad(&v)]
    }

    /// Random q, k, v and upstream gradient of shape `[2, T, d]`, with T = 70 so that the
    /// rows fall into a full block of 64 and a partial one.
    fn inputs(d: usize, seed: u64) -> ([ArrayD<f64>; 3], ArrayD<f64>) {
        let rng = Generator::new(seed);
        let shape = [2, ROW_BLOCK + 6, d];
        let inputs = [(); 3].map(|()| random_array(&shape, &rng));
        (inputs, random_array(&shape, &rng))
    }

    fn to_f32(x: &ArrayD<f64>) -> ArrayD<f32> {
        x.mapv(|v| v as f32)
    }

    #[test]
    fn agrees_with_the_separate_ops_forward_and_backward() {
        let (inputs, d_out) = inputs(8, 1);
        let fused = run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out);
        let separate = run(|q, k, v| separate_ops(q, k, v, 2), &inputs, &d_out);
        for (name, (a, b)) in ["output", "dq", "dk", "dv"]
            .iter()
            .zip(fused.iter().zip(&separate))
        {
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() < 1e-13, "{name}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let rng = Generator::new(4);
        let shape = [1, ROW_BLOCK + 2, 4];
        let xs = [(); 3].map(|()| random_array(&shape, &rng));
        assert_gradients(|xs| causal_attention(&xs[0], &xs[1], &xs[2], 2), &xs);
    }

    #[test]
    fn lane_sums_add_every_element_once_tails_included() {
        // Small whole numbers add exactly in any order, so a dropped, repeated or misplaced
        // element (in the groups of eight or in the tail) changes the result.
        for n in 0..=27_u32 {
            let xs: Vec<f64> = (1..=n).map(f64::from).collect();
            let ys: Vec<f64> = (1..=n).map(|i| f64::from(i % 5 + 1)).collect();
            assert_eq!(lane_sum(&xs), f64::from(n * (n + 1) / 2), "sum of 1..={n}");
            let dot: f64 = xs.iter().zip(&ys).map(|(x, y)| x * y).sum();
            assert_eq!(lane_dot(&xs, &ys), dot, "dot of length {n}");
        }
    }

    #[test]
    fn copy_rows_copies_strided_columns_into_place() {
        // Columns 2..5 of a 4 × 7 matrix, copied out and back into another matrix's columns.
        let source = Array2::from_shape_fn((4, 7), |(i, j)| (10 * i + j) as f64);
        let head = contiguous(source.slice(s![.., 2..5]));
        assert_eq!(head, source.slice(s![.., 2..5]));
        let mut target = Array2::<f64>::zeros((4, 7));
        copy_rows(target.slice_mut(s![.., 2..5]), head.view());
        assert_eq!(target.slice(s![.., 2..5]), source.slice(s![.., 2..5]));
        assert!(target.slice(s![.., ..2]).iter().all(|&x| x == 0.0));
        assert!(target.slice(s![.., 5..]).iter().all(|&x| x == 0.0));
    }

    #[test]
    fn under_autocast_it_rounds_where_the_separate_ops_do() {
        let (inputs, d_out) = inputs(16, 2);
        let (inputs, d_out) = (inputs.each_ref().map(to_f32), to_f32(&d_out));
        let bf16 = |x: &f32| x.round_to(Format::Bf16) == *x;
        let [fused, separate] = [0, 1].map(|which| {
            let _bf16 = autocast(Format::Bf16);
            if which == 0 {
                run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out)
            } else {
                run(|q, k, v| separate_ops(q, k, v, 2), &inputs, &d_out)
            }
        });
        for (name, (a, b)) in ["output", "dq", "dk", "dv"]
            .iter()
            .zip(fused.iter().zip(&separate))
        {
            // Every value comes out of a 16-bit rounding ...
            assert!(a.iter().all(bf16), "{name}: not all values are bf16");
            // ... and differs from the separate ops only where an f32 sum, accumulated in
            // another order, landed on the other side of a rounding boundary.
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= scale * 2f32.powi(-7), "{name}: {x} vs {y}");
            }
            assert!(
                differ * 100 < a.len(),
                "{name}: {differ} of {} differ",
                a.len()
            );
        }
        // Without autocast the same output is not bf16, so the check above can fail.
        let plain = run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out);
        assert!(!plain[0].iter().all(bf16));
    }

    #[test]
    fn fp16_gradient_underflows_are_counted_like_the_separate_ops() {
        // An upstream gradient of 1e-9 flushes to zero in fp16 (below 2^-25) at the first
        // rounding, so both count every element of it, and nothing after.
        let (inputs, d_out) = inputs(8, 3);
        let (inputs, d_out) = (inputs.each_ref().map(to_f32), d_out.mapv(|_| 1e-9_f32));
        let _fp16 = autocast(Format::Fp16);
        take_underflow_count();
        let fused = run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out);
        assert_eq!(take_underflow_count(), d_out.len() as u64);
        run(|q, k, v| separate_ops(q, k, v, 2), &inputs, &d_out);
        assert_eq!(take_underflow_count(), d_out.len() as u64);
        assert!(fused[1..].iter().flatten().all(|&g| g == 0.0));
    }

    #[test]
    fn the_split_over_threads_does_not_change_a_bit() {
        let (inputs, d_out) = inputs(8, 5);
        let (inputs, d_out) = (inputs.each_ref().map(to_f32), to_f32(&d_out));
        let [one, three] = [1, 3].map(|threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool");
            pool.install(|| run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out))
        });
        assert_eq!(one, three);
    }

    #[test]
    fn an_empty_sequence_gives_an_empty_output() {
        let x = Tensor::<f32>::param(ArrayD::zeros(IxDyn(&[2, 0, 8])));
        let y = causal_attention(&x, &x, &x, 2);
        assert_eq!(y.shape(), [2, 0, 8]);
        y.backward_with(ArrayD::zeros(IxDyn(&[2, 0, 8])));
        assert_eq!(x.grad().unwrap().shape(), [2, 0, 8]);
    }

    #[test]
    #[should_panic(expected = "causal_attention: expected q, k, v of one shape")]
    fn heads_that_do_not_divide_the_width_are_refused() {
        let x = Tensor::<f32>::zeros(&[1, 2, 6]);
        causal_attention(&x, &x, &x, 4);
    }
}
