//! Recording runs: [`record_run`] for one way of keeping activations, [`compare`] for plain
//! against checkpointed, and the [`Profile`] that holds them.

use serde::{Deserialize, Serialize};

use super::session::Session;
use super::timeline::Timeline;
use crate::error::{Result, TrainError};
use crate::model::Checkpointing;
use crate::train::TrainConfig;

/// What to profile: the training step of `train` (model, data, precision, micro-batches,
/// optimizer, seed), over `steps` recorded steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileConfig {
    /// The step's config. Its `checkpointing` is what [`compare`] sets against the plain
    /// run; its `steps` and learning-rate schedule are not used (the rate stays at its
    /// peak).
    pub train: TrainConfig,
    /// Steps recorded after the warm-up step.
    pub steps: usize,
}

/// The most steps one profile records (each step's timeline is kept in memory and drawn).
pub const MAX_PROFILE_STEPS: usize = 100;

impl ProfileConfig {
    /// Checks the config as the trainer would, and that at least one step is recorded.
    ///
    /// # Errors
    /// Those of [`TrainConfig::validate`]; [`TrainError::InvalidArgument`] for steps outside
    /// `1..=MAX_PROFILE_STEPS`.
    pub fn validate(&self) -> Result<()> {
        self.train.validate()?;
        if !(1..=MAX_PROFILE_STEPS).contains(&self.steps) {
            return Err(TrainError::InvalidArgument {
                name: "steps",
                value: self.steps.to_string(),
                reason: format!(
                    "must be in 1..={MAX_PROFILE_STEPS}: every step's timeline is kept"
                ),
            });
        }
        Ok(())
    }
}

/// Recorded timelines of one step config, each run with its own way of keeping activations,
/// and the config they share.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// What was profiled.
    pub config: ProfileConfig,
    /// One timeline per run, plain first.
    pub runs: Vec<Timeline>,
}

/// The name of a run that keeps activations as `checkpointing` says.
///
/// ```
/// use tl_train::model::Checkpointing;
/// use tl_train::profile::run_label;
/// assert_eq!(run_label(Checkpointing::Off), "plain");
/// assert_eq!(run_label(Checkpointing::Budget(2)), "checkpointed, budget 2");
/// ```
pub fn run_label(checkpointing: Checkpointing) -> String {
    match checkpointing {
        Checkpointing::Off => "plain".into(),
        Checkpointing::PerBlock => "checkpointed per block".into(),
        Checkpointing::Matmuls => "checkpointed, products kept".into(),
        Checkpointing::FirstMatmul => "checkpointed, x·Wq kept".into(),
        Checkpointing::Budget(budget) => format!("checkpointed, budget {budget}"),
    }
}

/// Records the live tensor bytes of `steps` training steps of `config`, phase by phase, on
/// this thread.
///
/// The run builds a fresh model and optimizer from the config's seed and first takes one
/// step on a one-row batch that is not recorded, so that AdamW's moments exist: the
/// recorded steps are the steady state, where the only memory that comes and goes is
/// gradients and activations. Bytes are counted from before the model was built, so tensors
/// the caller holds do not show.
///
/// # Errors
/// Those of [`ProfileConfig::validate`], checked first; a data file that cannot be used;
/// what the training step refuses (a non-finite loss, a loss scale stuck at its floor).
///
/// ```
/// use tl_train::model::{Checkpointing, Preset};
/// use tl_train::profile::{Phase, ProfileConfig, record_run};
/// use tl_train::train::{DataSource, TrainConfig};
///
/// let mut train = TrainConfig::for_preset(Preset::Tiny);
/// train.data = DataSource::Builtin { seed: 0, bytes: 20_000 };
/// (train.micro_batch, train.accum) = (2, 1);
/// let timeline = record_run(&ProfileConfig { train, steps: 1 })?;
/// assert_eq!(timeline.label, "plain");
/// // Activations pile up in forward: the peak is above where the step started.
/// assert!(timeline.phase_peak(Phase::Forward).unwrap() > timeline.start_live);
/// # Ok::<(), tl_train::TrainError>(())
/// ```
pub fn record_run(config: &ProfileConfig) -> Result<Timeline> {
    config.validate()?;
    let mut session = Session::new(&config.train)?;
    session.warm_up()?;
    let checkpointing = config.train.checkpointing;
    let mut timeline = Timeline::new(run_label(checkpointing), checkpointing, session.live());
    for step in 0..config.steps {
        let micro_batches = session.next_micro_batches();
        session.recorded_step(step, &micro_batches, &mut timeline)?;
    }
    Ok(timeline)
}

/// Records the step of `config` twice with the same seed — plain, then with the config's
/// checkpointing — so the two timelines see the same weights and batches. A config without
/// checkpointing gives the plain run alone.
///
/// # Errors
/// As [`record_run`].
///
/// ```
/// use tl_train::model::{Checkpointing, Preset};
/// use tl_train::profile::{ProfileConfig, compare};
/// use tl_train::train::{DataSource, TrainConfig};
///
/// let mut train = TrainConfig::for_preset(Preset::Tiny);
/// train.data = DataSource::Builtin { seed: 0, bytes: 20_000 };
/// (train.micro_batch, train.accum) = (4, 1);
/// train.checkpointing = Checkpointing::PerBlock;
/// let profile = compare(&ProfileConfig { train, steps: 1 })?;
/// let [plain, checkpointed] = &profile.runs[..] else { unreachable!() };
/// assert!(checkpointed.peak().bytes < plain.peak().bytes);
/// assert_eq!(checkpointed.losses, plain.losses); // recomputation changes no bit
/// # Ok::<(), tl_train::TrainError>(())
/// ```
pub fn compare(config: &ProfileConfig) -> Result<Profile> {
    config.validate()?;
    let mut modes = vec![Checkpointing::Off];
    if config.train.checkpointing != Checkpointing::Off {
        modes.push(config.train.checkpointing);
    }
    let runs = modes
        .into_iter()
        .map(|checkpointing| {
            let mut run = config.clone();
            run.train.checkpointing = checkpointing;
            record_run(&run)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Profile {
        config: config.clone(),
        runs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;
    use crate::profile::Phase;
    use crate::train::DataSource;

    fn tiny(micro_batch: usize, accum: usize, checkpointing: Checkpointing) -> ProfileConfig {
        let mut train = TrainConfig::for_preset(Preset::Tiny);
        train.data = DataSource::Builtin {
            seed: 0,
            bytes: 20_000,
        };
        (train.micro_batch, train.accum, train.checkpointing) = (micro_batch, accum, checkpointing);
        ProfileConfig { train, steps: 1 }
    }

    #[test]
    fn zero_steps_or_a_zero_micro_batch_is_refused_before_any_work() {
        let mut config = tiny(2, 1, Checkpointing::Off);
        config.steps = 0;
        let error = record_run(&config).unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid steps: 0 (must be in 1..=100: every step's timeline is kept)"
        );
        config.steps = MAX_PROFILE_STEPS + 1;
        assert!(record_run(&config).is_err(), "past the bound");
        let config = tiny(0, 1, Checkpointing::Off);
        assert!(matches!(
            compare(&config),
            Err(TrainError::InvalidArgument {
                name: "micro-batch",
                ..
            })
        ));
    }

    #[test]
    fn steady_state_steps_repeat_the_same_memory_pattern() {
        let mut config = tiny(2, 2, Checkpointing::Off);
        config.steps = 2;
        let timeline = record_run(&config).unwrap();
        assert_eq!(timeline.spans.len(), 2 * 6);
        assert_eq!(timeline.losses.len(), 2);
        let pattern = |step: usize| -> Vec<_> {
            let spans = &timeline.spans[6 * step..6 * (step + 1)];
            let events = spans[0].events.start..spans[5].events.end;
            timeline.events[events].to_vec()
        };
        // Same shapes every step, so the same allocations in the same order.
        assert_eq!(pattern(0), pattern(1));
    }

    #[test]
    fn accumulation_peaks_at_one_micro_batch_plus_the_gradients() {
        // Four micro-batches of 2 rows against one: the graph of a micro-batch is gone
        // before the next is built, but from the second micro-batch on, its activations
        // pile up on top of the gradients of the first (133,440 × 4 bytes). With one
        // micro-batch the peak comes before any gradient exists.
        let one = record_run(&tiny(2, 1, Checkpointing::Off)).unwrap();
        let four = record_run(&tiny(2, 4, Checkpointing::Off)).unwrap();
        assert_eq!(four.peak().bytes, one.peak().bytes + 133_440 * 4);
        let forwards = four.spans.iter().filter(|s| s.phase == Phase::Forward);
        assert_eq!(forwards.count(), 4);
        // One micro-batch of 8 rows holds more activations.
        let eight = record_run(&tiny(8, 1, Checkpointing::Off)).unwrap();
        assert!(eight.peak().bytes > one.peak().bytes);
    }
}
