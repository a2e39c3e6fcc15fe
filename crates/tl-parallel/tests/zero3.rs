//! ZeRO-3 on ranks that are threads of one process, against DDP on the same data.

mod common;

use common::{Batch, Config, Gate, Gated, Held, Mlp, SEED, loss_fn, weights, world};
use tl_collective::{Communicator, RingComm};
use tl_parallel::{DataParallel, UnitRunner, Zero3};
use tl_precision::{DynamicLossScaler, Precision, StepReport, finish_step_observed, start_step};
use tl_recompute::checkpoint;
use tl_tensor::Tensor;
use tl_tensor::losses::mse;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::{AdamW, AdamWState, Optimizer};

const LR: f64 = 1e-2;

fn config(
    precision: Precision,
    micro_batch_rows: usize,
    overflow: Option<(usize, usize)>,
) -> Config {
    Config {
        precision,
        global_rows: 8,
        micro_batch_rows,
        bucket_bytes: tl_parallel::DEFAULT_BUCKET_BYTES,
        overflow,
    }
}

/// What a rank ends with: the whole weights, every step's report, the whole AdamW state.
type Outcome = (Vec<f64>, Vec<StepReport>, AdamWState);

fn set_weights(model: &Mlp<f32>, values: &[f64]) {
    let mut offset = 0;
    for param in model.parameters() {
        let run = &values[offset..offset + param.numel()];
        param.update_value(|v| v.iter_mut().zip(run).for_each(|(x, &r)| *x = r as f32));
        offset += param.numel();
    }
}

/// DDP with a plain AdamW, steps `steps`, from `start` (weights and state) if given.
fn ddp_rank(
    comm: RingComm,
    config: &Config,
    steps: std::ops::Range<usize>,
    start: Option<&(Vec<f64>, AdamWState)>,
) -> Outcome {
    let mut ddp = DataParallel::new(Box::new(comm));
    let model = Mlp::<f32>::new(SEED);
    let mut opt = AdamW::new(model.parameters(), LR).unwrap();
    if let Some((values, state)) = start {
        set_weights(&model, values);
        opt.load_state_dict(state.clone()).unwrap();
    }
    let mut scaler = config.scaler();
    let (rank, n) = (ddp.rank(), ddp.world_size());
    let reports = steps
        .map(|step| {
            let batches: Vec<Batch<f32>> = config.micro_batches(step, n, rank);
            let report = ddp.train_step(
                &model,
                &batches,
                config.global_rows,
                loss_fn,
                &mut opt,
                config.precision,
                scaler.as_mut(),
                None,
            );
            report.unwrap()
        })
        .collect();
    (weights(&model), reports, opt.state_dict())
}

/// The MLP's forward with each layer a unit, checkpointed or not. A checkpointed unit is
/// run as a model runs its checkpointed blocks: the checkpoint around the unit, so that the
/// rerun during backward runs the unit again.
fn forward(
    runner: &UnitRunner<f32>,
    model: &Mlp<f32>,
    x: &Tensor<f32>,
    recompute: bool,
) -> Tensor<f32> {
    let layer = |unit: usize, linear: &Linear<f32>, x: &Tensor<f32>| {
        if !recompute {
            return runner.run_unit(unit, || linear.forward(x));
        }
        let params = linear.parameters();
        let copy = Linear::from_parts(params[0].clone(), params.get(1).cloned());
        let runner = runner.clone();
        checkpoint(
            move |xs| runner.run_unit(unit, || copy.forward(&xs[0])),
            std::slice::from_ref(x),
            &params,
            &[],
        )
    };
    layer(1, &model.out, &layer(0, &model.hidden, x).tanh())
}

/// ZeRO-3 with the hidden layer and the output layer as units; with the bytes the rank sent.
fn zero3_rank(
    comm: RingComm,
    config: &Config,
    steps: std::ops::Range<usize>,
    start: Option<&(Vec<f64>, AdamWState)>,
    recompute: bool,
) -> (Outcome, u64) {
    zero3_rank_prefetching(comm, config, steps, start, recompute, false)
}

/// [`zero3_rank`] on a `DataParallel` whose reduction overlaps backward when `prefetch`,
/// so that the next unit's gather is under way while a unit computes.
fn zero3_rank_prefetching(
    comm: RingComm,
    config: &Config,
    steps: std::ops::Range<usize>,
    start: Option<&(Vec<f64>, AdamWState)>,
    recompute: bool,
    prefetch: bool,
) -> (Outcome, u64) {
    let model = Mlp::<f32>::new(SEED);
    if let Some((values, _)) = start {
        set_weights(&model, values);
    }
    let units = vec![model.hidden.parameters(), model.out.parameters()];
    let adamw = AdamW::new(model.parameters(), LR).unwrap();
    let (rank, n) = (comm.rank(), comm.world_size());
    let ddp = DataParallel::new(Box::new(comm)).with_overlap(prefetch);
    let mut zero3 = Zero3::on(&ddp, units, &adamw).unwrap();
    if let Some((_, state)) = start {
        zero3.load_full_state(state).unwrap();
    }
    assert!(model.parameters().iter().all(Tensor::is_released));
    let runner = zero3.runner();
    let loss = |model: &Mlp<f32>, (x, target): &Batch<f32>| {
        mse(&forward(&runner, model, x, recompute), target)
    };
    let mut scaler = config.scaler();
    let reports = steps
        .map(|step| {
            let batches: Vec<Batch<f32>> = config.micro_batches(step, n, rank);
            let report = zero3.train_step(
                &model,
                &batches,
                config.global_rows,
                loss,
                config.precision,
                scaler.as_mut(),
                None,
            );
            assert!(model.parameters().iter().all(Tensor::is_released));
            report.unwrap()
        })
        .collect();
    let sent = zero3.stats().bytes_sent;
    let state = zero3.full_state().unwrap();
    zero3.gather_full_parameters().unwrap();
    let values = weights(&model);
    zero3.release_full_parameters();
    ((values, reports, state), sent)
}

/// ZeRO-3 as [`zero3_rank`] without recomputation, each step's passes run by the caller as a
/// pipeline's schedule runs them (every micro-batch's forward, then their backwards in
/// order), begun with `begin_step` and ended by tl-precision's `finish_step_observed` with
/// the stage's observer, prefetching the next unit; with the bytes the rank sent.
fn zero3_scheduled_rank(
    comm: RingComm,
    config: &Config,
    steps: std::ops::Range<usize>,
) -> (Outcome, u64) {
    let model = Mlp::<f32>::new(SEED);
    let units = vec![model.hidden.parameters(), model.out.parameters()];
    let adamw = AdamW::new(model.parameters(), LR).unwrap();
    let (rank, n) = (comm.rank(), comm.world_size());
    let ddp = DataParallel::new(Box::new(comm)).with_overlap(true);
    let mut zero3 = Zero3::on(&ddp, units, &adamw).unwrap();
    let runner = zero3.runner();
    let mut scaler = config.scaler();
    let reports = steps
        .map(|step| {
            let batches: Vec<Batch<f32>> = config.micro_batches(step, n, rank);
            start_step(&model, &mut zero3);
            let rows = |(x, _): &Batch<f32>| x.shape()[0];
            let local_rows: usize = batches.iter().map(rows).sum();
            zero3.begin_step(local_rows, config.global_rows).unwrap();
            let loss_scale = scaler.as_ref().map_or(1.0, DynamicLossScaler::loss_scale);
            let (mut local_loss, mut batch_loss) = (0.0, 0.0);
            {
                // The passes under the precision's autocast, backwards included, as the
                // pipeline's executor runs them.
                let _autocast = config.precision.autocast();
                let weighted: Vec<Tensor<f32>> = (batches.iter())
                    .map(|batch @ (x, target)| {
                        let loss = mse(&forward(&runner, &model, x, false), target);
                        let value = f64::from(loss.item());
                        local_loss += rows(batch) as f64 / config.global_rows as f64 * value;
                        let weight = rows(batch) as f64 / local_rows as f64;
                        batch_loss += weight * value;
                        loss.mul_scalar((weight * loss_scale) as f32)
                    })
                    .collect();
                weighted.iter().for_each(Tensor::backward);
            }
            zero3.record_loss(local_loss);
            let mut observer = zero3.observer();
            let report =
                finish_step_observed(&mut zero3, batch_loss, scaler.as_mut(), None, &mut observer);
            assert!(observer.take_error().is_none());
            assert!(model.parameters().iter().all(Tensor::is_released));
            observer.global_report(report.unwrap())
        })
        .collect();
    let sent = zero3.stats().bytes_sent;
    let state = zero3.full_state().unwrap();
    zero3.gather_full_parameters().unwrap();
    let values = weights(&model);
    zero3.release_full_parameters();
    ((values, reports, state), sent)
}

fn max_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Compares every rank's outcome with DDP's: exactly, or to `tolerance`, returning the
/// largest difference of the weights.
fn assert_matches(got: &[Outcome], want: &[Outcome], tolerance: Option<f64>, what: &str) -> f64 {
    let mut largest: f64 = 0.0;
    for ((weights, reports, _), (ddp_weights, ddp_reports, _)) in got.iter().zip(want) {
        for (report, ddp) in reports.iter().zip(ddp_reports) {
            assert_eq!(
                (report.skipped, report.scale),
                (ddp.skipped, ddp.scale),
                "{what}"
            );
            assert!(
                (report.loss - ddp.loss).abs() <= tolerance.unwrap_or(0.0),
                "{what}: loss"
            );
        }
        let difference = max_difference(weights, ddp_weights);
        match tolerance {
            None => assert_eq!(weights, ddp_weights, "{what}: weights bit for bit"),
            Some(t) => assert!(difference <= t, "{what}: weights differ by {difference:e}"),
        }
        largest = largest.max(difference);
    }
    largest
}

/// ZeRO-3 trains as DDP over 5 steps at N = 2 and 4, in fp32, bf16 and fp16 with an input
/// that overflows on rank 0 in step 2: bit for bit at N = 2 (a sum of two is one addition,
/// whatever the order), to 1e-6 at N = 4 (the ring adds a unit's chunks in another order).
#[test]
fn zero3_equals_ddp_in_every_precision_at_two_and_four_ranks() {
    for n in [2, 4] {
        for (precision, overflow) in [
            (Precision::Fp32, None),
            (Precision::Bf16, None),
            (Precision::Fp16, Some((2, 1))),
        ] {
            let config = config(precision, 8 / n, overflow);
            let ddp = world(n, |comm| ddp_rank(comm, &config, 0..5, None));
            let zero3 = world(n, |comm| zero3_rank(comm, &config, 0..5, None, false).0);
            if overflow.is_some() {
                assert!(ddp[0].1[2].skipped, "the overflow skips step 2");
            }
            let what = format!("N = {n}, {precision:?}");
            let tolerance = (n > 2).then_some(1e-6);
            let largest = assert_matches(&zero3, &ddp, tolerance, &what);
            println!("{what}: largest weight difference {largest:e}");
        }
    }
}

/// Each unit checkpointed: the rerun inside the unit's backward gathers the parameters and
/// keeps them for the backward that follows, so a checkpointed unit sends what a plain one
/// does, and the training is the plain run's bit for bit, with two micro-batches a rank
/// (the shards accumulate).
#[test]
fn zero3_with_checkpointed_units_equals_the_plain_run() {
    let config = config(Precision::Fp32, 2, None);
    let (plain, plain_sent): (Vec<_>, Vec<_>) =
        world(2, |comm| zero3_rank(comm, &config, 0..5, None, false))
            .into_iter()
            .unzip();
    let (recomputed, recomputed_sent): (Vec<_>, Vec<_>) =
        world(2, |comm| zero3_rank(comm, &config, 0..5, None, true))
            .into_iter()
            .unzip();
    assert_matches(&recomputed, &plain, None, "checkpointed");
    assert_eq!(recomputed_sent, plain_sent, "no gather more for the rerun");
    let ddp = world(2, |comm| ddp_rank(comm, &config, 0..5, None));
    let largest = assert_matches(&plain, &ddp, Some(1e-6), "accumulating");
    println!("two micro-batches a rank: largest weight difference from DDP {largest:e}");
}

/// A step whose passes the caller runs (a pipeline's schedule: every forward, then every
/// backward), begun with `begin_step` and ended with the stage's observer, is `train_step`'s
/// bit for bit with the same bytes sent: the same gathers and reduce-scatters, the shards
/// adding the micro-batches in the same order; in fp16 with an overflow on rank 0 too.
/// The next unit's gather started ahead (on the communication thread) gives the same
/// training, bit for bit, and sends the same bytes: a gather copies. At N = 3 with three
/// one-row micro-batches a rank (the shards accumulate), plain and checkpointed, in fp32,
/// bf16 and fp16 with an overflow. A prefetch used after the update would show here: the
/// weights would be the step before's.
#[test]
fn zero3_prefetching_the_next_unit_changes_no_bit() {
    for (precision, overflow) in [
        (Precision::Fp32, None),
        (Precision::Bf16, None),
        (Precision::Fp16, Some((2, 7))),
    ] {
        let config = Config {
            global_rows: 9,
            ..config(precision, 1, overflow)
        };
        for recompute in [false, true] {
            let run = |prefetch| {
                world(3, |comm| {
                    zero3_rank_prefetching(comm, &config, 0..5, None, recompute, prefetch)
                })
            };
            let (plain, ahead) = (run(false), run(true));
            let what = format!("{precision:?} recompute {recompute}");
            for ((a, sent_a), (b, sent_b)) in ahead.iter().zip(&plain) {
                assert_eq!(a.0, b.0, "{what}: weights");
                assert_eq!(a.2, b.2, "{what}: AdamW's state");
                let bits = |o: &Outcome| -> Vec<(u64, bool)> {
                    o.1.iter().map(|r| (r.loss.to_bits(), r.skipped)).collect()
                };
                assert_eq!(bits(a), bits(b), "{what}: reports");
                assert_eq!(sent_a, sent_b, "{what}: bytes");
            }
            if overflow.is_some() {
                assert!(ahead[0].0.1[2].skipped);
            }
        }
    }
}

/// The output layer's gather runs while the hidden layer computes: the gate holds it until
/// the hidden layer's forward has run, which it could not if the gather ran first on the
/// rank's own thread.
#[test]
fn zero3_gathers_the_next_unit_while_a_unit_computes() {
    let config = config(Precision::Fp32, 4, None);
    let outcomes = world(2, |comm| {
        let gate = Gate::default();
        // The second all-gather of the step: the output layer's, prefetched.
        let gated = Gated {
            inner: comm,
            held: Held::AllGather(2),
            gate: gate.clone(),
            gathers: 0,
        };
        let ddp = DataParallel::new(Box::new(gated)).with_overlap(true);
        let (rank, n) = (ddp.rank(), ddp.world_size());
        let model = Mlp::<f32>::new(SEED);
        let units = vec![model.hidden.parameters(), model.out.parameters()];
        let adamw = AdamW::new(model.parameters(), LR).unwrap();
        let mut zero3 = Zero3::on(&ddp, units, &adamw).unwrap();
        let runner = zero3.runner();
        let loss = |model: &Mlp<f32>, (x, target): &Batch<f32>| {
            let hidden = runner.run_unit(0, || {
                gate.open();
                model.hidden.forward(x)
            });
            mse(
                &runner.run_unit(1, || model.out.forward(&hidden.tanh())),
                target,
            )
        };
        let batches: Vec<Batch<f32>> = config.micro_batches(0, n, rank);
        assert_eq!(batches.len(), 1);
        let report = zero3.train_step(&model, &batches, 8, loss, config.precision, None, None);
        (report.is_ok(), gate.timed_out())
    });
    for (ok, timed_out) in outcomes {
        assert!(
            ok && !timed_out,
            "the prefetch ran before the unit it overlaps"
        );
    }
}

#[test]
fn a_step_whose_passes_the_caller_runs_is_train_steps() {
    for (precision, overflow) in [(Precision::Fp32, None), (Precision::Fp16, Some((2, 1)))] {
        let config = config(precision, 2, overflow);
        let (stepped, stepped_sent): (Vec<_>, Vec<_>) =
            world(2, |comm| zero3_rank(comm, &config, 0..5, None, false))
                .into_iter()
                .unzip();
        let (scheduled, scheduled_sent): (Vec<_>, Vec<_>) =
            world(2, |comm| zero3_scheduled_rank(comm, &config, 0..5))
                .into_iter()
                .unzip();
        if overflow.is_some() {
            assert!(stepped[0].1[2].skipped, "the overflow skips step 2");
        }
        let what = format!("{precision:?}, scheduled by the caller");
        assert_matches(&scheduled, &stepped, None, &what);
        assert_eq!(scheduled[0].2, stepped[0].2, "{what}: the AdamW state");
        assert_eq!(scheduled_sent, stepped_sent, "{what}: bytes sent");
    }
}

/// A state saved at N = 2 is DDP's whole AdamW state bit for bit, and resumes at N = 4 as
/// DDP resumes from it.
#[test]
fn zero3_state_saved_at_two_ranks_resumes_at_four() {
    let config = config(Precision::Fp32, 4, None);
    let saved = world(2, |comm| zero3_rank(comm, &config, 0..2, None, false).0);
    let ddp = world(2, |comm| ddp_rank(comm, &config, 0..2, None));
    assert_matches(&saved, &ddp, None, "saved");
    assert_eq!(saved[0].2, ddp[0].2, "the whole AdamW state");
    assert_eq!(saved[1].2, saved[0].2, "on every rank");
    let start = (saved[0].0.clone(), saved[0].2.clone());
    let config = config_at(4);
    let resumed = world(4, |comm| {
        zero3_rank(comm, &config, 2..4, Some(&start), false).0
    });
    let ddp = world(4, |comm| ddp_rank(comm, &config, 2..4, Some(&start)));
    let largest = assert_matches(&resumed, &ddp, Some(1e-6), "resumed");
    println!("resumed at N = 4: largest weight difference {largest:e}");
    assert!(
        resumed[0]
            .2
            .params
            .iter()
            .all(|p| p.as_ref().unwrap().step == 4)
    );
}

fn config_at(n: usize) -> Config {
    config(Precision::Fp32, 8 / n, None)
}

/// Only this rank's shard stays: a world of one keeps every element, released values and
/// all; the units must be run through the runner.
#[test]
fn a_world_of_one_keeps_every_element_in_its_shard() {
    let model = Mlp::<f32>::new(SEED);
    let adamw = AdamW::new(model.parameters(), LR).unwrap();
    let units = vec![model.hidden.parameters(), model.out.parameters()];
    let mut zero3 = Zero3::new(Box::new(tl_collective::Single::new()), units, &adamw).unwrap();
    assert_eq!(zero3.shard_elements(), common::PARAMS);
    zero3.set_learning_rate(0.5);
    assert_eq!(zero3.learning_rate(), 0.5);
    // Whole values loaded, then gathered: the shard took them.
    let values: Vec<_> = model
        .parameters()
        .iter()
        .map(|p| tl_tensor::ndarray::ArrayD::from_elem(p.shape(), 0.25))
        .collect();
    zero3.load_full_parameters(&values);
    zero3.gather_full_parameters().unwrap();
    assert!(
        model
            .parameters()
            .iter()
            .all(|p| p.to_vec().iter().all(|&v| v == 0.25))
    );
    zero3.release_full_parameters();
    assert!(model.parameters().iter().all(Tensor::is_released));
    let x = Tensor::<f32>::ones(&[1, common::IN]);
    let y = {
        let _no_grad = tl_tensor::no_grad();
        forward(&zero3.runner(), &model, &x, false)
    };
    assert_eq!(y.shape(), vec![1, common::OUT]);
    assert!(model.parameters().iter().all(Tensor::is_released));
}

const WIDTH: usize = 64;
const DEPTH: usize = 8;

/// Eight 64×64 layers: 133,120 bytes of fp32 parameters, against 512-byte activations a
/// row, so the parameters weigh.
fn stack(rng_seed: u64) -> Vec<Linear<f32>> {
    let rng = tl_tensor::Generator::new(rng_seed);
    (0..DEPTH)
        .map(|_| Linear::new(WIDTH, WIDTH, true, &rng))
        .collect()
}

fn stack_batch(step: usize, rank: usize) -> Batch<f32> {
    let value = |i: usize| ((step * 31 + rank * 14 + i) as f32 * 0.3).sin();
    let x = Tensor::from_vec((0..2 * WIDTH).map(value).collect(), &[2, WIDTH]).unwrap();
    let t = Tensor::from_vec((0..2 * WIDTH).map(|i| value(i + 5)).collect(), &[2, WIDTH]);
    (x, t.unwrap())
}

/// The most live bytes (absolute) a rank's meter saw during steps 1 and 2 of 3, under
/// ZeRO-2 (`zero3 == false`) or ZeRO-3 with each layer a unit.
fn stack_peak(comm: RingComm, zero3: bool) -> usize {
    let (rank, n) = (comm.rank(), comm.world_size());
    let layers = stack(SEED);
    let adamw = AdamW::new(layers.iter().flat_map(Module::parameters).collect(), LR).unwrap();
    let mut peak = 0;
    let mut measure = |step: usize, run: &mut dyn FnMut(&[Batch<f32>])| {
        tl_tensor::memory::reset_peak();
        run(&[stack_batch(step, rank)]);
        if step > 0 {
            peak = peak.max(tl_tensor::memory::peak_bytes());
        }
    };
    let model = Mlp::<f32>::new(SEED); // only zero_grad is asked of it; a stand-in
    if zero3 {
        let units = layers.iter().map(Module::parameters).collect();
        let mut zero3 = Zero3::new(Box::new(comm), units, &adamw).unwrap();
        let runner = zero3.runner();
        let loss = |_: &Mlp<f32>, (x, target): &Batch<f32>| {
            let y = layers
                .iter()
                .enumerate()
                .fold(x.clone(), |h, (unit, layer)| {
                    runner.run_unit(unit, || layer.forward(&h)).tanh()
                });
            mse(&y, target)
        };
        for step in 0..3 {
            measure(step, &mut |batches| {
                zero3
                    .train_step(&model, batches, 2 * n, loss, Precision::Fp32, None, None)
                    .unwrap();
            });
        }
    } else {
        let mut ddp = DataParallel::new(Box::new(comm)).with_bucket_bytes(WIDTH * WIDTH);
        let mut opt = tl_parallel::Zero2AdamW::new(&mut ddp, adamw).unwrap();
        let loss = |_: &Mlp<f32>, (x, target): &Batch<f32>| {
            let y = layers.iter().fold(x.clone(), |h, l| l.forward(&h).tanh());
            mse(&y, target)
        };
        for step in 0..3 {
            measure(step, &mut |batches| {
                let report = ddp.train_step(
                    &model,
                    batches,
                    2 * n,
                    loss,
                    &mut opt,
                    Precision::Fp32,
                    None,
                    None,
                );
                report.unwrap();
            });
        }
    }
    peak
}

/// ZeRO-3's per-rank peak is below ZeRO-2's, by more than half the parameters' bytes:
/// ZeRO-2 holds all the parameters throughout, ZeRO-3 its shard and about one layer.
#[test]
fn zero3_lowers_the_per_rank_peak_below_zero2() {
    let parameter_bytes = DEPTH * (WIDTH * WIDTH + WIDTH) * 4;
    for n in [2, 4] {
        let zero2 = world(n, |comm| stack_peak(comm, false));
        let zero3 = world(n, |comm| stack_peak(comm, true));
        let (zero2, zero3) = (*zero2.iter().max().unwrap(), *zero3.iter().max().unwrap());
        println!("N = {n}: per-rank peak ZeRO-2 {zero2} bytes, ZeRO-3 {zero3} bytes");
        assert!(
            zero3 + parameter_bytes / 2 < zero2,
            "N = {n}: ZeRO-2 {zero2}, ZeRO-3 {zero3}"
        );
    }
}
