//! `tinyllm plan`: the memory of a training step, predicted before it runs, and (with
//! `--measure`) checked against the memory meter on real steps.

use clap::Args;
use serde::Serialize;

use super::train::config_from_args;
use super::{Exit, TrainArgs};
use crate::error::Result;
use crate::plan::{
    Measurement, MemoryPlan, Recipe, measure_steps, relative_error, render, render_measurement,
};

/// Options of `tinyllm plan`: the recipe, as `tinyllm train` takes it, and what to print.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Model size: tiny, small or capstone [default: small].
    #[arg(long, value_name = "PRESET")]
    pub preset: Option<String>,
    /// Sequences per micro-batch [default: 8].
    #[arg(long, value_name = "N")]
    pub micro_batch: Option<usize>,
    /// Micro-batches accumulated per optimizer step [default: 4].
    #[arg(long, value_name = "K")]
    pub accum: Option<usize>,
    /// Matmuls under emulated bf16 autocast.
    #[arg(long, conflicts_with = "fp16")]
    pub bf16: bool,
    /// Matmuls under emulated fp16 autocast, with dynamic loss scaling.
    #[arg(long)]
    pub fp16: bool,
    /// Recompute each block's activations during backward instead of keeping them.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Checkpoint on the optimal schedule for this many stored block inputs.
    #[arg(long, value_name = "K", conflicts_with = "checkpoint_activations")]
    pub checkpoint_budget: Option<usize>,
    /// Dropout on each residual branch [default: 0].
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    pub dropout: Option<f64>,
    /// Also train a fresh model for two steps and compare the memory meter's peak with the
    /// prediction.
    #[arg(long)]
    pub measure: bool,
    /// Print the plan (and measurement) as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
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

/// Runs `tinyllm plan`.
pub(super) fn plan(args: &PlanArgs) -> Result<Exit> {
    let train_args = TrainArgs {
        preset: args.preset.clone(),
        bf16: args.bf16,
        fp16: args.fp16,
        micro_batch: args.micro_batch,
        accum: args.accum,
        checkpoint_activations: args.checkpoint_activations,
        checkpoint_budget: args.checkpoint_budget,
        dropout: args.dropout,
        ..TrainArgs::default()
    };
    let config = config_from_args(&train_args, None)?;
    let plan = MemoryPlan::new(&Recipe::from(&config))?;
    if !args.json {
        print!("{}", render(&plan));
    }
    let measured = if args.measure {
        if !args.json {
            eprintln!("\nmeasuring two real steps of the chosen recipe...");
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
