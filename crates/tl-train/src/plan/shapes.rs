//! Model shapes far beyond this machine, for `tinyllm plan --shape` only.
//!
//! They are [`ModelConfig`]s like any other, so the plan runs the same meta step on them, but
//! they are not [`Preset`](crate::model::Preset)s: `tinyllm train` cannot name them (it has
//! no `--shape` flag and `--preset 7b` is an unknown preset), and a config built from one by
//! hand is refused by the trainer's memory check long before anything is allocated.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::error::{Result, TrainError};
use crate::model::ModelConfig;

/// A Llama shape that only the memory plan may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum PlanShape {
    /// A 1.3B Llama: width 2048, 24 blocks of 16 heads (head size 128), SwiGLU hidden 5504
    /// (8/3·d = 5461 rounded up to a multiple of 128, as Llama sizes its MLP), Llama's
    /// 32,000-token vocabulary, context 2048.
    Llama1b3,
    /// Llama 7B: width 4096, 32 blocks of 32 heads, SwiGLU hidden 11008, vocabulary 32,000,
    /// context 4096 (Llama 2's).
    Llama7b,
    /// Llama 2 70B's sizes: width 8192, 80 blocks of 64 heads, SwiGLU hidden 28672,
    /// vocabulary 32,000, context 4096 — with full multi-head attention. Llama 2 70B shares
    /// each key and value head among 8 query heads (grouped-query attention), which this
    /// model does not have: its wk and wv are 8192 × 8192 rather than 8192 × 1024, so it has
    /// 78.4 billion parameters rather than 69 billion, and its keys and values in the
    /// activations are 8 times Llama 2's.
    Llama70b,
}

impl PlanShape {
    /// Both shapes, smallest first.
    pub const ALL: [PlanShape; 3] = [PlanShape::Llama1b3, PlanShape::Llama7b, PlanShape::Llama70b];

    /// The name `--shape` takes.
    pub fn name(self) -> &'static str {
        match self {
            PlanShape::Llama1b3 => "1.3b",
            PlanShape::Llama7b => "7b",
            PlanShape::Llama70b => "70b",
        }
    }

    /// The model's sizes (no dropout, Llama's norm epsilon and rotary base).
    ///
    /// ```
    /// use tl_train::plan::PlanShape;
    ///
    /// // 32000·4096 (embedding) + 32·(4·4096² + 3·4096·11008 + 2·4096) + 4096 + 4096·32000
    /// assert_eq!(PlanShape::Llama7b.config().num_parameters(), 6_738_415_616);
    /// assert_eq!(PlanShape::Llama1b3.config().num_parameters(), 1_345_423_360);
    /// // 32000·8192·2 + 80·(2·8192² + 2·8192·1024 + 3·8192·28672 + 2·8192) + 8192: eight
    /// // key/value heads of 128 (grouped-query attention), Llama 2 70B's count.
    /// assert_eq!(PlanShape::Llama70b.config().num_parameters(), 68_976_648_192);
    /// ```
    pub fn config(self) -> ModelConfig {
        let (d_model, n_layers, n_heads, hidden, context) = match self {
            PlanShape::Llama1b3 => (2048, 24, 16, 5504, 2048),
            PlanShape::Llama7b => (4096, 32, 32, 11008, 4096),
            PlanShape::Llama70b => (8192, 80, 64, 28672, 4096),
        };
        let n_kv_heads = (self == PlanShape::Llama70b).then_some(8);
        ModelConfig {
            vocab: 32_000,
            d_model,
            n_layers,
            n_heads,
            hidden,
            context,
            norm_eps: 1e-5,
            rope_base: 10_000.0,
            dropout: 0.0,
            n_kv_heads,
            tie_embeddings: false,
        }
    }
}

impl fmt::Display for PlanShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PlanShape {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self> {
        PlanShape::ALL
            .into_iter()
            .find(|shape| shape.name() == s)
            .ok_or_else(|| TrainError::InvalidArgument {
                name: "shape",
                value: s.to_string(),
                reason: "expected 1.3b, 7b or 70b".into(),
            })
    }
}
