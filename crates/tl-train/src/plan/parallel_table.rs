//! The text tables of `tinyllm plan --ranks N --zero S`.

use std::fmt::Write;

use super::parallel::ParallelPlan;
use super::table::{schedule_label, thousands};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const MIB: f64 = 1024.0 * 1024.0;

/// `bytes` in GiB, or in MiB when below one GiB, with two decimals.
fn size(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else {
        format!("{:.2} MiB", b / MIB)
    }
}

/// The header line every table starts with: the model and one rank's recipe.
fn recipe_line(out: &mut String, plan: &ParallelPlan) {
    let r = &plan.recipe;
    let c = &r.model;
    let _ = writeln!(
        out,
        "model: V={} d={} L={} H={} hidden={} T={}, {} parameters; per rank: {} x {} \
         sequences per step, {}, {} checkpointing; buckets of {}",
        c.vocab,
        c.d_model,
        c.n_layers,
        c.n_heads,
        c.hidden,
        c.context,
        thousands(plan.sizes.parameters),
        r.accum,
        r.micro_batch,
        r.arithmetic(),
        schedule_label(r.checkpointing),
        size(plan.parallelism.bucket_bytes),
    );
}

/// One plan in full: every rank's memory terms and traffic, the collectives of rank 0, and
/// the paper's arithmetic beside it.
pub fn render_parallel(plan: &ParallelPlan) -> String {
    let mut out = String::new();
    recipe_line(&mut out, plan);
    let p = &plan.parallelism;
    let replicas = p.ranks / (p.tensor * p.pipeline);
    let split = match p.tensor {
        1 => String::new(),
        t if p.sequence_parallel => {
            format!(" as {replicas} data-parallel x {t} tensor-parallel, with sequence parallelism")
        }
        t => format!(" as {replicas} data-parallel x {t} tensor-parallel"),
    };
    let split = match &plan.pipeline {
        Some(pipe) => format!(
            "{split} in a pipeline of {} ({}, {} micro-batches, {} stage(s) a rank)",
            p.pipeline, pipe.schedule, pipe.micro_batches, pipe.stages_per_rank
        ),
        None => split,
    };
    let _ = writeln!(
        out,
        "{} ranks{split}, ZeRO stage {} (the metered peak is the trainer's step on meta \
         tensors, exact)\n",
        p.ranks, p.stage,
    );
    let _ = writeln!(
        out,
        "{:>5} {:>16} {:>16} {:>16} {:>16} {:>16} {:>16} {:>10} {:>13} {:>16} {:>16}",
        "rank",
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "comm buffers",
        "= most alive",
        "when",
        "limits",
        "meter peak",
        "sent / step"
    );
    for rank in &plan.ranks {
        let _ = writeln!(
            out,
            "{:>5} {:>16} {:>16} {:>16} {:>16} {:>16} {:>16} {:>10} {:>13} {:>16} {:>16}",
            rank.rank,
            thousands(rank.weights_bytes),
            thousands(rank.gradients_bytes),
            thousands(rank.optimizer_bytes),
            thousands(rank.activations_bytes),
            thousands(rank.comm_buffer_bytes),
            thousands(rank.total_bytes),
            rank.phase.label(),
            rank.limiting.label(),
            thousands(rank.peak_bytes),
            thousands(rank.sent_bytes),
        );
    }
    let _ = writeln!(
        out,
        "bytes; 'meter peak' is what tl_tensor::memory counts on the rank: tensors and \
         tl-parallel's communication buffers"
    );
    if plan.ranks.len() < p.ranks {
        let _ = writeln!(
            out,
            "(rank 0 only: it holds the largest shards; other ranks differ by a few elements)"
        );
    }
    let rank0 = plan.rank0();
    let _ = writeln!(out, "\nbytes rank 0 sends per step, headers included:");
    let _ = writeln!(
        out,
        "{:<34} {:<15} {:>16} {:>8} {:>18}",
        "what", "collective", "elements", "calls", "bytes sent"
    );
    for sent in &rank0.sent {
        let c = &sent.calls;
        let _ = writeln!(
            out,
            "{:<34} {:<15} {:>16} {:>8} {:>18}",
            c.purpose,
            c.collective.label(),
            thousands(c.elements),
            c.calls,
            thousands(sent.bytes)
        );
    }
    let paper = &plan.paper;
    let _ = writeln!(
        out,
        "\nthe paper's arithmetic per rank (Rajbhandari et al., K = 12): model state {}; \
         tinyllm's f32 16P at this stage: weights {} + gradients {} + moments {} = {}; \
         this plan: model state {} + activations {}",
        size(paper.model_state_k12),
        size(paper.f32_weights),
        size(paper.f32_gradients),
        size(paper.f32_moments),
        size(paper.f32_weights + paper.f32_gradients + paper.f32_moments),
        size(rank0.weights_bytes + rank0.gradients_bytes + rank0.optimizer_bytes),
        size(rank0.activations_bytes),
    );
    let t = p.tensor;
    let formula = if t == 1 {
        "sbh(34 + 5as/h)".to_string()
    } else if p.sequence_parallel {
        format!("(sbh/{t})(34 + 5as/h)")
    } else {
        format!("sbh(10 + 24/{t} + 5as/({t}h))")
    };
    // (ZeRO-3's step does not mark the end of a micro-batch's forward pass for the
    // ledger, so its saved bytes are not split by block: no line then.)
    if rank0.block_activations_bytes > 0 {
        let _ = writeln!(
            out,
            "activations a block keeps for backward (the most of any), one micro-batch: \
             this plan {} ({}, exact); Korthikanti et al. 2022, Table 2, {formula}: {} (a \
             GPT block, 16-bit activations, 1-byte dropout masks)",
            size(rank0.block_activations_bytes),
            plan.recipe.precision.name(),
            size(plan.paper_block_activations),
        );
    }
    let _ = writeln!(
        out,
        "the paper's volume per rank: {} per step; this plan sends {}",
        size(paper.sent),
        size(rank0.sent_bytes)
    );
    if let Some(pipe) = &plan.pipeline {
        pipeline_lines(&mut out, plan, pipe);
    }
    out
}

/// Each rank's stages, the schedule's bubble and the activations in flight.
fn pipeline_lines(out: &mut String, plan: &ParallelPlan, pipe: &super::parallel::PipelinePlan) {
    let p = plan.parallelism.pipeline;
    let _ = writeln!(
        out,
        "
pipeline, {}: bubble (idle / compute, equal stages, a backward twice a forward)",
        pipe.schedule
    );
    let _ = writeln!(
        out,
        "{:>5} {:<24} {:>16} {:>12} {:>20}",
        "rank", "stages (blocks)", "meter peak", "bubble", "activations held"
    );
    // The mesh's layout, rank = (pp·DP + dp)·TP + tp: the pipeline rank of a world rank.
    let parallelism = &plan.parallelism;
    let per_pipeline_rank = parallelism.ranks / p;
    for rank in &plan.ranks {
        let r = rank.rank / per_pipeline_rank;
        let stages: Vec<String> = (r..pipe.stage_blocks.len())
            .step_by(p)
            .map(|s| {
                let [a, b] = pipe.stage_blocks[s];
                format!("{s} ({a}..{b})")
            })
            .collect();
        let _ = writeln!(
            out,
            "{:>5} {:<24} {:>16} {:>12.4} {:>20}",
            rank.rank,
            stages.join(", "),
            thousands(rank.peak_bytes),
            pipe.bubble[r],
            pipe.activations_in_flight[r]
        );
    }
    let _ = writeln!(out, "{}: {:.4}", pipe.bubble_source, pipe.bubble_formula);
}

/// One row per plan (rank 0 of each): the table over ranks and stages.
pub fn render_sweep(plans: &[ParallelPlan]) -> String {
    let mut out = String::new();
    if let Some(first) = plans.first() {
        recipe_line(&mut out, first);
    }
    // One unit for the whole table, chosen by its largest figure: GiB for the big shapes,
    // MiB where every figure would print as 0.00 GiB.
    let largest = plans
        .iter()
        .map(|plan| plan.rank0().total_bytes.max(plan.rank0().sent_bytes))
        .max()
        .unwrap_or(0);
    let (unit, unit_name) = if largest as f64 >= GIB {
        (GIB, "GiB")
    } else {
        (MIB, "MiB")
    };
    let _ = writeln!(
        out,
        "per rank (rank 0), steady-state step, {unit_name}: the terms at the moment ('when') the rank \
         holds most; 'meter' the metered peak (tensors and tl-parallel's communication \
         buffers); 'paper' Rajbhandari et al.'s model state with K = 12; 'f32 16P' tinyllm's \
         4P + 4P + 8P sharded as the stage shards it\n"
    );
    let _ = writeln!(
        out,
        "{:>5} {:>4} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>10} {:>10} {:>10} {:>10}  limits",
        "ranks",
        "ZeRO",
        "weights",
        "gradients",
        "optimizer",
        "activation",
        "comm buf",
        "total",
        "when",
        "meter",
        "paper",
        "f32 16P",
        "sent/step"
    );
    for plan in plans {
        let rank = plan.rank0();
        let paper = &plan.paper;
        let gib = |bytes: u64| format!("{:.2}", bytes as f64 / unit);
        let _ = writeln!(
            out,
            "{:>5} {:>4} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>10} {:>10} {:>10} {:>10}  {}",
            plan.parallelism.ranks,
            plan.parallelism.stage.to_string(),
            gib(rank.weights_bytes),
            gib(rank.gradients_bytes),
            gib(rank.optimizer_bytes),
            gib(rank.activations_bytes),
            gib(rank.comm_buffer_bytes),
            gib(rank.total_bytes),
            rank.phase.label(),
            gib(rank.peak_bytes),
            gib(paper.model_state_k12),
            gib(paper.f32_weights + paper.f32_gradients + paper.f32_moments),
            gib(rank.sent_bytes),
            rank.limiting.label(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;
    use crate::plan::{DataParallelism, Recipe, plan_ranks};
    use crate::train::TrainConfig;

    #[test]
    fn a_small_models_sweep_is_printed_in_mib_not_as_zeros() {
        let recipe = Recipe::from(&TrainConfig::for_preset(Preset::Tiny));
        let plans: Vec<ParallelPlan> = [0, 1]
            .iter()
            .map(|&stage| plan_ranks(&recipe, &DataParallelism::new(2, stage).unwrap()).unwrap())
            .collect();
        let table = render_sweep(&plans);
        assert!(table.contains("steady-state step, MiB"), "{table}");
        // Rank 0's weights under DDP: 133,440 f32 parameters = 0.51 MiB.
        assert!(table.contains(" 0.51 "), "{table}");
    }
}
