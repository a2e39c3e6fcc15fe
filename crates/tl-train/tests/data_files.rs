//! Training on the user's files: a BPE tokenizer trained by `tinyllm tokenizer train`, a
//! corpus from a directory or JSON Lines through the token cache, the reader's memory cap,
//! and resume noticing a changed file or tokenizer.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::{run_error, stdout_of, tinyllm};
use tl_train::TrainError;
use tl_train::cli::Exit;
use tl_train::data::{CacheOptions, Corpus, DEFAULT_CHUNK_BYTES, DataError, Manifest, Tokenizer};
use tl_train::store::fingerprint;
use tl_train::train::read_config;

/// The tiny preset, 2 × 2 sequences of 64 tokens a step, without a progress bar.
const TINY: [&str; 8] = [
    "train",
    "--preset",
    "tiny",
    "--micro-batch",
    "2",
    "--accum",
    "2",
    "--quiet",
];

/// Some 70 kB of English: this workspace's guides, one document each.
const GUIDES: [&str; 4] = [
    include_str!("../../../docs/training.md"),
    include_str!("../../../docs/mixed-precision.md"),
    include_str!("../../../docs/loss-scaling.md"),
    include_str!("../../../docs/gradient-accumulation.md"),
];

fn ok(args: &[&str]) {
    assert_eq!(tinyllm(args).unwrap(), Exit::Success, "tinyllm {args:?}");
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The guides as a directory: `a.txt`, `b.txt` and `part/c.txt`, `part/d.txt`.
fn guide_directory(root: &Path) -> PathBuf {
    let dir = root.join("guides");
    fs::create_dir_all(dir.join("part")).unwrap();
    for (name, text) in ["a.txt", "b.txt", "part/c.txt", "part/d.txt"]
        .iter()
        .zip(GUIDES)
    {
        fs::write(dir.join(name), text).unwrap();
    }
    fs::write(dir.join("README.md"), "not a .txt file: not read").unwrap();
    dir
}

fn train_tokenizer(data: &Path, vocab: usize, out: &Path) {
    ok(&[
        "tokenizer",
        "train",
        "--data",
        path(data),
        "--vocab-size",
        &vocab.to_string(),
        "--out",
        path(out),
    ]);
}

/// The one token cache under `root`: its manifest and its ids file.
fn only_cache(root: &Path) -> (Manifest, PathBuf) {
    let caches: Vec<PathBuf> = fs::read_dir(root)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    assert_eq!(caches.len(), 1, "{caches:?}");
    let manifest = serde_json::from_slice(&fs::read(caches[0].join("manifest.json")).unwrap());
    (manifest.unwrap(), caches[0].join("tokens.bin"))
}

#[test]
fn a_bpe_trained_twice_is_one_file_and_trains_a_model_on_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let data = guide_directory(dir.path());
    let tokenizer = dir.path().join("tokenizer.json");
    let again = dir.path().join("again.json");
    train_tokenizer(&data, 600, &tokenizer);
    train_tokenizer(&data, 600, &again);
    let bytes = fs::read(&tokenizer).unwrap();
    assert!(bytes == fs::read(&again).unwrap(), "two trainings differ");

    let run = dir.path().join("run");
    let mut args = TINY.to_vec();
    let tokenizer_arg = path(&tokenizer);
    args.extend(["--tokenizer", tokenizer_arg, "--data", path(&data)]);
    args.extend(["--steps", "3", "--out", path(&run)]);
    ok(&args);

    let config = read_config(&run).unwrap();
    assert_eq!(config.model.vocab, 600);
    let recorded = config.tokenizer.as_ref().unwrap();
    assert_eq!(recorded.sha256, fingerprint(&bytes));
    assert!(fs::read(run.join("tokenizer.json")).unwrap() == bytes);
    // The data's fingerprint: the SHA-256 of the files' `sha256sum` lines, in order.
    let listing: String = ["a.txt", "b.txt", "part/c.txt", "part/d.txt"]
        .iter()
        .map(|name| {
            let sha = fingerprint(&fs::read(data.join(name)).unwrap());
            format!("{sha}  {name}\n")
        })
        .collect();
    let data_file = config.data_file.as_ref().unwrap();
    assert_eq!(data_file.sha256, fingerprint(listing.as_bytes()));
    let total: usize = GUIDES.iter().map(|g| g.len()).sum();
    assert_eq!(data_file.bytes, total as u64);

    // The cache beside the run: four documents, u16 ids, three end-of-text ids between.
    let (manifest, ids) = only_cache(&dir.path().join("token-cache"));
    assert_eq!((manifest.documents, manifest.id_bytes), (4, 2));
    let ids = fs::read(ids).unwrap();
    assert_eq!(ids.len() as u64, 2 * manifest.tokens);
    let end_of_text = ids.chunks(2).filter(|id| id == &[0, 0]).count();
    assert_eq!(end_of_text, 3);

    // Sampling encodes the prompt and decodes the text with the run's tokenizer.
    let text = stdout_of(&[
        "sample",
        "--from",
        path(&run),
        "--prompt",
        "The model",
        "--tokens",
        "8",
        "--temperature",
        "0",
    ]);
    assert!(text.starts_with("The model"), "{text:?}");

    // The export carries the run's tokenizer byte for byte, and its end-of-text token (id
    // 0) as the end of generation for transformers.
    let hf = dir.path().join("hf");
    ok(&["export", "--from", path(&run), "--to", path(&hf)]);
    assert!(fs::read(hf.join("tokenizer.json")).unwrap() == bytes);
    let json = |name: &str| -> serde_json::Value {
        serde_json::from_slice(&fs::read(hf.join(name)).unwrap()).unwrap()
    };
    assert_eq!(json("config.json")["eos_token_id"], 0);
    assert_eq!(json("config.json")["bos_token_id"], serde_json::Value::Null);
    assert_eq!(json("generation_config.json")["eos_token_id"], 0);
    assert_eq!(json("generation_config.json")["do_sample"], false);
    assert_eq!(json("tokenizer_config.json")["eos_token"], "<|endoftext|>");
    assert_eq!(json("tokenizer_config.json")["add_bos_token"], false);
}

#[test]
fn json_lines_train_one_document_a_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("docs.jsonl");
    let paragraphs: Vec<&str> = GUIDES
        .iter()
        .flat_map(|guide| guide.split("\n\n"))
        .filter(|p| !p.trim().is_empty())
        .collect();
    let lines: String = paragraphs
        .iter()
        .enumerate()
        .map(|(i, p)| serde_json::json!({"id": i, "text": p}).to_string() + "\n")
        .collect();
    fs::write(&data, lines).unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    train_tokenizer(&data, 500, &tokenizer);

    let run = dir.path().join("run");
    let mut args = TINY.to_vec();
    args.extend(["--tokenizer", path(&tokenizer), "--data", path(&data)]);
    args.extend(["--steps", "2", "--out", path(&run)]);
    ok(&args);
    let (manifest, _) = only_cache(&dir.path().join("token-cache"));
    assert_eq!(manifest.documents, paragraphs.len() as u64);
    let start = manifest.validation_start;
    assert!(start > 0 && start < manifest.tokens);
}

#[test]
fn a_corpus_larger_than_the_readers_cap_trains_on_the_uncapped_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("guides.txt");
    fs::write(&data, GUIDES.concat()).unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    train_tokenizer(&data, 500, &tokenizer);

    // A reader that holds 1 kB of text at a time, 70 times less than the file.
    let capped = dir.path().join("capped");
    let run = dir.path().join("run");
    let mut args = TINY.to_vec();
    args.extend(["--tokenizer", path(&tokenizer), "--data", path(&data)]);
    args.extend(["--steps", "2", "--out", path(&run)]);
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tinyllm"))
        .args(&args)
        .env("TINYLLM_READ_CHUNK_BYTES", "1024")
        .env("TINYLLM_TOKEN_CACHE", &capped)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(fs::metadata(&data).unwrap().len() > 64 * 1024);
    let (manifest, ids) = only_cache(&capped);

    // The whole file read at once gives the same ids: the cuts fall where GPT-2's
    // pre-tokenizer cuts anyway.
    let whole = dir.path().join("whole");
    let options = CacheOptions {
        root: &whole,
        chunk_bytes: DEFAULT_CHUNK_BYTES,
        expected: None,
    };
    let corpus = Corpus::from_path(&data, &Tokenizer::load(&tokenizer).unwrap(), 64, options);
    let corpus = corpus.unwrap();
    let (whole_manifest, whole_ids) = only_cache(&whole);
    assert!(fs::read(ids).unwrap() == fs::read(whole_ids).unwrap());
    assert_eq!(manifest, whole_manifest);
    assert_eq!(
        corpus.train.len() + corpus.validation.len(),
        manifest.tokens as usize
    );
}

#[test]
fn a_changed_file_is_named_on_resume_and_an_unchanged_one_is_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let data = guide_directory(dir.path());
    let run = dir.path().join("run");
    let mut args = TINY.to_vec();
    args.extend(["--data", path(&data), "--steps", "4", "--until-step", "2"]);
    args.extend(["--out", path(&run)]);
    ok(&args);
    let (_, ids) = only_cache(&dir.path().join("token-cache"));
    let written = fs::metadata(&ids).unwrap().modified().unwrap();

    // The same size and time: a resume trusts them (as make and rsync do) and reads
    // nothing, so even a file changed behind its time's back is not noticed.
    let b = data.join("b.txt");
    let time = fs::metadata(&b).unwrap().modified().unwrap();
    let original = fs::read(&b).unwrap();
    let mut same_size = original.clone();
    same_size[0] ^= 0x20;
    fs::write(&b, &same_size).unwrap();
    fs::File::options()
        .write(true)
        .open(&b)
        .unwrap()
        .set_modified(time)
        .unwrap();
    let resume = [
        "train",
        "--resume",
        path(&run),
        "--quiet",
        "--until-step",
        "3",
    ];
    ok(&resume);
    assert_eq!(fs::metadata(&ids).unwrap().modified().unwrap(), written);

    // A new time makes it hash the file, and the change is refused, naming the file.
    fs::write(&b, &same_size).unwrap();
    let error = run_error(&["train", "--resume", path(&run), "--quiet"]);
    let TrainError::DataChanged { path: named, .. } = &error else {
        panic!("{error}");
    };
    assert_eq!(named, &b);
    assert!(error.to_string().contains("--data-changed-ok"), "{error}");
    // Its old contents back, with a new time: hashed, found the same, and resumed.
    fs::write(&b, &original).unwrap();
    ok(&[
        "train",
        "--resume",
        path(&run),
        "--quiet",
        "--until-step",
        "3",
    ]);
    // A file added to the directory is a change too; asked to, the run goes on, on new
    // tokens in a new cache.
    fs::write(data.join("part/e.txt"), "one more document\n").unwrap();
    let error = run_error(&["train", "--resume", path(&run), "--quiet"]);
    assert!(error.to_string().contains("e.txt"), "{error}");
    ok(&[
        "train",
        "--resume",
        path(&run),
        "--quiet",
        "--data-changed-ok",
    ]);
    let caches = fs::read_dir(dir.path().join("token-cache"))
        .unwrap()
        .count();
    assert_eq!(caches, 2);
}

#[test]
fn a_changed_tokenizer_is_refused_on_resume_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("guides.txt");
    fs::write(&data, GUIDES[..2].concat()).unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    train_tokenizer(&data, 400, &tokenizer);
    let run = dir.path().join("run");
    let mut args = TINY.to_vec();
    args.extend(["--tokenizer", path(&tokenizer), "--data", path(&data)]);
    args.extend(["--steps", "4", "--until-step", "2", "--out", path(&run)]);
    ok(&args);
    train_tokenizer(&data, 401, &tokenizer);
    let error = run_error(&["train", "--resume", path(&run), "--quiet"]);
    assert!(
        matches!(error, TrainError::Data(DataError::TokenizerChanged { .. })),
        "{error}"
    );
    assert!(error.to_string().contains("tokenizer.json"), "{error}");
}

#[test]
fn bad_files_are_errors_naming_the_file_and_line_and_create_no_run() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let train = |data: &Path, extra: &[&str]| {
        let mut args = TINY.to_vec();
        args.extend(["--data", path(data), "--out", path(&run)]);
        args.extend(extra);
        let error = run_error(&args);
        assert!(!run.exists(), "{error}");
        error
    };

    let broken = dir.path().join("broken.json");
    fs::write(&broken, "{\"model\": {}}").unwrap();
    let text = dir.path().join("text.txt");
    fs::write(&text, GUIDES[0]).unwrap();
    let error = train(&text, &["--tokenizer", path(&broken)]);
    assert!(
        matches!(error, TrainError::Data(DataError::Tokenizer { .. })),
        "{error}"
    );
    assert!(error.to_string().contains("broken.json"), "{error}");

    let jsonl = dir.path().join("docs.jsonl");
    fs::write(
        &jsonl,
        "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"body\": \"c\"}\n",
    )
    .unwrap();
    let error = train(&jsonl, &[]).to_string();
    assert!(error.contains("docs.jsonl, line 3"), "{error}");
    fs::write(&jsonl, "{\"text\": \"a\"}\n{\"text\": \"b\"\n").unwrap();
    let error = train(&jsonl, &[]).to_string();
    assert!(
        error.contains("docs.jsonl, line 2") && error.contains("not JSON"),
        "{error}"
    );

    let texts = dir.path().join("texts");
    fs::create_dir(&texts).unwrap();
    fs::write(texts.join("a.txt"), GUIDES[0]).unwrap();
    fs::write(texts.join("b.txt"), b"fine\nnot \xff fine\n").unwrap();
    let error = train(&texts, &[]);
    assert!(
        matches!(error, TrainError::Data(DataError::NotUtf8 { line: 2, .. })),
        "{error}"
    );
    assert!(error.to_string().contains("b.txt"), "{error}");
}
