//! Collectives over processes: the communication layer of data-parallel training (L11.2).
//!
//! A [`Communicator`] joins `world_size()` processes; each has a `rank()`. Every rank calls
//! the same collectives in the same order on slices of `f32` or `f64`:
//! [`all_reduce_sum`](Communicator::all_reduce_sum),
//! [`reduce_scatter_sum`](Communicator::reduce_scatter_sum) and
//! [`all_gather`](Communicator::all_gather) (shards as [`shard_range`] lays them out),
//! [`broadcast`](Communicator::broadcast), [`barrier`](Communicator::barrier), and the scalar
//! helpers a trainer needs (the max of an overflow flag, the sum of a squared norm).
//! A reduction is a sum, a maximum, or a sum in a 16-bit format as a GPU's bf16 or fp16
//! all-reduce computes it ([`ReduceOp::SumIn`]: rounded at every addition of the ring, sent
//! as 16 bits an element).
//! Point-to-point [`send`](Communicator::send) and [`recv`](Communicator::recv) move a
//! buffer from one rank to another (a pipeline's activations and gradients): buffered
//! sends, receives matched by sender and tag.
//! [`split`](Communicator::split) makes a group of some of the ranks (as `MPI_Comm_split`),
//! and a [`Mesh`] lays the world out as `dp × tp × pp` and splits it into each axis's groups.
//!
//! Backends:
//! - [`Single`]: a world of one, where every collective is a copy or nothing.
//! - [`RingComm`]: the course's ring over Unix-domain sockets between processes of one
//!   machine, written by hand: reduce-scatter then all-gather, bandwidth-optimal, in a fixed
//!   summation order (the same bits on every rank and every run), failing with a typed error
//!   within a bound when a rank dies. [`launch::launch`] starts the ranks.
//! - `MpiComm` (feature `mpi`): MPI's own collectives, or the ring over MPI point-to-point for
//!   deterministic sums, for runs across machines under `mpirun`.
//! - [`Phantom`]: rank r of a ring of N in a process of its own, for planning: it moves
//!   nothing and counts what the ring's rank r would send ([`ring_bytes_sent`]).
//!
//! A buffer may be shape-only ([`SliceMut::shape`]: an element type and a length, no
//! values), as a planner running the step on shapes passes it: [`Single`] and [`Phantom`]
//! take it, the backends that move bytes refuse it ([`CollectiveError::ShapeOnly`]).
//!
//! [`from_env`] picks the ring when a launcher set [`ENV_WORLD_SIZE`] and friends, else
//! [`Single`]; code written against `Box<dyn Communicator>` runs unchanged on one process:
//!
//! ```
//! use tl_collective::{Communicator, Single, shard_range};
//!
//! let mut comm: Box<dyn Communicator> = Box::new(Single::new()); // or tl_collective::from_env()?
//! let (rank, n) = (comm.rank(), comm.world_size());
//! let mut grads = vec![0.5f32; 10];
//! comm.all_reduce_sum((&mut grads).into())?;
//!
//! // ZeRO-style: reduce to this rank's shard, update it, gather the full vector back.
//! let mut shard = vec![0.0f32; shard_range(grads.len(), n, rank).len()];
//! comm.reduce_scatter_sum((&grads).into(), (&mut shard).into())?;
//! shard.iter_mut().for_each(|x| *x *= 2.0);
//! comm.all_gather((&shard).into(), (&mut grads).into())?;
//! assert_eq!(grads, vec![1.0; 10]);
//! assert_eq!(comm.stats().collectives, 3);
//! # Ok::<(), tl_collective::CollectiveError>(())
//! ```

pub mod bandwidth;
mod channel_ring;
mod communicator;
mod element;
mod env;
mod error;
mod group;
pub mod launch;
mod mesh;
#[cfg(feature = "mpi")]
mod mpi_comm;
#[cfg(feature = "mpi")]
mod mpi_watchdog;
mod p2p;
mod phantom;
mod ring;
mod ring_steps;
mod schedule;
mod shard;
mod single;
mod wire;

pub use channel_ring::{ChannelLink, channel_ring, on_channel_ring};
pub use communicator::{CommStats, Communicator};
pub use element::{Element, ElementType, ReduceOp, Slice, SliceMut, sum_in};
pub use env::{
    DEFAULT_TIMEOUT, ENV_RANK, ENV_RENDEZVOUS, ENV_SECRET, ENV_TIMEOUT_MS, ENV_WORLD_SIZE,
    MAX_WORLD_SIZE, RingConfig, format_secret, timeout_from_env,
};
pub use error::{CallHeader, CollectiveError, Result};
pub use mesh::{Axis, Coords, Mesh, MeshGroups};
#[cfg(feature = "mpi")]
pub use mpi_comm::{MpiComm, MpiMode};
#[cfg(feature = "mpi")]
pub use mpi_watchdog::{DEFAULT_MPI_TIMEOUT, TIMEOUT_EXIT_STATUS};
pub use p2p::MAX_TAG;
pub use phantom::Phantom;
pub use ring::{
    Collective, MAX_SOCKET_PATH, RING_HEADER_BYTES, RingComm, ring_bytes_sent, socket_path,
};
pub use ring_steps::{
    RingLink, all_gather_step, reduce_scatter_step, ring_all_gather, ring_all_reduce,
    ring_reduce_scatter,
};
pub use schedule::reference_all_reduce;
pub use shard::shard_range;
pub use single::Single;

/// The user guide `docs/collectives.md`, compiled as a doctest so its examples stay true.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/collectives.md")]
pub struct CollectivesGuide;

/// The communicator the environment describes: the ring when a launcher set
/// [`ENV_WORLD_SIZE`] (and the other `TINYLLM_*` variables), else a world of one.
///
/// # Errors
/// [`CollectiveError::BadEnv`] naming a missing or malformed variable; the errors of
/// [`RingComm::connect`].
pub fn from_env() -> Result<Box<dyn Communicator>> {
    match RingConfig::from_env()? {
        Some(config) => Ok(Box::new(RingComm::connect(config)?)),
        None => Ok(Box::new(Single::new())),
    }
}
