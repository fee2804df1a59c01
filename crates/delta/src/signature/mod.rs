//! Signed versions (docs/security.md): the trainer's ed25519 key signs a canonical
//! statement of each artifact it serves and of each Commit, so that whoever carries them
//! (a relay, a store, a file copy) can withhold them but not alter them unnoticed.
//!
//! The artifact id already binds the descriptor and the segment table (and through the
//! table every segment's bytes), so an artifact's statement is the id with the fields a
//! receiver acts on spelled out beside it: kind, versions, weights hashes, encoding. A
//! statement begins with a domain string, so a signature over one kind of statement can
//! never verify as another. Signing and verifying are pure: keys in, bytes out.
//!
//! An artifact's id is known only when its extraction ends, after its descriptor and
//! first segments went out cut-through; a receiver that builds from the descriptor
//! (a joiner allocates a snapshot's image from it) cannot wait for it. So the descriptor
//! is signed on its own too, as the Offer that carries it ([`Statement::Offer`]), and
//! checked before anything is decoded or allocated for it.
//!
//!
//! Every statement names the run it belongs to ([`RunId`]: random, fixed when the
//! trainer's store is made), right after its domain string. One key may sign many runs
//! (a fleet's `signing.key` outlives a run); the run keeps a node that pins this run
//! from taking another run's authentic versions, its version 0 included, as this one's.
//!
//! A detached signature file (`FILE.sig`, docs/delta-format.md §10) carries one artifact
//! signature with the signer's public key and the run, so `aurora delta verify --key`
//! can say whether the file was signed by another key, for another run, or altered since.

use ed25519_dalek::Signer;
pub use ed25519_dalek::{SigningKey, VerifyingKey};

use crate::{DeltaHeader, Encoding, Hash, Manifest};

/// First bytes of every artifact statement.
pub const ARTIFACT_DOMAIN: &[u8] = b"aurora-artifact-signature-v2\0";
/// First bytes of every Offer statement (an artifact's descriptor).
pub const OFFER_DOMAIN: &[u8] = b"aurora-offer-signature-v2\0";
/// First bytes of every commit statement.
pub const COMMIT_DOMAIN: &[u8] = b"aurora-commit-signature-v2\0";
/// Magic of a detached signature file.
pub const DETACHED_MAGIC: [u8; 8] = *b"\x89ASIG\r\n\x1a";
/// Version of the detached signature file format.
pub const DETACHED_VERSION: u16 = 2;
/// Bytes of a detached signature file of version 2.
pub const DETACHED_BYTES: usize = 8 + 2 + 1 + 32 + RunId::BYTES + 32 + 64;

/// A run's identity: 16 random bytes fixed when the trainer's store is made, in every
/// signed statement. The all-zero id is no run's: it stands for "not known yet" where a
/// relay has not learned its run.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct RunId(pub [u8; 16]);

impl RunId {
    pub const BYTES: usize = 16;
    /// No run.
    pub const UNKNOWN: RunId = RunId([0; 16]);

    /// Whether this names a run (not [`RunId::UNKNOWN`]).
    pub fn is_known(&self) -> bool {
        *self != RunId::UNKNOWN
    }

    /// 32 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// From 32 hex digits.
    pub fn from_hex(text: &str) -> Option<RunId> {
        if text.len() != 2 * RunId::BYTES || !text.is_ascii() {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(RunId(bytes))
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl std::fmt::Debug for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RunId({})", self.to_hex())
    }
}

impl serde::Serialize for RunId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for RunId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<RunId, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for RunId {
    type Err = String;

    fn from_str(text: &str) -> Result<RunId, String> {
        RunId::from_hex(text)
            .filter(RunId::is_known)
            .ok_or_else(|| format!("{text:?} is not a run id (32 hex digits, not all zero)"))
    }
}

/// The kind of an artifact, as an Offer names it (docs/wire-protocol.md §4.4) and a
/// statement signs it: a delta and a composed delta between the same versions are
/// different artifacts, and one must never pass for the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ArtifactKind {
    /// A delta D(v) from v - 1 to v.
    Delta = 1,
    /// A whole checkpoint in the delta format: the delta from the empty checkpoint to
    /// version v, every tensor added, with base and target version both v.
    Snapshot = 2,
    /// A delta from an older version straight to this one, for a peer catching up.
    Composed = 3,
}

impl ArtifactKind {
    pub fn from_code(code: u8) -> Option<ArtifactKind> {
        match code {
            1 => Some(ArtifactKind::Delta),
            2 => Some(ArtifactKind::Snapshot),
            3 => Some(ArtifactKind::Composed),
            _ => None,
        }
    }
}

impl std::fmt::Display for ArtifactKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ArtifactKind::Delta => "a delta",
            ArtifactKind::Snapshot => "a snapshot",
            ArtifactKind::Composed => "a composed delta",
        })
    }
}

/// An ed25519 signature by the trainer's key over a [`Statement`]: an artifact's or a
/// Commit's.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ArtifactSignature(pub [u8; 64]);

impl std::fmt::Debug for ArtifactSignature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex: String = self.0[..8].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "ArtifactSignature({hex}..)")
    }
}

/// What the trainer vouches for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Statement {
    /// This artifact (its id, so its descriptor, table and segments) is the trainer's.
    Artifact {
        kind: ArtifactKind,
        id: Hash,
        base_version: u64,
        target_version: u64,
        base_hash: Hash,
        target_hash: Hash,
        encoding: Encoding,
    },
    /// Version `version`, whose weights hash is `weights_hash`, is committed.
    Commit { version: u64, weights_hash: Hash },
    /// The artifact of `kind` to `version` has the descriptor (preamble and header, so
    /// every size a receiver allocates from) whose BLAKE3 hash is `descriptor`.
    Offer {
        kind: ArtifactKind,
        version: u64,
        descriptor: Hash,
    },
}

impl Statement {
    /// The statement of the artifact with `header` and id `id`.
    pub fn artifact(kind: ArtifactKind, id: Hash, header: &DeltaHeader) -> Statement {
        Statement::Artifact {
            kind,
            id,
            base_version: header.base_version,
            target_version: header.target_version,
            base_hash: header.base_hash,
            target_hash: header.target_hash,
            encoding: header.encoding,
        }
    }

    /// The statement of the artifact `manifest` describes (its id is computed here).
    pub fn manifest(kind: ArtifactKind, manifest: &Manifest) -> Statement {
        Statement::artifact(kind, manifest.id(), &manifest.header)
    }

    /// The statement of the Offer of the artifact of `kind` to `version` whose
    /// descriptor is `descriptor` (docs/wire-protocol.md §4.4).
    pub fn offer(kind: ArtifactKind, version: u64, descriptor: &[u8]) -> Statement {
        Statement::Offer {
            kind,
            version,
            descriptor: Hash::of(descriptor),
        }
    }

    /// The canonical bytes that are signed for `run`: the domain string, the run, then
    /// every field at a fixed width, integers little-endian.
    pub fn to_bytes(&self, run: &RunId) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(ARTIFACT_DOMAIN.len() + RunId::BYTES + 1 + 32 * 3 + 16 + 1);
        let begin = |out: &mut Vec<u8>, domain: &[u8]| {
            out.extend_from_slice(domain);
            out.extend_from_slice(&run.0);
        };
        match self {
            Statement::Artifact {
                kind,
                id,
                base_version,
                target_version,
                base_hash,
                target_hash,
                encoding,
            } => {
                begin(&mut out, ARTIFACT_DOMAIN);
                out.push(*kind as u8);
                out.extend_from_slice(&id.0);
                out.extend_from_slice(&base_version.to_le_bytes());
                out.extend_from_slice(&target_version.to_le_bytes());
                out.extend_from_slice(&base_hash.0);
                out.extend_from_slice(&target_hash.0);
                out.push(encoding.code());
            }
            Statement::Commit {
                version,
                weights_hash,
            } => {
                begin(&mut out, COMMIT_DOMAIN);
                out.extend_from_slice(&version.to_le_bytes());
                out.extend_from_slice(&weights_hash.0);
            }
            Statement::Offer {
                kind,
                version,
                descriptor,
            } => {
                begin(&mut out, OFFER_DOMAIN);
                out.push(*kind as u8);
                out.extend_from_slice(&version.to_le_bytes());
                out.extend_from_slice(&descriptor.0);
            }
        }
        out
    }
}

impl std::fmt::Display for Statement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Statement::Artifact {
                kind,
                id,
                base_version,
                target_version,
                ..
            } => write!(
                f,
                "{kind} from version {base_version} to {target_version} (id {id})"
            ),
            Statement::Commit {
                version,
                weights_hash,
            } => write!(
                f,
                "the commit of version {version} (weights {weights_hash})"
            ),
            Statement::Offer {
                kind,
                version,
                descriptor,
            } => write!(
                f,
                "the Offer of {kind} to version {version} (descriptor {descriptor})"
            ),
        }
    }
}

/// Why a signature does not vouch for what it came with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("{statement} carries no signature, and the trainer key {key} is pinned")]
    Missing { statement: String, key: String },
    /// Made by another key, for another run, or over other contents: ed25519 cannot
    /// tell these apart.
    #[error(
        "the signature of {statement} does not verify with the trainer key {key} for run {run}: it was made by another key, for another run or for other contents"
    )]
    Invalid {
        statement: String,
        key: String,
        run: RunId,
    },
    /// A detached signature names its signer, so this case is told apart.
    #[error("signed by key {signed_by}, not by the pinned trainer key {pinned}")]
    WrongKey { signed_by: String, pinned: String },
    /// A detached signature names its run, so this case is told apart too.
    #[error("signed for run {signed}, not for the pinned run {pinned}")]
    OtherRun { signed: RunId, pinned: RunId },
    /// A detached signature names the artifact it signs.
    #[error("the signature is for {signed}, not for {actual}")]
    OtherArtifact { signed: String, actual: String },
    #[error("not a detached signature: {0}")]
    Malformed(String),
}

/// Signs `statement` of `run` with the trainer's key.
pub fn sign(key: &SigningKey, run: &RunId, statement: &Statement) -> ArtifactSignature {
    ArtifactSignature(key.sign(&statement.to_bytes(run)).to_bytes())
}

/// Checks that `signature` is `key`'s over `statement` of `run`; a missing one is an
/// error (the caller pinned a key, so it requires one).
pub fn verify(
    key: &VerifyingKey,
    run: &RunId,
    statement: &Statement,
    signature: Option<&ArtifactSignature>,
) -> Result<(), SignatureError> {
    let Some(signature) = signature else {
        return Err(SignatureError::Missing {
            statement: statement.to_string(),
            key: key_fingerprint(key),
        });
    };
    let signature = ed25519_dalek::Signature::from_bytes(&signature.0);
    // Strict verification refuses the malleable and small-order encodings that plain
    // ed25519 verification lets through.
    key.verify_strict(&statement.to_bytes(run), &signature)
        .map_err(|_| SignatureError::Invalid {
            statement: statement.to_string(),
            key: key_fingerprint(key),
            run: *run,
        })
}

/// A short name for a public key in logs and errors: the first 8 bytes of the BLAKE3
/// hash of its bytes, in hex. Never compared in place of the key itself.
pub fn key_fingerprint(key: &VerifyingKey) -> String {
    Hash::of(key.as_bytes()).to_hex()[..16].to_string()
}

/// A detached signature of one artifact (docs/delta-format.md §10): what is signed and by
/// whom, so a check can name what differs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetachedSignature {
    pub kind: ArtifactKind,
    pub signer: VerifyingKey,
    pub run: RunId,
    pub id: Hash,
    pub signature: ArtifactSignature,
}

impl DetachedSignature {
    /// Signs the artifact `kind` of `run` with `header` and id `id`.
    pub fn sign(
        key: &SigningKey,
        run: RunId,
        kind: ArtifactKind,
        id: Hash,
        header: &DeltaHeader,
    ) -> Self {
        DetachedSignature {
            kind,
            signer: key.verifying_key(),
            run,
            id,
            signature: sign(key, &run, &Statement::artifact(kind, id, header)),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(DETACHED_BYTES);
        out.extend_from_slice(&DETACHED_MAGIC);
        out.extend_from_slice(&DETACHED_VERSION.to_le_bytes());
        out.push(self.kind as u8);
        out.extend_from_slice(self.signer.as_bytes());
        out.extend_from_slice(&self.run.0);
        out.extend_from_slice(&self.id.0);
        out.extend_from_slice(&self.signature.0);
        out
    }

    pub fn parse(bytes: &[u8]) -> Result<DetachedSignature, SignatureError> {
        let malformed = |what: String| SignatureError::Malformed(what);
        if bytes.len() < 10 || bytes[..8] != DETACHED_MAGIC {
            return Err(malformed("bad magic bytes".into()));
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != DETACHED_VERSION {
            return Err(malformed(format!(
                "format version {version}, this build reads version {DETACHED_VERSION}"
            )));
        }
        if bytes.len() != DETACHED_BYTES {
            return Err(malformed(format!(
                "{} bytes, a version {DETACHED_VERSION} signature has {DETACHED_BYTES}",
                bytes.len()
            )));
        }
        let kind = ArtifactKind::from_code(bytes[10])
            .ok_or_else(|| malformed(format!("unknown artifact kind {}", bytes[10])))?;
        let signer = VerifyingKey::from_bytes(bytes[11..43].try_into().expect("32 bytes"))
            .map_err(|_| malformed("the signer's public key is not a valid ed25519 key".into()))?;
        let run = RunId(bytes[43..59].try_into().expect("16 bytes"));
        if !run.is_known() {
            return Err(malformed("the run id is all zero".into()));
        }
        Ok(DetachedSignature {
            kind,
            signer,
            run,
            id: Hash(bytes[59..91].try_into().expect("32 bytes")),
            signature: ArtifactSignature(bytes[91..].try_into().expect("64 bytes")),
        })
    }

    /// Checks that this signature is `pinned`'s over the artifact with `header` and id
    /// `id`, for the run `run` where one is pinned, naming what differs: the signer,
    /// the run, the artifact, or (for a signature that does not verify) the contents.
    pub fn verify(
        &self,
        pinned: &VerifyingKey,
        run: Option<&RunId>,
        id: Hash,
        header: &DeltaHeader,
    ) -> Result<(), SignatureError> {
        if self.signer != *pinned {
            return Err(SignatureError::WrongKey {
                signed_by: key_fingerprint(&self.signer),
                pinned: key_fingerprint(pinned),
            });
        }
        if let Some(run) = run
            && *run != self.run
        {
            return Err(SignatureError::OtherRun {
                signed: self.run,
                pinned: *run,
            });
        }
        let statement = Statement::artifact(self.kind, id, header);
        if self.id != id {
            return Err(SignatureError::OtherArtifact {
                signed: format!("the artifact with id {}", self.id),
                actual: statement.to_string(),
            });
        }
        verify(pinned, &self.run, &statement, Some(&self.signature))
    }
}

#[cfg(test)]
mod tests;
