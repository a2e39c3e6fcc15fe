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
