//! Messages to the terminal that never fail a run.
//!
//! A training run's output is a courtesy: when whoever reads it goes away (`| head`, a
//! closed terminal, a full log disk), the run must go on. `eprintln!` panics when stderr is
//! a closed pipe; these write and ignore the error.

use std::io::Write;

/// Writes `line` and a newline to stderr, ignoring a reader that went away.
pub fn line(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Writes `warning: message` to stderr, ignoring a reader that went away.
pub fn warn(message: &str) {
    line(&format!("warning: {message}"));
}

/// `eprintln!` that ignores a closed stderr: the run's own messages.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::output::line(&format!($($arg)*))
    };
}
