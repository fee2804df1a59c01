use thiserror::Error;

/// Everything the engine can refuse or fail at. Variants name the offending input so a
/// caller can report it without guessing.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error("invalid model configuration: {0}")]
    Config(String),

    #[error("weights: {0}")]
    Weights(String),

    #[error("tensor '{name}': {reason}")]
    Tensor { name: String, reason: String },

    #[error("cannot tokenize character {character:?} at byte {offset}: not in the alphabet")]
    UnknownCharacter { character: char, offset: usize },

    #[error("invalid task: {0}")]
    Task(String),

    #[error("invalid generation settings: {0}")]
    Generation(String),

    #[error("rollout for prompt {prompt_id}: {reason}")]
    Rollout { prompt_id: u64, reason: String },

    #[error("invalid training input: {0}")]
    Training(String),

    #[error("trainer state: {0}")]
    State(String),

    #[error("tensor computation in {context}: {source}")]
    Compute {
        context: &'static str,
        #[source]
        source: candle_core::Error,
    },
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Attaches the name of the computation to a candle error, since candle's own messages
/// rarely say which part of the model failed.
pub(crate) trait ComputeContext<T> {
    fn context(self, context: &'static str) -> Result<T>;
}

impl<T> ComputeContext<T> for candle_core::Result<T> {
    fn context(self, context: &'static str) -> Result<T> {
        self.map_err(|source| EngineError::Compute { context, source })
    }
}
