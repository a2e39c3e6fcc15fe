//! L11.1: mixed precision, loss scaling, gradient accumulation and activation
//! checkpointing. The learner writes tl-precision and tl-recompute (but for what lies beyond
//! the chapter); the course tests are `tests/l11_1/`.

use super::{Chapter, CourseTest, Kind, LearnerCrate, Pitfall, Sources, test};

/// The chapter.
pub(crate) const L11_1: Chapter = Chapter {
    name: "L11.1",
    title: "Mixed precision, loss scaling, gradient accumulation and activation checkpointing",
    crates: CRATES,
    course_package: "tl-course",
    test_binary: "l11_1",
    tests: TESTS,
    pitfalls: PITFALLS,
};

/// The crates of L11.1 that the learner writes.
const CRATES: &[LearnerCrate] = &[
    LearnerCrate {
        dir: "crates/tl-precision",
        guides: &[
            ("scaler.rs", "docs/loss-scaling.md"),
            ("scaler_state.rs", "docs/loss-scaling.md"),
            ("observer.rs", "docs/loss-scaling.md"),
            ("accumulate.rs", "docs/gradient-accumulation.md"),
            ("step.rs", "docs/gradient-accumulation.md"),
            ("", "docs/mixed-precision.md"),
        ],
        starter: PRECISION_STARTER,
        // The tensor cores' accumulation models and fp8 training (issue 23).
        sources: Sources::AllBut(&["tensor_core.rs", "fp8.rs"]),
        own_tests: &["--lib", "--tests"],
    },
    LearnerCrate {
        dir: "crates/tl-recompute",
        guides: &[("", "docs/activation-checkpointing.md")],
        starter: RECOMPUTE_STARTER,
        // The keep policies of selective checkpointing (issue 24).
        sources: Sources::AllBut(&["policy.rs"]),
        own_tests: &["--lib", "--tests"],
    },
];

/// The starter tests of tl-precision: one worked example of the chapter, to copy from.
const PRECISION_STARTER: &str = r#"//! Your tests of tl-precision. `cargo xtask check L11.1` grades them: each of the chapter's
//! planted pitfalls must make at least one of them fail, and cargo-mutants must find them
//! catching at least 80% of the mutants of your code. Add a test for every rule of
//! docs/mixed-precision.md, docs/loss-scaling.md and docs/gradient-accumulation.md.

use tl_precision::{Format, cast};
use tl_tensor::Tensor;

/// A worked example of the chapter: 1 + 2⁻⁸ lies halfway between bf16's neighbours 1 and
/// 1 + 2⁻⁷, and a tie rounds to the even one, 1. fp16, with three more mantissa bits,
/// keeps it.
#[test]
fn a_tie_rounds_to_even_in_bf16_and_fp16_keeps_it() {
    let x = Tensor::<f32>::from_vec(vec![1.0 + 2f32.powi(-8)], &[1]).unwrap();
    assert_eq!(cast(&x, Format::Bf16).to_vec(), [1.0]);
    assert_eq!(cast(&x, Format::Fp16).to_vec(), [1.0 + 2f32.powi(-8)]);
}
"#;

/// The starter tests of tl-recompute.
const RECOMPUTE_STARTER: &str = r#"//! Your tests of tl-recompute. `cargo xtask check L11.1` grades them: each of the chapter's
//! planted pitfalls must make at least one of them fail, and cargo-mutants must find them
//! catching at least 80% of the mutants of your code. Add a test for every rule of
//! docs/activation-checkpointing.md.

use tl_recompute::checkpoint;
use tl_tensor::{Tensor, ndarray::arr2};

/// A worked example of the chapter: a checkpointed function gives the value and the
/// gradient of the plain one. Here y = (x·w)² with x = 3, w = 2: y = 36, dy/dw = 2·6·3 = 36.
#[test]
fn a_checkpointed_square_gives_the_plain_value_and_gradient() {
    let w = Tensor::<f64>::param(arr2(&[[2.0]]).into_dyn());
    let x = Tensor::<f64>::full(&[1, 1], 3.0);
    let weight = w.clone();
    let square = move |xs: &[Tensor<f64>]| xs[0].matmul(&weight).powi(2);
    let y = checkpoint(square, &[x], &[w.clone()], &[]);
    assert_eq!(y.item(), 36.0);
    y.sum_all().backward();
    assert_eq!(w.grad().unwrap()[[0, 0]], 36.0);
}
"#;

const P: &str = "precision";
const R: &str = "recompute";

/// The twenty tests of L11.1, in the chapter's order.
const TESTS: &[CourseTest] = &[
    test(
        "test_hand_example_bf16_matmul",
        P,
        Kind::Unit,
        "the worked bf16 product: 1 + 2^-8 rounds to 1, 1.01 is stored as 1.0078125, gradients are bf16",
        "the learner and the tests agree on what the emulation computes",
    ),
    test(
        "test_hand_example_accumulation",
        P,
        Kind::Unit,
        "micro-batches of 1 and 3 rows give the batch's loss 7.5 and gradient -15",
        "the trainer's --accum",
    ),
    test(
        "test_hand_example_loss_scaler",
        P,
        Kind::Unit,
        "the five-step trace of the scale, the good-step count and the weight",
        "fp16 runs",
    ),
    test(
        "test_hand_example_checkpoint_schedule",
        R,
        Kind::Unit,
        "six layers on a budget of 4 run forward [2,2,2,1,1,1] times with unchanged gradients",
        "--checkpoint-activations",
    ),
    test(
        "test_cast_rounds_both_directions",
        P,
        Kind::Unit,
        "cast rounds values and gradients in both formats and keeps the element type",
        "every autocast matmul is built from it",
    ),
    test(
        "test_autocast_matmul_matches_rounded_reference",
        P,
        Kind::Property,
        "random products, reflected operands and Linear equal rd(rd(a)·rd(b))",
        "attention and MLP products",
    ),
    test(
        "test_autocast_grads_are_bf16_and_masters_stay_fp32",
        P,
        Kind::Property,
        "weight gradients are bf16 values while an update of 1e-3 survives in the f32 master",
        "why mixed precision converges",
    ),
    test(
        "test_autocast_restores_matmul",
        P,
        Kind::Boundary,
        "a panic, nested scopes and an unknown format leave the right matmul in force",
        "no low precision leaks into the next evaluation",
    ),
    test(
        "test_fp16_underflow_is_rescued_by_loss_scaling",
        P,
        Kind::Differential,
        "tiny gradients vanish in fp16 and match f32 once the loss is scaled",
        "fp16 hardware",
    ),
    test(
        "test_scaler_skips_inf_steps",
        P,
        Kind::Property,
        "an overflow changes no weight, drops the gradients and halves the scale until steps succeed",
        "a long run survives a spike",
    ),
    test(
        "test_scaler_unscales_before_clipping",
        P,
        Kind::Differential,
        "a norm-5 gradient scaled by 1024 is clipped to norm 1 in true units",
        "the clip bound means what it says",
    ),
    test(
        "test_scaler_state_dict_roundtrip",
        P,
        Kind::Unit,
        "a saved and restored scaler keeps its scale and count; bad arguments are errors",
        "resuming a run from a checkpoint",
    ),
    test(
        "test_accumulation_equals_one_big_batch",
        P,
        Kind::Differential,
        "micro-batches of 5, 11 and 16 rows give the gradient of one batch of 32 to 1e-6",
        "MS-L11's loss within 2%",
    ),
    test(
        "test_train_step_mixed_bf16_tracks_fp32",
        P,
        Kind::Differential,
        "60 AdamW steps in bf16 end within 2% of the f32 run",
        "MS-L11 in miniature",
    ),
    test(
        "test_train_step_mixed_rejects_nan_loss",
        P,
        Kind::Boundary,
        "a NaN loss is an error before any parameter changes",
        "a training step never poisons the weights silently",
    ),
    test(
        "test_checkpoint_grads_bitwise_equal",
        R,
        Kind::Differential,
        "7 layers, three budgets, a residual around a segment, f64 and f32: every gradient equal to the plain run's, bit for bit",
        "checkpointing never changes training",
    ),
    test(
        "test_checkpoint_replays_dropout_rng",
        R,
        Kind::Differential,
        "the rerun draws the same dropout masks and the stream ends where the plain run's does",
        "dropout in the capstone",
    ),
    test(
        "test_checkpoint_params_get_grads_from_data_input",
        R,
        Kind::Unit,
        "a segment fed by data that needs no gradient still trains its parameters",
        "the embedding and the first block",
    ),
    test(
        "test_checkpoint_function_and_no_grad",
        R,
        Kind::Boundary,
        "a tensor passed twice, a number argument, and a call under no_grad",
        "checkpoint called directly",
    ),
    test(
        "test_checkpoint_lowers_peak_memory",
        R,
        Kind::Property,
        "the memory meter: bytes held after forward fall under half, the overall peak is lower",
        "the reason to checkpoint",
    ),
];

const PRECISION: &str = "tl-precision";
const RECOMPUTE: &str = "tl-recompute";

/// The 24 pitfalls of L11.1, `s01` to `s24` as in the chapter.
const PITFALLS: &[Pitfall] = &[
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
        pattern: "scale_grads(params, E::from_f64(inv_scale * clip_coef));",
        replacement: "scale_grads(params, E::from_f64(clip_coef));",
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

    #[test]
    fn the_chapter_has_twenty_tests_and_s01_to_s24_in_order() {
        assert_eq!(TESTS.len(), 20);
        let ids: Vec<&str> = PITFALLS.iter().map(|p| p.id).collect();
        let expected: Vec<String> = (1..=24).map(|i| format!("s{i:02}")).collect();
        assert_eq!(ids, expected);
    }
}
