//! [`Session`]: a model, its optimizer and its data, set up as the trainer sets them up,
//! for steps that are recorded phase by phase.

use tl_precision::DynamicLossScaler;
use tl_tensor::optim::AdamW;
use tl_tensor::{Generator, memory};

use crate::data::{Batch, Corpus, sample_batch};
use crate::error::Result;
use crate::model::Llama;
use crate::train::{TrainConfig, load_corpus, mixed_step, new_optimizer, new_scaler};

/// The batch stream's seed, derived from the run's seed so that two sessions of one config
/// see the same batches (any fixed value would do; the trainer uses its own).
const DATA_STREAM: u64 = 0x9F0F_11E5_7A7E_5EED;

/// Fp16 warm-up steps to try before giving up on an untouched optimizer: each skipped step
/// halves the loss scale, so this many skips mean a scale of 2^16 / 2^40.
const MAX_WARM_UP_TRIES: usize = 40;

/// Everything a training step needs, built from a [`TrainConfig`] as the trainer builds it:
/// the seeded model with the config's checkpointing, AdamW with the peak learning rate and
/// the config's weight decay, a loss scaler for fp16, and a seeded batch stream.
pub(super) struct Session {
    pub(super) config: TrainConfig,
    pub(super) model: Llama<f32>,
    pub(super) optimizer: AdamW<f32>,
    pub(super) scaler: Option<DynamicLossScaler>,
    pub(super) corpus: Corpus,
    pub(super) data_rng: Generator,
    /// Live bytes on this thread before the model existed: the zero of the session's figures.
    pub(super) base_live: usize,
}

impl Session {
    /// A session of `config`, which the caller has validated.
    ///
    /// # Errors
    /// [`TrainError::Data`](crate::TrainError::Data) when the data file cannot be used,
    /// [`TrainError::InvalidConfig`](crate::TrainError::InvalidConfig) for a model that
    /// cannot be built, [`TrainError::Tensor`](crate::TrainError::Tensor) for optimizer
    /// arguments AdamW refuses.
    pub(super) fn new(config: &TrainConfig) -> Result<Self> {
        let corpus = load_corpus(config, &crate::train::token_cache_root(None), None)?;
        let base_live = memory::live_bytes();
        let model = Llama::new(&config.model, config.seed)?;
        model.set_checkpointing(config.checkpointing);
        model.set_chunked_loss(config.chunked_loss.resolve(&config.model));
        let optimizer = new_optimizer(&model, config)?;
        Ok(Self {
            scaler: new_scaler(config),
            data_rng: Generator::new(config.seed ^ DATA_STREAM),
            config: config.clone(),
            model,
            optimizer,
            corpus,
            base_live,
        })
    }

    /// The next step's micro-batches: `accum` of `micro_batch` rows each.
    pub(super) fn next_micro_batches(&self) -> Vec<Batch> {
        (0..self.config.accum)
            .map(|_| self.next_batch(self.config.micro_batch))
            .collect()
    }

    fn next_batch(&self, rows: usize) -> Batch {
        let context = self.config.model.context;
        sample_batch(&self.corpus.train, rows, context, &self.data_rng)
    }

    /// Takes optimizer steps on one-row batches until one is not skipped, so that AdamW's
    /// moments exist and the recorded steps show the steady state rather than the first
    /// step's one-off allocation of the moments. A one-row batch is enough: the moments
    /// have the parameters' shapes whatever the batch.
    ///
    /// # Errors
    /// Those of [`train_step_mixed`], as [`TrainError::Precision`](crate::TrainError).
    pub(super) fn warm_up(&mut self) -> Result<()> {
        for _ in 0..MAX_WARM_UP_TRIES {
            let batch = [self.next_batch(1)];
            let report = mixed_step(
                &self.model,
                &batch,
                &mut self.optimizer,
                self.scaler.as_mut(),
                &self.config,
            )?;
            if !report.skipped {
                break;
            }
        }
        Ok(())
    }

    /// Live bytes of the session now, above [`Session::base_live`].
    pub(super) fn live(&self) -> u64 {
        memory::live_bytes().saturating_sub(self.base_live) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_of_one_config_see_the_same_batches() {
        let (a, b) = (
            Session::new(&TrainConfig::tiny_for_tests()).unwrap(),
            Session::new(&TrainConfig::tiny_for_tests()).unwrap(),
        );
        let batches = a.next_micro_batches();
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].rows, 2);
        assert_eq!(batches, b.next_micro_batches());
        assert_ne!(batches, a.next_micro_batches());
    }

    #[test]
    fn warming_up_leaves_the_weights_and_both_adamw_moments_live() {
        let mut session = Session::new(&TrainConfig::tiny_for_tests()).unwrap();
        // The tiny model's 133,440 f32 weights, plus its rotary tables.
        let weights = 133_440 * 4;
        let before = session.live();
        assert!(before >= weights, "{before}");
        session.warm_up().unwrap();
        // After a step: weights, gradients and two moments, 16 bytes a parameter.
        assert_eq!(session.live() - before, 3 * weights);
    }
}
