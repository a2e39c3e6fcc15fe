//! Messages to the terminal that never fail a run.
//!
//! A training run's output is a courtesy: when whoever reads it goes away (`| head`, a
//! closed terminal, a full log disk), the run must go on. `eprintln!` panics when stderr is
//! a closed pipe; these write and ignore the error.

use std::io::Write;
use std::sync::OnceLock;

/// `rank R: `, once the process knows it is one rank of several and no launcher prefixes
/// its lines (mpirun does not; `tinyllm launch` does).
static RANK_LABEL: OnceLock<String> = OnceLock::new();

/// Makes this process's warnings and errors name its rank.
pub fn label_rank(rank: usize) {
    let _ = RANK_LABEL.set(format!("rank {rank}: "));
}

fn label() -> &'static str {
    RANK_LABEL.get().map_or("", String::as_str)
}

/// Writes `line` and a newline to stderr, ignoring a reader that went away.
pub fn line(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Writes `warning: message` to stderr, ignoring a reader that went away.
pub fn warn(message: &str) {
    line(&format!("{}warning: {message}", label()));
}

/// Writes `error: message` to stderr, ignoring a reader that went away.
pub fn error(message: &str) {
    line(&format!("{}error: {message}", label()));
}

/// `eprintln!` that ignores a closed stderr: the run's own messages.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::output::line(&format!($($arg)*))
    };
}
