//! The timeline of a pipeline schedule (`tinyllm schedule`): one row per rank, time across,
//! each forward, backward, input gradient and weight gradient a box labelled with its stage
//! and micro-batch, the idle time left blank, and each rank's idle share at the row's end.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use tl_parallel::pipeline::{Action, Schedule, Simulation};

use super::ChartError;

const WIDTH: u32 = 1200;
const MARGIN: i32 = 20;
/// Room on the left for "rank r" and on the right for its idle share.
const LEFT: i32 = 80;
const RIGHT: i32 = 130;
const ROW: i32 = 34;
const BOX: i32 = 26;
const FONT: u32 = 15;
const SMALL: u32 = 11;

const FORWARD: RGBColor = RGBColor(114, 158, 206);
const BACKWARD: RGBColor = RGBColor(103, 191, 92);
const INPUT: RGBColor = RGBColor(168, 221, 149);
const WEIGHT: RGBColor = RGBColor(255, 158, 74);
const IDLE: RGBColor = RGBColor(240, 240, 240);

/// The colour and the short label of a compute action: its code and micro-batch, and its
/// stage when a rank holds several.
fn style(action: Action, stages_per_rank: usize) -> Option<(RGBColor, String)> {
    let (colour, code) = match action {
        Action::Forward { .. } => (FORWARD, "F"),
        Action::Backward { .. } => (BACKWARD, "B"),
        Action::BackwardInput { .. } => (INPUT, "I"),
        Action::BackwardWeight { .. } => (WEIGHT, "W"),
        _ => return None,
    };
    let (stage, micro_batch) = action.work()?;
    Some((
        colour,
        match stages_per_rank {
            1 => format!("{code}{micro_batch}"),
            _ => format!("{code}{micro_batch}·s{stage}"),
        },
    ))
}

/// The SVG text of `simulation`'s timeline of `schedule`, under `title`.
///
/// # Errors
/// [`ChartError::NothingToDraw`] for a step of no time; [`ChartError::Drawing`] if plotters
/// fails.
pub fn render_pipeline_timeline(
    schedule: &Schedule,
    simulation: &Simulation,
    title: &str,
) -> Result<String, ChartError> {
    if simulation.makespan == 0 {
        return Err(ChartError::NothingToDraw { log_y: false });
    }
    let ranks = simulation.ranks.len() as i32;
    let height = (2 * MARGIN + 50 + ROW * ranks + 60) as u32;
    let mut svg = String::new();
    {
        let area = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        let fail = |e: &dyn std::fmt::Display| ChartError::Drawing(e.to_string());
        area.fill(&WHITE).map_err(|e| fail(&e))?;
        let text = |size: u32, anchor: HPos| {
            TextStyle::from(("sans-serif", size).into_font())
                .color(&BLACK)
                .pos(Pos::new(anchor, VPos::Center))
        };
        area.draw(&Text::new(
            title.to_string(),
            (MARGIN, MARGIN + 10),
            text(FONT + 2, HPos::Left),
        ))
        .map_err(|e| fail(&e))?;
        let left = MARGIN + LEFT;
        let right = WIDTH as i32 - MARGIN - RIGHT;
        let x = |time: u64| {
            left + ((right - left) as f64 * time as f64 / simulation.makespan as f64) as i32
        };
        let top = MARGIN + 45;
        for (rank, timeline) in simulation.ranks.iter().enumerate() {
            let y = top + ROW * rank as i32;
            area.draw(&Text::new(
                format!("rank {rank}"),
                (MARGIN, y + BOX / 2),
                text(FONT, HPos::Left),
            ))
            .map_err(|e| fail(&e))?;
            area.draw(&Rectangle::new(
                [(left, y), (right, y + BOX)],
                IDLE.filled(),
            ))
            .map_err(|e| fail(&e))?;
            for &(action, start, end) in &timeline.spans {
                let Some((colour, label)) = style(action, schedule.stages_per_rank()) else {
                    continue;
                };
                let (x0, x1) = (x(start), x(end));
                area.draw(&Rectangle::new([(x0, y), (x1, y + BOX)], colour.filled()))
                    .map_err(|e| fail(&e))?;
                area.draw(&Rectangle::new(
                    [(x0, y), (x1, y + BOX)],
                    WHITE.stroke_width(1),
                ))
                .map_err(|e| fail(&e))?;
                // A label only where it fits (about 7 pixels a character).
                if x1 - x0 >= 7 * label.len() as i32 {
                    area.draw(&Text::new(
                        label,
                        ((x0 + x1) / 2, y + BOX / 2),
                        text(SMALL, HPos::Center),
                    ))
                    .map_err(|e| fail(&e))?;
                }
            }
            area.draw(&Text::new(
                format!("idle {:.1}%", 100.0 * timeline.idle_fraction()),
                (right + 10, y + BOX / 2),
                text(FONT, HPos::Left),
            ))
            .map_err(|e| fail(&e))?;
        }
        let y = top + ROW * ranks + 15;
        let split = schedule
            .all_actions()
            .iter()
            .flatten()
            .any(|a| matches!(a, Action::BackwardWeight { .. }));
        let mut legend = vec![(FORWARD, "forward")];
        if split {
            legend.extend([
                (INPUT, "input gradient (B)"),
                (WEIGHT, "weight gradient (W)"),
            ]);
        } else {
            legend.push((BACKWARD, "backward"));
        }
        legend.push((IDLE, "idle (the bubble)"));
        let mut at = left;
        for (colour, label) in legend {
            area.draw(&Rectangle::new(
                [(at, y), (at + 18, y + 18)],
                colour.filled(),
            ))
            .map_err(|e| fail(&e))?;
            area.draw(&Text::new(
                label,
                (at + 24, y + 9),
                text(SMALL + 2, HPos::Left),
            ))
            .map_err(|e| fail(&e))?;
            at += 40 + 8 * label.len() as i32;
        }
        let example = match schedule.stages_per_rank() {
            1 => "F3: the forward of micro-batch 3; time flows right",
            _ => "F3·s5: the forward of micro-batch 3 on stage 5; time flows right",
        };
        area.draw(&Text::new(
            example,
            (at + 10, y + 9),
            text(SMALL + 2, HPos::Left),
        ))
        .map_err(|e| fail(&e))?;
        area.present().map_err(|e| fail(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_parallel::pipeline::{Costs, ScheduleKind, simulate};

    #[test]
    fn the_timeline_draws_every_pass_and_each_ranks_idle_share() {
        let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
        let run = simulate(&schedule, Costs::UNIT).unwrap();
        let svg = render_pipeline_timeline(&schedule, &run, "1F1B").unwrap();
        // 2 ranks x 4 micro-batches: 8 forwards and 8 backwards, labelled.
        let labels = |code: char| {
            (svg.lines())
                .filter(|line| line.starts_with(code) && line.len() <= 3)
                .count()
        };
        assert_eq!((labels('F'), labels('B')), (8, 8), "{svg}");
        // (p − 1)/(m + p − 1) of the step: 1/5.
        assert_eq!(svg.matches("idle 20.0%").count(), 2);
        let zb = Schedule::new(ScheduleKind::ZeroBubbleH1, 2, 4, 1).unwrap();
        let run = simulate(&zb, Costs::UNIT).unwrap();
        let svg = render_pipeline_timeline(&zb, &run, "ZB-H1").unwrap();
        assert!(svg.contains("weight gradient (W)"));
        let weights = (svg.lines())
            .filter(|line| line.starts_with('W') && line.len() <= 3)
            .count();
        assert_eq!(weights, 8);
    }
}
