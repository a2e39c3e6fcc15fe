//! The chapters the harness knows, each as data: the crates (or the files of them) the
//! learner writes, the course tests and their catalog, and the pitfalls planted to grade the
//! learner's own tests. Every command of the harness takes one chapter and works from this
//! table alone, so a chapter is added by adding a file here.
//!
//! Pitfalls are anchored to the function they mutate, not to the file's text: the pattern is
//! matched on the function's code with comments skipped and whitespace ignored
//! ([`crate::anchor`]), so reformatting a statement or renaming or adding code elsewhere in
//! the file does not move it. Reviewed like code: an entry whose function or pattern stops
//! being found exactly once (because that function changed) fails
//! `every_pitfall_applies_exactly_once`, and a course test the catalog names but the course
//! crate lost fails `every_course_test_exists`, so `cargo test --workspace` notices a rotted
//! catalog before the grade does.

mod l11_1;
mod l11_2;
mod l11_3;

/// Every chapter this workspace implements, in the course's order.
pub(crate) const CHAPTERS: &[&Chapter] = &[&l11_1::L11_1, &l11_2::L11_2, &l11_3::L11_3];

/// One chapter of the course.
#[derive(Debug)]
pub(crate) struct Chapter {
    /// `L11.1`, as the course names it.
    pub(crate) name: &'static str,
    pub(crate) title: &'static str,
    /// What the learner writes.
    pub(crate) crates: &'static [LearnerCrate],
    /// The package of the course tests.
    pub(crate) course_package: &'static str,
    /// The course tests' binary (`cargo test -p PACKAGE --test BINARY`); its modules are
    /// `tests/BINARY/MODULE.rs`.
    pub(crate) test_binary: &'static str,
    /// The catalog, in the chapter's order.
    pub(crate) tests: &'static [CourseTest],
    /// The planted pitfalls.
    pub(crate) pitfalls: &'static [Pitfall],
}

impl Chapter {
    /// The packages the learner writes.
    pub(crate) fn packages(&self) -> Vec<&'static str> {
        self.crates.iter().map(LearnerCrate::package).collect()
    }

    /// `cargo test -p PACKAGE --test BINARY`, as a learner types it.
    pub(crate) fn course_command(&self) -> String {
        format!(
            "cargo test -p {} --test {}",
            self.course_package, self.test_binary
        )
    }

    /// The full path of the course test `name` inside the test binary, for an exact filter
    /// (the name itself if the catalog does not know it).
    pub(crate) fn test_path(&self, name: &str) -> String {
        self.tests
            .iter()
            .find(|t| t.name == name)
            .map_or_else(|| name.to_string(), CourseTest::path)
    }
}

/// Finds a chapter by name, or says which exist.
pub(crate) fn chapter(name: &str) -> Result<&'static Chapter, String> {
    CHAPTERS
        .iter()
        .copied()
        .find(|c| c.name == name)
        .ok_or_else(|| {
            format!(
                "unknown module '{name}'; this workspace implements: {}",
                names().join(", ")
            )
        })
}

/// The chapters' names.
pub(crate) fn names() -> Vec<&'static str> {
    CHAPTERS.iter().map(|c| c.name).collect()
}

/// Every crate any chapter's learner writes (a crate can serve several chapters).
pub(crate) fn all_packages() -> Vec<&'static str> {
    let mut packages: Vec<&'static str> = CHAPTERS.iter().flat_map(|c| c.packages()).collect();
    packages.sort_unstable();
    packages.dedup();
    packages
}

/// Which source files of a learner's crate the learner writes.
#[derive(Debug)]
pub(crate) enum Sources {
    /// All of `src/` but these files (by file name): they lie beyond the chapter and are
    /// kept as the reference wrote them (and not graded; see `.cargo/mutants.toml`).
    AllBut(&'static [&'static str]),
    /// Only these files (paths under `src/`); the rest of the crate is the reference's, and
    /// calls them.
    Only(&'static [&'static str]),
}

/// A crate the learner writes, and the guide each of its source files sends them to.
#[derive(Debug)]
pub(crate) struct LearnerCrate {
    /// Its directory, relative to the workspace root.
    pub(crate) dir: &'static str,
    /// `(file name, guide)`: the guide of the functions of a source file; the last entry,
    /// with an empty name, is the crate's default.
    pub(crate) guides: &'static [(&'static str, &'static str)],
    /// The starter test file written into the learner's `tests/`.
    pub(crate) starter: &'static str,
    /// Which of its sources the learner writes.
    pub(crate) sources: Sources,
    /// The targets of the reference's own tests (`cargo test -p PACKAGE ARGS`) that must
    /// catch each pitfall planted in this crate, and that test each of cargo-mutants'
    /// mutants of it: enough to catch them, few enough to run every mutant in minutes.
    pub(crate) own_tests: &'static [&'static str],
}

impl LearnerCrate {
    /// Its package name (the directory's last part).
    pub(crate) fn package(&self) -> &'static str {
        self.dir.rsplit('/').next().expect("a directory")
    }

    /// The guide of the functions of `file` (a name under `src/`).
    pub(crate) fn guide(&self, file: &str) -> &'static str {
        let name = file.rsplit('/').next().unwrap_or(file);
        self.guides
            .iter()
            .find(|(n, _)| *n == file || *n == name || n.is_empty())
            .map(|(_, guide)| *guide)
            .expect("a default guide")
    }

    /// Whether the learner writes `file` (its path under `src/`, `/`-separated).
    pub(crate) fn writes(&self, file: &str) -> bool {
        let name = file.rsplit('/').next().unwrap_or(file);
        match self.sources {
            Sources::AllBut(kept) => !kept.contains(&name),
            Sources::Only(written) => written.contains(&file),
        }
    }

    /// The files under `src/` the learner writes, for cargo-mutants' `--file` (`None`: the
    /// whole crate, minus `.cargo/mutants.toml`'s exclusions).
    pub(crate) fn graded_files(&self) -> Option<Vec<String>> {
        match self.sources {
            Sources::AllBut(_) => None,
            Sources::Only(written) => Some(
                written
                    .iter()
                    .map(|f| format!("{}/src/{f}", self.dir))
                    .collect(),
            ),
        }
    }
}

/// What kind of check a course test is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A fixed input with a hand-computed answer.
    Unit,
    /// A law checked over many generated inputs.
    Property,
    /// Edge cases and failure paths.
    Boundary,
    /// Two computations that must agree.
    Differential,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Unit => "unit",
            Kind::Property => "property",
            Kind::Boundary => "boundary",
            Kind::Differential => "differential",
        }
    }
}

/// One course test.
#[derive(Debug)]
pub(crate) struct CourseTest {
    /// The test function's name (and the chapter's table's).
    pub(crate) name: &'static str,
    /// The module of the course test binary that holds it.
    pub(crate) module: &'static str,
    pub(crate) kind: Kind,
    /// What it checks.
    pub(crate) checks: &'static str,
    /// Why it matters further on.
    pub(crate) matters: &'static str,
}

impl CourseTest {
    /// The test's path inside its test binary, for an exact filter.
    pub(crate) fn path(&self) -> String {
        format!("{}::{}", self.module, self.name)
    }
}

/// A [`CourseTest`], positionally: the catalogs' tables read better without field names.
pub(crate) const fn test(
    name: &'static str,
    module: &'static str,
    kind: Kind,
    checks: &'static str,
    matters: &'static str,
) -> CourseTest {
    CourseTest {
        name,
        module,
        kind,
        checks,
        matters,
    }
}

/// One planted bug.
#[derive(Debug)]
pub(crate) struct Pitfall {
    /// Its id, as in the chapter: a letter of the chapter's and two digits (`s01`).
    pub(crate) id: &'static str,
    /// The pitfall in one line.
    pub(crate) description: &'static str,
    /// The package whose own tests must catch it.
    pub(crate) package: &'static str,
    /// The file, relative to the workspace root.
    pub(crate) file: &'static str,
    /// The function the bug is planted in: `name` for a free function, `Type::name` for a
    /// method of an `impl` block for `Type`; it must be defined exactly once in the file.
    pub(crate) function: &'static str,
    /// The code replaced, whitespace between tokens insignificant; it must occur exactly once
    /// in the function's body, outside comments.
    pub(crate) pattern: &'static str,
    /// What it is replaced with: the bug.
    pub(crate) replacement: &'static str,
    /// The course test of the chapter's table expected to catch it.
    pub(crate) course_test: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::anchor;

    #[test]
    fn unknown_module_lists_the_known_ones() {
        let err = chapter("L9.9").unwrap_err();
        assert!(err.contains("L9.9") && err.contains("L11.1"), "{err}");
        assert_eq!(chapter("L11.1").unwrap().name, "L11.1");
    }

    #[test]
    fn names_and_ids_are_unique_and_each_pitfall_lies_in_its_chapter() {
        let mut ids: Vec<&str> = CHAPTERS
            .iter()
            .flat_map(|c| c.pitfalls.iter().map(|p| p.id))
            .collect();
        let count = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), count, "a pitfall id is used twice");
        for chapter in CHAPTERS {
            let mut names: Vec<&str> = chapter.tests.iter().map(|t| t.name).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(
                names.len(),
                chapter.tests.len(),
                "{}: a test twice",
                chapter.name
            );
            for p in chapter.pitfalls {
                let learner = chapter
                    .crates
                    .iter()
                    .find(|c| c.package() == p.package)
                    .unwrap_or_else(|| panic!("{}: {} is not the chapter's", p.id, p.package));
                assert!(
                    p.file.starts_with(&format!("{}/src/", learner.dir)),
                    "{}: {} is outside {}",
                    p.id,
                    p.file,
                    p.package
                );
                assert_ne!(p.pattern, p.replacement, "{}: it changes nothing", p.id);
                assert!(
                    chapter.tests.iter().any(|t| t.name == p.course_test),
                    "{}: {} is not a course test of {}",
                    p.id,
                    p.course_test,
                    chapter.name
                );
            }
        }
    }

    #[test]
    fn every_course_test_exists() {
        let root = crate::workspace_root();
        for chapter in CHAPTERS {
            for test in chapter.tests {
                let file = root.join(format!("tests/{}/{}.rs", chapter.test_binary, test.module));
                let source = std::fs::read_to_string(&file).expect("course test file");
                assert!(
                    source.contains(&format!("fn {}(", test.name)),
                    "{} is not defined in {}",
                    test.name,
                    file.display()
                );
            }
        }
    }

    #[test]
    fn every_pitfall_applies_exactly_once() {
        let root = crate::workspace_root();
        let rotted: Vec<String> = CHAPTERS
            .iter()
            .flat_map(|c| c.pitfalls)
            .filter_map(|p| {
                let source = std::fs::read_to_string(root.join(p.file)).unwrap_or_default();
                let mutated = anchor::replace_in(&source, p.function, p.pattern, p.replacement);
                match mutated {
                    Ok(mutated) if mutated != source => None,
                    Ok(_) => Some(format!(
                        "{} in {}: the mutant changes nothing",
                        p.id, p.file
                    )),
                    Err(why) => Some(format!("{} in {}: {why}", p.id, p.file)),
                }
            })
            .collect();
        assert!(
            rotted.is_empty(),
            "rotted pitfall mutants:\n{}",
            rotted.join("\n")
        );
    }

    #[test]
    fn a_learner_writes_what_its_sources_say() {
        let l11_1 = chapter("L11.1").unwrap();
        let precision = &l11_1.crates[0];
        assert!(precision.writes("cast.rs") && !precision.writes("fp8.rs"));
        assert_eq!(precision.graded_files(), None);
        let only = LearnerCrate {
            dir: "crates/x",
            guides: &[("a.rs", "A.md"), ("", "X.md")],
            starter: "",
            sources: Sources::Only(&["a.rs", "b/c.rs"]),
            own_tests: &[],
        };
        assert!(only.writes("a.rs") && only.writes("b/c.rs"));
        assert!(!only.writes("c.rs") && !only.writes("lib.rs"));
        assert_eq!(only.guide("a.rs"), "A.md");
        assert_eq!(only.guide("b/c.rs"), "X.md");
        assert_eq!(
            only.graded_files(),
            Some(vec![
                "crates/x/src/a.rs".into(),
                "crates/x/src/b/c.rs".into()
            ])
        );
    }
}
