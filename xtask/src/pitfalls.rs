//! The 24 pitfall mutants of L11.1: each one of the chapter's pitfalls, written as the bug a
//! Rust programmer would make, as a replacement of a pattern inside one named function.
//!
//! An entry is anchored to the function it mutates, not to the file's text: the pattern is
//! matched on the function's code with comments skipped and whitespace ignored
//! ([`crate::anchor`]), so reformatting a statement or renaming or adding code elsewhere in
//! the file does not move it. Reviewed like code: an entry whose function or pattern stops
//! being found exactly once (because that function changed) fails
//! `catalog_entries_apply_exactly_once`, so `cargo test --workspace` notices a rotted catalog
//! before the grade does.

/// One planted bug.
#[derive(Debug)]
pub(crate) struct Pitfall {
    /// `s01` … `s24`, as in the chapter.
    pub(crate) id: &'static str,
    /// The pitfall in one line.
    pub(crate) description: &'static str,
    /// The package whose own tests must catch it.
    pub(crate) package: &'static str,
    /// The file, relative to the workspace root.
    pub(crate) file: &'static str,
    /// The function the bug is planted in: `name` for a free function, `Type::name` for a
    /// method of an `impl` block for `Type`; it must be defined exactly once in the file.
    pub(crate) function: &'static str,
    /// The code replaced, whitespace between tokens insignificant; it must occur exactly once
    /// in the function's body, outside comments.
    pub(crate) pattern: &'static str,
    /// What it is replaced with: the bug.
    pub(crate) replacement: &'static str,
    /// The course test of the chapter's table expected to catch it.
    pub(crate) course_test: &'static str,
}

const PRECISION: &str = "tl-precision";
const RECOMPUTE: &str = "tl-recompute";

pub(crate) const PITFALLS: &[Pitfall] = &[
    Pitfall {
        id: "s01",
        description: "the matmul output is not rounded",
        package: PRECISION,
        file: "crates/tl-precision/src/autocast.rs",
        function: "RoundedMatmul::product",
        pattern: "cast_owned(product, f)",
        replacement: "product",
        course_test: "test_hand_example_bf16_matmul",
    },
    Pitfall {
        id: "s02",
        description: "the gradient passes through the cast unrounded",
        package: PRECISION,
        file: "crates/tl-precision/src/cast.rs",
        function: "cast_vjp",
        pattern: "let (grad_in, flushed) = round_counting_flushes(grad_out, format);",
        replacement: "let (grad_in, flushed) = (grad_out, 0);",
        course_test: "test_cast_rounds_both_directions",
    },
    Pitfall {
        id: "s03",
        description: "only one operand of the matmul is rounded",
        package: PRECISION,
        file: "crates/tl-precision/src/autocast.rs",
        function: "RoundedMatmul::product",
        pattern: "(rounded_operand(lhs, f), rounded_operand(rhs, f))",
        replacement: "(rounded_operand(lhs, f), rhs.clone())",
        course_test: "test_autocast_matmul_matches_rounded_reference",
    },
    Pitfall {
        id: "s04",
        description: "the cast rounds an f64 through f32",
        package: PRECISION,
        file: "crates/tl-precision/src/cast.rs",
        function: "rounded_copy",
        pattern: ".for_each(|(out, block)| round_slice_into(block, out, format));",
        replacement: ".for_each(|(out, block)| for (o, v) in out.iter_mut().zip(block) { o.write(E::from_f32(tl_numerics::Round::round_to(tl_tensor::Element::to_f32(*v), format))); });",
        course_test: "test_cast_rounds_both_directions",
    },
    Pitfall {
        id: "s05",
        description: "a panic inside autocast leaves the rounded matmul installed",
        package: PRECISION,
        file: "crates/tl-precision/src/autocast.rs",
        function: "AutocastGuard::drop",
        pattern: "set_matmul_hook(self.previous.take());",
        replacement: "if !std::thread::panicking() { set_matmul_hook(self.previous.take()); }",
        course_test: "test_autocast_restores_matmul",
    },
    Pitfall {
        id: "s06",
        description: "leaving an inner autocast ends the outer one",
        package: PRECISION,
        file: "crates/tl-precision/src/autocast.rs",
        function: "AutocastGuard::drop",
        pattern: "set_matmul_hook(self.previous.take());",
        replacement: "set_matmul_hook(None);",
        course_test: "test_autocast_restores_matmul",
    },
    Pitfall {
        id: "s07",
        description: "micro-batches weighted 1/k instead of n_i/N",
        package: PRECISION,
        file: "crates/tl-precision/src/accumulate.rs",
        function: "grad_accumulate_observed",
        pattern: "let weight = n as f64 / total_rows as f64;",
        replacement: "let weight = 1.0 / micro_batches.len() as f64;",
        course_test: "test_hand_example_accumulation",
    },
    Pitfall {
        id: "s08",
        description: "micro-batch losses summed, not weighted",
        package: PRECISION,
        file: "crates/tl-precision/src/accumulate.rs",
        function: "grad_accumulate_observed",
        pattern: "let weight = n as f64 / total_rows as f64;",
        replacement: "let weight = 1.0;",
        course_test: "test_accumulation_equals_one_big_batch",
    },
    Pitfall {
        id: "s09",
        description: "gradients zeroed between micro-batches",
        package: PRECISION,
        file: "crates/tl-precision/src/accumulate.rs",
        function: "grad_accumulate_observed",
        pattern: "weighted.backward();",
        replacement: "model.zero_grad(); weighted.backward();",
        course_test: "test_hand_example_accumulation",
    },
    Pitfall {
        id: "s10",
        description: "the reported loss is the unweighted mean",
        package: PRECISION,
        file: "crates/tl-precision/src/accumulate.rs",
        function: "grad_accumulate_observed",
        pattern: "batch_loss += weight * loss.item().to_f64();",
        replacement: "batch_loss += loss.item().to_f64() / micro_batches.len() as f64;",
        course_test: "test_hand_example_accumulation",
    },
    Pitfall {
        id: "s11",
        description: "gradients never unscaled before the update",
        package: PRECISION,
        file: "crates/tl-precision/src/scaler.rs",
        function: "DynamicLossScaler::step_observed",
        pattern: "multiply_grads(params, inv_scale * clip_coef);",
        replacement: "multiply_grads(params, clip_coef);",
        course_test: "test_hand_example_loss_scaler",
    },
    Pitfall {
        id: "s12",
        description: "the optimizer steps on non-finite gradients",
        package: PRECISION,
        file: "crates/tl-precision/src/scaler.rs",
        function: "DynamicLossScaler::step_observed",
        pattern: "let finite = observer.all_finite(params.iter().all(grad_is_finite));",
        replacement: "let finite = true;",
        course_test: "test_scaler_skips_inf_steps",
    },
    Pitfall {
        id: "s13",
        description: "the bad gradients are kept after a skipped step",
        package: PRECISION,
        file: "crates/tl-precision/src/scaler.rs",
        function: "DynamicLossScaler::step_observed",
        pattern: "params.iter().for_each(Tensor::zero_grad);",
        replacement: "",
        course_test: "test_scaler_skips_inf_steps",
    },
    Pitfall {
        id: "s14",
        description: "the good-step count is not restarted after an overflow",
        package: PRECISION,
        file: "crates/tl-precision/src/scaler.rs",
        function: "DynamicLossScaler::record_overflow",
        pattern: "self.good_steps = 0;",
        replacement: "",
        course_test: "test_hand_example_loss_scaler",
    },
    Pitfall {
        id: "s15",
        description: "the clip acts on scaled gradients",
        package: PRECISION,
        file: "crates/tl-precision/src/scaler.rs",
        function: "DynamicLossScaler::step_observed",
        pattern: "let grad_norm = clip.map(|_| total_norm(params, observer) * inv_scale);",
        replacement: "let grad_norm = clip.map(|_| total_norm(params, observer));",
        course_test: "test_scaler_unscales_before_clipping",
    },
    Pitfall {
        id: "s16",
        description: "the good-step count is lost on resume",
        package: PRECISION,
        file: "crates/tl-precision/src/scaler_state.rs",
        function: "DynamicLossScaler::from_state",
        pattern: "scaler.good_steps = state.good_steps;",
        replacement: "",
        course_test: "test_scaler_state_dict_roundtrip",
    },
    Pitfall {
        id: "s17",
        description: "a NaN loss without a scaler is stepped on",
        package: PRECISION,
        file: "crates/tl-precision/src/step.rs",
        function: "update",
        pattern: "if !loss.is_finite() {",
        replacement: "if false {",
        course_test: "test_train_step_mixed_rejects_nan_loss",
    },
    Pitfall {
        id: "s18",
        description: "the last segment is checkpointed too",
        package: RECOMPUTE,
        file: "crates/tl-recompute/src/sequential.rs",
        function: "checkpoint_sequential_with",
        pattern: "let is_last = index + 1 == sizes.len();",
        replacement: "let is_last = false;",
        course_test: "test_hand_example_checkpoint_schedule",
    },
    Pitfall {
        id: "s19",
        description: "the parameters are not parents of the checkpoint node",
        package: RECOMPUTE,
        file: "crates/tl-recompute/src/checkpoint.rs",
        function: "checkpoint_with",
        pattern: "let parents: Vec<&Tensor<E>> = inputs.iter().chain(params).collect();",
        replacement: "let parents: Vec<&Tensor<E>> = inputs.iter().collect();",
        course_test: "test_checkpoint_params_get_grads_from_data_input",
    },
    Pitfall {
        id: "s20",
        description: "a tensor passed twice gets its gradient twice",
        package: RECOMPUTE,
        file: "crates/tl-recompute/src/checkpoint.rs",
        function: "checkpoint_with",
        pattern: "let mut grads: Vec<Option<Tensor<E>>> = leaves.iter().map(Tensor::take_grad).collect();",
        replacement: "let mut grads: Vec<Option<Tensor<E>>> = inputs.iter().map(|input| inputs.iter().zip(&leaves).filter(|(other, _)| other.same(input)).filter_map(|(_, leaf)| leaf.grad()).reduce(|sum, grad| sum + grad).map(Tensor::from_array)).collect();",
        course_test: "test_checkpoint_function_and_no_grad",
    },
    Pitfall {
        id: "s21",
        description: "the generator is not replayed for the rerun",
        package: RECOMPUTE,
        file: "crates/tl-recompute/src/checkpoint.rs",
        function: "checkpoint_with",
        pattern: "set_rng_states(&rngs, &recorded);",
        replacement: "let _ = &recorded;",
        course_test: "test_checkpoint_replays_dropout_rng",
    },
    Pitfall {
        id: "s22",
        description: "the generator is not restored after the rerun",
        package: RECOMPUTE,
        file: "crates/tl-recompute/src/checkpoint.rs",
        function: "checkpoint_with",
        pattern: "set_rng_states(&rngs, &reached);",
        replacement: "let _ = &reached;",
        course_test: "test_checkpoint_replays_dropout_rng",
    },
    Pitfall {
        id: "s23",
        description: "the forward pass runs with the graph on",
        package: RECOMPUTE,
        file: "crates/tl-recompute/src/checkpoint.rs",
        function: "checkpoint_with",
        pattern: "let _graph_off = no_grad();",
        replacement: "let _graph_off = enable_grad();",
        course_test: "test_checkpoint_lowers_peak_memory",
    },
    Pitfall {
        id: "s24",
        description: "the rerun runs on the original tensors",
        package: RECOMPUTE,
        file: "crates/tl-recompute/src/checkpoint.rs",
        function: "checkpoint_with",
        pattern: "let leaves: Vec<Tensor<E>> = inputs.iter().map(rerun_copy).collect();",
        replacement: "let leaves: Vec<Tensor<E>> = inputs.to_vec();",
        course_test: "test_checkpoint_grads_bitwise_equal",
    },
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::anchor;

    #[test]
    fn the_catalog_has_s01_to_s24_in_order() {
        let ids: Vec<&str> = PITFALLS.iter().map(|p| p.id).collect();
        let expected: Vec<String> = (1..=24).map(|i| format!("s{i:02}")).collect();
        assert_eq!(ids, expected);
        for p in PITFALLS {
            let crate_dir = if p.package == PRECISION {
                "crates/tl-precision/"
            } else {
                "crates/tl-recompute/"
            };
            assert!(
                p.file.starts_with(crate_dir),
                "{}: {} is outside {}",
                p.id,
                p.file,
                p.package
            );
            assert_ne!(
                p.pattern, p.replacement,
                "{}: the mutant changes nothing",
                p.id
            );
            assert!(
                crate::catalog::L11_1
                    .iter()
                    .any(|t| t.name == p.course_test),
                "{}: {} is not a course test",
                p.id,
                p.course_test
            );
        }
    }

    #[test]
    fn catalog_entries_apply_exactly_once() {
        let root = crate::workspace_root();
        let rotted: Vec<String> = PITFALLS
            .iter()
            .filter_map(|p| {
                let source = std::fs::read_to_string(root.join(p.file)).unwrap_or_default();
                let mutated = anchor::replace_in(&source, p.function, p.pattern, p.replacement);
                match mutated {
                    Ok(mutated) if mutated != source => None,
                    Ok(_) => Some(format!(
                        "{} in {}: the mutant changes nothing",
                        p.id, p.file
                    )),
                    Err(why) => Some(format!("{} in {}: {why}", p.id, p.file)),
                }
            })
            .collect();
        assert!(
            rotted.is_empty(),
            "rotted pitfall mutants:\n{}",
            rotted.join("\n")
        );
    }
}
