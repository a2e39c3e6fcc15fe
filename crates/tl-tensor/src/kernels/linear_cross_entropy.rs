//! A linear layer and the cross-entropy on its output as one kernel, block by block of rows:
//! `mean_r(log Σ_c exp(z_rc) − z_r,t_r)` with `z = x·W`, for a language model's head, whose
//! `N × V` logits (and their gradient) are the largest tensors of a small model's step once
//! the vocabulary is large.
//!
//! - **Blocks of [`LOSS_BLOCK`] rows are the unit of the arithmetic.** Each block's logits
//!   are one product `x_b·W`, each row's softmax statistics its own, and the backward pass
//!   forms the block's `dz`, its `dx_b = dz·Wᵀ` and adds `x_bᵀ·dz` into `dW`, block after
//!   block in row order. Every product has the shape of a block, so the bits of the loss and
//!   of both gradients depend on the rows and the block size only: not on how many rows'
//!   logits are alive at once, nor on the thread count (every product here is
//!   deterministic, see [`gemm`](super::gemm)).
//! - **Keep or recompute.** The caller either gives room for all logits, which the forward
//!   pass fills and the backward pass reads, or none: then the backward pass recomputes each
//!   block's logits with the same product on the same operands, the forward pass's bits, and
//!   no more than one block of logits exists at a time. Both give the same bits.
//! - **Where it rounds is a parameter**, as for the fused attention ([`Rounding`]): under
//!   16-bit products the operands and the logits are rounded, and the gradients of the
//!   logits, of `x` and of `W` are rounded (and their flushes counted) where the separate
//!   ops' casts would round them: `z = rd(rd(x)·rd(W))`, `dz` rounded, `dx = rd(dz·rd(W)ᵀ)`,
//!   `dW = rd(Σ_b rd(x_b)ᵀ·dz_b)`.

use ndarray::{Array2, ArrayView2, ArrayViewMut2, s};
use rayon::prelude::*;

use super::attention::{Rounding, rounded_product};
use super::rows::{contiguous, lane_sum};
use crate::Element;

/// Rows per block: the unit of the kernel's arithmetic (see the module documentation).
pub const LOSS_BLOCK: usize = 64;

/// The geometry of one linear cross-entropy: `rows` rows of `d` inputs, `classes` outputs.
#[derive(Clone, Copy, Debug)]
pub struct LinearCrossEntropy {
    /// Rows (tokens), `N`.
    pub rows: usize,
    /// Inputs per row, `d`.
    pub d: usize,
    /// Classes (the vocabulary), `V`.
    pub classes: usize,
}

/// What the forward pass leaves for the backward pass: each row's log-sum-exp.
#[derive(Clone, Debug)]
pub struct RowStats<E>(Vec<E>);

impl LinearCrossEntropy {
    /// The sum over rows of `log Σ_c exp(z_rc) − z_r,t_r` (in f64, in row order) for
    /// `z = x·w` (`x` is `N × d`, `w` `d × V`, any strides), and each row's log-sum-exp for
    /// [`backward`](Self::backward). With `kept` (`N × V`), the logits are written there for
    /// the backward pass to read.
    ///
    /// # Panics
    /// If a shape is not this geometry's, or a target is not below `V`.
    pub fn forward<E: Element>(
        &self,
        x: ArrayView2<'_, E>,
        w: ArrayView2<'_, E>,
        targets: &[usize],
        mut kept: Option<ArrayViewMut2<'_, E>>,
        rounding: Option<&Rounding<'_, E>>,
    ) -> (f64, RowStats<E>) {
        self.check(x, w, targets);
        if let Some(kept) = &kept {
            assert_eq!(
                kept.dim(),
                (self.rows, self.classes),
                "LinearCrossEntropy: kept logits"
            );
        }
        let w = operand(w, rounding);
        let mut scratch = self.block_scratch(kept.is_none());
        let mut lse = vec![E::zero(); self.rows];
        let mut losses = vec![0.0f64; self.rows];
        for (start, end) in self.blocks() {
            let mut logits = match &mut kept {
                Some(kept) => kept.slice_mut(s![start..end, ..]),
                None => self.block_view(&mut scratch, end - start),
            };
            self.logits(&mut logits, x.slice(s![start..end, ..]), w.view(), rounding);
            let targets = &targets[start..end];
            (logits.outer_iter().into_par_iter())
                .zip(lse[start..end].par_iter_mut())
                .zip(losses[start..end].par_iter_mut())
                .zip(targets.par_iter())
                .for_each(|(((row, lse), loss), &target)| {
                    let row = row.as_slice().expect("contiguous rows");
                    *lse = log_sum_exp(row);
                    *loss = (*lse - row[target]).to_f64();
                });
        }
        (losses.iter().sum(), RowStats(lse))
    }

    /// The gradients of `scale · Σ_r loss_r` (`scale` is the mean's `g / N`) with respect to
    /// `x` and `w`, from the forward pass's statistics and its kept logits if it kept them,
    /// and how many gradient values `rounding` flushed to zero.
    ///
    /// # Panics
    /// As [`forward`](Self::forward), and if `stats` are not its.
    pub fn backward<E: Element>(
        &self,
        (x, w): (ArrayView2<'_, E>, ArrayView2<'_, E>),
        targets: &[usize],
        stats: &RowStats<E>,
        kept: Option<ArrayView2<'_, E>>,
        scale: E,
        rounding: Option<&Rounding<'_, E>>,
    ) -> (Array2<E>, Array2<E>, u64) {
        self.check(x, w, targets);
        assert_eq!(
            stats.0.len(),
            self.rows,
            "LinearCrossEntropy: row statistics"
        );
        let w = operand(w, rounding);
        let mut flushed = 0;
        let mut round_grad = |values: &mut [E]| {
            if let Some(rounding) = rounding {
                flushed += (rounding.gradients)(values);
            }
        };
        let mut dx = Array2::zeros((self.rows, self.d));
        let mut dw = Array2::zeros((self.d, self.classes));
        let mut scratch = self.block_scratch(true);
        for (start, end) in self.blocks() {
            let mut dz = self.block_view(&mut scratch, end - start);
            match &kept {
                Some(kept) => dz.assign(&kept.slice(s![start..end, ..])),
                None => self.logits(&mut dz, x.slice(s![start..end, ..]), w.view(), rounding),
            }
            let targets = &targets[start..end];
            (dz.outer_iter_mut().into_par_iter())
                .zip(stats.0[start..end].par_iter())
                .zip(targets.par_iter())
                .for_each(|((mut row, &lse), &target)| {
                    let row = row.as_slice_mut().expect("contiguous rows");
                    // dz = (softmax(z) − onehot(t)) · scale, softmax from the saved lse.
                    for z in row.iter_mut() {
                        *z -= lse;
                    }
                    E::exp_in_place(row);
                    for z in row.iter_mut() {
                        *z *= scale;
                    }
                    row[target] -= scale;
                });
            round_grad(dz.as_slice_mut().expect("contiguous block"));
            let x_block = operand(x.slice(s![start..end, ..]), rounding);
            let mut dx_block = dx.slice_mut(s![start..end, ..]);
            product(&mut dx_block, dz.view(), w.t(), false, rounding);
            // A block of dx is written once: round it where it lies.
            for mut row in dx_block.rows_mut() {
                round_grad(row.as_slice_mut().expect("contiguous rows"));
            }
            product(&mut dw.view_mut(), x_block.t(), dz.view(), true, rounding);
        }
        round_grad(dw.as_slice_mut().expect("standard layout"));
        (dx, dw, flushed)
    }

    /// `out = rd(x_b·w)` for a block of rows.
    fn logits<E: Element>(
        &self,
        out: &mut ArrayViewMut2<'_, E>,
        x: ArrayView2<'_, E>,
        w: ArrayView2<'_, E>,
        rounding: Option<&Rounding<'_, E>>,
    ) {
        let x = operand(x, rounding);
        product(out, x.view(), w, false, rounding);
        if let Some(rounding) = rounding {
            (rounding.values)(out.as_slice_mut().expect("contiguous block"));
        }
    }

    /// The `(start, end)` of each block of rows.
    fn blocks(&self) -> impl Iterator<Item = (usize, usize)> + use<> {
        let rows = self.rows;
        (0..rows)
            .step_by(LOSS_BLOCK)
            .map(move |start| (start, (start + LOSS_BLOCK).min(rows)))
    }

    /// Room for one block of logits (none when `needed` is false).
    fn block_scratch<E: Element>(&self, needed: bool) -> Vec<E> {
        let rows = if needed { LOSS_BLOCK.min(self.rows) } else { 0 };
        vec![E::zero(); rows * self.classes]
    }

    /// The front `rows × V` of `scratch` as a matrix.
    fn block_view<'s, E>(&self, scratch: &'s mut [E], rows: usize) -> ArrayViewMut2<'s, E> {
        ArrayViewMut2::from_shape((rows, self.classes), &mut scratch[..rows * self.classes])
            .expect("the scratch holds a block")
    }

    fn check<E>(&self, x: ArrayView2<'_, E>, w: ArrayView2<'_, E>, targets: &[usize]) {
        assert!(
            x.dim() == (self.rows, self.d)
                && w.dim() == (self.d, self.classes)
                && targets.len() == self.rows,
            "LinearCrossEntropy: expected x {:?}, w {:?} and {} targets, got {:?}, {:?}, {}",
            (self.rows, self.d),
            (self.d, self.classes),
            self.rows,
            x.dim(),
            w.dim(),
            targets.len()
        );
        if let Some((row, &target)) = targets
            .iter()
            .enumerate()
            .find(|&(_, &t)| t >= self.classes)
        {
            panic!(
                "LinearCrossEntropy: target {target} (row {row}) is not below the {} classes",
                self.classes
            );
        }
    }
}

/// `log Σ exp(z)` around the row's maximum (the maximum itself when it is not finite).
fn log_sum_exp<E: Element>(row: &[E]) -> E {
    let max = row.iter().copied().fold(E::neg_infinity(), E::max);
    if !max.is_finite() {
        return max;
    }
    let mut shifted: Vec<E> = row.iter().map(|&z| z - max).collect();
    E::exp_in_place(&mut shifted);
    max + lane_sum(&shifted).ln()
}

/// An operand: rounded into a contiguous copy under a rounding, the view itself otherwise.
fn operand<'a, E: Element>(
    x: ArrayView2<'a, E>,
    rounding: Option<&Rounding<'_, E>>,
) -> ndarray::CowArray<'a, E, ndarray::Ix2> {
    match rounding {
        Some(rounding) => {
            let mut owned = contiguous(x);
            (rounding.values)(owned.as_slice_mut().expect("standard layout"));
            owned.into()
        }
        None => x.into(),
    }
}

/// `out = lhs · rhs` (or `+=`), a block's product: split across the pool.
fn product<E: Element>(
    out: &mut ArrayViewMut2<'_, E>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
    rounding: Option<&Rounding<'_, E>>,
) {
    rounded_product(out, (lhs, rhs), accumulate, rounding, false);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Generator;
    use crate::testing::random_array;
    use ndarray::Ix2;

    fn random(shape: [usize; 2], rng: &Generator) -> Array2<f64> {
        random_array(&shape, rng)
            .into_dimensionality::<Ix2>()
            .unwrap()
    }

    /// The loss and gradients by the textbook formulas, in f64, row by row.
    fn naive(
        x: &Array2<f64>,
        w: &Array2<f64>,
        targets: &[usize],
        scale: f64,
    ) -> (f64, Array2<f64>, Array2<f64>) {
        let z = x.dot(w);
        let mut dz = Array2::zeros(z.dim());
        let mut total = 0.0;
        for (r, row) in z.outer_iter().enumerate() {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = row.iter().map(|z| (z - max).exp()).sum();
            let lse = max + sum.ln();
            total += lse - row[targets[r]];
            for c in 0..row.len() {
                dz[[r, c]] = ((row[c] - lse).exp() - f64::from(u8::from(c == targets[r]))) * scale;
            }
        }
        (total, dz.dot(&w.t()), x.t().dot(&dz))
    }

    fn run(
        kernel: &LinearCrossEntropy,
        (x, w): (&Array2<f64>, &Array2<f64>),
        targets: &[usize],
        keep: bool,
        rounding: Option<&Rounding<'_, f64>>,
    ) -> (f64, Array2<f64>, Array2<f64>, u64) {
        let mut kept = keep.then(|| Array2::zeros((kernel.rows, kernel.classes)));
        let (total, stats) = kernel.forward(
            x.view(),
            w.view(),
            targets,
            kept.as_mut().map(|k| k.view_mut()),
            rounding,
        );
        let scale = 0.5 / kernel.rows as f64;
        let (dx, dw, flushed) = kernel.backward(
            (x.view(), w.view()),
            targets,
            &stats,
            kept.as_ref().map(|k| k.view()),
            scale,
            rounding,
        );
        (total, dx, dw, flushed)
    }

    #[test]
    fn the_blocked_kernel_is_the_textbook_loss_and_gradients() {
        let rng = Generator::new(5);
        // 150 rows: two full blocks and a partial one.
        let kernel = LinearCrossEntropy {
            rows: 2 * LOSS_BLOCK + 22,
            d: 12,
            classes: 37,
        };
        let x = random([kernel.rows, kernel.d], &rng);
        let w = random([kernel.d, kernel.classes], &rng).mapv(|v| 3.0 * v);
        let targets: Vec<usize> = (0..kernel.rows)
            .map(|r| (r * 7 + 3) % kernel.classes)
            .collect();
        let (total, dx, dw) = naive(&x, &w, &targets, 0.5 / kernel.rows as f64);
        for keep in [true, false] {
            let (got, gdx, gdw, flushed) = run(&kernel, (&x, &w), &targets, keep, None);
            assert!((got - total).abs() < 1e-10 * total, "{got} vs {total}");
            for (a, b) in gdx.iter().zip(&dx).chain(gdw.iter().zip(&dw)) {
                assert!((a - b).abs() < 1e-12, "{a} vs {b}");
            }
            assert_eq!(flushed, 0);
        }
    }

    /// Keeping the logits or recomputing them, on 1 or 3 threads, under a rounding or not:
    /// the same bits.
    #[test]
    fn keeping_or_recomputing_on_any_thread_count_gives_the_same_bits() {
        let rng = Generator::new(6);
        let kernel = LinearCrossEntropy {
            rows: LOSS_BLOCK + 9,
            d: 16,
            classes: 300,
        };
        let x = random([kernel.rows, kernel.d], &rng);
        let w = random([kernel.d, kernel.classes], &rng);
        let targets: Vec<usize> = (0..kernel.rows)
            .map(|r| (r * 31) % kernel.classes)
            .collect();
        let sixteenths =
            |xs: &mut [f64]| xs.iter_mut().for_each(|x| *x = (*x * 16.0).round() / 16.0);
        let flush = |xs: &mut [f64]| {
            let mut flushed = 0;
            for x in xs.iter_mut() {
                let rounded = (*x * 4096.0).round() / 4096.0;
                flushed += u64::from(rounded == 0.0 && *x != 0.0);
                *x = rounded;
            }
            flushed
        };
        let rounding = Rounding {
            values: &sixteenths,
            gradients: &flush,
            products: None,
        };
        for rounding in [None, Some(&rounding)] {
            let reference = run(&kernel, (&x, &w), &targets, true, rounding);
            if rounding.is_some() {
                assert!(reference.3 > 0, "the rounding flushes some gradients");
                assert!(reference.1.iter().all(|v| (v * 4096.0).fract() == 0.0));
            }
            for (threads, keep) in [(1, false), (3, false), (3, true)] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let got = pool.install(|| run(&kernel, (&x, &w), &targets, keep, rounding));
                assert_eq!(
                    got.0.to_bits(),
                    reference.0.to_bits(),
                    "{threads} threads, keep {keep}"
                );
                assert_eq!(got.1, reference.1);
                assert_eq!(got.2, reference.2);
                assert_eq!(got.3, reference.3);
            }
        }
    }

    #[test]
    #[should_panic(expected = "target 9 (row 1) is not below the 9 classes")]
    fn a_target_out_of_range_is_named() {
        let kernel = LinearCrossEntropy {
            rows: 2,
            d: 1,
            classes: 9,
        };
        let (x, w) = (Array2::<f32>::zeros((2, 1)), Array2::<f32>::zeros((1, 9)));
        kernel.forward(x.view(), w.view(), &[0, 9], None, None);
    }
}
