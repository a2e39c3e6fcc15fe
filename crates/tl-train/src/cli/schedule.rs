//! `tinyllm schedule`: a pipeline schedule drawn as a timeline, from the simulator — each
//! rank's forwards and backwards in time, its idle share beside the papers' bubble, and the
//! activations it holds at once — or, with `--from RUN`, a run's last step as it ran, beside
//! the simulator fed with that step's own compute times.

use std::path::PathBuf;

use clap::Args;
use tl_parallel::pipeline::{
    Costs, RankTimeline, Schedule, ScheduleKind, Simulation, simulate, simulate_with,
};

use super::Exit;
use crate::chart::render_pipeline_timeline;
use crate::error::{Result, TrainError};
use crate::store::write_atomic;
use crate::train::{PIPELINE_TIMELINE_FILE, PipelineTimeline, read_config};

/// Options of `tinyllm schedule`.
#[derive(Debug, Args)]
pub struct ScheduleArgs {
    /// Pipeline stages over ranks (p).
    #[arg(long, value_name = "P", required_unless_present = "from")]
    pub pp: Option<usize>,
    /// Micro-batches a step (m): the step's --accum, streamed through the pipeline.
    #[arg(long, value_name = "M", required_unless_present = "from")]
    pub accum: Option<usize>,
    /// The last step of this run (trained with --pp), as it ran: each rank's measured
    /// times, and the simulator's idle shares with the step's mean forward and backward
    /// times fed in.
    #[arg(long, value_name = "RUN", conflicts_with_all = ["pp", "accum", "forward", "latency"])]
    pub from: Option<PathBuf>,
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

/// The table `tinyllm schedule` prints: each rank's busy and idle time, its bubble beside the
/// papers', and the most micro-batches' activations it holds.
fn table(schedule: &Schedule, run: &Simulation) -> String {
    let (kind, p, m, v) = (
        schedule.kind().expect("a generated schedule"),
        schedule.ranks(),
        schedule.micro_batches(),
        schedule.stages_per_rank(),
    );
    let (paper, formula) = kind.paper_bubble(p, m, v);
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
        "\nbubble = idle / busy; {formula} = {paper:.4} (equal stage times, no \
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
    if let Some(run) = &args.from {
        return from_run(run, args.chart.as_deref());
    }
    let (pp, accum) = (
        args.pp.expect("required without --from"),
        args.accum.expect("required without --from"),
    );
    let invalid = |name: &'static str, value: usize, limit: usize| {
        Err(TrainError::InvalidArgument {
            name,
            value: value.to_string(),
            reason: format!("at most {limit} are drawn"),
        })
    };
    if pp > MAX_RANKS {
        return invalid("--pp", pp, MAX_RANKS);
    }
    if accum > MAX_MICRO_BATCHES {
        return invalid("--accum", accum, MAX_MICRO_BATCHES);
    }
    if args.forward == 0 {
        return Err(TrainError::InvalidArgument {
            name: "--forward",
            value: "0".into(),
            reason: "a forward takes some time".into(),
        });
    }
    let schedule = Schedule::new(args.schedule, pp, accum, args.stages_per_rank)?;
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
            pp,
            accum,
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

/// Each rank's clock against rank 0's, in seconds, from the activations' messages: a
/// message cannot be received before it is sent, so rank `r`'s clock is at most
/// `receive end − send start` ahead of rank `r − 1`'s for every message between them, and a
/// receive that waited for its message ends just after the send. The least such gap is
/// taken as the offset (exact to the messages' latency).
fn clock_offsets(schedule: &Schedule, timeline: &PipelineTimeline) -> Vec<f64> {
    use tl_parallel::pipeline::Action;
    let mut offsets = vec![0.0; timeline.ranks.len()];
    for rank in 1..timeline.ranks.len() {
        let sent = |stage: usize, micro_batch: usize| {
            timeline.ranks[rank - 1].iter().find_map(|t| {
                let action = schedule.actions(rank - 1)[t.index];
                (action == Action::SendActivation { stage, micro_batch }).then_some(t.start_s)
            })
        };
        let gap = (timeline.ranks[rank].iter())
            .filter_map(|t| match schedule.actions(rank)[t.index] {
                Action::RecvActivation { stage, micro_batch }
                    if stage % schedule.ranks() == rank =>
                {
                    sent(stage - 1, micro_batch).map(|start| t.end_s - start)
                }
                _ => None,
            })
            .fold(f64::INFINITY, f64::min);
        offsets[rank] = offsets[rank - 1] + if gap.is_finite() { gap } else { 0.0 };
    }
    offsets
}

/// A run's last step as it ran (its `pipeline-timeline.json`), in microseconds on rank 0's
/// clock ([`clock_offsets`]), as the simulator's result of the same schedule: each rank's
/// compute time, and its idle time until the last rank ends.
fn measured(schedule: &Schedule, timeline: &PipelineTimeline) -> Result<Simulation> {
    let equal = simulate(schedule, Costs::UNIT)?;
    let offsets = clock_offsets(schedule, timeline);
    // The step starts with its first forward: a rank waiting before it waits for the rank
    // before to begin, not in the schedule's bubble.
    let earliest = (timeline.ranks.iter().zip(&offsets).enumerate())
        .flat_map(|(rank, (actions, offset))| {
            (actions.iter())
                .filter(move |t| schedule.actions(rank)[t.index].computes())
                .map(move |t| t.start_s - offset)
        })
        .fold(f64::INFINITY, f64::min);
    let mut ranks = Vec::new();
    for (rank, actions) in timeline.ranks.iter().enumerate() {
        let micros = |s: f64| ((s - offsets[rank] - earliest) * 1e6).round().max(0.0) as u64;
        let list = schedule.actions(rank);
        let mut spans = Vec::with_capacity(actions.len());
        for timed in actions {
            let action = *list
                .get(timed.index)
                .ok_or_else(|| TrainError::InvalidArgument {
                    name: "from",
                    value: PIPELINE_TIMELINE_FILE.into(),
                    reason: format!(
                        "rank {rank}'s action {} is not in the run's schedule",
                        timed.index
                    ),
                })?;
            if action.computes() || micros(timed.end_s) > 0 {
                spans.push((action, micros(timed.start_s), micros(timed.end_s)));
            }
        }
        let busy = (spans.iter())
            .filter(|(a, _, _)| a.computes())
            .map(|(_, s, e)| e - s)
            .sum();
        ranks.push(RankTimeline {
            spans,
            busy,
            idle: 0,
            peak_activations: equal.ranks[rank].peak_activations,
        });
    }
    let makespan = (ranks.iter())
        .flat_map(|r| r.spans.last().map(|s| s.2))
        .max()
        .unwrap_or(0);
    for rank in &mut ranks {
        rank.idle = makespan.saturating_sub(rank.busy);
    }
    Ok(Simulation { ranks, makespan })
}

/// `tinyllm schedule --from RUN`.
fn from_run(run: &std::path::Path, chart: Option<&std::path::Path>) -> Result<Exit> {
    let config = read_config(run)?;
    if config.parallel.pipeline < 2 {
        return Err(TrainError::InvalidArgument {
            name: "from",
            value: run.display().to_string(),
            reason: "the run was not trained on a pipeline (--pp)".into(),
        });
    }
    let path = run.join(PIPELINE_TIMELINE_FILE);
    let bytes = std::fs::read(&path).map_err(|source| TrainError::io(&path, source))?;
    let timeline: PipelineTimeline =
        serde_json::from_slice(&bytes).map_err(|e| TrainError::InvalidArgument {
            name: "from",
            value: path.display().to_string(),
            reason: format!("not a pipeline timeline: {e}"),
        })?;
    let schedule = config.pipeline_schedule()?;
    let measured = measured(&schedule, &timeline)?;
    // The simulator, fed with each action's own time in this step.
    let took: std::collections::HashMap<(usize, tl_parallel::pipeline::Action), u64> =
        (measured.ranks.iter().enumerate())
            .flat_map(|(rank, r)| r.spans.iter().map(move |&(a, s, e)| ((rank, a), e - s)))
            .collect();
    let simulated = simulate_with(
        &schedule,
        &|rank, action| took.get(&(rank, action)).copied().unwrap_or(0),
        0,
    )?;
    let mean = |pick: fn(&tl_parallel::pipeline::Action) -> bool| {
        let times: Vec<u64> = (measured.ranks.iter())
            .flat_map(|r| r.spans.iter())
            .filter(|(a, _, _)| pick(a))
            .map(|(_, s, e)| e - s)
            .collect();
        (times.iter().sum::<u64>() / times.len().max(1) as u64).max(1)
    };
    use tl_parallel::pipeline::Action;
    let forward = mean(|a| matches!(a, Action::Forward { .. }));
    let backward = if config.parallel.schedule == ScheduleKind::ZeroBubbleH1 {
        let input = mean(|a| matches!(a, Action::BackwardInput { .. }));
        let weight = mean(|a| matches!(a, Action::BackwardWeight { .. }));
        format!("its backward {input} us for the input's gradient and {weight} us for the weights'")
    } else {
        format!(
            "its backward {} us",
            mean(|a| matches!(a, Action::Backward { .. }))
        )
    };
    let equal = simulate(&schedule, Costs::UNIT)?;
    println!(
        "{}: step {} of {}, as it ran (microseconds); a stage's forward took {forward} us \
         and {backward} on average\n",
        config.parallel.schedule,
        timeline.step,
        run.display()
    );
    println!(
        "{:>5} {:>12} {:>12} {:>9} {:>22} {:>18}",
        "rank", "busy", "idle", "idle %", "simulated, these times", "simulated, equal"
    );
    for (rank, timeline) in measured.ranks.iter().enumerate() {
        println!(
            "{rank:>5} {:>12} {:>12} {:>8.1}% {:>21.1}% {:>17.1}%",
            timeline.busy,
            timeline.idle,
            100.0 * timeline.idle_fraction(),
            100.0 * simulated.ranks[rank].idle_fraction(),
            100.0 * equal.ranks[rank].idle_fraction(),
        );
    }
    println!(
        "\nidle % = idle / (busy + idle) until the last rank ends; the ranks' clocks are \
         aligned by their messages (none is received before it is sent)."
    );
    if let Some(path) = chart {
        let title = format!(
            "{} as it ran: {} ranks, {} micro-batches (microseconds)",
            config.parallel.schedule,
            schedule.ranks(),
            schedule.micro_batches()
        );
        let svg = render_pipeline_timeline(&schedule, &measured, &title)?;
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
