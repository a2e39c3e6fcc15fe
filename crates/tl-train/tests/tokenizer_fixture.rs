//! A tokenizer.json written by another tool (Hugging Face's Python `tokenizers`, by
//! `scripts/make_tokenizer_fixture.py`: a SentencePiece-style BPE with normalizers) loads,
//! encodes and decodes as Python did, and a model trains on its tokens. No Python is needed.

mod common;

use std::path::Path;

use common::tinyllm;
use tl_train::cli::Exit;
use tl_train::data::Tokenizer;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/python-bpe");

#[test]
fn a_python_made_tokenizer_encodes_and_decodes_as_python_did() {
    let tokenizer = Tokenizer::load(&Path::new(FIXTURE).join("tokenizer.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(FIXTURE).join("expected.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        tokenizer.vocab_size() as u64,
        expected["vocab_size"].as_u64().unwrap()
    );
    // `</s>`, the third special token, ends a document.
    assert_eq!(tokenizer.end_of_text(), [2]);
    let strings = expected["strings"].as_array().unwrap();
    assert_eq!(strings.len(), 5);
    for case in strings {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tokenizer.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(
            tokenizer.decode(&ids).unwrap(),
            case["decoded"].as_str().unwrap(),
            "{text:?}"
        );
    }
}

#[test]
fn a_model_trains_on_a_python_made_tokenizers_ids() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("text.txt");
    let line = "The lazy fox chases two birds near the river. Children like to watch birds.\n";
    std::fs::write(&data, line.repeat(200)).unwrap();
    let tokenizer = Path::new(FIXTURE).join("tokenizer.json");
    let run = dir.path().join("run");
    let args = [
        "train",
        "--preset",
        "tiny",
        "--micro-batch",
        "2",
        "--accum",
        "1",
        "--quiet",
        "--steps",
        "2",
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        run.to_str().unwrap(),
    ];
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
    let config = tl_train::train::read_config(&run).unwrap();
    assert_eq!(config.model.vocab, 160);
}
