//! [`RunSummary`]: what a finished run achieved and cost, from its metrics and meters.

use serde::{Deserialize, Serialize};

use super::metrics::Record;

/// The figures of a run that a report or a comparison needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// Optimizer steps done.
    pub steps: u64,
    /// Mean training loss of the last (up to) ten steps, nats per token.
    pub train_loss: f64,
    /// The last validation loss, nats per token.
    pub val_loss: Option<f64>,
    /// The last validation loss in bits per byte, when its record has it.
    pub val_bpb: Option<f64>,
    /// The corpus's entropy rate, when known: no model can go below it.
    pub entropy_floor: Option<f64>,
    /// Median throughput over the steps, tokens per second.
    pub tokens_per_s: f64,
    /// Median wall-clock seconds per optimizer step.
    pub step_s: f64,
    /// Peak bytes of live tensor storage (weights, gradients, moments, activations) over the
    /// run, from tl-tensor's meter.
    pub peak_live_bytes: u64,
    /// Peak resident memory of the process over the run, when the OS reports it.
    pub peak_rss_bytes: Option<u64>,
    /// Updates skipped because fp16 gradients overflowed.
    pub skipped_steps: u64,
    /// Each rank's memory, when the run trained on several (the figures above are rank 0's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<super::ranks::RankReport>,
    /// What to know about how the summary was made, when it is not the usual way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// How many trailing steps the train loss is averaged over.
const RECENT_STEPS: usize = 10;

impl RunSummary {
    /// Summarises `records` (one run's metrics, in order) with the meters' readings.
    ///
    /// ```
    /// use tl_train::train::{Record, RunSummary};
    /// let records = [
    ///     Record::Train { step: 1, loss: 3.0, lr: 1e-3, grad_norm: None, scale: None,
    ///                     skipped: false, underflows: 0, tokens_per_s: 100.0, step_s: 2.0,
    ///                     time: None, elapsed_s: Some(2.0), tokens: Some(512), fp8: None },
    ///     Record::Train { step: 2, loss: 2.0, lr: 1e-3, grad_norm: None, scale: None,
    ///                     skipped: false, underflows: 0, tokens_per_s: 120.0, step_s: 1.5,
    ///                     time: None, elapsed_s: Some(3.5), tokens: Some(1024), fp8: None },
    ///     Record::Eval { step: 2, val_loss: 2.5, val_bpb: None, time: None },
    /// ];
    /// let summary = RunSummary::from_records(&records, Some(1.0), 4096, None);
    /// assert_eq!(summary.train_loss, 2.5);      // mean of the last steps: (3 + 2)/2
    /// assert_eq!(summary.val_loss, Some(2.5));
    /// assert_eq!(summary.tokens_per_s, 120.0);  // the upper median of [100, 120]
    /// ```
    pub fn from_records(
        records: &[Record],
        entropy_floor: Option<f64>,
        peak_live_bytes: u64,
        peak_rss_bytes: Option<u64>,
    ) -> Self {
        let mut losses = Vec::new();
        let mut speeds = Vec::new();
        let mut times = Vec::new();
        let (mut steps, mut val_loss, mut val_bpb, mut skipped_steps) = (0, None, None, 0);
        for record in records {
            match *record {
                Record::Train {
                    step,
                    loss,
                    skipped,
                    tokens_per_s,
                    step_s,
                    ..
                } => {
                    steps = step;
                    losses.push(loss);
                    speeds.push(tokens_per_s);
                    times.push(step_s);
                    skipped_steps += u64::from(skipped);
                }
                Record::Eval {
                    val_loss: v,
                    val_bpb: b,
                    ..
                } => (val_loss, val_bpb) = (Some(v), b),
            }
        }
        let recent = &losses[losses.len().saturating_sub(RECENT_STEPS)..];
        Self {
            steps,
            train_loss: recent.iter().sum::<f64>() / recent.len().max(1) as f64,
            val_loss,
            val_bpb,
            entropy_floor,
            tokens_per_s: median(&mut speeds),
            step_s: median(&mut times),
            peak_live_bytes,
            peak_rss_bytes,
            skipped_steps,
            ranks: Vec::new(),
            note: None,
        }
    }
}

/// The upper median (0 for no values).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}
