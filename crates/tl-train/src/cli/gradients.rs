//! `tinyllm gradients`: where a model's gradients lie against fp16's window, and how the
//! loss scale moves them (see [`crate::gradients`]).

use std::fmt::Write;
use std::path::PathBuf;

use clap::Args;

use super::train::{config_from_flags, shrink_builtin_corpus};
use super::{Exit, RecipeArgs, TrainArgs};
use crate::error::Result;
use crate::gradients::{DEFAULT_SCALE_EXPONENT, GradientReport, measure, write_report};
use crate::model::{Llama, Preset};
use crate::train::load_model_at;

/// Bytes of built-in corpus to generate: one batch is drawn from it.
const CORPUS_BYTES: usize = 200_000;

/// Options of `tinyllm gradients`.
#[derive(Debug, Args, Default)]
pub struct GradientsArgs {
    /// Model size of a fresh model: tiny, small or capstone [default: small].
    #[arg(long, value_name = "PRESET", conflicts_with_all = ["config", "from"])]
    pub preset: Option<String>,
    /// The model and data of this config file (a run's `config.json`, or TOML).
    #[arg(long, value_name = "FILE", conflicts_with = "from")]
    pub config: Option<PathBuf>,
    /// The weights (and data) of this run's latest checkpoint instead of a fresh model.
    #[arg(long, value_name = "RUN")]
    pub from: Option<PathBuf>,
    /// With --from, the checkpoint of this step instead of the latest.
    #[arg(long, value_name = "STEP", requires = "from")]
    pub checkpoint: Option<u64>,
    /// Sequences in the batch [default: the config's micro-batch, 8 for the presets].
    #[arg(long, value_name = "N")]
    pub micro_batch: Option<usize>,
    /// Seed of a fresh model's weights and of the batch.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Directory for gradients.json, histogram.svg and sweep.svg [default: gradients-NAME].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Compute threads.
    #[command(flatten)]
    pub threads: super::Threads,
}

/// Runs `tinyllm gradients`.
pub(super) fn gradients(args: &GradientsArgs) -> Result<Exit> {
    let (mut config, model, weights) = match &args.from {
        Some(run) => {
            let (config, model) = load_model_at(run, args.checkpoint)?;
            let at = args
                .checkpoint
                .map_or("its latest checkpoint".to_string(), |step| {
                    format!("step {step}")
                });
            (config, model, format!("{} at {at}", run.display()))
        }
        None => {
            let train_args = TrainArgs {
                recipe: RecipeArgs {
                    preset: args.preset.clone(),
                    ..RecipeArgs::default()
                },
                config: args.config.clone(),
                seed: Some(args.seed),
                ..TrainArgs::default()
            };
            let config = config_from_flags(&train_args)?;
            let model = Llama::new(&config.model, config.seed)?;
            let weights = format!("initialisation (seed {})", config.seed);
            (config, model, weights)
        }
    };
    config.micro_batch = args.micro_batch.unwrap_or(config.micro_batch);
    shrink_builtin_corpus(&mut config, CORPUS_BYTES);
    config.validate()?;
    let name = config.preset.map_or("custom", Preset::name);
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("gradients-{name}")));
    say!(
        "tinyllm gradients: {name} ({} parameters), weights: {weights}, one batch of {} x {} tokens; \
         the f32 reference, then S = 2^0, 2^2, ..., 2^24 under fp16 and bf16 autocast",
        config.model.num_parameters(),
        config.micro_batch,
        config.model.context,
    );
    let report = measure(&model, &config, weights, args.seed)?;
    let paths = write_report(&report, &out)?;
    print!("{}", summary(&report));
    for path in paths {
        println!("wrote {}", path.display());
    }
    Ok(Exit::Success)
}

/// The report in a few tables: the shares below fp16's thresholds per kind, the window of
/// scales, the sweep, and where fp16 beats bf16.
fn summary(report: &GradientReport) -> String {
    let mut text = format!(
        "loss {:.4} nats per token\n{:<12}{:>12}{:>12}{:>14}{:>14}{:>18}\n",
        report.loss, "gradients", "entries", "zeros", "< 2^-24", "< 2^-14", "log2 |g| range"
    );
    for h in &report.histograms {
        let range = match (h.bins.first(), h.bins.last()) {
            (Some(lo), Some(hi)) => format!("{} .. {}", lo.0, hi.0),
            _ => "-".into(),
        };
        let _ = writeln!(
            text,
            "  {:<10}{:>12}{:>12}{:>13.4}%{:>13.4}%{:>18}",
            h.label,
            h.entries,
            h.zeros,
            100.0 * h.below_fp16_subnormal,
            100.0 * h.below_fp16_normal,
            range
        );
    }
    let window = &report.window;
    let intervals: Vec<String> = window
        .log2_intervals
        .iter()
        .map(|(lo, hi)| format!("2^{lo:.2} .. 2^{hi:.2}"))
        .collect();
    let _ = writeln!(
        text,
        "scales S putting {:.1}% of the nonzero S·g in fp16's normal range [2^-14, 65504]: {}",
        100.0 * window.coverage,
        if intervals.is_empty() {
            "none (the entries span more than fp16's 30 binades)".to_string()
        } else {
            intervals.join(", ")
        }
    );
    let _ = writeln!(
        text,
        "  the default S = 2^{DEFAULT_SCALE_EXPONENT} is {} that window",
        if window.default_inside {
            "inside"
        } else {
            "outside"
        }
    );
    let _ = writeln!(
        text,
        "{:<10}{:>16}{:>16}{:>14}",
        "log2 S", "fp16 error", "bf16 error", "fp16 flushed"
    );
    let run = |format: &str, k: i32| {
        report
            .sweep
            .iter()
            .find(|r| r.format == format && r.log2_scale == k)
    };
    let cell = |r: Option<&crate::gradients::SweepRun>| match r.and_then(|r| r.relative_error) {
        Some(error) => format!("{error:.3e}"),
        None => "non-finite".into(),
    };
    let mut better = Vec::new();
    for k in crate::gradients::SWEEP_EXPONENTS {
        let (fp16, bf16) = (run("fp16", k), run("bf16", k));
        let _ = writeln!(
            text,
            "  {k:<8}{:>16}{:>16}{:>14}",
            cell(fp16),
            cell(bf16),
            fp16.map_or(0, |r| r.lost)
        );
        if let (Some(a), Some(b)) = (
            fp16.and_then(|r| r.relative_error),
            bf16.and_then(|r| r.relative_error),
        ) && a < b
        {
            better.push(k);
        }
    }
    let _ = writeln!(
        text,
        "fp16 is more accurate than bf16 at S = {}",
        if better.is_empty() {
            "no scale of the sweep".to_string()
        } else {
            better
                .iter()
                .map(|k| format!("2^{k}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    text
}
