//! `tinyllm plan`: the memory of a training step, predicted before it runs, and (with
//! `--measure`) checked against the memory meter on real steps; with `--ranks` and
//! `--zero`, each data-parallel rank's memory and traffic.

use clap::Args;
use serde::Serialize;

use std::path::PathBuf;

use super::train::config_from_flags;
use super::{Exit, RecipeArgs, TrainArgs};
use crate::error::Result;
use crate::error::TrainError;
use crate::plan::{
    ComputeRate, DataParallelism, Link, Measurement, MemoryPlan, ParallelPlan, PlanShape, Recipe,
    ZeroStage, measure_steps, plan_ranks, predict_step_time, relative_error, render,
    render_measurement, render_parallel, render_step_time, render_step_time_sweep, render_sweep,
    step_flops,
};
use crate::train::TrainConfig;

/// Ranks of the table `--shape` prints when `--ranks` is not given.
const SWEEP_RANKS: [usize; 3] = [8, 64, 1024];

/// Options of `tinyllm plan`: the recipe, as `tinyllm train` takes it, and what to print.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The model and the recipe, as `tinyllm train` takes them.
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Plan the model and recipe of this config file (a run's `config.json`, or TOML by its
    /// `.toml` extension); flags given too override it.
    #[arg(long, value_name = "FILE", conflicts_with = "shape")]
    pub config: Option<PathBuf>,
    /// Also train a fresh model for two steps and compare the memory meter's peak with the
    /// prediction.
    #[arg(long, conflicts_with_all = ["ranks", "zero", "shape", "link"])]
    pub measure: bool,
    /// Print the plan (and measurement) as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Plan data-parallel training on this many ranks (a comma list prints a table)
    /// [default with --shape: 8,64,1024].
    #[arg(long, value_name = "N", value_delimiter = ',')]
    pub ranks: Vec<usize>,
    /// ZeRO stage of the data-parallel plan: 0 (plain DDP), 1, 2 or 3 (a comma list prints a
    /// table) [default: 0,1,2,3].
    #[arg(long, value_name = "S", value_delimiter = ',')]
    pub zero: Vec<usize>,
    /// Plan a large Llama shape instead of a preset: 1.3b, 7b or 70b (70b without
    /// grouped-query attention; plan only: far too large
    /// to train here). Micro-batch and accum default to 1.
    #[arg(long, value_name = "SHAPE", conflicts_with = "preset")]
    pub shape: Option<String>,
    /// MiB of gradients per collective of the reduction, as `tinyllm train --bucket-mib`
    /// takes it [default: 25].
    #[arg(long, value_name = "MIB")]
    pub bucket_mib: Option<f64>,
    /// Whether the reduction overlaps backward, as `tinyllm train --overlap` takes it: a
    /// rank holds up to two buckets more while they are under way [default: on].
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub overlap: Option<bool>,
    /// The blocks' linear layers in fp8 with delayed scaling, as `tinyllm train --fp8`.
    #[arg(long)]
    pub fp8: bool,
    /// Tensor parallelism, as `tinyllm train --tp`: each layer split over this many
    /// consecutive ranks of the `--ranks` (which must be a multiple of it) [default: 1].
    #[arg(long, value_name = "T", default_value_t = 1)]
    pub tp: usize,
    /// With --tp: also draw the split of one of the model's blocks over the group, as SVG.
    #[arg(long, value_name = "FILE", requires = "tp")]
    pub diagram: Option<PathBuf>,
    /// Sequence parallelism over the --tp groups, as `tinyllm train --sequence-parallel`.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Pipeline parallelism, as `tinyllm train --pp`: the model cut into stages over this
    /// many ranks (each stage's peak, the messages, the schedule's bubble).
    #[arg(long, value_name = "P", default_value_t = 1)]
    pub pp: usize,
    /// The pipeline's schedule, as `tinyllm train --schedule` [default: 1f1b].
    #[arg(long, value_name = "S")]
    pub schedule: Option<tl_parallel::pipeline::ScheduleKind>,
    /// Stages on each pipeline rank, as `tinyllm train --stages-per-rank`.
    #[arg(long, value_name = "V")]
    pub stages_per_rank: Option<usize>,
    /// The first block of each stage past the first, as `tinyllm train --pp-split`.
    #[arg(long, value_name = "B,B,..", value_delimiter = ',')]
    pub pp_split: Option<Vec<usize>>,
    /// Do not clip gradients, as `tinyllm train --no-clip` (under ZeRO-2 and 3 clipping
    /// adds an all-reduce of the norm).
    #[arg(long)]
    pub no_clip: bool,
    /// Predict each rank's step time on this link: its rate in Gbit/s, its latency in µs
    /// (default 0; each message also costs 10 µs of software), and the share of the rate
    /// the collectives reach (default 1), e.g. `400,5`. Needs --compute-rate or --bench.
    #[arg(
        long,
        value_name = "GBIT[,LATENCY_US[,EFFICIENCY]]",
        allow_hyphen_values = true
    )]
    pub link: Option<String>,
    /// With --link: the FLOP/s a rank's products run at, a number or a product such as
    /// `989e12*0.4` (a GPU's peak times the efficiency you expect).
    #[arg(
        long,
        value_name = "FLOPS",
        requires = "link",
        conflicts_with = "bench",
        allow_hyphen_values = true
    )]
    pub compute_rate: Option<String>,
    /// With --link: measure this node's rate by running two steps of one rank's recipe here
    /// (after one untimed), as `tinyllm bench` does.
    #[arg(long, requires = "link", conflicts_with = "shape")]
    pub bench: bool,
    /// Compute threads.
    #[command(flatten)]
    pub threads: super::Threads,
}

/// What `tinyllm plan --json` prints.
#[derive(Debug, Serialize)]
struct PlanOutput<'a> {
    plan: &'a MemoryPlan,
    /// The real steps' figures, with `--measure`.
    measured: Option<Measurement>,
    /// `(predicted − measured) / measured` of the steady-state peak, with `--measure`.
    relative_error: Option<f64>,
}

/// The recipe's config, on `--shape`'s model when one is given.
fn plan_config(args: &PlanArgs) -> Result<TrainConfig> {
    let shape: Option<PlanShape> = args.shape.as_deref().map(str::parse).transpose()?;
    let mut recipe = args.recipe.clone();
    if shape.is_some() {
        recipe.micro_batch = recipe.micro_batch.or(Some(1));
        recipe.accum = recipe.accum.or(Some(1));
    }
    let train_args = TrainArgs {
        recipe,
        config: args.config.clone(),
        bucket_mib: args.bucket_mib,
        overlap: args.overlap,
        fp8: args.fp8,
        no_clip: args.no_clip,
        ..TrainArgs::default()
    };
    let mut config = config_from_flags(&train_args)?;
    if let Some(shape) = shape {
        let dropout = config.model.dropout;
        config.preset = None;
        config.model = shape.config();
        config.model.dropout = dropout;
    }
    // The pipeline's flags on the model they cut (a --shape's, not the preset's).
    let parallel = &mut config.parallel;
    parallel.pipeline = args.pp;
    parallel.schedule = args.schedule.unwrap_or(parallel.schedule);
    let interleaved = parallel.schedule == tl_parallel::pipeline::ScheduleKind::Interleaved;
    parallel.stages_per_rank = match args.stages_per_rank {
        Some(v) => v,
        None if interleaved && args.pp > 1 => 2,
        None => 1,
    };
    parallel.pipeline_split = args.pp_split.clone();
    parallel.ranks = parallel.ranks.max(parallel.tensor * parallel.pipeline);
    config.validate()?;
    Ok(config)
}

/// Runs `tinyllm plan`.
pub(super) fn plan(args: &PlanArgs) -> Result<Exit> {
    let config = plan_config(args)?;
    if args.shape.is_some()
        || !args.ranks.is_empty()
        || !args.zero.is_empty()
        || args.tp > 1
        || args.sequence_parallel
        || args.pp > 1
        || args.link.is_some()
    {
        return plan_parallel(args, &config);
    }
    let plan = MemoryPlan::new(&Recipe::from(&config))?;
    if !args.json {
        print!("{}", render(&plan));
    }
    let measured = if args.measure {
        if !args.json {
            say!("\nmeasuring two real steps of the chosen recipe...");
        }
        Some(measure_steps(&config)?)
    } else {
        None
    };
    if args.json {
        let output = PlanOutput {
            plan: &plan,
            measured,
            relative_error: measured
                .map(|m| relative_error(plan.chosen().peak_bytes, m.peak_bytes)),
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&output).expect("the plan serializes")
        );
    } else if let Some(measured) = &measured {
        print!("\n{}", render_measurement(&plan, measured));
    }
    Ok(Exit::Success)
}

/// `--ranks` × `--zero`: one plan in full, or the table of several.
fn plan_parallel(args: &PlanArgs, config: &TrainConfig) -> Result<Exit> {
    if let Some(path) = &args.diagram {
        let written = crate::chart::write_tensor_parallel_block(path, &config.model, args.tp)?;
        say!(
            "diagram of a block over {} ranks: {}",
            args.tp,
            written.display()
        );
    }
    let recipe = &Recipe::from(config);
    // Refuse a bad link before any plan runs, and measure the rate once for every plan.
    let link: Option<Link> = args.link.as_deref().map(str::parse).transpose()?;
    let rate = match (&link, &args.compute_rate, args.bench) {
        (None, _, _) => None,
        (Some(_), Some(rate), _) => Some(rate.parse::<ComputeRate>()?),
        (Some(_), None, true) => Some(bench_rate(config)?),
        (Some(_), None, false) => {
            return Err(TrainError::InvalidArgument {
                name: "link",
                value: args.link.clone().unwrap_or_default(),
                reason: "a step time needs a compute rate: --compute-rate FLOPS, or --bench \
                         to measure this node's"
                    .into(),
            });
        }
    };
    let ranks = if args.ranks.is_empty() && args.pp > 1 {
        vec![args.pp * args.tp]
    } else if args.ranks.is_empty() {
        SWEEP_RANKS.to_vec()
    } else {
        args.ranks.clone()
    };
    let stages = if args.zero.is_empty() && args.pp > 1 {
        // One plan, DDP's, so that its table lists every rank's stages; `--zero` asks for
        // another stage (every one composes with a pipeline).
        vec![0]
    } else if args.zero.is_empty() && args.tp > 1 {
        // The stages composed with tensor parallelism.
        vec![0, 1]
    } else if args.zero.is_empty() {
        ZeroStage::ALL.iter().map(|s| s.index()).collect()
    } else {
        args.zero.clone()
    };
    let mut plans: Vec<ParallelPlan> = Vec::new();
    for &n in &ranks {
        for &stage in &stages {
            let parallelism = DataParallelism {
                bucket_bytes: config.parallel.bucket_bytes as u64,
                ..DataParallelism::new(n, stage)?
            }
            .with_tensor(args.tp)?
            .with_sequence_parallel(args.sequence_parallel)?
            .with_pipeline(args.pp)?;
            let mut plan = plan_ranks(recipe, &parallelism)?;
            if let (Some(link), Some(rate)) = (&link, &rate) {
                plan.step_time = Some(predict_step_time(&plan, config, link, rate)?);
            }
            plans.push(plan);
        }
    }
    if args.json {
        let json = if let [plan] = plans.as_slice() {
            serde_json::to_string_pretty(plan)
        } else {
            serde_json::to_string_pretty(&plans)
        };
        println!("{}", json.expect("the plan serializes"));
    } else if let [plan] = plans.as_slice() {
        print!("{}", render_parallel(plan));
        print!("{}", render_step_time(plan));
    } else {
        print!("{}", render_sweep(&plans));
        print!("{}", render_step_time_sweep(&plans));
    }
    Ok(Exit::Success)
}

/// This node's compute rate on one rank's recipe: the products' FLOPs of one step over the
/// median of two steps of it (after one untimed), trained here as one process, on the
/// trainer `tinyllm bench` times. A whole step's rate rather than a GEMM's: the step's
/// elementwise work, optimizer and rounding take time no FLOP count sees, and a rate
/// measured on the step itself carries them (a capstone step is about two thirds GEMM).
fn bench_rate(config: &TrainConfig) -> Result<ComputeRate> {
    use crate::bench::{BenchPlan, bench_one};
    let mut one = config.clone();
    one.parallel = crate::train::Parallel::default();
    super::train::shrink_builtin_corpus(&mut one, BENCH_CORPUS_BYTES);
    let dir =
        tempfile::tempdir().map_err(|source| TrainError::io("a temporary directory", source))?;
    let plan = BenchPlan {
        dir: dir.path(),
        warmup_steps: 1,
        steps: 2,
        gemm_limit: false,
    };
    say!("measuring this node's compute rate: one untimed and two timed steps of the recipe...");
    let report = bench_one(
        &one,
        &plan,
        &mut |config, dir| crate::train::Trainer::new(config, dir),
        &mut |step, seconds| say!("step {step}: {seconds:.3} s"),
    )?;
    let step_s = report.recipes[0].seconds.median;
    let flops = step_flops(&one, &DataParallelism::new(1, 0)?, 0)?.total();
    ComputeRate::measured(flops, step_s)
}

/// The built-in corpus `--bench` trains on: enough windows for three steps.
const BENCH_CORPUS_BYTES: usize = 200_000;
