//! DDP's reduction overlapped with backward, seen from inside backward: a spy communicator
//! counts the collectives done, and a hook at the very end of the last micro-batch's
//! backward (its input's gradient, the last thing backward computes) reads the count.
//! That the sums are the bits of the reduction after backward is tested with ZeRO's
//! (`zero.rs`: `overlap_gives_the_bits_of_the_reduction_after_backward`).

mod common;

use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{Batch, Config, Gate, Gated, Held, Mlp, SEED, SeenStats, Spy, loss_fn, world};
use tl_collective::Communicator;
use tl_parallel::{DataParallel, Zero2AdamW};
use tl_precision::Precision;
use tl_tensor::Module;
use tl_tensor::optim::{AdamW, Optimizer};

/// How long the hook waits for a collective before it concludes none was started.
const PATIENCE: Duration = Duration::from_secs(10);

/// For each step: collectives done when backward reached the last micro-batch's input,
/// and in the whole step. `wait` makes the hook wait (up to [`PATIENCE`]) for one.
fn collectives_inside_backward(overlap: bool, zero2: bool, wait: bool) -> Vec<Vec<(u64, u64)>> {
    // 16 f32 a bucket: the output layer's 18 parameters fill the first bucket, which is
    // complete before backward enters the hidden layer.
    let config = Config {
        precision: Precision::Fp32,
        global_rows: 16,
        micro_batch_rows: 4,
        bucket_bytes: 64,
        overflow: None,
    };
    world(2, |comm| {
        let stats = SeenStats::new(comm.stats());
        let spy = Spy {
            inner: comm,
            stats: stats.clone(),
        };
        let mut ddp = DataParallel::new(Box::new(spy))
            .with_bucket_bytes(config.bucket_bytes)
            .with_overlap(overlap);
        let model = Mlp::<f32>::new(SEED);
        let adamw = AdamW::new(model.parameters(), 1e-2).unwrap();
        let mut opt: Box<dyn Optimizer<f32>> = match zero2 {
            true => Box::new(Zero2AdamW::new(&mut ddp, adamw).unwrap()),
            false => Box::new(adamw),
        };
        let (rank, world) = (ddp.rank(), ddp.world_size());
        (0..3)
            .map(|step| {
                let batches = config.micro_batches::<f32>(step, world, rank);
                let start = stats.get().collectives;
                let seen = Rc::new(Cell::new(None));
                let last = batches.len() - 1;
                let mut forwards = 0;
                let watched_loss = |m: &Mlp<f32>, b: &Batch<f32>| {
                    if forwards == last {
                        let (x, _) = b;
                        x.set_requires_grad(true);
                        let (stats, seen) = (stats.clone(), Rc::clone(&seen));
                        x.set_grad_ready_hook(Some(Rc::new(move || {
                            let begun = Instant::now();
                            let done = || stats.get().collectives - start;
                            while wait && done() == 0 && begun.elapsed() < PATIENCE {
                                std::thread::sleep(Duration::from_millis(1));
                            }
                            seen.set(Some(done()));
                        })));
                    }
                    forwards += 1;
                    loss_fn(m, b)
                };
                ddp.train_step(
                    &model,
                    &batches,
                    config.global_rows,
                    watched_loss,
                    opt.as_mut(),
                    config.precision,
                    None,
                    None,
                )
                .unwrap();
                let inside = seen.get().expect("backward reached the input");
                (inside, stats.get().collectives - start)
            })
            .collect()
    })
}

/// With overlap, the first bucket's all-reduce is done (on both ranks) before backward has
/// reached the input of the last micro-batch; the hook waits for it, and without overlap it
/// would wait in vain (checked below). Every step makes the same collectives either way:
/// 4 buckets for the MLP's 58 parameters.
#[test]
fn ddp_buckets_are_reduced_while_backward_goes_on() {
    for rank in collectives_inside_backward(true, false, true) {
        for (inside, step) in rank {
            assert!(inside >= 1, "no collective inside backward: {inside}");
            assert_eq!(step, 4);
        }
    }
    for rank in collectives_inside_backward(false, false, false) {
        for (inside, step) in rank {
            assert_eq!(inside, 0, "without overlap DDP reduces after backward");
            assert_eq!(step, 4);
        }
    }
}

/// ZeRO-2 reduce-scatters each bucket during backward with or without overlap (to free the
/// gradients); with overlap the calls run on the communication thread. The step's
/// collectives: 4 reduce-scatters, the extras' all-reduce, 4 all-gathers.
#[test]
fn zero2_buckets_are_reduced_while_backward_goes_on() {
    for overlap in [false, true] {
        for rank in collectives_inside_backward(overlap, true, true) {
            for (inside, step) in rank {
                assert!(inside >= 1, "overlap {overlap}: {inside}");
                assert_eq!(step, 9, "overlap {overlap}");
            }
        }
    }
}

/// The all-reduces run concurrently with backward, not inside it: the gate holds the first
/// one until the rank's backward has reached the last micro-batch's input. Were the
/// collective run on the rank's own thread, backward would wait for it and it for
/// backward, until the gate gave up.
#[test]
fn the_reduction_runs_on_its_own_thread_while_backward_computes() {
    let config = Config {
        precision: Precision::Fp32,
        global_rows: 8,
        micro_batch_rows: 4,
        bucket_bytes: 64,
        overflow: None,
    };
    let outcomes = world(2, |comm| {
        let gate = Gate::default();
        let gated = Gated {
            inner: comm,
            held: Held::AllReduces,
            gate: gate.clone(),
            gathers: 0,
        };
        let mut ddp = DataParallel::new(Box::new(gated))
            .with_bucket_bytes(config.bucket_bytes)
            .with_overlap(true);
        let model = Mlp::<f32>::new(SEED);
        let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
        let (rank, world) = (ddp.rank(), ddp.world_size());
        let batches = config.micro_batches::<f32>(0, world, rank);
        assert_eq!(batches.len(), 1, "the gate opens in the last backward only");
        let opening_loss = |m: &Mlp<f32>, b: &Batch<f32>| {
            let (x, _) = b;
            x.set_requires_grad(true);
            let gate = gate.clone();
            x.set_grad_ready_hook(Some(Rc::new(move || gate.open())));
            loss_fn(m, b)
        };
        let report = ddp.train_step(
            &model,
            &batches,
            config.global_rows,
            opening_loss,
            &mut opt,
            config.precision,
            None,
            None,
        );
        (
            report.is_ok(),
            gate.timed_out(),
            ddp.overlapped_communication_time(),
        )
    });
    for (ok, timed_out, overlapped) in outcomes {
        assert!(
            ok && !timed_out,
            "the all-reduce waited for the backward it overlaps"
        );
        assert!(overlapped > Duration::ZERO);
    }
}
