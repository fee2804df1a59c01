//! The `aurora` sparse encoding (docs/delta-format.md §6.3).
//!
//! Why it is small: whether an element changes in one low-learning-rate step depends
//! mostly on the spacing of BF16 values around it, that is on the exponent of its base
//! value, which the receiver already holds. Elements are split into up to eight classes by
//! base exponent (boundaries chosen per chunk by dynamic programming over an estimated
//! cost), and within each class the changed elements are coded as gaps between their ranks
//! with a Golomb code tuned to the class's density. The change itself is coded as a step in
//! ordered-integer space (mostly +-1) with a per-class static rANS model. Applying a step
//! is an integer addition, so reconstruction is exact for every bit pattern.
//!
//! Why it is fast: both encoder and decoder map ranks to positions with one pass of
//! 64-element SIMD exponent masks over the base; everything else costs per changed
//! element.

mod changes;
mod classes;
mod decoder;
mod encoder;
mod locate;
mod runs;

#[cfg(test)]
mod tests;

use super::entropy::ALPHABET;
use crate::error::DeltaError;

pub(crate) use decoder::{decode, parse};
pub(crate) use encoder::encode;
pub(crate) use runs::escaped_runs;

/// Step values below this are rANS symbols; larger ones use the escape symbol plus an
/// exponential-Golomb remainder.
const ESCAPE: u64 = ALPHABET as u64 - 1;

fn bad(reason: String) -> DeltaError {
    DeltaError::Malformed(reason)
}

/// The hot loops are compiled twice: for the baseline target and, selected at run time,
/// for x86-64-v3, whose POPCNT, TZCNT and AVX2 instructions they lean on.
#[cfg(target_arch = "x86_64")]
fn x86_64_v3() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("bmi1")
            && std::arch::is_x86_feature_detected!("bmi2")
            && std::arch::is_x86_feature_detected!("popcnt")
            && std::arch::is_x86_feature_detected!("lzcnt")
    })
}
