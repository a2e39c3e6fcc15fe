//! `tinyllm`: train, resume and sample small Llama models (see `tinyllm --help`).

use std::process::ExitCode;

use tl_tensor::alloc::CachingAllocator;
use tl_train::cli::{CliError, Exit, run};

/// Large freed buffers are kept for the next micro-batch instead of going back to the
/// system, which would page-fault them in again (see `tl_tensor::alloc`).
#[global_allocator]
static ALLOCATOR: CachingAllocator = CachingAllocator;

fn main() -> ExitCode {
    match run(std::env::args_os()) {
        Ok(Exit::Success) => ExitCode::SUCCESS,
        Ok(Exit::Interrupted) => ExitCode::from(130),
        Ok(Exit::MilestoneMissed) => ExitCode::from(3),
        Err(CliError::Usage(error)) => error.exit(),
        Err(CliError::Run(error)) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
