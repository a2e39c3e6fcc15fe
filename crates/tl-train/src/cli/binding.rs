//! Where mpirun bound the ranks: a rank computes on as many threads as it may use cores
//! (the compute pool's default size), so the ranks of a node should together be allowed
//! its cores. Open MPI binds each rank to one core by default when a node runs two ranks or
//! fewer, so a one-rank-a-node job computes on one thread of a many-core node unless told
//! otherwise. When any rank's cores times its node's ranks fall short of the node's cores,
//! rank 0 says so once for the whole job, with the flags that give the ranks their node.

use tl_collective::{Communicator, SliceMut};

use crate::error::Result;

/// The cores this process may run on, the cores its node has, and the job's ranks there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cores {
    /// Cores in the process's affinity mask.
    pub allowed: usize,
    /// Cores online on its node.
    pub online: usize,
    /// The job's ranks on its node (`OMPI_COMM_WORLD_LOCAL_SIZE`, `MPI_LOCALNRANKS`; 1 if
    /// the launcher does not say).
    pub local_ranks: usize,
}

/// The job's ranks on this node, as the launcher tells them.
fn local_ranks() -> usize {
    [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "PMI_LOCAL_SIZE",
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok()?.trim().parse().ok())
    .filter(|&n: &usize| n > 0)
    .unwrap_or(1)
}

impl Cores {
    /// This process's, or `None` where the system does not say (off Linux).
    #[cfg(not(target_os = "linux"))]
    pub(crate) fn of_this_process() -> Option<Self> {
        None
    }

    /// This process's, or `None` where the system does not say.
    #[cfg(target_os = "linux")]
    pub(crate) fn of_this_process() -> Option<Self> {
        // SAFETY: `set` is a plain bit mask that sched_getaffinity fills for this process
        // (pid 0), with its own size passed; sysconf has no preconditions.
        let (allowed, online) = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return None;
            }
            (
                libc::CPU_COUNT(&set) as usize,
                libc::sysconf(libc::_SC_NPROCESSORS_ONLN),
            )
        };
        (allowed > 0 && online > 0).then_some(Self {
            allowed,
            online: online as usize,
            local_ranks: local_ranks(),
        })
    }

    /// Whether the node's ranks, each allowed as many cores as this one, leave some idle.
    fn leaves_cores_idle(self) -> bool {
        self.allowed * self.local_ranks < self.online
    }
}

/// The warning rank 0 prints when `bound` of the job's `ranks` were bound to too few cores
/// for their node (`own` being rank 0's cores), or `None` when none were.
pub(crate) fn binding_warning(bound: usize, ranks: usize, own: Cores) -> Option<String> {
    if bound == 0 {
        return None;
    }
    let which = if bound == ranks {
        format!("every rank ({ranks})")
    } else {
        format!("{bound} of {ranks} ranks")
    };
    Some(format!(
        "mpirun bound {which} to fewer cores than its node's ranks could use (rank 0: {} of \
         {} cores, {} rank{} on its node), and a rank computes on one thread a core. For one \
         rank a node, give it the node with `mpirun --bind-to none`; for R ranks a node of C \
         cores each, `mpirun --map-by ppr:R:node:pe=C`; or choose the threads with --threads N",
        own.allowed,
        own.online,
        own.local_ranks,
        if own.local_ranks == 1 { "" } else { "s" }
    ))
}

/// Rank 0's warning, once for the job, when mpirun bound any rank to too few cores for its
/// node: one all-reduce over `comm`'s ranks. Nothing is said, or sent, when the user
/// chose the threads (`--threads` or `RAYON_NUM_THREADS`).
///
/// # Errors
/// A failed collective.
pub(super) fn warn_if_bound(comm: &mut dyn Communicator, threads_chosen: bool) -> Result<()> {
    if threads_chosen || comm.world_size() == 1 {
        return Ok(());
    }
    let own = Cores::of_this_process();
    let mut bound = [f64::from(u8::from(
        own.is_some_and(Cores::leaves_cores_idle),
    ))];
    comm.all_reduce_sum(SliceMut::F64(&mut bound))
        .map_err(|source| tl_parallel::ParallelError::Collective {
            rank: comm.rank(),
            source,
        })?;
    if comm.rank() == 0
        && let Some(own) = own
        && let Some(warning) = binding_warning(bound[0] as usize, comm.world_size(), own)
    {
        crate::output::warn(&warning);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warning_names_the_ranks_and_the_flags() {
        let one_core = Cores {
            allowed: 1,
            online: 64,
            local_ranks: 1,
        };
        assert!(one_core.leaves_cores_idle());
        let shared = Cores {
            allowed: 8,
            online: 64,
            local_ranks: 8,
        };
        assert!(
            !shared.leaves_cores_idle(),
            "8 ranks of 8 cores use the node"
        );
        assert_eq!(binding_warning(0, 4, one_core), None);
        let all = binding_warning(4, 4, one_core).unwrap();
        assert!(all.starts_with("mpirun bound every rank (4)"), "{all}");
        assert!(
            all.contains("rank 0: 1 of 64 cores, 1 rank on its node"),
            "{all}"
        );
        assert!(all.contains("--bind-to none") && all.contains("ppr:R:node:pe=C"));
        let some = binding_warning(1, 4, one_core).unwrap();
        assert!(some.starts_with("mpirun bound 1 of 4 ranks"), "{some}");
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn this_process_may_use_some_of_its_nodes_cores() {
        let cores = Cores::of_this_process().expect("Linux says");
        assert!(
            cores.allowed >= 1 && cores.allowed <= cores.online,
            "{cores:?}"
        );
        assert_eq!(
            cores.allowed,
            std::thread::available_parallelism().unwrap().get(),
            "the compute pool's default size is the affinity's"
        );
    }
}
