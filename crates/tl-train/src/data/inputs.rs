//! [`Inputs`]: the files `--data` names (a text file, a directory of `.txt` files, or JSON
//! Lines), read as documents in pieces of bounded size, each file hashed on the way.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::DataError;
use crate::train::FileFingerprint;

/// How the files of `--data` hold their documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InputFormat {
    /// One UTF-8 text file: one document.
    Text,
    /// A `.jsonl` file: one JSON object a line, its `text` field a document.
    JsonLines,
    /// A directory: every `.txt` file under it, at any depth, a document.
    Directory,
}

/// The files of a corpus, in the order their documents come.
#[derive(Clone, Debug)]
pub struct Inputs {
    /// What `--data` named.
    pub root: PathBuf,
    /// How the files hold documents.
    pub format: InputFormat,
    /// The files: `root` itself, or the `.txt` files under it sorted by path.
    pub files: Vec<PathBuf>,
}

/// One input file as it was read: its path (relative to the directory for a directory, the
/// file's name otherwise), size, modification time and SHA-256.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputFile {
    /// The path, `/`-separated, relative to `--data` for a directory.
    pub path: String,
    /// Bytes.
    pub bytes: u64,
    /// Modification time, nanoseconds since 1970, when the file system has one.
    pub modified_ns: Option<u64>,
    /// SHA-256 of the bytes, as `sha256sum` prints it.
    pub sha256: String,
}

impl InputFile {
    /// `N bytes, SHA-256 H`, for messages.
    pub fn describe(&self) -> String {
        format!("{} bytes, SHA-256 {}", self.bytes, self.sha256)
    }
}

/// A stretch of one document's text, as [`Inputs::read`] hands it on.
#[derive(Clone, Copy, Debug)]
pub struct Piece<'a> {
    /// The text.
    pub text: &'a str,
    /// Whether it is the first piece of its document.
    pub starts_document: bool,
}

/// The smallest read buffer: room for the longest UTF-8 character and then some.
pub const MIN_CHUNK_BYTES: usize = 64;

impl Inputs {
    /// The files `path` names: a directory's `.txt` files (at any depth, sorted by their
    /// path below it, names starting with `.` skipped), a `.jsonl` file, or a text file.
    ///
    /// # Errors
    /// [`DataError::Io`] for a path that cannot be read, [`DataError::NotRegular`] for a
    /// device or pipe (which may never end), [`DataError::NoTextFiles`] for a directory
    /// without a `.txt` file.
    pub fn find(path: &Path) -> Result<Inputs, DataError> {
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        let metadata = std::fs::metadata(path).map_err(io)?;
        if metadata.is_dir() {
            let mut files = Vec::new();
            collect_text_files(path, &mut files)?;
            if files.is_empty() {
                return Err(DataError::NoTextFiles {
                    path: path.to_path_buf(),
                });
            }
            files.sort();
            return Ok(Inputs {
                root: path.to_path_buf(),
                format: InputFormat::Directory,
                files,
            });
        }
        if !metadata.is_file() {
            return Err(DataError::NotRegular {
                path: path.to_path_buf(),
            });
        }
        let format = if path.extension().is_some_and(|e| e == "jsonl") {
            InputFormat::JsonLines
        } else {
            InputFormat::Text
        };
        Ok(Inputs {
            root: path.to_path_buf(),
            format,
            files: vec![path.to_path_buf()],
        })
    }

    /// The name a file is recorded under: its path below the directory, or its file name.
    pub fn relative(&self, file: &Path) -> String {
        let relative = match self.format {
            InputFormat::Directory => file.strip_prefix(&self.root).unwrap_or(file),
            _ => Path::new(file.file_name().unwrap_or(file.as_os_str())),
        };
        relative
            .components()
            .map(|c| c.as_os_str().to_string_lossy())
            .collect::<Vec<_>>()
            .join("/")
    }

    /// The path of a file recorded as `relative`.
    pub fn resolve(&self, relative: &str) -> PathBuf {
        match self.format {
            InputFormat::Directory => self.root.join(relative),
            _ => self.root.clone(),
        }
    }

    /// Bytes in all the files, from their metadata.
    ///
    /// # Errors
    /// [`DataError::Io`] naming a file that cannot be read.
    pub fn total_bytes(&self) -> Result<u64, DataError> {
        self.files.iter().try_fold(0u64, |sum, file| {
            let metadata = std::fs::metadata(file).map_err(|source| DataError::Io {
                path: file.clone(),
                source,
            })?;
            Ok(sum + metadata.len())
        })
    }

    /// Every file's size, time and SHA-256, reading each once.
    ///
    /// # Errors
    /// [`DataError::Io`] naming a file that cannot be read.
    pub fn hash(&self, progress: &indicatif::ProgressBar) -> Result<Vec<InputFile>, DataError> {
        self.files
            .iter()
            .map(|file| {
                let io = |source| DataError::Io {
                    path: file.clone(),
                    source,
                };
                let mut reader = File::open(file).map_err(io)?;
                let mut hasher = Sha256::new();
                let mut buffer = vec![0u8; 1 << 20];
                loop {
                    let n = reader.read(&mut buffer).map_err(io)?;
                    if n == 0 {
                        break;
                    }
                    hasher.update(&buffer[..n]);
                    progress.inc(n as u64);
                }
                self.record(file, hasher)
            })
            .collect()
    }

    /// The documents of every file, in pieces of at most `chunk_bytes` bytes handed to
    /// `visit` in order, each file hashed as it is read; returns the files as read.
    ///
    /// A text file is one document, cut into pieces where GPT-2's byte-level pre-tokenizer
    /// cuts anyway (before white space that follows a character that is not), so that with
    /// it (the one `tinyllm tokenizer train` makes) the pieces' tokens are the whole text's;
    /// other tokenizers may split a word differently at a cut (Llama 3's pattern keeps
    /// punctuation with the newlines after it, SentencePiece's marks the start of every
    /// piece), which only a document longer than `chunk_bytes` has. A stretch of
    /// `chunk_bytes` without such a place is cut at a character boundary. A JSON Lines file
    /// holds a document a line (blank lines skipped), and a line may not be longer than
    /// `chunk_bytes`. Empty documents are skipped.
    ///
    /// # Errors
    /// [`DataError::NotUtf8`] (naming the file and line), [`DataError::NotJson`],
    /// [`DataError::NoText`], [`DataError::LineTooLong`], [`DataError::Io`], and whatever
    /// `visit` returns.
    ///
    /// # Panics
    /// If `chunk_bytes` is below [`MIN_CHUNK_BYTES`].
    pub fn read(
        &self,
        chunk_bytes: usize,
        progress: &indicatif::ProgressBar,
        visit: &mut dyn FnMut(Piece<'_>) -> Result<(), DataError>,
    ) -> Result<Vec<InputFile>, DataError> {
        assert!(
            chunk_bytes >= MIN_CHUNK_BYTES,
            "Inputs::read: chunks of {chunk_bytes} bytes are below {MIN_CHUNK_BYTES}"
        );
        self.files
            .iter()
            .map(|file| {
                let hasher = match self.format {
                    InputFormat::JsonLines => read_json_lines(file, chunk_bytes, progress, visit)?,
                    _ => read_text(file, chunk_bytes, progress, visit)?,
                };
                self.record(file, hasher)
            })
            .collect()
    }

    fn record(&self, file: &Path, hasher: Sha256) -> Result<InputFile, DataError> {
        let metadata = std::fs::metadata(file).map_err(|source| DataError::Io {
            path: file.to_path_buf(),
            source,
        })?;
        Ok(InputFile {
            path: self.relative(file),
            bytes: metadata.len(),
            modified_ns: modified_ns(&metadata),
            sha256: crate::store::hex(&hasher.finalize()),
        })
    }

    /// The data's fingerprint: a single file's size and SHA-256, or for a directory the
    /// total size and the SHA-256 of the lines `sha256sum` would print for its files
    /// (`<sha256>  <path>\n`, in order).
    pub fn fingerprint(&self, files: &[InputFile]) -> FileFingerprint {
        let bytes = files.iter().map(|f| f.bytes).sum();
        let sha256 = match (self.format, files) {
            (InputFormat::Directory, _) | (_, []) => {
                let mut hasher = Sha256::new();
                for file in files {
                    hasher.update(format!("{}  {}\n", file.sha256, file.path).as_bytes());
                }
                crate::store::hex(&hasher.finalize())
            }
            (_, [file, ..]) => file.sha256.clone(),
        };
        FileFingerprint { bytes, sha256 }
    }
}

/// The modification time of `metadata` in nanoseconds since 1970, if it has one.
pub fn modified_ns(metadata: &std::fs::Metadata) -> Option<u64> {
    let since = metadata.modified().ok()?.duration_since(UNIX_EPOCH).ok()?;
    u64::try_from(since.as_nanos()).ok()
}

fn collect_text_files(dir: &Path, files: &mut Vec<PathBuf>) -> Result<(), DataError> {
    let io = |source| DataError::Io {
        path: dir.to_path_buf(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path
            .file_name()
            .is_some_and(|name| name.to_string_lossy().starts_with('.'))
        {
            continue;
        }
        // Following links, as `cat` would.
        let metadata = std::fs::metadata(&path).map_err(|source| DataError::Io {
            path: path.clone(),
            source,
        })?;
        if metadata.is_dir() {
            collect_text_files(&path, files)?;
        } else if metadata.is_file() && path.extension().is_some_and(|e| e == "txt") {
            files.push(path);
        }
    }
    Ok(())
}

/// Where to cut `text` (not the end of its file) so that the pieces tokenize as the whole:
/// before the last white space that follows a character that is not. GPT-2's pattern never
/// puts the two in one word (a word is letters, digits or punctuation, after at most one
/// space; white space is a word of its own), and it matches each word from where the last
/// one ended, with no look behind. Without such a place, at the last character boundary.
fn safe_cut(text: &str) -> usize {
    let mut after = None;
    for (at, c) in text.char_indices().rev() {
        match after {
            Some(next) if !c.is_whitespace() => return next,
            _ => {}
        }
        after = c.is_whitespace().then_some(at);
    }
    text.len()
}

/// `text` in stretches of at most `max_bytes` (more only where no place to cut is found),
/// cut where [`Inputs::read`] cuts a text file, so that with GPT-2's pre-tokenizer they
/// tokenize as the whole.
///
/// ```
/// use tl_train::data::split_text;
/// let parts: Vec<&str> = split_text("one two  three", 6).collect();
/// assert_eq!(parts, ["one", " two", "  three"]);
/// ```
pub fn split_text(text: &str, max_bytes: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = if rest.len() <= max_bytes {
            rest.len()
        } else {
            let window = &rest[..rest.floor_char_boundary(max_bytes)];
            match safe_cut(window) {
                cut if cut < window.len() => cut,
                // No place to cut in the window: at the first place after it, else the end.
                _ => {
                    let after = safe_cut_after(rest, window.len());
                    after.unwrap_or(rest.len())
                }
            }
        };
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

/// The first place at or after `from` where [`safe_cut`] could cut `text`.
fn safe_cut_after(text: &str, from: usize) -> Option<usize> {
    let mut previous_is_space = true;
    for (at, c) in text.char_indices() {
        if at >= from && c.is_whitespace() && !previous_is_space {
            return Some(at);
        }
        previous_is_space = c.is_whitespace();
    }
    None
}

fn read_text(
    path: &Path,
    chunk_bytes: usize,
    progress: &indicatif::ProgressBar,
    visit: &mut dyn FnMut(Piece<'_>) -> Result<(), DataError>,
) -> Result<Sha256, DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buffer: Vec<u8> = Vec::with_capacity(chunk_bytes);
    let (mut line, mut offset, mut first) = (1usize, 0usize, true);
    loop {
        let before = buffer.len();
        (&mut file)
            .take((chunk_bytes - before) as u64)
            .read_to_end(&mut buffer)
            .map_err(io)?;
        hasher.update(&buffer[before..]);
        progress.inc((buffer.len() - before) as u64);
        let end_of_file = buffer.len() < chunk_bytes;
        if buffer.is_empty() {
            return Ok(hasher);
        }
        let valid = match std::str::from_utf8(&buffer) {
            Ok(text) => text.len(),
            // A character cut by the end of the buffer: its rest comes with the next read.
            Err(error) if error.error_len().is_none() && !end_of_file => error.valid_up_to(),
            Err(error) => {
                let valid = error.valid_up_to();
                return Err(DataError::NotUtf8 {
                    path: path.to_path_buf(),
                    line: line + buffer[..valid].iter().filter(|&&b| b == b'\n').count(),
                    offset: offset + valid,
                });
            }
        };
        let text = std::str::from_utf8(&buffer[..valid]).expect("checked");
        let cut = if end_of_file { valid } else { safe_cut(text) };
        visit(Piece {
            text: &text[..cut],
            starts_document: first,
        })?;
        first = false;
        line += text[..cut].matches('\n').count();
        offset += cut;
        buffer.drain(..cut);
        if end_of_file && buffer.is_empty() {
            return Ok(hasher);
        }
    }
}

fn read_json_lines(
    path: &Path,
    chunk_bytes: usize,
    progress: &indicatif::ProgressBar,
    visit: &mut dyn FnMut(Piece<'_>) -> Result<(), DataError>,
) -> Result<Sha256, DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::new(File::open(path).map_err(io)?);
    let mut hasher = Sha256::new();
    let (mut number, mut offset) = (0usize, 0usize);
    let mut bytes = Vec::new();
    loop {
        bytes.clear();
        number += 1;
        (&mut reader)
            .take(chunk_bytes as u64 + 1)
            .read_until(b'\n', &mut bytes)
            .map_err(io)?;
        if bytes.is_empty() {
            return Ok(hasher);
        }
        hasher.update(&bytes);
        progress.inc(bytes.len() as u64);
        if bytes.len() > chunk_bytes {
            return Err(DataError::LineTooLong {
                path: path.to_path_buf(),
                line: number,
                limit: chunk_bytes,
            });
        }
        let text = std::str::from_utf8(&bytes).map_err(|error| DataError::NotUtf8 {
            path: path.to_path_buf(),
            line: number,
            offset: offset + error.valid_up_to(),
        })?;
        offset += bytes.len();
        if text.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|error| DataError::NotJson {
                path: path.to_path_buf(),
                line: number,
                reason: error.to_string(),
            })?;
        let Some(document) = value.get("text").and_then(serde_json::Value::as_str) else {
            let found = match &value {
                serde_json::Value::Object(map) if map.contains_key("text") => {
                    "a \"text\" that is not a string".to_string()
                }
                serde_json::Value::Object(map) => format!(
                    "the keys {}",
                    map.keys()
                        .map(|k| format!("{k:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                _ => "no object".into(),
            };
            return Err(DataError::NoText {
                path: path.to_path_buf(),
                line: number,
                found,
            });
        };
        if !document.is_empty() {
            visit(Piece {
                text: document,
                starts_document: true,
            })?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(inputs: &Inputs, chunk: usize) -> Result<Vec<(String, bool)>, DataError> {
        let mut out = Vec::new();
        let hidden = indicatif::ProgressBar::hidden();
        inputs.read(chunk, &hidden, &mut |piece| {
            out.push((piece.text.to_string(), piece.starts_document));
            Ok(())
        })?;
        Ok(out)
    }

    #[test]
    fn a_directory_is_its_txt_files_at_any_depth_sorted() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("b/deeper")).unwrap();
        std::fs::write(root.join("b/deeper/z.txt"), "three").unwrap();
        std::fs::write(root.join("b/a.txt"), "two").unwrap();
        std::fs::write(root.join("a.txt"), "one").unwrap();
        std::fs::write(root.join("notes.md"), "not text").unwrap();
        std::fs::write(root.join(".hidden.txt"), "hidden").unwrap();
        let inputs = Inputs::find(root).unwrap();
        assert_eq!(inputs.format, InputFormat::Directory);
        let names: Vec<String> = inputs.files.iter().map(|f| inputs.relative(f)).collect();
        assert_eq!(names, ["a.txt", "b/a.txt", "b/deeper/z.txt"]);
        let read = pieces(&inputs, 64).unwrap();
        assert_eq!(
            read,
            [("one", true), ("two", true), ("three", true)].map(|(t, s)| (t.to_string(), s))
        );
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            Inputs::find(empty.path()),
            Err(DataError::NoTextFiles { .. })
        ));
    }

    #[test]
    fn a_text_file_is_cut_before_white_space_that_follows_a_word() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("text.txt");
        let text: String = (0..200)
            .map(|i| format!("line {i}\n\n  indented\n"))
            .collect();
        std::fs::write(&path, &text).unwrap();
        let inputs = Inputs::find(&path).unwrap();
        let read = pieces(&inputs, 100).unwrap();
        assert!(read.len() > 20);
        assert!(read.iter().all(|(piece, _)| piece.len() <= 100));
        assert_eq!(read.iter().filter(|(_, starts)| *starts).count(), 1);
        assert_eq!(read.concat_text(), text);
        for pair in read.windows(2) {
            let (before, after) = (&pair[0].0, &pair[1].0);
            assert!(!before.ends_with(char::is_whitespace), "{before:?}");
            assert!(after.starts_with(char::is_whitespace), "{after:?}");
        }
    }

    #[test]
    fn split_text_cuts_before_white_space_and_keeps_every_byte() {
        let text = "one two  three\nfour";
        let parts: Vec<&str> = split_text(text, 6).collect();
        assert_eq!(parts, ["one", " two", "  three", "\nfour"]);
        // No white space after a word within the limit: the first place after it.
        let parts: Vec<&str> = split_text("abcdefgh ij", 4).collect();
        assert_eq!(parts, ["abcdefgh", " ij"]);
        assert_eq!(split_text("漢字漢字", 4).collect::<Vec<_>>(), ["漢字漢字"]);
        assert_eq!(split_text("", 4).count(), 0);
    }

    #[test]
    fn pieces_tokenize_as_the_whole_with_a_trained_bpe() {
        let text = [
            include_str!("../../../../docs/training.md"),
            include_str!("../../../../docs/mixed-precision.md"),
        ]
        .concat();
        let json = crate::data::train_bpe([text.as_str()].into_iter(), 500).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let tokenizer_path = dir.path().join("tokenizer.json");
        std::fs::write(&tokenizer_path, json).unwrap();
        let tokenizer = crate::data::Tokenizer::load(&tokenizer_path).unwrap();
        let path = dir.path().join("text.txt");
        std::fs::write(&path, &text).unwrap();
        // Indented code, tables and prose, cut every few hundred bytes.
        let read = pieces(&Inputs::find(&path).unwrap(), 300).unwrap();
        assert!(read.len() > 100);
        let joined: Vec<u32> = read
            .iter()
            .flat_map(|(piece, _)| tokenizer.encode(piece).unwrap())
            .collect();
        assert!(joined == tokenizer.encode(&text).unwrap());
    }

    trait Concat {
        fn concat_text(&self) -> String;
    }
    impl Concat for Vec<(String, bool)> {
        fn concat_text(&self) -> String {
            self.iter().map(|(t, _)| t.as_str()).collect()
        }
    }

    #[test]
    fn a_character_cut_by_the_buffer_reads_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("text.txt");
        // 3-byte characters with no line break: cut at character boundaries only.
        let text = "漢字".repeat(100);
        std::fs::write(&path, &text).unwrap();
        let read = pieces(&Inputs::find(&path).unwrap(), 64).unwrap();
        assert_eq!(read.concat_text(), text);
    }

    #[test]
    fn invalid_utf8_is_an_error_naming_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.txt");
        std::fs::write(&path, b"first\nsecond\nthi\xffrd\n").unwrap();
        let error = pieces(&Inputs::find(&path).unwrap(), 64).unwrap_err();
        assert!(
            matches!(
                error,
                DataError::NotUtf8 {
                    line: 3,
                    offset: 16,
                    ..
                }
            ),
            "{error}"
        );
        let message = error.to_string();
        assert!(
            message.contains("bad.txt") && message.contains("line 3"),
            "{message}"
        );

        let jsonl = dir.path().join("bad.jsonl");
        std::fs::write(&jsonl, b"{\"text\": \"ok\"}\n{\"text\": \"\xc3\"}\n").unwrap();
        let error = pieces(&Inputs::find(&jsonl).unwrap(), 64).unwrap_err();
        assert!(
            matches!(error, DataError::NotUtf8 { line: 2, .. }),
            "{error}"
        );
    }

    #[test]
    fn json_lines_give_their_text_fields_and_refuse_anything_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docs.jsonl");
        std::fs::write(
            &path,
            "{\"text\": \"first\", \"id\": 1}\n\n{\"text\": \"sec\\nond\"}\r\n{\"text\": \"\"}\n",
        )
        .unwrap();
        let inputs = Inputs::find(&path).unwrap();
        assert_eq!(inputs.format, InputFormat::JsonLines);
        let read = pieces(&inputs, 64).unwrap();
        assert_eq!(
            read,
            [("first", true), ("sec\nond", true)].map(|(t, s)| (t.to_string(), s))
        );

        let cases: [(&str, usize, &str); 4] = [
            ("{\"text\": \"ok\"}\nnot json\n", 2, "not JSON"),
            ("{\"text\": \"ok\"}\n{\"body\": \"x\"}\n", 2, "\"body\""),
            ("{\"text\": 3}\n", 1, "not a string"),
            ("[1, 2]\n", 1, "no object"),
        ];
        for (content, line, words) in cases {
            std::fs::write(&path, content).unwrap();
            let error = pieces(&inputs, 64).unwrap_err();
            let message = error.to_string();
            assert!(
                message.contains("docs.jsonl")
                    && message.contains(&format!("line {line}"))
                    && message.contains(words),
                "{content:?}: {message}"
            );
        }
        std::fs::write(&path, format!("{{\"text\": \"{}\"}}\n", "x".repeat(100))).unwrap();
        let error = pieces(&inputs, 64).unwrap_err();
        assert!(matches!(
            error,
            DataError::LineTooLong {
                line: 1,
                limit: 64,
                ..
            }
        ));
    }

    #[test]
    fn a_device_is_refused_before_it_is_read() {
        let error = Inputs::find(Path::new("/dev/zero")).unwrap_err();
        assert!(matches!(error, DataError::NotRegular { .. }), "{error}");
        assert!(error.to_string().contains("/dev/zero"), "{error}");
    }

    #[test]
    fn the_fingerprint_of_one_file_is_its_own_and_of_a_directory_its_listing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.txt");
        std::fs::write(&path, "abc").unwrap();
        let hidden = indicatif::ProgressBar::hidden();
        let one = Inputs::find(&path).unwrap();
        let files = one.hash(&hidden).unwrap();
        // sha256sum of "abc".
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(
            one.fingerprint(&files),
            FileFingerprint {
                bytes: 3,
                sha256: abc.into()
            }
        );
        let listing = Inputs::find(dir.path()).unwrap();
        let files = listing.hash(&hidden).unwrap();
        let expected = crate::store::fingerprint(format!("{abc}  a.txt\n").as_bytes());
        assert_eq!(listing.fingerprint(&files).sha256, expected);
        assert_eq!(files, listing.read(64, &hidden, &mut |_| Ok(())).unwrap());
    }
}
