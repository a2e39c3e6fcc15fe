//! The device mesh: the world's ranks laid out on named axes — data parallel (`dp`), tensor
//! parallel (`tp`), pipeline parallel (`pp`) — and the groups each axis makes.
//!
//! The layout puts the tensor-parallel axis fastest, then data, then pipeline (Megatron's
//! order): `rank = (pp·DP + dp)·TP + tp`. So a tensor-parallel group is `TP` consecutive
//! ranks. Launchers place consecutive ranks on one node (`mpirun`'s default by-slot mapping,
//! `tinyllm launch` on one machine), so the group that communicates in every layer, twice
//! each way, stays inside a node; the data-parallel all-reduce, once a step, crosses nodes.
//!
//! ```
//! use tl_collective::{Axis, Coords, Mesh, Phantom};
//!
//! // 8 ranks as 2 (dp) × 4 (tp): tensor-parallel groups {0..3} and {4..7}.
//! let mesh = Mesh::for_world(8, 4, 1)?;
//! assert_eq!(mesh.to_string(), "dp 2 × tp 4 × pp 1");
//! assert_eq!(mesh.coords(6), Coords { dp: 1, tp: 2, pp: 0 });
//! assert_eq!(mesh.members(Axis::Tensor, 6), [4, 5, 6, 7]);
//! assert_eq!(mesh.members(Axis::Data, 6), [2, 6]);
//!
//! // Rank 6's groups, here of a phantom world (a real one splits its ring or MPI the same way).
//! let groups = mesh.split(&mut Phantom::new(6, 8)?)?;
//! assert_eq!((groups.tp.rank(), groups.tp.world_size()), (2, 4));
//! assert_eq!((groups.dp.rank(), groups.dp.world_size()), (1, 2));
//! # Ok::<(), tl_collective::CollectiveError>(())
//! ```

use std::fmt;

use crate::communicator::Communicator;
use crate::env::MAX_WORLD_SIZE;
use crate::error::{CollectiveError, Result};

/// An axis of the [`Mesh`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Data parallel: replicas (or ZeRO shards) that split the batch.
    Data,
    /// Tensor parallel: ranks that split each layer's weights.
    Tensor,
    /// Pipeline parallel: ranks that hold consecutive stages of the model.
    Pipeline,
}

impl Axis {
    /// Every axis, in the order [`Mesh::split`] splits them.
    pub const ALL: [Axis; 3] = [Axis::Tensor, Axis::Data, Axis::Pipeline];

    /// The axis's short name: `dp`, `tp`, `pp`.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Data => "dp",
            Axis::Tensor => "tp",
            Axis::Pipeline => "pp",
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A rank's place on each axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coords {
    /// Index among the data-parallel replicas.
    pub dp: usize,
    /// Rank inside the tensor-parallel group.
    pub tp: usize,
    /// Pipeline stage.
    pub pp: usize,
}

impl Coords {
    /// The coordinate on `axis`.
    pub fn on(self, axis: Axis) -> usize {
        match axis {
            Axis::Data => self.dp,
            Axis::Tensor => self.tp,
            Axis::Pipeline => self.pp,
        }
    }
}

/// The world laid out as `dp × tp × pp` (see the [module docs](self) for the order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    dp: usize,
    tp: usize,
    pp: usize,
}

impl Mesh {
    /// A mesh of the given axis sizes.
    ///
    /// # Errors
    /// [`CollectiveError::BadMesh`] for an axis of size 0 or a world over
    /// [`MAX_WORLD_SIZE`].
    pub fn new(dp: usize, tp: usize, pp: usize) -> Result<Mesh> {
        let bad = |reason: String| Err(CollectiveError::BadMesh { reason });
        for (axis, size) in [("dp", dp), ("tp", tp), ("pp", pp)] {
            if size == 0 {
                return bad(format!("axis {axis} has size 0; every axis is at least 1"));
            }
        }
        match dp
            .checked_mul(tp)
            .and_then(|n| n.checked_mul(pp))
            .filter(|&n| n <= MAX_WORLD_SIZE)
        {
            Some(_) => Ok(Mesh { dp, tp, pp }),
            None => bad(format!(
                "dp {dp} × tp {tp} × pp {pp} is over the largest world, {MAX_WORLD_SIZE} ranks"
            )),
        }
    }

    /// The mesh of a world of `world_size` ranks with `tp` and `pp` fixed and the data
    /// axis inferred (as `torchrun`'s users write `dp = -1`).
    ///
    /// # Errors
    /// [`CollectiveError::BadMesh`] when `tp · pp` does not divide the world size, naming
    /// all three; the errors of [`Mesh::new`].
    pub fn for_world(world_size: usize, tp: usize, pp: usize) -> Result<Mesh> {
        let model = tp.max(1).saturating_mul(pp.max(1));
        if tp == 0 || pp == 0 || !world_size.is_multiple_of(model) {
            return Err(CollectiveError::BadMesh {
                reason: format!(
                    "a world of {world_size} ranks cannot be split into tensor-parallel groups \
                     of {tp} × pipeline stages of {pp}: tp × pp = {model} must divide it"
                ),
            });
        }
        Mesh::new(world_size / model, tp, pp)
    }

    /// Checks that the mesh covers a world of `world_size` ranks.
    ///
    /// # Errors
    /// [`CollectiveError::BadMesh`] naming both sizes.
    pub fn check_world(&self, world_size: usize) -> Result<()> {
        if self.world_size() != world_size {
            return Err(CollectiveError::BadMesh {
                reason: format!(
                    "{self} is {} ranks, but the world has {world_size}",
                    self.world_size()
                ),
            });
        }
        Ok(())
    }

    /// Ranks in the world: the product of the axes.
    pub fn world_size(&self) -> usize {
        self.dp * self.tp * self.pp
    }

    /// The size of `axis`.
    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Data => self.dp,
            Axis::Tensor => self.tp,
            Axis::Pipeline => self.pp,
        }
    }

    /// Where `rank` sits.
    ///
    /// # Panics
    /// If `rank` is outside the mesh.
    pub fn coords(&self, rank: usize) -> Coords {
        assert!(rank < self.world_size(), "rank {rank} outside {self}");
        Coords {
            tp: rank % self.tp,
            dp: rank / self.tp % self.dp,
            pp: rank / (self.tp * self.dp),
        }
    }

    /// The rank at `coords`.
    ///
    /// # Panics
    /// If a coordinate is outside its axis.
    pub fn rank(&self, coords: Coords) -> usize {
        assert!(
            coords.dp < self.dp && coords.tp < self.tp && coords.pp < self.pp,
            "{coords:?} outside {self}"
        );
        (coords.pp * self.dp + coords.dp) * self.tp + coords.tp
    }

    /// The ranks of `rank`'s group along `axis` (those that differ from it only on that
    /// axis), in the order of their coordinate on it: their ranks in the group.
    ///
    /// # Panics
    /// If `rank` is outside the mesh.
    pub fn members(&self, axis: Axis, rank: usize) -> Vec<usize> {
        let at = self.coords(rank);
        (0..self.size(axis))
            .map(|i| {
                let mut c = at;
                match axis {
                    Axis::Data => c.dp = i,
                    Axis::Tensor => c.tp = i,
                    Axis::Pipeline => c.pp = i,
                }
                self.rank(c)
            })
            .collect()
    }

    /// Splits the world communicator `comm` into this rank's groups along every axis (one
    /// [`Communicator::split`] per axis, in the order of [`Axis::ALL`], on every rank).
    ///
    /// # Errors
    /// [`CollectiveError::BadMesh`] if the mesh does not cover `comm`'s world (found alike
    /// on every rank, before any exchange); the errors of [`Communicator::split`].
    pub fn split(&self, comm: &mut dyn Communicator) -> Result<MeshGroups> {
        self.check_world(comm.world_size())?;
        let rank = comm.rank();
        let tp = comm.split(&self.members(Axis::Tensor, rank))?;
        let dp = comm.split(&self.members(Axis::Data, rank))?;
        let pp = comm.split(&self.members(Axis::Pipeline, rank))?;
        Ok(MeshGroups {
            mesh: *self,
            coords: self.coords(rank),
            dp,
            tp,
            pp,
        })
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp {} × tp {} × pp {}", self.dp, self.tp, self.pp)
    }
}

/// A rank's communicators along each axis of a [`Mesh`].
pub struct MeshGroups {
    /// The mesh they were split by.
    pub mesh: Mesh,
    /// This rank's place on it.
    pub coords: Coords,
    /// The data-parallel group: the ranks at the same `tp` and `pp`.
    pub dp: Box<dyn Communicator>,
    /// The tensor-parallel group: the ranks at the same `dp` and `pp`.
    pub tp: Box<dyn Communicator>,
    /// The pipeline group: the ranks at the same `dp` and `tp`.
    pub pp: Box<dyn Communicator>,
}

impl fmt::Debug for MeshGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeshGroups")
            .field("mesh", &self.mesh)
            .field("coords", &self.coords)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes_that_do_not_fit_are_refused_naming_them() {
        let err = Mesh::for_world(6, 4, 1).unwrap_err();
        assert!(
            err.to_string().contains("6 ranks") && err.to_string().contains("4"),
            "{err}"
        );
        let err = Mesh::new(2, 0, 1).unwrap_err();
        assert!(err.to_string().contains("tp has size 0"), "{err}");
        let err = Mesh::new(2, 2, 1).unwrap().check_world(8).unwrap_err();
        assert_eq!(
            err.to_string(),
            "device mesh: dp 2 × tp 2 × pp 1 is 4 ranks, but the world has 8"
        );
        assert!(Mesh::new(MAX_WORLD_SIZE, 2, 1).is_err());
    }

    #[test]
    fn tensor_parallel_groups_are_contiguous_and_pipeline_is_outermost() {
        let mesh = Mesh::new(2, 2, 2).unwrap();
        assert_eq!(mesh.members(Axis::Tensor, 5), [4, 5]);
        assert_eq!(mesh.members(Axis::Data, 5), [5, 7]);
        assert_eq!(mesh.members(Axis::Pipeline, 5), [1, 5]);
        assert_eq!(
            mesh.coords(5),
            Coords {
                dp: 0,
                tp: 1,
                pp: 1
            }
        );
    }

    proptest! {
        #[test]
        fn every_axis_partitions_the_world(dp in 1usize..5, tp in 1usize..5, pp in 1usize..4) {
            let mesh = Mesh::new(dp, tp, pp).unwrap();
            let n = mesh.world_size();
            for rank in 0..n {
                prop_assert_eq!(mesh.rank(mesh.coords(rank)), rank);
                for axis in Axis::ALL {
                    let members = mesh.members(axis, rank);
                    prop_assert_eq!(members.len(), mesh.size(axis));
                    // Each member's group is the same list, and holds it at its coordinate.
                    for (i, &m) in members.iter().enumerate() {
                        prop_assert_eq!(&mesh.members(axis, m), &members);
                        prop_assert_eq!(mesh.coords(m).on(axis), i);
                    }
                }
            }
        }
    }
}
