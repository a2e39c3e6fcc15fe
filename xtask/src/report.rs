//! What the harness prints: the catalog, the course test results and the grade.

use std::time::Duration;

use crate::chapters::Chapter as Module;
use crate::grade::THRESHOLD;
use crate::{Grade, run};

/// Prints each course test with its kind, what it checks, why it matters, and the pitfalls
/// it is expected to catch.
pub(crate) fn print_catalog(module: &Module) {
    println!("{} — {}\n", module.name, module.title);
    for test in module.tests {
        let pitfalls: Vec<String> = module
            .pitfalls
            .iter()
            .filter(|p| p.course_test == test.name)
            .map(|p| format!("{} ({})", p.id, p.description))
            .collect();
        println!("{}  [{}]", test.name, test.kind.name());
        println!("    checks:   {}", test.checks);
        println!("    matters:  {}", test.matters);
        if pitfalls.is_empty() {
            println!("    catches:  -");
        } else {
            println!("    catches:  {}", pitfalls.join("; "));
        }
        println!();
    }
    println!(
        "{} tests; run them with: {}",
        module.tests.len(),
        module.course_command()
    );
}

/// What `start` made, and what to do next.
pub(crate) fn print_started(chapter: &Module, started: &crate::start::Started) {
    let dir = started.workspace.display();
    let module = chapter.name;
    println!("{module}: your workspace is {dir}\n");
    for learner in chapter.crates {
        match learner.sources {
            crate::chapters::Sources::AllBut(_) => println!(
                "  {}/src     the stubs: every body is a todo! naming what to write and the guide to read",
                learner.dir
            ),
            crate::chapters::Sources::Only(files) => {
                for file in files {
                    println!(
                        "  {}/src/{file}     the stubs: every body is a todo! naming what to write and the guide to read",
                        learner.dir
                    );
                }
            }
        }
        println!(
            "  {}/tests   your tests (one worked example to start from)",
            learner.dir
        );
    }
    println!(
        "\nThe reference implementation is kept outside your tree, in {}.",
        started.reference.display()
    );
    println!("\nNext:");
    println!("  cd {dir}");
    println!("  cargo xtask tests {module}     # the course tests: read the catalog first");
    println!(
        "  {}   # they fail, naming the function to write",
        chapter.course_command()
    );
    println!("  cargo xtask check {module}     # the course tests, then your tests graded");
    if chapter.crates.len() > 1 {
        println!(
            "  cargo xtask check {module} --ref-deps   # one crate done: the reference stands in for the other"
        );
    }
}

/// Pass/fail of each course test, by name.
pub(crate) struct CourseResults {
    pub(crate) results: Vec<(&'static str, Option<bool>)>,
}

impl CourseResults {
    pub(crate) fn all_pass(&self) -> bool {
        self.results.iter().all(|(_, r)| *r == Some(true))
    }
}

/// Runs the course test binary once and reads each test's result from libtest's output.
/// The tests run in the workspace at `dir`, building into `target_dir` (or cargo's default)
/// in `slot`, apart from the workspace's own builds.
pub(crate) fn run_course_tests(
    module: &Module,
    dir: &std::path::Path,
    target_dir: Option<&std::path::Path>,
    slot: crate::scratch::Slot,
) -> Result<CourseResults, String> {
    let slot = slot.args();
    let args = crate::scratch::with_after_subcommand(
        &[
            "test",
            "-p",
            module.course_package,
            "--test",
            module.test_binary,
            "--no-fail-fast",
        ],
        &slot,
    );
    let outcome = run::cargo(dir, target_dir, &args, Duration::from_secs(30 * 60))
        .map_err(|e| format!("cannot run the course tests: {e}"))?;
    if !outcome.output.contains("running ") {
        return Err(format!(
            "the course tests did not build:\n{}",
            run::tail(&outcome.output, 30)
        ));
    }
    let results = module
        .tests
        .iter()
        .map(|test| {
            let line = format!("test {} ... ", test.path());
            let result = outcome.output.lines().find_map(|l| {
                l.strip_prefix(&line)
                    .map(|rest| rest.trim_start().starts_with("ok"))
            });
            (test.name, result)
        })
        .collect();
    Ok(CourseResults { results })
}

fn mark(ok: bool) -> &'static str {
    if ok { "ok" } else { "FAIL" }
}

/// Prints the pitfall table and the per-crate scores.
pub(crate) fn print_grade(grade: &Grade) {
    println!("\nPitfall mutants (planted in a scratch copy; own tests must catch each):");
    // The pitfall column as wide as the longest description, so the columns line up.
    let width = (grade.planted.iter())
        .map(|r| r.pitfall.description.chars().count())
        .max()
        .unwrap_or(0)
        .max("pitfall".len());
    println!(
        "{:<4} {:<width$} {:<9} {:<7} course test",
        "id", "pitfall", "own", "course"
    );
    for r in &grade.planted {
        let course = match r.course_caught {
            Some(true) => "caught",
            Some(false) => "MISSED",
            None => "-",
        };
        println!(
            "{:<4} {:<width$} {:<9} {:<7} {}",
            r.pitfall.id,
            r.pitfall.description,
            r.own.label(),
            course,
            r.pitfall.course_test
        );
    }
    let missed: Vec<&str> = grade
        .planted
        .iter()
        .filter(|r| !r.own.is_caught())
        .map(|r| r.pitfall.id)
        .collect();
    if grade.learner {
        for r in grade.planted.iter().filter(|r| !r.own.is_caught()) {
            println!(
                "\n{} not caught: none of your tests of {} fails when {} (the course test {} \
                 shows one way to catch it)",
                r.pitfall.id, r.pitfall.package, r.pitfall.description, r.pitfall.course_test
            );
        }
    } else if !missed.is_empty() {
        println!(
            "\nNot caught by the crates' own tests: {} — write the test that fails on each.",
            missed.join(", ")
        );
    }
    if let Some(crates) = &grade.crates {
        println!("\nMutation grade (cargo-mutants, own tests; threshold {THRESHOLD:.2}):");
        for c in crates {
            println!(
                "  {:<14} score {:.3}  caught {}  timeout {}  missed {}  unviable {}  {}",
                c.package,
                c.score(),
                c.caught,
                c.timeout,
                c.missed.len(),
                c.unviable,
                mark(c.passes())
            );
            for m in &c.missed {
                println!("      missed: {m}");
            }
        }
    } else {
        println!("\n(cargo-mutants grade skipped: --pitfalls-only)");
    }
    print_unfinished(grade);
    println!("\ntook {:.0} s", grade.elapsed.as_secs_f64());
    let passed = grade.planted.iter().filter(|r| r.passes()).count();
    // The plain closing line CI reads: a pitfall passes when both its tests catch it.
    println!(
        "pitfalls: {passed} passed, {} failed",
        grade.planted.len() - passed
    );
}

/// What the learner has left to write, crate by crate, and what the check did about it.
fn print_unfinished(grade: &Grade) {
    let others = |package: &str| -> String {
        grade
            .chapter
            .packages()
            .into_iter()
            .filter(|p| *p != package && grade.unfinished.iter().all(|u| u.package != *p))
            .collect::<Vec<_>>()
            .join(" and ")
    };
    for u in &grade.unfinished {
        let (file, function) = &u.first;
        if grade.ref_deps {
            println!(
                "\n{}: the reference stood in for it (--ref-deps); {} bod{} of yours left to \
                 write, starting with `{function}` in {file}. Its pitfalls and mutation grade \
                 wait until they are written.",
                u.package,
                u.stubs,
                if u.stubs == 1 { "y" } else { "ies" }
            );
        } else {
            let alone = others(u.package);
            println!(
                "\n{}: {} bod{} left to write, starting with `{function}` in {file}; its course \
                 tests fail and its mutation grade waits until they are written.{}",
                u.package,
                u.stubs,
                if u.stubs == 1 { "y is" } else { "ies are" },
                if alone.is_empty() {
                    String::new()
                } else {
                    format!(
                        " To check {alone} meanwhile, with the reference standing in for {}: \
                         cargo xtask check {} --ref-deps",
                        u.package, grade.chapter.name
                    )
                }
            );
        }
    }
}

/// Prints the course results, the grade and one summary table; returns whether all holds.
pub(crate) fn print_check(module: &Module, course: &CourseResults, grade: &Grade) -> bool {
    println!("Course tests of {}:", module.name);
    for (name, result) in &course.results {
        let label = match result {
            Some(true) => "ok",
            Some(false) => "FAIL",
            None => "NOT RUN",
        };
        // What a failing course test guards against, so the learner knows where to look.
        let guards: Vec<String> = module
            .pitfalls
            .iter()
            .filter(|p| p.course_test == *name && *result != Some(true))
            .map(|p| format!("{}: {}", p.id, p.description))
            .collect();
        if guards.is_empty() {
            println!("  {label:<8} {name}");
        } else {
            println!("  {label:<8} {name}  (it catches {})", guards.join("; "));
        }
    }
    print_grade(grade);
    let own = grade.planted.iter().filter(|r| r.own.is_caught()).count();
    let by_course = grade
        .planted
        .iter()
        .filter(|r| r.course_caught == Some(true))
        .count();
    let passed = course
        .results
        .iter()
        .filter(|(_, r)| *r == Some(true))
        .count();
    let total = grade.planted.len();
    println!("\nSummary — {}", module.name);
    println!(
        "  {:<44} {:>7}  {}",
        "course tests passing",
        format!("{passed}/{}", course.results.len()),
        mark(course.all_pass())
    );
    let whose = if grade.learner {
        "pitfalls caught by your tests"
    } else {
        "pitfalls caught by the crates' own tests"
    };
    println!(
        "  {:<44} {:>7}  {}",
        whose,
        format!("{own}/{total}"),
        mark(own == total)
    );
    if !grade.learner {
        println!(
            "  {:<44} {:>7}  {}",
            "pitfalls caught by their named course test",
            format!("{by_course}/{total}"),
            mark(by_course == total)
        );
    }
    if let Some(crates) = &grade.crates {
        for c in crates {
            println!(
                "  {:<44} {:>7.3}  {}",
                format!("mutation score of {} (≥ {THRESHOLD:.2})", c.package),
                c.score(),
                mark(c.passes())
            );
        }
    }
    for u in &grade.unfinished {
        println!(
            "  {:<44} {:>7}  {}",
            format!("bodies left to write in {}", u.package),
            u.stubs,
            if grade.ref_deps {
                "reference stood in"
            } else {
                "FAIL"
            }
        );
    }
    let ok = course.all_pass() && grade.passes();
    let verdict = match (ok, grade.ref_deps && !grade.unfinished.is_empty()) {
        (false, _) => "FAIL".to_string(),
        (true, false) => "PASS".to_string(),
        (true, true) => {
            let stood_in: Vec<&str> = grade.unfinished.iter().map(|u| u.package).collect();
            format!(
                "PASS, in part: the reference stood in for {}",
                stood_in.join(", ")
            )
        }
    };
    println!(
        "  {:<44} {:>7}  {verdict}",
        format!("{} verdict", module.name),
        ""
    );
    ok
}
