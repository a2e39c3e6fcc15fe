//! The course test catalog of L11.1: one row per test of the chapter's table, in our words.

/// What kind of check a course test is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A fixed input with a hand-computed answer.
    Unit,
    /// A law checked over many generated inputs.
    Property,
    /// Edge cases and failure paths.
    Boundary,
    /// Two computations that must agree.
    Differential,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Unit => "unit",
            Kind::Property => "property",
            Kind::Boundary => "boundary",
            Kind::Differential => "differential",
        }
    }
}

/// One course test.
#[derive(Debug)]
pub(crate) struct CourseTest {
    /// The test function's name in `tests/l11_1/` (and the chapter's table).
    pub(crate) name: &'static str,
    /// The module of the course test binary that holds it.
    pub(crate) module: &'static str,
    pub(crate) kind: Kind,
    /// What it checks.
    pub(crate) checks: &'static str,
    /// Why it matters further on.
    pub(crate) matters: &'static str,
}

impl CourseTest {
    /// The test's path inside the `l11_1` test binary, for an exact filter.
    pub(crate) fn path(&self) -> String {
        format!("{}::{}", self.module, self.name)
    }
}

/// A course module the harness knows.
#[derive(Debug)]
pub(crate) struct Module {
    pub(crate) name: &'static str,
    pub(crate) title: &'static str,
    pub(crate) tests: &'static [CourseTest],
}

/// Every module this workspace implements.
pub(crate) const MODULES: &[Module] = &[Module {
    name: "L11.1",
    title: "Mixed precision, loss scaling, gradient accumulation and activation checkpointing",
    tests: L11_1,
}];

/// Finds a module by name, or says which exist.
pub(crate) fn module(name: &str) -> Result<&'static Module, String> {
    MODULES.iter().find(|m| m.name == name).ok_or_else(|| {
        let known: Vec<&str> = MODULES.iter().map(|m| m.name).collect();
        format!(
            "unknown module '{name}'; this workspace implements: {}",
            known.join(", ")
        )
    })
}

const fn test(
    name: &'static str,
    module: &'static str,
    kind: Kind,
    checks: &'static str,
    matters: &'static str,
) -> CourseTest {
    CourseTest {
        name,
        module,
        kind,
        checks,
        matters,
    }
}

const P: &str = "precision";
const R: &str = "recompute";

/// The twenty tests of L11.1, in the chapter's order.
pub(crate) const L11_1: &[CourseTest] = &[
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l11_1_has_the_chapters_twenty_tests_once_each() {
        assert_eq!(L11_1.len(), 20);
        let mut names: Vec<&str> = L11_1.iter().map(|t| t.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 20);
    }

    #[test]
    fn every_course_test_exists_in_the_course_crate() {
        let root = crate::workspace_root();
        for test in L11_1 {
            let file = root.join(format!("tests/l11_1/{}.rs", test.module));
            let source = std::fs::read_to_string(&file).expect("course test file");
            assert!(
                source.contains(&format!("fn {}(", test.name)),
                "{} is not defined in {}",
                test.name,
                file.display()
            );
        }
    }

    #[test]
    fn unknown_module_lists_the_known_ones() {
        let err = module("L9.9").unwrap_err();
        assert!(err.contains("L9.9") && err.contains("L11.1"), "{err}");
    }
}
