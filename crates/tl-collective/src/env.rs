//! The environment a launcher hands its ranks (torchrun style), and the ring's configuration.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{CollectiveError, Result};

/// This process's rank, `0..TINYLLM_WORLD_SIZE`.
pub const ENV_RANK: &str = "TINYLLM_RANK";
/// Number of processes in the run; unset means a world of one.
pub const ENV_WORLD_SIZE: &str = "TINYLLM_WORLD_SIZE";
/// The rendezvous directory (0700) holding the ranks' sockets.
pub const ENV_RENDEZVOUS: &str = "TINYLLM_RENDEZVOUS";
/// The run's secret: 64 hex digits (32 bytes).
pub const ENV_SECRET: &str = "TINYLLM_SECRET";
/// Milliseconds without progress after which a collective fails [default: 10000].
pub const ENV_TIMEOUT_MS: &str = "TINYLLM_COMM_TIMEOUT_MS";

/// The most ranks a ring takes: far past what one machine runs, and a bound that turns a
/// mistyped `TINYLLM_WORLD_SIZE` into an error at once rather than a wait for ranks that
/// will never come.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

/// Checks that `world_size` is in `1..=MAX_WORLD_SIZE` and `rank` below it.
pub(crate) fn check_world(rank: usize, world_size: usize) -> Result<()> {
    let (what, value) = if world_size == 0 || world_size > MAX_WORLD_SIZE {
        ("world size", world_size)
    } else if rank >= world_size {
        ("rank", rank)
    } else {
        return Ok(());
    };
    Err(CollectiveError::InvalidRank {
        what,
        value,
        world_size,
    })
}

/// How long a collective may go without moving a byte before it fails, unless
/// `TINYLLM_COMM_TIMEOUT_MS` or [`RingConfig::timeout`] says otherwise. A rank that exits or
/// is killed is noticed at once (its sockets close); this bound is for a rank that hangs.
/// Raise it when ranks do unequal work between collectives.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how a rank joins the ring.
#[derive(Clone, Debug)]
pub struct RingConfig {
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// The rendezvous directory.
    pub rendezvous: PathBuf,
    /// The run's secret, checked when a connection opens.
    pub secret: [u8; 32],
    /// Bound on a collective without progress, and on forming the ring.
    pub timeout: Duration,
}

impl RingConfig {
    /// Rank `rank` of `world_size` meeting in `rendezvous`, with the default timeout.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidRank`] for a world size of 0 or over [`MAX_WORLD_SIZE`], or
    /// a rank outside it.
    pub fn new(
        rank: usize,
        world_size: usize,
        rendezvous: impl Into<PathBuf>,
        secret: [u8; 32],
    ) -> Result<Self> {
        check_world(rank, world_size)?;
        Ok(RingConfig {
            rank,
            world_size,
            rendezvous: rendezvous.into(),
            secret,
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// The same with another timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Reads the ring's environment: `Ok(None)` when `TINYLLM_WORLD_SIZE` is unset (a world of
    /// one, or a run launched by something else such as mpirun).
    ///
    /// # Errors
    /// [`CollectiveError::BadEnv`] naming the variable that is missing or malformed once a
    /// world size is set; [`CollectiveError::InvalidRank`] for a rank outside the world.
    pub fn from_env() -> Result<Option<Self>> {
        let Some(world_size) = var(ENV_WORLD_SIZE)? else {
            return Ok(None);
        };
        let world_size = parse_world_size(&world_size)?;
        let rank = parse_number(ENV_RANK, &required(ENV_RANK)?)?;
        let rendezvous = PathBuf::from(required(ENV_RENDEZVOUS)?);
        let secret = parse_secret(&required(ENV_SECRET)?)?;
        let mut config = RingConfig::new(rank as usize, world_size as usize, rendezvous, secret)?;
        if let Some(ms) = var(ENV_TIMEOUT_MS)? {
            let ms = parse_number(ENV_TIMEOUT_MS, &ms)?;
            if ms == 0 {
                return Err(bad(ENV_TIMEOUT_MS, &ms.to_string(), "must be at least 1"));
            }
            config.timeout = Duration::from_millis(ms);
        }
        Ok(Some(config))
    }
}

/// The timeout set in `TINYLLM_COMM_TIMEOUT_MS`, if any.
///
/// # Errors
/// [`CollectiveError::BadEnv`] if it is not a positive number of milliseconds.
pub fn timeout_from_env() -> Result<Option<Duration>> {
    match var(ENV_TIMEOUT_MS)? {
        None => Ok(None),
        Some(ms) => match parse_number(ENV_TIMEOUT_MS, &ms)? {
            0 => Err(bad(ENV_TIMEOUT_MS, &ms, "must be at least 1")),
            ms => Ok(Some(Duration::from_millis(ms))),
        },
    }
}

/// Parses `TINYLLM_WORLD_SIZE`.
fn parse_world_size(value: &str) -> Result<u64> {
    match parse_number(ENV_WORLD_SIZE, value)? {
        n @ 1..=MAX_SIZE => Ok(n),
        _ => {
            let reason = format!("must be in 1..={MAX_WORLD_SIZE}");
            Err(bad(ENV_WORLD_SIZE, value, &reason))
        }
    }
}

/// [`MAX_WORLD_SIZE`] as the variable's type.
const MAX_SIZE: u64 = MAX_WORLD_SIZE as u64;

fn bad(name: &'static str, value: &str, reason: &str) -> CollectiveError {
    CollectiveError::BadEnv {
        name,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

fn var(name: &'static str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(value)) => {
            Err(bad(name, &value.to_string_lossy(), "not valid UTF-8"))
        }
    }
}

fn required(name: &'static str) -> Result<String> {
    var(name)?.ok_or_else(|| bad(name, "", &format!("must be set when {ENV_WORLD_SIZE} is")))
}

fn parse_number(name: &'static str, value: &str) -> Result<u64> {
    value
        .trim()
        .parse()
        .map_err(|_| bad(name, value, "expected a non-negative integer"))
}

/// Parses 64 hex digits.
pub(crate) fn parse_secret(value: &str) -> Result<[u8; 32]> {
    let digits = value.trim().as_bytes();
    if digits.len() != 64 {
        return Err(bad(ENV_SECRET, "<hidden>", "expected 64 hex digits"));
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(digits.chunks(2)) {
        let text = std::str::from_utf8(pair).unwrap_or("zz");
        *byte = u8::from_str_radix(text, 16)
            .map_err(|_| bad(ENV_SECRET, "<hidden>", "expected 64 hex digits"))?;
    }
    Ok(out)
}

/// Formats a secret as [`ENV_SECRET`] expects it.
pub fn format_secret(secret: &[u8; 32]) -> String {
    secret.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_round_trip_through_hex() {
        let secret: [u8; 32] = std::array::from_fn(|i| (i * 37) as u8);
        assert_eq!(parse_secret(&format_secret(&secret)).unwrap(), secret);
        let err = parse_secret("abc").unwrap_err();
        assert!(matches!(
            err,
            CollectiveError::BadEnv {
                name: ENV_SECRET,
                ..
            }
        ));
        // The secret's value never appears in an error message.
        assert!(!err.to_string().contains("abc"));
    }

    #[test]
    fn bad_numbers_name_their_variable() {
        let err = parse_number(ENV_RANK, "two").unwrap_err();
        assert!(err.to_string().contains("TINYLLM_RANK"), "{err}");
    }

    #[test]
    fn a_world_size_past_the_bound_is_refused_naming_the_variable() {
        for value in ["18446744073709551615", "65537", "0"] {
            let text = parse_world_size(value).unwrap_err().to_string();
            assert!(
                text.contains("TINYLLM_WORLD_SIZE") && text.contains("65536"),
                "{text}"
            );
        }
        assert_eq!(parse_world_size("65536").unwrap(), 65536);
        let err = RingConfig::new(0, MAX_WORLD_SIZE + 1, "/tmp", [0; 32]).unwrap_err();
        assert!(matches!(
            err,
            CollectiveError::InvalidRank {
                what: "world size",
                ..
            }
        ));
    }

    #[test]
    fn rank_outside_the_world_is_refused() {
        let err = RingConfig::new(2, 2, "/tmp", [0; 32]).unwrap_err();
        assert!(matches!(
            err,
            CollectiveError::InvalidRank {
                what: "rank",
                value: 2,
                ..
            }
        ));
        let err = RingConfig::new(0, 0, "/tmp", [0; 32]).unwrap_err();
        assert!(matches!(
            err,
            CollectiveError::InvalidRank {
                what: "world size",
                ..
            }
        ));
    }
}
