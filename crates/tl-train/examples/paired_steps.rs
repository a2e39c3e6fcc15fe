//! Step times of two training recipes, measured in pairs: one capstone step of each,
//! taking turns, in one process.
//!
//! On a shared machine the speed drifts by more than the difference between two recipes
//! within minutes, so benchmarks run one after the other (criterion's sittings) can rank
//! them either way. Here both trainers live side by side and take turns, so each pair of
//! steps sees the same machine; the median of the per-pair ratios is what a recipe costs.
//!
//! ```sh
//! cargo run --release -p tl-train --example paired_steps -- 12 fp32 bf16
//! ```
//!
//! The two recipes swap places from one pair to the next (A then B, B then A, ...), so that
//! whatever running second costs is shared evenly.
//!
//! Arguments: the number of pairs, then two of the step benchmark's modes
//! (`tl_train::train::STEP_RECIPES`: `fp32`, `bf16`, `fp16`, `fp32+ckpt`, `bf16+ckpt`; each
//! is `tinyllm train --preset capstone --micro-batch 8 --accum 1` with the mode's flags).
//! Each trainer takes one untimed step first.

use std::process::ExitCode;
use std::time::Instant;

use tl_train::train::{STEP_RECIPES, StepRecipe, Trainer};

/// As in `src/main.rs`, so that the figures match the binary's.
#[global_allocator]
static ALLOCATOR: tl_tensor::alloc::CachingAllocator = tl_tensor::alloc::CachingAllocator;

/// Parses `PAIRS MODE MODE`.
fn parse(args: &[String]) -> Result<(usize, [StepRecipe; 2]), String> {
    let [pairs, first, second] = args else {
        return Err("expected three arguments: PAIRS MODE MODE".into());
    };
    let pairs = pairs
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("PAIRS must be a positive whole number, not {pairs:?}"))?;
    let mode = |name: &String| {
        StepRecipe::named(name).ok_or_else(|| {
            let known: Vec<&str> = STEP_RECIPES.iter().map(|recipe| recipe.name).collect();
            format!("unknown mode {name:?}; the modes are {}", known.join(", "))
        })
    };
    Ok((pairs, [mode(first)?, mode(second)?]))
}

/// The value a fraction `q` of the way through `values`, which are sorted (for `q = 0.5`
/// the median, the upper of the two middle values for an even count).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[(q * sorted.len() as f64) as usize]
}

fn sorted(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(f64::total_cmp);
    values
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (pairs, modes) = match parse(&args) {
        Ok(parsed) => parsed,
        Err(message) => {
            eprintln!("paired_steps: {message}");
            return ExitCode::FAILURE;
        }
    };
    // Both recipes take steps of the same size.
    let tokens = modes[0].capstone_config().tokens_per_step() as f64;
    let dir = tempfile::tempdir().expect("a temporary directory for the two runs");
    let mut trainers: Vec<Trainer> = modes
        .iter()
        .enumerate()
        .map(|(i, recipe)| {
            let run = dir.path().join(format!("run{i}"));
            Trainer::new(recipe.capstone_config(), &run).expect("a new capstone run")
        })
        .collect();
    let step = |trainer: &mut Trainer| {
        let start = Instant::now();
        trainer.train_step().expect("the step succeeds");
        start.elapsed().as_secs_f64()
    };
    for trainer in &mut trainers {
        step(trainer);
    }
    let [first, second] = modes.map(|recipe| recipe.name);
    let (mut times, mut ratios) = ([Vec::new(), Vec::new()], Vec::new());
    for pair in 1..=pairs {
        // Every other pair runs the second recipe first, so that a cost of running second
        // (a cache or allocator state the other trainer left) falls on both alike.
        let second_first = pair % 2 == 0;
        let (a, b) = if second_first {
            let b = step(&mut trainers[1]);
            (step(&mut trainers[0]), b)
        } else {
            let a = step(&mut trainers[0]);
            (a, step(&mut trainers[1]))
        };
        let order = if second_first { " (second first)" } else { "" };
        println!(
            "pair {pair}: {first} {a:.3} s, {second} {b:.3} s, ratio {:.3}{order}",
            b / a
        );
        times[0].push(a);
        times[1].push(b);
        ratios.push(b / a);
    }
    for (name, times) in [first, second].iter().zip(times) {
        let median = quantile(&sorted(times), 0.5);
        println!(
            "{name}: median {median:.3} s/step, {:.0} tokens/s",
            tokens / median
        );
    }
    let ratios = sorted(ratios);
    println!(
        "{second} / {first}: median ratio {:.3}, quartiles {:.3} to {:.3}",
        quantile(&ratios, 0.5),
        quantile(&ratios, 0.25),
        quantile(&ratios, 0.75),
    );
    ExitCode::SUCCESS
}
