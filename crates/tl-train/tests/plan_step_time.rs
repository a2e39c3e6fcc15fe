//! `tinyllm plan --link`: each rank's predicted step time in the JSON and the text, and the
//! refusals of bad links and rates.

mod common;

use common::{run_error, stdout_of, tinyllm};
use tl_train::TrainError;

/// The tiny preset, one sequence a rank, DDP over 2 ranks.
const TINY_DDP: [&str; 10] = [
    "plan",
    "--preset",
    "tiny",
    "--micro-batch",
    "1",
    "--accum",
    "1",
    "--ranks",
    "2",
    "--zero",
];

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1e-9)
}

#[test]
fn the_json_plan_carries_each_ranks_step_time() {
    let mut args = TINY_DDP.to_vec();
    args.extend(["0", "--link", "1,50", "--compute-rate", "1e9*0.5", "--json"]);
    let plan: serde_json::Value = serde_json::from_str(&stdout_of(&args)).unwrap();
    let time = &plan["step_time"];
    assert_eq!(time["link"]["gbit_per_s"], 1.0);
    assert_eq!(time["link"]["latency_us"], 50.0);
    assert_eq!(time["link"]["efficiency"], 1.0);
    assert!(close(time["alpha_s"].as_f64().unwrap(), 60e-6));
    assert_eq!(time["beta_bytes_per_s"], 125e6);
    assert_eq!(time["compute"]["flops_per_s"], 5e8);
    assert_eq!(time["compute"]["source"], "given");
    let ranks = time["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for (rank, predicted) in plan["ranks"].as_array().unwrap().iter().zip(ranks) {
        // The tiny preset's hand count (src/plan/flops.rs): one sequence.
        assert_eq!(predicted["flops"]["forward"], 17_039_360);
        assert_eq!(predicted["flops"]["backward"], 35_127_296);
        assert_eq!(predicted["flops"]["recompute"], 0);
        let compute = predicted["compute_s"].as_f64().unwrap();
        assert!(close(compute, 52_166_656.0 / 5e8));
        // The plan's own bytes at β, and 3 messages per all-reduce at α.
        let sent = rank["sent_bytes"].as_f64().unwrap();
        let bandwidth = predicted["bandwidth_s"].as_f64().unwrap();
        assert!(close(bandwidth, sent / 125e6));
        let calls: f64 = (rank["sent"].as_array().unwrap().iter())
            .map(|s| s["calls"].as_f64().unwrap())
            .sum();
        let latency = predicted["latency_s"].as_f64().unwrap();
        assert!(close(latency, calls * 3.0 * 60e-6));
        let communication = predicted["communication_s"].as_f64().unwrap();
        assert!(close(communication, latency + bandwidth));
        assert_eq!(predicted["overlapped_s"], 0.0);
        let step = predicted["step_s"].as_f64().unwrap();
        assert!(close(step, compute + communication));
        let share = predicted["communication_share"].as_f64().unwrap();
        assert!(close(share, communication / step));
    }
}

#[test]
fn the_text_plan_prints_a_line_per_rank_and_a_sweep_prints_rank_0() {
    let mut args = TINY_DDP.to_vec();
    args.extend(["0", "--link", "10", "--compute-rate", "2e9"]);
    let text = stdout_of(&args);
    assert!(text.contains("step time on a 10 Gbit/s link"), "{text}");
    assert!(text.contains("compute at 2.0 GFLOP/s (given)"), "{text}");
    // The tiny model's gradients fill one bucket: nothing to reduce during backward.
    assert!(text.contains("nothing overlapped"), "{text}");
    let mut sweep = TINY_DDP.to_vec();
    sweep.extend(["0,1", "--link", "10", "--compute-rate", "2e9"]);
    let text = stdout_of(&sweep);
    assert!(text.contains("rank 0 of each;"), "{text}");
    // Without --link, no step time in the JSON.
    let mut plain = TINY_DDP.to_vec();
    plain.extend(["0", "--json"]);
    let plan: serde_json::Value = serde_json::from_str(&stdout_of(&plain)).unwrap();
    assert!(plan.get("step_time").is_none());
}

#[test]
fn bad_links_and_rates_are_refused_naming_the_option() {
    let refused = |extra: &[&str], option: &str| {
        let mut args = TINY_DDP.to_vec();
        args.push("0");
        args.extend(extra);
        match run_error(&args) {
            TrainError::InvalidArgument { name, .. } => assert_eq!(name, option, "{extra:?}"),
            other => panic!("{extra:?}: {other}"),
        }
    };
    refused(&["--link", "0", "--compute-rate", "1e9"], "link");
    refused(&["--link", "1,-5", "--compute-rate", "1e9"], "link");
    refused(&["--link", "fast", "--compute-rate", "1e9"], "link");
    refused(&["--link", "1,2,3,4", "--compute-rate", "1e9"], "link");
    refused(&["--link", "1"], "link"); // no rate
    refused(&["--link", "1", "--compute-rate", "0"], "compute-rate");
    refused(&["--link", "1", "--compute-rate", "-2e12"], "compute-rate");
    refused(
        &["--link", "1", "--compute-rate", "989e12*x"],
        "compute-rate",
    );
    // A rate without a link, and --bench on a shape this machine cannot train, are usage
    // errors.
    assert!(tinyllm(&["plan", "--preset", "tiny", "--compute-rate", "1e9"]).is_err());
    assert!(tinyllm(&["plan", "--shape", "7b", "--link", "400", "--bench"]).is_err());
    // --measure trains one process and plans no ranks: no link to time.
    let measure = [
        "plan",
        "--preset",
        "tiny",
        "--measure",
        "--link",
        "1",
        "--bench",
    ];
    assert!(tinyllm(&measure).is_err());
}
