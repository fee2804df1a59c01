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
    /// The caller broke the node's contract (publishing out of order, a base that is not
    /// the published version, an activation still held).
    #[error("{0}")]
    Usage(String),
}

impl NodeError {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
        move |source| NodeError::Io {
            what: what.into(),
            source,
        }
    }
}
