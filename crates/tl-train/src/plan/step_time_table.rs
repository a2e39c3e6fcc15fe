//! The text of `tinyllm plan --link`: each rank's predicted step, under the memory tables.

use std::fmt::Write;

use super::parallel::ParallelPlan;
use super::step_time::{RateSource, SOFTWARE_US_PER_MESSAGE, StepTimePlan};
use super::table::thousands;

/// The link, α, β and the compute rate, in one line.
fn header(out: &mut String, time: &StepTimePlan) {
    let link = &time.link;
    let efficiency = if link.efficiency < 1.0 {
        format!(" at {:.0}% efficiency", 100.0 * link.efficiency)
    } else {
        String::new()
    };
    let rate = match time.compute.source {
        RateSource::Given => "given".to_owned(),
        RateSource::Measured { step_s, flops } => format!(
            "measured: a {step_s:.3} s step of {} FLOPs on this node",
            thousands(flops)
        ),
    };
    let _ = writeln!(
        out,
        "\nstep time on a {} Gbit/s link{efficiency}: α = {} + {} µs a message = {:.1} µs, \
         β = {:.1} MB/s; compute at {} ({rate})",
        link.gbit_per_s,
        link.latency_us,
        SOFTWARE_US_PER_MESSAGE,
        time.alpha_s * 1e6,
        time.beta_bytes_per_s / 1e6,
        flops_per_s(time.compute.flops_per_s),
    );
}

/// A rate in GFLOP/s, or TFLOP/s from 10¹² on.
fn flops_per_s(rate: f64) -> String {
    if rate >= 1e12 {
        format!("{:.1} TFLOP/s", rate / 1e12)
    } else {
        format!("{:.1} GFLOP/s", rate / 1e9)
    }
}

/// How communication and compute combine in `time`'s lines.
fn overlap_note(time: &StepTimePlan) -> &'static str {
    if time.ranks.iter().any(|r| r.overlapped_s > 0.0) {
        "gradient buckets reduced during the last backward (--overlap), the last one after \
         it: step = compute + communication - overlapped"
    } else {
        "nothing overlapped (communication after backward, or blocking it): \
         step = compute + communication"
    }
}

/// Every rank of one plan's step time.
pub fn render_step_time(plan: &ParallelPlan) -> String {
    let mut out = String::new();
    let Some(time) = &plan.step_time else {
        return out;
    };
    header(&mut out, time);
    let _ = writeln!(
        out,
        "{:>5} {:>18} {:>10} {:>12} {:>12} {:>14} {:>12} {:>10} {:>14}",
        "rank",
        "FLOPs",
        "compute s",
        "latency s",
        "bandwidth s",
        "communic. s",
        "overlapped s",
        "step s",
        "communication"
    );
    for rank in &time.ranks {
        let _ = writeln!(
            out,
            "{:>5} {:>18} {:>10.4} {:>12.6} {:>12.4} {:>14.4} {:>12.4} {:>10.4} {:>13.1}%",
            rank.rank,
            thousands(rank.flops.total()),
            rank.compute_s,
            rank.latency_s,
            rank.bandwidth_s,
            rank.communication_s,
            rank.overlapped_s,
            rank.step_s,
            100.0 * rank.communication_share,
        );
    }
    if time.ranks.iter().any(|r| r.bubble > 0.0) {
        let _ = writeln!(
            out,
            "compute includes each rank's share of the pipeline's bubble: FLOPs / rate x (1 + bubble)"
        );
    }
    let _ = writeln!(out, "{}", overlap_note(time));
    out
}

/// Rank 0's step time in each plan of a sweep.
pub fn render_step_time_sweep(plans: &[ParallelPlan]) -> String {
    let mut out = String::new();
    let Some(first) = plans.iter().find_map(|p| p.step_time.as_ref()) else {
        return out;
    };
    header(&mut out, first);
    let _ = writeln!(
        out,
        "{:>5} {:>4} {:>10} {:>14} {:>12} {:>10} {:>14}",
        "ranks", "ZeRO", "compute s", "communic. s", "overlapped s", "step s", "communication"
    );
    for plan in plans {
        if let Some(rank) = plan.step_time.as_ref().map(|t| &t.ranks[0]) {
            let _ = writeln!(
                out,
                "{:>5} {:>4} {:>10.4} {:>14.4} {:>12.4} {:>10.4} {:>13.1}%",
                plan.parallelism.ranks,
                plan.parallelism.stage.index(),
                rank.compute_s,
                rank.communication_s,
                rank.overlapped_s,
                rank.step_s,
                100.0 * rank.communication_share,
            );
        }
    }
    let note = plans
        .iter()
        .filter_map(|p| p.step_time.as_ref())
        .find(|t| t.ranks.iter().any(|r| r.overlapped_s > 0.0))
        .map_or_else(|| overlap_note(first), overlap_note);
    let _ = writeln!(out, "rank 0 of each; {note}");
    out
}
