//! Drawing an [`AnnotatedChart`] with plotters: layout constants, colours, lines, legend.
//! The annotations themselves are drawn by `overlay`.

use std::ops::Range;

use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::annotate::{band_colour, band_labels, legend_band_labels, text_width};
use super::axis::{LogAxis, axis_ranges, drawable, tick_label};
use super::legend::{Corner, legend_corner};
use super::legend_row::{self, Entry, ROW_HEIGHT, Swatch};
use super::overlay::{draw_band_fills, draw_band_names, draw_notes};
use super::placement::NOTE_FONT;
use super::{AnnotatedChart, ChartError};

const WIDTH: u32 = 960;
const HEIGHT: u32 = 560;
const MARGIN: u32 = 16;
const X_LABEL_AREA: u32 = 48;
const Y_LABEL_AREA: u32 = 72;
const CAPTION_FONT: u32 = 24;
const CAPTION_HEIGHT: u32 = 30;
const LEGEND_FONT: u32 = 15;

/// Series colours (the Tableau palette without its greys and browns, kept for reference lines).
const SERIES_COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(227, 119, 194),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
const REFERENCE_COLOURS: [RGBColor; 3] = [
    RGBColor(0, 0, 0),
    RGBColor(127, 127, 127),
    RGBColor(140, 86, 75),
];

/// The SVG text of `annotated` (see [`super::render_annotated_chart`]).
pub(super) fn render(annotated: &AnnotatedChart) -> Result<String, ChartError> {
    let chart = &annotated.chart;
    let (x_range, y_range) = axis_ranges(chart, annotated.y_from_zero)
        .ok_or(ChartError::NothingToDraw { log_y: chart.log_y })?;
    let legend = if annotated.bands.is_empty() {
        let obstacles = note_samples(annotated, &x_range, &y_range);
        Legend::Corner(legend_corner(
            chart,
            &x_range,
            &y_range,
            legend_box_fraction(annotated, &x_range),
            &obstacles,
        ))
    } else {
        let entries = legend_entries(annotated, &x_range);
        let plot_width = plot_size(0).0 as i32;
        Legend::Rows(legend_row::row_count(&entries, LEGEND_FONT, plot_width))
    };
    let mut svg = String::new();
    {
        let area = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        let axes = Axes {
            y_range: y_range.clone(),
            x_range,
        };
        if chart.log_y {
            draw(&area, annotated, axes, LogAxis::new(y_range), legend)?;
        } else {
            draw(&area, annotated, axes, y_range, legend)?;
        }
        area.present().map_err(drawing_error)?;
    }
    Ok(svg)
}

/// Where the legend goes.
#[derive(Clone, Copy, Debug)]
enum Legend {
    /// In a box in this corner of the plot (charts without bands).
    Corner(Corner),
    /// In this many rows above the plot (charts with bands, which leave no corner free).
    Rows(usize),
}

impl Legend {
    /// Pixels the legend takes above the plot.
    fn height(self) -> u32 {
        match self {
            Legend::Corner(_) => 0,
            Legend::Rows(rows) => rows as u32 * ROW_HEIGHT as u32,
        }
    }
}

/// The entries of a legend drawn in rows: series, reference lines, then the bands whose
/// colour no label on the plot names.
fn legend_entries<'a>(annotated: &'a AnnotatedChart, x_range: &Range<f64>) -> Vec<Entry<'a>> {
    let chart = &annotated.chart;
    let series = chart
        .series
        .iter()
        .enumerate()
        .map(|(index, series)| Entry {
            label: &series.label,
            swatch: Swatch::Line(SERIES_COLOURS[index % SERIES_COLOURS.len()]),
        });
    let hlines = chart
        .hlines
        .iter()
        .enumerate()
        .map(|(index, (label, _))| Entry {
            label,
            swatch: Swatch::Dashed(REFERENCE_COLOURS[index % REFERENCE_COLOURS.len()]),
        });
    let names = band_labels(annotated.bands);
    let bands = legend_band_labels(annotated.bands, x_range, plot_size(0))
        .into_iter()
        .map(|label| Entry {
            label,
            swatch: Swatch::Fill(band_colour(
                names
                    .iter()
                    .position(|name| *name == label)
                    .expect("a band label"),
            )),
        });
    series.chain(hlines).chain(bands).collect()
}

/// The plot's ranges in data coordinates.
struct Axes {
    x_range: Range<f64>,
    y_range: Range<f64>,
}

/// Width and height of the plot in pixels, as the chart builder lays it out, when a legend
/// takes `legend_height` pixels above it.
fn plot_size(legend_height: u32) -> (f64, f64) {
    (
        f64::from(WIDTH - 2 * MARGIN - Y_LABEL_AREA),
        f64::from(HEIGHT - 2 * MARGIN - X_LABEL_AREA - CAPTION_HEIGHT - legend_height),
    )
}

/// Points along each note's label (as fractions of the plot), weighted heavily, so that the
/// legend goes where it hides no note.
fn note_samples(
    annotated: &AnnotatedChart,
    x_range: &Range<f64>,
    y_range: &Range<f64>,
) -> Vec<((f64, f64), f64)> {
    let (plot_width, _) = plot_size(0);
    let mut samples = Vec::new();
    for note in annotated.notes {
        let (x, y) = note.point;
        if !drawable(annotated.chart.log_y, (x, y)) {
            continue;
        }
        let fx = (x - x_range.start) / (x_range.end - x_range.start);
        let fy = if annotated.chart.log_y {
            (y / y_range.start).ln() / (y_range.end / y_range.start).ln()
        } else {
            (y - y_range.start) / (y_range.end - y_range.start)
        };
        let width = f64::from(text_width(&note.label, NOTE_FONT)) / plot_width;
        // The label may go either side of the point: cover both.
        samples.extend((-8..=8).map(|k| ((fx + width * f64::from(k) / 8.0, fy), 1.0)));
    }
    samples
}

fn drawing_error(error: impl std::fmt::Display) -> ChartError {
    ChartError::Drawing(error.to_string())
}

/// The legend box's size as fractions of the plot's width and height, estimated the way
/// plotters estimates text without fonts (about 0.55 of the font size per character).
fn legend_box_fraction(annotated: &AnnotatedChart, x_range: &Range<f64>) -> (f64, f64) {
    let chart = &annotated.chart;
    let (plot_width, plot_height) = plot_size(0);
    let labels = chart
        .series
        .iter()
        .map(|s| s.label.as_str())
        .chain(chart.hlines.iter().map(|h| h.0.as_str()))
        .chain(legend_band_labels(annotated.bands, x_range, plot_size(0)));
    let (entries, longest) = labels.fold((0, 0), |(n, longest), label| {
        (n + 1, longest.max(label.chars().count()))
    });
    let width = 50.0 + 0.55 * f64::from(LEGEND_FONT) * longest as f64;
    let height = 12.0 + 21.0 * f64::from(entries);
    (width / plot_width, height / plot_height)
}

/// Runs of consecutive drawable points: a non-drawable point ends a run.
pub(super) fn segments(log_y: bool, points: &[(f64, f64)]) -> Vec<Vec<(f64, f64)>> {
    points
        .split(|&point| !drawable(log_y, point))
        .filter(|run| !run.is_empty())
        .map(<[_]>::to_vec)
        .collect()
}

fn draw<Y>(
    area: &DrawingArea<SVGBackend, Shift>,
    annotated: &AnnotatedChart,
    axes: Axes,
    y_axis: Y,
    legend: Legend,
) -> Result<(), ChartError>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let chart = &annotated.chart;
    let Axes { x_range, y_range } = axes;
    area.fill(&WHITE).map_err(drawing_error)?;
    let mut builder = ChartBuilder::on(area);
    builder
        .margin(MARGIN)
        .x_label_area_size(X_LABEL_AREA)
        .y_label_area_size(Y_LABEL_AREA);
    if let Legend::Rows(_) = legend {
        // plotters puts its caption right on top of the plot; the rows of the legend go
        // between the two, so the caption is written here and the plot moved down.
        builder.margin_top(MARGIN + CAPTION_HEIGHT + legend.height());
        let style = TextStyle::from(("sans-serif", CAPTION_FONT).into_font())
            .pos(Pos::new(HPos::Center, VPos::Top));
        let centre = (WIDTH / 2) as i32;
        area.draw(&Text::new(chart.title, (centre, MARGIN as i32), &style))
            .map_err(drawing_error)?;
    } else {
        builder.caption(chart.title, ("sans-serif", CAPTION_FONT));
    }
    let mut plot = builder
        .build_cartesian_2d(x_range.clone(), y_axis)
        .map_err(drawing_error)?;

    // Bands first, so the grid, the lines and the notes are drawn over them.
    draw_band_fills(&mut plot, annotated.bands, &y_range)?;
    let x_span = x_range.end - x_range.start;
    let y_span = y_range.end - y_range.start;
    let x_format = |x: &f64| tick_label(*x, x_span);
    let y_format = |y: &f64| tick_label(*y, y_span);
    plot.configure_mesh()
        .x_desc(chart.x_label)
        .y_desc(chart.y_label)
        .x_label_formatter(&x_format)
        .y_label_formatter(&y_format)
        .axis_desc_style(("sans-serif", 16))
        .label_style(("sans-serif", 13))
        .light_line_style(RGBColor(238, 238, 238))
        // Fine grid lines would stripe the bands; the bold ones are enough on top of them.
        .max_light_lines(if annotated.bands.is_empty() { 10 } else { 0 })
        .draw()
        .map_err(drawing_error)?;
    // The estimate the legend was built with, so a band's name is on the plot or in the
    // legend, never neither.
    let estimate = plot_size(0);
    let band_names = draw_band_names(area, &plot, annotated.bands, &x_range, estimate)?;

    for (index, series) in chart.series.iter().enumerate() {
        let colour = SERIES_COLOURS[index % SERIES_COLOURS.len()];
        let style = colour.stroke_width(2);
        // An empty series carries the legend entry, so a series with no drawable point is
        // still listed and the legend is the same whatever the data.
        plot.draw_series(LineSeries::new(Vec::new(), style))
            .map_err(drawing_error)?
            .label(series.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        for run in segments(chart.log_y, &series.points) {
            if let [point] = run[..] {
                // A lone point has no line to show it.
                plot.draw_series([Circle::new(point, 3, colour.filled())])
                    .map_err(drawing_error)?;
            } else {
                plot.draw_series(LineSeries::new(run, style))
                    .map_err(drawing_error)?;
            }
        }
    }

    for (index, (label, y)) in chart.hlines.iter().enumerate() {
        if !drawable(chart.log_y, (x_range.start, *y)) {
            continue;
        }
        let style = REFERENCE_COLOURS[index % REFERENCE_COLOURS.len()].stroke_width(2);
        let ends = [(x_range.start, *y), (x_range.end, *y)];
        plot.draw_series(DashedLineSeries::new(ends, 8, 5, style))
            .map_err(drawing_error)?
            .label(label.as_str())
            .legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (9, 0)], style)
                    + PathElement::new(vec![(14, 0), (24, 0)], style)
            });
    }

    draw_notes(area, &mut plot, annotated, &SERIES_COLOURS, &band_names)?;

    let corner = match legend {
        Legend::Corner(corner) => corner,
        Legend::Rows(rows) => {
            let (plot_x, plot_y) = plot.plotting_area().get_pixel_range();
            let top = plot_y.start - rows as i32 * ROW_HEIGHT - 4;
            let entries = legend_entries(annotated, &x_range);
            return legend_row::draw(area, &entries, LEGEND_FONT, &plot_x, top);
        }
    };
    let position = match corner {
        Corner::UpperRight => SeriesLabelPosition::UpperRight,
        Corner::UpperLeft => SeriesLabelPosition::UpperLeft,
        Corner::LowerRight => SeriesLabelPosition::LowerRight,
        Corner::LowerLeft => SeriesLabelPosition::LowerLeft,
    };
    plot.configure_series_labels()
        .position(position)
        .label_font(("sans-serif", LEGEND_FONT))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .draw()
        .map_err(drawing_error)
}
