//! The control API's wire types: the JSON bodies of the hub's HTTP API and their
//! conversions to and from the core's types ([`aurora_control`]). This is the wire format
//! specified in `docs/control-api.md`, version 1; the hub (`aurora_hub`) serves it.
//!
//! It is a crate of its own so that clients (an actor's `ControlClient` in `aurora_node`,
//! `aurora run`'s actors, the Python package) speak the API without building the server:
//! it depends on the pure core and serde only, never on the hub's HTTP stack or database.
//!
//! The core's types are free to change shape; these are the contract with actors, so
//! every conversion is written out by hand. Identifiers and versions are plain
//! integers, weights hashes are 64 lowercase or uppercase hex digits, and times are
//! *durations from now* (`*_in_ms`): actors do not share the hub's clock, so an
//! absolute hub time would mean nothing to them.
//!
//! Requests are validated while converting ([`WireError`] names the field at fault);
//! results the core judges (late, duplicate, wrong hash...) are not errors but
//! per-result [`Outcome`]s in a successful [`SubmitResponse`].
//!
//! A result's `payload` (the rollout itself) is opaque to the hub: any JSON value of at
//! most [`MAX_PAYLOAD_BYTES`] as sent, kept as the exact text the actor sent.

use std::collections::BTreeMap;

use aurora_control::{
    Accepted, ActorId, Assignment, Capabilities, ControlPlane, LeaseGrant, LeaseId, Millis,
    Readiness, Region, Registration, Rejection, RolloutReport, StepId, Version, WeightsHash,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use thiserror::Error;

/// Largest payload of one result, in bytes of JSON text as sent. A rollout of a long
/// reasoning trace (32k tokens of text with per-token log-probabilities) fits; a
/// larger one is refused rather than stored in the state database.
pub const MAX_PAYLOAD_BYTES: usize = 256 * 1024;

/// A request body that is well-formed JSON but not a valid request.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{field}: {problem}")]
pub struct WireError {
    /// The field at fault, e.g. `results[3].weights_hash`.
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

/// `POST /v1/register`: join (or rejoin, as a new process) the membership.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    /// The actor's id, stable across reconnects.
    pub actor: u64,
    /// Its network region (printable ASCII, at most 64 bytes).
    pub region: String,
    /// Whether it can relay deltas to its region.
    #[serde(default)]
    pub can_relay: bool,
    /// The version whose weights it is generating with.
    pub active: u64,
    /// The next version, if its delta is staged.
    #[serde(default)]
    pub staged: Option<u64>,
}

impl RegisterRequest {
    /// The core's view of the request.
    pub fn into_core(self) -> Result<(ActorId, Registration), WireError> {
        let region = Region::new(&self.region).map_err(|error| WireError {
            field: "region".into(),
            problem: error.to_string(),
        })?;
        let registration = Registration {
            region,
            capabilities: Capabilities {
                can_relay: self.can_relay,
            },
            active: Version(self.active),
            staged: self.staged.map(Version),
        };
        Ok((ActorId(self.actor), registration))
    }
}

/// What an actor should do after registering or reporting its versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WireReadiness {
    /// Eligible for work: claim.
    Ready,
    /// Too far behind: catch up until active is `target` (or `target - 1` with
    /// `target` staged), then report the versions (`/v1/versions`).
    CatchUp {
        /// The latest published version.
        target: u64,
    },
}

impl From<Readiness> for WireReadiness {
    fn from(readiness: Readiness) -> WireReadiness {
        match readiness {
            Readiness::Ready => WireReadiness::Ready,
            Readiness::CatchUp { target } => WireReadiness::CatchUp { target: target.0 },
        }
    }
}

/// The answer to `POST /v1/register`: the readiness, and the actor's token for every
/// later call (`{"token":"...","kind":"ready"}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterResponse {
    /// The actor's bearer token, `<actor>.<64 hex digits>`; shown once.
    pub token: String,
    /// What to do next.
    #[serde(flatten)]
    pub readiness: WireReadiness,
}

impl RegisterResponse {
    /// The wire form of a registration's outcome, with the token's text. The token
    /// itself (the hub's `ActorToken`: drawn from the operating system's random source,
    /// stored as a hash) stays in the hub, so that this crate needs nothing of the server.
    pub fn from_core(readiness: Readiness, token: &str) -> RegisterResponse {
        RegisterResponse {
            token: token.to_owned(),
            readiness: readiness.into(),
        }
    }
}

/// The answer to `GET /v1/join`: what a node must know before it takes weights over the
/// wire, from the control plane, whose certificate (over mutual TLS) is the trainer's,
/// not from whoever serves it the weights: the run every signed statement names, the
/// newest committed version and the snapshot the trainer's hub offers for it. A joiner
/// pins the run, and takes no snapshot older than `snapshot` nor an upstream that has
/// committed less than `committed` (docs/wire-protocol.md §6.6).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinResponse {
    /// The run's id, 32 hex digits.
    pub run: String,
    /// The newest committed version, if any.
    #[serde(default)]
    pub committed: Option<u64>,
    /// The newest snapshot the trainer's store holds at or below `committed` (or the
    /// newest at all before any commit), if any.
    #[serde(default)]
    pub snapshot: Option<u64>,
}

/// `POST /v1/versions`: the versions an actor has active and staged, after staging a
/// delta, applying a Commit or catching up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VersionsRequest {
    /// The actor's id.
    pub actor: u64,
    /// The version it generates with.
    pub active: u64,
    /// The next version, if its delta is staged.
    #[serde(default)]
    pub staged: Option<u64>,
}

impl VersionsRequest {
    /// The reported active and staged versions.
    pub fn versions(self) -> (Version, Option<Version>) {
        (Version(self.active), self.staged.map(Version))
    }
}

/// `POST /v1/heartbeat`, `/v1/claim`, `/v1/leave` and `/v1/preempt`: a request that
/// only names the actor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActorRequest {
    /// The actor's id.
    pub actor: u64,
}

/// The empty answer of heartbeat, leave and preempt: `{}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {}

/// Names one lease; echo it back in the result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireLeaseId {
    /// The step whose batch holds the job.
    pub step: u64,
    /// The job's index in the batch.
    pub job: u32,
    /// Which attempt at the job this lease is.
    pub attempt: u64,
}

impl From<LeaseId> for WireLeaseId {
    fn from(lease: LeaseId) -> WireLeaseId {
        WireLeaseId {
            step: lease.step.0,
            job: lease.job,
            attempt: lease.attempt,
        }
    }
}

impl From<WireLeaseId> for LeaseId {
    fn from(lease: WireLeaseId) -> LeaseId {
        LeaseId {
            step: StepId(lease.step),
            job: lease.job,
            attempt: lease.attempt,
        }
    }
}

/// One job to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireLease {
    /// The lease to name in the result.
    pub lease: WireLeaseId,
    /// The prompt to generate for.
    pub prompt: u64,
    /// The version to generate with.
    pub version: u64,
    /// A result must arrive within this many milliseconds of the response.
    pub expires_in_ms: u64,
}

impl WireLease {
    fn from_core(grant: &LeaseGrant, now: Millis) -> WireLease {
        WireLease {
            lease: grant.lease.into(),
            prompt: grant.prompt.0,
            version: grant.version.0,
            expires_in_ms: grant.expires_at.saturating_since(now),
        }
    }
}

/// The answer to `POST /v1/claim`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ClaimResponse {
    /// Work on the open step; activate `commit` first if it is set. No leases means
    /// nothing is available now: claim again later.
    Work {
        /// The staged version to activate before generating.
        commit: Option<u64>,
        /// The jobs.
        leases: Vec<WireLease>,
    },
    /// In the preemption window: no new work, results for held leases are accepted for
    /// this many more milliseconds.
    Leaving {
        /// Time left in the window.
        leaving_in_ms: u64,
    },
    /// Too far behind for the open step.
    CatchUp {
        /// The open step's version.
        target: u64,
    },
    /// No step is open.
    NoOpenStep,
}

impl ClaimResponse {
    /// The wire form of the core's answer, with times relative to `now`, the time the
    /// claim was handled.
    pub fn from_core(assignment: &Assignment, now: Millis) -> ClaimResponse {
        match assignment {
            Assignment::Work { commit, leases } => ClaimResponse::Work {
                commit: commit.map(|version| version.0),
                leases: leases
                    .iter()
                    .map(|grant| WireLease::from_core(grant, now))
                    .collect(),
            },
            Assignment::Leaving { leaving_at } => ClaimResponse::Leaving {
                leaving_in_ms: leaving_at.saturating_since(now),
            },
            Assignment::CatchUp { target } => ClaimResponse::CatchUp { target: target.0 },
            Assignment::NoOpenStep => ClaimResponse::NoOpenStep,
        }
    }
}

/// One finished lease.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireResult {
    /// The lease it settles.
    pub lease: WireLeaseId,
    /// The version it was generated with.
    pub version: u64,
    /// h(version) of the weights it was generated with, 64 hex digits.
    pub weights_hash: String,
    /// Tokens generated.
    pub tokens: u64,
    /// The rollout: any JSON value (binary data as a base64 string), at most
    /// [`MAX_PAYLOAD_BYTES`] as sent.
    pub payload: Box<RawValue>,
}

/// One result as an actor submits it, validated: what the core judges, and the rollout
/// itself. What [`SubmitRequest::into_core`] makes and the hub's `Hub::submit` takes;
/// plain data, so it lives here with the conversion that checks it.
#[derive(Clone, Debug)]
pub struct RolloutResult {
    /// What decides acceptance and feeds the throughput estimate.
    pub report: RolloutReport,
    /// The rollout, opaque to the hub: any JSON value (binary data as a base64
    /// string). Stored if the result is accepted, dropped otherwise.
    pub payload: Box<RawValue>,
}

/// `POST /v1/submit`: results for leases the actor holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// The submitting actor.
    pub actor: u64,
    /// Its results, judged in order.
    pub results: Vec<WireResult>,
}

impl SubmitRequest {
    /// The hub's view of the request.
    pub fn into_core(self) -> Result<(ActorId, Vec<RolloutResult>), WireError> {
        let results = self
            .results
            .into_iter()
            .enumerate()
            .map(|(index, result)| {
                let weights_hash = parse_hash(&result.weights_hash).ok_or_else(|| WireError {
                    field: format!("results[{index}].weights_hash"),
                    problem: "expected 64 hex digits".into(),
                })?;
                let payload_bytes = result.payload.get().len();
                if payload_bytes > MAX_PAYLOAD_BYTES {
                    return Err(WireError {
                        field: format!("results[{index}].payload"),
                        problem: format!(
                            "{payload_bytes} bytes, more than the limit of {MAX_PAYLOAD_BYTES}"
                        ),
                    });
                }
                Ok(RolloutResult {
                    report: RolloutReport {
                        lease: result.lease.into(),
                        version: Version(result.version),
                        weights_hash,
                        tokens: result.tokens,
                    },
                    payload: result.payload,
                })
            })
            .collect::<Result<_, WireError>>()?;
        Ok((ActorId(self.actor), results))
    }
}

/// The answer to `POST /v1/submit`: one outcome per result, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitResponse {
    /// The outcomes.
    pub outcomes: Vec<Outcome>,
}

impl SubmitResponse {
    /// The wire form of the core's judgements.
    pub fn from_core(outcomes: &[Result<Accepted, Rejection>]) -> SubmitResponse {
        let outcomes = outcomes
            .iter()
            .map(|outcome| match outcome {
                Ok(accepted) => Outcome::Accepted {
                    prompt: accepted.prompt.0,
                },
                Err(rejection) => Outcome::Rejected {
                    reason: rejection_reason(*rejection).into(),
                    message: rejection.to_string(),
                },
            })
            .collect();
        SubmitResponse { outcomes }
    }
}

/// How one result was judged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    /// Accepted: the prompt is done and will never be accepted again.
    Accepted {
        /// The prompt it settled.
        prompt: u64,
    },
    /// Not accepted.
    Rejected {
        /// A stable name, one of [`rejection_reason`]'s.
        reason: String,
        /// A sentence for people.
        message: String,
    },
}

/// The answer to `GET /v1/status`: a monitoring view.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusResponse {
    /// The latest published version and its weights hash.
    pub latest: Option<PublishedStatus>,
    /// The lifetime a lease issued now would get.
    pub lease_ms: u64,
    /// Registered actors, by id.
    pub actors: Vec<ActorStatus>,
    /// The current or last step.
    pub step: Option<StepStatus>,
    /// Results accepted since the state was created.
    pub accepted: u64,
    /// Leases that ran out since the state was created.
    pub expired: u64,
    /// Results rejected since the state was created, by reason.
    pub rejected: BTreeMap<String, u64>,
}

/// A published version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishedStatus {
    /// The version.
    pub version: u64,
    /// h(version), 64 hex digits.
    pub weights_hash: String,
}

/// One registered actor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorStatus {
    /// Its id.
    pub actor: u64,
    /// Its region.
    pub region: String,
    /// Its active version.
    pub active: u64,
    /// Its staged version.
    pub staged: Option<u64>,
    /// Its throughput estimate, in thousandths of a token per second.
    pub estimate_milli_tokens_per_s: u64,
    /// Whether it is in a preemption window.
    pub leaving: bool,
}

/// Counts for one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepStatus {
    /// The step.
    pub step: u64,
    /// Its version.
    pub version: u64,
    /// Prompts in its batch.
    pub batch_size: u32,
    /// Results accepted.
    pub accepted: u32,
    /// Jobs under a live lease.
    pub leased: u32,
    /// Jobs in the pool, reserved or not.
    pub pooled: u32,
    /// Pooled jobs reserved for an actor.
    pub reserved: u32,
    /// Whether the step has completed.
    pub complete: bool,
}

impl StatusResponse {
    /// A monitoring view of the core.
    pub fn from_core(core: &ControlPlane) -> StatusResponse {
        let stats = core.stats();
        StatusResponse {
            latest: core
                .latest_version()
                .map(|(version, hash)| PublishedStatus {
                    version: version.0,
                    weights_hash: format_hash(&hash),
                }),
            lease_ms: core.lease_ms(),
            actors: core
                .members()
                .iter()
                .map(|(actor, member)| ActorStatus {
                    actor: actor.0,
                    region: member.region.as_str().into(),
                    active: member.active.0,
                    staged: member.staged.map(|version| version.0),
                    estimate_milli_tokens_per_s: member.estimate.milli_tokens_per_s(),
                    leaving: member.leaving_at.is_some(),
                })
                .collect(),
            step: core.step_progress().map(|progress| StepStatus {
                step: progress.step.0,
                version: progress.version.0,
                batch_size: progress.batch_size,
                accepted: progress.accepted,
                leased: progress.leased,
                pooled: progress.pooled,
                reserved: progress.reserved,
                complete: progress.completion.is_some(),
            }),
            accepted: stats.accepted,
            expired: stats.expired,
            rejected: stats
                .rejected
                .iter()
                .map(|(rejection, count)| (rejection_reason(*rejection).into(), *count))
                .collect(),
        }
    }
}

/// The body of every error response: `{ "error": "..." }`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What was wrong, as a sentence.
    pub error: String,
}

/// Every [`Rejection`], for metrics that list each reason even at zero.
pub const REJECTIONS: [Rejection; 9] = [
    Rejection::UnknownActor,
    Rejection::UnknownLease,
    Rejection::NotLeaseHolder,
    Rejection::StepClosed,
    Rejection::Late,
    Rejection::Duplicate,
    Rejection::WrongVersion,
    Rejection::WrongHash,
    Rejection::TokenCountOutOfRange,
];

/// The stable wire name of a rejection reason, used in submit outcomes, the status
/// and metric labels. Written out rather than derived so that renaming a core variant
/// cannot silently change the API.
pub fn rejection_reason(rejection: Rejection) -> &'static str {
    match rejection {
        Rejection::UnknownActor => "unknown_actor",
        Rejection::UnknownLease => "unknown_lease",
        Rejection::NotLeaseHolder => "not_lease_holder",
        Rejection::StepClosed => "step_closed",
        Rejection::Late => "late",
        Rejection::Duplicate => "duplicate",
        Rejection::WrongVersion => "wrong_version",
        Rejection::WrongHash => "wrong_hash",
        Rejection::TokenCountOutOfRange => "token_count_out_of_range",
    }
}

/// A weights hash as 64 lowercase hex digits.
pub fn format_hash(hash: &WeightsHash) -> String {
    hash.0.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Parses 64 hex digits (either case) into a weights hash.
pub fn parse_hash(text: &str) -> Option<WeightsHash> {
    let digits = text.as_bytes();
    if digits.len() != 64 {
        return None;
    }
    let mut hash = [0u8; 32];
    for (byte, pair) in hash.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = hex_value(pair[0])? << 4 | hex_value(pair[1])?;
    }
    Some(WeightsHash(hash))
}

fn hex_value(digit: u8) -> Option<u8> {
    char::from(digit)
        .to_digit(16)
        .and_then(|value| u8::try_from(value).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_round_trip_and_bad_ones_are_refused() {
        let hash = WeightsHash(std::array::from_fn(|i| u8::try_from(i * 7).unwrap_or(0)));
        assert_eq!(parse_hash(&format_hash(&hash)), Some(hash));
        assert_eq!(parse_hash(&format_hash(&hash).to_uppercase()), Some(hash));
        assert_eq!(parse_hash("00"), None);
        assert_eq!(parse_hash(&"g".repeat(64)), None);
        assert_eq!(parse_hash(&"é".repeat(32)), None);
    }

    #[test]
    fn every_rejection_has_a_distinct_reason() {
        let mut reasons: Vec<_> = REJECTIONS.iter().map(|r| rejection_reason(*r)).collect();
        reasons.sort_unstable();
        reasons.dedup();
        assert_eq!(reasons.len(), REJECTIONS.len());
    }

    fn submission(results: &[(&str, String)]) -> SubmitRequest {
        let results = results
            .iter()
            .map(|(weights_hash, payload)| WireResult {
                lease: WireLeaseId {
                    step: 0,
                    job: 0,
                    attempt: 0,
                },
                version: 1,
                weights_hash: (*weights_hash).to_owned(),
                tokens: 5,
                payload: RawValue::from_string(payload.clone()).unwrap(),
            })
            .collect();
        SubmitRequest { actor: 1, results }
    }

    #[test]
    fn a_bad_hash_names_its_result() {
        let good = format_hash(&WeightsHash([1; 32]));
        let request = submission(&[(&good, "{}".into()), ("xyz", "{}".into())]);
        let error = request.into_core().unwrap_err();
        assert_eq!(error.field, "results[1].weights_hash");
    }

    #[test]
    fn limit_max_payload_bytes() {
        let hash = format_hash(&WeightsHash([1; 32]));
        // A JSON string of exactly the limit, quotes included, passes unchanged.
        let largest = format!("\"{}\"", "a".repeat(MAX_PAYLOAD_BYTES - 2));
        let (_, results) = submission(&[(&hash, largest.clone())]).into_core().unwrap();
        assert_eq!(results[0].payload.get(), largest);
        let over = format!("\"{}\"", "a".repeat(MAX_PAYLOAD_BYTES - 1));
        let error = submission(&[(&hash, "{}".into()), (&hash, over)])
            .into_core()
            .unwrap_err();
        assert_eq!(error.field, "results[1].payload");
        assert_eq!(
            error.problem,
            format!(
                "{} bytes, more than the limit of {MAX_PAYLOAD_BYTES}",
                MAX_PAYLOAD_BYTES + 1
            )
        );
    }
}
