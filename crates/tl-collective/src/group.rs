//! Splitting a communicator into groups (as `MPI_Comm_split`): what every backend shares.
//!
//! A split is a collective of the whole communicator. Each rank names the members of its own
//! group, in the order that gives their ranks inside it; the groups must partition the
//! world. Before any backend forms anything, the ranks all-gather one record each over the
//! communicator being split — a 48-bit digest of the member list, the rank's position in it,
//! the group's size and, from each group's first member, where the group meets (the ring's
//! rendezvous directory) — and every rank checks that each of its members named the same
//! group. So a split the ranks disagree on fails on every rank with
//! [`CollectiveError::BadGroup`], naming a rank that disagrees, before any group exists;
//! nobody waits for a ring that will not form.
//!
//! The record is [`RECORD_WORDS`] `f64` words: every field is an integer below 2⁵³ (the
//! path's bytes one per word), so the exchange is exact whatever the backend.

use sha2::{Digest, Sha256};

use crate::communicator::Communicator;
use crate::element::SliceMut;
use crate::error::{CollectiveError, Result};

/// Words of the rendezvous path in a record: any path a ring's sockets fit in
/// ([`MAX_SOCKET_PATH`](crate::MAX_SOCKET_PATH) bytes) fits.
const PATH_WORDS: usize = 112;
/// Words of one rank's record: digest, position, size, path length, path bytes.
pub(crate) const RECORD_WORDS: usize = 4 + PATH_WORDS;

/// What one rank says of its group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    /// 48 bits of SHA-256 of the member list.
    pub(crate) digest: u64,
    /// The rank's position in its member list: its rank in the group.
    pub(crate) position: usize,
    /// Members in the group.
    pub(crate) size: usize,
    /// Where the group meets (empty unless the rank is its group's first member and the
    /// backend needs a place).
    pub(crate) path: Vec<u8>,
}

impl Record {
    fn encode(&self) -> Vec<f64> {
        let mut words = vec![0.0; RECORD_WORDS];
        words[0] = self.digest as f64;
        words[1] = self.position as f64;
        words[2] = self.size as f64;
        words[3] = self.path.len() as f64;
        for (word, &byte) in words[4..].iter_mut().zip(&self.path) {
            *word = f64::from(byte);
        }
        words
    }

    fn decode(words: &[f64]) -> Record {
        let len = (words[3] as usize).min(PATH_WORDS);
        Record {
            digest: words[0] as u64,
            position: words[1] as usize,
            size: words[2] as usize,
            path: words[4..4 + len].iter().map(|&w| w as u8).collect(),
        }
    }
}

/// 48 bits of SHA-256 of a member list: exact in an `f64`, and two different lists collide
/// with probability 2⁻⁴⁸.
fn digest(members: &[usize]) -> u64 {
    let mut hash = Sha256::new();
    for &m in members {
        hash.update((m as u64).to_le_bytes());
    }
    let bytes: [u8; 32] = hash.finalize().into();
    u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) >> 16
}

/// The checks a rank can make alone: its group is non-empty, holds it once, and names each
/// member once, inside the world. Returns the rank's position in the group.
///
/// # Errors
/// [`CollectiveError::BadGroup`] naming what is wrong.
pub(crate) fn check_members(members: &[usize], rank: usize, world_size: usize) -> Result<usize> {
    let bad = |reason: String| Err(CollectiveError::BadGroup { reason });
    if let Some(&m) = members.iter().find(|&&m| m >= world_size) {
        return bad(format!(
            "rank {rank}'s group {members:?} names rank {m}, outside the world of {world_size}"
        ));
    }
    let mut seen = vec![false; world_size];
    for &m in members {
        if std::mem::replace(&mut seen[m], true) {
            return bad(format!(
                "rank {rank}'s group {members:?} names rank {m} twice"
            ));
        }
    }
    match members.iter().position(|&m| m == rank) {
        Some(position) => Ok(position),
        None => bad(format!(
            "rank {rank}'s group {members:?} does not hold rank {rank}: every rank names its \
             own group"
        )),
    }
}

/// The record of this rank's group, with the meeting place `path` (what the group's first
/// member offers; empty otherwise).
pub(crate) fn record(members: &[usize], position: usize, path: Vec<u8>) -> Result<Record> {
    if path.len() > PATH_WORDS {
        return Err(CollectiveError::BadGroup {
            reason: format!(
                "the group's rendezvous path is {} bytes, over the {PATH_WORDS} a split \
                 carries: set TMPDIR to a shorter directory",
                path.len()
            ),
        });
    }
    Ok(Record {
        digest: digest(members),
        position,
        size: members.len(),
        path,
    })
}

/// All-gathers every rank's record over `comm` (a collective of the whole communicator) and
/// checks that each member of `members` named the same group, at its place in it. Returns
/// the record of the group's first member (which carries the meeting place).
///
/// # Errors
/// The all-gather's errors; [`CollectiveError::BadGroup`] naming the first member that
/// disagrees.
pub(crate) fn exchange(
    comm: &mut dyn Communicator,
    members: &[usize],
    own: &Record,
) -> Result<Record> {
    let n = comm.world_size();
    let mut all = vec![0.0f64; RECORD_WORDS * n];
    comm.all_gather((&own.encode()).into(), (&mut all).into())?;
    let records: Vec<Record> = all.chunks(RECORD_WORDS).map(Record::decode).collect();
    check_partition(&records)?;
    for (position, &m) in members.iter().enumerate() {
        let theirs = &records[m];
        if theirs.digest != own.digest || theirs.position != position {
            return Err(CollectiveError::BadGroup {
                reason: format!(
                    "rank {} puts rank {m} at place {position} of its group {members:?}, but \
                     rank {m} names another group (its place {} of {}): every member must \
                     name the same group, in the same order",
                    comm.rank(),
                    theirs.position,
                    theirs.size
                ),
            });
        }
    }
    Ok(records[members[0]].clone())
}

/// The verdict every rank reaches alike, from all the records: the ranks that name one
/// group (one digest) are as many as its size, at places 0, 1, … each once. So a split the
/// ranks disagree on fails on every rank, not only on those whose own group is wrong.
fn check_partition(records: &[Record]) -> Result<()> {
    let mut groups: std::collections::BTreeMap<u64, Vec<(usize, &Record)>> = Default::default();
    for (rank, record) in records.iter().enumerate() {
        groups
            .entry(record.digest)
            .or_default()
            .push((rank, record));
    }
    for ranks in groups.values() {
        let (first, record) = ranks[0];
        let mut places: Vec<usize> = ranks.iter().map(|(_, r)| r.position).collect();
        places.sort_unstable();
        let complete = places.iter().enumerate().all(|(i, &p)| i == p);
        if ranks.len() != record.size || !complete {
            let names: Vec<usize> = ranks.iter().map(|&(rank, _)| rank).collect();
            return Err(CollectiveError::BadGroup {
                reason: format!(
                    "rank {first} names a group of {} ranks, but only ranks {names:?} name                      that group (at places {places:?}): the groups must partition the world,                      each rank naming its own group alike",
                    record.size
                ),
            });
        }
    }
    Ok(())
}

/// The secret of a group's ring: the run's, bound to the group's members, so that a rank of
/// another group cannot join it.
pub(crate) fn group_secret(secret: &[u8; 32], members: &[usize]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key");
    mac.update(b"group");
    for &m in members {
        mac.update(&(m as u64).to_le_bytes());
    }
    mac.finalize().into_bytes().into()
}

/// The exchange's cost on a communicator that moves no values (a shape-only all-gather of
/// the same length), so that a planned split counts what a real one sends.
pub(crate) fn exchange_shape(comm: &mut dyn Communicator) -> Result<()> {
    let n = comm.world_size();
    comm.all_gather(
        crate::element::Slice::shape::<f64>(RECORD_WORDS),
        SliceMut::shape::<f64>(RECORD_WORDS * n),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Single;

    #[test]
    fn a_record_survives_its_encoding() {
        let record = record(&[4, 5, 6, 7], 2, b"/tmp/tinyllm-rendezvous-x".to_vec()).unwrap();
        assert_eq!(Record::decode(&record.encode()), record);
        assert!(record.digest < 1 << 48);
        assert_ne!(digest(&[4, 5, 6, 7]), digest(&[4, 5, 7, 6]));
    }

    #[test]
    fn local_checks_name_what_is_wrong() {
        assert_eq!(check_members(&[2, 3], 3, 4).unwrap(), 1);
        for (members, needle) in [
            (vec![0, 4], "outside the world of 4"),
            (vec![3, 3], "names rank 3 twice"),
            (vec![0, 1], "does not hold rank 3"),
            (vec![], "does not hold rank 3"),
        ] {
            let err = check_members(&members, 3, 4).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
        }
    }

    #[test]
    fn the_partition_verdict_names_a_group_short_of_members() {
        let pair = |position| record(&[0, 1], position, Vec::new()).unwrap();
        let alone = record(&[2], 0, Vec::new()).unwrap();
        check_partition(&[pair(0), pair(1), alone.clone()]).unwrap();
        // Rank 1 names {1, 2} instead: the pair {0, 1} lacks a member.
        let other = record(&[1, 2], 0, Vec::new()).unwrap();
        let err = check_partition(&[pair(0), other, alone]).unwrap_err();
        assert!(err.to_string().contains("only ranks [0]"), "{err}");
        // Two ranks at the same place.
        let err = check_partition(&[pair(0), pair(0)]).unwrap_err();
        assert!(err.to_string().contains("places [0, 0]"), "{err}");
        assert_ne!(
            group_secret(&[7; 32], &[0, 1]),
            group_secret(&[7; 32], &[2, 3])
        );
    }

    #[test]
    fn a_world_of_one_exchanges_its_own_record() {
        let own = record(&[0], 0, Vec::new()).unwrap();
        let mut comm = Single::new();
        assert_eq!(exchange(&mut comm, &[0], &own).unwrap(), own);
    }
}
