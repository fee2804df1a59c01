//! Composition of delta chains and inversion (docs/delta-format.md §8).
//!
//! Both are exact because they go through the weights: a chain is applied step by step,
//! each step verified by its target hash, and the result is extracted against the
//! original base. A composed delta therefore carries only elements that differ between
//! its endpoints (changes that cancel out along the chain vanish), and an inverse is an
//! ordinary delta from the target back to the base.

use crate::apply::{check_base, decode};
use crate::checkpoint::{Checkpoint, Hash, TensorLayout};
use crate::error::{DeltaError, Result};
use crate::extract::{ExtractOptions, Extraction, TargetHash};
use crate::format::{DeltaFile, Manifest};
use crate::image::{Image, ImageSpace, checkpoint_image};

/// Composes `chain` (consecutive deltas starting at `base`) into one delta from `base`
/// to the chain's last target. `options.base_hash`, when given, is the caller's word for
/// the weights hash of `base` (checked against the chain, not recomputed). The chain's
/// end is rebuilt in `space`.
pub fn compose(
    base: &Checkpoint<'_>,
    chain: &[DeltaFile<'_>],
    options: ExtractOptions,
    space: &dyn ImageSpace,
) -> Result<(Manifest, Vec<u8>)> {
    let (first, last) = match (chain.first(), chain.last()) {
        (Some(first), Some(last)) => (first.header(), last.header()),
        _ => return Err(DeltaError::BrokenChain("the chain is empty".into())),
    };
    let (end, layout) =
        replay(base, chain, options.base_hash, space)?.expect("the chain is not empty");
    let end_view = Checkpoint::from_layout(&end, &layout)?;
    let options = ExtractOptions {
        base_version: first.base_version,
        target_version: last.target_version,
        base_hash: Some(first.base_hash),
        target_hash: TargetHash::Known(last.target_hash),
        ..options
    };
    Extraction::new(base, &end_view, options)?.to_bytes()
}

/// Applies `chain` (consecutive deltas starting at `base`) link by link, each link
/// verified by its target hash, and returns the weights after the last one (`None` for
/// an empty chain) as an image in `space`. `base_hash`: the weights hash of `base` when
/// the caller has verified it already; otherwise it is computed once.
///
/// The base is copied into the image once and each link is applied to it in place, so
/// the chain is replayed in one model's worth of `space` (two, for the moment a link that
/// changes the layout is materialised), never on the heap.
pub fn replay(
    base: &Checkpoint<'_>,
    chain: &[DeltaFile<'_>],
    base_hash: Option<Hash>,
    space: &dyn ImageSpace,
) -> Result<Option<(Image, Vec<TensorLayout>)>> {
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
    if chain.is_empty() {
        return Ok(None);
    }
    let (mut image, mut layout) = checkpoint_image(base, space)?;
    // Each link after the first starts from weights whose hash the previous link has
    // just verified.
    let mut known = base_hash;
    for delta in chain {
        let mut patch = {
            let view = Checkpoint::from_layout(&image, &layout)?;
            check_base(delta.header(), &view, known)?;
            let patch = decode(delta, &view)?;
            if !patch.preserves_layout() {
                (image, layout) = patch.materialize_image(&view, space)?;
                known = Some(delta.header().target_hash);
                continue;
            }
            patch
        };
        patch.apply_in_place(&mut image, &layout)?;
        known = Some(delta.header().target_hash);
    }
    Ok(Some((image, layout)))
}

/// The inverse of `delta`: applied to its target it yields `base` exactly. The target is
/// rebuilt in `space`.
pub fn invert(
    delta: &DeltaFile<'_>,
    base: &Checkpoint<'_>,
    options: ExtractOptions,
    space: &dyn ImageSpace,
) -> Result<(Manifest, Vec<u8>)> {
    let header = delta.header();
    let (target, layout) =
        replay(base, std::slice::from_ref(delta), None, space)?.expect("one delta");
    let target_view = Checkpoint::from_layout(&target, &layout)?;
    let options = ExtractOptions {
        base_version: header.target_version,
        target_version: header.base_version,
        base_hash: Some(header.target_hash),
        target_hash: TargetHash::Known(header.base_hash),
        ..options
    };
    Extraction::new(&target_view, base, options)?.to_bytes()
}
