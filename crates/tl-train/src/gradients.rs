//! `tinyllm gradients`: where a model's gradients lie against fp16's window, and what loss
//! scaling does about it.
//!
//! fp16 has normal numbers from 2^-14 to 65,504 and subnormals down to 2^-24; a gradient
//! entry below 2^-24 is flushed to zero when a backward pass rounds it to fp16, one between
//! them keeps fewer bits. Loss scaling multiplies the loss by `S` before backward, so every
//! gradient is `S` times larger while it passes through fp16, and divides by `S` after. This
//! module measures both sides of that trade on one batch:
//!
//! - [`reference()`]: the f32 gradients of every parameter, the reference;
//! - [`Histogram`]: the histogram of `log2 |g|` over the nonzero entries, all parameters
//!   together and per [`ParamKind`], with the shares below 2^-24 and 2^-14;
//! - [`scale_window`]: the loss scales that put 99.9% of the scaled entries `S·g` in fp16's
//!   normal range (an exact interval in `log2 S`, computed from the sorted exponents);
//! - [`sweep`]: for `S = 2^0, 2^2, …, 2^24`, the gradients of `S·loss` under fp16 and bf16
//!   autocast, divided by `S`, and their relative error `‖ĝ − g‖ / ‖g‖` against the
//!   reference, runs with non-finite entries marked.
//!
//! Why fp16 can beat bf16: both round each gradient to a 16-bit value on its way back, and
//! the relative error of a rounding is at most `2^-11` in fp16 against `2^-8` in bf16 — as
//! long as the value is a normal fp16 number. Inside the window (the scale puts almost every
//! entry in the normal range and nothing overflows) fp16's three extra significand bits give
//! it about eight times less error; below the window it flushes, above it overflows.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tl_numerics::Format;
use tl_precision::autocast;
use tl_tensor::Generator;
use tl_tensor::nn::Module;

use crate::chart::{AnnotatedChart, Band, LineChart, Note, Series, render_annotated_chart};
use crate::data::{Batch, sample_batch};
use crate::error::{Result, TrainError};
use crate::model::Llama;
use crate::store::write_atomic;
use crate::train::{TrainConfig, load_corpus};

/// The batch stream's seed, derived from the given seed (any fixed value would do).
const BATCH_STREAM: u64 = 0x6A4D_1E57_0F16_0001;

/// The share of scaled entries the loss-scale window must put in fp16's normal range.
pub const COVERAGE: f64 = 0.999;

/// `log2` of fp16's largest finite value, 65,504.
pub fn log2_fp16_max() -> f64 {
    Format::Fp16.max_finite().log2()
}

/// The loss scales of the sweep: `2^0, 2^2, …, 2^24`, as exponents.
pub const SWEEP_EXPONENTS: [i32; 13] = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24];

/// The exponent of `torch.amp.GradScaler`'s (and tinyllm's) initial loss scale, 2^16.
pub const DEFAULT_SCALE_EXPONENT: i32 = 16;

/// What a parameter is, for the per-kind histograms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ParamKind {
    /// The token embedding.
    Embedding,
    /// The attention projections `wq`, `wk`, `wv`, `wo`.
    Attention,
    /// The MLP projections `w1`, `w3`, `w2`.
    Mlp,
    /// The RMSNorm gains.
    Norms,
    /// The output head.
    Head,
}

impl ParamKind {
    /// The five kinds, in model order.
    pub const ALL: [ParamKind; 5] = [
        ParamKind::Embedding,
        ParamKind::Attention,
        ParamKind::Mlp,
        ParamKind::Norms,
        ParamKind::Head,
    ];

    /// The kind of the parameter named `name` ([`Llama::named_parameters`]' names).
    ///
    /// ```
    /// use tl_train::gradients::ParamKind;
    /// assert_eq!(ParamKind::of("blocks.3.wk.weight"), ParamKind::Attention);
    /// assert_eq!(ParamKind::of("blocks.0.n2.w"), ParamKind::Norms);
    /// assert_eq!(ParamKind::of("norm.w"), ParamKind::Norms);
    /// assert_eq!(ParamKind::of("head.weight"), ParamKind::Head);
    /// ```
    pub fn of(name: &str) -> ParamKind {
        let leaf = name.rsplit('.').nth(1).unwrap_or(name);
        match leaf {
            "emb" => ParamKind::Embedding,
            "wq" | "wk" | "wv" | "wo" => ParamKind::Attention,
            "w1" | "w2" | "w3" => ParamKind::Mlp,
            "head" => ParamKind::Head,
            _ => ParamKind::Norms,
        }
    }

    /// Its name in tables, charts and JSON.
    pub fn name(self) -> &'static str {
        match self {
            ParamKind::Embedding => "embedding",
            ParamKind::Attention => "attention",
            ParamKind::Mlp => "mlp",
            ParamKind::Norms => "norms",
            ParamKind::Head => "head",
        }
    }
}

/// One parameter's f32 gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradient {
    /// The parameter's name.
    pub name: String,
    /// Its kind.
    pub kind: ParamKind,
    /// The gradient's entries, in the parameter's order.
    pub values: Vec<f32>,
}

/// `floor(log2 |x|)` of a nonzero finite f32, exactly (subnormals included): the binade
/// `[2^e, 2^(e+1))` that holds `|x|`.
///
/// ```
/// use tl_train::gradients::binade;
/// assert_eq!(binade(1.0), 0);
/// assert_eq!(binade(-0.75), -1);
/// assert_eq!(binade(f32::from_bits(1)), -149); // the smallest subnormal
/// assert_eq!(binade(1.999_999_9), 0);
/// ```
///
/// # Panics
/// For zero, infinities and NaN.
pub fn binade(x: f32) -> i32 {
    assert!(x != 0.0 && x.is_finite(), "binade of {x}");
    let bits = x.to_bits() & 0x7FFF_FFFF;
    let exponent = (bits >> 23) as i32;
    if exponent == 0 {
        // A subnormal: 2^-149 times its significand, whose top bit gives the binade.
        -149 + (31 - bits.leading_zeros() as i32)
    } else {
        exponent - 127
    }
}

/// The histogram of `log2 |g|` over the nonzero entries of some gradients.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    /// What the entries are: `"all"` or a [`ParamKind`]'s name.
    pub label: String,
    /// Entries in all.
    pub entries: u64,
    /// Entries that are exactly zero (left out of the bins).
    pub zeros: u64,
    /// `(e, n)`: `n` nonzero entries with `2^e ≤ |g| < 2^(e+1)`, by increasing `e`, empty
    /// binades left out.
    pub bins: Vec<(i32, u64)>,
    /// The share of the nonzero entries below fp16's smallest subnormal, 2^-24 (flushed to
    /// zero when rounded to fp16, half of them and more).
    pub below_fp16_subnormal: f64,
    /// The share below fp16's smallest normal, 2^-14 (subnormal in fp16, or flushed).
    pub below_fp16_normal: f64,
}

impl Histogram {
    /// The histogram of `values`, named `label`.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] when a value is not finite: the reference gradients
    /// of a diverged model say nothing about a window.
    pub fn of<'a>(label: &str, values: impl IntoIterator<Item = &'a f32>) -> Result<Self> {
        let mut bins = std::collections::BTreeMap::<i32, u64>::new();
        let (mut entries, mut zeros) = (0u64, 0u64);
        for &value in values {
            entries += 1;
            if !value.is_finite() {
                return Err(TrainError::InvalidArgument {
                    name: "gradients",
                    value: value.to_string(),
                    reason: format!("a reference gradient of {label} is not finite"),
                });
            }
            if value == 0.0 {
                zeros += 1;
            } else {
                *bins.entry(binade(value)).or_default() += 1;
            }
        }
        let nonzero = (entries - zeros).max(1) as f64;
        let below = |e: i32| bins.range(..e).map(|(_, n)| n).sum::<u64>() as f64 / nonzero;
        Ok(Self {
            label: label.to_string(),
            entries,
            zeros,
            below_fp16_subnormal: below(-24),
            below_fp16_normal: below(-14),
            bins: bins.into_iter().collect(),
        })
    }

    /// The nonzero entries.
    pub fn nonzero(&self) -> u64 {
        self.entries - self.zeros
    }
}

/// The loss scales `S` that put at least [`COVERAGE`] of the nonzero entries `S·g` in
/// fp16's normal range `[2^-14, 65504]`: the intervals of `log2 S` (closed, merged, in
/// increasing order) where that holds, and which whole powers of two lie in them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScaleWindow {
    /// The share asked for.
    pub coverage: f64,
    /// `[lo, hi]` ranges of `log2 S`; empty when no scale covers that share (the entries
    /// span more than fp16's 30 binades).
    pub log2_intervals: Vec<(f64, f64)>,
    /// The integers `k` with `2^k` in the window.
    pub powers: Vec<i32>,
    /// Whether the default 2^16 is one of them.
    pub default_inside: bool,
}

/// The [`ScaleWindow`] of `values` (their zeros left out) for `coverage`.
///
/// With `x_1 ≤ … ≤ x_n` the sorted `log2 |g|` and `m = ⌈coverage · n⌉`, a scale `2^s`
/// covers the `m` entries `x_i … x_(i+m-1)` exactly when `-14 ≤ x_i + s` and
/// `x_(i+m-1) + s ≤ log2 65504`; the window is the union of those `s` over `i`.
///
/// ```
/// use tl_train::gradients::scale_window;
/// // 1000 entries at 2^-30 and one at 2^10: 99.9% of them fit from S = 2^16 on, and the
/// // largest S keeps 2^-30·S at or below 65,504.
/// let mut values = vec![2f32.powi(-30); 1000];
/// values.push(1024.0);
/// let window = scale_window(&values, 0.999);
/// assert_eq!(window.log2_intervals.len(), 1);
/// let (lo, hi) = window.log2_intervals[0];
/// assert_eq!(lo, 16.0);
/// assert!((hi - (30.0 + 65504f64.log2())).abs() < 1e-12);
/// assert!(window.default_inside);
/// ```
pub fn scale_window(values: &[f32], coverage: f64) -> ScaleWindow {
    let mut logs: Vec<f64> = values
        .iter()
        .filter(|v| **v != 0.0 && v.is_finite())
        .map(|v| f64::from(v.abs()).log2())
        .collect();
    logs.sort_by(f64::total_cmp);
    let n = logs.len();
    let m = ((coverage * n as f64).ceil() as usize).clamp(1, n.max(1));
    let (low, high) = (Format::Fp16.min_normal().log2(), log2_fp16_max());
    let mut intervals: Vec<(f64, f64)> = Vec::new();
    if n > 0 {
        for i in 0..=n - m {
            let (lo, hi) = (low - logs[i], high - logs[i + m - 1]);
            if lo <= hi {
                match intervals.last_mut() {
                    // The starts decrease with i: merge an interval that overlaps.
                    Some(last) if hi >= last.0 => last.0 = last.0.min(lo),
                    _ => intervals.push((lo, hi)),
                }
            }
        }
    }
    intervals.reverse();
    // Each interval was built from one i; merging kept the widest reach of each run.
    let powers: Vec<i32> = intervals
        .iter()
        .flat_map(|&(lo, hi)| (lo.ceil() as i32)..=(hi.floor() as i32))
        .collect();
    ScaleWindow {
        coverage,
        default_inside: powers.contains(&DEFAULT_SCALE_EXPONENT),
        log2_intervals: intervals,
        powers,
    }
}

/// One run of the sweep: the gradients of `S·loss` under autocast in `format`, divided by
/// `S`, against the reference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepRun {
    /// `fp16` or `bf16`.
    pub format: String,
    /// `log2 S`.
    pub log2_scale: i32,
    /// `‖ĝ − g‖ / ‖g‖` over every parameter, `None` when an entry is not finite.
    pub relative_error: Option<f64>,
    /// The same per kind, in [`ParamKind::ALL`] order (`None` where not finite).
    pub by_kind: Vec<(ParamKind, Option<f64>)>,
    /// Entries of `ĝ` that are infinite or NaN (an overflow in fp16's range).
    pub non_finite: u64,
    /// Entries that are zero in `ĝ` but not in the reference (flushed on the way back).
    pub lost: u64,
}

/// Everything `tinyllm gradients` measures, as its JSON holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradientReport {
    /// Where the weights come from: `"initialisation (seed S)"` or the run and its step.
    pub weights: String,
    /// Trainable scalars.
    pub parameters: u64,
    /// Sequences × tokens of the batch.
    pub batch: (usize, usize),
    /// The batch's f32 loss, nats per token.
    pub loss: f64,
    /// All parameters together, then each kind.
    pub histograms: Vec<Histogram>,
    /// The loss scales that fit the gradients into fp16's normal range.
    pub window: ScaleWindow,
    /// The sweep, fp16 runs first, each by increasing scale.
    pub sweep: Vec<SweepRun>,
}

/// The f32 gradients of the mean loss on `batch`, every parameter, no autocast.
///
/// # Errors
/// [`TrainError::Recompute`] when the model's checkpointing admits no schedule.
pub fn reference(model: &Llama<f32>, batch: &Batch) -> Result<(f64, Vec<Gradient>)> {
    model.zero_grad();
    let loss = model.loss(&batch.inputs, &batch.targets, batch.rows, batch.context)?;
    loss.backward();
    Ok((f64::from(loss.item()), gradients_of(model, 1.0)))
}

/// Every parameter's gradient divided by `scale`, then zeroed.
fn gradients_of(model: &Llama<f32>, scale: f64) -> Vec<Gradient> {
    model
        .named_parameters()
        .into_iter()
        .map(|(name, tensor)| {
            let values = tensor.grad().map_or_else(
                || vec![0.0; tensor.numel()],
                |grad| {
                    grad.iter()
                        .map(|g| (f64::from(*g) / scale) as f32)
                        .collect()
                },
            );
            tensor.zero_grad();
            Gradient {
                kind: ParamKind::of(&name),
                name,
                values,
            }
        })
        .collect()
}

/// `‖ĝ − g‖ / ‖g‖` over the gradients that `keep` selects, in f64; `None` if an entry of
/// `ĝ` is not finite.
fn relative_error(
    estimate: &[Gradient],
    reference: &[Gradient],
    keep: impl Fn(ParamKind) -> bool,
) -> Option<f64> {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (e, r) in estimate.iter().zip(reference).filter(|(_, r)| keep(r.kind)) {
        for (&a, &b) in e.values.iter().zip(&r.values) {
            if !a.is_finite() {
                return None;
            }
            let (a, b) = (f64::from(a), f64::from(b));
            diff += (a - b) * (a - b);
            norm += b * b;
        }
    }
    Some((diff / norm).sqrt())
}

/// The gradients of `2^k · loss` under autocast in `format`, divided by `2^k`, for each `k`
/// of `exponents`, against `reference`.
///
/// # Errors
/// As [`reference`].
pub fn sweep(
    model: &Llama<f32>,
    batch: &Batch,
    reference: &[Gradient],
    format: Format,
    exponents: &[i32],
) -> Result<Vec<SweepRun>> {
    exponents
        .iter()
        .map(|&k| {
            let scale = 2f64.powi(k);
            model.zero_grad();
            let scaled = {
                let _autocast = autocast(format);
                let loss = model.loss(&batch.inputs, &batch.targets, batch.rows, batch.context)?;
                loss.mul_scalar(scale as f32)
            };
            scaled.backward();
            let estimate = gradients_of(model, scale);
            let count = |test: &dyn Fn(f32, f32) -> bool| {
                estimate
                    .iter()
                    .zip(reference)
                    .flat_map(|(e, r)| e.values.iter().zip(&r.values))
                    .filter(|&(&e, &r)| test(e, r))
                    .count() as u64
            };
            Ok(SweepRun {
                format: format.name().to_string(),
                log2_scale: k,
                relative_error: relative_error(&estimate, reference, |_| true),
                by_kind: ParamKind::ALL
                    .iter()
                    .map(|&kind| (kind, relative_error(&estimate, reference, |k| k == kind)))
                    .collect(),
                non_finite: count(&|e, _| !e.is_finite()),
                lost: count(&|e, r| e == 0.0 && r != 0.0),
            })
        })
        .collect()
}

/// The histograms of `gradients`: all together, then each kind present.
///
/// # Errors
/// As [`Histogram::of`].
pub fn histograms(gradients: &[Gradient]) -> Result<Vec<Histogram>> {
    let all = gradients.iter().flat_map(|g| &g.values);
    let mut histograms = vec![Histogram::of("all", all)?];
    for kind in ParamKind::ALL {
        let values: Vec<&f32> = gradients
            .iter()
            .filter(|g| g.kind == kind)
            .flat_map(|g| &g.values)
            .collect();
        if !values.is_empty() {
            histograms.push(Histogram::of(kind.name(), values)?);
        }
    }
    Ok(histograms)
}

/// The whole measurement for `model` (weights described by `weights`) on one batch of
/// `config`'s data drawn with `seed`.
///
/// # Errors
/// [`TrainError::Data`] when the data cannot be read; as [`reference`] and [`Histogram::of`].
pub fn measure(
    model: &Llama<f32>,
    config: &TrainConfig,
    weights: String,
    seed: u64,
) -> Result<GradientReport> {
    let corpus = load_corpus(config, &crate::train::token_cache_root(None), None)?;
    let batch = sample_batch(
        &corpus.train,
        config.micro_batch,
        config.model.context,
        &Generator::new(seed ^ BATCH_STREAM),
    );
    let (loss, gradients) = reference(model, &batch)?;
    let all: Vec<f32> = gradients
        .iter()
        .flat_map(|g| g.values.iter().copied())
        .collect();
    let mut sweep_runs = sweep(model, &batch, &gradients, Format::Fp16, &SWEEP_EXPONENTS)?;
    sweep_runs.extend(sweep(
        model,
        &batch,
        &gradients,
        Format::Bf16,
        &SWEEP_EXPONENTS,
    )?);
    model.zero_grad();
    Ok(GradientReport {
        weights,
        parameters: config.model.num_parameters() as u64,
        batch: (batch.rows, batch.context),
        loss,
        histograms: histograms(&gradients)?,
        window: scale_window(&all, COVERAGE),
        sweep: sweep_runs,
    })
}

/// The histogram chart: the share of nonzero entries per binade, all together and per kind,
/// with fp16's subnormal and normal ranges shaded, and bf16's smallest normal and subnormal
/// shaded too when they are within reach of the data.
///
/// # Errors
/// [`TrainError::Chart`] when there is nothing to draw.
pub fn render_histogram_chart(report: &GradientReport) -> Result<String> {
    let series: Vec<Series> = report
        .histograms
        .iter()
        .map(|h| Series {
            label: h.label.clone(),
            points: h
                .bins
                .iter()
                .map(|&(e, n)| (f64::from(e) + 0.5, n as f64 / h.nonzero().max(1) as f64))
                .collect(),
        })
        .collect();
    let lowest = report
        .histograms
        .iter()
        .filter_map(|h| h.bins.first().map(|&(e, _)| e))
        .min()
        .unwrap_or(-24);
    let mut bands = vec![
        Band {
            label: "fp16 subnormal (2^-24 .. 2^-14)".into(),
            start: -24.0,
            end: -14.0,
        },
        Band {
            label: "fp16 normal (2^-14 .. 65504)".into(),
            start: -14.0,
            end: log2_fp16_max(),
        },
    ];
    // bf16's thresholds: shaded when the data reaches them, named on the axis otherwise.
    let mut notes = Vec::new();
    if lowest <= -110 {
        bands.push(Band {
            label: "bf16 subnormal (2^-133 .. 2^-126)".into(),
            start: -133.0,
            end: -126.0,
        });
    } else {
        notes.push(Note {
            label: "bf16: normal from 2^-126, subnormal to 2^-133 (far left of this axis)".into(),
            point: (f64::from(lowest) + 0.5, 0.0),
            series: 0,
        });
    }
    let title = format!("log2 |g| of the f32 gradients, {}", report.weights);
    let chart = AnnotatedChart {
        chart: LineChart {
            title: &title,
            x_label: "log2 |g| (binade)",
            y_label: "share of nonzero entries",
            series: &series,
            hlines: &[],
            log_y: false,
        },
        bands: &bands,
        notes: &notes,
        y_from_zero: true,
    };
    render_annotated_chart(&chart).map_err(TrainError::from)
}

/// The sweep chart: relative error against `log2 S` for fp16 and bf16 on a log axis, runs
/// with non-finite entries marked on the top edge, the window of [`scale_window`] shaded and
/// the default 2^16 marked.
///
/// # Errors
/// [`TrainError::Chart`] when there is nothing to draw.
pub fn render_sweep_chart(report: &GradientReport) -> Result<String> {
    let formats = ["fp16", "bf16"];
    let series: Vec<Series> = formats
        .iter()
        .map(|format| Series {
            label: format!("{format}: ‖ĝ − g‖ / ‖g‖"),
            points: report
                .sweep
                .iter()
                .filter(|run| run.format == *format)
                .map(|run| {
                    (
                        f64::from(run.log2_scale),
                        run.relative_error.unwrap_or(f64::NAN),
                    )
                })
                .collect(),
        })
        .collect();
    let finite_max = report
        .sweep
        .iter()
        .filter_map(|run| run.relative_error)
        .fold(0.0f64, f64::max);
    let mut notes = Vec::new();
    for (index, format) in formats.iter().enumerate() {
        for run in report.sweep.iter().filter(|r| r.format == *format) {
            if run.relative_error.is_none() {
                notes.push(Note {
                    label: format!("{format} non-finite"),
                    point: (f64::from(run.log2_scale), finite_max.max(1e-6)),
                    series: index,
                });
            }
        }
    }
    let bands: Vec<Band> = report
        .window
        .log2_intervals
        .iter()
        .map(|&(lo, hi)| Band {
            label: "99.9% of S·g in fp16's normal range".to_string(),
            start: lo.max(-1.0),
            end: hi.min(25.0),
        })
        .chain(std::iter::once(Band {
            label: format!("default S = 2^{DEFAULT_SCALE_EXPONENT}"),
            start: f64::from(DEFAULT_SCALE_EXPONENT) - 0.1,
            end: f64::from(DEFAULT_SCALE_EXPONENT) + 0.1,
        }))
        .collect();
    let title = format!(
        "gradients of S·loss under autocast, divided by S, against f32 ({})",
        report.weights
    );
    let chart = AnnotatedChart {
        chart: LineChart {
            title: &title,
            x_label: "log2 S",
            y_label: "relative error",
            series: &series,
            hlines: &[],
            log_y: true,
        },
        bands: &bands,
        notes: &notes,
        y_from_zero: false,
    };
    render_annotated_chart(&chart).map_err(TrainError::from)
}

/// Writes the report as `DIR/gradients.json` and its two charts as `DIR/histogram.svg` and
/// `DIR/sweep.svg`, each atomically; returns the three paths.
///
/// # Errors
/// [`TrainError::Chart`] when a chart cannot be drawn (then nothing is written);
/// [`TrainError::Io`] naming a file that cannot be written.
pub fn write_report(report: &GradientReport, dir: &Path) -> Result<[std::path::PathBuf; 3]> {
    let histogram = render_histogram_chart(report)?;
    let sweep = render_sweep_chart(report)?;
    std::fs::create_dir_all(dir).map_err(|source| TrainError::io(dir, source))?;
    let paths = [
        dir.join("gradients.json"),
        dir.join("histogram.svg"),
        dir.join("sweep.svg"),
    ];
    let json = serde_json::to_vec_pretty(report).expect("a report serializes");
    write_atomic(&paths[0], &json)?;
    write_atomic(&paths[1], histogram.as_bytes())?;
    write_atomic(&paths[2], sweep.as_bytes())?;
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelConfig, Preset};
    use crate::train::DataSource;

    /// `n` entries of `±2^e` for each `(e, n)`, signs alternating.
    fn entries(exponents: &[(i32, usize)]) -> Vec<f32> {
        exponents
            .iter()
            .flat_map(|&(e, n)| {
                (0..n).map(move |i| if i % 2 == 0 { 1.0 } else { -1.0 } * 2f32.powi(e))
            })
            .collect()
    }

    #[test]
    fn the_histogram_counts_binades_and_the_shares_below_fp16s_thresholds() {
        // 10 entries below 2^-24, 30 more below 2^-14, 60 normal; 5 zeros left out.
        let mut values = entries(&[(-30, 4), (-25, 6), (-20, 10), (-15, 20), (-3, 60)]);
        values.extend([0.0; 5]);
        // A value just under a power of two stays in the binade below it.
        values.push(f32::from_bits(2f32.powi(-14).to_bits() - 1));
        let h = Histogram::of("hand-made", &values).unwrap();
        assert_eq!((h.entries, h.zeros, h.nonzero()), (106, 5, 101));
        assert_eq!(h.bins, [(-30, 4), (-25, 6), (-20, 10), (-15, 21), (-3, 60)]);
        assert_eq!(h.below_fp16_subnormal, 10.0 / 101.0);
        assert_eq!(h.below_fp16_normal, 41.0 / 101.0);
        // 2^-24 itself is fp16's smallest subnormal: not below it.
        let edge = Histogram::of("edge", &entries(&[(-24, 1), (-14, 1)])).unwrap();
        assert_eq!(
            (edge.below_fp16_subnormal, edge.below_fp16_normal),
            (0.0, 0.5)
        );
        assert!(Histogram::of("bad", &[1.0, f32::NAN]).is_err());
    }

    #[test]
    fn the_scale_window_is_exact_for_known_exponents() {
        // 1000 entries from 2^-40 to 2^-20 in equal parts, and one outlier at 2^0 that the
        // 0.1% may leave out. 99.9% of 1001 = 999.999, so 1000 entries must fit: the whole
        // spread of 20 binades; fp16's normal range spans log2(65504) + 14 ≈ 30 of them.
        let mut values = entries(&[(-40, 250), (-35, 250), (-25, 250), (-20, 250)]);
        values.push(1.0);
        let window = scale_window(&values, 0.999);
        let top = log2_fp16_max();
        // Lowest S: 2^-40 · S = 2^-14; highest: 2^-20 · S = 65504.
        assert_eq!(window.log2_intervals, [(26.0, 20.0 + top)]);
        assert_eq!(window.powers, (26..=35).collect::<Vec<_>>());
        assert!(!window.default_inside);
        // Asking for every entry: the outlier must fit too, 40 binades do not.
        let all = scale_window(&values, 1.0);
        assert!(all.log2_intervals.is_empty() && all.powers.is_empty());
        // Two clusters far apart and an even split: either cluster alone is 50%.
        let split = scale_window(&entries(&[(-60, 50), (0, 50)]), 0.5);
        assert_eq!(split.log2_intervals, [(-14.0, top), (46.0, 60.0 + top)]);
        assert!(split.powers.contains(&0) && split.powers.contains(&46));
        assert!(scale_window(&[0.0, 0.0], 0.999).log2_intervals.is_empty());
    }

    #[test]
    fn parameters_fall_into_their_kinds() {
        let model = Llama::<f32>::new(&Preset::Tiny.config(), 0).unwrap();
        let kinds: Vec<ParamKind> = model
            .named_parameters()
            .iter()
            .map(|(name, _)| ParamKind::of(name))
            .collect();
        let count = |kind| kinds.iter().filter(|k| **k == kind).count();
        let layers = Preset::Tiny.config().n_layers;
        assert_eq!(count(ParamKind::Embedding), 1);
        assert_eq!(count(ParamKind::Attention), 4 * layers);
        assert_eq!(count(ParamKind::Mlp), 3 * layers);
        assert_eq!(count(ParamKind::Norms), 2 * layers + 1);
        assert_eq!(count(ParamKind::Head), 1);
    }

    fn tiny() -> (Llama<f32>, Batch) {
        let config = ModelConfig {
            n_layers: 2,
            ..Preset::Tiny.config()
        };
        let model = Llama::<f32>::new(&config, 1).unwrap();
        let corpus = crate::data::Corpus::builtin(0, 4_000);
        let batch = sample_batch(&corpus.train, 2, 16, &Generator::new(3));
        (model, batch)
    }

    #[test]
    fn inside_the_window_the_error_is_fp16_rounding_alone_and_beyond_it_overflows() {
        let (model, batch) = tiny();
        let (_, reference) = reference(&model, &batch).unwrap();
        // Scaling by a power of two is exact for every value that stays normal in fp16, so
        // inside the window the error is fp16's rounding alone, whatever the scale: equal
        // to 0.1% (the few entries that are still subnormal somewhere, near zero, weigh
        // next to nothing in the norm), with nothing flushed and nothing overflowing.
        tl_precision::take_underflow_count();
        let runs = sweep(&model, &batch, &reference, Format::Fp16, &[8, 10, 12]).unwrap();
        assert_eq!(tl_precision::take_underflow_count(), 0, "nothing flushed");
        let error = runs[0].relative_error.unwrap();
        assert!(error > 0.0 && error < 1e-2, "{error}");
        for run in &runs {
            let other = run.relative_error.unwrap();
            assert!((other - error).abs() < 1e-3 * error, "{other} vs {error}");
            assert_eq!((run.non_finite, run.lost), (0, 0));
        }
        // bf16's rounding is about eight times coarser, and its range needs no scale.
        let bf16 = sweep(&model, &batch, &reference, Format::Bf16, &[0, 24]).unwrap();
        let bf16_error = bf16[0].relative_error.unwrap();
        assert_eq!(bf16[1].relative_error, Some(bf16_error));
        assert!(bf16_error > 4.0 * error, "{bf16_error} vs {error}");
        // At 2^24 the logits' gradients overflow fp16: the run is marked, not averaged.
        let over = &sweep(&model, &batch, &reference, Format::Fp16, &[24]).unwrap()[0];
        assert!(over.non_finite > 0);
        assert_eq!(over.relative_error, None);
    }

    #[test]
    fn the_report_is_written_and_reads_back() {
        let mut config = TrainConfig::for_preset(Preset::Tiny);
        config.micro_batch = 2;
        config.data = DataSource::Builtin {
            seed: 0,
            bytes: 20_000,
        };
        let model = Llama::<f32>::new(&config.model, 0).unwrap();
        let report = measure(&model, &config, "initialisation (seed 0)".into(), 0).unwrap();
        assert_eq!(report.sweep.len(), 2 * SWEEP_EXPONENTS.len());
        assert_eq!(report.histograms[0].entries, report.parameters);
        assert_eq!(report.histograms.len(), 1 + ParamKind::ALL.len());
        let dir = tempfile::tempdir().unwrap();
        let [json, histogram, sweep_chart] = write_report(&report, dir.path()).unwrap();
        let back: GradientReport = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
        assert_eq!(back, report);
        let histogram = std::fs::read_to_string(histogram).unwrap();
        assert!(histogram.contains("<svg") && histogram.contains("fp16 normal"));
        assert!(histogram.contains("fp16 subnormal") && histogram.contains("bf16"));
        assert!(histogram.contains("attention") && histogram.contains("head"));
        let sweep_chart = std::fs::read_to_string(sweep_chart).unwrap();
        assert!(sweep_chart.contains("bf16") && sweep_chart.contains("non-finite"));
        // The same model and batch give the same report.
        let again = measure(&model, &config, "initialisation (seed 0)".into(), 0).unwrap();
        assert_eq!(again, report);
    }
}
