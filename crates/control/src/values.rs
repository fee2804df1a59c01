//! Plain values shared by the ledger, the scheduler and membership: time, identifiers,
//! versions and ratios.
//!
//! Everything here is `Copy` or a validated string, serializes transparently, and is
//! cheap to compare, so that the whole core can be snapshotted with serde.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A point in time, in milliseconds, on whatever monotonic clock the driver uses.
///
/// The core never reads a clock: every call whose outcome depends on time takes `now`.
/// Arithmetic saturates because a driver that restarts on a different clock may hand in
/// a `now` earlier than a stored deadline; that must delay things, never panic.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Millis(pub u64);

impl Millis {
    /// `self + duration_ms`, clamped at the end of time.
    pub fn saturating_add(self, duration_ms: u64) -> Millis {
        Millis(self.0.saturating_add(duration_ms))
    }

    /// Milliseconds from `earlier` to `self`; zero if `earlier` is in the future.
    pub fn saturating_since(self, earlier: Millis) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// Identifies an actor across reconnects; the shell maps authenticated peers to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ActorId(pub u64);

impl fmt::Display for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "actor {}", self.0)
    }
}

/// Identifies a prompt of the training set; the trainer chooses these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PromptId(pub u64);

impl fmt::Display for PromptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "prompt {}", self.0)
    }
}

/// Identifies one training step's batch; assigned by the ledger, increasing from 0.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct StepId(pub u64);

impl fmt::Display for StepId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {}", self.0)
    }
}

/// A published policy version. Versions are consecutive, which is what lets the
/// eligibility rule speak of "v - 1 with v staged".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Version(pub u64);

impl Version {
    /// The version after this one, or `None` at the end of the number space.
    pub fn next(self) -> Option<Version> {
        self.0.checked_add(1).map(Version)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// Content hash of a version's BF16 weights, h(v). Results carry the hash of the
/// weights they were generated with, so a corrupted or half-applied policy is caught
/// even when the version number is right.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WeightsHash(pub [u8; 32]);

/// Longest accepted region name, in bytes. Region names come from actors, so they are
/// bounded like every other hostile input.
pub const MAX_REGION_LEN: usize = 64;

/// A network region (e.g. "eu-west"). One relay serves each region.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Region(String);

/// Why a region name was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum RegionError {
    /// The name is empty.
    #[error("region name is empty")]
    Empty,
    /// The name is longer than [`MAX_REGION_LEN`].
    #[error("region name is {len} bytes, more than the limit of {MAX_REGION_LEN}")]
    TooLong {
        /// Length of the refused name in bytes.
        len: usize,
    },
    /// The name has a byte outside printable ASCII, which would make logs and metric
    /// labels ambiguous.
    #[error("region name may only contain printable ASCII without spaces")]
    BadCharacter,
}

impl Region {
    /// Validates a region name.
    pub fn new(name: &str) -> Result<Region, RegionError> {
        if name.is_empty() {
            return Err(RegionError::Empty);
        }
        if name.len() > MAX_REGION_LEN {
            return Err(RegionError::TooLong { len: name.len() });
        }
        if !name.bytes().all(|byte| byte.is_ascii_graphic()) {
            return Err(RegionError::BadCharacter);
        }
        Ok(Region(name.to_owned()))
    }

    /// The region's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Region {
    type Error = RegionError;

    fn try_from(name: String) -> Result<Region, RegionError> {
        Region::new(&name)
    }
}

impl From<Region> for String {
    fn from(region: Region) -> String {
        region.0
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What an actor can do besides generating.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// It has the uplink and disk to forward deltas to its region.
    pub can_relay: bool,
}

/// Names one lease: which job of which step, and which attempt at it.
///
/// The attempt number makes every lease id unique without a global counter, and lets
/// the ledger classify a stale id (late, duplicate, closed step) from the job's state
/// alone instead of keeping tombstones for every lease it ever issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LeaseId {
    /// The step whose batch holds the job.
    pub step: StepId,
    /// Index of the job (prompt) in the step's batch.
    pub job: u32,
    /// How many leases on this job were issued before this one.
    pub attempt: u64,
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lease {}/{}/{}", self.step.0, self.job, self.attempt)
    }
}

/// A ratio in thousandths, 0..=1000. Integer ratios keep the core's arithmetic exact,
/// so a state restored from JSON behaves bit-for-bit like the one that was saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u16", into = "u16")]
pub struct Permille(u16);

/// Why a [`Permille`] was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("{0} permille is more than 1000")]
pub struct PermilleOutOfRange(pub u16);

impl Permille {
    /// The whole: 1000 permille.
    pub const ONE: Permille = Permille(1000);

    /// Validates a ratio in thousandths.
    pub const fn new(thousandths: u16) -> Result<Permille, PermilleOutOfRange> {
        if thousandths > 1000 {
            Err(PermilleOutOfRange(thousandths))
        } else {
            Ok(Permille(thousandths))
        }
    }

    /// A ratio in thousandths, values above 1000 taken as 1000: for literals in
    /// settings, where a typo must not turn into a panic.
    pub const fn clamped(thousandths: u16) -> Permille {
        if thousandths > 1000 {
            Permille(1000)
        } else {
            Permille(thousandths)
        }
    }

    /// The ratio in thousandths.
    pub const fn get(self) -> u16 {
        self.0
    }

    /// `value * self`, rounded to nearest. Never overflows because the ratio is at most 1.
    pub fn of(self, value: u64) -> u64 {
        let scaled = (u128::from(value) * u128::from(self.0) + 500) / 1000;
        // The ratio is at most one, so the product fits back into u64.
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }

    /// `value * self`, rounded up: for minimum counts, where rounding down would let
    /// a batch finish with less than the configured fraction.
    pub fn of_rounded_up(self, value: u64) -> u64 {
        let scaled = (u128::from(value) * u128::from(self.0)).div_ceil(1000);
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }
}

impl TryFrom<u16> for Permille {
    type Error = PermilleOutOfRange;

    fn try_from(thousandths: u16) -> Result<Permille, PermilleOutOfRange> {
        Permille::new(thousandths)
    }
}

impl From<Permille> for u16 {
    fn from(ratio: Permille) -> u16 {
        ratio.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_region(name: &str, expected: Result<&str, RegionError>) {
        let actual = Region::new(name);
        assert_eq!(
            actual.as_ref().map(Region::as_str),
            expected.as_ref().copied()
        );
    }

    #[test]
    fn region_names_are_validated() {
        check_region("eu-west", Ok("eu-west"));
        check_region("", Err(RegionError::Empty));
        check_region("eu west", Err(RegionError::BadCharacter));
        check_region("région", Err(RegionError::BadCharacter));
        check_region(&"a".repeat(MAX_REGION_LEN), Ok(&"a".repeat(MAX_REGION_LEN)));
        check_region(
            &"a".repeat(MAX_REGION_LEN + 1),
            Err(RegionError::TooLong {
                len: MAX_REGION_LEN + 1,
            }),
        );
    }

    #[test]
    fn region_is_validated_when_deserialized() {
        let restored: Result<Region, _> = serde_json::from_str("\"\"");
        assert!(restored.is_err());
        let restored: Region = serde_json::from_str("\"us-east\"").unwrap();
        assert_eq!(restored.as_str(), "us-east");
    }

    fn check_permille(ratio: u16, value: u64, nearest: u64, up: u64) {
        let ratio = Permille::new(ratio).unwrap();
        assert_eq!((ratio.of(value), ratio.of_rounded_up(value)), (nearest, up));
    }

    #[test]
    fn permille_rounds_as_documented() {
        check_permille(500, 3, 2, 2);
        check_permille(333, 10, 3, 4);
        check_permille(1000, u64::MAX, u64::MAX, u64::MAX);
        check_permille(0, 12345, 0, 0);
        assert_eq!(Permille::new(1001), Err(PermilleOutOfRange(1001)));
        assert_eq!(Permille::clamped(1001), Permille::ONE);
        assert!(serde_json::from_str::<Permille>("1001").is_err());
    }

    #[test]
    fn time_arithmetic_saturates() {
        assert_eq!(Millis(5).saturating_since(Millis(9)), 0);
        assert_eq!(Millis(9).saturating_since(Millis(5)), 4);
        assert_eq!(Millis(u64::MAX).saturating_add(1), Millis(u64::MAX));
    }
}
