//! `tinyllm`: train, resume and sample small Llama models (see `tinyllm --help`).

use std::process::ExitCode;

use tl_collective::CollectiveError;
use tl_tensor::alloc::CachingAllocator;
use tl_train::TrainError;
use tl_train::cli::{CliError, Exit, run};

/// Large freed buffers are kept for the next micro-batch instead of going back to the
/// system, which would page-fault them in again (see `tl_tensor::alloc`).
#[global_allocator]
static ALLOCATOR: CachingAllocator = CachingAllocator;

fn main() -> ExitCode {
    keep_heap_pages();
    match run(std::env::args_os()) {
        Ok(Exit::Success) => ExitCode::SUCCESS,
        Ok(Exit::Interrupted { signal }) => ExitCode::from(128 + signal as u8),
        Ok(Exit::MilestoneMissed) => ExitCode::from(3),
        Err(CliError::Usage(error)) => error.exit(),
        Err(CliError::Run(error)) => {
            tl_train::output::error(&error.to_string());
            ExitCode::from(exit_status(&error))
        }
    }
}

/// Tells glibc to keep the pages of freed memory mapped, so that the buffers of one step are
/// not page-faulted in (and zeroed by the kernel) again in the next.
///
/// Below the caching allocator's 1 MiB, glibc's own heuristics decide: it gives the top of a
/// heap back to the kernel once 128 KiB lie free there, and serves blocks above a threshold
/// that moves with the program's frees by mapping them afresh. A capstone step spent 10% of
/// its time in the kernel's `clear_page` for that; with the trim threshold at 2 GiB and the
/// mmap threshold fixed at glibc's largest, 32 MiB, it spends under 1%. Only the process's
/// resident memory after a step is larger (the pages are kept for the next one); its peak
/// is the same.
fn keep_heap_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's malloc parameters; it is called before any other
    // thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// The exit status of a failed command: 2 for arguments that were refused before anything
/// ran (as for a usage error), 4 for a run that diverged, 1 for anything else; under
/// `tinyllm launch`, the documented status the failing rank exited with.
fn exit_status(error: &TrainError) -> u8 {
    match error {
        TrainError::InvalidArgument { .. }
        | TrainError::FileTooLarge { .. }
        | TrainError::InvalidConfig { .. }
        | TrainError::ConfigFile { .. }
        | TrainError::UnknownPreset { .. }
        | TrainError::Recompute(_) => 2,
        TrainError::Diverged { .. } => 4,
        TrainError::Collective(CollectiveError::RankFailed {
            code: Some(code @ (2 | 3 | 4 | 129 | 130 | 143)),
            ..
        }) => *code as u8,
        _ => 1,
    }
}
