//! DDP on real processes over the ring, against one process training on the same global
//! batch: every rank trains 5 AdamW steps of a two-layer MLP on its share and, in the same
//! process, the single-process reference on the whole batch, and reports how far apart they
//! ended. The test binary re-runs itself as the ranks (see `support`).

mod common;
#[path = "../../tl-collective/tests/support/mod.rs"]
mod support;

use std::time::Duration;

use common::{Batch, Config, Mlp, PARAMS, SEED, STEPS, SeenStats, Spy, loss_fn, result, weights};
use support::{SCENARIO, assert_all_succeeded, hash_bits, run_world};
use tl_collective::{Communicator, RingComm, RingConfig, shard_range};
use tl_parallel::{DataParallel, GradElement, ParallelError, ShardedAdamW};
use tl_precision::{Precision, StepReport, train_step_mixed};
use tl_tensor::Module;
use tl_tensor::optim::{AdamW, Optimizer};

const DEADLINE: Duration = Duration::from_secs(60);
/// Every run clips, so a clip norm that is not global would show.
const CLIP: Option<f64> = Some(0.5);

fn report_bits(reports: &[StepReport]) -> u64 {
    hash_bits(reports.iter().flat_map(|r| {
        [
            r.loss.to_bits(),
            u64::from(r.skipped),
            r.scale.unwrap_or(0.0).to_bits(),
            r.grad_norm.unwrap_or(0.0).to_bits(),
        ]
    }))
}

/// What one DDP training of `STEPS` steps gave.
struct Run {
    reports: Vec<StepReport>,
    /// Collectives seen from inside the loss function, past each step's start.
    mid_step: u64,
    /// The most collectives one step made.
    per_step: u64,
}

/// `STEPS` data-parallel steps of `model` with `opt`, counting the collectives from inside
/// the loss function through `stats`.
fn train<E: GradElement, O: Optimizer<E>>(
    ddp: &mut DataParallel,
    model: &Mlp<E>,
    opt: &mut O,
    config: &Config,
    stats: &SeenStats,
) -> Run {
    let (rank, world) = (ddp.rank(), ddp.world_size());
    let mut scaler = config.scaler();
    let (mut mid_step, mut per_step) = (0, 0);
    let reports = (0..STEPS)
        .map(|step| {
            let batches = config.micro_batches::<E>(step, world, rank);
            let start = stats.get().collectives;
            let counting_loss = |m: &Mlp<E>, b: &Batch<E>| {
                // Every forward after the first follows a backward: neither may communicate.
                mid_step += stats.get().collectives - start;
                loss_fn(m, b)
            };
            let report = ddp
                .train_step(
                    model,
                    &batches,
                    config.global_rows,
                    counting_loss,
                    opt,
                    config.precision,
                    scaler.as_mut(),
                    CLIP,
                )
                .unwrap();
            per_step = per_step.max(ddp.stats().collectives - start);
            report
        })
        .collect();
    Run {
        reports,
        mid_step,
        per_step,
    }
}

/// The rank program of the `train` scenario: the reference, then DDP, then the comparison.
fn scenario_train<E: GradElement>(comm: RingComm) {
    let config = Config::from_env();
    let rank = comm.rank();

    let reference = Mlp::<E>::new(SEED);
    let mut opt = AdamW::new(reference.parameters(), 1e-2).unwrap();
    let mut scaler = config.scaler();
    let expected: Vec<StepReport> = (0..STEPS)
        .map(|step| {
            let batches = config.micro_batches::<E>(step, 1, 0);
            train_step_mixed(
                &reference,
                &batches,
                loss_fn,
                &mut opt,
                config.precision,
                scaler.as_mut(),
                CLIP,
            )
            .unwrap()
        })
        .collect();

    let stats = SeenStats::new(comm.stats());
    let spy = Spy {
        inner: comm,
        stats: stats.clone(),
    };
    let mut ddp = DataParallel::new(Box::new(spy)).with_bucket_bytes(config.bucket_bytes);
    // Different initial weights on every rank: the broadcast must make them rank 0's.
    let model = Mlp::<E>::new(SEED + rank as u64);
    ddp.broadcast_parameters(&model.parameters()).unwrap();
    let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
    let run = train(&mut ddp, &model, &mut opt, &config, &stats);
    let (reports, mid_step, per_step) = (run.reports, run.mid_step, run.per_step);

    if std::env::var("TL_ZERO").is_ok() {
        // ZeRO-1 on a third replica from the same start, through the same communicator.
        let sharded = Mlp::<E>::new(SEED + rank as u64);
        ddp.broadcast_parameters(&sharded.parameters()).unwrap();
        let adamw = AdamW::new(sharded.parameters(), 1e-2).unwrap();
        let mut opt = ShardedAdamW::new(&ddp, adamw).unwrap();
        let zero = train(&mut ddp, &sharded, &mut opt, &config, &stats);
        let same = weights(&sharded) == weights(&model);
        result(format_args!("zero1_weights_equal_ddp={same}"));
        let same = report_bits(&zero.reports) == report_bits(&reports);
        result(format_args!("zero1_reports_equal_ddp={same}"));
        result(format_args!("zero1_mid_step_collectives={}", zero.mid_step));
        result(format_args!("zero1_collectives_per_step={}", zero.per_step));
        result(format_args!("zero1_shard={}", opt.shard().len()));
        result(format_args!(
            "zero1_state_elements={}",
            opt.state_elements()
        ));
    }

    let (got, want) = (weights(&model), weights(&reference));
    let max_weight_diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let max_loss_rel = reports
        .iter()
        .zip(&expected)
        .map(|(r, e)| {
            if r.loss.is_finite() || e.loss.is_finite() {
                ((r.loss - e.loss) / e.loss).abs()
            } else {
                0.0
            }
        })
        .fold(0.0, f64::max);
    let decisions = |rs: &[StepReport]| rs.iter().map(|r| (r.skipped, r.scale)).collect::<Vec<_>>();
    let skipped: Vec<String> = reports
        .iter()
        .enumerate()
        .filter(|(_, r)| r.skipped)
        .map(|(i, _)| i.to_string())
        .collect();
    let capacity = (config.bucket_bytes / size_of::<E>()).max(1);
    result(format_args!("max_weight_diff={max_weight_diff:e}"));
    result(format_args!("weights_bits_equal={}", got == want));
    result(format_args!("max_loss_rel={max_loss_rel:e}"));
    result(format_args!(
        "decisions_equal={}",
        decisions(&reports) == decisions(&expected)
    ));
    result(format_args!("skipped={}", skipped.join(",")));
    result(format_args!("report_hash={}", report_bits(&reports)));
    result(format_args!(
        "weights_hash={}",
        hash_bits(got.iter().map(|w| w.to_bits()))
    ));
    result(format_args!("mid_step_collectives={mid_step}"));
    result(format_args!("collectives_per_step={per_step}"));
    result(format_args!("buckets={}", PARAMS.div_ceil(capacity)));
}

/// The rank program of `peer_exits`: the last rank leaves after the broadcast; the others'
/// step must fail with the collective's error and leave the weights alone.
fn scenario_peer_exits(comm: RingComm) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let config = Config::from_env();
    let mut ddp = DataParallel::new(Box::new(comm))
        .with_bucket_bytes(config.bucket_bytes)
        .with_overlap(std::env::var_os("TL_OVERLAP").is_some());
    let model = Mlp::<f32>::new(SEED);
    ddp.broadcast_parameters(&model.parameters()).unwrap();
    if rank + 1 == world {
        std::process::exit(0);
    }
    let before = weights(&model);
    let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
    let batches = config.micro_batches::<f32>(0, world, rank);
    let outcome = ddp.train_step(
        &model,
        &batches,
        config.global_rows,
        loss_fn,
        &mut opt,
        Precision::Fp32,
        None,
        None,
    );
    let error = outcome.expect_err("a step without its peer");
    assert!(matches!(error, ParallelError::Collective { .. }), "{error}");
    result(format_args!("error={error}"));
    result(format_args!("unchanged={}", weights(&model) == before));
    result(format_args!("error_taken={}", ddp.take_error().is_none()));
}

/// The rank program: does nothing in a normal test run.
#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let config = RingConfig::from_env()
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("a ring environment");
    let comm = RingComm::connect(config).unwrap_or_else(|e| panic!("{e}"));
    match (scenario.as_str(), std::env::var("TL_ELEMENT").as_deref()) {
        ("train", Ok("f64")) => scenario_train::<f64>(comm),
        ("train", _) => scenario_train::<f32>(comm),
        ("peer_exits", _) => scenario_peer_exits(comm),
        (other, _) => panic!("unknown scenario {other}"),
    }
}

/// A world's results, checked the same on every rank: identical reports and weights on
/// every rank, no collective before the last backward, one collective per bucket.
fn train_world(n: usize, env: &[(&str, &str)]) -> Vec<support::RankRun> {
    let env: Vec<(&str, String)> = env.iter().map(|(k, v)| (*k, v.to_string())).collect();
    let runs = run_world(n, "train", &env, DEADLINE);
    assert_all_succeeded(&runs);
    for key in ["report_hash", "weights_hash", "skipped"] {
        let first = runs[0].get(key);
        assert!(
            runs.iter().all(|r| r.get(key) == first),
            "{key} differs between ranks: {runs:?}"
        );
    }
    for run in &runs {
        assert_eq!(run.get("mid_step_collectives"), Some("0"));
        assert_eq!(run.get("collectives_per_step"), run.get("buckets"));
        assert_eq!(run.get("decisions_equal"), Some("true"), "{run:?}");
        let loss_rel: f64 = run.get("max_loss_rel").unwrap().parse().unwrap();
        assert!(loss_rel <= 1e-6, "loss relative difference {loss_rel}");
    }
    eprintln!(
        "N = {n} {env:?}: largest weight difference {}, loss {}",
        runs[0].get("max_weight_diff").unwrap(),
        runs[0].get("max_loss_rel").unwrap()
    );
    runs
}

fn max_weight_diff(runs: &[support::RankRun]) -> f64 {
    runs[0].get("max_weight_diff").unwrap().parse().unwrap()
}

fn assert_bit_exact(runs: &[support::RankRun]) {
    assert_eq!(runs[0].get("weights_bits_equal"), Some("true"), "{runs:?}");
}

/// N = 2, one micro-batch of 4 rows per rank. One process weights its two micro-batches by
/// 4/8 = 1/2 and adds them: g = 0 + ½·g0 + ½·g1. A rank's step weights its one micro-batch
/// by 4/4 = 1, then DDP by its share 4/8 = ½; multiplying by a power of two is exact (no
/// subnormals here), and every op of backward is linear in its incoming gradient, so the
/// rank holds ½·g_r bit for bit. The ring at N = 2 adds the two in one addition, which is
/// commutative: the same sum, the same bits, hence the same AdamW updates.
#[test]
fn two_ranks_one_micro_batch_each_equal_one_process_bit_for_bit() {
    assert_bit_exact(&train_world(2, &[]));
    assert_bit_exact(&train_world(2, &[("TL_ELEMENT", "f64")]));
    assert_bit_exact(&train_world(2, &[("TL_PRECISION", "bf16")]));
}

/// Small buckets split parameters across buckets (here 16 f32 elements each, 4 buckets for
/// the 58 parameters); sums are elementwise, so at N = 2 the bits are still one process's.
#[test]
fn buckets_smaller_than_a_parameter_change_nothing_but_the_number_of_collectives() {
    let runs = train_world(2, &[("TL_BUCKET_BYTES", "64")]);
    assert_eq!(runs[0].get("buckets"), Some("4"));
    assert_bit_exact(&runs);
}

/// With accumulation (two micro-batches per rank at N = 2, and N = 4), the ring adds the
/// ranks' partial sums in another order than one process's running sum, so the weights agree
/// to rounding only.
#[test]
fn ranks_with_accumulation_match_one_process_to_rounding() {
    for (n, env) in [
        (2, [("TL_GLOBAL_ROWS", "16"), ("TL_MICRO", "4")]),
        (4, [("TL_GLOBAL_ROWS", "16"), ("TL_MICRO", "2")]),
        (4, [("TL_GLOBAL_ROWS", "8"), ("TL_MICRO", "2")]),
    ] {
        for precision in ["fp32", "bf16"] {
            let mut env = env.to_vec();
            env.push(("TL_PRECISION", precision));
            let runs = train_world(n, &env);
            let tolerance = 1e-6; // measured: at most 3e-8 in both precisions
            assert!(
                max_weight_diff(&runs) <= tolerance,
                "{precision}: {}",
                max_weight_diff(&runs)
            );
        }
    }
}

/// 5 rows over 2 ranks in micro-batches of at most 2: rank 0 trains rows 0..2 and 2..3
/// (weight 3/5), rank 1 rows 3..5 (weight 2/5); one process 0..2, 2..4, 4..5. Both are the
/// gradient of the mean over the 5 rows: Σ_r (n_r/5)·Σ_i (n_i/n_r)·∇L_i = Σ_i (n_i/5)·∇L_i.
#[test]
fn unequal_shares_give_the_global_batch_gradient() {
    let runs = train_world(2, &[("TL_GLOBAL_ROWS", "5"), ("TL_MICRO", "2")]);
    assert!(max_weight_diff(&runs) <= 1e-6, "{}", max_weight_diff(&runs));
}

/// fp16 with a scaler: at step 2 one row of the last rank's share overflows. One process
/// skips that step and halves its scale; so must every rank, though only one saw the inf
/// (the skips and scales equal on every rank and equal one process's are checked by
/// `train_world`).
#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    for (n, rows, micro, row) in [(2, "8", "4", "6"), (4, "16", "2", "15")] {
        let runs = train_world(
            n,
            &[
                ("TL_PRECISION", "fp16"),
                ("TL_GLOBAL_ROWS", rows),
                ("TL_MICRO", micro),
                ("TL_OVERFLOW", &format!("2,{row}")),
            ],
        );
        assert_eq!(runs[0].get("skipped"), Some("2"), "{runs:?}");
        assert!(max_weight_diff(&runs) <= 1e-6, "{}", max_weight_diff(&runs));
    }
}

/// A rank that leaves mid-run: the others' step fails with the ring's error, naming the
/// rank, and no parameter moves.
#[test]
fn a_failed_collective_fails_the_step_and_changes_no_weight() {
    assert_the_survivor_failed(&run_world(2, "peer_exits", &[], DEADLINE));
}

/// Rank 0 of a `peer_exits` world failed its step with the ring's error, naming it, and
/// changed no weight.
fn assert_the_survivor_failed(runs: &[support::RankRun]) {
    assert_all_succeeded(runs);
    let survivor = &runs[0];
    assert_eq!(survivor.get("unchanged"), Some("true"), "{survivor:?}");
    assert_eq!(survivor.get("error_taken"), Some("true"));
    assert!(
        survivor.get("error").unwrap().starts_with("rank 0:"),
        "{survivor:?}"
    );
}

/// The same with the reduction overlapping backward, in buckets of 16 elements: the first
/// bucket fails on the communication thread during backward, every later one is refused,
/// and the step still fails with the ring's error and changes no weight.
#[test]
fn a_collective_that_fails_on_the_communication_thread_fails_the_step() {
    let env = [("TL_OVERLAP", "1".into()), ("TL_BUCKET_BYTES", "64".into())];
    assert_the_survivor_failed(&run_world(2, "peer_exits", &env, DEADLINE));
}

/// ZeRO-1 trains a third replica on the same communicator. Its gradients are DDP's (the same
/// all-reduce), and AdamW's update is elementwise with coefficients per parameter, so each
/// rank's AdamW on its shard computes for every element exactly the bits DDP's full AdamW
/// does; the all-gather copies them: bit for bit DDP, in every precision, skipped steps
/// included (a skip calls no optimizer and so gathers nothing). Each rank keeps the moments
/// of its `shard_range(58, N, r)` elements only, and a step makes one collective more.
#[test]
fn zero1_equals_ddp_bit_for_bit_holding_only_its_shard_of_the_moments() {
    for (n, env) in [
        (2, vec![("TL_GLOBAL_ROWS", "16"), ("TL_MICRO", "4")]),
        (
            4,
            vec![
                ("TL_GLOBAL_ROWS", "16"),
                ("TL_MICRO", "2"),
                ("TL_PRECISION", "bf16"),
            ],
        ),
        (
            4,
            vec![
                ("TL_PRECISION", "fp16"),
                ("TL_GLOBAL_ROWS", "8"),
                ("TL_MICRO", "2"),
                ("TL_OVERFLOW", "2,7"),
            ],
        ),
    ] {
        let mut env = env;
        env.push(("TL_ZERO", "1"));
        let runs = train_world(n, &env);
        for (rank, run) in runs.iter().enumerate() {
            assert_eq!(run.get("zero1_weights_equal_ddp"), Some("true"), "{run:?}");
            assert_eq!(run.get("zero1_reports_equal_ddp"), Some("true"), "{run:?}");
            assert_eq!(run.get("zero1_mid_step_collectives"), Some("0"));
            let buckets: u64 = run.get("buckets").unwrap().parse().unwrap();
            assert_eq!(
                run.get("zero1_collectives_per_step"),
                Some((buckets + 1).to_string().as_str())
            );
            let shard = shard_range(PARAMS, n, rank).len();
            assert_eq!(run.get("zero1_shard"), Some(shard.to_string().as_str()));
            assert_eq!(
                run.get("zero1_state_elements"),
                Some((2 * shard).to_string().as_str())
            );
        }
    }
}
