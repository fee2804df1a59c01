//! Composition of delta chains and inversion (docs/delta-format.md §8).
//!
//! Both are exact because they go through the weights: a chain is applied step by step,
//! each step verified by its target hash, and the result is extracted against the
//! original base. A composed delta therefore carries only elements that differ between
//! its endpoints (changes that cancel out along the chain vanish), and an inverse is an
//! ordinary delta from the target back to the base.

use crate::apply::{OwnedTensor, apply, owned_checkpoint};
use crate::checkpoint::{Checkpoint, Hash};
use crate::error::{DeltaError, Result};
use crate::extract::{ExtractOptions, Extraction};
use crate::format::{DeltaFile, Manifest};

/// Composes `chain` (consecutive deltas starting at `base`) into one delta from `base`
/// to the chain's last target. `options.base_hash`, when given, is the caller's word for
/// the weights hash of `base` (checked against the chain, not recomputed).
pub fn compose(
    base: &Checkpoint<'_>,
    chain: &[DeltaFile<'_>],
    options: ExtractOptions,
) -> Result<(Manifest, Vec<u8>)> {
    let (first, last) = match (chain.first(), chain.last()) {
        (Some(first), Some(last)) => (first.header(), last.header()),
        _ => return Err(DeltaError::BrokenChain("the chain is empty".into())),
    };
    let end = replay(base, chain, options.base_hash)?.expect("the chain is not empty");
    let end_view = owned_checkpoint(&end)?;
    let options = ExtractOptions {
        base_version: first.base_version,
        target_version: last.target_version,
        base_hash: Some(first.base_hash),
        target_hash: Some(last.target_hash),
        ..options
    };
    Extraction::new(base, &end_view, options)?.to_bytes()
}

/// Applies `chain` (consecutive deltas starting at `base`) link by link, each link
/// verified by its target hash, and returns the weights after the last one (`None` for
/// an empty chain). `base_hash`: the weights hash of `base` when the caller has verified
/// it already; otherwise it is computed once.
pub fn replay(
    base: &Checkpoint<'_>,
    chain: &[DeltaFile<'_>],
    base_hash: Option<Hash>,
) -> Result<Option<Vec<OwnedTensor>>> {
    for (i, pair) in chain.windows(2).enumerate() {
        let (a, b) = (pair[0].header(), pair[1].header());
        if a.target_version != b.base_version || a.target_hash != b.base_hash {
            return Err(DeltaError::BrokenChain(format!(
                "delta {} ends at version {} ({}), delta {} starts at version {} ({})",
                i,
                a.target_version,
                a.target_hash,
                i + 1,
                b.base_version,
                b.base_hash
            )));
        }
    }
    let mut current: Option<Vec<OwnedTensor>> = None;
    for delta in chain {
        let next = {
            let view = match &current {
                Some(tensors) => owned_checkpoint(tensors)?,
                None => base.clone(),
            };
            // Each link after the first starts from weights whose hash the previous link
            // has just verified.
            let known = match current {
                Some(_) => Some(delta.header().base_hash),
                None => base_hash,
            };
            apply(delta, &view, known)?
        };
        current = Some(next);
    }
    Ok(current)
}

/// The inverse of `delta`: applied to its target it yields `base` exactly.
pub fn invert(
    delta: &DeltaFile<'_>,
    base: &Checkpoint<'_>,
    options: ExtractOptions,
) -> Result<(Manifest, Vec<u8>)> {
    let header = delta.header();
    let target = apply(delta, base, None)?;
    let target_view = owned_checkpoint(&target)?;
    let options = ExtractOptions {
        base_version: header.target_version,
        target_version: header.base_version,
        base_hash: Some(header.target_hash),
        target_hash: Some(header.base_hash),
        ..options
    };
    Extraction::new(&target_view, base, options)?.to_bytes()
}
