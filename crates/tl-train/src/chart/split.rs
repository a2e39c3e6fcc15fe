//! The diagram of a Llama block split over a tensor-parallel group (`tinyllm plan --tp T
//! --diagram FILE`): what each rank holds, what every rank holds whole, and where the group
//! communicates, with the model's own sizes.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::ChartError;
use crate::model::ModelConfig;

const WIDTH: u32 = 960;
const MARGIN: i32 = 20;
const ROW: i32 = 46;
const BOX: i32 = 32;
const FONT: u32 = 15;
const SMALL: u32 = 13;

/// Replicated: every rank holds it whole.
const WHOLE: RGBColor = RGBColor(220, 220, 220);
/// Collectives.
const COMM: RGBColor = RGBColor(214, 39, 40);
/// Each rank's slices, by rank (cycled).
const RANKS: [RGBColor; 4] = [
    RGBColor(174, 199, 232),
    RGBColor(255, 187, 120),
    RGBColor(152, 223, 138),
    RGBColor(197, 176, 213),
];

/// One row of the diagram.
enum Row {
    /// Every rank computes it on the whole activations.
    Whole(String),
    /// Each rank its own part: a label per rank.
    Split(Vec<String>),
    /// A collective across the group, forward and backward.
    Collective(String),
}

/// The rows of a block of `model` over `t` ranks, top to bottom.
fn rows(model: &ModelConfig, t: usize) -> Vec<Row> {
    let (d, heads, hidden) = (model.d_model, model.n_heads, model.hidden);
    let per = |n: usize| n / t.max(1);
    let ranks = |label: &dyn Fn(usize) -> String| (0..t).map(label).collect::<Vec<_>>();
    vec![
        Row::Whole(format!(
            "x  [B, T, {d}]  the residual stream, whole on every rank"
        )),
        Row::Whole("RMSNorm (gain whole; its gradient equal on every rank)".into()),
        Row::Collective(
            "copy-to: identity forward, all-reduce of the input's gradient backward".into(),
        ),
        Row::Split(ranks(&|r| {
            let first = r * per(heads);
            format!(
                "Wq Wk Wv [{d}, {}]: heads {first}..{}",
                per(d),
                first + per(heads)
            )
        })),
        Row::Split(ranks(&|_| format!("attention over {} heads", per(heads)))),
        Row::Split(ranks(&|_| format!("Wo [{}, {d}]: a partial sum", per(d)))),
        Row::Collective(
            "reduce-from: all-reduce of the partial sums forward, identity backward".into(),
        ),
        Row::Whole("+ x  (dropout, residual)".into()),
        Row::Whole("RMSNorm".into()),
        Row::Collective("copy-to".into()),
        Row::Split(ranks(&|r| {
            let first = r * per(hidden);
            format!(
                "W1 W3 [{d}, {}]: units {first}..{}",
                per(hidden),
                first + per(hidden)
            )
        })),
        Row::Split(ranks(&|_| format!("SwiGLU, W2 [{}, {d}]", per(hidden)))),
        Row::Collective("reduce-from".into()),
        Row::Whole(format!("+ x  → the block's output [B, T, {d}]")),
    ]
}

/// The SVG text of the diagram of one block of `model` split over `t` ranks.
///
/// # Errors
/// [`ChartError::Drawing`] if plotters fails.
pub fn render_tensor_parallel_block(model: &ModelConfig, t: usize) -> Result<String, ChartError> {
    let rows = rows(model, t);
    let height = (2 * MARGIN + 60 + ROW * rows.len() as i32 + 70) as u32;
    let mut svg = String::new();
    {
        let area = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        let fail = |e: &dyn std::fmt::Display| ChartError::Drawing(e.to_string());
        area.fill(&WHITE).map_err(|e| fail(&e))?;
        let text = |size: u32, colour: &'static RGBColor, anchor: HPos| {
            TextStyle::from(("sans-serif", size).into_font())
                .color(colour)
                .pos(Pos::new(anchor, VPos::Center))
        };
        let title = format!(
            "A Llama block over a tensor-parallel group of {t}: d {}, {} heads, hidden {}, \
             vocabulary {} (each rank: {} of the rows)",
            model.d_model,
            model.n_heads,
            model.hidden,
            model.vocab,
            model.vocab / t.max(1)
        );
        area.draw(&Text::new(
            title,
            (MARGIN, MARGIN + 10),
            text(FONT + 2, &BLACK, HPos::Left),
        ))
        .map_err(|e| fail(&e))?;
        let left = MARGIN;
        let right = WIDTH as i32 - MARGIN;
        let column = (right - left) / t.max(1) as i32;
        let mut y = MARGIN + 50;
        for row in &rows {
            match row {
                Row::Whole(label) => {
                    area.draw(&Rectangle::new(
                        [(left, y), (right, y + BOX)],
                        WHOLE.filled(),
                    ))
                    .map_err(|e| fail(&e))?;
                    let at = ((left + right) / 2, y + BOX / 2);
                    area.draw(&Text::new(
                        label.clone(),
                        at,
                        text(FONT, &BLACK, HPos::Center),
                    ))
                    .map_err(|e| fail(&e))?;
                }
                Row::Split(labels) => {
                    for (r, label) in labels.iter().enumerate() {
                        let x0 = left + r as i32 * column;
                        let colour = RANKS[r % RANKS.len()];
                        area.draw(&Rectangle::new(
                            [(x0 + 2, y), (x0 + column - 2, y + BOX)],
                            colour.filled(),
                        ))
                        .map_err(|e| fail(&e))?;
                        let at = (x0 + column / 2, y + BOX / 2);
                        let size = if t > 2 { SMALL } else { FONT };
                        area.draw(&Text::new(
                            label.clone(),
                            at,
                            text(size, &BLACK, HPos::Center),
                        ))
                        .map_err(|e| fail(&e))?;
                    }
                }
                Row::Collective(label) => {
                    let middle = y + BOX / 2;
                    area.draw(&PathElement::new(
                        vec![(left, middle), (right, middle)],
                        COMM.stroke_width(3),
                    ))
                    .map_err(|e| fail(&e))?;
                    let at = ((left + right) / 2, middle - 10);
                    area.draw(&Text::new(
                        label.clone(),
                        at,
                        text(FONT, &COMM, HPos::Center),
                    ))
                    .map_err(|e| fail(&e))?;
                }
            }
            y += ROW;
        }
        let legend = std::iter::once((WHOLE, "whole on every rank".to_string()))
            .chain((0..t.min(RANKS.len())).map(|r| (RANKS[r], format!("rank {r}"))))
            .chain(std::iter::once((
                COMM,
                "a collective of the group: 2 all-reduces forward, 2 backward".to_string(),
            )));
        let mut x = left;
        for (colour, label) in legend {
            area.draw(&Rectangle::new(
                [(x, y + 10), (x + 18, y + 28)],
                colour.filled(),
            ))
            .map_err(|e| fail(&e))?;
            area.draw(&Text::new(
                label.clone(),
                (x + 24, y + 19),
                text(SMALL, &BLACK, HPos::Left),
            ))
            .map_err(|e| fail(&e))?;
            x += 30 + 8 * label.len() as i32;
        }
        area.present().map_err(|e| fail(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    #[test]
    fn the_diagram_names_each_ranks_heads_and_units() {
        let svg = render_tensor_parallel_block(&Preset::Capstone.config(), 2).unwrap();
        // Capstone: 10 heads, hidden 896, d 320 over 2 ranks.
        for needle in [
            "heads 0..5",
            "heads 5..10",
            "units 448..896",
            "Wo [160, 320]",
        ] {
            assert!(svg.contains(needle), "{needle}");
        }
        assert_eq!(
            svg.matches("reduce-from").count(),
            2,
            "the attention's and the MLP's"
        );
    }
}
