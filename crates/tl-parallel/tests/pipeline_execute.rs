//! The pipeline executor on real ranks: a chain of layers cut into `p · v` stages, every
//! schedule it runs (GPipe, 1F1B, interleaved, ZB-H1) at p = 2 and 4 against one process on the
//! same micro-batches, gradients compared bit for bit; the activations each rank held
//! against the simulator's count; the schedules it refuses, before any message.
//!
//! The ranks are threads, each with its own ring (see `common`).

mod common;

use common::world;
use tl_collective::{Communicator, RingComm};
use tl_parallel::ParallelError;
use tl_parallel::pipeline::{Costs, Schedule, ScheduleKind, StageModel, execute, simulate};
use tl_tensor::losses::mse;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Generator, Tensor};

const WIDTH: usize = 6;
const OUT: usize = 3;
const SEED: u64 = 11;

/// `p · v` stages of `tanh(x·W + b)`, the last followed by a head and the mean squared
/// error, each micro-batch's loss weighted by its share of the step's rows.
struct Chain {
    layers: Vec<Linear<f32>>,
    head: Linear<f32>,
    batches: Vec<(Tensor<f32>, Tensor<f32>)>,
    rows: usize,
}

/// Micro-batches of 3, 2, 4, 3, 2, 4, … rows: shares that differ, as a last short batch's.
fn rows_of(micro_batch: usize) -> usize {
    [3, 2, 4][micro_batch % 3]
}

impl Chain {
    fn new(stages: usize, micro_batches: usize) -> Self {
        let rng = Generator::new(SEED);
        let layers = (0..stages)
            .map(|_| Linear::new(WIDTH, WIDTH, true, &rng))
            .collect();
        let head = Linear::new(WIDTH, OUT, true, &rng);
        let data = Generator::new(SEED + 1);
        let normal = |shape: [usize; 2]| {
            let values = (0..shape[0] * shape[1])
                .map(|_| data.next_normal() as f32)
                .collect();
            Tensor::from_vec(values, &shape).unwrap()
        };
        let batches = (0..micro_batches)
            .map(|i| (normal([rows_of(i), WIDTH]), normal([rows_of(i), OUT])))
            .collect();
        let rows = (0..micro_batches).map(rows_of).sum();
        Self {
            layers,
            head,
            batches,
            rows,
        }
    }

    fn weighted_loss(&self, micro_batch: usize, h: &Tensor<f32>) -> Tensor<f32> {
        let (_, target) = &self.batches[micro_batch];
        let share = rows_of(micro_batch) as f32 / self.rows as f32;
        mse(&self.head.forward(h), target).mul_scalar(share)
    }

    /// One process: every micro-batch through every stage, its backward, in order.
    fn one_process(&self) {
        for (i, (x, _)) in self.batches.iter().enumerate() {
            let h = self
                .layers
                .iter()
                .fold(x.clone(), |h, layer| layer.forward(&h).tanh());
            self.weighted_loss(i, &h).backward();
        }
    }

    /// The gradients' bits of stage `stage`'s parameters (and the head's, on the last).
    fn gradient_bits(&self, stage: usize) -> Vec<u32> {
        let mut params = self.layers[stage].parameters();
        if stage + 1 == self.layers.len() {
            params.extend(self.head.parameters());
        }
        params
            .iter()
            .flat_map(|p| {
                p.grad()
                    .expect("a gradient")
                    .iter()
                    .map(|g| g.to_bits())
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

impl StageModel<f32> for Chain {
    type Error = ParallelError;

    fn input_shape(&self, _stage: usize, micro_batch: usize) -> Vec<usize> {
        vec![rows_of(micro_batch), WIDTH]
    }

    fn forward(
        &self,
        stage: usize,
        micro_batch: usize,
        input: Option<&Tensor<f32>>,
    ) -> Result<Tensor<f32>, ParallelError> {
        let x = input.unwrap_or(&self.batches[micro_batch].0);
        let h = self.layers[stage].forward(x).tanh();
        Ok(if stage + 1 == self.layers.len() {
            self.weighted_loss(micro_batch, &h)
        } else {
            h
        })
    }
}

/// Every (kind, p, m, v) the executor runs here.
fn layouts() -> Vec<(ScheduleKind, usize, usize, usize)> {
    let mut layouts = Vec::new();
    for p in [2, 4] {
        for m in [1, p - 1, p, p + 1, 2 * p] {
            layouts.push((ScheduleKind::GPipe, p, m, 1));
        }
        for m in [p, p + 1, 2 * p + 1] {
            layouts.push((ScheduleKind::OneFOneB, p, m, 1));
            layouts.push((ScheduleKind::ZeroBubbleH1, p, m, 1));
        }
        for m in [p, 2 * p] {
            layouts.push((ScheduleKind::Interleaved, p, m, 2));
        }
    }
    layouts
}

#[test]
fn every_schedule_gives_one_process_gradients_bit_for_bit() {
    for (kind, p, m, v) in layouts() {
        let schedule = Schedule::new(kind, p, m, v).unwrap();
        let stages = p * v;
        let whole = Chain::new(stages, m);
        whole.one_process();
        let expected: Vec<Vec<u32>> = (0..stages).map(|s| whole.gradient_bits(s)).collect();
        let simulated = simulate(&schedule, Costs::UNIT).unwrap();
        let ranks = world(p, |mut comm: RingComm| {
            let rank = comm.rank();
            let chain = Chain::new(stages, m);
            let executed = execute(&schedule, &mut comm, &chain).unwrap();
            let own: Vec<(usize, Vec<u32>)> = (rank..stages)
                .step_by(p)
                .map(|s| (s, chain.gradient_bits(s)))
                .collect();
            (own, executed, comm.messages_waiting(), comm.stats())
        });
        let what = format!("{kind} p {p} m {m} v {v}");
        for (rank, (own, executed, waiting, stats)) in ranks.into_iter().enumerate() {
            for (stage, bits) in own {
                assert_eq!(bits, expected[stage], "{what}: stage {stage}");
            }
            assert_eq!(waiting, 0, "{what}: rank {rank} left messages unread");
            assert_eq!(
                executed.peak_activations, simulated.ranks[rank].peak_activations,
                "{what}: rank {rank}"
            );
            // A message a micro-batch each way for every stage boundary this rank is on.
            let first = usize::from(rank == 0);
            let last = usize::from(rank == p - 1);
            let boundaries = 2 * v - first - last;
            assert_eq!(stats.sends, (boundaries * m) as u64, "{what}: rank {rank}");
            assert_eq!(stats.receives, stats.sends, "{what}: rank {rank}");
            assert_eq!(stats.collectives, 0, "{what}");
            // F and B, or F, I and W, for each micro-batch on each of the rank's stages.
            let passes = if kind == ScheduleKind::ZeroBubbleH1 {
                3
            } else {
                2
            };
            let computed = executed.timeline.iter().filter(|t| t.action.computes());
            assert_eq!(computed.count(), passes * m * v, "{what}: rank {rank}");
        }
    }
}

#[test]
fn a_schedule_the_executor_cannot_run_is_refused_before_any_message() {
    let four_ranks = Schedule::new(ScheduleKind::OneFOneB, 4, 4, 1).unwrap();
    let errors = world(2, |mut comm: RingComm| {
        let chain = Chain::new(2, 2);
        let size = execute(&four_ranks, &mut comm, &chain).unwrap_err();
        assert_eq!(comm.stats().sends, 0);
        // Nothing was sent, so the group is still whole.
        comm.barrier().unwrap();
        size.to_string()
    });
    assert_eq!(
        errors[1],
        "pipeline rank 1: the schedule is for 4 ranks, the pipeline group has 2"
    );
}

#[test]
fn a_stage_that_is_gone_is_an_error_naming_it() {
    let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, 3, 1).unwrap();
    let errors = world(2, |mut comm: RingComm| {
        if comm.rank() == 1 {
            return String::new();
        }
        let chain = Chain::new(2, 3);
        execute(&schedule, &mut comm, &chain)
            .unwrap_err()
            .to_string()
    });
    assert!(errors[0].starts_with("rank 0: rank 1"), "{}", errors[0]);
}
