//! `tinyllm bench`: the step time of a recipe, as README and docs/benchmarks.md report it,
//! or two recipes paired step by step.

use std::path::PathBuf;

use clap::Args;
use tl_precision::{Accumulation, Precision};
use tl_tensor::kernels::gemm_limit::{GemmCall, GemmLimit, Spread};

use super::backend::{Backend, communicator};
use super::train::{config_from_flags, mib, shrink_builtin_corpus};
use super::{Exit, RecipeArgs, TrainArgs};
use crate::bench::{BenchPlan, BenchReport, Machine, bench_one, bench_paired, paired_recipes};
use crate::error::{Result, TrainError};
use crate::model::Preset;
use crate::train::{TrainConfig, Trainer};

/// Options of `tinyllm bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The model and the recipe, as `tinyllm train` takes them.
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Time the model and recipe of this config file (a run's `config.json`, or TOML by its
    /// `.toml` extension); flags given too override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Timed optimizer steps (pairs of steps with --paired) [default: 5, or 8 pairs].
    #[arg(long, value_name = "N")]
    pub steps: Option<usize>,
    /// Untimed steps each trainer takes first.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub warmup: usize,
    /// The blocks' linear layers in fp8 with delayed scaling, as `tinyllm train --fp8`.
    #[arg(long)]
    pub fp8: bool,
    /// Time two recipes against each other, taking turns step by step in one process:
    /// two of fp32, bf16, fp16, fp32+ckpt, bf16+ckpt, fp32+ckpt-matmuls,
    /// fp32+ckpt-first-matmul, fp8, bf16+amx (the precision, the checkpoint policy, fp8 and
    /// the accumulation replace the recipe's).
    #[arg(long, value_name = "A,B", value_delimiter = ',')]
    pub paired: Vec<String>,
    /// After the timed steps, record one more step's products and time each alone on the
    /// f32 GEMM: what the step would take if it did nothing but its products, and the
    /// fraction of that the step reaches (fp32 recipes; not with --paired).
    #[arg(long)]
    pub gemm_limit: bool,
    /// Print the figures as one JSON object on stdout (progress still goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Seed of the weights and batches [default: 0].
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// How the ranks communicate, when the bench runs on several (`tinyllm launch -n N --
    /// bench ...`, or mpirun with mpi).
    #[arg(long, value_enum, default_value_t)]
    pub backend: Backend,
    /// Compute threads.
    #[command(flatten)]
    pub threads: super::Threads,
}

/// Bytes of built-in corpus a bench generates: what the batches hold does not change the
/// time of a step.
const CORPUS_BYTES: usize = 200_000;

/// The config a bench times: the flags on `--config`'s file, with a small built-in corpus.
fn bench_config(args: &BenchArgs) -> Result<TrainConfig> {
    let train_args = TrainArgs {
        recipe: args.recipe.clone(),
        config: args.config.clone(),
        seed: args.seed,
        fp8: args.fp8,
        ..TrainArgs::default()
    };
    let mut config = config_from_flags(&train_args)?;
    // Still valid: the corpus keeps the windows the context needs.
    shrink_builtin_corpus(&mut config, CORPUS_BYTES);
    Ok(config)
}

/// Runs `tinyllm bench`.
pub(super) fn bench(args: &BenchArgs) -> Result<Exit> {
    let config = bench_config(args)?;
    let paired = if args.paired.is_empty() {
        None
    } else {
        Some(paired_recipes(&args.paired)?)
    };
    let steps = args.steps.unwrap_or(if paired.is_some() { 8 } else { 5 });
    let dir =
        tempfile::tempdir().map_err(|source| TrainError::io("a temporary directory", source))?;
    let plan = BenchPlan {
        dir: dir.path(),
        warmup_steps: args.warmup,
        steps,
        gemm_limit: args.gemm_limit,
    };
    let mut comm = Some(communicator(args.backend)?);
    let (rank, world) = {
        let comm = comm.as_ref().expect("just made");
        (comm.rank(), comm.world_size())
    };
    let leader = rank == 0;
    if paired.is_some() && world > 1 {
        return Err(TrainError::InvalidArgument {
            name: "paired",
            value: args.paired.join(","),
            reason: "pairs two trainers in one process; run it without a launcher".into(),
        });
    }
    if leader {
        print_header(&config, world, &plan, paired.is_some());
    }
    let report = match paired {
        None => bench_one(
            &config,
            &plan,
            &mut |config, dir| {
                let comm = comm.take().expect("one trainer");
                Trainer::new_on(config, dir, comm)
            },
            &mut |step, seconds| {
                if leader {
                    say!("step {step}: {seconds:.3} s");
                }
            },
        )?,
        Some(recipes) => {
            let [a, b] = recipes.map(|recipe| recipe.name);
            bench_paired(
                &config,
                recipes,
                &plan,
                &mut |config, dir| Trainer::new(config, dir),
                &mut |pair, a_s, b_s| {
                    let order = if pair % 2 == 0 {
                        format!(" ({b} first)")
                    } else {
                        String::new()
                    };
                    say!(
                        "pair {pair}: {a} {a_s:.3} s, {b} {b_s:.3} s, ratio {:.3}{order}",
                        b_s / a_s
                    );
                },
            )?
        }
    };
    if !leader {
        return Ok(Exit::Success);
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("the report serializes")
        );
    } else {
        print_summary(&report);
    }
    Ok(Exit::Success)
}

/// How this CPU computes bf16 products in the default order (the units'), operands in the
/// units' window: the bits are the same on every route.
fn bf16_products_here() -> &'static str {
    use tl_tensor::kernels::bf16_dot::{Bf16Route, pairs_route, units_available};
    match pairs_route() {
        Bf16Route::Units => "on the CPU's AVX512-BF16 units",
        Bf16Route::Fma if units_available() => {
            "by fused multiply-adds in 16 lanes, which outpace this CPU's AVX512-BF16 units \
             (the same bits)"
        }
        Bf16Route::Fma => {
            "by fused multiply-adds in 16 lanes (AVX-512 without bf16 units; the same bits)"
        }
        _ => "by the portable path (no AVX-512; the same bits)",
    }
}

fn print_header(config: &TrainConfig, world: usize, plan: &BenchPlan<'_>, paired: bool) {
    say!(
        "tinyllm bench: {} ({} parameters), micro-batch {} x accum {} x context {}{} = {} tokens/step",
        config.preset.map_or("custom", Preset::name),
        config.model.num_parameters(),
        config.micro_batch,
        config.accum,
        config.model.context,
        if world > 1 {
            format!(" x {world} ranks")
        } else {
            String::new()
        },
        config.tokens_per_step() * world,
    );
    say!("machine: {}", Machine::this().describe());
    if config.precision == Precision::Bf16 && config.accumulation == Accumulation::F32 {
        say!("bf16 products: {}", bf16_products_here());
        if tl_tensor::kernels::bf16_dot::amx_available() {
            say!(
                "note: this CPU has AMX tiles; --accumulate amx sums the bf16 products in \
                 their order, on them (other bits than the default order)"
            );
        }
    }
    let what = if paired { "pair" } else { "step" };
    say!(
        "{} untimed warm-up step{} per trainer, then {} timed {what}{}",
        plan.warmup_steps,
        if plan.warmup_steps == 1 { "" } else { "s" },
        plan.steps,
        if plan.steps == 1 { "" } else { "s" },
    );
    if plan.gemm_limit {
        say!("then one more step with its GEMM calls recorded, and each call timed alone");
    }
}

/// The figures, as lines on stdout.
fn print_summary(report: &BenchReport) {
    for recipe in &report.recipes {
        let s = recipe.seconds;
        let skipped = if recipe.skipped > 0 {
            format!(" ({} skipped by the loss scaler)", recipe.skipped)
        } else {
            String::new()
        };
        println!(
            "{}: median {:.3} s/step (quartiles {:.3} to {:.3}), {:.0} tokens/s{skipped}",
            recipe.name, s.median, s.q1, s.q3, recipe.tokens_per_s
        );
    }
    if let Some(paired) = &report.paired {
        let [a, b] = [0, 1].map(|i| report.recipes[i].name.as_str());
        let r = paired.ratio;
        println!(
            "{b} / {a}: median ratio {:.3}, quartiles {:.3} to {:.3}, over {} pairs",
            r.median,
            r.q1,
            r.q3,
            paired.ratios.len()
        );
    }
    if let Some(limit) = &report.gemm_limit {
        print_gemm_limit(limit, report.recipes[0].seconds.median);
    }
    if let Some(live) = report.peak_live_bytes {
        let rss = report.peak_rss_bytes.map_or_else(
            || "peak process memory unavailable here".to_string(),
            |rss| format!("peak process memory {:.1} MiB", mib(rss)),
        );
        println!(
            "peak live tensors {:.1} MiB (rank 0, timed steps); {rss}",
            mib(live)
        );
    }
}

/// The products that take the longest, listed under the GEMM limit.
const LIMIT_ROWS: usize = 6;

/// The GEMM limit of a step, its split, the fraction the step reaches, and the products
/// that take the most of it.
fn print_gemm_limit(limit: &GemmLimit, step_s: f64) {
    println!(
        "GEMM limit: {:.3} s for one step's {} products ({:.1} GFLOP, {:.0} GFLOP/s): {:.3} s \
         spread over the pool, {:.3} s one per task; the median step reaches {:.1}% of it",
        limit.seconds,
        limit.calls,
        limit.flops as f64 / 1e9,
        limit.flops as f64 / limit.seconds / 1e9,
        limit.spread_s,
        limit.serial_s,
        100.0 * limit.seconds / step_s,
    );
    println!(
        "inside the step the products took about {:.3} s ({:.1}% of the median step), \
         {:.2}x their time alone; the rest of the step, {:.3} s, is everything else",
        limit.in_program_s,
        100.0 * limit.in_program_s / step_s,
        limit.in_program_s / limit.seconds,
        step_s - limit.in_program_s,
    );
    let mut products: Vec<_> = limit.products.iter().collect();
    products.sort_by(|a, b| (b.seconds * b.count as f64).total_cmp(&(a.seconds * a.count as f64)));
    for product in products.iter().take(LIMIT_ROWS) {
        let call = &product.call;
        let [m, k, n] = call.shape;
        let total = product.seconds * product.count as f64;
        println!(
            "  {:>5.1}%  {m}x{k}x{n} {} {}, {} x {:.3} ms = {:.3} s",
            100.0 * total / limit.seconds,
            layouts(call),
            match call.spread {
                Spread::Serial => "one per task".to_string(),
                Spread::Gemm => "split by gemm".to_string(),
                Spread::RowBlocks(rows) => format!("in blocks of {rows} rows"),
            },
            product.count,
            product.seconds * 1e3,
            total,
        );
    }
}

/// How a product's operands lie: `N` a matrix in rows (unit column stride), `T` in columns
/// (unit row stride), `S` neither; left, right, then the output, and `+=` if it accumulates.
fn layouts(call: &GemmCall) -> String {
    let layout = |[row, column]: [isize; 2]| match (row, column) {
        (_, 1) => 'N',
        (1, _) => 'T',
        _ => 'S',
    };
    let [l, r, o] = call.strides.map(layout);
    format!("{l}{r}->{o}{}", if call.accumulate { "+=" } else { "" })
}
