//! Where a note's label goes: beside its point, inside the plot, off the other labels, and
//! over as little of the lines as possible.

/// Font size of a note's label.
pub(super) const NOTE_FONT: u32 = 14;
/// Pixels between a note's point and its label, sideways.
const NOTE_GAP: i32 = 9;
/// Pixels between a note's point and its label, above or below.
const NOTE_LIFT: i32 = 3;

/// A rectangle in pixels, `left..right` by `top..bottom` (y grows downwards).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PixelBox {
    pub(super) left: i32,
    pub(super) top: i32,
    pub(super) right: i32,
    pub(super) bottom: i32,
}

impl PixelBox {
    fn overlaps(&self, other: &PixelBox) -> bool {
        self.left < other.right
            && other.left < self.right
            && self.top < other.bottom
            && other.top < self.bottom
    }

    fn inside(&self, bounds: &PixelBox) -> bool {
        bounds.left <= self.left
            && self.right <= bounds.right
            && bounds.top <= self.top
            && self.bottom <= bounds.bottom
    }

    /// Whether the pixel `(x, y)` is in the box.
    pub(super) fn contains(&self, (x, y): (i32, i32)) -> bool {
        (self.left..self.right).contains(&x) && (self.top..self.bottom).contains(&y)
    }
}

/// The places tried for a label `width` wide beside the point `(x, y)`, in order of
/// preference: level with the point to its right and left, then above, then below.
fn candidates((x, y): (i32, i32), width: i32, line_height: i32) -> [PixelBox; 6] {
    let right = x + NOTE_GAP;
    let left = x - NOTE_GAP - width;
    let level = y - line_height / 2;
    let above = y - NOTE_LIFT - line_height;
    let below = y + NOTE_LIFT;
    [
        (right, level),
        (left, level),
        (right, above),
        (left, above),
        (right, below),
        (left, below),
    ]
    .map(|(left, top)| PixelBox {
        left,
        top,
        right: left + width,
        bottom: top + line_height,
    })
}

/// The boxes of labels `widths[i]` pixels wide beside `points[i]` (pixels), in order.
///
/// Each label takes, of the [`candidates`] that stay inside `plot` and off both the `taken`
/// boxes and the labels placed before it, the one that covers the fewest pixels by
/// `crowding` (the points of the lines inside it); ties go to the earlier candidate. When
/// every candidate is out, the label goes level with its point — right, or left if the
/// right leaves the plot — and moves down by `line_height` until it overlaps no earlier
/// label (`taken` boxes are then ignored: the label must go somewhere).
///
/// # Panics
/// If `line_height` is not positive (the labels could never move apart).
pub(super) fn place_labels(
    points: &[(i32, i32)],
    widths: &[i32],
    plot: &PixelBox,
    line_height: i32,
    taken: &[PixelBox],
    crowding: impl Fn(&PixelBox) -> usize,
) -> Vec<PixelBox> {
    assert!(
        line_height > 0,
        "place_labels: line_height must be positive"
    );
    let mut placed: Vec<PixelBox> = Vec::with_capacity(points.len());
    for (&point, &width) in points.iter().zip(widths) {
        let options = candidates(point, width, line_height);
        let free = options.iter().filter(|label| {
            label.inside(plot) && !placed.iter().chain(taken).any(|p| p.overlaps(label))
        });
        let best = free.min_by_key(|label| crowding(label)).copied();
        let label = best.unwrap_or_else(|| {
            let [mut label, left, ..] = options;
            if label.right > plot.right {
                label = left;
            }
            // Moving down only, it clears the lowest earlier label after finitely many moves.
            while placed.iter().any(|other| other.overlaps(&label)) {
                label.top += line_height;
                label.bottom += line_height;
            }
            label
        });
        placed.push(label);
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLOT: PixelBox = PixelBox {
        left: 0,
        top: 0,
        right: 1000,
        bottom: 1000,
    };

    fn lefts_and_tops(boxes: &[PixelBox]) -> Vec<(i32, i32)> {
        boxes.iter().map(|b| (b.left, b.top)).collect()
    }

    #[test]
    fn a_label_goes_right_of_its_point_unless_it_would_leave_the_plot() {
        let boxes = place_labels(&[(100, 50), (950, 200)], &[80, 80], &PLOT, 20, &[], |_| 0);
        // Right: 100 + 9 .. 189, centred on y 50 (40..60).
        assert_eq!(
            boxes[0],
            PixelBox {
                left: 109,
                top: 40,
                right: 189,
                bottom: 60
            }
        );
        // 950 + 9 + 80 > 1000: left of the point instead, 950 − 9 − 80 = 861.
        assert_eq!((boxes[1].left, boxes[1].right), (861, 941));
    }

    #[test]
    fn a_label_avoids_the_lines_and_the_labels_before_it() {
        // Lines crowd the right of the point (200, 500): the label goes left, 200 − 9 − 80.
        let crowded_right = |label: &PixelBox| usize::from(label.left > 200);
        let boxes = place_labels(&[(200, 500)], &[80], &PLOT, 20, &[], crowded_right);
        assert_eq!(lefts_and_tops(&boxes), [(111, 490)]);
        // Two points at one place: the second label takes the left.
        let boxes = place_labels(&[(100, 100), (105, 104)], &[60, 60], &PLOT, 20, &[], |_| 0);
        assert_eq!(lefts_and_tops(&boxes), [(109, 90), (36, 94)]);
        // A band name right of the point (150..200 by 95..105) sends the label left too.
        let name = PixelBox {
            left: 150,
            top: 95,
            right: 200,
            bottom: 105,
        };
        let boxes = place_labels(&[(100, 100)], &[60], &PLOT, 20, &[name], |_| 0);
        assert_eq!(lefts_and_tops(&boxes), [(31, 90)]);
    }

    #[test]
    fn a_label_with_no_free_candidate_moves_down_until_clear() {
        // A point at the top right corner of a short plot: the first label fits only level
        // with it on the left; for the second no candidate is free, so it goes there too
        // and moves down past the first.
        let plot = PixelBox {
            left: 0,
            top: 0,
            right: 200,
            bottom: 40,
        };
        let boxes = place_labels(&[(190, 10), (190, 10)], &[60, 60], &plot, 20, &[], |_| 0);
        // Level: 190 − 9 − 60 = 121, top 10 − 10 = 0 for both; the second moves to 20.
        assert_eq!(lefts_and_tops(&boxes), [(121, 0), (121, 20)]);
    }

    #[test]
    fn a_box_contains_its_top_left_pixel_but_not_its_bottom_right() {
        let label = PixelBox {
            left: 10,
            top: 20,
            right: 30,
            bottom: 40,
        };
        assert!(label.contains((10, 20)) && label.contains((29, 39)));
        assert!(!label.contains((30, 39)) && !label.contains((29, 40)));
    }
}
