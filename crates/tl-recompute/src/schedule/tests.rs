use proptest::prelude::*;

use super::*;

#[test]
fn six_layers_in_four_units_split_three_and_three() {
    // Sizes 3, 3: peak max(0 + 3, 1 + 3) = 4; a last segment of 4 would need 1 + 4 = 5.
    assert_eq!(checkpoint_schedule(6, 4).unwrap(), vec![0, 3]);
}

#[test]
fn a_budget_holding_the_stack_means_no_checkpointing() {
    assert_eq!(checkpoint_schedule(6, 6).unwrap(), vec![0]);
    assert_eq!(checkpoint_schedule(6, 100).unwrap(), vec![0]);
    assert_eq!(checkpoint_schedule(1, 1).unwrap(), vec![0]);
}

#[test]
fn seven_layers_keep_the_longest_last_segment_the_budget_allows() {
    // Two segments: the last holds B − 1 layers, the first the rest (at most B).
    assert_eq!(checkpoint_schedule(7, 4).unwrap(), vec![0, 4]); // 4, 3
    assert_eq!(checkpoint_schedule(7, 5).unwrap(), vec![0, 3]); // 3, 4
    assert_eq!(checkpoint_schedule(7, 6).unwrap(), vec![0, 2]); // 2, 5
}

#[test]
fn the_tightest_budget_uses_the_staircase() {
    // B(B + 1)/2 layers exactly: sizes B, B − 1, …, 1, every segment at peak B.
    assert_eq!(checkpoint_schedule(6, 3).unwrap(), vec![0, 3, 5]);
    assert_eq!(checkpoint_schedule(10, 4).unwrap(), vec![0, 4, 7, 9]);
    // One budget step above the staircase (5 + 4 + 3 + 2 + 1 = 15 ≥ 10): the last segment
    // can hold 3 layers with 3 segments (2 + 3 = 5), leaving 7 = 5 + 2 in front.
    assert_eq!(checkpoint_schedule(10, 5).unwrap(), vec![0, 5, 7]);
}

#[test]
fn a_budget_too_small_names_the_smallest_that_fits() {
    // 3 + 2 + 1 = 6 < 7 ≤ 4 + 3 + 2 + 1 = 10.
    assert_eq!(
        checkpoint_schedule(7, 3),
        Err(RecomputeError::BudgetTooSmall {
            n_layers: 7,
            mem_budget_layers: 3,
            min_budget: 4
        })
    );
    let message = checkpoint_schedule(16, 4).unwrap_err().to_string();
    // 5 · 6 / 2 = 15 < 16 ≤ 6 · 7 / 2 = 21.
    assert!(
        message.contains("smallest budget that fits is 6"),
        "{message}"
    );
}

#[test]
fn zero_layers_or_a_zero_budget_are_rejected() {
    assert!(matches!(
        checkpoint_schedule(0, 4),
        Err(RecomputeError::InvalidArgument {
            name: "n_layers",
            ..
        })
    ));
    assert!(matches!(
        checkpoint_schedule(4, 0),
        Err(RecomputeError::InvalidArgument {
            name: "mem_budget_layers",
            ..
        })
    ));
    assert!(uniform_schedule(0).is_err());
    assert!(schedule_cost(0, &[0]).is_err());
}

#[test]
fn uniform_segments_are_ceil_sqrt_long() {
    assert_eq!(uniform_schedule(1).unwrap(), vec![0]);
    assert_eq!(uniform_schedule(6).unwrap(), vec![0, 3]); // ⌈√6⌉ = 3
    assert_eq!(uniform_schedule(7).unwrap(), vec![0, 3, 6]);
    assert_eq!(uniform_schedule(16).unwrap(), vec![0, 4, 8, 12]);
    assert_eq!(uniform_schedule(17).unwrap(), vec![0, 5, 10, 15]);
}

#[test]
fn cost_counts_stored_inputs_and_the_rerun_layers() {
    // Sizes 3, 2, 1: peaks 0 + 3, 1 + 2, 2 + 1; layers 0..5 rerun.
    assert_eq!(
        schedule_cost(6, &[0, 3, 5]).unwrap(),
        ScheduleCost {
            peak_layers: 3,
            recomputed_layers: 5
        }
    );
    // No checkpointing: every input held once, nothing rerun.
    assert_eq!(
        schedule_cost(6, &[0]).unwrap(),
        ScheduleCost {
            peak_layers: 6,
            recomputed_layers: 0
        }
    );
    // Per layer: 5 stored inputs + the last layer.
    assert_eq!(
        schedule_cost(6, &[0, 1, 2, 3, 4, 5]).unwrap().peak_layers,
        6
    );
}

#[test]
fn malformed_schedules_are_rejected() {
    for (schedule, reason) in [
        (vec![], "starts at layer 0"),
        (vec![1, 3], "starts at layer 0"),
        (vec![0, 3, 3], "increase strictly"),
        (vec![0, 4, 2], "increase strictly"),
        (vec![0, 6], "before the last layer's end"),
    ] {
        let error = schedule_cost(6, &schedule).unwrap_err();
        assert!(
            matches!(&error, RecomputeError::InvalidSchedule { schedule: s, n_layers: 6, .. } if *s == schedule),
            "{error}"
        );
        assert!(error.to_string().contains(reason), "{error}");
    }
    assert_eq!(segment_sizes(6, &[0, 1, 4]).unwrap(), vec![1, 3, 2]);
}

/// Every schedule of `n` layers: one per subset of the cut points 1..n.
fn all_schedules(n_layers: usize) -> impl Iterator<Item = Vec<usize>> {
    (0u32..1 << (n_layers - 1)).map(move |cuts| {
        std::iter::once(0)
            .chain((1..n_layers).filter(|cut| cuts & (1 << (cut - 1)) != 0))
            .collect()
    })
}

proptest! {
    #[test]
    fn the_chosen_schedule_fits_and_no_other_recomputes_less(
        n_layers in 1usize..=11,
        mem_budget_layers in 1usize..=12,
    ) {
        let best = all_schedules(n_layers)
            .map(|schedule| schedule_cost(n_layers, &schedule).map(|cost| (cost, schedule.len())))
            .map(Result::unwrap)
            .filter(|(cost, _)| cost.peak_layers <= mem_budget_layers)
            .map(|(cost, segments)| (cost.recomputed_layers, segments))
            .min();
        match (checkpoint_schedule(n_layers, mem_budget_layers), best) {
            (Ok(schedule), Some(best)) => {
                let cost = schedule_cost(n_layers, &schedule).unwrap();
                prop_assert!(cost.peak_layers <= mem_budget_layers);
                prop_assert_eq!((cost.recomputed_layers, schedule.len()), best);
            }
            (Err(RecomputeError::BudgetTooSmall { min_budget, .. }), None) => {
                prop_assert!(min_budget > mem_budget_layers);
                prop_assert!(checkpoint_schedule(n_layers, min_budget).is_ok());
                prop_assert!(checkpoint_schedule(n_layers, min_budget - 1).is_err());
            }
            (chosen, best) => prop_assert!(false, "chose {:?}, brute force {:?}", chosen, best),
        }
    }

    #[test]
    fn uniform_schedules_are_valid_with_a_sqrt_peak(n_layers in 1usize..400) {
        let cost = schedule_cost(n_layers, &uniform_schedule(n_layers).unwrap()).unwrap();
        // At most ⌈√n⌉ segments of at most ⌈√n⌉ layers: peak < 2⌈√n⌉.
        let side = (n_layers as f64).sqrt().ceil() as usize;
        prop_assert!(cost.peak_layers < 2 * side, "peak {}", cost.peak_layers);
    }
}
