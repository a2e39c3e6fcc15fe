//! The axes of a chart: ranges that fit the data, a log axis with round ticks, tick labels.

use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};

use super::LineChart;

/// At most this many labelled ticks on a log axis.
const MAX_LOG_TICKS: usize = 10;

/// Whether a point can be placed on the axes: finite, and positive on a log axis.
pub(super) fn drawable(log_y: bool, (x, y): (f64, f64)) -> bool {
    x.is_finite() && y.is_finite() && (!log_y || y > 0.0)
}

/// The x and y ranges of the plot, or `None` when no series has a drawable point.
///
/// x spans the drawable points exactly; y also spans the drawable reference lines, plus 5%
/// of the span at each end (in log space on a log axis). A zero span is widened so the
/// single value sits in the middle. With `y_from_zero` on a linear axis whose values are all
/// at least zero, y starts at exactly zero instead, and 10% is left at the top: room for
/// the band labels written there above the highest point.
pub(super) fn axis_ranges(
    chart: &LineChart,
    y_from_zero: bool,
) -> Option<(Range<f64>, Range<f64>)> {
    let points: Vec<(f64, f64)> = chart
        .series
        .iter()
        .flat_map(|series| series.points.iter().copied())
        .filter(|&point| drawable(chart.log_y, point))
        .collect();
    let (x_min, x_max) = min_max(points.iter().map(|p| p.0))?;
    let hlines = chart.hlines.iter().map(|(_, y)| (x_min, *y));
    let all_points = points
        .iter()
        .copied()
        .chain(hlines.filter(|&p| drawable(chart.log_y, p)));
    let (y_min, y_max) = min_max(all_points.map(|p| p.1))?;
    if y_from_zero && !chart.log_y && y_min >= 0.0 {
        let top = if y_max > 0.0 { 1.1 * y_max } else { 1.0 };
        return Some((widen(x_min, x_max), 0.0..top));
    }
    let x_range = widen(x_min, x_max);
    let y_range = if chart.log_y {
        // 5% of the log span is a factor (max / min)^0.05 at each end.
        let factor = if y_min < y_max {
            (y_max / y_min).powf(0.05)
        } else {
            1.5
        };
        y_min / factor..y_max * factor
    } else {
        let margin = if y_min < y_max {
            0.05 * (y_max - y_min)
        } else {
            0.5_f64.max(0.05 * y_max.abs())
        };
        y_min - margin..y_max + margin
    };
    Some((x_range, y_range))
}

/// `min..max`, or a unit range around a single value.
fn widen(min: f64, max: f64) -> Range<f64> {
    if min < max {
        min..max
    } else {
        min - 0.5..max + 0.5
    }
}

fn min_max(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// A logarithmic axis with round-number ticks in every decade it spans.
///
/// plotters' own log axis labels only powers of ten, which leaves a loss axis from 0.3 to 6
/// with labels above 1 only.
pub(super) struct LogAxis {
    range: Range<f64>,
    ticks: Vec<f64>,
    grid: Vec<f64>,
}

impl LogAxis {
    /// An axis over `range`, which must be positive.
    pub(super) fn new(range: Range<f64>) -> Self {
        let grid = if range.end / range.start < 1e6 {
            mantissa_ticks(&range, &[1, 2, 3, 4, 5, 6, 7, 8, 9])
        } else {
            Vec::new()
        };
        Self {
            ticks: log_ticks(&range),
            grid,
            range,
        }
    }
}

impl Ranged for LogAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let (lo, hi) = (self.range.start.log10(), self.range.end.log10());
        let fraction = (value.log10() - lo) / (hi - lo);
        // Clamped so a value far outside the range (never drawn) cannot overflow the sum.
        let offset = (fraction * f64::from(limit.1 - limit.0))
            .round()
            .clamp(-1e6, 1e6);
        limit.0 + offset as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.grid.clone()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

/// Every `m · 10^k` in `range` for the given mantissas `m`.
fn mantissa_ticks(range: &Range<f64>, mantissas: &[u8]) -> Vec<f64> {
    let decades = range.start.log10().floor() as i32..=range.end.log10().floor() as i32;
    decades
        .flat_map(|k| mantissas.iter().map(move |&m| f64::from(m) * 10f64.powi(k)))
        .filter(|v| range.start <= *v && *v <= range.end)
        .collect()
}

/// Ticks of a log axis: the densest of 1–9, {1, 2, 5}, {1, 3}, {1} per decade that fits in
/// [`MAX_LOG_TICKS`]; every few powers of ten over many decades; round linear steps over
/// less than a decade.
fn log_ticks(range: &Range<f64>) -> Vec<f64> {
    let mantissa_sets: [&[u8]; 4] = [&[1, 2, 3, 4, 5, 6, 7, 8, 9], &[1, 2, 5], &[1, 3], &[1]];
    for mantissas in mantissa_sets {
        let ticks = mantissa_ticks(range, mantissas);
        if ticks.len() < 2 {
            return linear_ticks(range, 5);
        }
        if ticks.len() <= MAX_LOG_TICKS {
            return ticks;
        }
    }
    let powers = mantissa_ticks(range, &[1]);
    let stride = powers.len().div_ceil(MAX_LOG_TICKS);
    powers.into_iter().step_by(stride).collect()
}

/// Multiples of a round step (1, 2 or 5 times a power of ten) in `range`, about `target` of
/// them.
fn linear_ticks(range: &Range<f64>, target: usize) -> Vec<f64> {
    let raw_step = (range.end - range.start) / target as f64;
    let magnitude = 10f64.powf(raw_step.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw_step)
        .unwrap_or(10.0 * magnitude);
    let first = (range.start / step).ceil() as i64;
    let last = (range.end / step).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// A tick label with at most four significant digits and no trailing zeros ("50", "0.375",
/// "1.5e9"); values within `span · 1e-9` of zero, float noise of a tick at 0, print "0".
pub(super) fn tick_label(value: f64, span: f64) -> String {
    if value.abs() <= span.abs() * 1e-9 {
        return "0".into();
    }
    let magnitude = value.abs().log10().floor();
    if !(-4.0..6.0).contains(&magnitude) {
        let scientific = format!("{value:.3e}");
        let (mantissa, exponent) = scientific
            .split_once('e')
            .expect("{:e} output has an exponent");
        return format!("{}e{exponent}", trim_zeros(mantissa));
    }
    let decimals = (3.0 - magnitude).max(0.0) as usize;
    trim_zeros(&format!("{value:.decimals$}")).to_string()
}

fn trim_zeros(number: &str) -> &str {
    if number.contains('.') {
        number.trim_end_matches('0').trim_end_matches('.')
    } else {
        number
    }
}

#[cfg(test)]
mod tests {
    use super::super::Series;
    use super::*;

    fn series(points: &[(f64, f64)]) -> [Series; 1] {
        [Series {
            label: "a".into(),
            points: points.to_vec(),
        }]
    }

    fn chart<'a>(series: &'a [Series], hlines: &'a [(String, f64)], log_y: bool) -> LineChart<'a> {
        LineChart {
            series,
            hlines,
            log_y,
            ..LineChart::default()
        }
    }

    fn assert_all_close(actual: &[f64], expected: &[f64]) {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
        assert!(
            actual.len() == expected.len()
                && actual.iter().zip(expected).all(|(&a, &b)| close(a, b)),
            "{actual:?} != {expected:?}"
        );
    }

    fn assert_range(actual: &Range<f64>, expected: Range<f64>) {
        assert_all_close(&[actual.start, actual.end], &[expected.start, expected.end]);
    }

    #[test]
    fn ranges_cover_points_and_reference_lines_with_a_margin_on_y() {
        let series = series(&[(0.0, 1.0), (10.0, 3.0)]);
        let hlines = [("floor".to_string(), 0.5)];
        let (x, y) = axis_ranges(&chart(&series, &hlines, false), false).unwrap();
        // y spans 0.5 (the line) to 3: 5% of 2.5 = 0.125 on each side.
        assert_range(&x, 0.0..10.0);
        assert_range(&y, 0.375..3.125);
    }

    #[test]
    fn ranges_skip_non_finite_points() {
        let series = series(&[
            (0.0, 1.0),
            (1.0, f64::NAN),
            (f64::INFINITY, 9.0),
            (5.0, 5.0),
        ]);
        let (x, y) = axis_ranges(&chart(&series, &[], false), false).unwrap();
        // Finite y from 1 to 5: a margin of 0.2.
        assert_range(&x, 0.0..5.0);
        assert_range(&y, 0.8..5.2);
    }

    #[test]
    fn a_single_point_sits_in_the_middle_of_widened_ranges() {
        let series = series(&[(5.0, 2.0)]);
        let (x, y) = axis_ranges(&chart(&series, &[], false), false).unwrap();
        // A zero span is widened by 0.5 each side (y: max(0.5, 5% of 2)).
        assert_range(&x, 4.5..5.5);
        assert_range(&y, 1.5..2.5);
        assert!(axis_ranges(&chart(&[], &[("floor".into(), 1.0)], false), false).is_none());
    }

    #[test]
    fn a_range_from_zero_starts_at_zero_and_keeps_its_margin_on_top() {
        let positive = series(&[(0.0, 10.0), (4.0, 30.0)]);
        let (x, y) = axis_ranges(&chart(&positive, &[], false), true).unwrap();
        // 0 to 30, plus 10% of 30 above.
        assert_range(&x, 0.0..4.0);
        assert_range(&y, 0.0..33.0);
        // A negative value, or a log axis, keeps the ordinary range.
        let below = series(&[(0.0, -1.0), (1.0, 1.0)]);
        let (_, y) = axis_ranges(&chart(&below, &[], false), true).unwrap();
        assert_range(&y, -1.1..1.1);
        let (_, y) = axis_ranges(&chart(&positive, &[], true), true).unwrap();
        assert!(y.start > 9.0, "{y:?}");
    }

    #[test]
    fn a_log_range_leaves_out_values_at_or_below_zero() {
        let series = series(&[(0.0, 0.0), (1.0, 1.0), (2.0, 100.0), (3.0, -1.0)]);
        let hlines = [("zero".to_string(), 0.0), ("ten".to_string(), 10.0)];
        let (x, y) = axis_ranges(&chart(&series, &hlines, true), false).unwrap();
        // y from 1 to 100, widened by a factor 100^0.05 = 10^0.1 = 1.2589254117941673.
        assert_range(&x, 1.0..2.0);
        assert_range(&y, 0.7943282347242815..125.89254117941673);
    }

    #[test]
    fn log_ticks_are_round_numbers_in_every_decade() {
        // 0.3 to 7.4: 1-9 per decade gives 14 ticks (> 10), so {1, 2, 5}: 0.5, 1, 2, 5.
        assert_all_close(&log_ticks(&(0.3..7.4)), &[0.5, 1.0, 2.0, 5.0]);
        // 1 to 1e12: 13 powers of ten, thinned to every second one.
        assert_all_close(
            &log_ticks(&(1.0..1e12)),
            &[1.0, 1e2, 1e4, 1e6, 1e8, 1e10, 1e12],
        );
        // 2 to 2.6 holds only the tick 2: round linear steps of 0.2 instead (0.6 / 5 = 0.12).
        assert_all_close(&log_ticks(&(2.0..2.6)), &[2.0, 2.2, 2.4, 2.6]);
        let axis = LogAxis::new(1.0..100.0);
        // 10 is halfway between 1 and 100 in log space.
        assert_eq!(axis.map(&10.0, (0, 400)), 200);
    }

    #[test]
    fn tick_labels_have_four_significant_digits_and_no_trailing_zeros() {
        let labels = [50.0, 0.375, 0.1 * 3.0, 12_345.0, -2.5, 1.5e9, 2.5e-5, 1e-17]
            .map(|v| tick_label(v, 1.0));
        assert_eq!(
            labels,
            [
                "50", "0.375", "0.3", "12345", "-2.5", "1.5e9", "2.5e-5", "0"
            ]
        );
    }
}
