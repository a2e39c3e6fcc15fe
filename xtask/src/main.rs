//! The course harness for this workspace.
//!
//! ```text
//! cargo xtask start MODULE [--into DIR]               a learner's workspace: the stubs
//! cargo xtask tests MODULE                            the course test catalog
//! cargo xtask check MODULE [--ref-deps] [--pitfalls-only] [--jobs N]   course tests, then the grade
//! cargo xtask mutate [MODULE] [--ref-deps] [--pitfalls-only] [--jobs N] the grade alone
//! cargo xtask diff MODULE                             after a passing check: yours against the reference
//! ```
//!
//! MODULE is a chapter: L11.1 (mixed precision, loss scaling, accumulation, checkpointing),
//! L11.2 (the ring all-reduce), L11.3 (data parallelism and ZeRO). Each is a table in
//! `chapters/`. The grade has two parts: the chapter's pitfall mutants, each planted in a
//! scratch copy of the workspace and required to be caught by the crate's own tests (and by
//! its named course test); and cargo-mutants' score over the code the learner writes, which
//! must reach 0.80 per crate.

mod anchor;
mod chapters;
mod grade;
mod planted;
mod report;
mod run;
mod scratch;
mod start;
mod stub;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

const USAGE: &str = "usage:
  cargo xtask start <MODULE> [--into DIR]                  a learner's workspace: the chapter's crates as stubs
  cargo xtask tests <MODULE>                               print the course test catalog
  cargo xtask check <MODULE> [--ref-deps] [--pitfalls-only] [--jobs N]  course tests, then the full grade
  cargo xtask mutate [<MODULE>] [--ref-deps] [--pitfalls-only] [--jobs N] [--only s04,s17] [--shard K/N]  the grade alone
  (--ref-deps: in a learner's workspace, the reference stands in for a crate with todo!s left)
  cargo xtask diff <MODULE>                                a learner's code against the reference, once check passes
modules: L11.1, L11.2, L11.3 (a learner's workspace: mutate defaults to its own)";

/// The workspace the harness works on: the nearest directory at or above the current one
/// that holds this course's layout (`Cargo.toml`, `xtask/`, the chapter's crates), as cargo
/// finds its workspace; else the one this harness was built in. So a harness binary run in
/// a learner's tree grades that tree.
pub(crate) fn workspace_root() -> PathBuf {
    let course = |dir: &std::path::Path| {
        dir.join("Cargo.toml").is_file()
            && dir.join("xtask").join("Cargo.toml").is_file()
            && chapters::all_packages()
                .iter()
                .all(|p| dir.join("crates").join(p).join("Cargo.toml").is_file())
    };
    std::env::current_dir()
        .ok()
        .and_then(|cwd| cwd.ancestors().find(|d| course(d)).map(PathBuf::from))
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .expect("xtask lives in the workspace")
                .to_path_buf()
        })
}

#[derive(Debug, PartialEq)]
enum Command {
    Start {
        module: String,
        into: Option<PathBuf>,
    },
    Diff {
        module: String,
    },
    Tests {
        module: String,
    },
    Check {
        module: String,
        options: GradeOptions,
    },
    Mutate {
        module: String,
        options: GradeOptions,
    },
    Help,
}

#[derive(Debug, PartialEq, Clone)]
struct GradeOptions {
    pitfalls_only: bool,
    jobs: usize,
    /// Plant only these pitfalls (`--only s04,s17`); empty means all.
    only: Vec<String>,
    /// Run one shard `k/n` of cargo-mutants' mutants (`--shard 0/4`), to split the grade.
    shard: Option<String>,
    /// In a learner's workspace, the reference stands in for a crate whose bodies are not
    /// all written yet, and only the others are graded.
    ref_deps: bool,
}

fn parse(args: &[String]) -> Result<Command, String> {
    let Some((command, rest)) = args.split_first() else {
        return Ok(Command::Help);
    };
    let mut module = None;
    let mut options = GradeOptions {
        pitfalls_only: false,
        jobs: 1,
        only: Vec::new(),
        shard: None,
        ref_deps: false,
    };
    let mut into = None;
    let mut rest = rest.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--into" if command == "start" => {
                into = Some(PathBuf::from(
                    rest.next().ok_or("--into needs a directory")?,
                ));
            }
            "--pitfalls-only" if !matches!(command.as_str(), "tests" | "start" | "diff") => {
                options.pitfalls_only = true
            }
            "--ref-deps" if !matches!(command.as_str(), "tests" | "start" | "diff") => {
                options.ref_deps = true
            }
            "--jobs" | "-j" if !matches!(command.as_str(), "tests" | "start" | "diff") => {
                let value = rest.next().ok_or("--jobs needs a number")?;
                options.jobs = value
                    .parse()
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| format!("--jobs takes a whole number ≥ 1, not '{value}'"))?;
            }
            "--only" if !matches!(command.as_str(), "tests" | "start" | "diff") => {
                let value = rest
                    .next()
                    .ok_or("--only needs pitfall ids, e.g. s04,s17")?;
                options.only.extend(value.split(',').map(str::to_string));
            }
            "--shard" if !matches!(command.as_str(), "tests" | "start" | "diff") => {
                let value = rest.next().ok_or("--shard needs K/N, e.g. 0/4")?;
                let valid = value.split_once('/').is_some_and(|(k, n)| {
                    matches!((k.parse::<u32>(), n.parse::<u32>()), (Ok(k), Ok(n)) if k < n)
                });
                if !valid {
                    return Err(format!(
                        "--shard takes K/N with K < N, e.g. 0/4, not '{value}'"
                    ));
                }
                options.shard = Some(value.clone());
            }
            flag if flag.starts_with('-') => {
                let known = if command == "tests" || command == "diff" {
                    "(none)"
                } else if command == "start" {
                    "--into DIR"
                } else {
                    "--ref-deps, --pitfalls-only, --jobs N, --only s01,s02,.., --shard K/N"
                };
                return Err(format!(
                    "unknown flag '{flag}' for '{command}'; flags: {known}"
                ));
            }
            name if module.is_none() => module = Some(chapters::chapter(name)?.name.to_string()),
            extra => return Err(format!("unexpected argument '{extra}'")),
        }
    }
    let default_module = || {
        start::learner_module(&workspace_root())
            .filter(|m| chapters::chapter(m).is_ok())
            .unwrap_or_else(|| chapters::CHAPTERS[0].name.to_string())
    };
    let module = match (module, command.as_str()) {
        (None, "mutate") => Some(default_module()),
        (module, _) => module,
    };
    if let Some(name) = &module {
        let chapter = chapters::chapter(name)?;
        for id in &options.only {
            if !chapter.pitfalls.iter().any(|p| p.id == id) {
                let ids: Vec<&str> = chapter.pitfalls.iter().map(|p| p.id).collect();
                return Err(format!(
                    "--only: {name} has no pitfall '{id}'; its ids are {} to {}",
                    ids.first().unwrap_or(&"-"),
                    ids.last().unwrap_or(&"-")
                ));
            }
        }
    }
    match command.as_str() {
        "start" => Ok(Command::Start {
            module: module.ok_or("'start' needs a module, e.g. L11.1")?,
            into,
        }),
        "tests" => Ok(Command::Tests {
            module: module.ok_or("'tests' needs a module, e.g. L11.1")?,
        }),
        "diff" => Ok(Command::Diff {
            module: module.ok_or("'diff' needs a module, e.g. L11.1")?,
        }),
        "check" => Ok(Command::Check {
            module: module.ok_or("'check' needs a module, e.g. L11.1")?,
            options,
        }),
        "mutate" => Ok(Command::Mutate {
            module: module.expect("mutate has a default"),
            options,
        }),
        "help" | "--help" | "-h" => Ok(Command::Help),
        other => Err(format!(
            "unknown command '{other}'; commands: start, tests, check, mutate, diff"
        )),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = match parse(&args) {
        Ok(command) => command,
        Err(message) => {
            eprintln!("error: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcome = match command {
        Command::Help => {
            println!("{USAGE}");
            Ok(true)
        }
        Command::Start { module, into } => {
            let chapter = chapters::chapter(&module).expect("parsed");
            start::cache_root()
                .and_then(|cache| start::start(chapter, &workspace_root(), into.as_deref(), &cache))
                .map(|started| {
                    report::print_started(chapter, &started);
                    true
                })
        }
        Command::Diff { module } => diff(&module, &workspace_root()),
        Command::Tests { module } => {
            report::print_catalog(chapters::chapter(&module).expect("parsed"));
            Ok(true)
        }
        Command::Check { module, options } => check(&module, options),
        Command::Mutate { module, options } => {
            let chapter = chapters::chapter(&module).expect("parsed");
            start::unfinished(chapter, &workspace_root())
                .and_then(|unfinished| mutate(chapter, options, unfinished))
                .map(|grade| {
                    report::print_grade(&grade);
                    grade.passes()
                })
        }
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Everything the grade found.
pub(crate) struct Grade {
    /// The chapter graded.
    pub(crate) chapter: &'static chapters::Chapter,
    pub(crate) planted: Vec<planted::PlantedResult>,
    /// `None` with --pitfalls-only.
    pub(crate) crates: Option<Vec<grade::CrateGrade>>,
    pub(crate) elapsed: Duration,
    /// Graded a learner's tests (a workspace made by `start`), not the reference's.
    pub(crate) learner: bool,
    /// The learner's crates with bodies still to write: not graded by cargo-mutants.
    pub(crate) unfinished: Vec<start::Unfinished>,
    /// `--ref-deps`: the reference stood in for the unfinished crates.
    pub(crate) ref_deps: bool,
}

impl Grade {
    pub(crate) fn passes(&self) -> bool {
        (self.unfinished.is_empty() || self.ref_deps)
            && self.planted.iter().all(planted::PlantedResult::passes)
            && self
                .crates
                .as_ref()
                .is_none_or(|crates| crates.iter().all(grade::CrateGrade::passes))
    }
}

/// The grade of `options`, given the learner's crates still `unfinished` (none here).
fn mutate(
    chapter: &'static chapters::Chapter,
    options: GradeOptions,
    unfinished: Vec<start::Unfinished>,
) -> Result<Grade, String> {
    let start = Instant::now();
    let workspace = workspace_root();
    if !options.pitfalls_only && !run::has_subcommand("mutants") {
        return Err(grade::INSTALL_HINT.to_string());
    }
    let reference = start::learner_reference(&workspace);
    if let Some(reference) = &reference
        && !reference.join("COMPLETE").exists()
    {
        return Err(format!(
            "this learner's workspace names its reference at {}, which is gone; run `cargo \
             xtask start {} --into NEW_DIR` from the course repository again and copy your \
             crates' src/ and tests/ over",
            reference.display(),
            chapter.name
        ));
    }
    let mode = match &reference {
        Some(reference) => planted::Mode::Learner { reference },
        None => planted::Mode::Reference,
    };
    // With --ref-deps, an unfinished crate is not graded at all: the reference stands in.
    let graded: Vec<&'static str> = chapter
        .packages()
        .into_iter()
        .filter(|p| !options.ref_deps || unfinished.iter().all(|u| u.package != *p))
        .collect();
    if graded.is_empty() {
        return Err(
            "every crate of the chapter still has todo!s: write one crate's bodies first, then \
             check it with --ref-deps"
                .into(),
        );
    }
    let tool = run::TestTool::detect();
    let plan = planted::Plan {
        chapter,
        jobs: options.jobs,
        only: &options.only,
        packages: &graded,
        mode,
        tool,
    };
    let planted = planted::run_all(&workspace, &plan)?;
    let crates = if options.pitfalls_only {
        None
    } else {
        // cargo-mutants mutates the crates of this tree (the learner's own code, in a
        // learner's workspace) and runs their tests; a crate with stubs left has nothing
        // to mutate yet.
        let name = if reference.is_some() {
            "scratch-learner"
        } else {
            "scratch-0"
        };
        let copies = if options.shard.is_some() {
            1
        } else {
            options.jobs
        };
        let scratches: Vec<scratch::Scratch> = (0..copies)
            .map(|i| match i {
                // In this repository the first copy is the pitfalls' (the same code):
                // its builds are warm.
                0 if reference.is_none() => {
                    scratch::Scratch::sync(&workspace, name, scratch::Slot::pitfalls(0))
                }
                0 => scratch::Scratch::sync(&workspace, name, scratch::Slot::mutants(0)),
                i => scratch::Scratch::sync(
                    &workspace,
                    &format!("{name}-{i}"),
                    scratch::Slot::mutants(i),
                ),
            })
            .collect::<Result<_, _>>()
            .map_err(|e| format!("cannot prepare the scratch copy: {e}"))?;
        let grades = graded
            .iter()
            .filter(|p| unfinished.iter().all(|u| u.package != **p))
            .map(|package| {
                eprintln!("xtask: cargo-mutants over {package}…");
                let learner = chapter
                    .crates
                    .iter()
                    .find(|c| c.package() == *package)
                    .expect("a chapter's package");
                grade::grade_crate(
                    &workspace,
                    &scratches,
                    learner,
                    options.shard.as_deref(),
                    tool,
                    reference.is_some(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Some(grades)
    };
    Ok(Grade {
        chapter,
        planted,
        crates,
        elapsed: start.elapsed(),
        learner: reference.is_some(),
        unfinished,
        ref_deps: options.ref_deps,
    })
}

fn check(module: &str, options: GradeOptions) -> Result<bool, String> {
    let module = chapters::chapter(module)?;
    let workspace = workspace_root();
    let full = !options.pitfalls_only && options.only.is_empty() && options.shard.is_none();
    if !options.pitfalls_only && !run::has_subcommand("mutants") {
        // Said before the course tests run, not minutes after.
        return Err(format!(
            "{}; or, for the course tests and the pitfalls alone: cargo xtask check {} \
             --pitfalls-only",
            grade::INSTALL_HINT,
            module.name
        ));
    }
    let before = start::learner_sources_hash(module, &workspace)?;
    let unfinished = start::unfinished(module, &workspace)?;
    let stand_ins: Vec<&'static str> = if options.ref_deps {
        unfinished.iter().map(|u| u.package).collect()
    } else {
        Vec::new()
    };
    eprintln!("xtask: running the course tests of {}…", module.name);
    let course = if stand_ins.is_empty() {
        let slot = scratch::Slot::COURSE.of(&workspace);
        report::run_course_tests(module, &workspace, None, slot)?
    } else {
        // The learner's tree with the reference's sources in the unfinished crates.
        let reference = start::learner_reference(&workspace).ok_or(
            "--ref-deps needs a learner's workspace (made by cargo xtask start), whose \
             reference can stand in",
        )?;
        let scratch = planted::prepare_scratch(
            &workspace,
            "scratch-course",
            scratch::Slot::COURSE_REF,
            Some((&reference, module, &stand_ins)),
        )
        .map_err(|e| format!("cannot prepare the scratch copy: {e}"))?;
        report::run_course_tests(
            module,
            &scratch.root,
            Some(&scratch.target_dir),
            scratch.slot,
        )?
    };
    let grade = mutate(module, options, unfinished)?;
    let full = full && stand_ins.is_empty();
    let passed = report::print_check(module, &course, &grade);
    if grade.learner {
        // `diff` shows the reference only once a full check passed on these very sources.
        let stamp = start::passed_stamp(&workspace);
        let _ = std::fs::remove_file(&stamp);
        if passed && full && start::learner_sources_hash(module, &workspace)? == before {
            std::fs::create_dir_all(stamp.parent().expect("under target"))
                .and_then(|()| std::fs::write(&stamp, format!("{before:016x}\n")))
                .map_err(|e| format!("{}: {e}", stamp.display()))?;
            println!(
                "\nNext: cargo xtask diff {}   # your code against the reference",
                module.name
            );
        }
    }
    Ok(passed)
}

/// `diff`: the learner's crates in `workspace` against the reference, once a full check has
/// passed on them; `Ok(false)` (and nothing shown) before.
fn diff(module: &str, workspace: &std::path::Path) -> Result<bool, String> {
    let chapter = chapters::chapter(module)?;
    let Some(reference) = start::learner_reference(workspace) else {
        return Err(format!(
            "diff compares a learner's workspace with the reference; this is the reference \
             itself (make a learner's workspace with `cargo xtask start {module} --into DIR`)"
        ));
    };
    let stamp = std::fs::read_to_string(start::passed_stamp(workspace)).unwrap_or_default();
    let now = format!("{:016x}", start::learner_sources_hash(chapter, workspace)?);
    if stamp.trim() != now {
        println!(
            "The reference is shown once `cargo xtask check {module}` passes in full on your \
             current code and tests ({}).",
            if stamp.is_empty() {
                "it has not passed yet"
            } else {
                "they changed since it last passed"
            }
        );
        return Ok(false);
    }
    for learner in chapter.crates {
        let (theirs, yours) = (
            reference.join(learner.dir).join("src"),
            workspace.join(learner.dir).join("src"),
        );
        println!(
            "== {}/src: the reference (---) against yours (+++)",
            learner.dir
        );
        let shown = std::process::Command::new("git")
            .args(["diff", "--no-index", "--"])
            .arg(&theirs)
            .arg(&yours)
            .status()
            .or_else(|_| {
                std::process::Command::new("diff")
                    .arg("-ru")
                    .arg(&theirs)
                    .arg(&yours)
                    .status()
            })
            .map_err(|e| format!("neither git nor diff runs here: {e}"))?;
        // Both exit with 1 when the trees differ, which is what they are for.
        if !matches!(shown.code(), Some(0 | 1)) {
            return Err(format!("comparing {} failed", learner.dir));
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn parses_the_three_commands() {
        assert_eq!(
            parse(&args(&["tests", "L11.1"])),
            Ok(Command::Tests {
                module: "L11.1".into()
            })
        );
        assert_eq!(
            parse(&args(&["check", "L11.1", "--jobs", "2"])),
            Ok(Command::Check {
                module: "L11.1".into(),
                options: GradeOptions {
                    pitfalls_only: false,
                    jobs: 2,
                    only: vec![],
                    shard: None,
                    ref_deps: false,
                }
            })
        );
        let Ok(Command::Check { options, .. }) = parse(&args(&["check", "L11.1", "--ref-deps"]))
        else {
            panic!("check --ref-deps parses");
        };
        assert!(options.ref_deps && !options.pitfalls_only);
        assert!(parse(&args(&["tests", "L11.1", "--ref-deps"])).is_err());
        assert_eq!(
            parse(&args(&["mutate", "--pitfalls-only"])),
            Ok(Command::Mutate {
                module: "L11.1".into(),
                options: GradeOptions {
                    pitfalls_only: true,
                    jobs: 1,
                    only: vec![],
                    shard: None,
                    ref_deps: false,
                }
            })
        );
    }

    #[test]
    fn diff_shows_the_reference_only_after_a_full_check_passed_on_these_sources() {
        let base = std::env::temp_dir().join(format!("xtask-diff-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (learner, reference) = (base.join("learner"), base.join("reference"));
        for root in [&learner, &reference] {
            for krate in chapters::chapter("L11.1").unwrap().crates {
                let src = root.join(krate.dir).join("src");
                std::fs::create_dir_all(&src).unwrap();
                std::fs::write(src.join("lib.rs"), format!("// {}\n", root.display())).unwrap();
            }
        }
        assert!(
            diff("L11.1", &workspace_root())
                .unwrap_err()
                .contains("the reference itself")
        );
        std::fs::write(
            learner.join(start::MARKER),
            format!("module = L11.1\nreference = {}\n", reference.display()),
        )
        .unwrap();
        assert_eq!(diff("L11.1", &learner), Ok(false), "no check has passed");
        let stamp = start::passed_stamp(&learner);
        std::fs::create_dir_all(stamp.parent().unwrap()).unwrap();
        let l11_1 = chapters::chapter("L11.1").unwrap();
        let hash = start::learner_sources_hash(l11_1, &learner).unwrap();
        std::fs::write(&stamp, format!("{hash:016x}\n")).unwrap();
        assert_eq!(diff("L11.1", &learner), Ok(true));
        // Changed after passing: check again first.
        std::fs::write(
            learner.join("crates/tl-precision/src/lib.rs"),
            "// edited\n",
        )
        .unwrap();
        assert_eq!(diff("L11.1", &learner), Ok(false));
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn parses_start_with_and_without_a_directory() {
        assert_eq!(
            parse(&args(&["start", "L11.1", "--into", "my-l11"])),
            Ok(Command::Start {
                module: "L11.1".into(),
                into: Some(PathBuf::from("my-l11")),
            })
        );
        assert_eq!(
            parse(&args(&["start", "L11.1"])),
            Ok(Command::Start {
                module: "L11.1".into(),
                into: None,
            })
        );
        assert!(
            parse(&args(&["start"]))
                .unwrap_err()
                .contains("needs a module")
        );
        assert!(parse(&args(&["start", "L11.1", "--into"])).is_err());
        let grading_flag = parse(&args(&["start", "L11.1", "--jobs", "2"])).unwrap_err();
        assert!(grading_flag.contains("--into DIR"), "{grading_flag}");
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        let unknown_module = parse(&args(&["check", "L2.3"])).unwrap_err();
        assert!(unknown_module.contains("L11.1"), "{unknown_module}");
        let unknown_flag = parse(&args(&["mutate", "--fast"])).unwrap_err();
        assert!(unknown_flag.contains("--pitfalls-only"), "{unknown_flag}");
        let unknown_command = parse(&args(&["grade"])).unwrap_err();
        assert!(
            unknown_command.contains("tests, check, mutate"),
            "{unknown_command}"
        );
        assert!(parse(&args(&["mutate", "--jobs", "0"])).is_err());
        assert!(parse(&args(&["tests"])).is_err());
        assert!(parse(&args(&["mutate", "--shard", "4/4"])).is_err());
        assert!(parse(&args(&["mutate", "--shard", "1/4"])).is_ok());
        let unknown_pitfall = parse(&args(&["mutate", "--only", "s04,s99"])).unwrap_err();
        assert!(unknown_pitfall.contains("s99"), "{unknown_pitfall}");
        match parse(&args(&["mutate", "--only", "s04,s17"])) {
            Ok(Command::Mutate { options, .. }) => assert_eq!(options.only, ["s04", "s17"]),
            other => panic!("{other:?}"),
        }
    }
}
