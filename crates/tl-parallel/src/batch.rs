//! The global batch of a data-parallel step and each rank's share of it.
//!
//! One process training with micro-batches of `m` rows and `accum · world_size` accumulation
//! steps sees, at each step, `B = m · accum · world_size` rows: micro-batch `j` is rows
//! `j·m .. (j+1)·m` of the step's window of data. Under data parallelism rank `r` takes the
//! contiguous block of rows [`shard_range`]`(B, world_size, r)` — for equal shares exactly
//! the micro-batches `r·accum .. (r+1)·accum` of the single process — and cuts it into
//! micro-batches of at most `m` rows. The union over the ranks is the single process's
//! batch, window for window, in the same order.
//!
//! The gradient of the global batch is `∇L = Σ_i (n_i/B)·∇L_i` over every micro-batch `i` of
//! every rank. A training step weights its own micro-batches by `n_i/n_r` (its rows `n_r`),
//! so rank `r`'s gradient must enter the sum with weight `n_r/B` ([`BatchShare::weight`]):
//! `Σ_r (n_r/B) · Σ_{i∈r} (n_i/n_r)·∇L_i = ∇L`, whatever the shares. Averaging over ranks
//! (`1/world_size`) is right only when the shares are equal.

use std::ops::Range;

use tl_collective::shard_range;

use crate::error::{ParallelError, Result};

/// The weight of rank `rank`'s gradient in the sum over the `world_size` ranks: its rows
/// over the global batch's, `n_r/B` (docs/course/L11.3.md § 2, *The weighted sum*).
///
/// A rank's step weights its micro-batches by their share of its own rows, so its gradient
/// is the gradient of the mean over its `n_r` rows. Multiplied by `n_r/B` before the sum,
/// the ranks' gradients add up to the gradient of the mean over all `B` rows, whatever the
/// shares. `1/world_size` is the same number only when the shares are equal: with 3 rows
/// on rank 0 and 1 on rank 1 the weights are 3/4 and 1/4, not 1/2 and 1/2. The weight
/// does not depend on `world_size`; the ranks' weights sum to one.
///
/// # Errors
/// [`ParallelError::RowsOutsideBatch`] naming `rank` if `local_rows` is zero or greater than
/// `global_rows`.
///
/// # Panics
/// In debug builds, if `rank` is not below `world_size`.
pub(crate) fn replica_weight(
    rank: usize,
    world_size: usize,
    local_rows: usize,
    global_rows: usize,
) -> Result<f64> {
    debug_assert!(
        rank < world_size,
        "rank {rank} outside a world of {world_size}"
    );
    if local_rows == 0 || local_rows > global_rows {
        return Err(ParallelError::RowsOutsideBatch {
            rank,
            local_rows,
            global_rows,
        });
    }
    Ok(local_rows as f64 / global_rows as f64)
}

/// Rank `rank`'s part of one step's global batch: which rows, cut into which micro-batches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchShare {
    /// The rows of each micro-batch of this rank, as ranges of row indices into the step's
    /// global batch, in order; together they cover [`rows`](Self::rows).
    pub micro_batches: Vec<Range<usize>>,
    /// This rank's rows: one contiguous block of the global batch.
    pub rows: Range<usize>,
    /// Rows of the whole global batch, over all ranks.
    pub global_rows: usize,
}

impl BatchShare {
    /// This rank's weight in the sum of the ranks' gradients: its rows over the global rows,
    /// `n_r/B` (docs/course/L11.3.md § 2, *The weighted sum*).
    pub fn weight(&self) -> f64 {
        self.rows.len() as f64 / self.global_rows as f64
    }
}

/// Rank `rank`'s share of a step's `global_rows` rows, cut into micro-batches of at most
/// `micro_batch_rows` rows (see the [module docs](self) for the layout and the weights, and
/// docs/course/L11.3.md § 2, *The weighted sum*).
///
/// Rank `r` takes the contiguous rows [`shard_range`]`(global_rows, world_size, r)`: when
/// the rows do not divide, the first `global_rows % world_size` ranks take one row more
/// (5 rows over 2 ranks: `0..3` and `3..5`). It cuts them, in order, into micro-batches of
/// `micro_batch_rows` rows, the last one shorter if they do not divide; no micro-batch
/// reaches past the rank's rows.
///
/// With `global_rows = m · accum · world_size` and `micro_batch_rows = m`, rank `r` gets the
/// single process's micro-batches `r·accum .. (r+1)·accum`, each `m` rows.
///
/// # Errors
/// [`ParallelError::InvalidBatch`] for a world of zero ranks, a rank outside it, micro-batches
/// of zero rows, or fewer global rows than ranks (a rank would have nothing to train on).
///
/// ```
/// use tl_parallel::batch_share;
///
/// // 5 rows over 2 ranks, micro-batches of at most 2 rows.
/// let first = batch_share(5, 2, 2, 0)?;
/// assert_eq!(first.micro_batches, [0..2, 2..3]);
/// assert_eq!(first.weight(), 0.6);
/// let second = batch_share(5, 2, 2, 1)?;
/// assert_eq!(second.micro_batches, [3..5]);
/// assert_eq!(second.weight(), 0.4);
/// # Ok::<(), tl_parallel::ParallelError>(())
/// ```
pub fn batch_share(
    global_rows: usize,
    micro_batch_rows: usize,
    world_size: usize,
    rank: usize,
) -> Result<BatchShare> {
    let invalid = |reason| ParallelError::InvalidBatch {
        global_rows,
        micro_batch_rows,
        world_size,
        rank,
        reason,
    };
    if world_size == 0 {
        return Err(invalid("the world has no rank"));
    }
    if rank >= world_size {
        return Err(invalid("the rank is outside the world"));
    }
    if micro_batch_rows == 0 {
        return Err(invalid("micro-batches must have at least one row"));
    }
    if global_rows < world_size {
        return Err(invalid("every rank needs at least one row"));
    }
    let rows = shard_range(global_rows, world_size, rank);
    let micro_batches = rows
        .clone()
        .step_by(micro_batch_rows)
        .map(|start| start..(start + micro_batch_rows).min(rows.end))
        .collect();
    Ok(BatchShare {
        micro_batches,
        rows,
        global_rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn equal_shares_are_the_single_process_micro_batches_in_rank_order() {
        // m = 2, accum = 2, world 2: the single process's micro-batches are 0..2, 2..4,
        // 4..6, 6..8; rank 0 takes the first two, rank 1 the last two.
        assert_eq!(batch_share(8, 2, 2, 0).unwrap().micro_batches, [0..2, 2..4]);
        assert_eq!(batch_share(8, 2, 2, 1).unwrap().micro_batches, [4..6, 6..8]);
    }

    #[test]
    fn a_replica_weighs_its_share_of_the_rows_not_one_over_the_ranks() {
        // 3 rows and 1 of 4: 3/4 and 1/4, not 1/2 each.
        assert_eq!(replica_weight(0, 2, 3, 4).unwrap(), 0.75);
        assert_eq!(replica_weight(1, 2, 1, 4).unwrap(), 0.25);
        assert_eq!(replica_weight(0, 1, 4, 4).unwrap(), 1.0);
        for (local, global) in [(0, 4), (5, 4)] {
            let error = replica_weight(1, 2, local, global).unwrap_err();
            assert!(
                matches!(error, ParallelError::RowsOutsideBatch { rank: 1, .. }),
                "{error}"
            );
        }
    }

    #[test]
    fn impossible_shares_are_errors_naming_the_reason() {
        for (args, reason) in [
            ((4, 1, 0, 0), "no rank"),
            ((4, 1, 2, 2), "outside"),
            ((4, 0, 2, 0), "at least one row"),
            ((1, 1, 2, 0), "every rank"),
        ] {
            let error = batch_share(args.0, args.1, args.2, args.3).unwrap_err();
            assert!(error.to_string().contains(reason), "{error}");
        }
    }

    proptest! {
        /// The ranks' micro-batches, concatenated in rank order, are exactly the single
        /// process's micro-batches of m rows over m·accum·world rows.
        #[test]
        fn union_of_equal_shares_is_the_single_process_batch(
            m in 1usize..6, accum in 1usize..5, world in 1usize..9,
        ) {
            let global = m * accum * world;
            let union: Vec<Range<usize>> = (0..world)
                .flat_map(|r| batch_share(global, m, world, r).unwrap().micro_batches)
                .collect();
            let single: Vec<Range<usize>> = (0..accum * world).map(|j| j * m..(j + 1) * m).collect();
            prop_assert_eq!(union, single);
        }

        /// Any shares: every row exactly once, in order, micro-batches of 1..=m rows, and
        /// weights that add up to one (so the weighted sum is the global batch's gradient).
        #[test]
        fn any_shares_cover_every_row_once_with_weights_summing_to_one(
            global in 1usize..200, m in 1usize..17, world in 1usize..17,
        ) {
            prop_assume!(global >= world);
            let shares: Vec<BatchShare> =
                (0..world).map(|r| batch_share(global, m, world, r).unwrap()).collect();
            let rows: Vec<usize> = shares
                .iter()
                .flat_map(|s| s.micro_batches.iter().cloned().flatten())
                .collect();
            prop_assert_eq!(rows, (0..global).collect::<Vec<_>>());
            for share in &shares {
                prop_assert!(share.micro_batches.iter().all(|b| (1..=m).contains(&b.len())));
                prop_assert_eq!(share.micro_batches.iter().map(Range::len).sum::<usize>(), share.rows.len());
            }
            let total: usize = shares.iter().map(|s| s.rows.len()).sum();
            prop_assert_eq!(total, global);
            let weights: f64 = shares.iter().map(BatchShare::weight).sum();
            prop_assert!((weights - 1.0).abs() < 1e-12);
        }
    }
}
