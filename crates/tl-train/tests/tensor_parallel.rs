//! The Llama split over a tensor-parallel group against the whole model on one process: the
//! same loss, every gradient the whole model's (the ranks' slices put side by side by the
//! model's own placement table), the collectives Megatron's layout makes, and the
//! composition with checkpointing and dropout.
//!
//! The ranks are threads of this process over the socket ring (each its own sockets), so a
//! test is a few hundred milliseconds.
//!
//! - `sequence`: the split with sequence parallelism.

mod common;
#[path = "tensor_parallel/sequence.rs"]
mod sequence;

use std::time::Duration;

use tl_collective::{Communicator, RingComm};
use tl_parallel::{GradElement, TensorParallel};
use tl_tensor::ndarray::{ArrayD, Axis, concatenate};
use tl_tensor::nn::Module;
use tl_train::model::parallel::{Placement, placement};
use tl_train::model::{Checkpointing, Llama, ModelConfig};

const TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `program` on `n` ranks of a ring, one thread each.
fn world<T: Send>(n: usize, program: impl Fn(RingComm) -> T + Sync) -> Vec<T> {
    common::thread_world(n, TIMEOUT, program)
}

/// Small enough for milliseconds, every split size divisible by 4.
fn config(dropout: f64) -> ModelConfig {
    ModelConfig {
        vocab: 16,
        d_model: 16,
        n_layers: 2,
        n_heads: 4,
        hidden: 24,
        context: 6,
        norm_eps: 1e-5,
        rope_base: 10_000.0,
        dropout,
        n_kv_heads: None,
        tie_embeddings: false,
    }
}

const ROWS: usize = 2;
const TIME: usize = 5;
const INPUTS: [usize; 10] = [1, 4, 7, 2, 0, 10, 3, 3, 15, 8];
const TARGETS: [usize; 10] = [4, 7, 2, 9, 10, 3, 3, 5, 8, 12];

/// The loss and every named gradient of one forward and backward pass.
#[derive(Clone)]
struct Pass {
    loss: f64,
    grads: Vec<(String, ArrayD<f64>)>,
    /// Collectives of the tensor-parallel group: forward, then backward.
    collectives: (u64, u64),
}

fn pass<E: GradElement>(model: &Llama<E>, tp: Option<&TensorParallel>) -> Pass {
    model.zero_grad();
    let count = || tp.map_or(0, |tp| tp.stats().collectives);
    let start = count();
    let loss = model.loss(&INPUTS, &TARGETS, ROWS, TIME).unwrap();
    let forward = count() - start;
    loss.backward();
    let backward = count() - start - forward;
    if let Some(split) = model.tensor_split() {
        assert!(split.take_error().is_none());
    }
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(name, p)| {
            let grad = p.grad().unwrap_or_else(|| panic!("{name} has no gradient"));
            (name, grad.mapv(|g| g.to_f64()))
        })
        .collect();
    Pass {
        loss: loss.item().to_f64(),
        grads,
        collectives: (forward, backward),
    }
}

/// The whole model's gradients from the ranks' slices, by [`placement`].
fn assemble(ranks: &[Pass]) -> Vec<(String, ArrayD<f64>)> {
    (0..ranks[0].grads.len())
        .map(|i| {
            let name = ranks[0].grads[i].0.clone();
            let whole = match placement(&name) {
                Placement::Replicated => {
                    // Every rank computed the same gradient from the same activations.
                    for rank in &ranks[1..] {
                        assert_eq!(rank.grads[i].1, ranks[0].grads[i].1, "{name}");
                    }
                    ranks[0].grads[i].1.clone()
                }
                Placement::Split { axis } => {
                    let parts: Vec<_> = ranks.iter().map(|r| r.grads[i].1.view()).collect();
                    concatenate(Axis(axis), &parts).unwrap()
                }
            };
            (name, whole)
        })
        .collect()
}

/// The largest relative difference of two gradient lists, over the whole of each tensor.
fn max_relative(a: &[(String, ArrayD<f64>)], b: &[(String, ArrayD<f64>)]) -> f64 {
    a.iter()
        .zip(b)
        .map(|((name, x), (other, y))| {
            assert_eq!(name, other);
            assert_eq!(x.shape(), y.shape(), "{name}");
            let scale = y.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-300);
            x.iter()
                .zip(y)
                .fold(0.0f64, |m, (p, q)| m.max((p - q).abs() / scale))
        })
        .fold(0.0, f64::max)
}

fn split_run<E: GradElement>(
    t: usize,
    config: &ModelConfig,
    checkpointing: Checkpointing,
) -> Vec<Pass> {
    world(t, |comm| {
        let tp = TensorParallel::new(Box::new(comm));
        let whole = Llama::<E>::new(config, 3).unwrap();
        let part = whole.tensor_parallel(tp.clone()).unwrap();
        drop(whole);
        part.set_checkpointing(checkpointing);
        pass(&part, Some(&tp))
    })
}

/// Each of `t` ranks' refusal to split a model of `config`.
fn split_errors(t: usize, config: &ModelConfig) -> Vec<String> {
    world(t, |comm| {
        let tp = TensorParallel::new(Box::new(comm));
        let whole = Llama::<f32>::new(config, 3).unwrap();
        let refused = whole.tensor_parallel(tp).err();
        refused.expect("refused").to_string()
    })
}

#[test]
fn a_split_llama_computes_the_whole_models_loss_and_gradients() {
    let config = config(0.0);
    for t in [2, 4] {
        let whole = pass(&Llama::<f64>::new(&config, 3).unwrap(), None);
        let ranks = split_run::<f64>(t, &config, Checkpointing::Off);
        for rank in &ranks {
            assert!(
                (rank.loss - whole.loss).abs() <= 1e-14 * whole.loss,
                "t {t}"
            );
            // Megatron's count: the embedding's sum, a reduce-from per attention and MLP,
            // the cross-entropy's two; backward, a copy-to per attention, MLP and the head.
            let blocks = config.n_layers as u64;
            assert_eq!(
                rank.collectives,
                (1 + 2 * blocks + 2, 2 * blocks + 1),
                "t {t}"
            );
        }
        // Measured: 8.9e-16 (t = 2) and 6.2e-16 (t = 4) of each tensor's largest gradient,
        // 4 ε: the ranks' partial sums are added in another order than one product adds.
        let error = max_relative(&assemble(&ranks), &whole.grads);
        assert!(
            error < 8.0 * f64::EPSILON,
            "t {t}: gradients differ by {error:e}"
        );

        let whole32 = pass(&Llama::<f32>::new(&config, 3).unwrap(), None);
        let ranks32 = split_run::<f32>(t, &config, Checkpointing::Off);
        let error = max_relative(&assemble(&ranks32), &whole32.grads);
        // Measured: 4.4e-7 and 3.3e-7, 4 ε of f32.
        let bound = 8.0 * f64::from(f32::EPSILON);
        assert!(error < bound, "t {t} f32: gradients differ by {error:e}");
    }
}

/// Grouped-query attention and a tied head split over the group: each rank holds its query
/// heads with the key/value heads they read, and its rows of the embedding, which are its
/// columns of the tied head. The whole model's loss and gradients, as without them.
#[test]
fn grouped_queries_and_a_tied_head_split_as_the_whole_model_computes() {
    for (n_kv_heads, tie_embeddings) in [(2, false), (1, false), (4, true), (2, true)] {
        let config = ModelConfig {
            n_kv_heads: Some(n_kv_heads),
            tie_embeddings,
            ..config(0.0)
        };
        let t = 2;
        let whole = pass(&Llama::<f64>::new(&config, 3).unwrap(), None);
        let what = format!("{n_kv_heads} kv heads, tied {tie_embeddings}");
        if n_kv_heads % t != 0 {
            for error in split_errors(t, &config) {
                assert!(
                    error.contains("n_kv_heads = 1") && error.contains("not replicate"),
                    "{error}"
                );
            }
            continue;
        }
        let ranks = split_run::<f64>(t, &config, Checkpointing::PerBlock);
        for rank in &ranks {
            assert!(
                (rank.loss - whole.loss).abs() <= 1e-14 * whole.loss,
                "{what}"
            );
        }
        let error = max_relative(&assemble(&ranks), &whole.grads);
        assert!(
            error < 8.0 * f64::EPSILON,
            "{what}: gradients differ by {error:e}"
        );
    }
}

#[test]
fn a_checkpointed_split_block_reruns_its_collectives_and_gives_the_same_bits() {
    let config = config(0.0);
    let plain = split_run::<f32>(2, &config, Checkpointing::Off);
    for checkpointing in Checkpointing::POLICIES.into_iter().skip(1) {
        let checkpointed = split_run::<f32>(2, &config, checkpointing);
        for (rank, (p, c)) in plain.iter().zip(&checkpointed).enumerate() {
            assert_eq!(
                p.loss.to_bits(),
                c.loss.to_bits(),
                "{checkpointing} rank {rank}"
            );
            assert_eq!(p.grads, c.grads, "{checkpointing} rank {rank}");
            // The rerun makes a block's two forward all-reduces again, in each checkpointed
            // block: all but the last, which runs plainly (its rerun would start at once).
            let reruns = config.n_layers as u64 - 1;
            assert_eq!(c.collectives.0, p.collectives.0, "{checkpointing}");
            assert_eq!(
                c.collectives.1,
                p.collectives.1 + 2 * reruns,
                "{checkpointing}"
            );
        }
    }
}

#[test]
fn dropout_draws_the_whole_models_masks_on_every_rank() {
    let config = config(0.25);
    let whole_model = Llama::<f64>::new(&config, 3).unwrap();
    let whole = pass(&whole_model, None);
    let ranks = split_run::<f64>(2, &config, Checkpointing::PerBlock);
    for rank in &ranks {
        assert!((rank.loss - whole.loss).abs() <= 1e-14 * whole.loss);
    }
    let error = max_relative(&assemble(&ranks), &whole.grads);
    assert!(error < 8.0 * f64::EPSILON, "gradients differ by {error:e}");
}

#[test]
fn sizes_that_do_not_divide_are_refused_naming_them() {
    for (config, what) in [
        (
            ModelConfig {
                n_heads: 2,
                d_model: 8,
                ..config(0.0)
            },
            "n_heads = 2",
        ),
        (
            ModelConfig {
                hidden: 18,
                ..config(0.0)
            },
            "hidden = 18",
        ),
        (
            ModelConfig {
                vocab: 18,
                ..config(0.0)
            },
            "vocab = 18",
        ),
    ] {
        for error in split_errors(4, &config) {
            assert!(
                error.contains(what) && error.contains("divisible by 4"),
                "{error}"
            );
        }
    }
}

#[test]
fn a_rank_that_is_gone_makes_the_loss_an_error_not_a_nan() {
    let config = config(0.0);
    let outcomes = world(2, |comm| {
        let rank = comm.rank();
        let tp = TensorParallel::new(Box::new(comm));
        let part = Llama::<f32>::new(&config, 3)
            .unwrap()
            .tensor_parallel(tp)
            .unwrap();
        if rank == 1 {
            return None; // leaves: its sockets close
        }
        Some(part.loss(&INPUTS, &TARGETS, ROWS, TIME).map(|_| ()))
    });
    let error = outcomes[0]
        .as_ref()
        .unwrap()
        .as_ref()
        .unwrap_err()
        .to_string();
    assert!(error.contains("rank 1"), "{error}");
}
