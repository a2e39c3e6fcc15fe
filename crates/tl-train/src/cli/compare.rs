//! `tinyllm compare`: MS-L11, the mixed recipe against the float32 baseline.

use std::path::PathBuf;

use clap::Args;
use indicatif::{MultiProgress, ProgressBar};
use tl_precision::Precision;

use super::backend::{Backend, communicator};
use super::train::{config_from_flags, mib, progress_bar, write_loss_chart};
use super::{Exit, RecipeArgs, TrainArgs};
use crate::compare::{Comparison, MAX_RELATIVE_GAP, compare_on};
use crate::error::Result;
use crate::model::{Checkpointing, Preset};
use crate::store::write_atomic;
use crate::train::TrainConfig;
use crate::train::{Event, Record};

/// Options of `tinyllm compare`: the recipe to test (default: bf16, micro-batch 8,
/// accumulation 4, per-block checkpointing, or the recipe of `--config`'s file); the
/// baseline is derived from it.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Model size: tiny, small or capstone [default: small].
    #[arg(long, value_name = "PRESET")]
    pub preset: Option<String>,
    /// Take the recipe (and model size) from this config file, in the schema of a run's
    /// `config.json` (JSON, or TOML by its `.toml` extension); flags given too override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Train on this text instead of the built-in corpus: a UTF-8 file, a directory of .txt
    /// files or a .jsonl file, as `tinyllm train` takes it.
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// Tokens from this tokenizer.json; the model's vocabulary is its own [default: bytes].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Bytes of built-in corpus to generate [default: 2000000].
    #[arg(long, value_name = "N", conflicts_with = "data")]
    pub corpus_bytes: Option<usize>,
    /// The recipe in fp16 (with dynamic loss scaling) instead of bf16.
    #[arg(long, conflicts_with = "fp32")]
    pub fp16: bool,
    /// The recipe in fp32 (to isolate accumulation and checkpointing).
    #[arg(long)]
    pub fp32: bool,
    /// The recipe's 16-bit products add up as this hardware does: amx (Intel's AMX tiles,
    /// bf16), the tensor cores of v100, a100 or h100, or tensor-core:BLOCK:EXTRA_BITS
    /// [default: f32].
    #[arg(long, value_name = "MODEL", conflicts_with = "fp32")]
    pub accumulate: Option<tl_precision::Accumulation>,
    /// The recipe's block projections in fp8 with delayed scaling (HYBRID, Transformer
    /// Engine's defaults), on top of its precision.
    #[arg(long)]
    pub fp8: bool,
    /// Sequences per micro-batch of the recipe [default: 8].
    #[arg(long, value_name = "N")]
    pub micro_batch: Option<usize>,
    /// Micro-batches per step of the recipe; the baseline takes all of them at once
    /// [default: 4].
    #[arg(long, value_name = "K")]
    pub accum: Option<usize>,
    /// The recipe keeps every activation.
    #[arg(long)]
    pub no_checkpoint_activations: bool,
    /// The recipe checkpoints on the optimal schedule for K stored block inputs instead of
    /// per block.
    #[arg(long, value_name = "K", conflicts_with = "no_checkpoint_activations")]
    pub checkpoint_budget: Option<usize>,
    /// What each block of the recipe keeps for backward (as `tinyllm train` takes it)
    /// instead of per-block checkpointing.
    #[arg(
        long,
        value_name = "POLICY",
        conflicts_with_all = ["no_checkpoint_activations", "checkpoint_budget"]
    )]
    pub checkpoint_policy: Option<super::CheckpointPolicy>,
    /// Optimizer steps of each run [default: by preset].
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Peak learning rate [default: by preset].
    #[arg(long, value_name = "LR", allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Seed of both runs [default: 0].
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// Directory of the two runs and the report [default: runs/compare-PRESET-seedS].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
    /// How the ranks communicate, when both runs train on several (`tinyllm launch -n N --
    /// compare ...`, or mpirun with mpi).
    #[arg(long, value_enum, default_value_t)]
    pub backend: Backend,
    /// Compute threads.
    #[command(flatten)]
    pub threads: super::Threads,
}

/// The recipe `tinyllm compare` tests: `--config`'s file, or the chapter's mixed recipe
/// (bf16, 8 × 4, per-block checkpointing), with the flags given on top.
fn recipe_config(args: &CompareArgs) -> Result<TrainConfig> {
    let defaults = args.config.is_none();
    let train_args = TrainArgs {
        recipe: RecipeArgs {
            preset: args.preset.clone(),
            tokenizer: args.tokenizer.clone(),
            init_from: None,
            bf16: defaults && !args.fp16 && !args.fp32,
            fp16: args.fp16,
            accumulate: args.accumulate,
            micro_batch: args.micro_batch.or(defaults.then_some(8)),
            accum: args.accum.or(defaults.then_some(4)),
            checkpoint_activations: defaults
                && !args.no_checkpoint_activations
                && args.checkpoint_budget.is_none()
                && args.checkpoint_policy.is_none(),
            checkpoint_budget: args.checkpoint_budget,
            checkpoint_policy: args.checkpoint_policy,
            chunked_loss: None,
            dropout: None,
        },
        config: args.config.clone(),
        data: args.data.clone(),
        corpus_bytes: args.corpus_bytes,
        steps: args.steps,
        lr: args.lr,
        seed: args.seed,
        fp8: args.fp8,
        ..TrainArgs::default()
    };
    let mut recipe = config_from_flags(&train_args)?;
    if args.fp32 {
        recipe.precision = Precision::Fp32;
    }
    if args.no_checkpoint_activations {
        recipe.checkpointing = Checkpointing::Off;
    }
    Ok(recipe)
}

/// Runs `tinyllm compare`: exit status success only when MS-L11 holds.
pub(super) fn compare_command(args: &CompareArgs) -> Result<Exit> {
    let recipe = recipe_config(args)?;
    let comm = communicator(args.backend)?;
    let (leader, world) = (comm.rank() == 0, comm.world_size());
    let out = args.out.clone().unwrap_or_else(|| {
        let preset = recipe.preset.map_or("custom", Preset::name);
        PathBuf::from("runs").join(format!("compare-{preset}-seed{}", recipe.seed))
    });
    if leader {
        say!(
            "tinyllm compare on {} ({} steps of {} tokens{}): the fp32 baseline, then the recipe",
            recipe.preset.map_or("custom", Preset::name),
            recipe.steps,
            recipe.tokens_per_step() * world,
            if world > 1 {
                format!(" over {world} ranks")
            } else {
                String::new()
            }
        );
    }
    let bars = MultiProgress::new();
    let mut current: Option<(String, ProgressBar)> = None;
    let comparison = compare_on(&recipe, &out, comm, &mut |name, event| {
        if current.as_ref().is_none_or(|(n, _)| n != name) {
            if let Some((_, bar)) = current.take() {
                bar.finish();
            }
            let bar = bars.add(progress_bar(args.quiet || !leader, 0, recipe.steps));
            bar.set_prefix(name.to_string());
            current = Some((name.to_string(), bar));
        }
        let (_, bar) = current.as_ref().expect("just set");
        if let Event::Metric(Record::Train {
            step,
            loss,
            tokens_per_s,
            ..
        }) = event
        {
            bar.set_position(*step);
            bar.set_message(format!("{name}: loss {loss:.4} | {tokens_per_s:.0} tok/s"));
        }
    })?;
    if let Some((_, bar)) = current {
        bar.finish();
    }
    let Some(comparison) = comparison else {
        // Not rank 0: rank 0 reports.
        return Ok(Exit::Success);
    };
    let json = serde_json::to_vec_pretty(&comparison).expect("the comparison serializes");
    write_atomic(&out.join("comparison.json"), &json)?;
    let chart = out.join("compare.svg");
    // A log axis keeps the last steps, where the two runs differ, as visible as the first.
    write_loss_chart(
        &chart,
        "MS-L11: fp32 baseline vs the recipe",
        &[
            ("fp32", &out.join("fp32-baseline")),
            ("recipe", &out.join("recipe")),
        ],
        comparison.recipe.entropy_floor,
        true,
    )?;
    print_table(&comparison);
    say!(
        "report: {}  chart: {}",
        out.join("comparison.json").display(),
        chart.display()
    );
    Ok(if comparison.passes {
        Exit::Success
    } else {
        Exit::MilestoneMissed
    })
}

fn print_table(c: &Comparison) {
    let recipe = &c.recipe_config;
    let label = format!(
        "recipe ({}, {}×{}, checkpointing {})",
        recipe.precision.name(),
        recipe.micro_batch,
        recipe.accum,
        recipe.checkpointing
    );
    let loss = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
    let rss = |v: Option<u64>| v.map_or("-".to_string(), |v| format!("{:.1} MiB", mib(v)));
    let rows = [
        (
            "train loss (last steps)",
            format!("{:.4}", c.baseline.train_loss),
            format!("{:.4}", c.recipe.train_loss),
            format!("{:+.2}%", 100.0 * c.train_gap),
        ),
        (
            "validation loss",
            loss(c.baseline.val_loss),
            loss(c.recipe.val_loss),
            format!(
                "{:+.2}% (limit +{:.0}%)",
                100.0 * c.val_gap,
                100.0 * MAX_RELATIVE_GAP
            ),
        ),
        (
            "peak live tensors",
            format!("{:.1} MiB", mib(c.baseline.peak_live_bytes)),
            format!("{:.1} MiB", mib(c.recipe.peak_live_bytes)),
            format!("{:.2}×", c.peak_live_ratio),
        ),
        (
            "peak process memory",
            rss(c.baseline.peak_rss_bytes),
            rss(c.recipe.peak_rss_bytes),
            c.peak_rss_ratio.map_or("-".into(), |r| format!("{r:.2}×")),
        ),
        (
            "tokens/s (median)",
            format!("{:.0}", c.baseline.tokens_per_s),
            format!("{:.0}", c.recipe.tokens_per_s),
            format!("{:.2}×", c.recipe.tokens_per_s / c.baseline.tokens_per_s),
        ),
    ];
    say!(
        "\n{:<24} {:>16} {:>16}   {label}",
        "",
        "fp32 baseline",
        "recipe"
    );
    for (name, baseline, recipe, relation) in rows {
        say!("{name:<24} {baseline:>16} {recipe:>16}   {relation}");
    }
    if let Some(floor) = c.recipe.entropy_floor {
        say!("{:<24} {floor:>16.4}", "entropy floor");
    }
    let verdict = if c.passes { "PASSES" } else { "FAILS" };
    say!(
        "\nMS-L11 (the recipe trains as well on less memory) {verdict}: validation gap {:+.2}% (≤ +2% needed), peak live tensors {:.2}× the baseline's (< 1 needed)",
        100.0 * c.val_gap,
        c.peak_live_ratio
    );
}
