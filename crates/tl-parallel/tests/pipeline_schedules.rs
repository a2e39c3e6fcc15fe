//! Pipeline schedules as data: every generated schedule for p ≤ 8 ranks, m ≤ 32
//! micro-batches and v ≤ 4 stages a rank is complete and deadlock-free, its bubble is the
//! papers' formula where the formula holds, each rank holds the activations the schedule
//! promises, and hand-broken schedules are caught with the action named.

use tl_parallel::pipeline::{
    Action, Costs, Schedule, ScheduleError, ScheduleKind, Simulation, simulate,
};

/// Every valid (p, m, v) of a kind in the ranges above.
fn sizes(kind: ScheduleKind) -> impl Iterator<Item = (usize, usize, usize)> {
    let stages_per_rank = match kind {
        ScheduleKind::Interleaved => 1..=4,
        _ => 1..=1,
    };
    stages_per_rank.flat_map(move |v| {
        (1..=8).flat_map(move |p| {
            (1..=32)
                .filter(move |&m| match kind {
                    ScheduleKind::GPipe => true,
                    ScheduleKind::Interleaved => m >= p && m % p == 0,
                    _ => m >= p,
                })
                .map(move |m| (p, m, v))
        })
    })
}

fn run(kind: ScheduleKind, p: usize, m: usize, v: usize, costs: Costs) -> Simulation {
    let schedule = Schedule::new(kind, p, m, v).unwrap();
    simulate(&schedule, costs).unwrap_or_else(|e| panic!("{kind} p {p} m {m} v {v}: {e}"))
}

/// The ratio `idle / busy` of every rank, as a fraction `n / d` compared exactly.
fn assert_bubble(what: &str, run: &Simulation, numerator: u64, denominator: u64) {
    for (rank, timeline) in run.ranks.iter().enumerate() {
        assert_eq!(
            timeline.idle * denominator,
            timeline.busy * numerator,
            "{what}, rank {rank}: idle {} over busy {}, not {numerator}/{denominator}",
            timeline.idle,
            timeline.busy
        );
    }
}

#[test]
fn gpipe_and_1f1b_have_narayanans_bubble_p_minus_1_over_m() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for (p, m, v) in sizes(kind) {
            let run = run(kind, p, m, v, Costs::UNIT);
            assert_bubble(&format!("{kind} p {p} m {m}"), &run, p as u64 - 1, m as u64);
            // With a latency too, every schedule still ends.
            let slow = Costs {
                latency: 3,
                ..Costs::UNIT
            };
            assert!(simulate(&Schedule::new(kind, p, m, v).unwrap(), slow).is_ok());
        }
    }
}

#[test]
fn interleaving_v_stages_a_rank_divides_the_bubble_by_v() {
    for (p, m, v) in sizes(ScheduleKind::Interleaved) {
        let run = run(ScheduleKind::Interleaved, p, m, v, Costs::UNIT);
        // (1/v)(p − 1)/m, each of the v stages costing 1/v of the rank's work.
        let what = format!("interleaved p {p} m {m} v {v}");
        assert_bubble(&what, &run, p as u64 - 1, (v * m) as u64);
    }
}

#[test]
fn zb_h1_cuts_the_bubble_to_p_minus_1_of_f_plus_b_minus_w() {
    // Qi et al.: with T_F = T_B = T_W the bubble is (p − 1)(T_F + T_B − T_W) = p − 1 units
    // against 1F1B's 3(p − 1), over 3m units of work.
    for (p, m, v) in sizes(ScheduleKind::ZeroBubbleH1) {
        let run = run(ScheduleKind::ZeroBubbleH1, p, m, v, Costs::UNIT);
        let what = format!("zb-h1 p {p} m {m}");
        assert_bubble(&what, &run, p as u64 - 1, 3 * m as u64);
    }
}

#[test]
fn each_rank_holds_what_its_schedule_promises() {
    for kind in ScheduleKind::ALL {
        for (p, m, v) in sizes(kind) {
            let run = run(kind, p, m, v, Costs::UNIT);
            for (r, timeline) in run.ranks.iter().enumerate() {
                let expected = match kind {
                    ScheduleKind::GPipe => m,
                    // The warm-up's forwards and one more.
                    ScheduleKind::OneFOneB => (p - r).min(m),
                    // Those, and the `r` weight gradients held back: 1F1B's largest.
                    ScheduleKind::ZeroBubbleH1 => p.min(m),
                    ScheduleKind::Interleaved => (2 * (p - 1 - r) + (v - 1) * p + 1).min(m * v),
                };
                assert_eq!(
                    timeline.peak_activations, expected,
                    "{kind} p {p} m {m} v {v}, rank {r}"
                );
            }
        }
    }
}

#[test]
fn too_few_micro_batches_are_refused_with_the_reason() {
    let error = Schedule::new(ScheduleKind::OneFOneB, 4, 3, 1).unwrap_err();
    assert!(
        matches!(error, ScheduleError::Invalid { value: 3, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("at least 4"), "{error}");
    let error = Schedule::new(ScheduleKind::Interleaved, 4, 6, 2).unwrap_err();
    assert!(error.to_string().contains("multiple of 4"), "{error}");
    let error = Schedule::new(ScheduleKind::GPipe, 2, 4, 2).unwrap_err();
    assert!(error.to_string().contains("stages per rank"), "{error}");
    // GPipe streams any number: a stage waits only for micro-batches that exist.
    assert!(
        simulate(
            &Schedule::new(ScheduleKind::GPipe, 4, 1, 1).unwrap(),
            Costs::UNIT
        )
        .is_ok()
    );
    let error = "2f2b".parse::<ScheduleKind>().unwrap_err();
    assert!(error.to_string().contains("1f1b"), "{error}");
}

/// Rank `rank`'s list of `schedule` with `edit` applied.
fn edited(schedule: &Schedule, rank: usize, edit: impl FnOnce(&mut Vec<Action>)) -> Schedule {
    let mut actions = schedule.all_actions().to_vec();
    edit(&mut actions[rank]);
    Schedule::from_actions(
        actions,
        schedule.micro_batches(),
        schedule.stages_per_rank(),
    )
}

#[test]
fn a_hand_broken_schedule_is_caught_naming_the_action() {
    let good = Schedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    // Rank 0 waits for micro-batch 0's gradient before sending its activations: rank 1
    // waits for those, so neither goes on (pytorch #127332's kind of hang).
    let swapped = edited(&good, 0, |actions| {
        let send = actions
            .iter()
            .position(|a| {
                *a == Action::SendActivation {
                    stage: 0,
                    micro_batch: 0,
                }
            })
            .unwrap();
        let recv = actions
            .iter()
            .position(|a| {
                *a == Action::RecvGradient {
                    stage: 0,
                    micro_batch: 0,
                }
            })
            .unwrap();
        let moved = actions.remove(recv);
        actions.insert(send, moved);
    });
    match simulate(&swapped, Costs::UNIT) {
        Err(ScheduleError::Deadlock {
            rank: 0, action, ..
        }) => {
            assert_eq!(
                action,
                Action::RecvGradient {
                    stage: 0,
                    micro_batch: 0
                }
            );
        }
        other => panic!("not the deadlock: {other:?}"),
    }
    // A backward dropped: named as missing.
    let dropped = edited(&good, 1, |actions| {
        actions.retain(|a| {
            *a != Action::Backward {
                stage: 1,
                micro_batch: 1,
            }
        });
    });
    let error = simulate(&dropped, Costs::UNIT).unwrap_err();
    assert!(
        matches!(error, ScheduleError::Inconsistent { rank: 1, .. }),
        "{error}"
    );
    // A forward on a rank that does not hold the stage.
    let misplaced = edited(&good, 0, |actions| {
        actions.insert(
            0,
            Action::Forward {
                stage: 1,
                micro_batch: 0,
            },
        );
    });
    let error = simulate(&misplaced, Costs::UNIT).unwrap_err();
    assert!(
        error.to_string().contains("stage 1 is on rank 1"),
        "{error}"
    );
    // A backward before its forward.
    let early = edited(&good, 1, |actions| {
        actions.insert(
            0,
            Action::Backward {
                stage: 1,
                micro_batch: 1,
            },
        );
    });
    let error = simulate(&early, Costs::UNIT).unwrap_err();
    assert!(error.to_string().contains("before its forward"), "{error}");
}

proptest::proptest! {
    /// Whatever the passes and the messages cost, every generated schedule runs to its end,
    /// each rank computes exactly its stages' work, and no rank idles less than GPipe's
    /// critical path allows: the step lasts at least the first micro-batch's way through
    /// every stage and back.
    #[test]
    fn any_costs_run_every_schedule_to_its_end(
        kind in proptest::sample::select(ScheduleKind::ALL.to_vec()),
        p in 1usize..=6,
        rounds in 1usize..=4,
        v in 1usize..=3,
        forward in 1u64..=5,
        backward_input in 1u64..=5,
        backward_weight in 1u64..=5,
        latency in 0u64..=4,
    ) {
        let v = if kind == ScheduleKind::Interleaved { v } else { 1 };
        let m = p * rounds;
        let schedule = Schedule::new(kind, p, m, v).unwrap();
        let costs = Costs {
            forward,
            backward: backward_input + backward_weight,
            backward_input,
            backward_weight,
            latency,
        };
        let run = simulate(&schedule, costs).unwrap();
        let work = (m * v) as u64 * (forward + backward_input + backward_weight);
        for timeline in &run.ranks {
            proptest::prop_assert_eq!(timeline.busy, work);
            proptest::prop_assert_eq!(timeline.busy + timeline.idle, run.makespan);
        }
        let stages = (p * v) as u64;
        let critical = stages * (forward + backward_input) + 2 * (stages - 1) * latency;
        proptest::prop_assert!(run.makespan >= critical);
    }
}
