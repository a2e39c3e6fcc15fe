//! ZeRO on ranks that are threads of one process: each thread connects its own ring
//! communicator, so the memory meter, being thread-local, measures one rank.

mod common;

use std::time::Duration;

use common::{Batch, Config, Mlp, SEED, loss_fn, weights};
use tl_collective::{Communicator, RingComm, RingConfig};
use tl_parallel::{DataParallel, GradElement, ShardedAdamW};
use tl_precision::{Precision, StepReport};
use tl_tensor::optim::{AdamW, AdamWState, Optimizer};
use tl_tensor::{Element, Module};

/// A collective that makes no progress for this long fails, so a broken test cannot hang.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `rank_program` on `n` ranks, one thread each, and returns their results in rank
/// order.
fn world<T: Send>(n: usize, rank_program: impl Fn(RingComm) -> T + Sync) -> Vec<T> {
    let dir = tempfile::tempdir().expect("rendezvous directory");
    let secret = [n as u8; 32];
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (dir, rank_program) = (dir.path(), &rank_program);
                scope.spawn(move || {
                    let config = RingConfig::new(rank, n, dir, secret)
                        .unwrap()
                        .timeout(TIMEOUT);
                    rank_program(RingComm::connect(config).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn config(precision: Precision, global_rows: usize, micro_batch_rows: usize) -> Config {
    Config {
        precision,
        global_rows,
        micro_batch_rows,
        bucket_bytes: tl_parallel::DEFAULT_BUCKET_BYTES,
        overflow: None,
    }
}

/// Data-parallel steps `steps` of `model` with `opt`.
fn train<E: GradElement, O: Optimizer<E>>(
    ddp: &mut DataParallel,
    model: &Mlp<E>,
    opt: &mut O,
    config: &Config,
    steps: std::ops::Range<usize>,
    clip: Option<f64>,
) -> Vec<StepReport> {
    let (rank, world) = (ddp.rank(), ddp.world_size());
    let mut scaler = config.scaler();
    steps
        .map(|step| {
            let batches: Vec<Batch<E>> = config.micro_batches(step, world, rank);
            ddp.train_step(
                model,
                &batches,
                config.global_rows,
                loss_fn,
                opt,
                config.precision,
                scaler.as_mut(),
                clip,
            )
            .unwrap()
        })
        .collect()
}

fn set_weights<E: Element>(model: &Mlp<E>, values: &[f64]) {
    let mut offset = 0;
    for param in model.parameters() {
        let run = &values[offset..offset + param.numel()];
        param.update_value(|v| {
            v.iter_mut()
                .zip(run)
                .for_each(|(x, &r)| *x = E::from_f64(r))
        });
        offset += param.numel();
    }
}

/// What a rank of the resumed run ends with: (ZeRO-1's weights, DDP's weights).
fn resume(comm: Box<dyn Communicator>, start: &[f64], state: &AdamWState) -> (Vec<f64>, Vec<f64>) {
    let config = config(Precision::Fp32, 8, 2);
    let mut ddp = DataParallel::new(comm);
    let sharded = Mlp::<f32>::new(SEED);
    set_weights(&sharded, start);
    let mut opt = ShardedAdamW::new(&ddp, AdamW::new(sharded.parameters(), 1e-2).unwrap()).unwrap();
    opt.load_full_state(state).unwrap();
    train(&mut ddp, &sharded, &mut opt, &config, 2..3, None);
    let replica = Mlp::<f32>::new(SEED);
    set_weights(&replica, start);
    let mut adamw = AdamW::new(replica.parameters(), 1e-2).unwrap();
    adamw.load_state_dict(state.clone()).unwrap();
    train(&mut ddp, &replica, &mut adamw, &config, 2..3, None);
    (weights(&sharded), weights(&replica))
}

/// A ZeRO-1 state saved at N = 2 is the whole AdamW state DDP's optimizer has, and resumes
/// at N = 4 and at N = 1 exactly as DDP does from that state: the same weights, bit for bit.
#[test]
fn zero1_full_state_saved_at_two_ranks_resumes_at_four_and_at_one() {
    let config = config(Precision::Fp32, 8, 2);
    let saved = world(2, |comm| {
        let mut ddp = DataParallel::new(Box::new(comm));
        let sharded = Mlp::<f32>::new(SEED);
        let mut opt =
            ShardedAdamW::new(&ddp, AdamW::new(sharded.parameters(), 1e-2).unwrap()).unwrap();
        train(&mut ddp, &sharded, &mut opt, &config, 0..2, None);
        let full = opt.full_state().unwrap();
        let replica = Mlp::<f32>::new(SEED);
        let mut adamw = AdamW::new(replica.parameters(), 1e-2).unwrap();
        train(&mut ddp, &replica, &mut adamw, &config, 0..2, None);
        assert_eq!(weights(&sharded), weights(&replica));
        // Moments and step counts of every parameter, though each rank held only half.
        assert_eq!(full, adamw.state_dict());
        (weights(&sharded), full)
    });
    let (start, state) = &saved[0];
    assert_eq!(saved[1].1, *state, "every rank receives the whole state");
    assert!(
        state
            .params
            .iter()
            .all(|p| p.as_ref().is_some_and(|p| p.step == 2))
    );

    for (sharded, replica) in world(4, |comm| resume(Box::new(comm), start, state)) {
        assert_eq!(sharded, replica);
    }
    let (sharded, replica) = resume(Box::new(tl_collective::Single::new()), start, state);
    assert_eq!(sharded, replica);
}

/// A state for other parameters is refused and changes nothing.
#[test]
fn zero1_refuses_a_state_that_does_not_fit() {
    let ddp = DataParallel::new(Box::new(tl_collective::Single::new()));
    let model = Mlp::<f32>::new(SEED);
    let mut opt = ShardedAdamW::new(&ddp, AdamW::new(model.parameters(), 1e-2).unwrap()).unwrap();
    let mut state = opt.full_state().unwrap();
    state.shapes[0] = vec![3, 3];
    let error = opt.load_full_state(&state).unwrap_err();
    assert!(error.to_string().contains("shape"), "{error}");
}
