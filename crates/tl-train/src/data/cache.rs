//! The token cache: a corpus tokenized once into a flat file of ids (nanoGPT's `train.bin`),
//! memory-mapped by every run that trains on it, keyed by the SHA-256 of the data and of the
//! tokenizer.
//!
//! ```text
//! CACHE/<key>/tokens.bin      the ids of every document in order, little-endian u16 (a
//!                             vocabulary of at most 65,536) or u32, documents separated by
//!                             the end-of-text ids
//! CACHE/<key>/manifest.json   the files read (path, size, time, SHA-256), the tokenizer's
//!                             SHA-256, the id width, and where the validation split starts
//! ```
//!
//! `key` is the SHA-256 of the cache format, the data's fingerprint (see
//! [`Inputs::fingerprint`]) and the tokenizer's SHA-256 (`bytes` for bytes): a changed file
//! or tokenizer is another key, and so another cache. A cache is written to a temporary
//! directory and renamed into place whole, so a crash leaves none half-written.

use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::error::DataError;
use super::inputs::{InputFile, InputFormat, Inputs, Piece, modified_ns, split_text};
use super::tokenizer::Tokenizer;
use super::tokens::{IdWidth, Tokens};
use crate::train::FileFingerprint;

/// Written into every key and manifest: a change of the layout or of the split is a new
/// format, so older caches are not misread.
const FORMAT: u32 = 1;

/// What a cache holds besides its ids.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// How the input held its documents.
    pub input: InputFormat,
    /// The data's fingerprint.
    pub data: FileFingerprint,
    /// The tokenizer's SHA-256; `None` for bytes.
    pub tokenizer_sha256: Option<String>,
    /// Bytes per id: 2 or 4.
    pub id_bytes: usize,
    /// Ids in `tokens.bin`.
    pub tokens: u64,
    /// Documents (empty ones not counted).
    pub documents: u64,
    /// The first id of the validation split.
    pub validation_start: u64,
    /// The files read, in order.
    pub files: Vec<InputFile>,
}

/// The cache directory's name for `data` tokenized by `tokenizer`.
pub fn cache_key(data: &FileFingerprint, tokenizer: &Tokenizer) -> String {
    let text = format!(
        "tinyllm token cache {FORMAT}\ndata {} {}\ntokenizer {}\n",
        data.bytes,
        data.sha256,
        tokenizer.sha256().unwrap_or("bytes")
    );
    crate::store::fingerprint(text.as_bytes())
}

/// A cache opened: its manifest and its ids.
#[derive(Clone, Debug)]
pub struct Cached {
    /// The manifest.
    pub manifest: Manifest,
    /// Every id, memory-mapped.
    pub tokens: Tokens,
    /// Its directory.
    pub dir: PathBuf,
}

/// The cache at `dir`, if it is a whole one.
fn open(dir: &Path) -> Option<Cached> {
    let manifest: Manifest =
        serde_json::from_slice(&fs::read(dir.join("manifest.json")).ok()?).ok()?;
    let width = match manifest.id_bytes {
        2 => IdWidth::U16,
        4 => IdWidth::U32,
        _ => return None,
    };
    let tokens = Tokens::map_file(&dir.join("tokens.bin"), width).ok()?;
    (manifest.format == FORMAT && tokens.len() as u64 == manifest.tokens).then(|| Cached {
        manifest,
        tokens,
        dir: dir.to_path_buf(),
    })
}

/// Where to start the validation split of `tokens` ids whose documents start at
/// `document_starts`: the shortest run of whole last documents that holds a tenth of the
/// ids (at least the last document, at most all but the first); a single document is cut
/// at its last tenth.
pub fn validation_start(tokens: u64, document_starts: &[u64]) -> u64 {
    let tenth = tokens / 10;
    if document_starts.len() < 2 {
        return tokens - tenth;
    }
    document_starts[1..]
        .iter()
        .rev()
        .copied()
        .find(|&start| tokens - start >= tenth)
        .unwrap_or(document_starts[1])
}

/// Checks, by size and modification time, that the files the cache was built from are still
/// there as they were; a file whose size or time changed is hashed again, and only a changed
/// content counts. Nothing else is read.
///
/// # Errors
/// [`DataError::Changed`] naming the first file added, removed or changed.
fn check_files(inputs: &Inputs, manifest: &Manifest) -> Result<(), DataError> {
    let now: Vec<String> = inputs.files.iter().map(|f| inputs.relative(f)).collect();
    let before: Vec<&str> = manifest.files.iter().map(|f| f.path.as_str()).collect();
    if let Some(added) = now.iter().find(|p| !before.contains(&p.as_str())) {
        return Err(DataError::Changed {
            path: inputs.resolve(added),
            expected: "no such file".into(),
            found: "a new file".into(),
        });
    }
    for file in &manifest.files {
        let path = inputs.resolve(&file.path);
        let Ok(metadata) = fs::metadata(&path) else {
            return Err(DataError::Changed {
                path,
                expected: file.describe(),
                found: "no such file".into(),
            });
        };
        if metadata.len() == file.bytes && modified_ns(&metadata) == file.modified_ns {
            continue;
        }
        let single = Inputs {
            root: inputs.root.clone(),
            format: inputs.format,
            files: vec![path.clone()],
        };
        let found = single.hash(&indicatif::ProgressBar::hidden())?;
        if found[0].sha256 != file.sha256 {
            return Err(DataError::Changed {
                path,
                expected: file.describe(),
                found: found[0].describe(),
            });
        }
    }
    Ok(())
}

/// The tokens of `inputs` by `tokenizer`, from the cache under `root` or written to it.
///
/// With `expected` (a resumed run's fingerprint of its data), the cache of that key is used
/// when the files are as they were, and nothing is read; a file that changed is
/// [`DataError::Changed`]. Otherwise every file is hashed first, and the cache of their
/// fingerprint opened, or built by reading and tokenizing them once more, in pieces of at
/// most `chunk_bytes` (see [`Inputs::read`]).
///
/// # Errors
/// [`DataError::Changed`], [`DataError::Empty`], [`DataError::TooLarge`], what reading and
/// tokenizing the files report, and [`DataError::Io`] for the cache itself.
pub fn load(
    inputs: &Inputs,
    tokenizer: &Tokenizer,
    root: &Path,
    chunk_bytes: usize,
    expected: Option<&FileFingerprint>,
) -> Result<Cached, DataError> {
    if let Some(expected) = expected
        && let Some(cached) = open(&root.join(cache_key(expected, tokenizer)))
    {
        check_files(inputs, &cached.manifest)?;
        return Ok(cached);
    }
    let total = inputs.total_bytes()?;
    let limit = crate::train::limits::MAX_DATA_BYTES;
    if total > limit {
        return Err(DataError::TooLarge {
            path: inputs.root.clone(),
            limit,
        });
    }
    let progress = progress_bar(total, "hashing");
    let files = inputs.hash(&progress)?;
    progress.finish_and_clear();
    let fingerprint = inputs.fingerprint(&files);
    if fingerprint.bytes == 0 {
        return Err(DataError::Empty {
            path: inputs.root.clone(),
        });
    }
    if let Some(expected) = expected
        && *expected != fingerprint
    {
        return Err(DataError::Changed {
            path: inputs.root.clone(),
            expected: expected.describe(),
            found: fingerprint.describe(),
        });
    }
    let dir = root.join(cache_key(&fingerprint, tokenizer));
    if let Some(cached) = open(&dir) {
        return Ok(cached);
    }
    build(inputs, tokenizer, &dir, chunk_bytes, &files)
}

fn progress_bar(bytes: u64, what: &'static str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(bytes);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} {wide_bar} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta})",
    ) {
        bar.set_style(style);
    }
    bar.set_message(what);
    bar
}

/// Tokenizes `inputs` into a new cache at `dir`; `hashed` are the files as hashed just
/// before, which the files read now must match.
fn build(
    inputs: &Inputs,
    tokenizer: &Tokenizer,
    dir: &Path,
    chunk_bytes: usize,
    hashed: &[InputFile],
) -> Result<Cached, DataError> {
    let root = dir.parent().expect("a cache directory has a parent");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Io { path, source }
    };
    fs::create_dir_all(root).map_err(io(root))?;
    let staging = root.join(format!(
        ".{}.{}.tmp",
        dir.file_name().expect("named").to_string_lossy(),
        std::process::id()
    ));
    if staging.exists() {
        fs::remove_dir_all(&staging).map_err(io(&staging))?;
    }
    fs::create_dir(&staging).map_err(io(&staging))?;
    let result = write_cache(inputs, tokenizer, &staging, chunk_bytes, hashed);
    let manifest = match result {
        Ok(manifest) => manifest,
        Err(error) => {
            let _ = fs::remove_dir_all(&staging);
            return Err(error);
        }
    };
    if let Err(source) = fs::rename(&staging, dir) {
        let _ = fs::remove_dir_all(&staging);
        // Another process (a rank of the same run) built the same cache first.
        return open(dir).ok_or(DataError::Io {
            path: dir.to_path_buf(),
            source,
        });
    }
    let width = if manifest.id_bytes == 2 {
        IdWidth::U16
    } else {
        IdWidth::U32
    };
    let tokens = Tokens::map_file(&dir.join("tokens.bin"), width).map_err(io(dir))?;
    Ok(Cached {
        manifest,
        tokens,
        dir: dir.to_path_buf(),
    })
}

fn write_cache(
    inputs: &Inputs,
    tokenizer: &Tokenizer,
    staging: &Path,
    chunk_bytes: usize,
    hashed: &[InputFile],
) -> Result<Manifest, DataError> {
    let path = staging.join("tokens.bin");
    let io = |source| DataError::Io {
        path: path.clone(),
        source,
    };
    let file = fs::File::create(&path).map_err(io)?;
    let mut writer = IdWriter {
        out: BufWriter::with_capacity(1 << 20, file),
        width: IdWidth::for_vocab(tokenizer.vocab_size()),
        separator: tokenizer.end_of_text(),
        document_starts: Vec::new(),
        tokens: 0,
        batch: Vec::new(),
        batch_bytes: 0,
    };
    let progress = progress_bar(hashed.iter().map(|f| f.bytes).sum(), "tokenizing");
    let files = inputs.read(chunk_bytes, &progress, &mut |piece| {
        writer.push(piece, chunk_bytes, tokenizer, &path)
    })?;
    writer.flush(tokenizer, &path)?;
    progress.finish_and_clear();
    let IdWriter {
        out,
        width,
        tokens,
        document_starts,
        ..
    } = writer;
    out.into_inner()
        .map_err(|error| io(error.into_error()))?
        .sync_all()
        .map_err(io)?;
    for (before, now) in hashed.iter().zip(&files) {
        if before.sha256 != now.sha256 {
            return Err(DataError::Changed {
                path: inputs.resolve(&now.path),
                expected: before.describe(),
                found: format!("{} (it changed while read)", now.describe()),
            });
        }
    }
    let manifest = Manifest {
        format: FORMAT,
        input: inputs.format,
        data: inputs.fingerprint(&files),
        tokenizer_sha256: tokenizer.sha256().map(str::to_string),
        id_bytes: width.bytes(),
        tokens,
        documents: document_starts.len() as u64,
        validation_start: validation_start(tokens, &document_starts),
        files,
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("serializes");
    let manifest_path = staging.join("manifest.json");
    fs::write(&manifest_path, json).map_err(|source| DataError::Io {
        path: manifest_path,
        source,
    })?;
    Ok(manifest)
}

/// The pieces of text read so far, encoded a batch at a time on every core and written in
/// order.
struct IdWriter {
    out: BufWriter<fs::File>,
    width: IdWidth,
    separator: Vec<u32>,
    document_starts: Vec<u64>,
    tokens: u64,
    /// Pieces waiting to be encoded, each with whether it starts a document.
    batch: Vec<(bool, String)>,
    batch_bytes: usize,
}

/// The longest stretch of text encoded as one task: short enough that a piece of a large
/// file keeps every core busy, and that the tokenizer's working memory for it (its encoding
/// keeps offsets and strings, tens of bytes a byte of text) stays small: tasks of 1 MiB
/// were no faster and held several times the memory.
const TASK_BYTES: usize = 64 << 10;

impl IdWriter {
    /// Adds `piece` to the batch, cut at the places where [`Inputs::read`] cuts, into tasks
    /// of at most [`TASK_BYTES`]; a batch that reaches `batch_limit` bytes is encoded.
    fn push(
        &mut self,
        piece: Piece<'_>,
        batch_limit: usize,
        tokenizer: &Tokenizer,
        path: &Path,
    ) -> Result<(), DataError> {
        let mut starts = piece.starts_document;
        for task in split_text(piece.text, TASK_BYTES) {
            self.batch.push((starts, task.to_string()));
            self.batch_bytes += task.len();
            starts = false;
        }
        if self.batch_bytes >= batch_limit {
            self.flush(tokenizer, path)?;
        }
        Ok(())
    }

    /// Encodes the batch, in parallel, and writes its ids in order.
    fn flush(&mut self, tokenizer: &Tokenizer, path: &Path) -> Result<(), DataError> {
        use rayon::prelude::*;
        let encoded: Vec<Result<Vec<u32>, DataError>> = self
            .batch
            .par_iter()
            .map(|(_, text)| tokenizer.encode(text))
            .collect();
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        for ((starts_document, _), ids) in self.batch.drain(..).zip(encoded) {
            if starts_document {
                if !self.document_starts.is_empty() {
                    self.tokens +=
                        write_ids(&self.separator, self.width, &mut self.out).map_err(io)?;
                }
                self.document_starts.push(self.tokens);
            }
            self.tokens += write_ids(&ids?, self.width, &mut self.out).map_err(io)?;
        }
        self.batch_bytes = 0;
        Ok(())
    }
}

fn write_ids(ids: &[u32], width: IdWidth, out: &mut impl Write) -> std::io::Result<u64> {
    for &id in ids {
        match width {
            // Ids below the vocabulary, which this width holds.
            IdWidth::U16 => out.write_all(&(id as u16).to_le_bytes())?,
            IdWidth::U32 => out.write_all(&id.to_le_bytes())?,
        }
    }
    Ok(ids.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_validation_split_is_the_shortest_tail_of_documents_holding_a_tenth() {
        // 100 ids; a tenth is 10. Documents at 0, 50, 85, 95: the last (5 ids) is too short,
        // the last two (15 ids) hold a tenth.
        assert_eq!(validation_start(100, &[0, 50, 85, 95]), 85);
        // The last document alone holds a tenth.
        assert_eq!(validation_start(100, &[0, 50, 90]), 90);
        // One long first document: all the others, however few.
        assert_eq!(validation_start(100, &[0, 97, 98]), 97);
        // One document: its last tenth (rounded down), as the byte corpus always had it.
        assert_eq!(validation_start(1005, &[0]), 905);
        assert_eq!(validation_start(1005, &[]), 905);
    }

    #[test]
    fn a_vocabulary_past_65536_is_cached_in_u32_ids() {
        // A word-level tokenizer of 70,000 words "w0".."w69999", split at white space.
        let vocab: serde_json::Map<String, serde_json::Value> = (0..70_000u32)
            .map(|i| (format!("w{i}"), i.into()))
            .chain([("[UNK]".to_string(), 70_000u32.into())])
            .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        let dir = tempfile::tempdir().unwrap();
        let tokenizer_path = dir.path().join("words.json");
        std::fs::write(&tokenizer_path, json.to_string()).unwrap();
        let tokenizer = Tokenizer::load(&tokenizer_path).unwrap();
        assert_eq!(tokenizer.vocab_size(), 70_001);
        let data = dir.path().join("words.txt");
        std::fs::write(&data, "w69999 w1 w65536 nonsense\n").unwrap();
        let inputs = Inputs::find(&data).unwrap();
        let cached = load(
            &inputs,
            &tokenizer,
            &dir.path().join("cache"),
            1 << 20,
            None,
        )
        .unwrap();
        assert_eq!(cached.manifest.id_bytes, 4);
        let ids: Vec<usize> = cached.tokens.iter().collect();
        assert_eq!(ids, [69_999, 1, 65_536, 70_000]);
        // Opened again, by its fingerprint, without reading the file.
        let again = load(
            &inputs,
            &tokenizer,
            &dir.path().join("cache"),
            1 << 20,
            Some(&cached.manifest.data),
        );
        assert_eq!(again.unwrap().manifest, cached.manifest);
    }

    #[test]
    fn a_key_changes_with_the_data_and_the_tokenizer() {
        let data = FileFingerprint {
            bytes: 3,
            sha256: "ab".into(),
        };
        let other = FileFingerprint {
            bytes: 3,
            sha256: "ac".into(),
        };
        let key = cache_key(&data, &Tokenizer::Bytes);
        assert_eq!(key.len(), 64);
        assert_eq!(key, cache_key(&data.clone(), &Tokenizer::Bytes));
        assert_ne!(key, cache_key(&other, &Tokenizer::Bytes));
    }
}
