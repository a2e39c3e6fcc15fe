//! [`Llama`]: the decoder-only model of the capstone.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use tl_parallel::{GradElement, TensorParallel, VocabParallelEmbedding};
use tl_precision::round_for_products;
use tl_recompute::{KeepPolicy, checkpoint_schedule, checkpoint_sequential_with, keeping};
use tl_tensor::losses::cross_entropy;
use tl_tensor::nn::{Embedding, Linear, Module, RmsNorm};
use tl_tensor::{Element, Generator, Tensor, memory, no_grad};

use super::block::Block;
use super::causal_attention::ATTENTION;
use super::config::ModelConfig;
use super::fp8::LAYER_NAMES;
use super::parallel::{BatchShape, Placement, TensorSplit, placement};
use super::roles;
use super::rope::Rope;
use crate::error::Result;

/// How the blocks keep their activations for backward: where the checkpointed segments are,
/// and what each keeps besides its input (its keep policy).
///
/// Every checkpointed block keeps the fused attention's result (`N·d` values that spare the
/// rerun the attention's forward pass, as torchtitan's selective checkpointing keeps it);
/// [`Matmuls`](Checkpointing::Matmuls) and [`FirstMatmul`](Checkpointing::FirstMatmul) keep
/// projections' outputs too, so the rerun does not multiply them again. The model names its
/// results and this enum only chooses names ([`Checkpointing::keep_policy`]): no policy is a
/// case in the model's code.
///
/// In JSON and TOML (a run's `config.json`, checkpoints, the plan's and profile's JSON) it
/// is `"off"`, `"per-block"`, `"matmuls"`, `"first-matmul"` or `{"budget": K}`; the names of
/// earlier builds (`"Off"`, `"PerBlock"`, `{"Budget": K}`) still read, so older run
/// directories resume. Its [`Display`](std::fmt::Display) is the words `tinyllm` prints.
///
/// ```
/// use tl_train::model::Checkpointing;
/// assert_eq!(serde_json::to_string(&Checkpointing::PerBlock)?, r#""per-block""#);
/// assert_eq!(serde_json::from_str::<Checkpointing>(r#"{"Budget":3}"#)?, Checkpointing::Budget(3));
/// assert_eq!(Checkpointing::Budget(3).to_string(), "optimal schedule for 3 stored block inputs");
/// assert!(Checkpointing::FirstMatmul.keep_policy().keeps("wq"));
/// assert!(!Checkpointing::PerBlock.keep_policy().keeps("wq"));
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Checkpointing {
    /// Every block keeps everything its backward needs (fastest, most memory).
    #[serde(alias = "Off")]
    Off,
    /// Each block keeps its input (and the attention's result) and reruns its forward pass
    /// during backward, as `torch.utils.checkpoint` around each block.
    #[serde(alias = "PerBlock")]
    PerBlock,
    /// Per block, keeping the output of every product (the seven projections and the
    /// attention): the rerun recomputes only norms, rotations and the SwiGLU gate, as JAX's
    /// `dots_saveable` policy.
    Matmuls,
    /// Per block, keeping the first projection's output (`x·Wq`) and the attention's.
    FirstMatmul,
    /// tl-recompute's optimal schedule for a budget of this many stored block inputs, each
    /// segment keeping what [`PerBlock`](Checkpointing::PerBlock) keeps.
    #[serde(alias = "Budget")]
    Budget(usize),
}

impl Checkpointing {
    /// The four policies of `--checkpoint-policy`, in the order of the bytes they keep
    /// between forward and backward, most first: `none`, `matmuls`, `first-matmul`, `block`.
    pub const POLICIES: [Checkpointing; 4] = [
        Checkpointing::Off,
        Checkpointing::Matmuls,
        Checkpointing::FirstMatmul,
        Checkpointing::PerBlock,
    ];

    /// What each checkpointed segment keeps for its rerun: names of the model's results (the
    /// attention's [`ATTENTION`] and the projections'
    /// [`LAYER_NAMES`]). Empty when nothing is checkpointed.
    pub fn keep_policy(self) -> KeepPolicy {
        match self {
            Checkpointing::Off => KeepPolicy::nothing(),
            Checkpointing::PerBlock | Checkpointing::Budget(_) => KeepPolicy::only([ATTENTION]),
            Checkpointing::Matmuls => {
                KeepPolicy::only(std::iter::once(ATTENTION).chain(LAYER_NAMES))
            }
            Checkpointing::FirstMatmul => KeepPolicy::only([ATTENTION, LAYER_NAMES[0]]),
        }
    }

    /// The policy's name for `--checkpoint-policy`, if it is one of [`Checkpointing::POLICIES`].
    pub fn policy_name(self) -> Option<&'static str> {
        match self {
            Checkpointing::Off => Some("none"),
            Checkpointing::PerBlock => Some("block"),
            Checkpointing::Matmuls => Some("matmuls"),
            Checkpointing::FirstMatmul => Some("first-matmul"),
            Checkpointing::Budget(_) => None,
        }
    }

    /// The starts of the checkpointed segments of `n` blocks (`None` without checkpointing).
    ///
    /// # Errors
    /// [`TrainError::Recompute`](crate::TrainError::Recompute) when a budget admits no
    /// schedule.
    pub fn schedule(self, n: usize) -> Result<Option<Vec<usize>>> {
        Ok(match self {
            Checkpointing::Off => None,
            Checkpointing::PerBlock | Checkpointing::Matmuls | Checkpointing::FirstMatmul => {
                Some((0..n).collect())
            }
            Checkpointing::Budget(budget) => Some(checkpoint_schedule(n, budget)?),
        })
    }
}

impl std::fmt::Display for Checkpointing {
    /// `off`, `per block`, `per block, keeping every product`, `per block, keeping the first
    /// product`, or `optimal schedule for K stored block inputs`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Checkpointing::Off => f.write_str("off"),
            Checkpointing::PerBlock => f.write_str("per block"),
            Checkpointing::Matmuls => f.write_str("per block, keeping every product"),
            Checkpointing::FirstMatmul => f.write_str("per block, keeping the first product"),
            Checkpointing::Budget(1) => f.write_str("optimal schedule for 1 stored block input"),
            Checkpointing::Budget(k) => write!(f, "optimal schedule for {k} stored block inputs"),
        }
    }
}

/// What runs each of the model's units (see [`Llama::units`]) when one is set with
/// [`Llama::set_unit_hook`]: called with the unit's index and its forward, it returns the
/// forward's output. ZeRO-3 gathers the unit's parameters around it.
pub type UnitHook<E> = Rc<dyn Fn(usize, &dyn Fn() -> Tensor<E>) -> Tensor<E>>;

/// A Llama-style decoder: token embedding, `n_layers` pre-norm [`Block`]s, a final RMSNorm
/// and a linear head to the vocabulary: a weight of its own, or the embedding's table
/// (`logits = x·Eᵀ`) when the config ties them.
///
/// Weights are initialised as PyTorch initialises `llama_ref.py` (embedding N(0, 1), linear
/// layers U(±1/√in), gains 1), drawn from one generator seeded by `seed`: same seed, same
/// model. Linear weights are stored `[in, out]` (PyTorch stores `[out, in]`).
///
/// ```
/// use tl_train::model::{Llama, Preset};
/// let model = Llama::<f32>::new(&Preset::Tiny.config(), 0)?;
/// let logits = model.forward_ids(&[104, 105], 1, 2)?;
/// assert_eq!(logits.shape(), vec![1, 2, 256]);
/// # Ok::<(), tl_train::TrainError>(())
/// ```
pub struct Llama<E: GradElement = f32> {
    config: ModelConfig,
    /// The embedding: `None` in a pipeline part without the first stage.
    embedding: Option<TokenEmbedding<E>>,
    /// The blocks held, with their index in the whole model: all of them, or a pipeline
    /// part's.
    blocks: Vec<(usize, Rc<Block<E>>)>,
    /// The final norm and the head: `None` in a pipeline part without the last stage.
    top: Option<Top<E>>,
    /// The pipeline stages this model holds, when it is a part of the whole (see
    /// [`pipeline_part`](Self::pipeline_part)).
    stages: Option<Rc<[Stage]>>,
    /// The tensor-parallel group the layers are split over, if any.
    split: Option<Rc<TensorSplit>>,
    dropout_rng: Generator,
    checkpointing: Cell<Checkpointing>,
    /// Whether the loss recomputes the head's logits in backward instead of keeping them
    /// (see [`head_loss`](super::head_loss)).
    chunked_loss: Cell<bool>,
    unit_hook: RefCell<Option<UnitHook<E>>>,
}

/// The final norm and the head.
struct Top<E: GradElement> {
    norm: RmsNorm<E>,
    /// `[d, V]`, or this rank's `[d, V/t]` columns under tensor parallelism; `None` when the
    /// head is tied to the embedding, whose `[V, d]` table (or this rank's `[V/t, d]` rows)
    /// it multiplies by transposed.
    head: Option<Linear<E>>,
}

/// One pipeline stage a part of the model holds: its index among all the stages, and the
/// blocks it runs (indices in the whole model).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    /// Its index, from 0 (which holds the embedding).
    pub index: usize,
    /// Its blocks.
    pub blocks: std::ops::Range<usize>,
    /// Whether it is the last stage (which holds the final norm, the head and the loss).
    pub last: bool,
}

/// The token embedding: the whole table, or this rank's rows of it.
enum TokenEmbedding<E: GradElement> {
    Whole(Embedding<E>),
    Split(VocabParallelEmbedding<E>),
}

impl<E: GradElement> TokenEmbedding<E> {
    fn weight(&self) -> &Tensor<E> {
        match self {
            TokenEmbedding::Whole(embedding) => embedding.weight(),
            TokenEmbedding::Split(embedding) => embedding.weight(),
        }
    }
}

/// A block as one unit of the model: its forward goes through the unit hook, if any.
/// The blocks are checkpointed in this form, so a checkpointed block's rerun goes through
/// the hook too. It carries the batch's shape, which a sequence-parallel block's rows do not say, into a
/// checkpoint's rerun.
struct UnitBlock<E: GradElement> {
    unit: usize,
    block: Rc<Block<E>>,
    hook: Option<UnitHook<E>>,
    batch: BatchShape,
}

impl<E: GradElement> Clone for UnitBlock<E> {
    fn clone(&self) -> Self {
        Self {
            unit: self.unit,
            block: Rc::clone(&self.block),
            hook: self.hook.clone(),
            batch: self.batch,
        }
    }
}

impl<E: GradElement> Module<E> for UnitBlock<E> {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let forward = || self.block.forward_batch(x, self.batch);
        run_unit(self.hook.as_ref(), self.unit, &forward)
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        self.block.parameters()
    }

    fn set_training(&self, training: bool) {
        self.block.set_training(training);
    }
}

/// The table of a tied embedding and head, `[V, d]`, drawn as an untied head's weight is,
/// uniformly from `±1/√d` (row-major): the head's logits start as small as an untied
/// head's. A standard normal table, `nn.Embedding`'s, would start them `√(3d)` times
/// larger: a tiny model's first loss would be about 64 nats instead of `ln V`.
fn tied_table<E: Element>(vocab: usize, d: usize, rng: &Generator) -> Embedding<E> {
    let bound = 1.0 / (d as f64).sqrt();
    let shape = [vocab, d];
    let table = || {
        tl_tensor::ndarray::ArrayD::from_shape_simple_fn(tl_tensor::ndarray::IxDyn(&shape), || {
            E::from_f64((2.0 * rng.next_f64() - 1.0) * bound)
        })
    };
    Embedding::from_weight(Tensor::param_with(&shape, table))
}

/// `forward()` through `hook` as unit `unit`, or plainly without one.
fn run_unit<E: Element>(
    hook: Option<&UnitHook<E>>,
    unit: usize,
    forward: &dyn Fn() -> Tensor<E>,
) -> Tensor<E> {
    // What the unit makes is its own on the memory meter (its parameters are, see `new`).
    let _owner = memory::owner_scope(Some(unit));
    match hook {
        Some(hook) => hook(unit, forward),
        None => forward(),
    }
}

impl<E: GradElement> Llama<E> {
    /// A freshly initialised model.
    ///
    /// # Errors
    /// [`TrainError::InvalidConfig`](crate::TrainError::InvalidConfig) if the sizes do not
    /// fit together.
    pub fn new(config: &ModelConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let rng = Generator::new(seed);
        // Dropout draws from its own stream, so turning dropout on leaves the weights alone.
        let dropout_rng = Generator::new(seed ^ 0x9E37_79B9_7F4A_7C15);
        let rope = Rc::new(Rope::new(
            config.head_dim(),
            config.context,
            config.rope_base,
        ));
        // Each unit's parameters are owned by it on the memory meter (see `units`).
        let embedding = {
            let _owner = memory::owner_scope(Some(0));
            TokenEmbedding::Whole(match config.tie_embeddings {
                false => Embedding::new(config.vocab, config.d_model, &rng),
                true => tied_table(config.vocab, config.d_model, &rng),
            })
        };
        let blocks = (0..config.n_layers)
            .map(|i| {
                let _owner = memory::owner_scope(Some(i + 1));
                let block = Block::new(config, Rc::clone(&rope), &rng, &dropout_rng);
                (i, Rc::new(block))
            })
            .collect();
        let _owner = memory::owner_scope(Some(config.n_layers + 1));
        Ok(Self {
            config: config.clone(),
            embedding: Some(embedding),
            blocks,
            top: Some(Top {
                norm: RmsNorm::new(config.d_model, config.norm_eps),
                head: (!config.tie_embeddings)
                    .then(|| Linear::new(config.d_model, config.vocab, false, &rng)),
            }),
            stages: None,
            split: None,
            dropout_rng,
            checkpointing: Cell::new(Checkpointing::Off),
            chunked_loss: Cell::new(false),
            unit_hook: RefCell::new(None),
        })
    }

    /// This rank's part of the whole model `self` split over the tensor-parallel group
    /// `tp` (Megatron's layout, see [`parallel`](super::parallel)): each block's heads and
    /// hidden units, the embedding's rows and the head's columns of the vocabulary; the
    /// norms whole. Every rank of the group cuts its part from the same whole model (the
    /// same seed), so the parts are the whole model's weights, and the group computes what
    /// the whole model computes. Checkpointing, the unit hook and fp8 are set on the part as
    /// on a whole model; dropout draws from the whole model's stream.
    ///
    /// # Errors
    /// [`TrainError::InvalidConfig`](crate::TrainError::InvalidConfig) naming the size and
    /// `t` when `t` does not divide the heads, the hidden size or the vocabulary.
    pub fn tensor_parallel(&self, tp: TensorParallel) -> Result<Self> {
        self.tensor_parallel_with(tp, false)
    }

    /// [`tensor_parallel`](Self::tensor_parallel), with the residual stream split over the
    /// group too when `sequence_parallel` (Korthikanti et al.'s sequence parallelism, see
    /// [`parallel`](super::parallel)): outside the split layers each rank holds its rows
    /// of the batch's flattened tokens, `[B·T/t, d]`, and runs the norms, dropout and
    /// residual adds on them; every pass's `B·T` must then be divisible by `t`
    /// ([`loss`](Self::loss) and [`forward_ids`](Self::forward_ids) refuse one that is not,
    /// before any collective). The norms' gains are trained on each rank's rows, so their
    /// gradients must be summed over the group before each update
    /// ([`sequence_parallel_parameters`](Self::sequence_parallel_parameters)). Dropout
    /// draws the whole model's masks on every rank and applies its rows of them.
    ///
    /// # Errors
    /// As [`tensor_parallel`](Self::tensor_parallel).
    pub fn tensor_parallel_with(
        &self,
        tp: TensorParallel,
        sequence_parallel: bool,
    ) -> Result<Self> {
        assert!(
            self.split.is_none() && self.stages.is_none(),
            "Llama::tensor_parallel: already split (tensor-parallel split first, then the pipeline)"
        );
        let split = Rc::new(TensorSplit::with_sequence_parallel(tp, sequence_parallel));
        let config = &self.config;
        split.part("n_heads", config.n_heads)?;
        split.part("hidden", config.hidden)?;
        split.part("vocab", config.vocab)?;
        let embedding =
            VocabParallelEmbedding::from_full(self.embedding().weight(), split.group())?
                .with_sequence_parallel(sequence_parallel);
        let blocks = (self.blocks.iter())
            .map(|(i, block)| Ok((*i, Rc::new(block.split(&split)?))))
            .collect::<Result<_>>()?;
        let top = self.top();
        let head = (top.head.as_ref())
            .map(|head| split.slice("vocab", head.weight(), placement("head.weight")))
            .transpose()?;
        Ok(Self {
            config: config.clone(),
            embedding: Some(TokenEmbedding::Split(embedding)),
            blocks,
            top: Some(Top {
                norm: RmsNorm::from_weight(top.norm.weight().clone(), top.norm.eps()),
                head: head.map(|head| Linear::from_parts(head, None)),
            }),
            stages: None,
            split: Some(split),
            dropout_rng: self.dropout_rng.clone(),
            checkpointing: Cell::new(self.checkpointing.get()),
            chunked_loss: Cell::new(self.chunked_loss.get()),
            unit_hook: RefCell::new(None),
        })
    }

    /// This rank's part of the model for pipeline parallelism: the blocks of `stages`, with
    /// the embedding if it holds stage 0 and the final norm and head if it holds the last;
    /// the rest is dropped. Names, units and fp8 layers keep their whole-model indices
    /// (`blocks.5.wq.weight` is block 5's on whichever rank holds it), so a checkpoint does
    /// not depend on the split. Run it stage by stage with
    /// [`stage_forward`](Self::stage_forward); the whole model's passes
    /// ([`loss`](Self::loss), [`forward_ids`](Self::forward_ids)) need the whole model.
    ///
    /// # Panics
    /// If `stages` is empty, is not in order, or names blocks outside the model.
    pub fn into_pipeline_part(mut self, stages: Vec<Stage>) -> Self {
        assert!(
            !stages.is_empty()
                && stages
                    .windows(2)
                    .all(|w| w[0].blocks.end <= w[1].blocks.start),
            "Llama::into_pipeline_part: stages must be given in order: {stages:?}"
        );
        assert!(
            stages.iter().all(|s| s.blocks.end <= self.config.n_layers),
            "Llama::into_pipeline_part: {stages:?} names blocks past {}",
            self.config.n_layers
        );
        assert!(
            !self.config.tie_embeddings
                || (stages[0].index == 0 && stages.last().is_some_and(|s| s.last)),
            "Llama::into_pipeline_part: a tied head needs the embedding in the same part \
             (stage 0 and the last stage together), got {stages:?}"
        );
        if stages[0].index != 0 {
            self.embedding = None;
        }
        if !stages.last().is_some_and(|s| s.last) {
            self.top = None;
        }
        self.blocks
            .retain(|(i, _)| stages.iter().any(|s| s.blocks.contains(i)));
        self.stages = Some(stages.into());
        self
    }

    /// The pipeline stages this part holds (`None` for a whole model).
    pub fn stages(&self) -> Option<&[Stage]> {
        self.stages.as_deref()
    }

    /// Stage `stage`'s forward pass on a batch of `rows × time` tokens: from the tokens
    /// `inputs` on stage 0, from `input` (the residual stream the stage before sent) on the
    /// others. Returns the residual stream it hands on, or on the last stage the mean
    /// cross-entropy against `targets`, as [`loss`](Self::loss) computes it: the stages run
    /// in turn compute the whole model's loss, to the bit.
    ///
    /// With dropout, every stage expects the dropout stream where the whole model's pass
    /// would start it (the caller sets it to the micro-batch's state before each stage), and
    /// skips the draws of the blocks before the stage: each block draws the masks it draws
    /// in the whole model, whichever part holds it and in whatever order the stages run.
    ///
    /// # Errors
    /// As [`loss`](Self::loss).
    ///
    /// # Panics
    /// If this part does not hold `stage`, or `input` is missing past stage 0.
    pub fn stage_forward(
        &self,
        stage: usize,
        input: Option<&Tensor<E>>,
        (inputs, targets): (&[usize], &[usize]),
        rows: usize,
        time: usize,
    ) -> Result<Tensor<E>> {
        let held = (self.stages())
            .and_then(|stages| stages.iter().find(|s| s.index == stage))
            .unwrap_or_else(|| panic!("Llama::stage_forward: stage {stage} is not held here"));
        let hook = self.unit_hook.borrow().clone();
        let hook = hook.as_ref();
        let x = match input {
            _ if stage == 0 => self.embed(inputs, rows, time, hook)?,
            Some(input) => input.clone(),
            None => panic!("Llama::stage_forward: stage {stage} needs its input"),
        };
        let first = (self.blocks.iter()).position(|(i, _)| held.blocks.contains(i));
        let positions = first.map_or(0..0, |first| first..first + held.blocks.len());
        let batch = [rows, time];
        if let Some(first) = first {
            // The masks the whole model's pass draws for these blocks: from where it starts
            // (the stream is set there for every stage), past its earlier blocks' masks.
            for _ in 0..held.blocks.start {
                self.blocks[first].1.skip_dropout(batch);
            }
        }
        let x = self.run_blocks(&x, batch, hook, positions)?;
        if !held.last {
            return Ok(x);
        }
        self.head_loss(&x, batch, hook, targets)
    }

    /// The tensor-parallel group the model is split over, if it is.
    pub fn tensor_split(&self) -> Option<&TensorSplit> {
        self.split.as_deref()
    }

    /// The parameters whose gradient on this rank is its share of the whole model's, to be
    /// summed over the tensor-parallel group before the update (with
    /// `TensorParallel::all_reduce_gradients`, or by the trainer's step): under sequence
    /// parallelism the replicated ones, the norms' gains, which each rank trains on its
    /// rows of the tokens; none otherwise.
    pub fn sequence_parallel_parameters(&self) -> Vec<Tensor<E>> {
        if !self.split.as_ref().is_some_and(|s| s.sequence_parallel()) {
            return Vec::new();
        }
        self.named_parameters()
            .into_iter()
            .filter(|(name, _)| placement(name) == Placement::Replicated)
            .map(|(_, tensor)| tensor)
            .collect()
    }

    /// The sizes of this model.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The generator dropout draws from: save its state to resume a run exactly.
    pub fn dropout_generator(&self) -> &Generator {
        &self.dropout_rng
    }

    /// Trains the blocks' projections in fp8 with `state`'s delayed scales (7 layers per
    /// block, see [`fp8`](super::fp8)), or plainly again with `None`.
    ///
    /// # Errors
    /// [`TrainError::Precision`](crate::TrainError::Precision) when `state` has not one
    /// valid layer per projection.
    pub fn set_fp8(&self, state: Option<Rc<RefCell<tl_precision::Fp8State>>>) -> Result<()> {
        if let Some(state) = &state {
            state.borrow().check(self.fp8_layer_names().len())?;
        }
        for (i, block) in &self.blocks {
            let i = *i;
            block.set_fp8(
                state
                    .as_ref()
                    .map(|s| (s, super::fp8::LAYERS_PER_BLOCK * i)),
            );
        }
        Ok(())
    }

    /// The names of the fp8 layers, in layer order: `blocks.{i}.wq`, ... `blocks.{i}.w2`.
    pub fn fp8_layer_names(&self) -> Vec<String> {
        (0..self.config.n_layers)
            .flat_map(|i| super::fp8::LAYER_NAMES.map(|name| format!("blocks.{i}.{name}")))
            .collect()
    }

    /// Chooses how the blocks keep activations from the next forward pass on.
    pub fn set_checkpointing(&self, checkpointing: Checkpointing) {
        self.checkpointing.set(checkpointing);
    }

    /// Chooses, from the next forward pass on, whether the loss recomputes the head's
    /// logits in backward block by block (`true`) or keeps them (`false`, the default). The
    /// two give the same bits (see [`head_loss`](super::head_loss)). Under tensor
    /// parallelism the loss is the vocabulary-parallel cross-entropy, which keeps its
    /// columns of the logits either way.
    pub fn set_chunked_loss(&self, chunked: bool) {
        self.chunked_loss.set(chunked);
    }

    /// Whether the loss recomputes the head's logits in backward.
    pub fn chunked_loss(&self) -> bool {
        self.chunked_loss.get()
    }

    /// How the blocks keep activations.
    pub fn checkpointing(&self) -> Checkpointing {
        self.checkpointing.get()
    }

    /// The parameters grouped as the forward pass uses them, one group a *unit*: the
    /// embedding, each block, then the final norm with the head. Concatenated they are
    /// [`Module::parameters`], in order.
    pub fn units(&self) -> Vec<Vec<Tensor<E>>> {
        let mut units = Vec::new();
        units.extend((self.embedding.iter()).map(|embedding| vec![embedding.weight().clone()]));
        units.extend(self.blocks.iter().map(|(_, block)| block.parameters()));
        units.extend((self.top.iter()).map(|top| {
            std::iter::once(top.norm.weight().clone())
                .chain(top.head.iter().map(|head| head.weight().clone()))
                .collect()
        }));
        units
    }

    /// The whole model's index of each of [`units`](Self::units), which the unit hook is
    /// called with: the embedding 0, block `i` `i + 1`, the final norm with the head
    /// `n_layers + 1`. A whole model's are `0..n_layers + 2`; a pipeline part's are those of
    /// the units it holds.
    pub fn unit_indices(&self) -> Vec<usize> {
        let mut indices = Vec::new();
        indices.extend(self.embedding.iter().map(|_| 0));
        indices.extend(self.blocks.iter().map(|(i, _)| i + 1));
        indices.extend(self.top.iter().map(|_| self.head_unit()));
        indices
    }

    /// Runs every unit of the following forward passes (and of checkpointed blocks'
    /// reruns) through `hook`, or plainly with `None`.
    pub fn set_unit_hook(&self, hook: Option<UnitHook<E>>) {
        *self.unit_hook.borrow_mut() = hook;
    }

    /// Logits `[rows, time, vocab]` for token ids laid out row-major as `[rows, time]`.
    ///
    /// # Errors
    /// [`TrainError::Recompute`](crate::TrainError::Recompute) when a checkpointing budget
    /// admits no schedule; [`TrainError::InvalidArgument`](crate::TrainError::InvalidArgument)
    /// under sequence parallelism when `t` does not divide `rows · time` (before any
    /// collective).
    ///
    /// # Panics
    /// If `ids.len() != rows · time`, `time` exceeds the context, or an id is not below the
    /// vocabulary size.
    pub fn forward_ids(&self, ids: &[usize], rows: usize, time: usize) -> Result<Tensor<E>> {
        let logits = self.local_logits(ids, rows, time)?;
        Ok(match &self.split {
            Some(split) => split.gather_columns(&logits),
            None => logits,
        })
    }

    /// The logits this rank computes, `[rows, time, ..]`: all of them, or its columns of
    /// the vocabulary under tensor parallelism.
    fn local_logits(&self, ids: &[usize], rows: usize, time: usize) -> Result<Tensor<E>> {
        let hook = self.unit_hook.borrow().clone();
        let hook = hook.as_ref();
        let x = self.embed(ids, rows, time, hook)?;
        let batch = [rows, time];
        let x = self.run_blocks(&x, batch, hook, 0..self.blocks.len())?;
        Ok(self.logits(&x, batch, hook))
    }

    /// The embedding unit: the tokens' vectors, as the residual stream holds them (the
    /// batch `[rows, time, d]`, or this rank's rows of its tokens under sequence
    /// parallelism).
    fn embed(
        &self,
        ids: &[usize],
        rows: usize,
        time: usize,
        hook: Option<&UnitHook<E>>,
    ) -> Result<Tensor<E>> {
        assert!(
            time <= self.config.context,
            "Llama: {time} positions exceed the context of {}",
            self.config.context
        );
        let stream_shape = self.stream_shape(rows, time)?;
        let sequence_parallel = self.split.as_ref().filter(|s| s.sequence_parallel());
        Ok(run_unit(hook, 0, &|| {
            let _label = memory::label_scope(roles::EMBEDDING);
            match (self.embedding(), &self.split) {
                (TokenEmbedding::Whole(embedding), _) => embedding.forward_ids(ids, &[rows, time]),
                (TokenEmbedding::Split(embedding), Some(split)) => {
                    // Under sequence parallelism the lookups of the flattened tokens,
                    // reduce-scattered into the rank's rows.
                    let batch_shape = match sequence_parallel {
                        Some(_) => vec![rows * time],
                        None => vec![rows, time],
                    };
                    split.kept(embedding.forward_ids(ids, &batch_shape), &stream_shape)
                }
                (TokenEmbedding::Split(_), None) => unreachable!("a split embedding has a group"),
            }
        }))
    }

    /// The residual stream's shape for a batch of `rows × time` tokens: the batch, or this
    /// rank's rows of its tokens under sequence parallelism.
    ///
    /// # Errors
    /// Under sequence parallelism, when the group does not divide the batch's tokens.
    pub fn stream_shape(&self, rows: usize, time: usize) -> Result<Vec<usize>> {
        Ok(
            match self.split.as_ref().filter(|s| s.sequence_parallel()) {
                Some(split) => {
                    let mine = split.token_rows(rows, time)?;
                    vec![mine.len(), self.config.d_model]
                }
                None => vec![rows, time, self.config.d_model],
            },
        )
    }

    /// The head unit: the final norm and the head's logits (this rank's columns under
    /// tensor parallelism).
    fn logits(&self, x: &Tensor<E>, batch: BatchShape, hook: Option<&UnitHook<E>>) -> Tensor<E> {
        let top = self.top();
        run_unit(hook, self.head_unit(), &|| {
            let normed = self.final_norm(x, batch);
            let _label = memory::label_scope(roles::LOGITS);
            match &top.head {
                Some(head) => head.forward(&normed),
                // Tied: the embedding's rows are the head's columns.
                None => normed.matmul(&self.embedding().weight().transpose(0, 1)),
            }
        })
    }

    /// The final norm of the residual stream `x`, as the head reads it (under tensor
    /// parallelism, entered into the group's batch).
    fn final_norm(&self, x: &Tensor<E>, batch: BatchShape) -> Tensor<E> {
        let normed = {
            let _label = memory::label_scope(roles::NORM);
            round_for_products(|finish| self.top().norm.forward_then(x, finish))
        };
        match &self.split {
            Some(split) => split.enter_batch(&normed, batch),
            None => normed,
        }
    }

    /// The mean cross-entropy of the head's logits of `x` (the last block's output) against
    /// `targets`: the head unit with the loss in it, one fused op
    /// ([`head_loss`](super::head_loss::head_loss)) for a whole model; the head's columns and
    /// the vocabulary-parallel cross-entropy under tensor parallelism.
    fn head_loss(
        &self,
        x: &Tensor<E>,
        batch: BatchShape,
        hook: Option<&UnitHook<E>>,
        targets: &[usize],
    ) -> Result<Tensor<E>> {
        let [rows, time] = batch;
        if self.split.is_some() {
            let logits = self.logits(x, batch, hook);
            return self.cross_entropy_of(&logits, targets, rows, time);
        }
        let top = self.top();
        Ok(run_unit(hook, self.head_unit(), &|| {
            let normed = self.final_norm(x, batch);
            let (head, tied) = match &top.head {
                Some(head) => (head.weight(), false),
                None => (self.embedding().weight(), true),
            };
            super::head_loss::head_loss(&normed, head, tied, targets, self.chunked_loss.get())
        }))
    }

    /// The mean cross-entropy of `logits` (`[rows, time, ..]`, this rank's columns under
    /// tensor parallelism) against `targets`.
    fn cross_entropy_of(
        &self,
        logits: &Tensor<E>,
        targets: &[usize],
        rows: usize,
        time: usize,
    ) -> Result<Tensor<E>> {
        // The loss belongs with the head on the memory meter, outside its unit.
        let _owner = memory::owner_scope(Some(self.head_unit()));
        let columns = *logits.shape().last().expect("logits have a class axis");
        let flat = {
            let _label = memory::label_scope(roles::LOGITS);
            logits.reshape(&[rows * time, columns])
        };
        let _label = memory::label_scope(roles::LOSS);
        let Some(split) = &self.split else {
            return Ok(cross_entropy(&flat, targets));
        };
        let loss = split.cross_entropy(&flat, targets);
        // A collective of this forward pass that failed: its error, not a NaN loss.
        match split.take_error() {
            Some(error) => Err(error.into()),
            None => Ok(loss),
        }
    }

    /// The embedding, which a whole model (and a pipeline part with the first stage) has.
    fn embedding(&self) -> &TokenEmbedding<E> {
        self.embedding
            .as_ref()
            .expect("Llama: this pipeline part does not hold the embedding (stage 0)")
    }

    /// The final norm and head, which a whole model (and a pipeline part with the last
    /// stage) has.
    fn top(&self) -> &Top<E> {
        self.top
            .as_ref()
            .expect("Llama: this pipeline part does not hold the head (the last stage)")
    }

    /// The mean cross-entropy (nats per token) of predicting `targets` from `inputs`, both
    /// `[rows, time]` row-major.
    ///
    /// # Errors
    /// As [`Llama::forward_ids`].
    pub fn loss(
        &self,
        inputs: &[usize],
        targets: &[usize],
        rows: usize,
        time: usize,
    ) -> Result<Tensor<E>> {
        let hook = self.unit_hook.borrow().clone();
        let hook = hook.as_ref();
        let x = self.embed(inputs, rows, time, hook)?;
        let batch = [rows, time];
        let x = self.run_blocks(&x, batch, hook, 0..self.blocks.len())?;
        self.head_loss(&x, batch, hook, targets)
    }

    /// The last unit's index: the final norm and the head.
    fn head_unit(&self) -> usize {
        self.config.n_layers + 1
    }

    /// Runs the held blocks `range` (positions in `self.blocks`) on `x`, checkpointed as
    /// the model's policy says, over those blocks.
    fn run_blocks(
        &self,
        x: &Tensor<E>,
        batch: BatchShape,
        hook: Option<&UnitHook<E>>,
        range: std::ops::Range<usize>,
    ) -> Result<Tensor<E>> {
        let rngs = [self.dropout_rng.clone()];
        let blocks: Vec<UnitBlock<E>> = (self.blocks[range].iter())
            .map(|(i, block)| UnitBlock {
                unit: i + 1,
                block: Rc::clone(block),
                hook: hook.cloned(),
                batch,
            })
            .collect();
        let checkpointing = self.checkpointing.get();
        Ok(match checkpointing.schedule(blocks.len())? {
            None => blocks.iter().fold(x.clone(), |h, block| block.forward(&h)),
            Some(schedule) => {
                let _policy = keeping(checkpointing.keep_policy());
                checkpoint_sequential_with(&blocks, x, &schedule, &rngs, false)?
            }
        })
    }

    /// Every parameter with its name, in [`Module::parameters`] order: `emb.weight`,
    /// `blocks.{i}.{n1.w, wq.weight, ..}`, `norm.w`, `head.weight` (the names of
    /// `llama_ref.py`).
    pub fn named_parameters(&self) -> Vec<(String, Tensor<E>)> {
        let mut named = Vec::new();
        if let Some(embedding) = &self.embedding {
            named.push(("emb.weight".to_string(), embedding.weight().clone()));
        }
        for (i, block) in &self.blocks {
            named.extend(
                block
                    .named_parameters()
                    .into_iter()
                    .map(|(name, tensor)| (format!("blocks.{i}.{name}"), tensor)),
            );
        }
        if let Some(top) = &self.top {
            named.push(("norm.w".to_string(), top.norm.weight().clone()));
            if let Some(head) = &top.head {
                named.push(("head.weight".to_string(), head.weight().clone()));
            }
        }
        named
    }

    /// Continues `prompt` by `n_tokens` tokens, each drawn from `softmax(logits / temperature)`
    /// of the last position with `rng` (the most likely token when `temperature` is 0). With
    /// `top_k`, only the `top_k` most likely tokens of each position can be drawn (`Some(1)`
    /// is the most likely token whatever the temperature). The model sees at most its context
    /// of most recent tokens.
    ///
    /// # Panics
    /// If `prompt` is empty, `temperature` is negative or not finite, `top_k` is `Some(0)`,
    /// an id is not below the vocabulary size, or (sequence parallelism) the group does not
    /// divide a window's tokens.
    pub fn generate(
        &self,
        prompt: &[usize],
        n_tokens: usize,
        temperature: f64,
        top_k: Option<usize>,
        rng: &Generator,
    ) -> Vec<usize> {
        assert!(
            !prompt.is_empty(),
            "Llama::generate: the prompt must not be empty"
        );
        assert!(
            temperature.is_finite() && temperature >= 0.0,
            "Llama::generate: temperature must be finite and >= 0, got {temperature}"
        );
        assert!(
            top_k != Some(0),
            "Llama::generate: top_k must be at least 1"
        );
        let _inference = no_grad();
        self.set_training(false);
        let mut tokens = prompt.to_vec();
        for _ in 0..n_tokens {
            let window = &tokens[tokens.len().saturating_sub(self.config.context)..];
            // No graph, so no checkpointing schedule; a sequence-parallel model refuses a
            // window its group cannot split.
            let logits = (self.forward_ids(window, 1, window.len()))
                .unwrap_or_else(|error| panic!("Llama::generate: {error}"));
            let vocab = self.config.vocab;
            let last: Vec<f64> = logits.to_vec()[(window.len() - 1) * vocab..]
                .iter()
                .map(|&v| Element::to_f64(v))
                .collect();
            tokens.push(sample_index(&last, temperature, top_k, rng));
        }
        tokens.split_off(prompt.len())
    }
}

/// An index drawn from `softmax(logits / temperature)`, or the first maximum at temperature 0.
/// With `top_k`, only the indices of the `top_k` largest logits can be drawn (of equal logits,
/// the lower indices count as larger, so `Some(1)` is the first maximum).
fn sample_index(logits: &[f64], temperature: f64, top_k: Option<usize>, rng: &Generator) -> usize {
    let mut candidates: Vec<usize> = (0..logits.len()).collect();
    if let Some(k) = top_k.filter(|&k| k < logits.len()) {
        // A stable sort, largest first: equal logits stay in index order.
        candidates.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        candidates.truncate(k.max(1));
        candidates.sort_unstable();
    }
    let argmax = candidates.iter().copied().fold(candidates[0], |best, i| {
        if logits[i] > logits[best] { i } else { best }
    });
    if temperature == 0.0 {
        return argmax;
    }
    let max = logits[argmax];
    let weights: Vec<f64> = candidates
        .iter()
        .map(|&i| ((logits[i] - max) / temperature).exp())
        .collect();
    let mut u = rng.next_f64() * weights.iter().sum::<f64>();
    for (&i, &w) in candidates.iter().zip(&weights) {
        if u < w {
            return i;
        }
        u -= w;
    }
    argmax
}

impl<E: GradElement> Module<E> for Llama<E> {
    /// Logits `[B, T, vocab]` for a `[B, T]` tensor whose values are token ids (whole
    /// numbers below the vocabulary size); [`Llama::forward_ids`] is the direct form.
    ///
    /// # Panics
    /// As [`Llama::forward_ids`], and if a value is not a whole number, or a checkpointing
    /// budget admits no schedule.
    fn forward(&self, ids: &Tensor<E>) -> Tensor<E> {
        let shape = ids.shape();
        assert_eq!(
            shape.len(),
            2,
            "Llama: expected [batch, time] ids, got {shape:?}"
        );
        let ids: Vec<usize> = ids
            .to_vec()
            .into_iter()
            .map(|v| {
                let id = Element::to_f64(v);
                assert!(
                    id >= 0.0 && id.fract() == 0.0,
                    "Llama: {id} is not a token id"
                );
                id as usize
            })
            .collect();
        self.forward_ids(&ids, shape[0], shape[1])
            .unwrap_or_else(|error| panic!("Llama: {error}"))
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        self.named_parameters()
            .into_iter()
            .map(|(_, tensor)| tensor)
            .collect()
    }

    fn set_training(&self, training: bool) {
        for (_, block) in &self.blocks {
            block.set_training(training);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;
    use tl_tensor::testing::{GradcheckOptions, check_parameter_gradients};

    /// A model small enough to check every weight by finite differences.
    fn micro_config(dropout: f64) -> ModelConfig {
        ModelConfig {
            vocab: 11,
            d_model: 8,
            n_layers: 2,
            n_heads: 2,
            hidden: 12,
            context: 5,
            norm_eps: 1e-5,
            rope_base: 10_000.0,
            dropout,
            n_kv_heads: None,
            tie_embeddings: false,
        }
    }

    const INPUTS: [usize; 8] = [1, 4, 7, 2, 0, 10, 3, 3];
    const TARGETS: [usize; 8] = [4, 7, 2, 9, 10, 3, 3, 5];

    #[test]
    fn every_presets_parameters_add_up_to_its_formula() {
        for preset in Preset::ALL {
            let config = preset.config();
            let model = Llama::<f32>::new(&config, 0).unwrap();
            assert_eq!(model.num_parameters(), config.num_parameters(), "{preset}");
            let names: std::collections::HashSet<String> = model
                .named_parameters()
                .into_iter()
                .map(|(name, _)| name)
                .collect();
            assert_eq!(names.len(), 2 + 9 * config.n_layers + 1, "names are unique");
        }
        // llama_ref.py's tiny: 256·64 + 2·(4·64² + 3·64·176 + 2·64) + 64 + 64·256 = 133,440
        assert_eq!(Preset::Tiny.config().num_parameters(), 133_440);
    }

    #[test]
    fn the_whole_models_gradients_match_finite_differences() {
        let model = Llama::<f64>::new(&micro_config(0.0), 1).unwrap();
        let loss = || model.loss(&INPUTS, &TARGETS, 2, 4).unwrap();
        check_parameter_gradients(loss, &model.parameters(), GradcheckOptions::default()).unwrap();
    }

    /// A tied head is the embedding's table: no `head.weight`, one parameter fewer of
    /// `V·d` scalars, the logits of an untied model with the same weights whose head holds
    /// `Eᵀ`, a first loss near `ln V` (the table is drawn as a head's weight), and
    /// gradients that check with grouped-query attention (one key/value head) besides.
    #[test]
    fn a_tied_head_is_the_embeddings_table() {
        let config = ModelConfig {
            tie_embeddings: true,
            n_kv_heads: Some(1),
            ..micro_config(0.0)
        };
        let tied = Llama::<f64>::new(&config, 3).unwrap();
        let names: Vec<String> = (tied.named_parameters().into_iter())
            .map(|(name, _)| name)
            .collect();
        assert!(!names.iter().any(|name| name == "head.weight"), "{names:?}");
        assert_eq!(tied.num_parameters(), config.num_parameters());
        assert_eq!(
            tied.units().last().map(Vec::len),
            Some(1),
            "the head unit: its norm"
        );

        let untied = Llama::<f64>::new(
            &ModelConfig {
                tie_embeddings: false,
                ..config.clone()
            },
            3,
        )
        .unwrap();
        let table = tied.named_parameters()[0].1.to_array();
        let mut weights = untied.named_parameters();
        let head = weights.pop().unwrap();
        assert_eq!(head.0, "head.weight");
        head.1.update_value(|w| w.assign(&table.t()));
        for ((name, ours), (_, theirs)) in weights.iter().zip(tied.named_parameters()) {
            ours.update_value(|w| w.assign(&*theirs.value()));
            assert_ne!(name, "head.weight");
        }
        assert_eq!(
            tied.forward_ids(&INPUTS, 2, 4).unwrap().to_vec(),
            untied.forward_ids(&INPUTS, 2, 4).unwrap().to_vec()
        );
        let first = tied.loss(&INPUTS, &TARGETS, 2, 4).unwrap().item();
        let ln_v = (config.vocab as f64).ln();
        assert!(
            (first - ln_v).abs() < 1.0,
            "first loss {first}, ln V {ln_v}"
        );
        let loss = || tied.loss(&INPUTS, &TARGETS, 2, 4).unwrap();
        check_parameter_gradients(loss, &tied.parameters(), GradcheckOptions::default()).unwrap();
    }

    /// The loss and every gradient of one backward pass, as bits.
    fn loss_and_gradients(model: &Llama<f32>) -> (u32, Vec<Vec<u32>>) {
        loss_and_gradients_under(model, None, true)
    }

    /// [`loss_and_gradients`] with the forward pass (loss included) under autocast in a format
    /// and an accumulation model, and the backward pass inside the guard or after it has
    /// dropped.
    fn loss_and_gradients_under(
        model: &Llama<f32>,
        autocast: Option<(tl_precision::Format, tl_precision::Accumulation)>,
        backward_inside: bool,
    ) -> (u32, Vec<Vec<u32>>) {
        model.zero_grad();
        let guard = autocast.map(|(format, model)| tl_precision::autocast_with(format, model));
        let loss = model.loss(&INPUTS, &TARGETS, 2, 4).unwrap();
        if backward_inside {
            loss.backward();
            drop(guard);
        } else {
            drop(guard);
            loss.backward();
        }
        let grads = model
            .parameters()
            .iter()
            .map(|p| p.grad().unwrap().iter().map(|g| g.to_bits()).collect())
            .collect();
        (loss.item().to_bits(), grads)
    }

    /// The chunked loss (logits recomputed in backward, 64 rows at a time) gives the bits of
    /// the loss that keeps its logits: the loss and every gradient, in f32 and under bf16
    /// and fp16 autocast and a V100's products, for batches of 1 row, 7 (less than a block)
    /// and 75 (a block and a part), tied or not. (The kernel's own tests vary the threads.)
    #[test]
    fn the_chunked_loss_gives_the_bits_of_the_kept_logits() {
        use tl_precision::{Accumulation, Format};
        for tie_embeddings in [false, true] {
            let config = ModelConfig {
                vocab: 300,
                d_model: 16,
                context: 8,
                tie_embeddings,
                ..micro_config(0.0)
            };
            let model = Llama::<f32>::new(&config, 5).unwrap();
            for (rows, time) in [(1, 1), (1, 7), (15, 5)] {
                let inputs: Vec<usize> = (0..rows * time).map(|i| (i * 37 + 11) % 300).collect();
                let targets: Vec<usize> = (0..rows * time).map(|i| (i * 53 + 7) % 300).collect();
                let run = |chunked: bool, autocast: Option<(Format, Accumulation)>| {
                    model.set_chunked_loss(chunked);
                    model.zero_grad();
                    let guard = autocast.map(|(f, a)| tl_precision::autocast_with(f, a));
                    let loss = model.loss(&inputs, &targets, rows, time).unwrap();
                    loss.backward();
                    drop(guard);
                    let grads: Vec<Vec<u32>> = (model.parameters().iter())
                        .map(|p| p.grad().unwrap().iter().map(|g| g.to_bits()).collect())
                        .collect();
                    (loss.item().to_bits(), grads)
                };
                for autocast in [
                    None,
                    Some((Format::Bf16, Accumulation::F32)),
                    Some((Format::Fp16, Accumulation::F32)),
                    Some((Format::Fp16, Accumulation::V100)),
                ] {
                    let kept = run(false, autocast);
                    let chunked = run(true, autocast);
                    assert!(
                        chunked == kept,
                        "tied {tie_embeddings}, {rows}×{time}, {autocast:?}"
                    );
                }
            }
        }
    }

    /// The fused head and loss computes what the head's product and the cross-entropy
    /// compute apart (in f64, to rounding: the sums run in another order).
    #[test]
    fn the_fused_head_loss_is_the_separate_ops_loss() {
        for tie_embeddings in [false, true] {
            let config = ModelConfig {
                vocab: 300,
                d_model: 16,
                tie_embeddings,
                ..micro_config(0.0)
            };
            let model = Llama::<f64>::new(&config, 6).unwrap();
            let fused = {
                model.zero_grad();
                let loss = model.loss(&INPUTS, &TARGETS, 2, 4).unwrap();
                loss.backward();
                let grads: Vec<_> = model
                    .parameters()
                    .iter()
                    .map(|p| p.grad().unwrap())
                    .collect();
                (loss.item(), grads)
            };
            model.zero_grad();
            let logits = model.forward_ids(&INPUTS, 2, 4).unwrap();
            let flat = logits.reshape(&[8, 300]);
            let loss = cross_entropy(&flat, &TARGETS);
            loss.backward();
            assert!(
                (loss.item() - fused.0).abs() < 1e-13,
                "{} vs {}",
                loss.item(),
                fused.0
            );
            for (p, fused) in model.parameters().iter().zip(&fused.1) {
                let separate = p.grad().unwrap();
                for (a, b) in separate.iter().zip(fused) {
                    assert!((a - b).abs() < 1e-13, "tied {tie_embeddings}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn stages_run_in_turn_give_the_whole_models_loss_and_gradients_bit_for_bit() {
        for dropout in [0.0, 0.25] {
            stages_run_in_turn_with_dropout(dropout);
        }
    }

    /// With dropout each stage starts from the stream where the whole model's pass starts
    /// (as the pipeline sets it for each micro-batch) and draws its blocks' masks there.
    fn stages_run_in_turn_with_dropout(dropout: f64) {
        let config = ModelConfig {
            n_layers: 4,
            ..micro_config(dropout)
        };
        let whole = Llama::<f32>::new(&config, 3).unwrap();
        let start = whole.dropout_generator().state();
        let (loss_bits, grads) = loss_and_gradients(&whole);
        let names: Vec<String> = whole
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        for (blocks, checkpointing) in [
            (vec![0..1, 1..3, 3..4], Checkpointing::Off),
            (vec![0..2, 2..4], Checkpointing::PerBlock),
        ] {
            let last = blocks.len() - 1;
            // One part per stage, as on ranks of their own.
            let parts: Vec<Llama<f32>> = (0..blocks.len())
                .map(|index| {
                    let stage = Stage {
                        index,
                        blocks: blocks[index].clone(),
                        last: index == last,
                    };
                    let part = Llama::<f32>::new(&config, 3)
                        .unwrap()
                        .into_pipeline_part(vec![stage]);
                    part.set_checkpointing(checkpointing);
                    part
                })
                .collect();
            let mut outputs = Vec::new();
            let mut input: Option<Tensor<f32>> = None;
            for (index, part) in parts.iter().enumerate() {
                part.dropout_generator().set_state(&start);
                let output = part
                    .stage_forward(index, input.as_ref(), (&INPUTS, &TARGETS), 2, 4)
                    .unwrap();
                input = Some(output.detach_leaf());
                outputs.push((input.clone().unwrap(), output));
            }
            let (_, loss) = outputs.last().unwrap();
            assert_eq!(loss.item().to_bits(), loss_bits, "{blocks:?} p {dropout}");
            loss.backward();
            // Each stage's backward from the gradient of the leaf the next stage started on.
            for (leaf, output) in outputs[..last].iter().rev() {
                output.backward_with(leaf.grad().unwrap());
            }
            // Every parameter is on exactly one part, with the whole model's gradient.
            let mut found = 0;
            for part in &parts {
                for (name, tensor) in part.named_parameters() {
                    let at = names.iter().position(|n| *n == name).unwrap();
                    let bits: Vec<u32> =
                        tensor.grad().unwrap().iter().map(|g| g.to_bits()).collect();
                    assert_eq!(
                        bits, grads[at],
                        "{blocks:?} {checkpointing} p {dropout}: {name}"
                    );
                    found += 1;
                }
            }
            assert_eq!(found, names.len());
        }
    }

    #[test]
    fn checkpointed_runs_match_the_plain_run_bit_for_bit_dropout_included() {
        let config = ModelConfig {
            n_layers: 4,
            ..micro_config(0.25)
        };
        let model = Llama::<f32>::new(&config, 2).unwrap();
        let start = model.dropout_generator().state();
        let plain = loss_and_gradients(&model);
        let after_plain = model.dropout_generator().state();
        for checkpointing in [
            Checkpointing::PerBlock,
            Checkpointing::Matmuls,
            Checkpointing::FirstMatmul,
            Checkpointing::Budget(3),
            Checkpointing::Budget(4),
        ] {
            model.dropout_generator().set_state(&start);
            model.set_checkpointing(checkpointing);
            assert_eq!(loss_and_gradients(&model), plain, "{checkpointing:?}");
            // Later draws are those of the plain run: the rerun's draws were replayed.
            assert_eq!(model.dropout_generator().state(), after_plain);
        }
    }

    /// The units are the parameters in order, and the forward runs each through the hook,
    /// in order: the embedding, the blocks, the head. A checkpointed block runs through it
    /// again in its rerun during backward, so ZeRO-3 finds it there too. The hook changes
    /// nothing the model computes.
    #[test]
    fn every_unit_runs_through_the_hook_in_order_reruns_included() {
        let config = ModelConfig {
            n_layers: 3,
            ..micro_config(0.25)
        };
        let model = Llama::<f32>::new(&config, 2).unwrap();
        let flattened: Vec<Tensor<f32>> = model.units().into_iter().flatten().collect();
        let parameters = model.parameters();
        assert_eq!(model.units().len(), config.n_layers + 2);
        assert_eq!(flattened.len(), parameters.len());
        assert!(
            flattened
                .iter()
                .zip(&parameters)
                .all(|(a, b)| a.shares_storage(b))
        );

        let start = model.dropout_generator().state();
        let plain = loss_and_gradients(&model);
        let calls = Rc::new(RefCell::new(Vec::new()));
        let seen = Rc::clone(&calls);
        model.set_unit_hook(Some(Rc::new(move |unit, forward| {
            seen.borrow_mut().push((unit, tl_tensor::in_backward()));
            forward()
        })));
        for (checkpointing, reruns) in [
            (Checkpointing::Off, vec![]),
            (Checkpointing::PerBlock, vec![2, 1]),
            (Checkpointing::Budget(2), vec![1, 2]),
        ] {
            calls.borrow_mut().clear();
            model.dropout_generator().set_state(&start);
            model.set_checkpointing(checkpointing);
            assert_eq!(loss_and_gradients(&model), plain, "{checkpointing:?}");
            let mut expected: Vec<(usize, bool)> = (0..5).map(|unit| (unit, false)).collect();
            expected.extend(reruns.iter().map(|&unit| (unit, true)));
            assert_eq!(*calls.borrow(), expected, "{checkpointing:?}");
        }
    }

    /// The way PyTorch users write it: the loss under autocast, `backward` after the guard.
    /// A checkpointed block reruns during that backward, and must round as its forward did
    /// (the fused attention asks for the autocast format again in the rerun).
    #[test]
    fn checkpointed_runs_under_autocast_match_the_plain_run_wherever_backward_runs() {
        use tl_precision::{Accumulation, Format};
        let config = ModelConfig {
            n_layers: 4,
            ..micro_config(0.25)
        };
        let model = Llama::<f32>::new(&config, 3).unwrap();
        let start = model.dropout_generator().state();
        for format in [Format::Bf16, Format::Fp16] {
            model.set_checkpointing(Checkpointing::Off);
            model.dropout_generator().set_state(&start);
            let plain = loss_and_gradients_under(&model, Some((format, Accumulation::F32)), true);
            model.dropout_generator().set_state(&start);
            let no_autocast = loss_and_gradients(&model);
            assert_ne!(
                plain, no_autocast,
                "{format}: autocast changes the gradients"
            );
            for checkpointing in [
                Checkpointing::PerBlock,
                Checkpointing::Matmuls,
                Checkpointing::FirstMatmul,
                Checkpointing::Budget(3),
            ] {
                model.set_checkpointing(checkpointing);
                for backward_inside in [true, false] {
                    model.dropout_generator().set_state(&start);
                    assert_eq!(
                        loss_and_gradients_under(
                            &model,
                            Some((format, Accumulation::F32)),
                            backward_inside
                        ),
                        plain,
                        "{format}, {checkpointing:?}, backward inside the guard: {backward_inside}"
                    );
                }
            }
        }
    }

    /// fp8 meets the keep policies: a kept fp8 product is given back to the rerun's
    /// `fp8_matmul`, which records its node (the VJP casts the gradient to E5M2 with the
    /// layer's scale) without multiplying, and the rerun records no second amax.
    #[test]
    fn keep_policies_under_fp8_match_the_plain_fp8_run() {
        let config = ModelConfig {
            n_layers: 3,
            ..micro_config(0.25)
        };
        let model = Llama::<f32>::new(&config, 4).unwrap();
        let layers = model.fp8_layer_names().len();
        let fresh_state = || {
            Rc::new(RefCell::new(
                tl_precision::Fp8State::new(tl_precision::Fp8Recipe::default(), layers).unwrap(),
            ))
        };
        let start = model.dropout_generator().state();
        let run = |checkpointing| {
            let state = fresh_state();
            model.set_fp8(Some(Rc::clone(&state))).unwrap();
            model.set_checkpointing(checkpointing);
            model.dropout_generator().set_state(&start);
            let result = loss_and_gradients(&model);
            let recorded = serde_json::to_string(&*state.borrow()).unwrap();
            (result, recorded)
        };
        let plain = run(Checkpointing::Off);
        for checkpointing in [
            Checkpointing::PerBlock,
            Checkpointing::Matmuls,
            Checkpointing::FirstMatmul,
        ] {
            let other = run(checkpointing);
            assert!(other.0 == plain.0, "{checkpointing:?}: gradients");
            assert_eq!(other.1, plain.1, "{checkpointing:?}: recorded amaxes");
        }
        model.set_fp8(None).unwrap();
    }

    /// A keep policy saves the rerun its kept products: the backward of a checkpointed run
    /// allocates the same as per-block checkpointing's, less one output per kept projection
    /// of every rerun block (three checkpointed blocks of four here; the last is not rerun).
    #[test]
    fn a_policys_rerun_allocates_no_product_it_kept() {
        let config = ModelConfig {
            n_layers: 4,
            ..micro_config(0.0)
        };
        let model = Llama::<f32>::new(&config, 2).unwrap();
        let backward_allocations = |checkpointing| {
            model.set_checkpointing(checkpointing);
            model.zero_grad();
            let loss = model.loss(&INPUTS, &TARGETS, 2, 4).unwrap();
            let ((), events) = tl_tensor::memory::record(|| loss.backward());
            let allocations: Vec<usize> = events
                .iter()
                .filter(|e| e.kind == tl_tensor::memory::EventKind::Alloc)
                .map(|e| e.bytes)
                .collect();
            (allocations.len(), allocations.iter().sum::<usize>())
        };
        let (count, bytes) = backward_allocations(Checkpointing::PerBlock);
        let (d, h, tokens) = (config.d_model, config.hidden, 2 * 4);
        // Every projection's output, f32: q, k, v, o of width d; w1, w3 of width h; w2 of d.
        let all_seven = tokens * (5 * d + 2 * h) * 4;
        assert_eq!(
            backward_allocations(Checkpointing::Matmuls),
            (count - 3 * 7, bytes - 3 * all_seven)
        );
        assert_eq!(
            backward_allocations(Checkpointing::FirstMatmul),
            (count - 3, bytes - 3 * tokens * d * 4)
        );
    }

    /// A tensor-core model meets checkpointing: the rerun during a backward that runs after
    /// the guard must multiply by the forward's model (the hook travels in the modes a
    /// checkpoint captures; the fused attention keeps the kernel it took at forward time).
    #[test]
    fn checkpointed_runs_under_a_tensor_core_model_match_the_plain_run() {
        use tl_precision::{Accumulation, Format};
        let config = ModelConfig {
            n_layers: 4,
            ..micro_config(0.25)
        };
        let model = Llama::<f32>::new(&config, 4).unwrap();
        let start = model.dropout_generator().state();
        for (format, accumulation) in [
            (Format::Fp16, Accumulation::V100),
            (Format::Fp16, Accumulation::H100),
        ] {
            model.set_checkpointing(Checkpointing::Off);
            model.dropout_generator().set_state(&start);
            let plain = loss_and_gradients_under(&model, Some((format, accumulation)), true);
            model.dropout_generator().set_state(&start);
            let f32_sums =
                loss_and_gradients_under(&model, Some((format, Accumulation::F32)), true);
            // The micro model's sums are a block or two long: an H100 adds them almost
            // exactly, like f32, and its fp16 results agree; a V100 truncates every four.
            if accumulation == Accumulation::V100 {
                assert!(
                    plain != f32_sums,
                    "{accumulation}: the model changes no gradient"
                );
            }
            for checkpointing in [
                Checkpointing::PerBlock,
                Checkpointing::Matmuls,
                Checkpointing::FirstMatmul,
                Checkpointing::Budget(3),
            ] {
                model.set_checkpointing(checkpointing);
                for backward_inside in [true, false] {
                    model.dropout_generator().set_state(&start);
                    let checkpointed = loss_and_gradients_under(
                        &model,
                        Some((format, accumulation)),
                        backward_inside,
                    );
                    assert!(
                        checkpointed == plain,
                        "{accumulation} {format}, {checkpointing:?}, backward inside: {backward_inside}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_budget_with_no_schedule_is_an_error() {
        let model = Llama::<f32>::new(&micro_config(0.0), 0).unwrap();
        model.set_checkpointing(Checkpointing::Budget(0));
        assert!(matches!(
            model.loss(&INPUTS, &TARGETS, 2, 4),
            Err(crate::TrainError::Recompute(_))
        ));
    }

    #[test]
    fn the_same_seed_gives_the_same_model_and_the_same_samples() {
        let config = micro_config(0.0);
        let (a, b) = (
            Llama::<f32>::new(&config, 9).unwrap(),
            Llama::<f32>::new(&config, 9).unwrap(),
        );
        let values = |m: &Llama<f32>| {
            m.parameters()
                .iter()
                .flat_map(|p| p.to_vec())
                .collect::<Vec<_>>()
        };
        assert_eq!(values(&a), values(&b));
        assert_ne!(values(&a), values(&Llama::<f32>::new(&config, 10).unwrap()));
        let sample = |m: &Llama<f32>| m.generate(&[1, 2], 12, 1.0, None, &Generator::new(4));
        let text = sample(&a);
        assert_eq!(
            text.len(),
            12,
            "longer than the context of 5: the window slides"
        );
        assert!(text.iter().all(|&id| id < 11));
        assert_eq!(text, sample(&b));
    }

    #[test]
    fn temperature_zero_picks_the_first_maximum() {
        assert_eq!(
            sample_index(&[0.0, 3.0, 3.0, -1.0], 0.0, None, &Generator::new(0)),
            1
        );
        // At a very low temperature the maximum is (numerically) certain.
        assert_eq!(
            sample_index(&[0.0, 3.0, 1.0], 1e-3, None, &Generator::new(0)),
            1
        );
    }

    #[test]
    fn top_k_draws_only_among_the_k_largest_logits() {
        let logits = [0.5, 2.0, -1.0, 1.9, 2.0, 0.0];
        let rng = Generator::new(3);
        // Top-k 1 is the greedy pick (the first maximum), at any temperature.
        for temperature in [0.0, 1.0, 50.0] {
            assert_eq!(sample_index(&logits, temperature, Some(1), &rng), 1);
        }
        // At a high temperature every candidate is about as likely: all three and only
        // the three largest (indices 1, 3, 4) come up.
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..400 {
            seen.insert(sample_index(&logits, 50.0, Some(3), &rng));
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), [1, 3, 4]);
        // K at or above the vocabulary restricts nothing: the same draws as no K.
        let (a, b) = (Generator::new(8), Generator::new(8));
        for _ in 0..50 {
            assert_eq!(
                sample_index(&logits, 1.0, Some(6), &a),
                sample_index(&logits, 1.0, None, &b)
            );
        }
    }

    #[test]
    fn generating_with_top_k_1_is_generating_at_temperature_0() {
        let model = Llama::<f32>::new(&micro_config(0.0), 5).unwrap();
        let greedy = model.generate(&[1, 2, 3], 10, 0.0, None, &Generator::new(0));
        let top1 = model.generate(&[1, 2, 3], 10, 1.5, Some(1), &Generator::new(7));
        assert_eq!(top1, greedy);
    }

    #[test]
    fn checkpointing_has_lowercase_json_names_and_reads_the_old_ones() {
        for (mode, new, old) in [
            (Checkpointing::Off, r#""off""#, r#""Off""#),
            (Checkpointing::PerBlock, r#""per-block""#, r#""PerBlock""#),
            (
                Checkpointing::Budget(3),
                r#"{"budget":3}"#,
                r#"{"Budget":3}"#,
            ),
        ] {
            assert_eq!(serde_json::to_string(&mode).unwrap(), new);
            for text in [new, old] {
                let back: Checkpointing = serde_json::from_str(text).unwrap();
                assert_eq!(back, mode, "{text}");
            }
        }
        assert_eq!(Checkpointing::Off.to_string(), "off");
        assert_eq!(Checkpointing::PerBlock.to_string(), "per block");
        assert_eq!(
            Checkpointing::Budget(1).to_string(),
            "optimal schedule for 1 stored block input"
        );
    }
}
