//! `tinyllm bench`: its `--json` output parsed back, the paired mode, a custom size from a
//! config file, and bad arguments refused before any step runs.

use std::process::{Command, Output};

use tl_precision::Precision;
use tl_train::bench::BenchReport;
use tl_train::model::Checkpointing;

/// The tiny preset, one sequence per step: the quickest step there is.
const TINY: [&str; 7] = [
    "bench",
    "--preset",
    "tiny",
    "--micro-batch",
    "1",
    "--accum",
    "1",
];

/// `tinyllm ARGS..` as a process, with one compute thread.
fn tinyllm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinyllm"))
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("tinyllm runs")
}

/// The report of a `tinyllm bench .. --json` that must succeed.
fn report(extra: &[&str]) -> BenchReport {
    let mut args = TINY.to_vec();
    args.extend(extra);
    args.push("--json");
    let output = tinyllm(&args);
    assert!(
        output.status.success(),
        "tinyllm {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "stdout is not one bench report ({error}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

#[test]
fn the_json_report_holds_every_timed_step_and_the_machine() {
    let report = report(&["--bf16", "--steps", "3", "--warmup", "2"]);
    assert_eq!(report.tinyllm, env!("CARGO_PKG_VERSION"));
    assert_eq!((report.ranks, report.warmup_steps), (1, 2));
    assert_eq!(report.tokens_per_step, 64, "1 sequence of the tiny context");
    assert_eq!(report.config.precision, Precision::Bf16);
    let [recipe] = report.recipes.as_slice() else {
        panic!("one recipe: {:?}", report.recipes)
    };
    assert_eq!(recipe.name, "bf16");
    assert_eq!(recipe.step_s.len(), 3);
    assert!(recipe.step_s.iter().all(|s| s.is_finite() && *s > 0.0));
    let s = recipe.seconds;
    assert!(s.min <= s.q1 && s.q1 <= s.median && s.median <= s.q3 && s.q3 <= s.max);
    assert!((recipe.tokens_per_s * s.median - 64.0).abs() < 1e-6);
    assert!(report.peak_live_bytes.is_some_and(|b| b > 0));
    assert!(report.paired.is_none());
    assert!(!report.machine.cpu.is_empty());
    assert_eq!(
        report.machine.threads, 1,
        "RAYON_NUM_THREADS is the default"
    );
}

#[test]
fn the_paired_mode_times_both_recipes_in_turns() {
    let report = report(&[
        "--paired",
        "fp32,bf16+ckpt",
        "--steps",
        "4",
        "--threads",
        "2",
    ]);
    assert_eq!(report.machine.threads, 2, "--threads sizes the pool");
    let names: Vec<&str> = report.recipes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["fp32", "bf16+ckpt"]);
    assert_eq!(report.recipes[1].checkpointing, Checkpointing::PerBlock);
    let paired = report.paired.expect("a paired report");
    assert_eq!(paired.second_first, [false, true, false, true]);
    assert_eq!(paired.ratios.len(), 4);
    for (i, ratio) in paired.ratios.iter().enumerate() {
        let (a, b) = (report.recipes[0].step_s[i], report.recipes[1].step_s[i]);
        assert!((ratio - b / a).abs() < 1e-12);
    }
}

#[test]
fn an_fp8_step_is_timed_alone_and_paired() {
    let alone = report(&["--fp8", "--steps", "1"]);
    assert!(alone.config.fp8.is_some());
    let names: Vec<&str> = alone.recipes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["fp8"]);
    let paired = report(&["--paired", "bf16,fp8", "--steps", "1"]);
    let names: Vec<&str> = paired.recipes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["bf16", "fp8"]);
    assert_eq!(paired.paired.unwrap().ratios.len(), 1);
}

#[test]
fn the_gemm_limit_times_the_very_products_the_plan_counts() {
    use tl_train::plan::{DataParallelism, step_flops};
    // The step's GEMM calls, recorded in a process of their own, carry exactly the FLOPs the
    // plan counts from the model's shape: the projections, the fused attention's blocks,
    // the head, and a checkpointed block's rerun less what its policy keeps.
    for policy in [
        &[][..],
        &["--checkpoint-activations"],
        &["--checkpoint-policy", "first-matmul"],
        &["--checkpoint-activations", "--chunked-loss", "on"],
    ] {
        let mut args = vec!["--gemm-limit", "--steps", "1", "--threads", "2"];
        args.extend(policy);
        let report = report(&args);
        let limit = report.gemm_limit.expect("asked for");
        let planned = step_flops(&report.config, &DataParallelism::new(1, 0).unwrap(), 0);
        assert_eq!(limit.flops, planned.unwrap().total(), "{policy:?}");
        assert_eq!(
            limit.calls,
            limit.products.iter().map(|p| p.count).sum::<u64>()
        );
        let sum: f64 = limit
            .products
            .iter()
            .map(|p| p.count as f64 * p.seconds)
            .sum();
        assert!(limit.seconds > 0.0 && (limit.seconds - sum).abs() <= 1e-9 * sum);
        assert!((limit.spread_s + limit.serial_s - limit.seconds).abs() <= 1e-9 * sum);
        // The recorded step's calls, timed where they ran.
        assert!(limit.in_program_s > 0.0);
        assert!(limit.products.iter().all(|p| p.in_program_s > 0.0));
    }
}

#[test]
fn a_custom_size_from_a_config_file_is_timed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("wide.toml");
    // The schema of a run's config.json, as TOML: a model no preset has.
    std::fs::write(
        &file,
        r#"
precision = "fp32"
micro_batch = 1
accum = 1
checkpointing = "off"
steps = 10
weight_decay = 0.01
clip = 1.0
seed = 3
eval_interval = 5
eval_batches = 1
save_interval = 5

[model]
vocab = 256
d_model = 48
n_layers = 1
n_heads = 2
hidden = 128
context = 32
norm_eps = 1e-5
rope_base = 10000.0
dropout = 0.0

[data.builtin]
seed = 0
bytes = 20000

[lr]
peak = 1e-3
min = 1e-4
warmup = 1
total = 10
"#,
    )
    .unwrap();
    let output = tinyllm(&[
        "bench",
        "--config",
        file.to_str().unwrap(),
        "--steps",
        "1",
        "--json",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: BenchReport = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report.config.model.d_model, 48);
    assert_eq!(report.config.seed, 3);
    assert_eq!(report.config.preset, None);
    assert_eq!(report.tokens_per_step, 32);
}

#[test]
fn bad_bench_arguments_fail_before_any_step() {
    for (args, expected) in [
        (vec!["--paired", "fp32"], "expected two recipes"),
        (vec!["--paired", "fp32,fp9"], "is not a recipe"),
        (vec!["--steps", "0"], "steps"),
        (vec!["--threads", "0"], "threads"),
        (vec!["--bf16", "--gemm-limit"], "gemm-limit"),
        (
            vec!["--paired", "fp32,fp32+ckpt", "--gemm-limit"],
            "gemm-limit",
        ),
    ] {
        let mut all = TINY.to_vec();
        all.extend(&args);
        let output = tinyllm(&all);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("step 1:"), "{args:?} ran a step: {stderr}");
        assert!(output.stdout.is_empty());
    }
}
