"""aurora_rl: lossless sparse delta checkpoints for RL post-training, from Python.

The Rust core that the ``aurora`` binary runs, with torch and numpy faces:

- ``diff``, ``apply`` and ``weights_hash``: the delta codec on mappings of Hugging Face
  tensor names to torch tensors or numpy arrays.
- ``Trainer``: the trainer node (control plane, transport hub, checkpoint store) in a
  PyTorch process: publish versions, post steps, take accepted rollouts.
- ``aurora_rl.sharded.ShardedPublisher`` (with torch): publishes from an FSDP2-sharded
  model without gathering it, each rank encoding its own shards.
- ``Actor``: the actor node in an inference process, activating versions into an engine
  (``aurora_rl.engines``: vLLM, Hugging Face transformers) at its safe points.

Errors are ``AuroraError`` subclasses carrying the Rust error's message: the delta
codec's (``DeltaError`` and its kinds, ``WrongBaseError``, ...), a node's failures
(``NodeError``; ``NodeTimeoutError`` is also a ``TimeoutError``, ``NodeClosedError``
follows ``close()``) and calls its contract does not allow (``UsageError``, also a
``ValueError``). Nodes are context managers: ``with Trainer(...) as trainer:`` closes
the node at the end of the block. Log records go
to Python's ``logging``: the package's to ``aurora_rl.*``, the Rust nodes' to loggers
named after their modules (``aurora_transport.node``, ``aurora_node.actor``, ...).
"""

from aurora_rl._core import (
    FORMAT_VERSION,
    AuroraError,
    CheckpointError,
    CorruptedDeltaError,
    DeltaError,
    NodeClosedError,
    NodeError,
    NodeTimeoutError,
    TargetMismatchError,
    TruncatedDeltaError,
    UsageError,
    WrongBaseError,
)
from aurora_rl.actor import Actor, Lease, LeaseId, Work
from aurora_rl.codec import apply, diff, weights_hash
from aurora_rl.trainer import ActorStatus, Published, Rollout, Status, StepResults, StepStatus, Trainer

__all__ = [
    "FORMAT_VERSION",
    "Actor",
    "ActorStatus",
    "Lease",
    "LeaseId",
    "Published",
    "Rollout",
    "Status",
    "StepResults",
    "StepStatus",
    "Trainer",
    "Work",
    "AuroraError",
    "CheckpointError",
    "CorruptedDeltaError",
    "DeltaError",
    "NodeClosedError",
    "NodeError",
    "NodeTimeoutError",
    "TargetMismatchError",
    "TruncatedDeltaError",
    "UsageError",
    "WrongBaseError",
    "apply",
    "diff",
    "weights_hash",
]
