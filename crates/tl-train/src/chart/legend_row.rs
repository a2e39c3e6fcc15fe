//! The legend of a chart with bands: rows of entries between the caption and the plot.
//!
//! Bands shade the whole height of the plot and a memory timeline fills its width, so no
//! corner is free for a legend box; above the plot, the legend hides nothing.

use std::ops::Range;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::ChartError;
use super::annotate::text_width;

/// Height of one row of entries, in pixels.
pub(super) const ROW_HEIGHT: i32 = 22;
/// Width of an entry's swatch.
const SWATCH: i32 = 24;
/// Between a swatch and its label.
const SWATCH_GAP: i32 = 6;
/// Between two entries of a row.
const ENTRY_GAP: i32 = 24;

/// What an entry shows before its label.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Swatch {
    /// A solid line: a series.
    Line(RGBColor),
    /// A dashed line: a reference line.
    Dashed(RGBColor),
    /// A filled box: a band.
    Fill(RGBColor),
}

/// One legend entry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Entry<'a> {
    pub(super) label: &'a str,
    pub(super) swatch: Swatch,
}

impl Entry<'_> {
    /// Its width in pixels at `font`, swatch included.
    fn width(&self, font: u32) -> i32 {
        SWATCH + SWATCH_GAP + text_width(self.label, font)
    }
}

/// Splits entries `widths[i]` pixels wide into rows at most `available` wide (with the gaps
/// between entries), keeping their order; an entry wider than a row gets a row of its own.
pub(super) fn rows(widths: &[i32], available: i32) -> Vec<Range<usize>> {
    let mut rows = Vec::new();
    let (mut start, mut used) = (0, 0);
    for (index, &width) in widths.iter().enumerate() {
        if index > start && used + ENTRY_GAP + width > available {
            rows.push(start..index);
            (start, used) = (index, width);
        } else {
            used += if index > start { ENTRY_GAP } else { 0 } + width;
        }
    }
    if start < widths.len() {
        rows.push(start..widths.len());
    }
    rows
}

/// How many rows `entries` take above a plot `plot_width` pixels wide.
pub(super) fn row_count(entries: &[Entry], font: u32, plot_width: i32) -> usize {
    let widths: Vec<i32> = entries.iter().map(|entry| entry.width(font)).collect();
    rows(&widths, plot_width).len()
}

/// Draws `entries` in rows centred over the plot's pixel columns `plot_x`, the first row
/// starting at pixel row `top`.
pub(super) fn draw(
    area: &DrawingArea<SVGBackend, Shift>,
    entries: &[Entry],
    font: u32,
    plot_x: &Range<i32>,
    top: i32,
) -> Result<(), ChartError> {
    let drawing = |error: DrawingAreaErrorKind<_>| ChartError::Drawing(error.to_string());
    let widths: Vec<i32> = entries.iter().map(|entry| entry.width(font)).collect();
    let style = TextStyle::from(("sans-serif", font).into_font())
        .pos(Pos::new(HPos::Left, VPos::Center))
        .color(&BLACK);
    for (row_index, row) in rows(&widths, plot_x.end - plot_x.start)
        .into_iter()
        .enumerate()
    {
        let row_width: i32 =
            widths[row.clone()].iter().sum::<i32>() + ENTRY_GAP * (row.len() as i32 - 1);
        let mut x = plot_x.start + (plot_x.end - plot_x.start - row_width).max(0) / 2;
        let y = top + row_index as i32 * ROW_HEIGHT + ROW_HEIGHT / 2;
        for (entry, width) in entries[row.clone()].iter().zip(&widths[row]) {
            match entry.swatch {
                Swatch::Line(colour) => area.draw(&PathElement::new(
                    vec![(x, y), (x + SWATCH, y)],
                    colour.stroke_width(2),
                )),
                Swatch::Dashed(colour) => {
                    let style = colour.stroke_width(2);
                    area.draw(&PathElement::new(vec![(x, y), (x + 9, y)], style))
                        .and_then(|()| {
                            area.draw(&PathElement::new(vec![(x + 14, y), (x + SWATCH, y)], style))
                        })
                }
                Swatch::Fill(colour) => {
                    let corners = [(x, y - 6), (x + SWATCH, y + 6)];
                    area.draw(&Rectangle::new(corners, colour.filled()))
                        .and_then(|()| {
                            let border = RGBColor(160, 160, 160).stroke_width(1);
                            area.draw(&Rectangle::new(corners, border))
                        })
                }
            }
            .map_err(drawing)?;
            area.draw(&Text::new(
                entry.label,
                (x + SWATCH + SWATCH_GAP, y),
                &style,
            ))
            .map_err(drawing)?;
            x += width + ENTRY_GAP;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_fill_a_row_before_starting_the_next() {
        // 100 + 24 + 100 + 24 + 100 = 348 fits in 350; the fourth starts a new row.
        assert_eq!(rows(&[100, 100, 100, 100], 350), [0..3, 3..4]);
        // An entry wider than the row still gets one, alone.
        assert_eq!(rows(&[500, 100], 350), [0..1, 1..2]);
        assert_eq!(rows(&[], 350), Vec::<Range<usize>>::new());
    }

    #[test]
    fn an_entry_is_as_wide_as_its_swatch_and_label() {
        let entry = Entry {
            label: "plain",
            swatch: Swatch::Line(BLACK),
        };
        // 24 + 6 + ⌈0.55 · 15 / 1.24 · 5⌉ = 30 + 34
        assert_eq!(entry.width(15), 64);
        assert_eq!(row_count(&[entry; 3], 15, 100), 3);
        assert_eq!(row_count(&[entry; 3], 15, 1000), 1);
    }
}
