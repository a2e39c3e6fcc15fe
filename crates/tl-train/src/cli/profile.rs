//! `tinyllm profile`: record the live tensor memory of a training step, plain and
//! checkpointed, and draw the two timelines on one chart.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;

use super::train::{config_from_flags, shrink_builtin_corpus};
use super::{Exit, RecipeArgs, TrainArgs};
use crate::error::{Result, TrainError};
use crate::model::head_loss::ChunkedLoss;
use crate::model::{Checkpointing, Preset};
use crate::plan::{MemoryPlan, Recipe};
use crate::profile::{
    Profile, ProfileConfig, X_AXIS, policy_table, record_run, run_label, table, timeline_path,
    write_profile,
};

/// Bytes of built-in corpus to generate: the batches' content does not change the memory
/// figures, so a little text is enough (and quick to make).
const CORPUS_BYTES: usize = 100_000;

/// Options of `tinyllm profile`.
#[derive(Debug, Args, Default)]
pub struct ProfileArgs {
    /// The model and the recipe, as `tinyllm train` takes them. The recipe's checkpointing
    /// (per block when none is given) is profiled against the plain run.
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Profile the model and recipe of this config file (a run's `config.json`, or TOML by
    /// its `.toml` extension); flags given too override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Record the four checkpoint policies (none, matmuls, first-matmul, block) on the same
    /// seed instead of plain against the recipe's, each beside the plan's prediction.
    #[arg(long)]
    pub policies: bool,
    /// Steady-state steps to record, after one unrecorded warm-up step.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub steps: usize,
    /// Seed of the weights and batches (both runs use it).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// The chart to write (SVG); the raw timeline goes beside it as .json
    /// [default: profile-PRESET.svg].
    #[arg(long, value_name = "FILE.svg")]
    pub out: Option<PathBuf>,
    /// Compute threads.
    #[command(flatten)]
    pub threads: super::Threads,
}

/// Runs `tinyllm profile`: every argument is checked before any work, so a bad one writes
/// nothing.
pub(super) fn profile(args: &ProfileArgs) -> Result<Exit> {
    let config = config_from_args(args)?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| default_out(config.train.preset.map_or("custom", Preset::name)));
    check_out(&out)?;
    print_header(&config, args.policies);

    let modes = if args.policies {
        Checkpointing::POLICIES.to_vec()
    } else {
        vec![Checkpointing::Off, config.train.checkpointing]
    };
    let mut runs = Vec::new();
    for checkpointing in modes {
        let mut run = config.clone();
        run.train.checkpointing = checkpointing;
        say!("recording {} ...", run_label(checkpointing));
        let started = Instant::now();
        runs.push(record_run(&run)?);
        say!("  done in {:.1} s", started.elapsed().as_secs_f64());
    }
    // The recipe's step once more with the chunked loss the other way: its peak beside.
    let chunked = config.train.chunked_loss.resolve(&config.train.model);
    let mut toggled = config.clone();
    toggled.train.chunked_loss = match chunked {
        true => ChunkedLoss::Off,
        false => ChunkedLoss::On,
    };
    say!(
        "recording the chunked loss {} ...",
        if chunked { "off" } else { "on" }
    );
    let other_peak = record_run(&toggled)?.peak().bytes;
    let profile = Profile { config, runs };
    let json = write_profile(&profile, &out)?;
    print!("{}", table(&profile));
    let recipe_peak = (profile.runs.iter())
        .find(|run| run.checkpointing == profile.config.train.checkpointing)
        .map_or(0, |run| run.peak().bytes);
    let (on, off) = match chunked {
        true => (recipe_peak, other_peak),
        false => (other_peak, recipe_peak),
    };
    println!(
        "chunked loss (--chunked-loss {}: {}): measured peak {:.1} MiB with it on, {:.1} MiB off",
        profile.config.train.chunked_loss,
        if chunked { "on" } else { "off" },
        on as f64 / f64::from(1u32 << 20),
        off as f64 / f64::from(1u32 << 20),
    );
    if args.policies {
        let plan = MemoryPlan::new(&Recipe::from(&profile.config.train))?;
        print!("\n{}", policy_table(&profile, &plan));
    }
    println!("chart: {}", out.display());
    println!("timeline: {}", json.display());
    Ok(Exit::Success)
}

/// The profile the flags describe; the checkpointing is the mode set against the plain run.
fn config_from_args(args: &ProfileArgs) -> Result<ProfileConfig> {
    let train_args = TrainArgs {
        recipe: args.recipe.clone(),
        config: args.config.clone(),
        seed: Some(args.seed),
        ..TrainArgs::default()
    };
    let mut train = config_from_flags(&train_args)?;
    shrink_builtin_corpus(&mut train, CORPUS_BYTES);
    if train.checkpointing == Checkpointing::Off {
        train.checkpointing = Checkpointing::PerBlock;
    }
    let config = ProfileConfig {
        train,
        steps: args.steps,
    };
    config.validate()?;
    Ok(config)
}

fn default_out(preset: &str) -> PathBuf {
    PathBuf::from(format!("profile-{preset}.svg"))
}

/// Refuses an `--out` that cannot become a chart file: not `.svg` (the chart is drawn as
/// SVG only), a directory (or its `.json` twin is), or in a directory that does not exist
/// or is read-only. Checked
/// before the profile runs, which can take minutes.
fn check_out(out: &Path) -> Result<()> {
    let refuse = |reason: &str| {
        Err(TrainError::InvalidArgument {
            name: "out",
            value: out.display().to_string(),
            reason: reason.to_string(),
        })
    };
    let is_svg = out
        .extension()
        .is_some_and(|extension| extension.eq_ignore_ascii_case("svg"));
    if !is_svg {
        return refuse(
            "the chart is written as SVG: name a .svg file (convert it with rsvg-convert for a PNG)",
        );
    }
    if out.is_dir() {
        return refuse("is a directory");
    }
    if timeline_path(out).is_dir() {
        return refuse("the timeline beside it (.json) would replace a directory");
    }
    let parent = match out.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    match std::fs::metadata(parent) {
        Ok(meta) if !meta.is_dir() => refuse("its parent is not a directory"),
        Ok(meta) if meta.permissions().readonly() => refuse("its directory is read-only"),
        Ok(_) => Ok(()),
        Err(_) => refuse("its directory does not exist"),
    }
}

fn print_header(config: &ProfileConfig, policies: bool) {
    let train = &config.train;
    say!(
        "tinyllm profile: {} ({} parameters), {}, micro-batch {} x accum {} x context {}, {}",
        train.preset.map_or("custom", Preset::name),
        train.model.num_parameters(),
        train.precision,
        train.micro_batch,
        train.accum,
        train.model.context,
        if policies {
            "the four checkpoint policies".to_string()
        } else {
            format!("plain vs {}", run_label(train.checkpointing))
        },
    );
    say!(
        "each run: one warm-up step (AdamW's moments appear), then {} recorded step{}; x axis: {X_AXIS}",
        config.steps,
        if config.steps == 1 { "" } else { "s" },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_precision::Precision;

    #[test]
    fn the_defaults_profile_the_trainers_step_against_per_block_checkpointing() {
        let config = config_from_args(&ProfileArgs {
            steps: 1,
            ..ProfileArgs::default()
        })
        .unwrap();
        assert_eq!(config.train.preset, Some(Preset::Small));
        assert_eq!((config.train.micro_batch, config.train.accum), (8, 4));
        assert_eq!(config.train.precision, Precision::Fp32);
        assert_eq!(config.train.checkpointing, Checkpointing::PerBlock);
        assert_eq!(default_out("small"), Path::new("profile-small.svg"));
    }

    #[test]
    fn an_out_that_cannot_hold_the_chart_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let reason = |out: &Path| match check_out(out) {
            Err(TrainError::InvalidArgument { name, reason, .. }) => {
                assert_eq!(name, "out");
                reason
            }
            other => panic!("{}: {other:?}", out.display()),
        };
        assert!(reason(&dir.path().join("chart.png")).contains("SVG"));
        assert_eq!(
            reason(&dir.path().join("missing/chart.svg")),
            "its directory does not exist"
        );
        let folder = dir.path().join("folder.svg");
        std::fs::create_dir(&folder).unwrap();
        assert_eq!(reason(&folder), "is a directory");
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert_eq!(
            reason(&file.join("chart.svg")),
            "its parent is not a directory"
        );
        check_out(&dir.path().join("chart.SVG")).unwrap();
        check_out(Path::new("chart.svg")).unwrap();
    }
}
