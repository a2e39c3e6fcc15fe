//! `tinyllm sample`: continue a prompt with a trained model.

use std::io::Write;

use tl_tensor::Generator;

use super::SampleArgs;
use crate::error::{Result, TrainError};
use crate::train::load_model;

/// Runs `tinyllm sample`: prints the prompt and its continuation to stdout.
pub(super) fn sample(args: &SampleArgs) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(TrainError::InvalidArgument {
            name: "temperature",
            value: args.temperature.to_string(),
            reason: "must be finite and >= 0".into(),
        });
    }
    let prompt = args.prompt.clone().unwrap_or_else(|| "\n".to_string());
    if prompt.is_empty() {
        return Err(TrainError::InvalidArgument {
            name: "prompt",
            value: "\"\"".into(),
            reason: "must hold at least one byte".into(),
        });
    }
    if !(1..=MAX_SAMPLE_TOKENS).contains(&args.tokens) {
        return Err(TrainError::InvalidArgument {
            name: "tokens",
            value: args.tokens.to_string(),
            reason: format!("must be in 1..={MAX_SAMPLE_TOKENS}"),
        });
    }
    let (_, model) = load_model(&args.from)?;
    let ids: Vec<usize> = prompt.bytes().map(usize::from).collect();
    let generated = model.generate(
        &ids,
        args.tokens,
        args.temperature,
        &Generator::new(args.seed),
    );
    let bytes: Vec<u8> = generated.into_iter().map(|id| id as u8).collect();
    let mut stdout = std::io::stdout().lock();
    let text = format!("{prompt}{}", String::from_utf8_lossy(&bytes));
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.write_all(b"\n"))
        .and_then(|()| stdout.flush())
    {
        // A reader that stopped reading (`| head`) has what it wanted.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        result => result.map_err(|source| TrainError::io("stdout", source)),
    }
}

/// The most bytes one `tinyllm sample` generates.
const MAX_SAMPLE_TOKENS: usize = 1 << 20;
