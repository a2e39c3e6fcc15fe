//! A [`Profile`] as files and text: the chart with its raw timeline beside it as JSON, and
//! the summary table `tinyllm profile` prints.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use super::chart::{format_mib, render_chart};
use super::run::Profile;
use super::timeline::{Phase, Timeline};
use crate::error::{Result, TrainError};
use crate::plan::{MemoryPlan, relative_error, thousands};
use crate::store::write_atomic;

/// The JSON file written beside the chart `svg_path`: the same name with `.json`.
///
/// ```
/// use std::path::Path;
/// let json = tl_train::profile::timeline_path(Path::new("out/small.svg"));
/// assert_eq!(json, Path::new("out/small.json"));
/// ```
pub fn timeline_path(svg_path: &Path) -> PathBuf {
    svg_path.with_extension("json")
}

/// Writes the profile's chart to `svg_path` and the whole profile as JSON to
/// [`timeline_path`]`(svg_path)`, each atomically; returns the JSON's path.
///
/// The JSON is the [`Profile`] itself (config, and each run's events and phases), so
/// [`read_profile`] gives it back to re-plot or analyse.
///
/// # Errors
/// [`TrainError::Chart`] if the chart cannot be drawn (then nothing is written);
/// [`TrainError::Io`] naming the file that could not be written.
pub fn write_profile(profile: &Profile, svg_path: &Path) -> Result<PathBuf> {
    let svg = render_chart(profile)?;
    let json = serde_json::to_vec(profile).expect("a profile serializes");
    write_atomic(svg_path, svg.as_bytes())?;
    let json_path = timeline_path(svg_path);
    write_atomic(&json_path, &json)?;
    Ok(json_path)
}

/// The largest profile read back: a step's timeline of a large model is a few MiB.
const MAX_PROFILE_BYTES: u64 = 1 << 28;

/// Reads a profile that [`write_profile`] wrote.
///
/// # Errors
/// [`TrainError::Io`] if the file cannot be read or is not a profile.
pub fn read_profile(path: &Path) -> Result<Profile> {
    let bytes = crate::store::read_bounded(path, MAX_PROFILE_BYTES, "a profile")?;
    serde_json::from_slice(&bytes).map_err(|error| TrainError::io(path, error.into()))
}

/// Where a timeline peaked: the phase, with its micro-batch, and the step when several
/// were recorded.
fn peak_place(profile: &Profile, run: &Timeline) -> String {
    let Some(span) = run.peak().event.and_then(|event| run.span_of(event)) else {
        return "start".into();
    };
    let mut place = span.phase.name().to_string();
    if let Some(micro_batch) = span.micro_batch {
        let _ = write!(place, " {}", micro_batch + 1);
    }
    if profile.config.steps > 1 {
        let _ = write!(place, ", step {}", span.step + 1);
    }
    place
}

/// The summary of `tinyllm profile`: one column per run; rows for the peak and where it
/// happened, the peak of each phase, the counts of allocations and frees, and the loss of
/// the last step (equal across runs: recomputation changes no bit).
pub fn table(profile: &Profile) -> String {
    let mut rows: Vec<(String, Vec<String>)> = vec![
        (String::new(), column(profile, |run| run.label.clone())),
        (
            "peak live".into(),
            column(profile, |run| format_mib(run.peak().bytes)),
        ),
        (
            "  reached in".into(),
            column(profile, |run| peak_place(profile, run)),
        ),
    ];
    for phase in Phase::ALL {
        rows.push((
            format!("  {} peak", phase.name()),
            column(profile, |run| {
                run.phase_peak(phase).map_or("-".into(), format_mib)
            }),
        ));
    }
    rows.push((
        "at step start".into(),
        column(profile, |run| format_mib(run.start_live)),
    ));
    rows.push((
        "allocations / frees".into(),
        column(profile, |run| {
            let (allocs, frees) = run.counts();
            format!("{allocs} / {frees}")
        }),
    ));
    rows.push((
        "loss".into(),
        column(profile, |run| {
            run.losses
                .last()
                .map_or("-".into(), |loss| format!("{loss:.6}"))
        }),
    ));
    let label_width = rows.iter().map(|(label, _)| label.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..profile.runs.len())
        .map(|i| {
            rows.iter()
                .map(|(_, cells)| cells[i].len())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut text = String::new();
    for (label, cells) in rows {
        let _ = write!(text, "{label:<label_width$}");
        for (cell, width) in cells.iter().zip(&widths) {
            let _ = write!(text, "  {cell:>width$}");
        }
        text.push('\n');
    }
    text
}

fn column(profile: &Profile, cell: impl Fn(&Timeline) -> String) -> Vec<String> {
    profile.runs.iter().map(cell).collect()
}

/// `tinyllm profile --policies`: for each recorded run, what its first forward pass held for
/// backward and its steady-state peak, measured beside the plan's prediction (to the byte:
/// the plan runs the same step on meta tensors), its median step time, and what its updates allocated beyond
/// the gradients, in units of 4P.
pub fn policy_table(profile: &Profile, plan: &MemoryPlan) -> String {
    let four_p = 4 * plan.parameters;
    let mut text = format!(
        "{:<30}{:>16}{:>16}{:>16}{:>16}{:>10}{:>12}\n",
        "checkpoint policy, bytes",
        "held measured",
        "held predicted",
        "peak measured",
        "peak predicted",
        "step s",
        "update/4P"
    );
    for run in &profile.runs {
        let predicted = plan
            .policies
            .iter()
            .find(|policy| policy.checkpointing == run.checkpointing);
        let cell = |value: Option<u64>| value.map_or("-".into(), thousands);
        let held = run.held_for_backward();
        let _ = writeln!(
            text,
            "  {:<28}{:>16}{:>16}{:>16}{:>16}{:>10}{:>12}",
            run.checkpointing.policy_name().unwrap_or(&run.label),
            cell(held),
            cell(predicted.map(|p| p.held_bytes)),
            thousands(run.peak().bytes),
            cell(predicted.map(|p| p.peak_bytes)),
            run.median_step_seconds()
                .map_or("-".into(), |s| format!("{s:.3}")),
            run.update_extra()
                .map_or("-".into(), |b| format!("{:.2}", b as f64 / four_p as f64)),
        );
        if let Some(p) = predicted
            && p.peak_bytes != run.peak().bytes
        {
            let _ = writeln!(
                text,
                "    (peak off the plan by {:+.3}%)",
                100.0 * relative_error(p.peak_bytes, run.peak().bytes)
            );
        }
    }
    let _ = writeln!(
        text,
        "  held: bytes the first micro-batch's forward pass leaves for its backward; step s: the \
         median step, the meter's recording included; update/4P: the update's allocations \
         beyond the gradients in units of 4P = {} B",
        thousands(four_p)
    );
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Checkpointing, Preset};
    use crate::profile::{ProfileConfig, compare};
    use crate::train::{DataSource, TrainConfig};

    fn tiny_profile() -> Profile {
        let mut train = TrainConfig::for_preset(Preset::Tiny);
        train.data = DataSource::Builtin {
            seed: 0,
            bytes: 20_000,
        };
        (train.micro_batch, train.accum) = (2, 1);
        train.checkpointing = Checkpointing::Budget(2);
        compare(&ProfileConfig { train, steps: 1 }).unwrap()
    }

    #[test]
    fn the_profile_round_trips_through_its_json_beside_the_chart() {
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("memory.svg");
        let profile = tiny_profile();
        let json = write_profile(&profile, &svg).unwrap();
        assert_eq!(json, dir.path().join("memory.json"));
        assert_eq!(read_profile(&json).unwrap(), profile);
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn a_missing_directory_is_an_io_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("missing").join("memory.svg");
        let error = write_profile(&tiny_profile(), &svg).unwrap_err();
        assert!(
            matches!(&error, TrainError::Io { path, .. } if *path == svg),
            "{error}"
        );
        let not_json = dir.path().join("not.json");
        std::fs::write(&not_json, "{}").unwrap();
        assert!(matches!(
            read_profile(&not_json),
            Err(TrainError::Io { .. })
        ));
    }

    #[test]
    fn the_table_has_a_column_per_run_and_a_row_per_phase() {
        let profile = tiny_profile();
        let table = table(&profile);
        let lines: Vec<&str> = table.lines().collect();
        // Header, peak, where, four phases, start, counts, loss.
        assert_eq!(lines.len(), 10);
        assert!(
            lines[0].ends_with("plain  checkpointed, budget 2"),
            "{table}"
        );
        let peak = format_mib(profile.runs[1].peak().bytes);
        assert!(lines[1].starts_with("peak live") && lines[1].ends_with(&peak));
        assert!(lines[4].trim_start().starts_with("forward peak"));
        // Both runs computed the same loss.
        let losses: Vec<&str> = lines[9].split_whitespace().skip(1).collect();
        assert_eq!(losses.len(), 2);
        assert_eq!(losses[0], losses[1]);
    }
}
