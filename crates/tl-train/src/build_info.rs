//! Which tinyllm this is: the crate's version and the git commit it was built from (set by
//! `build.rs` when the source was a git checkout).

use serde::{Deserialize, Serialize};

/// The version of tinyllm, as in its `Cargo.toml`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git commit (40 hexadecimal digits) this build was made from; `None` when it was not
/// built from a git checkout.
pub const COMMIT: Option<&str> = option_env!("TINYLLM_GIT_COMMIT");

/// What `tinyllm --version` prints after the name: `0.1.0 (commit 0123…)`, or the version
/// alone when the commit is not known.
pub const VERSION_LINE: &str = env!("TINYLLM_VERSION_LINE");

/// The build that wrote a file, as the `tinyllm` key of a run's `config.json` holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildInfo {
    /// [`VERSION`].
    pub version: String,
    /// [`COMMIT`]: `null` when not known.
    pub commit: Option<String>,
}

impl BuildInfo {
    /// This build.
    pub fn current() -> Self {
        Self {
            version: VERSION.to_string(),
            commit: COMMIT.map(str::to_string),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_line_starts_with_the_version_and_names_a_full_commit() {
        assert!(VERSION_LINE.starts_with(VERSION), "{VERSION_LINE}");
        if let Some(commit) = COMMIT {
            assert_eq!(commit.len(), 40);
            assert!(commit.bytes().all(|b| b.is_ascii_hexdigit()), "{commit}");
            assert!(VERSION_LINE.contains(commit), "{VERSION_LINE}");
        }
    }
}
