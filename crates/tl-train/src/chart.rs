//! SVG line charts: loss curves, memory timelines.
//!
//! Drawn with plotters' SVG backend, which needs no font or system library: the text is left
//! for the viewer to render. [`write_line_chart`] draws lines and reference lines;
//! [`write_annotated_chart`] adds shaded x bands (the phases of a training step) and
//! labelled points (a peak and its value).

use std::path::{Path, PathBuf};

use thiserror::Error;

mod annotate;
mod axis;
mod draw;
mod legend;
mod legend_row;
mod overlay;
mod placement;
mod split;
mod timeline;

pub use split::render_tensor_parallel_block;
pub use timeline::render_pipeline_timeline;

/// Writes [`render_tensor_parallel_block`] of `model` over `t` ranks to `path`.
///
/// # Errors
/// [`ChartError::Drawing`] if plotters fails, [`ChartError::Io`] if the file cannot be
/// written.
pub fn write_tensor_parallel_block(
    path: &Path,
    model: &crate::model::ModelConfig,
    t: usize,
) -> Result<PathBuf, ChartError> {
    let svg = render_tensor_parallel_block(model, t)?;
    write_atomic(path, svg.as_bytes()).map_err(|source| ChartError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(path.to_path_buf())
}

/// One labelled line of a chart.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// The name shown in the legend.
    pub label: String,
    /// `(x, y)` points, drawn in order. A non-finite coordinate (a NaN loss) breaks the line
    /// there instead of breaking the chart.
    pub points: Vec<(f64, f64)>,
}

/// What to draw: one or more series, and labelled horizontal reference lines.
#[derive(Clone, Copy, Debug, Default)]
pub struct LineChart<'a> {
    /// The caption above the plot.
    pub title: &'a str,
    /// The x axis's description.
    pub x_label: &'a str,
    /// The y axis's description.
    pub y_label: &'a str,
    /// The lines, each in its own colour.
    pub series: &'a [Series],
    /// Labelled horizontal lines across the plot, dashed: an entropy floor, a memory budget.
    pub hlines: &'a [(String, f64)],
    /// A logarithmic y axis; points and lines at `y <= 0` are then left out.
    pub log_y: bool,
}

/// A shaded vertical band from `start` to `end` on the x axis, behind the lines: a phase of
/// a training step, say. Bands with the same label share a colour.
#[derive(Clone, Debug, PartialEq)]
pub struct Band {
    /// The legend entry of this band's colour.
    pub label: String,
    /// Where the band begins on the x axis.
    pub start: f64,
    /// Where it ends.
    pub end: f64,
}

/// A point marked by a dot in the colour of series `series`, with `label` written beside
/// it: a peak and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Note {
    /// The text beside the point.
    pub label: String,
    /// The point, in data coordinates.
    pub point: (f64, f64),
    /// The index of the series whose colour the dot takes.
    pub series: usize,
}

/// A [`LineChart`] with shaded x bands, labelled points, and optionally a y axis that
/// starts at zero (for quantities like bytes, where the distance from zero is the point).
#[derive(Clone, Copy, Debug, Default)]
pub struct AnnotatedChart<'a> {
    /// The lines and reference lines.
    pub chart: LineChart<'a>,
    /// Bands drawn behind the lines, in order; the legend lists each label once.
    pub bands: &'a [Band],
    /// Points marked on top of the lines.
    pub notes: &'a [Note],
    /// Start a linear y axis at zero when every value is positive (ignored on a log axis).
    pub y_from_zero: bool,
}

/// Why a chart could not be written.
#[derive(Debug, Error)]
pub enum ChartError {
    /// No series has a point that can be drawn (finite, and positive on a log axis).
    #[error("nothing to draw: no series has a finite point{}", if *log_y { " with y > 0" } else { "" })]
    NothingToDraw {
        /// Whether the y axis was logarithmic.
        log_y: bool,
    },
    /// plotters failed while drawing.
    #[error("drawing the chart failed: {0}")]
    Drawing(String),
    /// The chart file could not be written.
    #[error("cannot write chart {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
}

/// Draws `chart` as an SVG file at `path`, replacing any file there.
///
/// The SVG is rendered in memory, written to a temporary file beside `path`, then renamed
/// over it, so a crash never leaves a half-written chart.
///
/// Axis ranges cover every drawable point and every reference line, with 5% of margin on y.
/// A series without drawable points still gets its legend entry; a point isolated between
/// non-finite values is drawn as a dot. The legend goes in the corner that hides the least
/// of the lines.
///
/// # Errors
/// [`ChartError::NothingToDraw`] if no series has a drawable point (reference lines alone do
/// not give an x range); [`ChartError::Io`] if the file cannot be written;
/// [`ChartError::Drawing`] if plotters fails.
///
/// ```
/// use tl_train::chart::{LineChart, Series, write_line_chart};
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("loss.svg");
/// let series = [Series { label: "train".into(), points: vec![(0.0, 5.5), (1.0, 3.0), (2.0, 2.0)] }];
/// let chart = LineChart {
///     title: "loss", x_label: "step", y_label: "nats/byte",
///     series: &series, hlines: &[("entropy floor".into(), 0.7)], log_y: false,
/// };
/// write_line_chart(&path, &chart).unwrap();
/// assert!(std::fs::read_to_string(&path).unwrap().contains("entropy floor"));
/// ```
pub fn write_line_chart(path: &Path, chart: &LineChart) -> Result<(), ChartError> {
    write_annotated_chart(path, &plain(chart))
}

/// The SVG text of `chart`, as [`write_line_chart`] would write it.
///
/// # Errors
/// [`ChartError::NothingToDraw`] or [`ChartError::Drawing`], as for [`write_line_chart`].
pub fn render_line_chart(chart: &LineChart) -> Result<String, ChartError> {
    draw::render(&plain(chart))
}

/// Draws `chart` with its bands and notes as an SVG file at `path`, replacing any file
/// there, as [`write_line_chart`] does.
///
/// Bands cover the plot's full height behind the grid and the lines, each label in its own
/// tint. A band's label is written at the top of the plot, across the band, or turned along
/// it when the band is narrow; a label that fits neither way is named in the legend by its
/// colour. With bands, the legend is a row (or rows) between the caption and the plot,
/// since shaded bands and a full timeline leave no corner free; without them it is a box
/// in a corner, as [`write_line_chart`] draws it.
///
/// A note is a dot on its point with its label beside it: level with the point, right or
/// left, or above or below it, whichever stays inside the plot, clear of the other notes'
/// labels, and over the fewest points of the lines.
///
/// # Errors
/// As [`write_line_chart`]: bands and notes alone do not make anything to draw.
///
/// ```
/// use tl_train::chart::{AnnotatedChart, Band, LineChart, Note, Series, write_annotated_chart};
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("memory.svg");
/// let series = [Series { label: "live".into(), points: vec![(0.0, 1.0), (5.0, 9.0), (10.0, 2.0)] }];
/// let bands = [
///     Band { label: "forward".into(), start: 0.0, end: 5.0 },
///     Band { label: "backward".into(), start: 5.0, end: 10.0 },
/// ];
/// let notes = [Note { label: "peak 9 MiB".into(), point: (5.0, 9.0), series: 0 }];
/// let chart = AnnotatedChart {
///     chart: LineChart { title: "memory", x_label: "event", y_label: "MiB", series: &series, ..Default::default() },
///     bands: &bands,
///     notes: &notes,
///     y_from_zero: true,
/// };
/// write_annotated_chart(&path, &chart).unwrap();
/// let svg = std::fs::read_to_string(&path).unwrap();
/// assert!(svg.contains("backward") && svg.contains("peak 9 MiB"));
/// ```
pub fn write_annotated_chart(path: &Path, chart: &AnnotatedChart) -> Result<(), ChartError> {
    let svg = render_annotated_chart(chart)?;
    write_atomic(path, svg.as_bytes()).map_err(|source| ChartError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The SVG text of `chart`, as [`write_annotated_chart`] would write it.
///
/// # Errors
/// [`ChartError::NothingToDraw`] or [`ChartError::Drawing`], as for [`write_line_chart`].
pub fn render_annotated_chart(chart: &AnnotatedChart) -> Result<String, ChartError> {
    draw::render(chart)
}

/// `chart` without annotations.
fn plain<'a>(chart: &LineChart<'a>) -> AnnotatedChart<'a> {
    AnnotatedChart {
        chart: *chart,
        ..AnnotatedChart::default()
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename,
/// which replaces the file in one step on the same file system.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the path does not name a file",
        )
    })?;
    let mut temp_name = std::ffi::OsString::from(".");
    temp_name.push(name);
    temp_name.push(format!(".{}.tmp", std::process::id()));
    let temp = path.with_file_name(temp_name);
    let result = std::fs::write(&temp, bytes).and_then(|()| std::fs::rename(&temp, path));
    if result.is_err() {
        // Best effort: the temporary may not even exist when the directory is missing.
        let _ = std::fs::remove_file(&temp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(label: &str, points: &[(f64, f64)]) -> Series {
        Series {
            label: label.into(),
            points: points.to_vec(),
        }
    }

    fn chart<'a>(series: &'a [Series], hlines: &'a [(String, f64)]) -> LineChart<'a> {
        LineChart {
            title: "loss",
            x_label: "optimizer step",
            y_label: "nats per byte",
            series,
            hlines,
            log_y: false,
        }
    }

    #[test]
    fn writes_well_formed_svg_with_every_label() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loss.svg");
        let series = [
            series("train loss", &[(0.0, 5.5), (1.0, 2.0)]),
            series("validation loss", &[(1.0, 2.1)]),
        ];
        let hlines = [("entropy floor".to_string(), 0.37)];
        write_line_chart(&path, &chart(&series, &hlines)).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(
            svg.starts_with("<svg") || svg.starts_with("<?xml"),
            "{}",
            &svg[..40]
        );
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in [
            "train loss",
            "validation loss",
            "entropy floor",
            "optimizer step",
            "nats per byte",
        ] {
            assert!(svg.contains(text), "the chart lacks {text:?}");
        }
    }

    #[test]
    fn non_finite_points_break_the_line_instead_of_the_chart() {
        let points = [
            (0.0, 1.0),
            (1.0, f64::NAN),
            (2.0, 2.0),
            (3.0, 3.0),
            (f64::INFINITY, 4.0),
            (5.0, 5.0),
        ];
        let runs = draw::segments(false, &points);
        assert_eq!(
            runs,
            [
                vec![(0.0, 1.0)],
                vec![(2.0, 2.0), (3.0, 3.0)],
                vec![(5.0, 5.0)]
            ]
        );
        let series = [series("a", &points)];
        let svg = render_line_chart(&chart(&series, &[])).unwrap();
        assert!(svg.ends_with("</svg>\n") && !svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn a_lone_point_is_drawn_as_a_dot() {
        let lone = [series("only", &[(5.0, 2.0)])];
        assert!(
            render_line_chart(&chart(&lone, &[]))
                .unwrap()
                .contains("<circle")
        );
        let line = [series("line", &[(5.0, 2.0), (6.0, 3.0)])];
        assert!(
            !render_line_chart(&chart(&line, &[]))
                .unwrap()
                .contains("<circle")
        );
    }

    #[test]
    fn a_log_axis_leaves_out_reference_lines_at_or_below_zero() {
        let series = [series("a", &[(0.0, 0.0), (1.0, 1.0), (2.0, 100.0)])];
        let hlines = [
            ("zero line".to_string(), 0.0),
            ("ten line".to_string(), 10.0),
        ];
        let chart = LineChart {
            log_y: true,
            ..chart(&series, &hlines)
        };
        let svg = render_line_chart(&chart).unwrap();
        assert!(svg.contains("ten line") && !svg.contains("zero line"));
    }

    #[test]
    fn nothing_to_draw_is_an_error_and_writes_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.svg");
        let hlines = [("floor".to_string(), 1.0)];
        let empty = [series("a", &[]), series("b", &[(0.0, f64::NAN)])];
        for series in [&[][..], &empty[..]] {
            let error = write_line_chart(&path, &chart(series, &hlines)).unwrap_err();
            assert!(
                matches!(error, ChartError::NothingToDraw { log_y: false }),
                "{error}"
            );
        }
        let negative = [series("a", &[(0.0, -1.0)])];
        let log_chart = LineChart {
            log_y: true,
            ..chart(&negative, &[])
        };
        let message = write_line_chart(&path, &log_chart).unwrap_err().to_string();
        assert_eq!(
            message,
            "nothing to draw: no series has a finite point with y > 0"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn writing_replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loss.svg");
        std::fs::write(&path, "old").unwrap();
        let series = [series("new series", &[(0.0, 1.0), (1.0, 0.5)])];
        write_line_chart(&path, &chart(&series, &[])).unwrap();
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .contains("new series")
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["loss.svg"]);
    }

    #[test]
    fn an_unwritable_path_is_an_io_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("loss.svg");
        let series = [series("a", &[(0.0, 1.0), (1.0, 0.5)])];
        let error = write_line_chart(&path, &chart(&series, &[])).unwrap_err();
        assert!(
            matches!(&error, ChartError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
        );
        assert!(error.to_string().contains("missing-dir"), "{error}");
    }
}
