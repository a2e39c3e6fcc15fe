//! The layout of a chart's bands: their colours, how their labels fit, which ones the legend
//! must name; and the text width estimate every label placement uses.

use std::ops::Range;

use plotters::style::RGBColor;

use super::Band;

/// Font size of a band's label, written at the top of the plot.
pub(super) const BAND_FONT: u32 = 13;
/// Pixels of room a band's label needs on each side within the band.
const BAND_PADDING: i32 = 2;

/// Band fills: light tints, so the lines and the grid stay readable on top of them, each
/// still distinct from the white background.
const BAND_COLOURS: [RGBColor; 6] = [
    RGBColor(222, 222, 222),
    RGBColor(253, 226, 200),
    RGBColor(222, 242, 216),
    RGBColor(228, 222, 244),
    RGBColor(214, 230, 246),
    RGBColor(250, 218, 216),
];

/// The distinct labels of `bands`, in order of first appearance: one legend entry and one
/// colour each.
pub(super) fn band_labels(bands: &[Band]) -> Vec<&str> {
    let mut labels: Vec<&str> = Vec::new();
    for band in bands {
        if !labels.contains(&band.label.as_str()) {
            labels.push(&band.label);
        }
    }
    labels
}

/// The fill of the band label at `index` in [`band_labels`].
pub(super) fn band_colour(index: usize) -> RGBColor {
    BAND_COLOURS[index % BAND_COLOURS.len()]
}

/// How a band's label is written at the top of the plot, if at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BandText {
    /// Across the band, horizontally.
    Across,
    /// Along the band, turned a quarter, reading downwards: for narrow bands.
    Along,
    /// Too narrow even for that: the legend names the band's colour instead.
    Nowhere,
}

/// How `band`'s label fits at [`BAND_FONT`], on an x axis over `x_range` drawn in a plot of
/// `plot_size` pixels (width, height). Turned text needs the band to be a line of text
/// wide, and at most a third of the plot high.
pub(super) fn band_text(band: &Band, x_range: &Range<f64>, plot_size: (f64, f64)) -> BandText {
    let (plot_width, plot_height) = plot_size;
    let pixels = (band.end - band.start) / (x_range.end - x_range.start) * plot_width;
    let length = f64::from(text_width(&band.label, BAND_FONT) + 2 * BAND_PADDING);
    if length <= pixels {
        BandText::Across
    } else if f64::from(BAND_FONT) / SVG_FONT_SCALE + 2.0 <= pixels && length <= plot_height / 3.0 {
        BandText::Along
    } else {
        BandText::Nowhere
    }
}

/// The band labels the legend lists: those with a band too narrow to carry the label even
/// turned, in [`band_labels`] order.
pub(super) fn legend_band_labels<'a>(
    bands: &'a [Band],
    x_range: &Range<f64>,
    plot_size: (f64, f64),
) -> Vec<&'a str> {
    band_labels(bands)
        .into_iter()
        .filter(|&label| {
            bands.iter().any(|band| {
                band.label == label && band_text(band, x_range, plot_size) == BandText::Nowhere
            })
        })
        .collect()
}

/// plotters' SVG backend writes a font of size `s` as `font-size: s / 1.24`.
const SVG_FONT_SCALE: f64 = 1.24;

/// The width in pixels of `text` at plotters font size `font`, estimated at 0.55 of the
/// rendered font size per character (close to DejaVu Sans, which viewers usually pick for
/// `sans-serif`).
pub(super) fn text_width(text: &str, font: u32) -> i32 {
    (0.55 * f64::from(font) / SVG_FONT_SCALE * text.chars().count() as f64).ceil() as i32
}

/// The height in pixels of a line of text at plotters font size `font`.
pub(super) fn text_height(font: u32) -> i32 {
    (f64::from(font) / SVG_FONT_SCALE).ceil() as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn band(label: &str) -> Band {
        Band {
            label: label.into(),
            start: 0.0,
            end: 1.0,
        }
    }

    #[test]
    fn band_labels_are_listed_once_in_order_of_first_appearance() {
        let bands = [
            band("forward"),
            band("backward"),
            band("forward"),
            band("optimizer"),
            band("backward"),
        ];
        assert_eq!(band_labels(&bands), ["forward", "backward", "optimizer"]);
        assert_eq!(band_colour(1), band_colour(1 + BAND_COLOURS.len()));
        assert_ne!(band_colour(0), band_colour(1));
    }

    #[test]
    fn text_width_grows_with_the_text_and_the_font() {
        // 0.55 · 14 / 1.24 · 10 = 62.1; 14 / 1.24 = 11.3
        assert_eq!(text_width("peak 9 MiB", 14), 63);
        assert_eq!(text_height(14), 12);
        assert_eq!(text_width("", 14), 0);
    }

    #[test]
    fn a_band_label_goes_across_then_along_then_to_the_legend() {
        let band = |label: &str, start: f64, end: f64| Band {
            label: label.into(),
            start,
            end,
        };
        // On a 1000 × 400 plot for x from 0 to 100, "forward" needs 0.55 · 13 / 1.24 · 7 =
        // 40.4 → 41 px plus 4 of padding across; turned, a line of 13 / 1.24 + 2 = 12.5 px.
        let bands = [
            band("forward", 0.0, 10.0),
            band("backward", 10.0, 30.0),
            band("forward", 30.0, 34.0),
            band("optimizer", 34.0, 35.0),
        ];
        let size = (1000.0, 400.0);
        let texts: Vec<BandText> = bands
            .iter()
            .map(|b| band_text(b, &(0.0..100.0), size))
            .collect();
        // 100 px, 200 px, 40 px, 10 px.
        assert_eq!(
            texts,
            [
                BandText::Across,
                BandText::Across,
                BandText::Along,
                BandText::Nowhere
            ]
        );
        assert_eq!(
            legend_band_labels(&bands, &(0.0..100.0), size),
            ["optimizer"]
        );
        // In a plot 100 px high, turned text longer than 33 px (here 45) does not fit either.
        assert_eq!(
            legend_band_labels(&bands, &(0.0..100.0), (1000.0, 100.0)),
            ["forward", "optimizer"]
        );
    }
}
