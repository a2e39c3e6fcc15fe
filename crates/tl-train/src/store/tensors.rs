//! Tensors in safetensors files: encoded whole (exports), or streamed a tensor at a time
//! to and from a checkpoint (no second copy of a model in memory).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, serialize, tensor::TensorView};

use super::{hex, write_atomic_with};
use crate::error::{Result, TrainError};

/// A named `f32` tensor: its shape and row-major values.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// Decoded tensors by name: shape and row-major values.
pub type TensorMap = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// The safetensors encoding of `tensors` (dtype F32, little-endian), with `metadata` as the
/// header's `__metadata__` (none when empty).
///
/// The bytes depend only on the arguments: the metadata is written in key order (the
/// `safetensors` crate writes a `HashMap` in an order that changes from one process to the
/// next, and a resumed run must write the same bytes as an uninterrupted one).
///
/// # Panics
/// If a tensor's values do not fill its shape (a bug of the caller).
pub fn encode_tensors(tensors: &[NamedTensor], metadata: &[(&str, &str)]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, values)| values.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors.iter().zip(&bytes).map(|((name, shape, _), data)| {
        let view = TensorView::new(Dtype::F32, shape.clone(), data)
            .unwrap_or_else(|error| panic!("encode_tensors: {name}: {error}"));
        (name.as_str(), view)
    });
    let plain = serialize(views, None::<HashMap<String, String>>).expect("sizes were checked");
    if metadata.is_empty() {
        plain
    } else {
        with_metadata(&plain, metadata)
    }
}

/// Where the values of a tensor come from when a file of tensors is streamed to disk
/// ([`write_tensors_atomic`]): borrowed or shared, never copied whole.
pub enum Values<'a> {
    /// Values in memory.
    F32(&'a [f32]),
    /// `f64` values each exactly an `f32` (AdamW's saved moments of `f32` weights).
    Narrowed(&'a [f64]),
    /// A tensor's storage, read in place.
    Tensor(tl_tensor::Tensor<f32>),
    /// This many zeros.
    Zeros(usize),
}

impl Values<'_> {
    /// How many values there are.
    fn len(&self) -> usize {
        match self {
            Values::F32(values) => values.len(),
            Values::Narrowed(values) => values.len(),
            Values::Tensor(tensor) => tensor.numel(),
            Values::Zeros(n) => *n,
        }
    }

    /// Hands the values to `sink` in order, as little-endian bytes, a chunk at a time.
    fn write_le(&self, sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        const CHUNK: usize = 1 << 14;
        let mut buffer = Vec::with_capacity(4 * CHUNK);
        let mut flush = |values: &mut dyn Iterator<Item = f32>| -> std::io::Result<()> {
            loop {
                buffer.clear();
                buffer.extend(values.take(CHUNK).flat_map(f32::to_le_bytes));
                if buffer.is_empty() {
                    return Ok(());
                }
                sink(&buffer)?;
            }
        };
        match self {
            Values::F32(values) => flush(&mut values.iter().copied()),
            Values::Narrowed(values) => flush(&mut values.iter().map(|&v| v as f32)),
            Values::Tensor(tensor) => flush(&mut tensor.value().iter().copied()),
            Values::Zeros(n) => flush(&mut std::iter::repeat_n(0.0, *n)),
        }
    }
}

/// A named tensor to stream into a safetensors file.
pub struct TensorSource<'a> {
    /// Its name in the file.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its values, row-major.
    pub values: Values<'a>,
}

/// Writes `tensors` as a safetensors file (F32, little-endian, `metadata` as the header's
/// `__metadata__`) at `path`, atomically as [`write_atomic`] does, and returns the file's
/// SHA-256 ([`fingerprint`]'s form).
///
/// The bytes are those [`encode_tensors`] gives for a non-empty `metadata`, but no copy of
/// a tensor is made: each is converted a few KiB at a time on its way to the file and the
/// hash. A checkpoint of a model of `P` parameters then costs no memory beyond the model
/// (building the file in memory first held about 14 copies of `P` floats at once).
///
/// # Errors
/// [`TrainError::Io`] naming the file that failed.
///
/// # Panics
/// If a tensor's values do not fill its shape (a bug of the caller).
pub fn write_tensors_atomic(
    path: &Path,
    tensors: &[TensorSource<'_>],
    metadata: &[(&str, &str)],
) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut order: Vec<&TensorSource<'_>> = tensors.iter().collect();
    // The safetensors crate's order (every tensor is F32): by name.
    order.sort_by(|a, b| a.name.cmp(&b.name));
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for tensor in &order {
        let n = tensor.shape.iter().product::<usize>();
        assert_eq!(
            n,
            tensor.values.len(),
            "write_tensors_atomic: {} has {} values for shape {:?}",
            tensor.name,
            tensor.values.len(),
            tensor.shape
        );
        header.insert(
            tensor.name.clone(),
            serde_json::json!({
                "dtype": "F32",
                "shape": tensor.shape,
                "data_offsets": [offset, offset + 4 * n],
            }),
        );
        offset += 4 * n;
    }
    let header = header_bytes(header, metadata);
    let mut hasher = Sha256::new();
    write_atomic_with(path, |file| {
        let mut file = std::io::BufWriter::with_capacity(1 << 20, file);
        let mut sink = |bytes: &[u8]| {
            hasher.update(bytes);
            file.write_all(bytes)
        };
        sink(&(header.len() as u64).to_le_bytes())?;
        sink(&header)?;
        for tensor in &order {
            tensor.values.write_le(&mut sink)?;
        }
        file.flush()
    })?;
    Ok(hex(&hasher.finalize()))
}

/// A safetensors header: `tensors` (name to dtype, shape and offsets) with `metadata` as
/// `__metadata__`, keys sorted, padded with spaces to a multiple of 8 bytes as the crate
/// pads it.
fn header_bytes(
    mut tensors: serde_json::Map<String, serde_json::Value>,
    metadata: &[(&str, &str)],
) -> Vec<u8> {
    let metadata: BTreeMap<&str, &str> = metadata.iter().copied().collect();
    tensors.insert(
        "__metadata__".to_string(),
        serde_json::to_value(metadata).expect("strings serialize"),
    );
    let mut header = serde_json::to_vec(&tensors).expect("JSON serializes");
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    header
}

/// What [`read_tensors`] hands each tensor to: its name, shape and values.
pub type TensorVisitor<'a> = dyn FnMut(String, Vec<usize>, Vec<f32>) -> Result<()> + 'a;

/// Where a tensor's bytes lie in a safetensors file, from its header.
struct Span {
    name: String,
    shape: Vec<usize>,
    /// Its bytes' range after the header.
    offsets: (usize, usize),
}

/// The longest safetensors header read (a checkpoint's is a few KiB).
const MAX_HEADER_BYTES: u64 = 1 << 24;

/// Reads the safetensors file at `path` one tensor at a time, in the file's order, handing
/// each to `visit` as its name, shape and values; then checks the whole file's SHA-256
/// against `expected_sha256`.
///
/// Only one tensor is in memory at a time (what `visit` keeps aside), where reading the
/// file whole and decoding it held two copies of every tensor at once. A file whose digest
/// does not match is refused after `visit` has seen some of its tensors: a caller builds
/// nothing it keeps from them until this returns `Ok`.
///
/// # Errors
/// [`TrainError::Checkpoint`] naming `path`: it cannot be read, it is damaged (its SHA-256
/// is not the one expected; preferred over any other complaint about its bytes), it is
/// not a safetensors file, or a tensor is not F32; then `visit`'s own errors.
pub fn read_tensors(
    path: &Path,
    expected_sha256: &str,
    visit: &mut TensorVisitor<'_>,
) -> Result<()> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let unreadable =
        |error: std::io::Error| TrainError::checkpoint(path, format!("cannot be read: {error}"));
    let file = fs::File::open(path).map_err(unreadable)?;
    let length = file.metadata().map_err(unreadable)?.len();
    let mut reader = HashingReader {
        inner: std::io::BufReader::with_capacity(1 << 20, file),
        hasher: Sha256::new(),
    };
    let damaged = |reader: &mut HashingReader<_>| -> Option<TrainError> {
        // Hash the rest, so that a damaged file is called damaged whatever broke first.
        std::io::copy(reader, &mut std::io::sink()).ok()?;
        let actual = hex(&reader.hasher.clone().finalize());
        (actual != expected_sha256).then(|| {
            TrainError::checkpoint(
                path,
                format!("damaged: its SHA-256 is {actual}, SHA256SUMS records {expected_sha256}"),
            )
        })
    };
    let result = (|| {
        let layout = read_layout(&mut reader, length)
            .map_err(|reason| TrainError::checkpoint(path, reason))?;
        // Converted a chunk at a time: the tensor's bytes are never all in memory beside
        // its values.
        let mut chunk = vec![0u8; 1 << 16];
        for Span {
            name,
            shape,
            offsets: (begin, end),
        } in layout
        {
            let mut values = Vec::with_capacity((end - begin) / 4);
            let mut left = end - begin;
            while left > 0 {
                let bytes = &mut chunk[..left.min(1 << 16)];
                reader.read_exact(bytes).map_err(unreadable)?;
                values.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|four| f32::from_le_bytes(four.try_into().expect("4 bytes"))),
                );
                left -= bytes.len();
            }
            visit(name, shape, values)?;
        }
        Ok(())
    })();
    match (result, damaged(&mut reader)) {
        (_, Some(damage)) => Err(damage),
        (result, None) => result,
    }
}

/// A reader that hashes what it reads.
struct HashingReader<R> {
    inner: R,
    hasher: sha2::Sha256,
}

impl<R: std::io::Read> std::io::Read for HashingReader<R> {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        use sha2::Digest;
        let n = self.inner.read(buffer)?;
        self.hasher.update(&buffer[..n]);
        Ok(n)
    }
}

/// Reads a safetensors header from `reader` (a file of `length` bytes) and checks it: every
/// tensor F32 with as many bytes as its shape holds, the data tightly packed to the end of
/// the file. Returns the tensors in the order of their data.
fn read_layout(
    reader: &mut impl std::io::Read,
    length: u64,
) -> std::result::Result<Vec<Span>, String> {
    let invalid = |reason: &str| format!("not a valid safetensors file: {reason}");
    let mut size = [0u8; 8];
    reader
        .read_exact(&mut size)
        .map_err(|_| invalid("shorter than its header"))?;
    let header_len = u64::from_le_bytes(size);
    if header_len > MAX_HEADER_BYTES || header_len > length.saturating_sub(8) {
        return Err(invalid(&format!(
            "a header of {header_len} bytes in a file of {length}"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    reader
        .read_exact(&mut header)
        .map_err(|_| invalid("shorter than its header"))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|error| invalid(&error.to_string()))?;
    #[derive(serde::Deserialize)]
    struct Info {
        dtype: String,
        shape: Vec<usize>,
        data_offsets: (usize, usize),
    }
    let mut layout = Vec::with_capacity(header.len());
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let info: Info = serde_json::from_value(info)
            .map_err(|error| invalid(&format!("tensor {name}: {error}")))?;
        if info.dtype != "F32" {
            return Err(format!("tensor {name} is {}, expected F32", info.dtype));
        }
        let (begin, end) = info.data_offsets;
        let bytes = info
            .shape
            .iter()
            .try_fold(4usize, |bytes, &dim| bytes.checked_mul(dim));
        if end < begin || bytes != Some(end - begin) {
            return Err(invalid(&format!(
                "tensor {name} of shape {:?} spans bytes {begin}..{end}",
                info.shape
            )));
        }
        layout.push(Span {
            name,
            shape: info.shape,
            offsets: (begin, end),
        });
    }
    layout.sort_by_key(|span| span.offsets);
    let mut at = 0;
    for Span {
        name,
        offsets: (begin, end),
        ..
    } in &layout
    {
        if *begin != at {
            return Err(invalid(&format!(
                "tensor {name} starts at {begin}, not {at}"
            )));
        }
        at = *end;
    }
    if at as u64 != length - 8 - header_len {
        return Err(invalid(&format!(
            "its tensors hold {at} bytes, the file {} after its header",
            length - 8 - header_len
        )));
    }
    Ok(layout)
}

/// `plain` (safetensors bytes without metadata) with `metadata` added to its header, keys
/// sorted. The header stays padded with spaces to a multiple of 8 bytes, as the crate pads
/// it; tensor offsets count from the end of the header, so they stay as they are.
fn with_metadata(plain: &[u8], metadata: &[(&str, &str)]) -> Vec<u8> {
    let length = u64::from_le_bytes(plain[..8].try_into().expect("8 bytes"));
    let length = usize::try_from(length).expect("a header in memory");
    let (header, data) = plain[8..].split_at(length);
    let header = header_bytes(
        serde_json::from_slice(header).expect("safetensors writes a JSON object"),
        metadata,
    );
    let mut bytes = Vec::with_capacity(8 + header.len() + data.len());
    bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(data);
    bytes
}

/// Decodes a safetensors file of `f32` tensors into a map from name to shape and values.
///
/// # Errors
/// [`TrainError::Checkpoint`] naming `path` when the bytes are not valid safetensors or a
/// tensor is not F32.
pub fn decode_tensors(path: &Path, bytes: &[u8]) -> Result<TensorMap> {
    let file = SafeTensors::deserialize(bytes).map_err(|error| {
        TrainError::checkpoint(path, format!("not a valid safetensors file: {error}"))
    })?;
    let mut tensors = BTreeMap::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(TrainError::checkpoint(
                path,
                format!("tensor {name} is {:?}, expected F32", view.dtype()),
            ));
        }
        let values = view
            .data()
            .chunks_exact(4)
            .map(|chunk| f32::from_le_bytes(chunk.try_into().expect("4 bytes")))
            .collect();
        tensors.insert(name, (view.shape().to_vec(), values));
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fingerprint;

    #[test]
    fn tensors_round_trip_bit_for_bit() {
        let tensors = vec![
            (
                "a".to_string(),
                vec![2, 2],
                vec![1.0, -0.0, f32::MIN_POSITIVE / 2.0, f32::MAX],
            ),
            ("b.weight".to_string(), vec![3], vec![0.1, 0.2, 0.3]),
        ];
        let decoded = decode_tensors(
            Path::new("x"),
            &encode_tensors(&tensors, &[("format", "test")]),
        )
        .unwrap();
        for (name, shape, values) in &tensors {
            let (got_shape, got) = &decoded[name];
            assert_eq!(got_shape, shape);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(got), bits(values));
        }
    }

    #[test]
    fn a_streamed_file_is_byte_for_byte_the_encoded_one_and_its_sum_is_the_files() {
        let values: Vec<f32> = (0..40_000).map(|i| (i as f32).sin() * 1e3).collect();
        let widened: Vec<f64> = values.iter().map(|&v| f64::from(v)).collect();
        let tensor = tl_tensor::Tensor::from_vec(values[..6].to_vec(), &[2, 3]).unwrap();
        // Out of name order on purpose, and larger than one chunk.
        let named = vec![
            ("z.big".to_string(), vec![200, 200], values.clone()),
            ("a.narrowed".to_string(), vec![40_000], values.clone()),
            ("m.tensor".to_string(), vec![2, 3], values[..6].to_vec()),
            ("b.zeros".to_string(), vec![5], vec![0.0; 5]),
        ];
        let sources = [
            TensorSource {
                name: "z.big".into(),
                shape: vec![200, 200],
                values: Values::F32(&values),
            },
            TensorSource {
                name: "a.narrowed".into(),
                shape: vec![40_000],
                values: Values::Narrowed(&widened),
            },
            TensorSource {
                name: "m.tensor".into(),
                shape: vec![2, 3],
                values: Values::Tensor(tensor),
            },
            TensorSource {
                name: "b.zeros".into(),
                shape: vec![5],
                values: Values::Zeros(5),
            },
        ];
        let metadata = [("format", "tinyllm"), ("a", "first")];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let sum = write_tensors_atomic(&path, &sources, &metadata).unwrap();
        let written = fs::read(&path).unwrap();
        assert_eq!(written, encode_tensors(&named, &metadata));
        assert_eq!(sum, fingerprint(&written));
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary left"
        );
    }

    #[test]
    fn metadata_is_read_back_and_its_bytes_do_not_depend_on_the_order_given() {
        let tensors = vec![("w".to_string(), vec![1, 2], vec![1.5, -2.0])];
        let metadata = [
            ("format", "tinyllm"),
            ("layout", "[in, out]"),
            ("z", "last"),
        ];
        let bytes = encode_tensors(&tensors, &metadata);
        let mut reversed = metadata;
        reversed.reverse();
        assert_eq!(encode_tensors(&tensors, &reversed), bytes);
        let header_length = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert!(header_length.is_multiple_of(8), "the header stays padded");
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let expected: HashMap<String, String> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(header.metadata().as_ref(), Some(&expected));
        let decoded = decode_tensors(Path::new("x"), &bytes).unwrap();
        assert_eq!(decoded["w"], (vec![1, 2], vec![1.5, -2.0]));
        // Without metadata, the bytes are the safetensors crate's own.
        assert!(
            SafeTensors::read_metadata(&encode_tensors(&tensors, &[]))
                .unwrap()
                .1
                .metadata()
                .is_none()
        );
    }

    #[test]
    fn garbage_is_a_checkpoint_error_naming_the_file() {
        let error =
            decode_tensors(Path::new("run/model.safetensors"), b"not safetensors").unwrap_err();
        assert!(matches!(error, TrainError::Checkpoint { .. }));
        assert!(error.to_string().contains("run/model.safetensors"));
    }
}
