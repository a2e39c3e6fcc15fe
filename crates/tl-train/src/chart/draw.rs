//! Drawing a [`LineChart`] with plotters: layout constants, colours, lines, legend.

use std::ops::Range;

use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

use super::axis::{LogAxis, axis_ranges, drawable, tick_label};
use super::legend::{Corner, legend_corner};
use super::{ChartError, LineChart};

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

/// The SVG text of `chart` (see [`super::render_line_chart`]).
pub(super) fn render(chart: &LineChart) -> Result<String, ChartError> {
    let (x_range, y_range) =
        axis_ranges(chart).ok_or(ChartError::NothingToDraw { log_y: chart.log_y })?;
    let corner = legend_corner(chart, &x_range, &y_range, legend_box_fraction(chart));
    let mut svg = String::new();
    {
        let area = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        let span = y_range.end - y_range.start;
        if chart.log_y {
            draw(&area, chart, x_range, LogAxis::new(y_range), span, corner)?;
        } else {
            draw(&area, chart, x_range, y_range, span, corner)?;
        }
        area.present().map_err(drawing_error)?;
    }
    Ok(svg)
}

fn drawing_error(error: impl std::fmt::Display) -> ChartError {
    ChartError::Drawing(error.to_string())
}

/// The legend box's size as fractions of the plot's width and height, estimated the way
/// plotters estimates text without fonts (about 0.55 of the font size per character).
fn legend_box_fraction(chart: &LineChart) -> (f64, f64) {
    let labels = chart
        .series
        .iter()
        .map(|s| s.label.as_str())
        .chain(chart.hlines.iter().map(|h| h.0.as_str()));
    let (entries, longest) = labels.fold((0, 0), |(n, longest), label| {
        (n + 1, longest.max(label.chars().count()))
    });
    let plot_width = f64::from(WIDTH - 2 * MARGIN - Y_LABEL_AREA);
    let plot_height = f64::from(HEIGHT - 2 * MARGIN - X_LABEL_AREA - CAPTION_HEIGHT);
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
    chart: &LineChart,
    x_range: Range<f64>,
    y_axis: Y,
    y_span: f64,
    corner: Corner,
) -> Result<(), ChartError>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    area.fill(&WHITE).map_err(drawing_error)?;
    let mut plot = ChartBuilder::on(area)
        .caption(chart.title, ("sans-serif", CAPTION_FONT))
        .margin(MARGIN)
        .x_label_area_size(X_LABEL_AREA)
        .y_label_area_size(Y_LABEL_AREA)
        .build_cartesian_2d(x_range.clone(), y_axis)
        .map_err(drawing_error)?;
    let x_span = x_range.end - x_range.start;
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
        .draw()
        .map_err(drawing_error)?;

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
