//! The handshake that opens a ring connection: both ends prove they know the run's secret
//! without either revealing it, so that neither a stranger dialling a rank's socket nor one
//! listening at a neighbour's socket path learns it.
//!
//! ```text
//! dialler  → listener   hello:     magic · dialler's rank · world size · nonce_d
//! listener → dialler    challenge: nonce_l · HMAC(secret, "listen" · transcript)
//! dialler  → listener   proof:     HMAC(secret, "dial" · transcript)
//! listener → dialler    accepted:  one byte
//! ```
//!
//! The transcript is everything both ends agreed on: magic, both ranks, the world size and
//! both nonces. Fresh nonces on each side make every answer single-use; the two labels keep
//! one side's answer from being replayed as the other's. The dialler checks the listener's
//! answer before it answers, so an impostor listener gets a nonce and nothing else. (The
//! secret used to be sent in clear in the hello.)

use std::io::Read;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{CollectiveError, Result};

/// Names the protocol and its version: a peer speaking another is refused at once.
pub(crate) const MAGIC: &[u8; 8] = b"TLRING02";
/// Bytes of the hello.
pub(crate) const HELLO_LEN: usize = 8 + 8 + 8 + NONCE_LEN;
/// Bytes of a nonce, and of an HMAC-SHA256 tag.
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of the listener's challenge: its nonce and its answer.
pub(crate) const CHALLENGE_LEN: usize = NONCE_LEN + NONCE_LEN;
/// The byte that tells the dialler it was accepted.
pub(crate) const ACCEPTED: u8 = 0xA5;

/// A dialler's hello, as received.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hello {
    pub(crate) rank: u64,
    pub(crate) world_size: u64,
    pub(crate) nonce: [u8; NONCE_LEN],
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[..8].copy_from_slice(MAGIC);
        out[8..16].copy_from_slice(&self.rank.to_le_bytes());
        out[16..24].copy_from_slice(&self.world_size.to_le_bytes());
        out[24..].copy_from_slice(&self.nonce);
        out
    }

    /// Reads a hello; `Err` with the reason to refuse it when it is not one of ours.
    pub(crate) fn decode(bytes: &[u8; HELLO_LEN]) -> std::result::Result<Hello, String> {
        if &bytes[..8] != MAGIC {
            return Err("not a tl-collective ring connection (or another version)".into());
        }
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        Ok(Hello {
            rank: word(8),
            world_size: word(16),
            nonce: bytes[24..].try_into().expect("32 bytes"),
        })
    }
}

/// What both ends of one connection agreed on, which each answer covers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Transcript {
    pub(crate) dialler: u64,
    pub(crate) listener: u64,
    pub(crate) world_size: u64,
    pub(crate) dialler_nonce: [u8; NONCE_LEN],
    pub(crate) listener_nonce: [u8; NONCE_LEN],
}

/// Which end an answer comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Role {
    Listener,
    Dialler,
}

impl Transcript {
    fn mac(&self, secret: &[u8; 32], role: Role) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key");
        mac.update(match role {
            Role::Listener => b"listen",
            Role::Dialler => b"dial",
        });
        mac.update(MAGIC);
        for word in [self.dialler, self.listener, self.world_size] {
            mac.update(&word.to_le_bytes());
        }
        mac.update(&self.dialler_nonce);
        mac.update(&self.listener_nonce);
        mac
    }

    /// `role`'s answer: HMAC-SHA256 of the transcript under the secret.
    pub(crate) fn answer(&self, secret: &[u8; 32], role: Role) -> [u8; NONCE_LEN] {
        self.mac(secret, role).finalize().into_bytes().into()
    }

    /// Whether `answer` is `role`'s, compared in constant time (the time taken says nothing
    /// about how much of a forged answer was right).
    pub(crate) fn verify(&self, secret: &[u8; 32], role: Role, answer: &[u8]) -> bool {
        self.mac(secret, role).verify_slice(answer).is_ok()
    }
}

/// A fresh nonce from the kernel's generator.
///
/// # Errors
/// [`CollectiveError::Io`] if `/dev/urandom` cannot be read.
pub(crate) fn nonce() -> Result<[u8; NONCE_LEN]> {
    random_bytes()
}

/// 32 bytes from `/dev/urandom`: a run's secret, or a nonce.
///
/// # Errors
/// [`CollectiveError::Io`] if it cannot be read.
pub(crate) fn random_bytes() -> Result<[u8; 32]> {
    let mut out = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut out))
        .map_err(|e| CollectiveError::io("read random bytes from /dev/urandom", e))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transcript() -> Transcript {
        Transcript {
            dialler: 0,
            listener: 1,
            world_size: 2,
            dialler_nonce: [1; 32],
            listener_nonce: [2; 32],
        }
    }

    #[test]
    fn an_answer_checks_only_under_its_secret_role_and_transcript() {
        let secret = [7u8; 32];
        let t = transcript();
        let answer = t.answer(&secret, Role::Dialler);
        assert!(t.verify(&secret, Role::Dialler, &answer));
        // The listener's answer is no dialler's: a reflected answer does not pass.
        assert!(!t.verify(&secret, Role::Listener, &answer));
        assert!(!t.verify(&[8u8; 32], Role::Dialler, &answer));
        let replayed = Transcript {
            listener_nonce: [3; 32],
            ..t
        };
        assert!(!replayed.verify(&secret, Role::Dialler, &answer));
        assert!(!t.verify(&secret, Role::Dialler, &answer[..31]));
    }

    #[test]
    fn a_hello_round_trips_and_carries_no_secret() {
        let hello = Hello {
            rank: 3,
            world_size: 4,
            nonce: [9; 32],
        };
        let bytes = hello.encode();
        let back = Hello::decode(&bytes).unwrap();
        assert_eq!((back.rank, back.world_size, back.nonce), (3, 4, [9; 32]));
        let mut other = bytes;
        other[..8].copy_from_slice(b"TLRING01");
        assert!(Hello::decode(&other).is_err());
    }
}
