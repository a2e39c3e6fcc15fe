//! ZeRO's stages 1 to 3 against DDP: the same training, what each rank holds and sends, the
//! clip norm over the shards, and a state that resumes at another world size.

use tl_collective::{Communicator, Phantom, RingComm};
use tl_parallel::{DataParallel, ShardedAdamW, Zero2AdamW, Zero3};
use tl_precision::Precision;
use tl_tensor::losses::mse;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::{AdamW, Optimizer};
use tl_tensor::{Generator, Tensor, memory, meta_mode};

use crate::common::{
    Batch, Data, Mlp, PARAMS, Run, STAGES, Stage, assert_ranks_agree, loss_fn, max_relative, train,
    world,
};

/// The capstone's parameters (V = 256, d = 320, 8 blocks, hidden 896) as ZeRO-3's units:
/// the embedding, each block (two norms, four attention projections, three MLP matrices),
/// the final norm with the head. Meta tensors: shapes, no values.
fn capstone_units() -> Vec<Vec<Tensor<f32>>> {
    let (v, d, h) = (256, 320, 896);
    let mut units = vec![vec![Tensor::meta_param(&[v, d])]];
    for _ in 0..8 {
        let mut block = vec![Tensor::meta_param(&[d])];
        block.extend((0..4).map(|_| Tensor::meta_param(&[d, d])));
        block.push(Tensor::meta_param(&[d]));
        block.extend([[d, h], [d, h], [h, d]].map(|shape| Tensor::meta_param(&shape)));
        units.push(block);
    }
    units.push(vec![Tensor::meta_param(&[d]), Tensor::meta_param(&[d, v])]);
    units
}

/// A stand-in whose loss reaches every parameter: the sum of their squares.
struct Capstone {
    units: Vec<Vec<Tensor<f32>>>,
}

impl Module<f32> for Capstone {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x.clone()
    }
    fn parameters(&self) -> Vec<Tensor<f32>> {
        self.units.concat()
    }
}

fn squares(params: &[Tensor<f32>]) -> Tensor<f32> {
    (params.iter().map(|p| p.powi(2).sum_all()))
        .reduce(|sum, s| sum + s)
        .expect("a parameter")
}

/// Rank 0 of 4 of `stage`'s step on the capstone's shapes, micro-batch 4, accum 1, f32,
/// over a phantom ring: (bytes sent, elements of weights, gradients and moments it holds).
fn capstone_rank0(stage: Stage) -> (u64, usize) {
    let _meta = meta_mode();
    let model = Capstone {
        units: capstone_units(),
    };
    let p = model.parameters().iter().map(Tensor::numel).sum::<usize>();
    let adamw = AdamW::new(model.parameters(), 1e-3).unwrap();
    let comm = Box::new(Phantom::new(0, 4).unwrap());
    let batch = [Tensor::<f32>::meta(&[4, 1])];
    let loss = |m: &Capstone, _: &Tensor<f32>| squares(&m.parameters());
    if stage == Stage::Zero3 {
        let mut zero3 = Zero3::new(comm, model.units.clone(), &adamw).unwrap();
        let runner = zero3.runner();
        let units = model.units.clone();
        let loss = |_: &Capstone, _: &Tensor<f32>| {
            (0..units.len())
                .map(|u| runner.run_unit(u, || squares(&units[u])))
                .reduce(|sum, s| sum + s)
                .unwrap()
        };
        let before = zero3.stats().bytes_sent;
        zero3
            .train_step(&model, &batch, 16, loss, Precision::Fp32, None, None)
            .unwrap();
        let shard = zero3.shard_elements();
        return (zero3.stats().bytes_sent - before, 4 * shard);
    }
    let mut ddp = DataParallel::new(comm);
    let (mut opt, state): (Box<dyn Optimizer<f32>>, usize) = match stage {
        Stage::Ddp => (Box::new(adamw), 4 * p),
        Stage::Zero1 => {
            let opt = ShardedAdamW::new(&ddp, adamw).unwrap();
            let shard = opt.shard().len();
            (Box::new(opt), 2 * p + 2 * shard)
        }
        _ => {
            let opt = Zero2AdamW::new(&mut ddp, adamw).unwrap();
            let shard = opt.shard_elements();
            (Box::new(opt), p + 3 * shard)
        }
    };
    let before = ddp.stats().bytes_sent;
    ddp.train_step(
        &model,
        &batch,
        16,
        loss,
        opt.as_mut(),
        Precision::Fp32,
        None,
        None,
    )
    .unwrap();
    (ddp.stats().bytes_sent - before, state)
}

fn mib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / f64::from(1 << 20))
}

/// The chapter's worked example: the capstone at N = 4, what `tinyllm plan --preset
/// capstone --micro-batch 4 --accum 1 --ranks 4 --zero 0,1,2,3` prints in its "f32 16P"
/// and "sent/step" columns, from the stages' own step on the capstone's shapes.
#[test]
fn test_hand_example_capstone_at_four_ranks() {
    let p: u64 = capstone_units()
        .iter()
        .flatten()
        .map(|t| t.numel() as u64)
        .sum();
    assert_eq!(p, 10_327_360);
    // 4P = 39.40 MiB of weights, as many of gradients, 8P = 78.79 MiB of moments.
    assert_eq!((mib(4 * p), mib(8 * p)), ("39.40".into(), "78.79".into()));
    // ZeRO-1's optimizer: moments 8P/4 and the master shard 4P/4, 29.55 MiB.
    assert_eq!(
        (mib(8 * p / 4), mib(4 * p / 4), mib(12 * p / 4)),
        ("19.70".into(), "9.85".into(), "29.55".into())
    );
    let figures: Vec<(String, String)> = STAGES
        .iter()
        .map(|&stage| {
            let (sent, state) = capstone_rank0(stage);
            (mib(4 * state as u64), mib(sent))
        })
        .collect();
    let expected = [
        ("157.58", "59.09"),
        ("98.49", "88.64"),
        ("68.94", "59.09"),
        ("39.40", "88.64"),
    ];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|&(s, b)| (s.into(), b.into()))
        .collect();
    assert_eq!(
        figures, expected,
        "(f32 16P, sent a step) in MiB, ZeRO-0 to 3"
    );
}

#[test]
fn test_zero_stages_equal_ddp() {
    // One micro-batch per rank: ZeRO-1 and ZeRO-2 are DDP bit for bit at N = 2 and 4 (their
    // shards add the numbers DDP's ring adds, in its order; AdamW is elementwise), and so
    // is ZeRO-3 at N = 2 (each element's sum is one addition).
    for n in [2, 4] {
        let data = Data::fp32(4 * n, 4);
        let ddp = train(Run::new(Stage::Ddp, n, data));
        for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            if stage == Stage::Zero3 && n > 2 {
                continue;
            }
            let outcomes = train(Run::new(stage, n, data));
            assert_ranks_agree(&outcomes, &format!("{stage:?}"));
            for (rank, (got, want)) in outcomes.iter().zip(&ddp).enumerate() {
                assert_eq!(got.weights, want.weights, "{stage:?}, N = {n}, rank {rank}");
            }
        }
    }
    // Accumulation and unequal shares (11 rows over 3 ranks, micro-batches of 2): equal to
    // rounding.
    let data = Data::fp32(11, 2);
    let ddp = train(Run::new(Stage::Ddp, 3, data));
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let outcomes = train(Run::new(stage, 3, data));
        assert_ranks_agree(&outcomes, &format!("{stage:?}"));
        let relative = max_relative(&outcomes[0].weights, &ddp[0].weights);
        assert!(relative < 1e-6, "{stage:?}: weights differ by {relative:e}");
    }
}

/// A clip bound the gradients exceed: under ZeRO-2 and 3 each rank holds a shard of them,
/// and the norm they are clipped by is the whole gradient's, DDP's, the same on every rank.
#[test]
fn test_clip_norm_is_global() {
    let data = Data::fp32(8, 2); // 4 rows a rank, two micro-batches
    let clip = Some(0.05);
    let ddp = train(Run {
        clip,
        ..Run::new(Stage::Ddp, 2, data)
    });
    for stage in [Stage::Zero2, Stage::Zero3] {
        let outcomes = train(Run {
            clip,
            ..Run::new(stage, 2, data)
        });
        assert_ranks_agree(&outcomes, &format!("{stage:?}"));
        for (rank, outcome) in outcomes.iter().enumerate() {
            for (step, (got, want)) in outcome.reports.iter().zip(&ddp[0].reports).enumerate() {
                let (g, w) = (got.grad_norm.unwrap(), want.grad_norm.unwrap());
                assert!(w > 0.05, "the clip binds: step {step}'s norm is {w}");
                assert!(
                    (g - w).abs() <= 1e-6 * w,
                    "{stage:?}, rank {rank}, step {step}: norm {g}, DDP's {w}"
                );
            }
            let relative = max_relative(&outcome.weights, &ddp[0].weights);
            assert!(relative < 1e-6, "{stage:?}: weights differ by {relative:e}");
        }
    }
}

/// ZeRO-2 ends the backward holding only its shard of the gradients: no parameter of the
/// model keeps a full gradient (each is dropped once its bucket is copied), and the shard
/// is a quarter of them at N = 4.
#[test]
fn test_zero2_keeps_only_its_gradient_shard() {
    let data = Data::fp32(8, 1); // two micro-batches a rank
    let shards = world(4, |comm: RingComm| {
        let (rank, n) = (comm.rank(), comm.world_size());
        let mut ddp = DataParallel::new(Box::new(comm)).with_bucket_bytes(64);
        let model = Mlp::new();
        let adamw = AdamW::new(model.parameters(), 1e-2).unwrap();
        let mut opt = Zero2AdamW::new(&mut ddp, adamw).unwrap();
        for step in 0..2 {
            let batches = data.micro_batches(step, n, rank);
            ddp.train_step(
                &model,
                &batches,
                8,
                loss_fn,
                &mut opt,
                Precision::Fp32,
                None,
                None,
            )
            .unwrap();
            let full: Vec<bool> = model
                .parameters()
                .iter()
                .map(|p| p.grad().is_some())
                .collect();
            assert!(
                full.iter().all(|f| !f),
                "rank {rank}, step {step}: full gradients kept {full:?}"
            );
        }
        opt.shard_elements()
    });
    // 58 parameters and 3 extras in 4 buckets of 16 (the last 10 + 3): a quarter each,
    // within one element a bucket.
    assert_eq!(shards.iter().sum::<usize>(), PARAMS);
    assert!(
        shards
            .iter()
            .all(|&s| (PARAMS / 4 - 3..=PARAMS / 4 + 4).contains(&s)),
        "{shards:?}"
    );
}

const WIDTH: usize = 64;
const DEPTH: usize = 8;

/// Eight 64×64 layers on two rows a rank: the parameters and their state dominate.
fn stack() -> Vec<Linear<f32>> {
    let rng = Generator::new(3);
    (0..DEPTH)
        .map(|_| Linear::new(WIDTH, WIDTH, true, &rng))
        .collect()
}

fn stack_batch(step: usize, rank: usize) -> Batch {
    let value = |i: usize| ((step * 31 + rank * 14 + i) as f32 * 0.3).sin();
    let x = Tensor::from_vec((0..2 * WIDTH).map(value).collect(), &[2, WIDTH]).unwrap();
    let t = Tensor::from_vec((0..2 * WIDTH).map(|i| value(i + 5)).collect(), &[2, WIDTH]);
    (x, t.unwrap())
}

struct Stack(Vec<Linear<f32>>);

impl Module<f32> for Stack {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        self.0.iter().fold(x.clone(), |h, l| l.forward(&h).tanh())
    }
    fn parameters(&self) -> Vec<Tensor<f32>> {
        self.0.iter().flat_map(Module::parameters).collect()
    }
}

/// The most bytes rank `comm.rank()`'s meter held during steps 1 and 2 of 3 of `stage` on
/// the stack, with buckets of a quarter of a layer.
fn stack_peak(comm: RingComm, stage: Stage) -> usize {
    let (rank, n) = (comm.rank(), comm.world_size());
    let model = Stack(stack());
    let adamw = AdamW::new(model.parameters(), 1e-3).unwrap();
    let mut ddp = DataParallel::new(Box::new(comm)).with_bucket_bytes(WIDTH * WIDTH);
    let mut zero3 = (stage == Stage::Zero3).then(|| {
        let units = model.0.iter().map(Module::parameters).collect();
        Zero3::on(&ddp, units, &adamw).unwrap()
    });
    let mut opt: Option<Box<dyn Optimizer<f32>>> = match stage {
        Stage::Ddp => Some(Box::new(adamw)),
        Stage::Zero1 => Some(Box::new(ShardedAdamW::new(&ddp, adamw).unwrap())),
        Stage::Zero2 => Some(Box::new(Zero2AdamW::new(&mut ddp, adamw).unwrap())),
        Stage::Zero3 => None,
    };
    let mut peak = 0;
    for step in 0..3 {
        let batches = [stack_batch(step, rank)];
        memory::reset_peak();
        let global = 2 * n;
        match (&mut zero3, &mut opt) {
            (Some(zero3), _) => {
                let runner = zero3.runner();
                let loss = |m: &Stack, (x, t): &Batch| {
                    let y = (m.0.iter().enumerate()).fold(x.clone(), |h, (u, l)| {
                        runner.run_unit(u, || l.forward(&h)).tanh()
                    });
                    mse(&y, t)
                };
                zero3.train_step(&model, &batches, global, loss, Precision::Fp32, None, None)
            }
            (None, Some(opt)) => {
                let loss = |m: &Stack, (x, t): &Batch| mse(&m.forward(x), t);
                ddp.train_step(
                    &model,
                    &batches,
                    global,
                    loss,
                    opt.as_mut(),
                    Precision::Fp32,
                    None,
                    None,
                )
            }
            (None, None) => unreachable!(),
        }
        .unwrap();
        if step > 0 {
            peak = peak.max(memory::peak_bytes());
        }
    }
    peak
}

/// Each stage holds less than the one before, on every rank: the model state per rank
/// falls as the stages shard the moments, then the gradients, then the weights, and so do
/// the per-rank peaks of a model whose state outweighs its activations.
#[test]
fn test_state_per_rank_falls_stage_by_stage() {
    let data = Data::fp32(8, 2);
    let state: Vec<usize> = STAGES
        .iter()
        .map(|&stage| {
            let outcomes = train(Run::new(stage, 4, data));
            outcomes.iter().map(|o| o.state).max().unwrap()
        })
        .collect();
    // 4P; 2P + 2P/4; P + 3P/4; 4P/4, to a few elements (the shards' remainders and ZeRO-2's
    // extras slots).
    assert_eq!(state[0], 4 * PARAMS);
    for (got, want) in state.iter().zip([
        4 * PARAMS,
        2 * PARAMS + PARAMS / 2,
        PARAMS + 3 * PARAMS / 4,
        PARAMS,
    ]) {
        assert!(got.abs_diff(want) <= 12, "state per rank {state:?}");
    }
    let peaks: Vec<usize> = STAGES
        .iter()
        .map(|&stage| {
            *world(2, |comm| stack_peak(comm, stage))
                .iter()
                .max()
                .unwrap()
        })
        .collect();
    for pair in peaks.windows(2) {
        assert!(pair[1] < pair[0], "per-rank peaks, ZeRO-0 to 3: {peaks:?}");
    }
}

/// ZeRO-2's whole AdamW state, saved at N = 2, resumes at N = 4: two more steps there end
/// where two more steps at N = 2 end, to rounding (the rings add in other orders).
#[test]
fn test_state_saved_at_two_resumes_at_four() {
    let data = Data::fp32(8, 2);
    let run = |comm: RingComm,
               from: Option<&(Vec<f32>, tl_tensor::optim::AdamWState)>,
               steps: std::ops::Range<usize>| {
        let (rank, n) = (comm.rank(), comm.world_size());
        let mut ddp = DataParallel::new(Box::new(comm)).with_bucket_bytes(64);
        let model = Mlp::new();
        if let Some((weights, _)) = from {
            let mut offset = 0;
            for p in model.parameters() {
                let run = &weights[offset..offset + p.numel()];
                p.update_value(|v| v.iter_mut().zip(run).for_each(|(x, &r)| *x = r));
                offset += p.numel();
            }
        }
        let adamw = AdamW::new(model.parameters(), 1e-2).unwrap();
        let mut opt = Zero2AdamW::new(&mut ddp, adamw).unwrap();
        if let Some((_, state)) = from {
            opt.load_full_state(state).unwrap();
        }
        for step in steps {
            let batches = data.micro_batches(step, n, rank);
            ddp.train_step(
                &model,
                &batches,
                8,
                loss_fn,
                &mut opt,
                Precision::Fp32,
                None,
                None,
            )
            .unwrap();
        }
        (model.weights(), opt.full_state().unwrap())
    };
    let saved = world(2, |comm| run(comm, None, 0..2));
    assert_eq!(saved[0].1, saved[1].1, "every rank has the whole state");
    let at_two = world(2, |comm| run(comm, Some(&saved[0]), 2..4));
    let at_four = world(4, |comm| run(comm, Some(&saved[0]), 2..4));
    for (rank, (weights, _)) in at_four.iter().enumerate() {
        let relative = max_relative(weights, &at_two[0].0);
        assert!(
            relative < 1e-6,
            "rank {rank} at N = 4 differs by {relative:e}"
        );
    }
}
