//! What the ranks decide together at the end of a step: whether it may update the weights,
//! and the norm the gradients are clipped by. Every rank must reach the same answer, or the
//! replicas drift apart (docs/course/L11.3.md § 2, *Buckets*, and § 3, *The overflow by
//! hand*).

use crate::ddp::StepSummary;

/// Whether the step may update the weights: `true` only when no rank's gradients held an
/// inf or a NaN, the same answer on every rank.
///
/// - `local`: whether the gradients this rank's optimizer holds are finite (under DDP the
///   reduced gradients, under ZeRO-2 and 3 only this rank's shard of them);
/// - `failed`: whether a collective of the step failed (the gradients are then not the
///   sums, and must not be used);
/// - `summary`: the [`STEP_EXTRAS`](crate::STEP_EXTRAS) summed over the ranks, whose
///   `nonfinite_ranks` counts the ranks that flagged an inf or a NaN in their local
///   gradients before the reduction (`None` if the step has not reduced them).
///
/// A rank that decides from `local` alone skips the step where its own shard overflowed and
/// steps where it did not: one inf on one rank then skips the step on some ranks only, and
/// their weights and loss scales differ from then on.
pub(crate) fn all_ranks_finite(local: bool, failed: bool, summary: Option<StepSummary>) -> bool {
    local && !failed && summary.is_some_and(|s| s.nonfinite_ranks == 0)
}

/// The sum of the squares of the whole model's gradient (whose square root the clip
/// compares with its bound), from `local`, the sum of squares of the gradients this rank
/// holds: when they are a shard (`sharded`, ZeRO-2 and 3), the ranks' sums added up
/// (`sum_over_ranks`, an all-reduce); when they are the whole reduced gradient, replicated
/// on every rank (DDP, ZeRO-1), `local` itself, already the same on every rank, with no
/// collective.
///
/// Clipping by the norm of the local shard would give each rank its own clip factor.
pub(crate) fn global_sum_squares(
    local: f64,
    sharded: bool,
    sum_over_ranks: impl FnOnce(f64) -> f64,
) -> f64 {
    if sharded {
        sum_over_ranks(local)
    } else {
        local
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(nonfinite_ranks: u64) -> Option<StepSummary> {
        Some(StepSummary {
            global_loss: None,
            nonfinite_ranks,
            underflows: 0,
        })
    }

    #[test]
    fn one_rank_that_overflowed_skips_the_step_on_every_rank() {
        // Rank 1's inf: rank 0's own gradients are finite, the flags sum to 1.
        assert!(!all_ranks_finite(true, false, summary(1)));
        assert!(all_ranks_finite(true, false, summary(0)));
        assert!(!all_ranks_finite(false, false, summary(0)));
        assert!(!all_ranks_finite(true, true, summary(0)));
        assert!(!all_ranks_finite(true, false, None));
    }

    #[test]
    fn a_sharded_sum_of_squares_is_added_over_the_ranks_a_replicated_one_is_not() {
        // Two ranks' shards, 3² and 4²: the norm is 5 on both.
        assert_eq!(global_sum_squares(9.0, true, |s| s + 16.0), 25.0);
        let never = |_: f64| -> f64 { panic!("a replicated gradient needs no collective") };
        assert_eq!(global_sum_squares(25.0, false, never), 25.0);
    }
}
