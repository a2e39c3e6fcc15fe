//! The cross-entropy of logits split over the vocabulary (Megatron's
//! `vocab_parallel_cross_entropy`): no rank ever holds a row's whole logits.
//!
//! Rank `r` of `t` holds the logits `z_{n,c}` of the classes `c ∈ [r·c_r, (r + 1)·c_r)` of
//! every row `n` (the output of a column-parallel head, not gathered). The loss of a row is
//! `log Σ_c exp(z_c) − z_target`, and each piece of it is a reduction over the vocabulary:
//!
//! 1. `m = max_c z_c`: each rank's maximum, then an all-reduce (max) — exact;
//! 2. `S = Σ_c exp(z_c − m)`: each rank's sum over its classes, and `z_target`: the rank
//!    that holds the target puts it, the others 0; both in one all-reduce (sum);
//! 3. `lse = m + ln S`, the loss `mean_n(lse_n − z_{n,target})`, the same on every rank.
//!
//! Backward needs no communication: `∂L/∂z_c = (exp(z_c − lse) − [c = target])/N` for the
//! rank's own classes. Megatron all-reduces the target's logit and the sums separately
//! (three all-reduces); here they travel together (two).
//!
//! **Numerics.** tl-tensor's [`cross_entropy`](tl_tensor::losses::cross_entropy) computes
//! the same expressions in the same element type, the loss summed over rows in `f64` and
//! rounded once. Only `S` differs: the full loss adds a row's exponentials in one sequence,
//! here each rank adds its classes and the ring adds the ranks' sums. The maximum and the
//! target's logit are exact, so the loss and the gradients differ from the full ones by the
//! rounding of `S` alone: a few units in the last place of `E`. Measured in the tests
//! (t = 2 and 4, relative to the largest magnitude): loss and gradients within 1.8 ε in f64
//! and 1.4 ε in f32 through an embedding and a head, the loss bit for bit on f32 logits of
//! ±40, and everything bit for bit on one rank.

use tl_collective::ReduceOp;
use tl_tensor::Tensor;
use tl_tensor::ndarray::{ArrayD, IxDyn};

use crate::ddp::GradElement;
use crate::error::Result;
use crate::metered::{Metered, communication, labels};

use super::group::TensorParallel;
use super::views::is_meta;

impl TensorParallel {
    /// The mean cross-entropy over the rows of logits split over the vocabulary: `logits`
    /// is this rank's `[.., V/t]` slice (classes `[r·V/t, (r + 1)·V/t)`, as a
    /// [`ColumnParallelLinear`](crate::ColumnParallelLinear) head makes them), `targets`
    /// one class of the whole vocabulary per row, in row-major order. Every rank gets the
    /// same 0-dimensional loss, equal to [`cross_entropy`](tl_tensor::losses::cross_entropy)
    /// of the whole logits (see the [module docs](self) for the rounding); backward, this
    /// rank's logits get their slice of the whole gradient. Two all-reduces of `rows` and
    /// `2·rows` elements forward, nothing backward.
    ///
    /// # Errors
    /// [`ParallelError::Collective`](crate::ParallelError::Collective) if an all-reduce
    /// fails.
    ///
    /// # Panics
    /// If `logits` has no axis, `targets` does not have one entry per row, or a target is
    /// not below `V` (naming it).
    ///
    /// ```
    /// use tl_collective::Single;
    /// use tl_parallel::TensorParallel;
    /// use tl_tensor::{losses::cross_entropy, Tensor};
    ///
    /// let tp = TensorParallel::new(Box::new(Single::new()));
    /// let logits = Tensor::<f64>::param(tl_tensor::ndarray::arr2(&[[0.0, 3f64.ln()]]).into_dyn());
    /// let loss = tp.vocab_parallel_cross_entropy(&logits, &[1])?;
    /// assert_eq!(loss.item(), cross_entropy(&logits, &[1]).item()); // ln(4/3)
    /// # Ok::<(), tl_parallel::ParallelError>(())
    /// ```
    pub fn vocab_parallel_cross_entropy<E: GradElement>(
        &self,
        logits: &Tensor<E>,
        targets: &[usize],
    ) -> Result<Tensor<E>> {
        let shape = logits.shape();
        let classes = *shape
            .last()
            .expect("vocab_parallel_cross_entropy: logits need a class axis");
        let rows = logits.numel() / classes.max(1);
        assert_eq!(
            targets.len(),
            rows,
            "vocab_parallel_cross_entropy: logits of shape {shape:?} have {rows} rows but {} \
             targets were given",
            targets.len()
        );
        let vocab = classes * self.world_size();
        if let Some((row, &target)) = targets.iter().enumerate().find(|&(_, &t)| t >= vocab) {
            panic!(
                "vocab_parallel_cross_entropy: target {target} (row {row}) is not below the \
                 {vocab} classes"
            );
        }
        let start = self.rank() * classes;
        // Each row's target as a class of this rank, if it holds it.
        let local_targets: Vec<Option<usize>> = targets
            .iter()
            .map(|&t| (start..start + classes).contains(&t).then(|| t - start))
            .collect();
        let meta = is_meta(&[logits]);
        let tag = communication(labels::VOCABULARY_STATISTICS, None);
        let by_row = |f: &mut dyn FnMut(usize, &[E])| {
            let value = logits.value();
            let standard = value.as_standard_layout();
            let values = standard.as_slice().expect("standard layout");
            values
                .chunks(classes)
                .enumerate()
                .for_each(|(n, row)| f(n, row));
        };

        // 1. The maximum of each row over the whole vocabulary.
        let mut max = Metered::<E>::zeros(rows, meta, tag);
        if let Some(max) = max.values_mut() {
            by_row(&mut |n, row| {
                max[n] = row.iter().copied().fold(E::neg_infinity(), E::max);
            });
        }
        self.call(|comm| comm.all_reduce(max.view_mut(), ReduceOp::Max))?;

        // 2. The sums of exponentials (first `rows`) and the targets' logits (then `rows`).
        let mut sums = Metered::<E>::zeros(2 * rows, meta, tag);
        if let (Some(max), Some(sums)) = (max.values(), sums.values_mut()) {
            by_row(&mut |n, row| {
                if max[n].is_finite() {
                    sums[n] = row
                        .iter()
                        .fold(E::zero(), |acc, &z| acc + (z - max[n]).exp());
                }
                if let Some(target) = local_targets[n] {
                    sums[rows + n] = row[target];
                }
            });
        }
        self.call(|comm| comm.all_reduce_sum(sums.view_mut()))?;

        // 3. Each row's log-sum-exp, kept for backward, and the mean loss.
        let computed = max.values().zip(sums.values()).map(|(max, sums)| {
            let log_sum_exp: Vec<E> = (0..rows)
                .map(|n| match max[n].is_finite() {
                    true => max[n] + sums[n].ln(),
                    // All −∞ (or a +∞ or NaN present): as the full loss, which would
                    // compute ∞ − ∞ otherwise.
                    false => max[n],
                })
                .collect();
            let total: f64 = (0..rows)
                .map(|n| (log_sum_exp[n] - sums[rows + n]).to_f64())
                .sum();
            let mean = E::from_f64(total / rows as f64);
            (ArrayD::from_elem(IxDyn(&[]), mean), log_sum_exp)
        });
        drop((sums, max));
        let (value, log_sum_exp) = computed.unzip();
        let value = || value.expect("computed for real inputs");
        let saved = logits.clone();
        Ok(Tensor::from_op_shaped(
            &[],
            value,
            &[logits],
            move |grad_out| {
                let log_sum_exp = log_sum_exp.expect("a values VJP runs on real gradients only");
                let scale = grad_out.iter().next().copied().expect("one element")
                    / E::from_f64(rows as f64);
                let value = saved.value();
                let mut grad = value.as_standard_layout().into_owned();
                let flat = grad.as_slice_mut().expect("standard layout");
                for ((row, &lse), target) in flat
                    .chunks_mut(classes)
                    .zip(&log_sum_exp)
                    .zip(&local_targets)
                {
                    row.iter_mut().for_each(|z| *z = (*z - lse).exp() * scale);
                    if let Some(target) = *target {
                        row[target] -= scale;
                    }
                }
                let grad = grad
                    .into_shape_with_order(IxDyn(&shape))
                    .expect("same count");
                vec![Some(grad)]
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_collective::{Collective, CommStats, Phantom, Single, ring_bytes_sent};
    use tl_tensor::Generator;
    use tl_tensor::losses::cross_entropy;
    use tl_tensor::ndarray::Array;

    #[test]
    fn on_a_world_of_one_it_is_tl_tensors_loss_bit_for_bit() {
        // One rank adds a row's exponentials in the full loss's order: nothing may differ.
        let rng = Generator::new(2);
        let values = Array::from_shape_fn((5, 7), |_| (rng.next_f64() * 2.0 - 1.0) as f32 * 20.0);
        let targets = [6, 0, 3, 3, 1];
        let tp = TensorParallel::new(Box::new(Single::new()));
        let ours = Tensor::param(values.clone().into_dyn());
        let theirs = Tensor::param(values.into_dyn());
        let loss = tp.vocab_parallel_cross_entropy(&ours, &targets).unwrap();
        let full = cross_entropy(&theirs, &targets);
        assert_eq!(loss.item().to_bits(), full.item().to_bits());
        loss.mul_scalar(0.5).backward();
        full.mul_scalar(0.5).backward();
        assert_eq!(ours.grad(), theirs.grad());
    }

    #[test]
    fn on_meta_logits_it_makes_two_all_reduces_and_a_meta_gradient() {
        let tp = TensorParallel::new(Box::new(Phantom::new(2, 4).unwrap()));
        let logits = Tensor::<f32>::meta_param(&[6, 5]);
        let loss = tp
            .vocab_parallel_cross_entropy(&logits, &[0, 19, 7, 8, 9, 10])
            .unwrap();
        let forward = tp.stats();
        loss.backward();
        assert!(loss.is_meta() && logits.grad_is_meta());
        // The maxima (6 floats), then the sums and the targets' logits (12): nothing back.
        let sent = |elements| ring_bytes_sent(Collective::AllReduce, elements, 4, 4, 2);
        let expected = CommStats {
            collectives: 2,
            bytes_sent: sent(6) + sent(12),
            ..CommStats::default()
        };
        assert_eq!((forward, tp.stats()), (expected, expected));
    }

    #[test]
    #[should_panic(expected = "target 20 (row 1) is not below the 20 classes")]
    fn a_target_outside_the_whole_vocabulary_is_named() {
        let tp = TensorParallel::new(Box::new(Phantom::new(0, 4).unwrap()));
        let _ = tp.vocab_parallel_cross_entropy(&Tensor::<f32>::zeros(&[2, 5]), &[0, 20]);
    }
}
