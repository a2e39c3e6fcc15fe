//! The 24 pitfall mutants of L11.1: each one of the chapter's pitfalls, written as the bug a
//! Rust programmer would make, as an exact text replacement in one source file.
//!
//! Reviewed like code: an entry whose original text stops occurring exactly once (because the
//! source changed) fails `catalog_entries_apply_exactly_once`, so `cargo test --workspace`
//! notices a rotted catalog before the grade does.

/// One planted bug.
#[derive(Debug)]
pub(crate) struct Pitfall {
    /// `s01` … `s24`, as in the chapter.
    pub(crate) id: &'static str,
    /// The pitfall in one line.
    pub(crate) description: &'static str,
    /// The package whose own tests must catch it.
    pub(crate) package: &'static str,
    /// The file, relative to the workspace root.
    pub(crate) file: &'static str,
    /// The exact text replaced; it must occur exactly once in the file.
    pub(crate) original: &'static str,
    /// What it is replaced with: the bug.
    pub(crate) replacement: &'static str,
    /// The course test of the chapter's table expected to catch it.
    pub(crate) course_test: &'static str,
}

const PRECISION: &str = "tl-precision";
const RECOMPUTE: &str = "tl-recompute";

pub(crate) const PITFALLS: &[Pitfall] = &[
    // filled from the crates' sources
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planted::occurrences;

    #[test]
    fn the_catalog_has_s01_to_s24_in_order() {
        let ids: Vec<&str> = PITFALLS.iter().map(|p| p.id).collect();
        let expected: Vec<String> = (1..=24).map(|i| format!("s{i:02}")).collect();
        assert_eq!(ids, expected);
        for p in PITFALLS {
            let crate_dir = if p.package == PRECISION {
                "crates/tl-precision/"
            } else {
                "crates/tl-recompute/"
            };
            assert!(
                p.file.starts_with(crate_dir),
                "{}: {} is outside {}",
                p.id,
                p.file,
                p.package
            );
            assert_ne!(
                p.original, p.replacement,
                "{}: the mutant changes nothing",
                p.id
            );
            assert!(
                crate::catalog::L11_1
                    .iter()
                    .any(|t| t.name == p.course_test),
                "{}: {} is not a course test",
                p.id,
                p.course_test
            );
        }
        let _ = RECOMPUTE;
    }

    #[test]
    fn catalog_entries_apply_exactly_once() {
        let root = crate::workspace_root();
        let rotted: Vec<String> = PITFALLS
            .iter()
            .filter_map(|p| {
                let source = std::fs::read_to_string(root.join(p.file)).unwrap_or_default();
                let n = occurrences(&source, p.original);
                (n != 1).then(|| format!("{} in {}: original text found {n} times", p.id, p.file))
            })
            .collect();
        assert!(
            rotted.is_empty(),
            "rotted pitfall mutants:\n{}",
            rotted.join("\n")
        );
    }
}
