//! `tinyllm plan`: the memory of a training step, predicted before it runs, and (with
//! `--measure`) checked against the memory meter on real steps.

use clap::Args;
use serde::Serialize;

use super::train::config_from_args;
use super::{Exit, RecipeArgs, TrainArgs};
use crate::error::Result;
use crate::plan::{
    Measurement, MemoryPlan, Recipe, measure_steps, relative_error, render, render_measurement,
};

/// Options of `tinyllm plan`: the recipe, as `tinyllm train` takes it, and what to print.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The model and the recipe, as `tinyllm train` takes them.
    #[command(flatten)]
    pub recipe: RecipeArgs,
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
        recipe: args.recipe.clone(),
        ..TrainArgs::default()
    };
    let config = config_from_args(&train_args, None)?;
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
