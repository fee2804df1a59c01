use std::time::Duration;

/// What can stop a node or one of its calls; each names the part that failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("the checkpoint store: {0}")]
    Store(#[from] aurora_store::StoreError),
    #[error("opening the control plane: {0}")]
    OpenHub(#[from] aurora_hub::OpenError),
    #[error("the control plane: {0}")]
    Control(#[from] aurora_hub::CallError),
    #[error("the transport: {0}")]
    Transport(#[from] aurora_transport::TransportError),
    #[error(transparent)]
    Delta(#[from] aurora_delta::DeltaError),
    #[error(transparent)]
    BeyondLoopback(#[from] aurora_trust::BeyondLoopback),
    /// A call of the control plane's HTTP API failed.
    #[error("{path}: {reason}")]
    Api { path: String, reason: String },
    #[error("{what} did not happen within {timeout:?}")]
    Timeout { what: String, timeout: Duration },
    /// The node's security could not be built from its certificates.
    #[error("{what}: {reason}")]
    Security { what: &'static str, reason: String },
    /// Plaintext with an empty fleet token would let anyone in.
    #[error("the fleet token is empty: plaintext needs a shared secret")]
    EmptyFleetToken,
    /// The weights an activation handed out are still held where the next one would
    /// write them.
    #[error(
        "the weights of the previous activation are still held: release them before the next safe point"
    )]
    ActivationStillHeld,
    /// A version was published from a base that is not the latest published version.
    #[error(
        "the base is not version {version} as published (weights hash {base}, published {published}): were its tensors changed in place after publishing? Publish a copy (an export) instead"
    )]
    BaseNotPublished {
        version: u64,
        base: aurora_delta::Hash,
        published: aurora_delta::Hash,
    },
    /// The first version was published again.
    #[error("version {version} is published already: publish the next versions from it")]
    AlreadyPublished { version: u64 },
    /// A call needs a published version and there is none.
    #[error("nothing is published: publish the first version first")]
    NothingPublished,
    /// After a restart, a version was published again with weights other than those
    /// announced before.
    #[error(
        "version {version} was announced with weights {announced} before a restart, and these are {produced}: the trainer did not reproduce it"
    )]
    NotReproduced {
        version: u64,
        announced: aurora_delta::Hash,
        produced: aurora_delta::Hash,
    },
    /// The completed step's outcome went to another caller.
    #[error("the completed step's outcome was taken by another caller")]
    OutcomeTaken,
    /// The control plane's open step runs on a version the store does not hold.
    #[error("the open step runs on version {version}, which the store lacks")]
    StoreLacksVersion { version: u64 },
    /// The store and the control plane disagree on a version's weights.
    #[error("version {version} has one weights hash in the store and another in the control plane")]
    HashesDisagree { version: u64 },
    /// The node's certificate gives it no part in the segment protocol.
    #[error(transparent)]
    NoSegmentRole(#[from] aurora_transport::NoSegmentRole),
    /// The certificate names another node than the settings do.
    #[error(
        "the certificate is of {} '{}' in region '{}', not of this {role}{}{}",
        certified.role,
        certified.peer_id,
        certified.region,
        id.as_ref().map(|id| format!(" '{id}'")).unwrap_or_default(),
        region.as_ref().map(|r| format!(" in region '{r}'")).unwrap_or_default()
    )]
    NotThisNode {
        certified: aurora_proto::Identity,
        role: aurora_proto::Role,
        id: Option<String>,
        region: Option<String>,
    },
    /// A node without certificates was given no id.
    #[error("a {role} without certificates needs an id")]
    NoId { role: aurora_proto::Role },
    /// A relay or actor was given no upstream to follow.
    #[error("at least one upstream is required")]
    NoUpstream,
    /// The transport hub started without a listening address.
    #[error("the transport hub has no listening address")]
    NoTransportAddress,
}

impl NodeError {
    /// Whether the caller broke the node's contract (rather than something failing
    /// under it): the Python face raises these as `UsageError`.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            NodeError::Security { .. }
                | NodeError::EmptyFleetToken
                | NodeError::ActivationStillHeld
                | NodeError::BaseNotPublished { .. }
                | NodeError::AlreadyPublished { .. }
                | NodeError::NothingPublished
                | NodeError::NotReproduced { .. }
                | NodeError::OutcomeTaken
                | NodeError::StoreLacksVersion { .. }
                | NodeError::HashesDisagree { .. }
                | NodeError::NoSegmentRole(_)
                | NodeError::NoTransportAddress
                | NodeError::NotThisNode { .. }
                | NodeError::NoId { .. }
                | NodeError::NoUpstream
        )
    }
}

impl NodeError {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
        move |source| NodeError::Io {
            what: what.into(),
            source,
        }
    }
}
