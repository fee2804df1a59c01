//! Snapshots on the wire (docs/wire-protocol.md §4.4): a whole checkpoint travels as the
//! delta from the empty checkpoint to it, so segments, hashes, the table, the artifact id,
//! verification, resume and striping work for it exactly as for a delta.
//!
//! A snapshot of version v is an artifact whose header names v as both base and target
//! version (it delivers v and follows nothing), the empty checkpoint's weights hash as its
//! base hash, and every tensor as added (dense chunks, delta-format §5). Only a peer that
//! holds no weights can decode it: its base is the empty checkpoint.

use aurora_delta::{Checkpoint, DeltaHeader, Hash, TensorChange};

/// The weights hash of the checkpoint with no tensors (delta-format §2): a snapshot's
/// base hash.
pub fn empty_weights_hash() -> Hash {
    Checkpoint::default().weights_hash()
}

/// Why a header does not describe a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotASnapshot {
    #[error(
        "a snapshot of version {version} must name it as base and target, not {base} and {target}"
    )]
    Versions {
        version: u64,
        base: u64,
        target: u64,
    },
    #[error("a snapshot starts from the empty checkpoint, not from weights {base_hash}")]
    Base { base_hash: Hash },
    #[error("tensor '{name}' of a snapshot is not added")]
    NotAdded { name: String },
}

/// Checks that `header` describes the snapshot of `version`.
pub fn check_header(header: &DeltaHeader, version: u64) -> Result<(), NotASnapshot> {
    if header.base_version != version || header.target_version != version {
        return Err(NotASnapshot::Versions {
            version,
            base: header.base_version,
            target: header.target_version,
        });
    }
    if header.base_hash != empty_weights_hash() {
        return Err(NotASnapshot::Base {
            base_hash: header.base_hash,
        });
    }
    if let Some(entry) = header
        .tensors
        .iter()
        .find(|e| !matches!(e.change, TensorChange::Added(_)))
    {
        return Err(NotASnapshot::NotAdded {
            name: entry.name.clone(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use aurora_delta::{Encoding, TensorEntry, TensorSpec};

    fn header() -> DeltaHeader {
        DeltaHeader {
            base_version: 4,
            target_version: 4,
            base_hash: empty_weights_hash(),
            target_hash: Hash([7; 32]),
            encoding: Encoding::Dense,
            tensors: vec![TensorEntry {
                name: "w".into(),
                change: TensorChange::Added(TensorSpec {
                    dtype: aurora_delta::Dtype::Bf16,
                    shape: vec![2],
                }),
            }],
        }
    }

    #[test]
    fn only_the_delta_from_the_empty_checkpoint_is_a_snapshot() {
        assert_eq!(check_header(&header(), 4), Ok(()));
        assert!(
            check_header(&header(), 5)
                .unwrap_err()
                .to_string()
                .contains("version 5")
        );
        let mut delta = header();
        delta.base_version = 3;
        assert!(
            check_header(&delta, 4)
                .unwrap_err()
                .to_string()
                .contains("3 and 4")
        );
        let mut other_base = header();
        other_base.base_hash = Hash([1; 32]);
        assert!(
            check_header(&other_base, 4)
                .unwrap_err()
                .to_string()
                .contains("empty checkpoint")
        );
        let mut patched = header();
        patched.tensors[0].change = TensorChange::Patched(TensorSpec {
            dtype: aurora_delta::Dtype::Bf16,
            shape: vec![2],
        });
        assert!(
            check_header(&patched, 4)
                .unwrap_err()
                .to_string()
                .contains("'w' of a snapshot is not added")
        );
    }
}
