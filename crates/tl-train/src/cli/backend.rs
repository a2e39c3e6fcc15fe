//! `--backend`: which communicator a command's ranks talk over.

use clap::ValueEnum;
use tl_collective::Communicator;

use crate::error::{Result, TrainError};

/// Which communicator the ranks use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The hand-built ring, as `tinyllm launch` wires it (one process alone: a world of one).
    #[default]
    Ring,
    /// MPI's own collectives, under mpirun (needs the `mpi` feature).
    Mpi,
    /// The ring's algorithm over MPI point-to-point, under mpirun (needs the `mpi` feature).
    MpiRing,
}

impl std::fmt::Display for Backend {
    /// The backend's name on the command line: `ring`, `mpi` or `mpi-ring`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Ring => "ring",
            Backend::Mpi => "mpi",
            Backend::MpiRing => "mpi-ring",
        })
    }
}

/// Open MPI's setting that makes a rank's blocking calls yield the core while they wait.
#[cfg(feature = "mpi")]
const YIELD_WHEN_IDLE: &str = "OMPI_MCA_mpi_yield_when_idle";

/// Makes Open MPI's waits yield their core unless the user chose otherwise: the rank's
/// communication thread (the reduction overlapped with backward) waits in blocking MPI
/// calls, which otherwise spin on a core the rank's computation needs. On two namespace
/// hosts of a 2-core machine the overlapped 1 Gbit/s capstone step took 2.29–2.32 s
/// spinning and 2.06–2.10 s yielding (docs/data-parallel.md).
#[cfg(feature = "mpi")]
fn yield_when_idle() {
    if std::env::var_os(YIELD_WHEN_IDLE).is_none() {
        // SAFETY: before MPI is initialised, and the only other threads of the process are
        // rayon's idle workers (and, for `train`, none yet reading the environment), so no
        // thread reads or writes the environment meanwhile.
        unsafe { std::env::set_var(YIELD_WHEN_IDLE, "1") };
    }
}

/// Environment variables by which MPI launchers tell a process the size of its world.
const MPI_WORLD_SIZE: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"];

/// The communicator of `backend`, as the environment describes it.
///
/// # Errors
/// The backend's own errors; [`TrainError::InvalidArgument`] for `--backend mpi` in a build
/// without MPI, or for the ring backend in a process that mpirun started as one of several
/// (each would otherwise train alone).
pub fn communicator(backend: Backend) -> Result<Box<dyn Communicator>> {
    match backend {
        Backend::Ring => {
            let comm = tl_collective::from_env()?;
            let under_mpi = MPI_WORLD_SIZE
                .iter()
                .filter_map(|name| std::env::var(name).ok())
                .any(|size| size.trim().parse::<usize>().is_ok_and(|n| n > 1));
            if comm.world_size() == 1 && under_mpi {
                return Err(TrainError::InvalidArgument {
                    name: "--backend",
                    value: "ring".into(),
                    reason: "this process was started by mpirun as one of several ranks: \
                             pass --backend mpi (or start the ranks with tinyllm launch)"
                        .into(),
                });
            }
            Ok(comm)
        }
        #[cfg(feature = "mpi")]
        Backend::Mpi | Backend::MpiRing => {
            use tl_collective::{MpiComm, MpiMode};
            let mode = if backend == Backend::Mpi {
                MpiMode::Native
            } else {
                MpiMode::Ring
            };
            yield_when_idle();
            let comm = MpiComm::init(mode)?;
            if comm.world_size() > 1 {
                crate::output::label_rank(comm.rank());
            }
            Ok(Box::new(comm))
        }
        #[cfg(not(feature = "mpi"))]
        Backend::Mpi | Backend::MpiRing => Err(TrainError::InvalidArgument {
            name: "--backend",
            value: backend.to_string(),
            reason: "this tinyllm was built without the `mpi` feature".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_prints_as_its_command_line_name() {
        for backend in Backend::value_variants() {
            let name = backend.to_possible_value().unwrap().get_name().to_string();
            assert_eq!(backend.to_string(), name);
        }
    }
}
