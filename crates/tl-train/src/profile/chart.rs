//! The memory timeline chart of a [`Profile`]: every run's live bytes on one axis, the
//! phases shaded behind them, each run's peak marked with its value.

use crate::chart::render_annotated_chart;
use crate::chart::{AnnotatedChart, Band, ChartError, LineChart, Note, Series};

use super::layout::align;
use super::run::Profile;

/// Bytes in a MiB.
const MIB: f64 = 1024.0 * 1024.0;

/// What the chart's x axis counts.
pub const X_AXIS: &str = "allocation events (each phase as wide as the run with more events in it)";

/// `bytes` in MiB as text: two decimals below 10 MiB, one above.
///
/// ```
/// assert_eq!(tl_train::profile::format_mib(3 * 1024 * 1024 / 2), "1.50 MiB");
/// assert_eq!(tl_train::profile::format_mib(1536 * 1024 * 1024), "1536.0 MiB");
/// ```
pub fn format_mib(bytes: u64) -> String {
    let mib = bytes as f64 / MIB;
    if mib < 10.0 {
        format!("{mib:.2} MiB")
    } else {
        format!("{mib:.1} MiB")
    }
}

/// The chart's caption: model, precision and batch shape.
fn title(profile: &Profile) -> String {
    let train = &profile.config.train;
    let preset = train.preset.map_or("custom", |preset| preset.name());
    let steps = match profile.config.steps {
        1 => "one training step".to_string(),
        n => format!("{n} training steps"),
    };
    format!(
        "Live tensor memory over {steps}: {preset}, {}, micro-batch {} x accum {}",
        train.precision, train.micro_batch, train.accum
    )
}

/// The SVG text of the profile's timeline chart.
///
/// The y axis is live tensor memory in MiB from zero; x is described by [`X_AXIS`]; the
/// legend names the runs and the phases; a dashed line marks the weights and AdamW's two
/// moments, the 12 bytes per parameter that stay live through the whole step.
///
/// # Errors
/// [`ChartError::NothingToDraw`] if the profile has no run; [`ChartError::Drawing`] if
/// plotters fails.
pub fn render_chart(profile: &Profile) -> Result<String, ChartError> {
    let layout = align(&profile.runs);
    let series: Vec<Series> = profile
        .runs
        .iter()
        .zip(&layout.points)
        .map(|(run, points)| Series {
            label: run.label.clone(),
            points: points
                .iter()
                .map(|&(x, bytes)| (x, bytes as f64 / MIB))
                .collect(),
        })
        .collect();
    let bands: Vec<Band> = profile
        .runs
        .first()
        .map(|run| {
            run.spans
                .iter()
                .zip(&layout.spans)
                .map(|(span, x)| Band {
                    label: span.phase.name().to_string(),
                    start: x.start,
                    end: x.end,
                })
                .collect()
        })
        .unwrap_or_default();
    let notes: Vec<Note> = profile
        .runs
        .iter()
        .enumerate()
        .map(|(index, run)| {
            let peak = run.peak();
            // The start is point 0 of the layout, event i is point i + 1.
            let point = peak.event.map_or(0, |event| event + 1);
            Note {
                label: format!("{} peak {}", run.label, format_mib(peak.bytes)),
                point: (layout.points[index][point].0, peak.bytes as f64 / MIB),
                series: index,
            }
        })
        .collect();
    let parameters = profile.config.train.model.num_parameters() as f64;
    let hlines = [(
        "weights + AdamW moments (12 B/parameter)".to_string(),
        12.0 * parameters / MIB,
    )];
    let title = title(profile);
    render_annotated_chart(&AnnotatedChart {
        chart: LineChart {
            title: &title,
            x_label: X_AXIS,
            y_label: "live tensor memory (MiB)",
            series: &series,
            hlines: &hlines,
            log_y: false,
        },
        bands: &bands,
        notes: &notes,
        y_from_zero: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Checkpointing, Preset};
    use crate::profile::{Phase, ProfileConfig, compare};
    use crate::train::{DataSource, TrainConfig};

    #[test]
    fn the_chart_names_both_runs_every_phase_and_both_peaks() {
        let mut train = TrainConfig::for_preset(Preset::Tiny);
        train.data = DataSource::Builtin {
            seed: 0,
            bytes: 20_000,
        };
        (train.micro_batch, train.accum) = (2, 2);
        train.checkpointing = Checkpointing::PerBlock;
        let profile = compare(&ProfileConfig { train, steps: 1 }).unwrap();
        let svg = render_chart(&profile).unwrap();
        for run in &profile.runs {
            let peak = format!("{} peak {}", run.label, format_mib(run.peak().bytes));
            assert!(svg.contains(&peak), "no {peak:?}");
        }
        for phase in Phase::ALL {
            assert!(svg.contains(phase.name()), "no {}", phase.name());
        }
        assert!(svg.contains("tiny, fp32, micro-batch 2 x accum 2"));
        assert!(svg.contains("12 B/parameter"));
    }

    #[test]
    fn a_profile_without_runs_has_nothing_to_draw() {
        let train = TrainConfig::for_preset(Preset::Tiny);
        let profile = Profile {
            config: ProfileConfig { train, steps: 1 },
            runs: Vec::new(),
        };
        assert!(matches!(
            render_chart(&profile),
            Err(ChartError::NothingToDraw { .. })
        ));
    }
}
