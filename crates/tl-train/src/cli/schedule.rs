//! `tinyllm schedule`: a pipeline schedule drawn as a timeline, from the simulator — each
//! rank's forwards and backwards in time, its idle share beside the papers' bubble, and the
//! activations it holds at once.

use std::path::PathBuf;

use clap::Args;
use tl_parallel::pipeline::{Costs, Schedule, ScheduleKind, Simulation, simulate};

use super::Exit;
use crate::chart::render_pipeline_timeline;
use crate::error::{Result, TrainError};
use crate::store::write_atomic;

/// Options of `tinyllm schedule`.
#[derive(Debug, Args)]
pub struct ScheduleArgs {
    /// Pipeline stages over ranks (p).
    #[arg(long, value_name = "P")]
    pub pp: usize,
    /// Micro-batches a step (m): the step's --accum, streamed through the pipeline.
    #[arg(long, value_name = "M")]
    pub accum: usize,
    /// gpipe, 1f1b, interleaved or zb-h1.
    #[arg(long, value_name = "NAME", default_value = "1f1b")]
    pub schedule: ScheduleKind,
    /// Stages on each rank (v), for the interleaved schedule.
    #[arg(long, value_name = "V", default_value_t = 1)]
    pub stages_per_rank: usize,
    /// A stage's forward time, in any unit (a backward takes twice as long, half of it the
    /// input's gradient).
    #[arg(long, value_name = "T", default_value_t = 1)]
    pub forward: u64,
    /// A message's time from send to arrival, in the same unit.
    #[arg(long, value_name = "T", default_value_t = 0)]
    pub latency: u64,
    /// Draws the timeline to this SVG file.
    #[arg(long, value_name = "FILE")]
    pub chart: Option<PathBuf>,
}

/// The most ranks and micro-batches drawn (a timeline past these is a grey smear).
const MAX_RANKS: usize = 64;
const MAX_MICRO_BATCHES: usize = 1024;

/// The papers' bubble (idle over compute time) for `kind` with equal stage times, where a
/// formula holds: Narayanan et al.'s `(p − 1)/m`, `(1/v)(p − 1)/m` interleaved; Qi et al.'s
/// `(p − 1)(F + B − W)` over `m(F + B + W)` for ZB-H1 with `B = W = F`.
fn paper_bubble(kind: ScheduleKind, p: usize, m: usize, v: usize) -> (f64, &'static str) {
    let (p, m, v) = (p as f64, m as f64, v as f64);
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => ((p - 1.0) / m, "(p-1)/m"),
        ScheduleKind::Interleaved => ((p - 1.0) / (v * m), "(p-1)/(vm)"),
        ScheduleKind::ZeroBubbleH1 => ((p - 1.0) / (3.0 * m), "(p-1)(F+B-W)/(3mF)"),
    }
}

/// The table `tinyllm schedule` prints: each rank's busy and idle time, its bubble beside the
/// papers', and the most micro-batches' activations it holds.
fn table(schedule: &Schedule, run: &Simulation) -> String {
    let (kind, p, m, v) = (
        schedule.kind().expect("a generated schedule"),
        schedule.ranks(),
        schedule.micro_batches(),
        schedule.stages_per_rank(),
    );
    let (paper, formula) = paper_bubble(kind, p, m, v);
    let mut out = format!(
        "{kind}: p = {p} ranks, m = {m} micro-batches, v = {v} stage{} a rank; step {} time units\n\n",
        if v == 1 { "" } else { "s" },
        run.makespan
    );
    out += &format!(
        "{:>5} {:>8} {:>8} {:>8} {:>10} {:>18}\n",
        "rank", "busy", "idle", "idle %", "bubble", "activations held"
    );
    for (rank, timeline) in run.ranks.iter().enumerate() {
        out += &format!(
            "{rank:>5} {:>8} {:>8} {:>7.1}% {:>10.4} {:>18}\n",
            timeline.busy,
            timeline.idle,
            100.0 * timeline.idle_fraction(),
            timeline.bubble_ratio(),
            timeline.peak_activations
        );
    }
    out += &format!(
        "\nbubble = idle / busy; the papers' {formula} = {paper:.4} (equal stage times, no \
         latency). Activations held: micro-batches of one stage{}, from a forward to the end of \
         its backward (of its weight gradient, when split).\n",
        if v == 1 {
            ""
        } else {
            " (1/v of the rank's layers)"
        }
    );
    out
}

/// Runs `tinyllm schedule`.
pub(super) fn schedule(args: &ScheduleArgs) -> Result<Exit> {
    let invalid = |name: &'static str, value: usize, limit: usize| {
        Err(TrainError::InvalidArgument {
            name,
            value: value.to_string(),
            reason: format!("at most {limit} are drawn"),
        })
    };
    if args.pp > MAX_RANKS {
        return invalid("--pp", args.pp, MAX_RANKS);
    }
    if args.accum > MAX_MICRO_BATCHES {
        return invalid("--accum", args.accum, MAX_MICRO_BATCHES);
    }
    if args.forward == 0 {
        return Err(TrainError::InvalidArgument {
            name: "--forward",
            value: "0".into(),
            reason: "a forward takes some time".into(),
        });
    }
    let schedule = Schedule::new(args.schedule, args.pp, args.accum, args.stages_per_rank)?;
    let costs = Costs {
        forward: args.forward,
        backward: 2 * args.forward,
        backward_input: args.forward,
        backward_weight: args.forward,
        latency: args.latency,
    };
    let run = simulate(&schedule, costs)?;
    print!("{}", table(&schedule, &run));
    if let Some(path) = &args.chart {
        let title = format!(
            "{}: {} ranks, {} micro-batches{}",
            args.schedule,
            args.pp,
            args.accum,
            match args.stages_per_rank {
                1 => String::new(),
                v => format!(", {v} stages a rank"),
            }
        );
        let svg = render_pipeline_timeline(&schedule, &run, &title)?;
        write_atomic(path, svg.as_bytes())?;
        println!("wrote {}", path.display());
    }
    Ok(Exit::Success)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_gives_each_ranks_bubble_beside_the_papers() {
        let schedule = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
        let run = simulate(&schedule, Costs::UNIT).unwrap();
        let table = table(&schedule, &run);
        // 4 ranks: each idles (p − 1)/m = 3/8 of its compute; rank r holds p − r.
        assert_eq!(table.matches("0.3750").count(), 5, "{table}");
        for (rank, held) in [(0, 4), (3, 1)] {
            assert!(
                table
                    .lines()
                    .any(|l| l.trim_start().starts_with(&format!("{rank} "))
                        && l.trim_end().ends_with(&format!(" {held}"))),
                "{table}"
            );
        }
    }
}
