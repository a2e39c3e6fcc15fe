//! [`Tokens`]: a run of token ids, in memory or memory-mapped from a token cache, and
//! [`TokenSource`], what the batch functions read windows from.

use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

/// How many bytes one id takes in a token file: 2 (u16) when the vocabulary fits, else 4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdWidth {
    /// Little-endian u16 ids: vocabularies of at most 65,536 tokens.
    U16,
    /// Little-endian u32 ids.
    U32,
}

impl IdWidth {
    /// The narrowest width that holds every id of a `vocab`-token vocabulary.
    pub fn for_vocab(vocab: usize) -> IdWidth {
        if vocab <= 1 << 16 {
            IdWidth::U16
        } else {
            IdWidth::U32
        }
    }

    /// Bytes per id.
    pub fn bytes(self) -> usize {
        match self {
            IdWidth::U16 => 2,
            IdWidth::U32 => 4,
        }
    }
}

enum Storage {
    Bytes(Vec<u8>),
    Ids(Vec<u32>),
    Mapped { map: Mmap, width: IdWidth },
}

/// Token ids `0..len()`: bytes held in memory (the built-in grammar), or a token file mapped
/// into memory, so that a corpus larger than memory trains (the kernel pages in the windows
/// a batch reads). Cloning and [`slice`](Self::slice) share the storage.
#[derive(Clone)]
pub struct Tokens {
    storage: Arc<Storage>,
    range: Range<usize>,
}

impl Tokens {
    /// Bytes as tokens (ids 0..=255).
    pub fn from_bytes(bytes: Vec<u8>) -> Tokens {
        let range = 0..bytes.len();
        Tokens {
            storage: Arc::new(Storage::Bytes(bytes)),
            range,
        }
    }

    /// Ids held in memory.
    pub fn from_ids(ids: Vec<u32>) -> Tokens {
        let range = 0..ids.len();
        Tokens {
            storage: Arc::new(Storage::Ids(ids)),
            range,
        }
    }

    /// The ids of a token file written by the cache: little-endian, `width` bytes each.
    ///
    /// # Errors
    /// What the operating system says when the file cannot be opened or mapped, or
    /// `InvalidData` when its length is not a whole number of ids.
    pub(super) fn map_file(path: &Path, width: IdWidth) -> std::io::Result<Tokens> {
        let file = File::open(path)?;
        // SAFETY: the map is read-only, and a token file is written once, to a temporary
        // name, and renamed into place before anything maps it; tinyllm never writes it
        // again (a rebuilt cache is a new directory). Another process truncating it while
        // mapped would fault the reader, the caveat of every memory map (numpy's memmap in
        // nanoGPT has it too). `tests::a_mapped_token_file_reads_its_ids` exercises it.
        let map = unsafe { Mmap::map(&file)? };
        if map.len() % width.bytes() != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} bytes is not a whole number of ids", map.len()),
            ));
        }
        let range = 0..map.len() / width.bytes();
        Ok(Tokens {
            storage: Arc::new(Storage::Mapped { map, width }),
            range,
        })
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether there is no id.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Id `index`.
    ///
    /// # Panics
    /// If `index >= len()`.
    pub fn get(&self, index: usize) -> usize {
        assert!(
            index < self.len(),
            "Tokens::get: index {index} of {}",
            self.len()
        );
        let at = self.range.start + index;
        match &*self.storage {
            Storage::Bytes(bytes) => usize::from(bytes[at]),
            Storage::Ids(ids) => ids[at] as usize,
            Storage::Mapped { map, width } => match width {
                IdWidth::U16 => usize::from(u16::from_le_bytes([map[2 * at], map[2 * at + 1]])),
                IdWidth::U32 => {
                    let bytes = [
                        map[4 * at],
                        map[4 * at + 1],
                        map[4 * at + 2],
                        map[4 * at + 3],
                    ];
                    u32::from_le_bytes(bytes) as usize
                }
            },
        }
    }

    /// The ids in `range`, sharing this storage.
    ///
    /// # Panics
    /// If `range` runs past `len()`.
    pub fn slice(&self, range: Range<usize>) -> Tokens {
        assert!(
            range.start <= range.end && range.end <= self.len(),
            "Tokens::slice: {range:?} of {}",
            self.len()
        );
        Tokens {
            storage: Arc::clone(&self.storage),
            range: self.range.start + range.start..self.range.start + range.end,
        }
    }

    /// Every id, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).map(|index| self.get(index))
    }

    /// The ids as bytes, for byte-token text.
    ///
    /// # Panics
    /// If an id is above 255.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.iter()
            .map(|id| u8::try_from(id).expect("Tokens::to_bytes: an id above 255"))
            .collect()
    }
}

impl PartialEq for Tokens {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &*self.storage {
            Storage::Bytes(_) => "bytes",
            Storage::Ids(_) => "u32",
            Storage::Mapped {
                width: IdWidth::U16,
                ..
            } => "mapped u16",
            Storage::Mapped {
                width: IdWidth::U32,
                ..
            } => "mapped u32",
        };
        write!(f, "Tokens({} {kind} ids)", self.len())
    }
}

/// Token ids the batch functions can cut windows from: bytes, or [`Tokens`].
pub trait TokenSource {
    /// Number of ids.
    fn token_count(&self) -> usize;
    /// Id `index` (below `token_count()`).
    fn token(&self, index: usize) -> usize;
}

impl TokenSource for [u8] {
    fn token_count(&self) -> usize {
        self.len()
    }
    fn token(&self, index: usize) -> usize {
        usize::from(self[index])
    }
}

impl<const N: usize> TokenSource for [u8; N] {
    fn token_count(&self) -> usize {
        N
    }
    fn token(&self, index: usize) -> usize {
        usize::from(self[index])
    }
}

impl TokenSource for Vec<u8> {
    fn token_count(&self) -> usize {
        self.len()
    }
    fn token(&self, index: usize) -> usize {
        usize::from(self[index])
    }
}

impl TokenSource for Tokens {
    fn token_count(&self) -> usize {
        self.len()
    }
    fn token(&self, index: usize) -> usize {
        self.get(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_token_file_reads_its_ids() {
        let dir = tempfile::tempdir().unwrap();
        let narrow = dir.path().join("u16.bin");
        let ids16: [u16; 4] = [0, 1, 258, 65535];
        std::fs::write(&narrow, ids16.map(u16::to_le_bytes).concat()).unwrap();
        let tokens = Tokens::map_file(&narrow, IdWidth::U16).unwrap();
        assert_eq!(tokens.iter().collect::<Vec<_>>(), [0, 1, 258, 65535]);
        assert_eq!(tokens.slice(1..3).iter().collect::<Vec<_>>(), [1, 258]);

        let wide = dir.path().join("u32.bin");
        let ids32: [u32; 3] = [7, 65536, 128_255];
        std::fs::write(&wide, ids32.map(u32::to_le_bytes).concat()).unwrap();
        let tokens = Tokens::map_file(&wide, IdWidth::U32).unwrap();
        assert_eq!(tokens.iter().collect::<Vec<_>>(), [7, 65536, 128_255]);
        assert_eq!(tokens.slice(2..3).get(0), 128_255);

        // Three bytes are not a whole number of u16 ids.
        std::fs::write(&narrow, [1, 2, 3]).unwrap();
        let error = Tokens::map_file(&narrow, IdWidth::U16).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn tokens_compare_by_their_ids_whatever_the_storage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids.bin");
        std::fs::write(&path, [104u16, 105].map(u16::to_le_bytes).concat()).unwrap();
        let mapped = Tokens::map_file(&path, IdWidth::U16).unwrap();
        assert_eq!(mapped, Tokens::from_bytes(b"hi".to_vec()));
        assert_eq!(mapped.to_bytes(), b"hi");
        assert_eq!(IdWidth::for_vocab(65_536), IdWidth::U16);
        assert_eq!(IdWidth::for_vocab(65_537), IdWidth::U32);
    }
}
