//! The published chain the simulation serves: every version's weights and the deltas
//! between them, the store's snapshots and composed deltas, the trainer's signatures, and
//! what a malicious relay forges.

use super::*;

/// The published chain: weights images of every version and the deltas between them,
/// and the snapshot artifacts a store builds for joiners.
pub(crate) struct Chain {
    pub(crate) images: Vec<Vec<u8>>,
    pub(crate) hashes: Vec<Hash>,
    pub(crate) deltas: Vec<Bytes>,
    pub(crate) snapshots: BTreeMap<u64, Bytes>,
}

pub(crate) fn chain() -> &'static Chain {
    static CHAIN: OnceLock<Chain> = OnceLock::new();
    CHAIN.get_or_init(|| {
        let shape = aurora_synth::preset("tiny").unwrap();
        let mut config = aurora_synth::SynthConfig::new(shape, 11);
        // A larger step than real training, so each delta spans several segments.
        config.learning_rate = 2e-5;
        let chain = aurora_synth::DeltaChain::new(config, VERSIONS, 2048);
        let snapshots = (0..=VERSIONS)
            .step_by(SNAPSHOT_EVERY as usize)
            .map(|version| {
                let target = Checkpoint::from_safetensors(&chain.images[version as usize]).unwrap();
                let options = ExtractOptions {
                    encoding: Encoding::Dense,
                    base_version: version,
                    target_version: version,
                    segment_target_bytes: 4096,
                    ..ExtractOptions::default()
                };
                let (_, bytes) = Extraction::new(&Checkpoint::default(), &target, options)
                    .unwrap()
                    .to_bytes()
                    .unwrap();
                (version, Bytes::from(bytes))
            })
            .collect();
        Chain {
            images: chain.images,
            hashes: chain.hashes,
            deltas: chain.deltas.into_iter().map(Bytes::from).collect(),
            snapshots,
        }
    })
}

/// The run the simulated trainer's store made: every statement names it.
pub(crate) const RUN: RunId = RunId([0x77; 16]);

/// The trainer's signing key: the hub signs with it, every other peer pins its public half.
pub(crate) fn trainer_key() -> SigningKey {
    SigningKey::from_bytes(&[0x42; 32])
}

/// `bytes` as `kind`, with the trainer's signatures, as the hub serves it.
pub(crate) fn signed(bytes: Bytes, kind: ArtifactKind) -> StoredArtifact {
    StoredArtifact::signed(bytes, kind, &trainer_key(), &RUN).unwrap()
}

/// What the malicious relay offers a joiner as the snapshot of `version`: a well-formed
/// artifact whose descriptor claims one BF16 tensor of 2 TiB, signed by another key
/// (even versions) or not at all. A joiner that sized an image from the descriptor
/// before checking it would try to allocate what it claims.
pub(crate) fn forged_snapshot(version: u64) -> StoredArtifact {
    let header = DeltaHeader {
        base_version: version,
        target_version: version,
        base_hash: Checkpoint::default().weights_hash(),
        target_hash: Hash([0xEE; 32]),
        encoding: Encoding::Dense,
        tensors: vec![TensorEntry {
            name: "model.embed_tokens.weight".into(),
            change: TensorChange::Added(TensorSpec {
                dtype: Dtype::Bf16,
                shape: vec![1 << 20, 1 << 20],
            }),
        }],
    };
    let (_, bytes) = aurora_delta::assemble(&header, &[b"forged".to_vec(), vec![0; 64]]);
    let bytes = Bytes::from(bytes);
    if version.is_multiple_of(2) {
        let stranger = SigningKey::from_bytes(&[0x13; 32]);
        StoredArtifact::signed(bytes, ArtifactKind::Snapshot, &stranger, &RUN).unwrap()
    } else {
        StoredArtifact::unsigned(bytes)
    }
}

/// The trainer's signed commit of `version`.
pub(crate) fn signed_commit(version: u64) -> Commit {
    let mut commit = Commit {
        target: version_ref(version),
        signature: None,
    };
    commit.signature = Some(aurora_delta::sign(
        &trainer_key(),
        &RUN,
        &commit.statement(),
    ));
    commit
}

/// What a malicious relay serves as D(version): a valid delta from the real weights of
/// `version - 1` to weights with a few values changed, so its segments, their hashes,
/// the table, the id and the target hash all differ from the trainer's and agree with
/// each other. Only a signature can tell it from the real one.
pub(crate) fn forged(version: u64) -> Bytes {
    static FORGED: OnceLock<BTreeMap<u64, Bytes>> = OnceLock::new();
    FORGED.get_or_init(|| {
        let chain = chain();
        (1..=VERSIONS)
            .map(|version| {
                let base =
                    Checkpoint::from_safetensors(&chain.images[version as usize - 1]).unwrap();
                let mut image = chain.images[version as usize].clone();
                // The last bytes are tensor data (a BF16 value): poisoned weights.
                let end = image.len();
                image[end - 2] ^= 0x40;
                image[end - 5] ^= 0x01;
                let target = Checkpoint::from_safetensors(&image).unwrap();
                let options = ExtractOptions {
                    base_version: version - 1,
                    target_version: version,
                    segment_target_bytes: 2048,
                    base_hash: Some(chain.hashes[version as usize - 1]),
                    ..ExtractOptions::default()
                };
                let (_, bytes) = Extraction::new(&base, &target, options)
                    .unwrap()
                    .to_bytes()
                    .unwrap();
                assert_ne!(
                    DeltaFile::parse(&bytes).unwrap().header().target_hash,
                    chain.hashes[version as usize]
                );
                (version, Bytes::from(bytes))
            })
            .collect()
    })[&version]
        .clone()
}

/// The composed delta from `base` to `target`, as a store builds it: `target` extracted
/// against `base` (what `aurora_delta::compose` of the deltas in between yields).
pub(crate) fn composed(base: u64, target: u64) -> Bytes {
    let chain = chain();
    let from = Checkpoint::from_safetensors(&chain.images[base as usize]).unwrap();
    let to = Checkpoint::from_safetensors(&chain.images[target as usize]).unwrap();
    let options = ExtractOptions {
        base_version: base,
        target_version: target,
        segment_target_bytes: 2048,
        base_hash: Some(chain.hashes[base as usize]),
        target_hash: TargetHash::Known(chain.hashes[target as usize]),
        ..ExtractOptions::default()
    };
    let (_, bytes) = Extraction::new(&from, &to, options)
        .unwrap()
        .to_bytes()
        .unwrap();
    Bytes::from(bytes)
}
