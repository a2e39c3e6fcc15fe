//! Where the legend goes: the corner of the plot that hides the least of the data.

use std::ops::Range;

use super::LineChart;
use super::axis::drawable;

/// A corner of the plot, for the legend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Corner {
    UpperRight,
    UpperLeft,
    LowerRight,
    LowerLeft,
}

/// The corner where a legend box of `box_fraction` (width, height, as fractions of the plot)
/// hides the least of the data, measured as the length of line inside it (in fractions of
/// the plot; a reference line inside counts the box's width) plus the weight of each of
/// `obstacles` (a point in plot fractions and its weight: a note's label) inside it. Ties go
/// to the upper right, then upper left, lower right, lower left.
pub(super) fn legend_corner(
    chart: &LineChart,
    x_range: &Range<f64>,
    y_range: &Range<f64>,
    box_fraction: (f64, f64),
    obstacles: &[((f64, f64), f64)],
) -> Corner {
    let to_fraction = |(x, y): (f64, f64)| {
        let fx = (x - x_range.start) / (x_range.end - x_range.start);
        let fy = if chart.log_y {
            (y / y_range.start).ln() / (y_range.end / y_range.start).ln()
        } else {
            (y - y_range.start) / (y_range.end - y_range.start)
        };
        (fx, fy)
    };
    // Points along the lines, each standing for the length of line around it; a lone point
    // counts as a short stroke.
    const SAMPLES_PER_SEGMENT: u32 = 16;
    let mut samples: Vec<((f64, f64), f64)> = Vec::new();
    for series in chart.series {
        let points: Vec<(f64, f64)> = series
            .points
            .iter()
            .map(|&p| {
                if drawable(chart.log_y, p) {
                    to_fraction(p)
                } else {
                    (f64::NAN, f64::NAN)
                }
            })
            .collect();
        for (i, &a) in points.iter().enumerate() {
            if a.0.is_nan() {
                continue;
            }
            match points.get(i + 1).filter(|b| !b.0.is_nan()) {
                Some(&b) => {
                    let length = (b.0 - a.0).hypot(b.1 - a.1) / f64::from(SAMPLES_PER_SEGMENT);
                    samples.extend((0..SAMPLES_PER_SEGMENT).map(|k| {
                        let t = (f64::from(k) + 0.5) / f64::from(SAMPLES_PER_SEGMENT);
                        ((a.0 + t * (b.0 - a.0), a.1 + t * (b.1 - a.1)), length)
                    }));
                }
                None => samples.push((a, 0.01)),
            }
        }
    }
    let hlines: Vec<f64> = chart
        .hlines
        .iter()
        .map(|(_, y)| (x_range.start, *y))
        .filter(|&p| drawable(chart.log_y, p))
        .map(|p| to_fraction(p).1)
        .collect();
    let (width, height) = box_fraction;
    let covered = |corner: Corner| {
        let right = matches!(corner, Corner::UpperRight | Corner::LowerRight);
        let upper = matches!(corner, Corner::UpperRight | Corner::UpperLeft);
        let x_inside = |fx: f64| {
            if right {
                fx >= 1.0 - width
            } else {
                fx <= width
            }
        };
        let y_inside = |fy: f64| {
            if upper {
                fy >= 1.0 - height
            } else {
                fy <= height
            }
        };
        let lines: f64 = samples
            .iter()
            .chain(obstacles)
            .filter(|((fx, fy), _)| x_inside(*fx) && y_inside(*fy))
            .map(|(_, length)| length)
            .sum();
        lines + width * hlines.iter().filter(|&&fy| y_inside(fy)).count() as f64
    };
    let corners = [
        Corner::UpperRight,
        Corner::UpperLeft,
        Corner::LowerRight,
        Corner::LowerLeft,
    ];
    corners
        .into_iter()
        .min_by(|&a, &b| covered(a).total_cmp(&covered(b)))
        .expect("four corners")
}

#[cfg(test)]
mod tests {
    use super::super::Series;
    use super::super::axis::axis_ranges;
    use super::*;

    #[test]
    fn the_legend_avoids_the_corners_the_lines_pass_through() {
        let box_fraction = (0.3, 0.2);
        let corner = |points: &[(f64, f64)], hlines: &[(String, f64)]| {
            let series = [Series {
                label: "a".into(),
                points: points.to_vec(),
            }];
            let chart = LineChart {
                series: &series,
                hlines,
                ..LineChart::default()
            };
            let (x, y) = axis_ranges(&chart, false).unwrap();
            legend_corner(&chart, &x, &y, box_fraction, &[])
        };
        // A falling loss curve leaves the upper right free.
        assert_eq!(
            corner(&[(0.0, 5.0), (1.0, 1.0), (10.0, 0.5)], &[]),
            Corner::UpperRight
        );
        // A rising line crosses the upper right and the lower left.
        assert_eq!(corner(&[(0.0, 0.0), (10.0, 10.0)], &[]), Corner::UpperLeft);
        // ... and a reference line at the top rules out the upper left too.
        assert_eq!(
            corner(&[(0.0, 0.0), (10.0, 10.0)], &[("limit".into(), 9.9)]),
            Corner::LowerRight
        );
    }

    #[test]
    fn the_legend_avoids_an_obstacle_in_an_empty_corner() {
        let series = [Series {
            label: "a".into(),
            points: vec![(0.0, 5.0), (1.0, 1.0), (10.0, 0.5)],
        }];
        let chart = LineChart {
            series: &series,
            ..LineChart::default()
        };
        let (x, y) = axis_ranges(&chart, false).unwrap();
        // The falling curve leaves the upper right free, unless a note's label sits there;
        // then the upper left, which the curve crosses only at its steep start, is best.
        assert_eq!(
            legend_corner(&chart, &x, &y, (0.3, 0.2), &[]),
            Corner::UpperRight
        );
        let note = [((0.9, 0.9), 1.0)];
        assert_eq!(
            legend_corner(&chart, &x, &y, (0.3, 0.2), &note),
            Corner::UpperLeft
        );
    }
}
