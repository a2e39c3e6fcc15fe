//! The text tables of `tinyllm plan`.

use std::fmt::Write;

use super::kind::TensorKind;
use super::ledger::StepPrediction;
use super::measure::{Measurement, relative_error};
use super::report::{FLOOR_BYTES_PER_PARAMETER, MemoryPlan};
use crate::model::Checkpointing;

const MIB: f64 = 1024.0 * 1024.0;

/// `bytes` in MiB with one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / MIB)
}

/// `n` with thousands separators: `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// How a schedule is named in the tables.
pub fn schedule_label(checkpointing: Checkpointing) -> String {
    match checkpointing {
        Checkpointing::Off => "plain".into(),
        Checkpointing::PerBlock => "per block".into(),
        Checkpointing::Matmuls => "per block, products kept".into(),
        Checkpointing::FirstMatmul => "per block, x·Wq kept".into(),
        Checkpointing::Budget(budget) => format!("budget {budget}"),
    }
}

/// The tables of `tinyllm plan`: model state, saved activations by kind and by layer, the
/// predicted peaks with and without checkpointing, and what is alive at each peak.
pub fn render(plan: &MemoryPlan) -> String {
    let mut out = String::new();
    header(&mut out, plan);
    model_state(&mut out, plan);
    saved_by_kind(&mut out, plan);
    per_layer(&mut out, plan);
    peaks(&mut out, plan);
    anatomy(&mut out, plan);
    policies(&mut out, plan);
    out
}

/// The four checkpoint policies side by side: what a block keeps, what it holds between
/// forward and backward, what its rerun multiplies again, and the step's peak; then what
/// the optimizer's update allocates beyond the gradients, in units of 4P.
fn policies(out: &mut String, plan: &MemoryPlan) {
    let _ = writeln!(
        out,
        "\ncheckpoint policies (--checkpoint-policy), MiB\n  {:<14}{:<44}{:>9}{:>10}{:>10}  rerun multiplies again",
        "policy", "a checkpointed block keeps", "block 0", "all held", "peak"
    );
    for policy in &plan.policies {
        let keeps = if policy.checkpointing == Checkpointing::Off {
            "every activation (no rerun)".to_string()
        } else {
            format!("its input, {}", policy.kept.join(" "))
        };
        let rerun = match (policy.checkpointing, policy.recomputed.as_slice()) {
            (Checkpointing::Off, _) => "-".to_string(),
            (_, []) => "nothing".to_string(),
            (_, products) => products.join(" "),
        };
        let _ = writeln!(
            out,
            "  {:<14}{keeps:<44}{:>9}{:>10}{:>10}  {rerun}",
            policy.policy,
            mib(policy.first_block_bytes()),
            mib(policy.held_bytes),
            mib(policy.peak_bytes),
        );
    }
    let _ = writeln!(
        out,
        "  (the last block is never rerun: its backward comes first, so it keeps every activation)"
    );
    let update = plan.policies[0].update_extra_bytes;
    let _ = writeln!(
        out,
        "  the AdamW update allocates {} B beyond weights, gradients and moments: {:.2} × 4P{}",
        thousands(update),
        update as f64 / (4 * plan.parameters) as f64,
        if update == 0 {
            " (it updates in place)"
        } else {
            ""
        }
    );
}

/// The prediction for the chosen recipe next to the meter's reading of real steps.
pub fn render_measurement(plan: &MemoryPlan, measured: &Measurement) -> String {
    let predicted = plan.chosen();
    let mut out = format!(
        "measured on real steps ({}, {}):\n{:<26}{:>18}{:>18}{:>12}\n",
        schedule_label(predicted.checkpointing),
        plan.recipe.arithmetic(),
        "",
        "predicted",
        "measured",
        "error"
    );
    for (label, predicted, measured) in [
        (
            "steady-state peak",
            predicted.peak_bytes,
            measured.peak_bytes,
        ),
        (
            "first step peak",
            predicted.first_step_peak_bytes,
            measured.first_step_peak_bytes,
        ),
        (
            "live between steps",
            predicted.between_steps_bytes,
            measured.between_steps_bytes,
        ),
    ] {
        let _ = writeln!(
            out,
            "  {label:<24}{:>18}{:>18}{:>11.3}%",
            thousands(predicted),
            thousands(measured),
            100.0 * relative_error(predicted, measured)
        );
    }
    out
}

fn header(out: &mut String, plan: &MemoryPlan) {
    let r = &plan.recipe;
    let model = &r.model;
    let per_step = match r.accum {
        1 => "1 micro-batch per step".to_string(),
        k => format!("{k} micro-batches per step"),
    };
    let _ = writeln!(
        out,
        "tinyllm plan: {} parameters (d {}, {} layers, {} heads, hidden {}, vocab {})\n\
         micro-batch {} × {} tokens, {per_step}, {}, checkpointing: {}",
        thousands(plan.parameters),
        model.d_model,
        model.n_layers,
        model.n_heads,
        model.hidden,
        model.vocab,
        r.micro_batch,
        model.context,
        r.arithmetic(),
        schedule_label(r.checkpointing),
    );
    if let Checkpointing::Budget(budget) = r.checkpointing
        && budget >= model.n_layers
    {
        let _ = writeln!(
            out,
            "(a budget of {budget} ≥ {} layers keeps every block: one plain segment)",
            model.n_layers
        );
    }
    let _ = writeln!(
        out,
        "Bytes of live tensor storage as tl_tensor::memory counts them (1 MiB = 1,048,576 bytes).\n"
    );
}

fn model_state(out: &mut String, plan: &MemoryPlan) {
    let _ = writeln!(out, "{:<40}{:>16}{:>12}", "model state", "bytes", "MiB");
    let p = plan.parameters;
    for (label, per_parameter) in [
        ("weights (f32)", 4),
        ("gradients (f32)", 4),
        ("AdamW moments (2 × f32)", 8),
        ("floor", FLOOR_BYTES_PER_PARAMETER),
    ] {
        let bytes = per_parameter * p;
        let _ = writeln!(
            out,
            "  {label:<24}{:>2} B/parameter{:>16}{:>12}",
            per_parameter,
            thousands(bytes),
            mib(bytes)
        );
    }
    out.push('\n');
}

fn saved_by_kind(out: &mut String, plan: &MemoryPlan) {
    let schedule = schedule_label(plan.checkpointed.checkpointing);
    let blocks = format!("{} blocks", plan.recipe.model.n_layers);
    let _ = writeln!(
        out,
        "{:<42}{:>11}{:>11}{:>11}{:>11}{:>11}",
        "saved for backward, one micro-batch, MiB", "per block", blocks, "other", "plain", schedule
    );
    let mut totals = [0u64; 5];
    for row in &plan.kinds {
        let cells = [
            row.per_block,
            row.all_blocks,
            row.outside_blocks,
            row.plain,
            row.checkpointed,
        ];
        let _ = write!(out, "  {:<40}", row.kind.label());
        for (total, cell) in totals.iter_mut().zip(cells) {
            *total += cell;
            let _ = write!(out, "{:>11}", mib(cell));
        }
        out.push('\n');
    }
    let _ = write!(out, "  {:<40}", "total");
    for total in totals {
        let _ = write!(out, "{:>11}", mib(total));
    }
    out.push_str("\n  (\"other\": embedding, final norm, head and loss)\n\n");
}

fn per_layer(out: &mut String, plan: &MemoryPlan) {
    let schedule = format!("saved {}", schedule_label(plan.checkpointed.checkpointing));
    let _ = writeln!(
        out,
        "{:<16}{:>12}{:>10}{:>11}{:>10}{:>13}{:>17}",
        "per layer, MiB", "parameters", "weights", "gradients", "moments", "saved plain", schedule
    );
    let mut total = [0u64; 6];
    for row in &plan.layers {
        let cells = [
            row.parameters,
            row.weights,
            row.gradients,
            row.moments,
            row.saved_plain,
            row.saved_checkpointed,
        ];
        for (sum, cell) in total.iter_mut().zip(cells) {
            *sum += cell;
        }
        layer_line(out, &row.layer.to_string(), cells);
    }
    layer_line(out, "total", total);
    out.push('\n');
}

fn layer_line(out: &mut String, label: &str, cells: [u64; 6]) {
    let _ = writeln!(
        out,
        "  {label:<14}{:>12}{:>10}{:>11}{:>10}{:>13}{:>17}",
        thousands(cells[0]),
        mib(cells[1]),
        mib(cells[2]),
        mib(cells[3]),
        mib(cells[4]),
        mib(cells[5]),
    );
}

fn peaks(out: &mut String, plan: &MemoryPlan) {
    let columns = [&plan.plain, &plan.checkpointed];
    let _ = writeln!(
        out,
        "{:<40}{:>20}{:>20}",
        "peak live bytes, steady-state step (≥ 2)",
        schedule_label(Checkpointing::Off),
        schedule_label(plan.checkpointed.checkpointing)
    );
    let row = |out: &mut String, label: &str, cell: &dyn Fn(&StepPrediction) -> String| {
        let _ = writeln!(
            out,
            "  {label:<38}{:>20}{:>20}",
            cell(columns[0]),
            cell(columns[1])
        );
    };
    row(out, "predicted, bytes", &|p| thousands(p.peak_bytes));
    row(out, "predicted, MiB", &|p| mib(p.peak_bytes));
    row(out, "× the 16 B/parameter floor", &|p| {
        format!("{:.2}", p.peak_bytes as f64 / plan.floor_bytes as f64)
    });
    row(out, "first step of a fresh model, MiB", &|p| {
        mib(p.first_step_peak_bytes)
    });
    row(out, "saved by one micro-batch, MiB", &|p| {
        mib(p.saved_total())
    });
    for prediction in columns {
        let _ = writeln!(
            out,
            "  {} peak at: {}",
            schedule_label(prediction.checkpointing),
            prediction.peak_at
        );
    }
    let chunked = &plan.chunked_loss;
    let _ = writeln!(
        out,
        "  chunked loss (--chunked-loss {}: {}): peak {} MiB with it on, {} MiB off",
        plan.recipe.chunked_loss,
        if chunked.on { "on" } else { "off" },
        mib(chunked.peak_on_bytes),
        mib(chunked.peak_off_bytes),
    );
    out.push('\n');
}

fn anatomy(out: &mut String, plan: &MemoryPlan) {
    let _ = writeln!(
        out,
        "{:<40}{:>20}{:>20}",
        "alive at the peak, MiB",
        schedule_label(Checkpointing::Off),
        schedule_label(plan.checkpointed.checkpointing)
    );
    let bytes_of = |p: &StepPrediction, kind: TensorKind| {
        p.peak_by_kind
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |&(_, bytes)| bytes)
    };
    for kind in TensorKind::ALL {
        let (plain, checkpointed) = (
            bytes_of(&plan.plain, kind),
            bytes_of(&plan.checkpointed, kind),
        );
        if plain > 0 || checkpointed > 0 {
            let _ = writeln!(
                out,
                "  {:<38}{:>20}{:>20}",
                kind.label(),
                mib(plain),
                mib(checkpointed)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_are_separated_by_commas() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(10_327_360), "10,327,360");
    }

    #[test]
    fn schedules_have_short_names() {
        assert_eq!(schedule_label(Checkpointing::Off), "plain");
        assert_eq!(schedule_label(Checkpointing::PerBlock), "per block");
        assert_eq!(schedule_label(Checkpointing::Budget(3)), "budget 3");
        assert_eq!(
            schedule_label(Checkpointing::FirstMatmul),
            "per block, x·Wq kept"
        );
    }

    #[test]
    fn a_mebibyte_is_two_to_the_twenty_bytes() {
        assert_eq!(mib(1 << 20), "1.0");
        assert_eq!(mib(3 << 19), "1.5");
    }
}
