//! Drawing a chart's annotations with plotters: band fills and names, noted points and
//! their labels. Where things go is decided in `annotate`; this only draws.

use std::ops::Range;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::annotate::{
    BAND_FONT, BandText, band_colour, band_labels, band_text, text_height, text_width,
};
use super::axis::drawable;
use super::placement::{NOTE_FONT, PixelBox, place_labels};
use super::{AnnotatedChart, Band, ChartError};

/// The plot of a chart, whatever its axes.
type Plot<'a, 'b, X, Y> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<X, Y>>;

fn drawing_error(error: impl std::fmt::Display) -> ChartError {
    ChartError::Drawing(error.to_string())
}

/// Shades each band over the plot's full height, in its label's colour.
pub(super) fn draw_band_fills<X, Y>(
    plot: &mut Plot<X, Y>,
    bands: &[Band],
    y_range: &Range<f64>,
) -> Result<(), ChartError>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let names = band_labels(bands);
    for band in bands {
        let index = names
            .iter()
            .position(|name| *name == band.label)
            .expect("every band's label is listed");
        let corners = [(band.start, y_range.start), (band.end, y_range.end)];
        plot.draw_series([Rectangle::new(corners, band_colour(index).filled())])
            .map_err(drawing_error)?;
    }
    Ok(())
}

/// Writes each band's label at the top of the plot: across the band, or turned along a
/// narrow one (see [`band_text`]); `plot_size` is the estimate the legend was built with.
/// Returns the pixel boxes of the labels written, for the notes to keep clear of.
pub(super) fn draw_band_names<X, Y>(
    area: &DrawingArea<SVGBackend, Shift>,
    plot: &Plot<X, Y>,
    bands: &[Band],
    x_range: &Range<f64>,
    plot_size: (f64, f64),
) -> Result<Vec<PixelBox>, ChartError>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let colour = RGBColor(70, 70, 70);
    let across = TextStyle::from(("sans-serif", BAND_FONT).into_font())
        .pos(Pos::new(HPos::Center, VPos::Top))
        .color(&colour);
    let along = TextStyle::from(
        ("sans-serif", BAND_FONT)
            .into_font()
            .transform(FontTransform::Rotate90),
    )
    .pos(Pos::new(HPos::Left, VPos::Center))
    .color(&colour);
    let (_, plot_y) = plot.plotting_area().get_pixel_range();
    let top = plot_y.start + 5;
    let length = |band: &Band| text_width(&band.label, BAND_FONT);
    let thickness = text_height(BAND_FONT);
    let mut written = Vec::new();
    for band in bands {
        let middle = (band.start + band.end) / 2.0;
        let (x, _) = plot.backend_coord(&(middle, plot.y_range().start));
        let (style, (width, height)) = match band_text(band, x_range, plot_size) {
            BandText::Across => (&across, (length(band), thickness)),
            BandText::Along => (&along, (thickness, length(band))),
            BandText::Nowhere => continue,
        };
        area.draw(&Text::new(band.label.as_str(), (x, top), style))
            .map_err(drawing_error)?;
        written.push(PixelBox {
            left: x - width / 2,
            top,
            right: x + width / 2 + 1,
            bottom: top + height,
        });
    }
    Ok(written)
}

/// Marks each note's point with a dot in its series' colour and writes its label beside it,
/// clear of the `taken` boxes (the band names) where it can be, and where it hides the
/// fewest points of the lines (see [`place_labels`]), on a light backing so it reads over
/// any line it still crosses.
pub(super) fn draw_notes<X, Y>(
    area: &DrawingArea<SVGBackend, Shift>,
    plot: &mut Plot<X, Y>,
    annotated: &AnnotatedChart,
    series_colours: &[RGBColor],
    taken: &[PixelBox],
) -> Result<(), ChartError>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let notes: Vec<_> = annotated
        .notes
        .iter()
        .filter(|note| drawable(annotated.chart.log_y, note.point))
        .collect();
    for note in &notes {
        let colour = series_colours[note.series % series_colours.len()];
        plot.draw_series([
            Circle::new(note.point, 5, colour.filled()),
            Circle::new(note.point, 5, BLACK.stroke_width(1)),
        ])
        .map_err(drawing_error)?;
    }
    let points: Vec<(i32, i32)> = notes.iter().map(|n| plot.backend_coord(&n.point)).collect();
    let widths: Vec<i32> = notes
        .iter()
        .map(|n| text_width(&n.label, NOTE_FONT))
        .collect();
    let (plot_x, plot_y) = plot.plotting_area().get_pixel_range();
    let bounds = PixelBox {
        left: plot_x.start,
        top: plot_y.start,
        right: plot_x.end,
        bottom: plot_y.end,
    };
    let ink: Vec<(i32, i32)> = annotated
        .chart
        .series
        .iter()
        .flat_map(|series| &series.points)
        .filter(|&&point| drawable(annotated.chart.log_y, point))
        .map(|point| plot.backend_coord(point))
        .collect();
    let crowding = |label: &PixelBox| ink.iter().filter(|&&p| label.contains(p)).count();
    let line_height = NOTE_FONT as i32 + 6;
    let boxes = place_labels(&points, &widths, &bounds, line_height, taken, crowding);
    let style = TextStyle::from(("sans-serif", NOTE_FONT).into_font())
        .pos(Pos::new(HPos::Left, VPos::Center))
        .color(&BLACK);
    for (note, label) in notes.iter().zip(boxes) {
        let backing = [
            (label.left - 3, label.top + 1),
            (label.right + 3, label.bottom - 1),
        ];
        area.draw(&Rectangle::new(backing, WHITE.mix(0.8).filled()))
            .map_err(drawing_error)?;
        let middle = (label.top + label.bottom) / 2;
        area.draw(&Text::new(
            note.label.as_str(),
            (label.left, middle),
            &style,
        ))
        .map_err(drawing_error)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{LineChart, Note, Series, render_annotated_chart};
    use super::*;

    /// How many text elements of `svg` read exactly `text`.
    fn texts(svg: &str, text: &str) -> usize {
        svg.matches(&format!(">\n{text}\n</text>")).count()
    }

    fn band(label: &str, start: f64, end: f64) -> Band {
        Band {
            label: label.into(),
            start,
            end,
        }
    }

    fn render(bands: &[Band], notes: &[Note]) -> String {
        let series = [Series {
            label: "live".into(),
            points: vec![(0.0, 1.0), (50.0, 9.0), (100.0, 2.0)],
        }];
        render_annotated_chart(&AnnotatedChart {
            chart: LineChart {
                series: &series,
                ..LineChart::default()
            },
            bands,
            notes,
            y_from_zero: true,
        })
        .unwrap()
    }

    #[test]
    fn every_band_is_named_once_on_the_plot_or_in_the_legend() {
        // On about 870 pixels for 100 units: 40 and 48 units have room across, 2.5 units
        // (about 22 px) only for turned text, 0.5 units (about 4 px) for none.
        let bands = [
            band("forward", 0.0, 40.0),
            band("backward", 40.0, 88.0),
            band("clip", 88.0, 90.5),
            band("optimizer", 90.5, 91.0),
            band("forward", 91.0, 100.0),
        ];
        let svg = render(&bands, &[]);
        // Both forward bands carry their name; the others once each, one of them turned.
        assert_eq!(texts(&svg, "forward"), 2);
        for label in ["backward", "clip", "optimizer", "live"] {
            assert_eq!(texts(&svg, label), 1, "{label}");
        }
        assert_eq!(svg.matches("rotate(90").count(), 1);
    }

    #[test]
    fn a_note_is_a_dot_in_its_series_colour_with_its_label() {
        let notes = [Note {
            label: "peak 9 MiB".into(),
            point: (50.0, 9.0),
            series: 0,
        }];
        let svg = render(&[band("forward", 0.0, 100.0)], &notes);
        assert_eq!(texts(&svg, "peak 9 MiB"), 1);
        // The first series colour, (31, 119, 180).
        assert!(
            svg.contains(r##"r="5" opacity="1" fill="#1F77B4""##),
            "{svg}"
        );
    }
}
