//! Step times of training recipes, as `tinyllm bench` measures them: one recipe on its own,
//! or two recipes paired step by step.
//!
//! What is timed is [`Trainer::train_step`], the very call `tinyllm train` makes once per
//! optimizer step: drawing the micro-batches, forward, backward, the reduction over the
//! ranks, clipping, the loss scaler's check and the AdamW update, and the one flushed line
//! of `metrics.jsonl`. Evaluations and checkpoints happen only between steps in
//! [`Trainer::run`], so none falls inside a timed step. Every trainer takes untimed warm-up
//! steps first (AdamW's moments appear at the first update, and the caching allocator fills
//! up).
//!
//! On a shared machine the speed drifts by more than the difference between two recipes
//! within minutes, so timings taken one after the other can rank two recipes either way.
//! The paired mode keeps both trainers side by side in one process and lets them take turns
//! (A then B, then B then A, ...), so that each pair sees the same machine and whatever
//! running second costs falls on both alike; the median of the per-pair ratios is what one
//! recipe costs against the other.

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tl_precision::{Accumulation, Precision};
use tl_tensor::kernels::gemm_limit::{GemmLimit, record_products};
use tl_tensor::memory;

use crate::error::{Result, TrainError};
use crate::model::Checkpointing;
use crate::process_memory::{peak_rss_bytes, reset_peak_rss};
use crate::train::{Record, STEP_RECIPES, StepRecipe, TrainConfig, Trainer};

/// The most timed steps (or pairs) one bench takes.
pub const MAX_BENCH_STEPS: usize = 10_000;

/// The median and quartiles of some measurements.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// The middle value (of an even count, the upper of the two middle values).
    pub median: f64,
    /// A quarter of the way up.
    pub q1: f64,
    /// Three quarters of the way up.
    pub q3: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
}

impl Spread {
    /// The spread of `values`; `None` when there are none.
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let at = |q: f64| sorted[((q * sorted.len() as f64) as usize).min(sorted.len() - 1)];
        (!sorted.is_empty()).then(|| Self {
            median: at(0.5),
            q1: at(0.25),
            q3: at(0.75),
            min: sorted[0],
            max: sorted[sorted.len() - 1],
        })
    }
}

/// The timed steps of one recipe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecipeTimes {
    /// The recipe's short name: `fp32`, `bf16+ckpt`, ... (see [`recipe_name`]).
    pub name: String,
    /// The arithmetic of its matmuls.
    pub precision: Precision,
    /// How its blocks keep activations.
    pub checkpointing: Checkpointing,
    /// Seconds of each timed step, in the order taken.
    pub step_s: Vec<f64>,
    /// Their spread.
    pub seconds: Spread,
    /// Tokens of the global batch per second, at the median step.
    pub tokens_per_s: f64,
    /// fp16 steps whose gradients overflowed (skipped updates: shorter steps).
    pub skipped: usize,
}

/// The per-pair comparison of the paired mode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Paired {
    /// `B / A` of each pair's step times, in the order taken.
    pub ratios: Vec<f64>,
    /// Whether B stepped first in each pair (every other pair).
    pub second_first: Vec<bool>,
    /// The spread of the ratios: the median is what B costs against A.
    pub ratio: Spread,
}

/// What `tinyllm bench` measured, as `--json` prints it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// tinyllm's version.
    pub tinyllm: String,
    /// Where it ran.
    pub machine: Machine,
    /// The run timed (for the paired mode, the first recipe's).
    pub config: TrainConfig,
    /// Ranks that took each step together.
    pub ranks: usize,
    /// Tokens of one optimizer step over all ranks.
    pub tokens_per_step: usize,
    /// Untimed steps each trainer took first.
    pub warmup_steps: usize,
    /// One recipe, or the two of the paired mode (A, then B).
    pub recipes: Vec<RecipeTimes>,
    /// The pairs' ratios, in the paired mode.
    pub paired: Option<Paired>,
    /// The peak of live tensor bytes over the timed steps (rank 0), single mode only: two
    /// trainers side by side share the meter.
    pub peak_live_bytes: Option<u64>,
    /// The process's peak resident memory (rank 0), single mode only; `None` where the
    /// system does not say.
    pub peak_rss_bytes: Option<u64>,
    /// What the GEMM alone takes for one step's products (`--gemm-limit`, single mode): the
    /// step after the timed ones, its products recorded, then each timed alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_limit: Option<GemmLimit>,
}

/// The machine a bench ran on: figures from different CPUs compare only as ratios.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// The CPU's model name, as the system reports it.
    pub cpu: String,
    /// Logical cores the system has.
    pub cores: usize,
    /// Compute threads of this process (rayon's pool).
    pub threads: usize,
    /// The vector units the kernels can use: `avx2`, `fma`, `avx512f`, `avx512bf16`, and
    /// `amx-bf16` when this process may use the AMX tiles.
    pub features: Vec<String>,
    /// The operating system and architecture.
    pub os: String,
}

impl Machine {
    /// This machine.
    pub fn this() -> Self {
        Self {
            cpu: cpu_model().unwrap_or_else(|| "unknown CPU".into()),
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            threads: rayon::current_num_threads(),
            features: cpu_features(),
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        }
    }

    /// One line: `Intel Xeon ... (2 cores, avx2 fma avx512f), 2 threads`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({} core{}{}), {} thread{}",
            self.cpu,
            self.cores,
            plural(self.cores),
            if self.features.is_empty() {
                String::new()
            } else {
                format!(", {}", self.features.join(" "))
            },
            self.threads,
            plural(self.threads),
        )
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The CPU's model name from `/proc/cpuinfo` (Linux) or `sysctl` (macOS).
fn cpu_model() -> Option<String> {
    if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
        return info
            .lines()
            .find(|line| line.starts_with("model name"))
            .and_then(|line| line.split_once(':'))
            .map(|(_, name)| name.trim().to_string());
    }
    let output = std::process::Command::new("sysctl")
        .args(["-n", "machdep.cpu.brand_string"])
        .output()
        .ok()?;
    let name = String::from_utf8(output.stdout).ok()?.trim().to_string();
    (!name.is_empty()).then_some(name)
}

/// The vector extensions the kernels dispatch on that this CPU has.
fn cpu_features() -> Vec<String> {
    #[allow(unused_mut)]
    let mut features: Vec<&str> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        for (name, present) in [
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
            (
                "avx512bf16",
                std::arch::is_x86_feature_detected!("avx512bf16"),
            ),
        ] {
            if present {
                features.push(name);
            }
        }
        if tl_tensor::kernels::bf16_dot::amx_available() {
            features.push("amx-bf16");
        }
    }
    #[cfg(target_arch = "aarch64")]
    features.push("neon");
    features.into_iter().map(String::from).collect()
}

/// The short name of a config's recipe: its precision, `+ckpt` with per-block
/// checkpointing (`+ckpt-matmuls`, `+ckpt-first-matmul` keeping those products),
/// `+ckptK` on the optimal schedule of K stored inputs.
///
/// ```
/// use tl_train::bench::recipe_name;
/// use tl_train::model::Checkpointing;
/// use tl_precision::Precision;
/// assert_eq!(recipe_name(Precision::Bf16, Checkpointing::PerBlock), "bf16+ckpt");
/// assert_eq!(recipe_name(Precision::Fp32, Checkpointing::Budget(2)), "fp32+ckpt2");
/// ```
pub fn recipe_name(precision: Precision, checkpointing: Checkpointing) -> String {
    named_recipe(precision.name(), checkpointing)
}

/// The short name of the recipe `config` trains in: [`recipe_name`], with fp8 in front of
/// the other products' precision: `fp8` for fp8 over fp32 (the [`STEP_RECIPES`] name of
/// `tinyllm train --fp8`), `bf16+fp8` over bf16; and the products' accumulation when it is
/// not f32, `bf16+amx`, `fp16+v100`.
///
/// ```
/// use tl_train::bench::config_recipe_name;
/// use tl_train::model::Preset;
/// use tl_train::train::TrainConfig;
/// use tl_precision::{Accumulation, Precision};
/// let mut config = TrainConfig::for_preset(Preset::Tiny);
/// assert_eq!(config_recipe_name(&config), "fp32");
/// config.fp8 = Some(Default::default());
/// assert_eq!(config_recipe_name(&config), "fp8");
/// config.fp8 = None;
/// config.precision = Precision::Bf16;
/// config.accumulation = Accumulation::Amx;
/// assert_eq!(config_recipe_name(&config), "bf16+amx");
/// ```
pub fn config_recipe_name(config: &TrainConfig) -> String {
    let mut precision = match (config.fp8.is_some(), config.precision) {
        (false, precision) => precision.name().to_string(),
        (true, Precision::Fp32) => "fp8".to_string(),
        (true, precision) => format!("{}+fp8", precision.name()),
    };
    if config.accumulation != Accumulation::F32 {
        precision = format!("{precision}+{}", config.accumulation);
    }
    named_recipe(&precision, config.checkpointing)
}

/// `precision` followed by the suffix of `checkpointing`.
fn named_recipe(precision: &str, checkpointing: Checkpointing) -> String {
    let checkpointing = match checkpointing {
        Checkpointing::Off => String::new(),
        Checkpointing::PerBlock => "+ckpt".into(),
        Checkpointing::Matmuls => "+ckpt-matmuls".into(),
        Checkpointing::FirstMatmul => "+ckpt-first-matmul".into(),
        Checkpointing::Budget(k) => format!("+ckpt{k}"),
    };
    format!("{precision}{checkpointing}")
}

/// `base` with the precision, checkpointing, fp8 and accumulation of `recipe`: the paired
/// mode's two runs differ only there. An fp8 recipe keeps `base`'s own fp8 recipe (its `--fp8-*` settings)
/// when it has one, and a recipe without fp8 drops it.
pub fn with_recipe(base: &TrainConfig, recipe: StepRecipe) -> TrainConfig {
    let fp8 = recipe.fp8.then(|| base.fp8.unwrap_or_default());
    TrainConfig {
        precision: recipe.precision,
        checkpointing: recipe.checkpointing,
        fp8,
        accumulation: recipe.accumulation,
        ..base.clone()
    }
}

/// The two named recipes of `--paired A,B`.
///
/// # Errors
/// [`TrainError::InvalidArgument`] naming the known recipes when either is unknown.
pub fn paired_recipes(names: &[String]) -> Result<[StepRecipe; 2]> {
    let known = || {
        STEP_RECIPES
            .iter()
            .map(|recipe| recipe.name)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let [a, b] = names else {
        return Err(TrainError::InvalidArgument {
            name: "paired",
            value: names.join(","),
            reason: format!("expected two recipes, A,B, out of {}", known()),
        });
    };
    let find = |name: &String| {
        StepRecipe::named(name).ok_or_else(|| TrainError::InvalidArgument {
            name: "paired",
            value: name.clone(),
            reason: format!("is not a recipe; the recipes are {}", known()),
        })
    };
    Ok([find(a)?, find(b)?])
}

/// How a bench runs: the trainers' run directories (one each, created inside `dir`), the
/// warm-up and the timed steps, and what to call after each timed step.
pub struct BenchPlan<'a> {
    /// Where the trainers' run directories go (a temporary directory).
    pub dir: &'a Path,
    /// Untimed steps each trainer takes first (at least 1).
    pub warmup_steps: usize,
    /// Timed steps, or pairs in the paired mode.
    pub steps: usize,
    /// Whether to measure the step's GEMM limit after the timed steps (fp32 recipes, single
    /// mode): one more step with its products recorded, then each product timed alone
    /// ([`tl_tensor::kernels::gemm_limit`]).
    pub gemm_limit: bool,
}

impl BenchPlan<'_> {
    fn check(&self) -> Result<()> {
        let invalid = |name: &'static str, value: usize| {
            Err(TrainError::InvalidArgument {
                name,
                value: value.to_string(),
                reason: format!("must be in 1..={MAX_BENCH_STEPS}"),
            })
        };
        if !(1..=MAX_BENCH_STEPS).contains(&self.steps) {
            return invalid("steps", self.steps);
        }
        if !(1..=MAX_BENCH_STEPS).contains(&self.warmup_steps) {
            return invalid("warmup", self.warmup_steps);
        }
        Ok(())
    }
}

/// A trainer and what its timed steps gave.
struct Timed {
    trainer: Trainer,
    step_s: Vec<f64>,
    skipped: usize,
}

impl Timed {
    /// Takes one step; `record` says whether to time it.
    fn step(&mut self, record: bool) -> Result<f64> {
        let start = Instant::now();
        let taken = self.trainer.train_step()?;
        let seconds = start.elapsed().as_secs_f64();
        if record {
            self.step_s.push(seconds);
            if let Record::Train { skipped: true, .. } = taken {
                self.skipped += 1;
            }
        }
        Ok(seconds)
    }

    fn into_times(self, tokens_per_step: usize) -> RecipeTimes {
        let config = self.trainer.config();
        let seconds = Spread::of(&self.step_s).expect("at least one timed step");
        RecipeTimes {
            name: config_recipe_name(config),
            precision: config.precision,
            checkpointing: config.checkpointing,
            tokens_per_s: tokens_per_step as f64 / seconds.median,
            seconds,
            step_s: self.step_s,
            skipped: self.skipped,
        }
    }
}

/// The trainer of `config` in `plan.dir`'s subdirectory `name`, on the ranks of `start`.
fn trainer(
    config: &TrainConfig,
    plan: &BenchPlan<'_>,
    name: &str,
    start: &mut dyn FnMut(TrainConfig, &Path) -> Result<Trainer>,
) -> Result<Timed> {
    let mut config = config.clone();
    // Steps enough for the warm-up, the timed ones and the one recorded for the GEMM limit;
    // no checkpoint or evaluation is taken by `train_step` anyway.
    let steps = (plan.warmup_steps + plan.steps + usize::from(plan.gemm_limit)) as u64;
    config.steps = config.steps.max(steps);
    config.lr.total = config.lr.total.max(steps);
    let trainer = start(config, &plan.dir.join(name))?;
    Ok(Timed {
        trainer,
        step_s: Vec::new(),
        skipped: 0,
    })
}

/// Times `plan.steps` steps of `config` after the warm-up, then measures the step's GEMM
/// limit if the plan asks. `start` makes a trainer of a config in a run directory (on this
/// process's ranks); `on_step` hears each timed step's index and seconds.
///
/// # Errors
/// Whatever starting the trainer or a step returns, or [`TrainError::InvalidArgument`] for
/// a plan out of range or a GEMM limit asked of a recipe whose products are not the f32
/// GEMM's.
pub fn bench_one(
    config: &TrainConfig,
    plan: &BenchPlan<'_>,
    start: &mut dyn FnMut(TrainConfig, &Path) -> Result<Trainer>,
    on_step: &mut dyn FnMut(usize, f64),
) -> Result<BenchReport> {
    plan.check()?;
    if plan.gemm_limit {
        check_gemm_limit(config)?;
    }
    let mut timed = trainer(config, plan, "run", start)?;
    for _ in 0..plan.warmup_steps {
        timed.step(false)?;
    }
    memory::reset_peak();
    reset_peak_rss();
    for i in 1..=plan.steps {
        let seconds = timed.step(true)?;
        on_step(i, seconds);
    }
    let peaks = (Some(memory::peak_bytes() as u64), peak_rss_bytes());
    let limit = if plan.gemm_limit {
        let (taken, products) = record_products(|| timed.step(false));
        taken?;
        Some(products.time_alone())
    } else {
        None
    };
    let mut report = report(vec![timed], plan, None, peaks);
    report.gemm_limit = limit;
    Ok(report)
}

/// Refuses a GEMM limit for a recipe whose products do not all run on the f32 GEMM: a
/// limit of some of them would bound nothing.
fn check_gemm_limit(config: &TrainConfig) -> Result<()> {
    if config.precision == Precision::Fp32 && config.fp8.is_none() {
        return Ok(());
    }
    Err(TrainError::InvalidArgument {
        name: "gemm-limit",
        value: config_recipe_name(config),
        reason: "the GEMM limit bounds a step whose products all run on the f32 GEMM: an fp32 \
                 recipe (bf16, fp16 and fp8 products run on kernels of their own)"
            .into(),
    })
}

/// The paired mode: `plan.steps` pairs of one step of `base` in recipe A and one in
/// recipe B, taking turns (B first in every other pair). `on_pair` hears each pair's index
/// and the seconds of A and B.
///
/// # Errors
/// As [`bench_one`].
pub fn bench_paired(
    base: &TrainConfig,
    recipes: [StepRecipe; 2],
    plan: &BenchPlan<'_>,
    start: &mut dyn FnMut(TrainConfig, &Path) -> Result<Trainer>,
    on_pair: &mut dyn FnMut(usize, f64, f64),
) -> Result<BenchReport> {
    plan.check()?;
    if plan.gemm_limit {
        return Err(TrainError::InvalidArgument {
            name: "gemm-limit",
            value: "true".into(),
            reason: "measures one recipe's step: leave out --paired".into(),
        });
    }
    let mut a = trainer(&with_recipe(base, recipes[0]), plan, "a", start)?;
    let mut b = trainer(&with_recipe(base, recipes[1]), plan, "b", start)?;
    for _ in 0..plan.warmup_steps {
        a.step(false)?;
        b.step(false)?;
    }
    let (mut ratios, mut second_first) = (Vec::new(), Vec::new());
    for pair in 1..=plan.steps {
        // Every other pair runs B first, so that a cost of running second (a cache or an
        // allocator state the other trainer left) falls on both alike.
        let b_first = pair % 2 == 0;
        let (a_s, b_s) = if b_first {
            let b_s = b.step(true)?;
            (a.step(true)?, b_s)
        } else {
            let a_s = a.step(true)?;
            (a_s, b.step(true)?)
        };
        on_pair(pair, a_s, b_s);
        ratios.push(b_s / a_s);
        second_first.push(b_first);
    }
    let paired = Paired {
        ratio: Spread::of(&ratios).expect("at least one pair"),
        ratios,
        second_first,
    };
    Ok(report(vec![a, b], plan, Some(paired), (None, None)))
}

/// The report of the timed trainers (the first one's config), with the peaks of live
/// tensors and of the process's memory when they were measured.
fn report(
    timed: Vec<Timed>,
    plan: &BenchPlan<'_>,
    paired: Option<Paired>,
    (peak_live_bytes, peak_rss_bytes): (Option<u64>, Option<u64>),
) -> BenchReport {
    let config = timed[0].trainer.config().clone();
    let tokens_per_step = config.tokens_per_step();
    BenchReport {
        tinyllm: crate::build_info::VERSION.to_string(),
        machine: Machine::this(),
        ranks: config.parallel.ranks,
        tokens_per_step,
        warmup_steps: plan.warmup_steps,
        recipes: timed
            .into_iter()
            .map(|t| t.into_times(tokens_per_step))
            .collect(),
        paired,
        peak_live_bytes,
        peak_rss_bytes,
        gemm_limit: None,
        config,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    #[test]
    fn the_spread_picks_the_median_and_quartiles_of_sorted_values() {
        let spread = Spread::of(&[5.0, 1.0, 4.0, 2.0, 3.0]).unwrap();
        assert_eq!(
            (spread.median, spread.q1, spread.q3, spread.min, spread.max),
            (3.0, 2.0, 4.0, 1.0, 5.0)
        );
        assert_eq!(Spread::of(&[2.0, 1.0]).unwrap().median, 2.0);
        assert_eq!(Spread::of(&[7.0]).unwrap().q3, 7.0);
        assert!(Spread::of(&[]).is_none());
    }

    #[test]
    fn a_paired_recipe_changes_only_the_precision_the_checkpointing_and_fp8() {
        let base = TrainConfig::for_preset(Preset::Tiny);
        let [a, b] = paired_recipes(&["fp32".into(), "bf16+ckpt".into()]).unwrap();
        let (a, b) = (with_recipe(&base, a), with_recipe(&base, b));
        assert_eq!(a, base);
        assert_eq!(b.precision, Precision::Bf16);
        assert_eq!(b.checkpointing, Checkpointing::PerBlock);
        assert_eq!(
            TrainConfig {
                precision: base.precision,
                checkpointing: base.checkpointing,
                ..b
            },
            base
        );
        let [bf16, fp8] = paired_recipes(&["bf16".into(), "fp8".into()]).unwrap();
        let (bf16, fp8) = (with_recipe(&base, bf16), with_recipe(&base, fp8));
        assert_eq!((bf16.precision, bf16.fp8), (Precision::Bf16, None));
        assert_eq!(fp8.precision, Precision::Fp32);
        assert_eq!(fp8.fp8, Some(tl_precision::Fp8Recipe::default()));
        assert_eq!(TrainConfig { fp8: None, ..fp8 }, base);
        // A recipe of fp8's own (`--fp8-margin 2`) is the one an fp8 run takes.
        let tuned = TrainConfig {
            fp8: Some(tl_precision::Fp8Recipe {
                margin: 2,
                ..Default::default()
            }),
            ..base.clone()
        };
        let [fp32, fp8] = paired_recipes(&["fp32".into(), "fp8".into()]).unwrap();
        assert_eq!(with_recipe(&tuned, fp8), tuned);
        assert_eq!(with_recipe(&tuned, fp32).fp8, None);
    }

    #[test]
    fn unknown_or_missing_paired_recipes_are_refused_by_name() {
        for names in [vec!["fp32".to_string()], vec!["fp32".into(), "fp9".into()]] {
            match paired_recipes(&names) {
                Err(TrainError::InvalidArgument { name, reason, .. }) => {
                    assert_eq!(name, "paired");
                    assert!(reason.contains("bf16+ckpt"), "{reason}");
                }
                other => panic!("{names:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_machine_names_its_cpu_and_threads() {
        let machine = Machine::this();
        assert!(machine.cores >= 1 && machine.threads >= 1);
        assert!(machine.describe().contains(&machine.cpu));
    }

    /// The GEMM limit of `config`'s step on a fresh trainer in `dir` (one warm-up, one timed
    /// step).
    fn gemm_limit_of(config: &TrainConfig, dir: &Path) -> Result<BenchReport> {
        let plan = BenchPlan {
            dir,
            warmup_steps: 1,
            steps: 1,
            gemm_limit: true,
        };
        bench_one(
            config,
            &plan,
            &mut |c, d| Trainer::new(c, d),
            &mut |_, _| {},
        )
    }

    #[test]
    fn a_gemm_limit_is_refused_where_products_leave_the_f32_gemm_or_for_two_recipes() {
        let dir = tempfile::tempdir().unwrap();
        let tiny = TrainConfig::tiny_for_tests();
        let refused = |result: Result<BenchReport>, recipe: &str| match result {
            Err(TrainError::InvalidArgument { name, value, .. }) => {
                assert_eq!((name, value.as_str()), ("gemm-limit", recipe));
            }
            other => panic!("{recipe}: {other:?}"),
        };
        let bf16 = TrainConfig {
            precision: Precision::Bf16,
            ..tiny.clone()
        };
        refused(gemm_limit_of(&bf16, dir.path()), "bf16");
        let fp8 = TrainConfig {
            fp8: Some(tl_precision::Fp8Recipe::default()),
            ..tiny.clone()
        };
        refused(gemm_limit_of(&fp8, dir.path()), "fp8");
        let plan = BenchPlan {
            dir: dir.path(),
            warmup_steps: 1,
            steps: 1,
            gemm_limit: true,
        };
        let recipes = paired_recipes(&["fp32".into(), "fp32+ckpt".into()]).unwrap();
        let paired = bench_paired(
            &tiny,
            recipes,
            &plan,
            &mut |c, d| Trainer::new(c, d),
            &mut |_, _, _| {},
        );
        refused(paired, "true");
        // Nothing was started: no run directory.
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
    }

    #[test]
    fn a_bench_times_the_steps_it_was_asked_for_after_the_warmup() {
        let dir = tempfile::tempdir().unwrap();
        let config = TrainConfig {
            micro_batch: 1,
            accum: 1,
            ..TrainConfig::tiny_for_tests()
        };
        let plan = BenchPlan {
            dir: dir.path(),
            warmup_steps: 1,
            steps: 3,
            gemm_limit: false,
        };
        let mut seen = Vec::new();
        let report = bench_one(
            &config,
            &plan,
            &mut |config, dir| Trainer::new(config, dir),
            &mut |i, s| seen.push((i, s)),
        )
        .unwrap();
        assert_eq!(seen.iter().map(|&(i, _)| i).collect::<Vec<_>>(), [1, 2, 3]);
        let [times] = report.recipes.as_slice() else {
            panic!("one recipe")
        };
        assert_eq!(
            times.step_s,
            seen.iter().map(|&(_, s)| s).collect::<Vec<_>>()
        );
        assert_eq!(times.name, "fp32");
        assert_eq!(report.tokens_per_step, 64);
        assert!((times.tokens_per_s - 64.0 / times.seconds.median).abs() < 1e-9);
        assert!(report.peak_live_bytes.unwrap() > 0);
        // The warm-up and the timed steps were taken, nothing more.
        let records = crate::train::read_records(&dir.path().join("run/metrics.jsonl")).unwrap();
        assert_eq!(records.len(), 4);

        let paired = bench_paired(
            &config,
            paired_recipes(&["fp32".into(), "bf16".into()]).unwrap(),
            &BenchPlan { steps: 2, ..plan },
            &mut |config, dir| Trainer::new(config, dir),
            &mut |_, _, _| {},
        )
        .unwrap();
        let pairs = paired.paired.unwrap();
        assert_eq!(pairs.second_first, [false, true]);
        let names: Vec<&str> = paired.recipes.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["fp32", "bf16"]);
        for (i, ratio) in pairs.ratios.iter().enumerate() {
            let [a, b] = [0, 1].map(|r| paired.recipes[r].step_s[i]);
            assert_eq!(*ratio, b / a);
        }
    }
}
