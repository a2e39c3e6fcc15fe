//! [`StepTimePlan`]: each rank's step time, predicted from the plan's exact traffic, a link
//! and a compute rate (`tinyllm plan --link GBIT[,LATENCY_US[,EFFICIENCY]]`).
//!
//! # The model
//!
//! - **Compute**: the FLOPs of the rank's products ([`step_flops`]) over a rate `R` in FLOP/s,
//!   given (a GPU's peak times an efficiency the user states) or measured on this node by
//!   running the recipe's own step. A measured rate is a whole step's: it absorbs the
//!   elementwise work, the optimizer and the rounding, which are not products. On a
//!   pipeline the rank also idles for its share of the schedule's bubble (the plan's
//!   simulated idle over compute): `compute = FLOPs / R · (1 + bubble)`.
//! - **Communication**, an α–β model of the ring: a collective over a group of `N` ranks
//!   first all-gathers its 40-byte header round the ring (`N − 1` messages), then moves its
//!   payload in `2(N − 1)` steps for an all-reduce, `N − 1` for a reduce-scatter or an
//!   all-gather; a pipeline's message is one. Each message costs `α` = the link's latency
//!   plus [`SOFTWARE_US_PER_MESSAGE`], and each byte `1/β` with `β` the link's rate in bytes
//!   per second times the transport's efficiency. The bytes are the plan's exact bytes per
//!   call, headers included (the sum over a call's steps of `α + (n/N)/β` is `hops·α +
//!   bytes/β`), so `communication = Σ calls · hops · α + Σ bytes / β`.
//! - **Overlap as built**: nothing. DDP reduces its buckets after backward, and ZeRO-2's and
//!   3's collectives block the rank while they run, so
//!   `step = compute + communication − overlapped` with `overlapped = 0`
//!   ([`overlapped_s`]). Buckets reduced concurrently with backward would change that one
//!   term: it would become the communication of every bucket but the last, up to the
//!   backward's compute.
//!
//! The worked example of `docs/step-time.md`, as a test:
//!
//! ```
//! use tl_train::plan::{Link, communication_s};
//! // The capstone's DDP step at N = 2 sends 41,309,532 bytes in two all-reduces (two
//! // buckets, the last carrying the step's scalars). On a 1 Gbit/s link with 50 µs of
//! // latency: 2 calls of 3 messages each (one header, two ring steps) at α = 60 µs, and
//! // the bytes at β = 125 MB/s.
//! let link: Link = "1,50".parse()?;
//! let (latency, bandwidth) = communication_s(&[(2, 3, 41_309_532)], &link);
//! assert!((latency - 6.0 * 60e-6).abs() < 1e-12);
//! assert!((bandwidth - 0.330_476_256).abs() < 1e-9);
//! # Ok::<(), tl_train::TrainError>(())
//! ```

use std::str::FromStr;

use serde::Serialize;

use super::collectives::Collective;
use super::flops::{StepFlops, step_flops};
use super::parallel::{DataParallelism, ParallelPlan};
use crate::error::{Result, TrainError};
use crate::train::TrainConfig;

/// Microseconds of software each message costs on top of the link's latency: what an
/// 8-byte all-reduce of Open MPI over TCP between two network namespaces of one machine
/// takes per message (32.8 µs for its three messages, `docs/step-time.md`).
pub const SOFTWARE_US_PER_MESSAGE: f64 = 10.0;

/// A network link: its rate, its latency, and the share of the rate the collectives reach.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Link {
    /// Line rate, Gbit/s (10⁹ bits per second).
    pub gbit_per_s: f64,
    /// One-way latency of a message, µs, before the software's
    /// [`SOFTWARE_US_PER_MESSAGE`].
    pub latency_us: f64,
    /// The share of the line rate the collectives' large messages reach (1 unless stated:
    /// a measured bus bandwidth over the line rate, as nccl-tests or `tinyllm comm-bench`
    /// report it).
    pub efficiency: f64,
}

impl Link {
    /// A link of `gbit_per_s` Gbit/s, `latency_us` µs, reaching `efficiency` of its rate.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] (`link`) for a rate that is not positive and finite,
    /// a latency that is negative or not finite, or an efficiency outside `(0, 1]`.
    pub fn new(gbit_per_s: f64, latency_us: f64, efficiency: f64) -> Result<Self> {
        let refuse = |value: f64, reason: &str| {
            Err(TrainError::InvalidArgument {
                name: "link",
                value: value.to_string(),
                reason: reason.into(),
            })
        };
        if !(gbit_per_s.is_finite() && gbit_per_s > 0.0) {
            return refuse(gbit_per_s, "a link's rate is a positive number of Gbit/s");
        }
        if !(latency_us.is_finite() && latency_us >= 0.0) {
            return refuse(latency_us, "a link's latency is zero or more microseconds");
        }
        if !(efficiency > 0.0 && efficiency <= 1.0) {
            return refuse(efficiency, "a link's efficiency is a share in (0, 1]");
        }
        Ok(Self {
            gbit_per_s,
            latency_us,
            efficiency,
        })
    }

    /// `α`: seconds each message costs, the latency and the software's cost.
    pub fn alpha_s(&self) -> f64 {
        (self.latency_us + SOFTWARE_US_PER_MESSAGE) * 1e-6
    }

    /// `β`: bytes per second the collectives move, `Gbit/s · 10⁹ / 8 · efficiency`.
    pub fn beta_bytes_per_s(&self) -> f64 {
        self.gbit_per_s * 1e9 / 8.0 * self.efficiency
    }
}

impl FromStr for Link {
    type Err = TrainError;

    /// `GBIT[,LATENCY_US[,EFFICIENCY]]`: `400,5` is 400 Gbit/s with 5 µs of latency; the
    /// latency defaults to 0 and the efficiency to 1.
    fn from_str(text: &str) -> Result<Self> {
        let malformed = |reason: &str| TrainError::InvalidArgument {
            name: "link",
            value: text.to_owned(),
            reason: format!("{reason}; expected GBIT[,LATENCY_US[,EFFICIENCY]], e.g. 400,5"),
        };
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        if fields.len() > 3 {
            return Err(malformed("more than three fields"));
        }
        let number = |field: &str, what: &str| {
            field
                .parse::<f64>()
                .map_err(|_| malformed(&format!("{what} {field:?} is not a number")))
        };
        let gbit = number(fields[0], "the rate")?;
        let latency = fields
            .get(1)
            .map_or(Ok(0.0), |f| number(f, "the latency"))?;
        let efficiency = fields
            .get(2)
            .map_or(Ok(1.0), |f| number(f, "the efficiency"))?;
        Link::new(gbit, latency, efficiency)
    }
}

/// Where a compute rate comes from.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "source")]
pub enum RateSource {
    /// `--compute-rate`.
    Given,
    /// `--bench`: the recipe's own step run on this node, one process.
    Measured {
        /// The median of the timed steps, s.
        step_s: f64,
        /// The products' FLOPs of that step.
        flops: u64,
    },
}

/// FLOP/s a rank computes at.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ComputeRate {
    /// FLOP/s.
    pub flops_per_s: f64,
    /// Given or measured.
    #[serde(flatten)]
    pub source: RateSource,
}

impl ComputeRate {
    /// A rate given by the user.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] (`compute-rate`) unless positive and finite.
    pub fn given(flops_per_s: f64) -> Result<Self> {
        if !(flops_per_s.is_finite() && flops_per_s > 0.0) {
            return Err(TrainError::InvalidArgument {
                name: "compute-rate",
                value: flops_per_s.to_string(),
                reason: "a compute rate is a positive number of FLOP/s".into(),
            });
        }
        Ok(Self {
            flops_per_s,
            source: RateSource::Given,
        })
    }

    /// The rate of a step of `flops` FLOPs measured to take `step_s` seconds.
    ///
    /// # Errors
    /// As [`given`](Self::given), for a step of no FLOPs or no time.
    pub fn measured(flops: u64, step_s: f64) -> Result<Self> {
        let rate = Self::given(flops as f64 / step_s)?;
        Ok(Self {
            source: RateSource::Measured { step_s, flops },
            ..rate
        })
    }
}

impl FromStr for ComputeRate {
    type Err = TrainError;

    /// A number of FLOP/s, or a product of numbers: `989e12*0.4` is an H100's dense bf16
    /// peak at 40% efficiency.
    fn from_str(text: &str) -> Result<Self> {
        let mut rate = 1.0;
        for factor in text.split('*').map(str::trim) {
            rate *= factor
                .parse::<f64>()
                .map_err(|_| TrainError::InvalidArgument {
                    name: "compute-rate",
                    value: text.to_owned(),
                    reason: format!(
                        "{factor:?} is not a number; expected FLOP/s, or a product such as \
                         989e12*0.4 (a peak times an efficiency)"
                    ),
                })?;
        }
        Self::given(rate)
    }
}

/// Messages one call of `collective` over a ring of `ranks` puts on the critical path: the
/// header's `N − 1`, then `2(N − 1)` steps for an all-reduce and `N − 1` for a
/// reduce-scatter or an all-gather; a point-to-point message is one (its frame header
/// travels with it). A group of one sends nothing.
///
/// ```
/// use tl_train::plan::{Collective, ring_messages};
/// assert_eq!(ring_messages(Collective::AllReduce, 8), 7 + 14);
/// assert_eq!(ring_messages(Collective::AllGather, 8), 7 + 7);
/// assert_eq!(ring_messages(Collective::Send, 8), 1);
/// assert_eq!(ring_messages(Collective::AllReduce, 1), 0);
/// ```
pub fn ring_messages(collective: Collective, ranks: usize) -> u64 {
    let hops = ranks.saturating_sub(1) as u64;
    match collective {
        Collective::AllReduce => 3 * hops,
        Collective::ReduceScatter | Collective::AllGather => 2 * hops,
        Collective::Send => 1,
    }
}

/// The latency and bandwidth terms, in seconds, of `calls` on `link`: each entry is
/// (calls, messages per call, bytes sent over all those calls), giving
/// `Σ calls · messages · α` and `Σ bytes / β`.
pub fn communication_s(calls: &[(u64, u64, u64)], link: &Link) -> (f64, f64) {
    let messages: u64 = calls.iter().map(|&(n, hops, _)| n * hops).sum();
    let bytes: u64 = calls.iter().map(|&(_, _, bytes)| bytes).sum();
    (
        messages as f64 * link.alpha_s(),
        bytes as f64 / link.beta_bytes_per_s(),
    )
}

/// Seconds of communication hidden behind the last micro-batch's backward, as
/// `--overlap` runs it: `buckets` are the gradient buckets in the order they are reduced,
/// each as (elements, seconds of communication), over a backward of `backward_s` seconds.
///
/// Backward produces the gradients in the buckets' order, at a pace taken proportional to
/// their elements, so bucket `i` is ready at the share of `backward_s` that the elements up
/// to its end make of all of them. The communication thread reduces the buckets one at a
/// time, each once it is ready and the one before is done; the last bucket (which carries
/// the step's loss and flags) starts only when backward is over. What ends after backward
/// is what the rank waits for; the rest was hidden.
///
/// ```
/// use tl_train::plan::overlapped_s;
/// // Two equal buckets of 0.3 s over a 1 s backward: the first is ready at 0.5 s and done
/// // at 0.8 s; the last starts at 1.0 s, so 0.3 s of 0.6 s was hidden.
/// assert!((overlapped_s(&[(10, 0.3), (10, 0.3)], 1.0) - 0.3).abs() < 1e-12);
/// // Communication slower than backward: the first bucket is done at 0.5 + 0.8 = 1.3 s,
/// // so the last starts there and only 0.5 s of the first was hidden.
/// assert!((overlapped_s(&[(10, 0.8), (10, 0.3)], 1.0) - 0.5).abs() < 1e-12);
/// assert_eq!(overlapped_s(&[(10, 0.3)], 1.0), 0.0); // one bucket: nothing to hide
/// ```
pub fn overlapped_s(buckets: &[(u64, f64)], backward_s: f64) -> f64 {
    let Some((_, reduced_during)) = buckets.split_last() else {
        return 0.0;
    };
    let elements: u64 = buckets.iter().map(|&(n, _)| n).sum();
    let mut produced = 0;
    let mut free_at: f64 = 0.0;
    for &(n, seconds) in reduced_during {
        produced += n;
        let ready = backward_s * produced as f64 / elements.max(1) as f64;
        free_at = free_at.max(ready) + seconds;
    }
    // What the buckets before the last still take after backward is waited for, and so is
    // the whole last bucket.
    let during: f64 = reduced_during.iter().map(|&(_, seconds)| seconds).sum();
    (during - (free_at - backward_s).max(0.0)).max(0.0)
}

/// The plan's names of the gradient buckets' calls, in the order a step makes them.
const GRADIENT_BUCKETS: [&str; 2] = ["gradient buckets", "last gradient bucket"];

/// Whether the step reduces its gradient buckets while backward goes on: `--overlap`, on
/// data parallelism alone at ZeRO 0 to 2 (see the [module docs](self)).
fn overlaps(config: &TrainConfig, parallelism: &DataParallelism) -> bool {
    config.parallel.overlap
        && parallelism.tensor == 1
        && parallelism.pipeline == 1
        && parallelism.stage.index() <= 2
}

/// One rank's step, predicted.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RankStepTime {
    /// The rank.
    pub rank: usize,
    /// Its products' FLOPs per step.
    pub flops: StepFlops,
    /// The pipeline's bubble on this rank (idle over compute), 0 without a pipeline.
    pub bubble: f64,
    /// `FLOPs / rate · (1 + bubble)`, s.
    pub compute_s: f64,
    /// The messages' term, `Σ calls · messages · α`, s.
    pub latency_s: f64,
    /// The bytes' term, `Σ bytes / β`, s.
    pub bandwidth_s: f64,
    /// The two together, s.
    pub communication_s: f64,
    /// Communication hidden behind the last backward ([`overlapped_s`]); 0 without overlap.
    pub overlapped_s: f64,
    /// `compute + communication − overlapped`, s.
    pub step_s: f64,
    /// Communication not hidden, over the step.
    pub communication_share: f64,
}

/// Every listed rank's predicted step, with the link and the rate behind it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepTimePlan {
    /// The link.
    pub link: Link,
    /// `α`, s.
    pub alpha_s: f64,
    /// `β`, bytes/s.
    pub beta_bytes_per_s: f64,
    /// The compute rate.
    pub compute: ComputeRate,
    /// Rank by rank, as the plan lists them.
    pub ranks: Vec<RankStepTime>,
}

/// The step time of every rank `plan` lists, on `link` at `rate` (see the
/// [module docs](self)). `config` is the recipe the plan ran.
///
/// # Errors
/// The config's errors of a pipeline's cut.
pub fn predict_step_time(
    plan: &ParallelPlan,
    config: &TrainConfig,
    link: &Link,
    rate: &ComputeRate,
) -> Result<StepTimePlan> {
    let parallelism: &DataParallelism = &plan.parallelism;
    let mut config = config.clone();
    config.parallel.pipeline = parallelism.pipeline;
    config.parallel.tensor = parallelism.tensor;
    let replicas = parallelism.ranks / (parallelism.tensor * parallelism.pipeline);
    let ranks = plan
        .ranks
        .iter()
        .map(|rank| {
            let flops = step_flops(&config, parallelism, rank.rank)?;
            let pp_rank = rank.rank / (parallelism.tensor * replicas);
            let bubble = plan
                .pipeline
                .as_ref()
                .and_then(|p| p.bubble.get(pp_rank).copied())
                .unwrap_or(0.0);
            let compute_s = flops.total() as f64 / rate.flops_per_s * (1.0 + bubble);
            let calls: Vec<(u64, u64, u64)> = (rank.sent.iter())
                .map(|s| {
                    let hops = ring_messages(s.calls.collective, s.calls.group_ranks);
                    (s.calls.calls, hops, s.bytes)
                })
                .collect();
            let (latency_s, bandwidth_s) = communication_s(&calls, link);
            let communication_s = latency_s + bandwidth_s;
            let overlapped_s = if overlaps(&config, parallelism) {
                // The gradient buckets, each call with its own share of the bytes.
                let buckets: Vec<(u64, f64)> = (rank.sent.iter())
                    .filter(|s| GRADIENT_BUCKETS.contains(&s.calls.purpose))
                    .flat_map(|s| {
                        let hops = ring_messages(s.calls.collective, s.calls.group_ranks);
                        let per_call = s.bytes / s.calls.calls.max(1);
                        let (latency, bandwidth) =
                            self::communication_s(&[(1, hops, per_call)], link);
                        std::iter::repeat_n(
                            (s.calls.elements, latency + bandwidth),
                            s.calls.calls as usize,
                        )
                    })
                    .collect();
                let last_backward = (flops.backward + flops.recompute) as f64
                    / config.accum.max(1) as f64
                    / rate.flops_per_s;
                overlapped_s(&buckets, last_backward)
            } else {
                0.0
            };
            let step_s = compute_s + communication_s - overlapped_s;
            Ok(RankStepTime {
                rank: rank.rank,
                flops,
                bubble,
                compute_s,
                latency_s,
                bandwidth_s,
                communication_s,
                overlapped_s,
                step_s,
                communication_share: (communication_s - overlapped_s) / step_s,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(StepTimePlan {
        link: *link,
        alpha_s: link.alpha_s(),
        beta_bytes_per_s: link.beta_bytes_per_s(),
        compute: *rate,
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;
    use crate::plan::{Recipe, plan_ranks};

    #[test]
    fn a_link_parses_its_rate_latency_and_efficiency() {
        let link: Link = "400,5".parse().unwrap();
        assert_eq!(
            (link.gbit_per_s, link.latency_us, link.efficiency),
            (400.0, 5.0, 1.0)
        );
        // 400 Gbit/s = 50 GB/s; α = 5 + 10 µs.
        assert_eq!(link.beta_bytes_per_s(), 50e9);
        assert!((link.alpha_s() - 15e-6).abs() < 1e-18);
        let link: Link = " 1 , 0 , 0.5 ".parse().unwrap();
        assert_eq!(link.beta_bytes_per_s(), 62.5e6);
        assert_eq!("10".parse::<Link>().unwrap().latency_us, 0.0);
    }

    #[test]
    fn bad_links_are_refused_naming_the_option() {
        for bad in [
            "", "0", "-1", "abc", "1,", "1,-5", "1,x", "inf", "NaN", "1,2,0", "1,2,1.5", "1,2,3,4",
        ] {
            match bad.parse::<Link>() {
                Err(TrainError::InvalidArgument { name: "link", .. }) => {}
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn a_compute_rate_is_a_number_or_a_product_and_positive() {
        let rate: ComputeRate = "989e12*0.4".parse().unwrap();
        assert_eq!(rate.flops_per_s, 989e12 * 0.4);
        assert_eq!("1.5e9".parse::<ComputeRate>().unwrap().flops_per_s, 1.5e9);
        for bad in [
            "0",
            "-3e12",
            "1e12*0",
            "fast",
            "1e12*",
            "inf",
            "1e308*1e308",
        ] {
            match bad.parse::<ComputeRate>() {
                Err(TrainError::InvalidArgument {
                    name: "compute-rate",
                    ..
                }) => {}
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
        assert!(ComputeRate::measured(1000, 0.0).is_err());
        let measured = ComputeRate::measured(3_000, 1.5).unwrap();
        assert_eq!(measured.flops_per_s, 2_000.0);
    }

    /// By hand: 2 all-reduces of 1,000,040 bytes each over 4 ranks (9 messages each) and 4
    /// sends of 1,000 bytes on a 10 Gbit/s link of 40 µs: α = 50 µs, β = 1.25 GB/s.
    #[test]
    fn the_alpha_beta_terms_match_a_hand_count() {
        let link = Link::new(10.0, 40.0, 1.0).unwrap();
        let calls = [
            (2, ring_messages(Collective::AllReduce, 4), 2_000_080),
            (4, ring_messages(Collective::Send, 4), 4_000),
        ];
        let (latency, bandwidth) = communication_s(&calls, &link);
        // (2·9 + 4·1) · 50 µs = 1.1 ms; 2,004,080 B / 1.25e9 B/s = 1.603264 ms.
        assert!((latency - 1.1e-3).abs() < 1e-12, "{latency}");
        assert!((bandwidth - 1.603_264e-3).abs() < 1e-12, "{bandwidth}");
    }

    /// The capstone's DDP at N = 2 on 1 Gbit/s, 50 µs (the docs' worked example): two
    /// gradient buckets, the last carrying the step's scalars, 41,309,532 bytes; compute at
    /// a given rate.
    #[test]
    fn the_capstone_ddp_step_on_a_link_is_compute_plus_communication() {
        let mut config = TrainConfig::for_preset(Preset::Capstone);
        config.micro_batch = 4;
        config.accum = 1;
        let plan =
            plan_ranks(&Recipe::from(&config), &DataParallelism::new(2, 0).unwrap()).unwrap();
        let rank = plan.rank0();
        assert_eq!(rank.sent_bytes, 41_309_532);
        let calls: u64 = rank.sent.iter().map(|s| s.calls.calls).sum();
        assert_eq!(calls, 2);
        let link: Link = "1,50".parse().unwrap();
        let rate = ComputeRate::given(1e10).unwrap();
        let time = predict_step_time(&plan, &config, &link, &rate).unwrap();
        let r0 = &time.ranks[0];
        // 2 all-reduces × 3 messages × 60 µs.
        assert!((r0.latency_s - 360e-6).abs() < 1e-12);
        assert!((r0.bandwidth_s - 41_309_532.0 / 125e6).abs() < 1e-12);
        // 4 sequences of 36,742,103,040 FLOPs (`flops.rs`).
        assert_eq!(r0.flops.total(), 146_968_412_160);
        assert!((r0.compute_s - r0.flops.total() as f64 / 1e10).abs() < 1e-12);
        // The first bucket (25 MiB, ready at 64% of backward) is reduced during backward,
        // well within it; the last one after it.
        let first = rank
            .sent
            .iter()
            .find(|s| s.calls.purpose == "gradient buckets");
        let first = first.unwrap().bytes as f64;
        assert!((r0.overlapped_s - (3.0 * 60e-6 + first / 125e6)).abs() < 1e-12);
        let backward = r0.flops.backward as f64 / 1e10;
        assert!(r0.overlapped_s < backward);
        let step = r0.compute_s + r0.communication_s - r0.overlapped_s;
        assert!((r0.step_s - step).abs() < 1e-12);
        let exposed = r0.communication_s - r0.overlapped_s;
        assert!((r0.communication_share - exposed / r0.step_s).abs() < 1e-12);
        // Without overlap, nothing is hidden.
        config.parallel.overlap = false;
        let after = predict_step_time(&plan, &config, &link, &rate).unwrap();
        assert_eq!(after.ranks[0].overlapped_s, 0.0);
        assert!((after.ranks[0].step_s - (r0.compute_s + r0.communication_s)).abs() < 1e-12);
        assert_eq!(time.ranks.len(), 2);
    }
}
