//! What the ranks of a run agree on outside the training step: that every rank could start
//! (and with the same config), whether to stop after a step, the dropout stream of each
//! micro-batch, and each rank's memory for the summary.
//!
//! In a world of one none of these communicates.

use serde::{Deserialize, Serialize};
use tl_collective::ReduceOp;
use tl_parallel::DataParallel;
use tl_precision::MicroBatch;
use tl_tensor::{Generator, GeneratorState};

use super::config::TrainConfig;
use crate::data::Batch;
use crate::error::{Result, TrainError};

/// A micro-batch of a step and its place in the step's global batch (0 for the first
/// micro-batch of rank 0, `accum · ranks − 1` for the last of the last rank).
pub struct StepBatch {
    /// Its index among the global batch's micro-batches.
    pub index: usize,
    /// Its rows.
    pub batch: Batch,
    /// Where dropout's stream starts for it ([`dropout_state`] of the run's seed, the step
    /// and `index`): set before its forward pass, and before each pipeline stage's.
    pub dropout: GeneratorState,
}

impl MicroBatch for StepBatch {
    fn rows(&self) -> usize {
        self.batch.rows
    }
}

/// Seed of the dropout streams, mixed with the run's seed.
const DROPOUT_STREAM: u64 = 0x9E6C_63D0_676A_9A99;

/// SplitMix64's finaliser: a bijection that spreads every input bit over the output.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The state dropout's generator starts from for micro-batch `index` of step `step` (counted
/// from 0): a function of the run's seed and the micro-batch's place in the global batch
/// only, so that a micro-batch gets the same masks on whichever rank, at whatever world
/// size, it runs.
pub fn dropout_state(seed: u64, step: u64, index: usize) -> GeneratorState {
    let key = mix(mix(seed ^ DROPOUT_STREAM) ^ step) ^ mix(index as u64 ^ DROPOUT_STREAM);
    Generator::new(mix(key)).state()
}

/// A 48-bit fingerprint of the config and the step a rank starts from (exact in an `f64`).
fn fingerprint(config: &TrainConfig, step: u64) -> f64 {
    let mut bytes = serde_json::to_vec(config).expect("the config serializes");
    bytes.extend_from_slice(&step.to_le_bytes());
    let hex = crate::store::fingerprint(&bytes);
    u64::from_str_radix(&hex[..12], 16).expect("hex digits") as f64
}

/// The ranks' answer to "did you get ready?": `local` on every rank when all succeeded
/// with the same config and step (`fingerprint`, given when `local` is `Ok`); otherwise this
/// rank's own error, or one naming the ranks that failed or disagree.
///
/// # Errors
/// This rank's error; [`TrainError::Ranks`]; [`TrainError::Parallel`] when the collective
/// itself fails.
pub fn agree<T>(
    ddp: &mut DataParallel,
    local: Result<T>,
    fingerprint_of: Option<(&TrainConfig, u64)>,
    what: &'static str,
) -> Result<T> {
    let (rank, world) = (ddp.rank(), ddp.world_size());
    if world == 1 {
        return local;
    }
    // Slot r: whether rank r failed; slot world + r: its fingerprint.
    let mut slots = vec![0.0f64; 2 * world];
    match (&local, fingerprint_of) {
        (Ok(_), Some((config, step))) => slots[world + rank] = fingerprint(config, step),
        _ => slots[rank] = 1.0,
    }
    ddp.with_communicator(|comm| {
        comm.all_reduce(
            <f64 as tl_collective::Element>::view_mut(&mut slots),
            ReduceOp::Sum,
        )
    })?;
    let local = local?;
    let failed: Vec<usize> = (0..world).filter(|&r| slots[r] != 0.0).collect();
    if !failed.is_empty() {
        return Err(TrainError::Ranks {
            ranks: failed,
            what: format!("could not {what} (see the error of each)"),
        });
    }
    let differing: Vec<usize> = (1..world)
        .filter(|&r| slots[world + r] != slots[world])
        .collect();
    if !differing.is_empty() {
        return Err(TrainError::Ranks {
            ranks: differing,
            what: format!(
                "would {what} with another config or step than rank 0: start every rank with \
                 the same flags and run directory"
            ),
        });
    }
    Ok(local)
}

/// Checks that every rank was given the same `value` of `flag`: a number that shapes the
/// run without being part of its config (`--until-step`), so that [`agree`]'s fingerprint
/// does not cover it. Ranks that disagree would part at the first step one of them saves
/// or stops after, as a mismatched collective; this names them before any step.
///
/// # Errors
/// [`TrainError::Ranks`] naming the ranks whose value differs from rank 0's;
/// [`TrainError::Parallel`] when the collective fails.
pub fn same_value(ddp: &mut DataParallel, value: u64, flag: &'static str) -> Result<()> {
    let (rank, world) = (ddp.rank(), ddp.world_size());
    if world == 1 {
        return Ok(());
    }
    // Slot r: rank r's value (exact in an f64: a step count).
    let mut slots = vec![0.0f64; world];
    slots[rank] = value as f64;
    ddp.with_communicator(|comm| {
        comm.all_reduce(
            <f64 as tl_collective::Element>::view_mut(&mut slots),
            ReduceOp::Sum,
        )
    })?;
    let differing: Vec<usize> = (1..world).filter(|&r| slots[r] != slots[0]).collect();
    match differing.first() {
        None => Ok(()),
        Some(&first) => Err(TrainError::Ranks {
            what: format!(
                "would run with another {flag} than rank 0 ({} against {}): start every rank \
                 with the same flags",
                slots[first], slots[0]
            ),
            ranks: differing,
        }),
    }
}

/// Whether `flag` holds on any rank (`flag` itself in a world of one).
///
/// # Errors
/// [`TrainError::Parallel`] when the collective fails.
pub fn any(ddp: &mut DataParallel, flag: bool) -> Result<bool> {
    if ddp.world_size() == 1 {
        return Ok(flag);
    }
    let mut value = [f64::from(u8::from(flag))];
    ddp.with_communicator(|comm| {
        comm.all_reduce(
            <f64 as tl_collective::Element>::view_mut(&mut value),
            ReduceOp::Sum,
        )
    })?;
    Ok(value[0] > 0.0)
}

/// The largest of `value` over the ranks (`value` itself in a world of one).
///
/// # Errors
/// [`TrainError::Parallel`] when the collective fails.
pub fn max(ddp: &mut DataParallel, value: u32) -> Result<u32> {
    if ddp.world_size() == 1 {
        return Ok(value);
    }
    let mut slot = [f64::from(value)];
    ddp.with_communicator(|comm| {
        comm.all_reduce(
            <f64 as tl_collective::Element>::view_mut(&mut slot),
            ReduceOp::Max,
        )
    })?;
    // Exact: every rank's value is an integer below 2^32.
    Ok(slot[0] as u32)
}

/// What one rank's part of a run cost: memory and communication.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    /// The rank.
    pub rank: usize,
    /// Its peak of live tensor bytes (tl-tensor's meter).
    pub peak_live_bytes: u64,
    /// Its peak resident memory, when the OS reports it.
    pub peak_rss_bytes: Option<u64>,
    /// Bytes it sent to its peers per training step (mean over the run's steps).
    pub bytes_sent_per_step: f64,
    /// Seconds it spent communicating per training step (mean over the run's steps): in
    /// collectives, and a pipeline's messages with their waits.
    pub comm_s_per_step: f64,
    /// The share of its own step time spent inside collectives (waiting for a slower rank
    /// included), 0 to 1.
    pub comm_share: f64,
    /// Seconds per training step its communication thread spent reducing gradients while
    /// the rank computed (`--overlap`): communication the step did not wait for, except
    /// where it is also in `comm_s_per_step` (the rank waiting for the thread).
    #[serde(default)]
    pub overlapped_comm_s_per_step: f64,
}

/// Slots of [`RankReport`] exchanged per rank.
const REPORT_SLOTS: usize = 6;

/// This rank's communication over the steps of a run: bytes sent, seconds in collectives,
/// and the number of steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTraffic {
    /// Bytes sent to peers.
    pub bytes_sent: u64,
    /// Seconds communicating: inside collectives, and a pipeline's messages (a receive's
    /// wait for its sender included).
    pub comm_s: f64,
    /// Seconds of the steps, collectives included.
    pub step_s: f64,
    /// Seconds the communication thread spent in collectives, while the rank computed or
    /// waited for it.
    pub overlapped_s: f64,
    /// Steps they were spent on.
    pub steps: u64,
}

/// Every rank's report, in rank order (a collective: every rank calls it).
///
/// # Errors
/// [`TrainError::Parallel`] when the collective fails.
pub fn gather_reports(
    ddp: &mut DataParallel,
    peak_live_bytes: u64,
    peak_rss_bytes: Option<u64>,
    traffic: StepTraffic,
) -> Result<Vec<RankReport>> {
    let (rank, world) = (ddp.rank(), ddp.world_size());
    // Exact in f64 below 2^53; the process memory as bytes + 1, 0 when unknown.
    let mut slots = vec![0.0f64; REPORT_SLOTS * world];
    slots[REPORT_SLOTS * rank..REPORT_SLOTS * (rank + 1)].copy_from_slice(&[
        peak_live_bytes as f64,
        peak_rss_bytes.map_or(0.0, |b| b as f64 + 1.0),
        traffic.bytes_sent as f64,
        traffic.comm_s,
        traffic.step_s,
        traffic.overlapped_s,
    ]);
    if world > 1 {
        ddp.with_communicator(|comm| {
            comm.all_reduce(
                <f64 as tl_collective::Element>::view_mut(&mut slots),
                ReduceOp::Sum,
            )
        })?;
    }
    let per_step = |total: f64| total / traffic.steps.max(1) as f64;
    Ok(slots
        .chunks_exact(REPORT_SLOTS)
        .enumerate()
        .map(|(rank, s)| RankReport {
            rank,
            peak_live_bytes: s[0] as u64,
            peak_rss_bytes: (s[1] > 0.0).then(|| s[1] as u64 - 1),
            bytes_sent_per_step: per_step(s[2]),
            comm_s_per_step: per_step(s[3]),
            comm_share: if s[4] > 0.0 { s[3] / s[4] } else { 0.0 },
            overlapped_comm_s_per_step: per_step(s[5]),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropout_streams_differ_by_step_and_micro_batch_and_repeat_exactly() {
        let draw = |state: GeneratorState| {
            let rng = Generator::new(0);
            rng.set_state(&state);
            (0..4).map(|_| rng.below(1 << 30)).collect::<Vec<_>>()
        };
        let base = draw(dropout_state(5, 3, 2));
        assert_eq!(base, draw(dropout_state(5, 3, 2)));
        for other in [
            dropout_state(5, 3, 1),
            dropout_state(5, 2, 2),
            dropout_state(4, 3, 2),
        ] {
            assert_ne!(base, draw(other));
        }
    }
}
