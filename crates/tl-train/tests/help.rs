//! Snapshots of `tinyllm --help` and of every subcommand's help: a change of wording, a
//! flag gone or a default changed shows up in review as a diff of `tests/snapshots/`.
//!
//! After a deliberate change: `INSTA_UPDATE=always cargo test -p tl-train --test help`
//! (or `cargo insta review`), and read the diff before committing it.

use tl_train::cli::{CliError, run};

/// Every subcommand, as `tinyllm --help` lists it.
const COMMANDS: [&str; 13] = [
    "train",
    "sample",
    "export",
    "logits",
    "compare",
    "gradients",
    "plan",
    "profile",
    "bench",
    "launch",
    "comm-bench",
    "schedule",
    "tokenizer",
];

/// What `tinyllm ARGS.. --help` prints.
fn help(args: &[&str]) -> String {
    let argv = std::iter::once("tinyllm")
        .chain(args.iter().copied())
        .chain(["--help"]);
    match run(argv) {
        Err(CliError::Usage(error)) if error.kind() == clap::error::ErrorKind::DisplayHelp => {
            error.render().to_string()
        }
        other => panic!("tinyllm {args:?} --help: {other:?}"),
    }
}

#[test]
fn the_top_level_help_lists_every_real_subcommand() {
    let text = help(&[]);
    insta::assert_snapshot!("tinyllm", text);
    let listed: Vec<&str> = text
        .lines()
        .skip_while(|line| *line != "Commands:")
        .skip(1)
        .take_while(|line| !line.is_empty())
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .collect();
    assert_eq!(listed, COMMANDS);
}

#[test]
fn every_subcommand_has_a_help_in_users_words() {
    for command in COMMANDS {
        let text = help(&[command]);
        insta::assert_snapshot!(format!("tinyllm-{command}"), text);
        // Rust's names for things are not a user's words.
        for debug_name in ["PerBlock", "Some(", "None", "Budget("] {
            assert!(
                !text.contains(debug_name),
                "tinyllm {command} --help shows {debug_name}"
            );
        }
    }
}

#[test]
fn every_command_that_computes_takes_threads() {
    for command in [
        "train",
        "sample",
        "logits",
        "compare",
        "gradients",
        "plan",
        "profile",
        "bench",
    ] {
        assert!(
            help(&[command]).contains("--threads <N>"),
            "tinyllm {command} has no --threads"
        );
    }
}
