//! Activation checkpointing for tl-tensor: keep only some layers' inputs during the forward
//! pass and recompute the rest during backward, with gradients equal bit for bit to those of
//! the plain run.
//!
//! - [`checkpoint`] turns one segment into one graph node that reruns it during backward,
//!   replaying its random draws ([`Generator`](tl_tensor::Generator) states) and keeping its
//!   parameters as parents of the node, so a segment fed by data still learns.
//! - [`checkpoint_schedule`] plans where to cut a stack of `n` layers under a memory budget
//!   (in units of one layer's stored input), recomputing as few layers as possible;
//!   [`uniform_schedule`] is the `√n` alternative and [`schedule_cost`] prices any schedule.
//! - [`checkpoint_sequential`] runs a stack on such a schedule.
//! - [`keep_for_rerun`] lets an expensive op inside a segment be computed once: the node
//!   keeps its result and the rerun takes it back (selective checkpointing); with
//!   [`keep_named`] and [`keep_product`] the op names its result and the caller's
//!   [`KeepPolicy`], put in force with [`keeping`], decides what is kept.
//! - Verified mode ([`CheckpointOptions::verified`], [`backward_verified`]) checks that every
//!   rerun reproduces its forward pass bit for bit, and names the segment that does not.
//!
//! ```
//! use std::rc::Rc;
//! use tl_recompute::{checkpoint_schedule, checkpoint_sequential};
//! use tl_tensor::nn::{Linear, Module};
//! use tl_tensor::{Generator, Tensor};
//!
//! let rng = Generator::new(0);
//! let layers: Vec<Rc<dyn Module<f64>>> =
//!     (0..6).map(|_| Rc::new(Linear::new(4, 4, true, &rng)) as Rc<dyn Module<f64>>).collect();
//! let x = Tensor::<f64>::ones(&[3, 4]);
//! assert_eq!(checkpoint_schedule(6, 4)?, vec![0, 3]); // layers 0..3 rerun, 3..6 kept
//! let y = checkpoint_sequential(&layers, &x, 4, &[])?;
//! y.sum_all().backward();
//! let plain = layers.iter().fold(x.clone(), |h, layer| layer.forward(&h));
//! assert_eq!(y.to_vec(), plain.to_vec());
//! # Ok::<(), tl_recompute::RecomputeError>(())
//! ```

mod checkpoint;
mod error;
mod keep;
pub mod policy;
mod schedule;
mod sequential;
mod verify;

pub use checkpoint::{CheckpointOptions, checkpoint, checkpoint_with};
pub use error::{RecomputeError, Result};
pub use keep::keep_for_rerun;
pub use policy::{KeepPolicy, KeepingGuard, keep_named, keep_policy, keep_product, keeping};
pub use schedule::{
    ScheduleCost, checkpoint_schedule, schedule_cost, segment_sizes, uniform_schedule,
};
pub use sequential::{SharedLayer, checkpoint_sequential, checkpoint_sequential_with};
pub use verify::backward_verified;
