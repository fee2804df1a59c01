"""aurora as a vLLM weight-transfer backend (``weight_transfer_config={"backend":
"aurora"}``), for frameworks that drive vLLM's native weight-sync API.

Inference side (``AuroraWeightTransferEngine``, in each vLLM worker): the init info makes
the engine an aurora actor, whose node runs in the worker of tensor-parallel rank 0 (the
other ranks follow it: ``aurora_rl.engines.vllm_ranks``). It joins the fleet from the
newest snapshot (loaded whole), then stages every version the trainer publishes while vLLM serves. An update
(``update_weights`` with ``{"version", "weights_hash"}``) activates that committed version
inside vLLM's update lifecycle: its changed elements are written into the parameters in
place (``aurora_rl.engines.vllm_worker``), then what the model computes with is read
back and compared with the version (the version before with the changes laid over it,
as read from the delta whose target hash the node checked): a few tensors at random
(``verify="sample"``, the default), every one (``"full"``), or none (``"off"``); under
tensor parallelism each rank checks its shards.

Trainer side (``AuroraTrainerEngine``, through ``WeightTransferTrainerFactory``): the
trainer node (an ``aurora_rl.Trainer`` the caller made, with its certificates and signing
key) publishes each state the ``WeightSource`` yields as a delta, commits it, and drives
the inference side through the framework's ``VLLMWeightSyncClient``, reporting
``"<version>:<weights hash>"`` as vLLM's weight version.

Both register from ``aurora_rl.vllm_plugin`` (vLLM's plugin entry point), and on import
of this module, so a trainer process that never starts vLLM finds the trainer engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import aurora_rl
from aurora_rl.actor import VERIFY_MODES
from aurora_rl.engines import weight_version
from aurora_rl.engines.vllm_ranks import RankedModel, RankGroup, follow
from aurora_rl.engines.vllm_worker import ModelWriter

if TYPE_CHECKING:
    import torch
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient, WeightSource

logger = logging.getLogger("aurora_rl.vllm")

BACKEND = "aurora"


@dataclass
class AuroraInitInfo(WeightTransferInitInfo):
    """What makes a vLLM worker an aurora actor: ``aurora_rl.Actor``'s arguments."""

    #: The trainer node's control plane, HOST:PORT.
    control: str
    #: Where versions come from, in order of preference: the region's relay, the hub.
    upstreams: list[str]
    region: str
    #: The actor's id: the engine's, whatever its tensor-parallel size (rank 0's worker
    #: runs the actor node; the other ranks follow it, aurora_rl.engines.vllm_ranks).
    id: int
    token: Optional[str] = None
    ca: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    trainer_key: Optional[str] = None
    insecure_plaintext: bool = False
    insecure_closed_network: bool = False
    insecure_unsigned: bool = False
    streams: int = 4
    #: Longest wait for the snapshot to join from (s). Under tensor parallelism the other
    #: ranks wait that long in vLLM's group: keep it within the group's timeout.
    join_timeout: float = 300.0
    #: After each update, read back what the model computes with and compare it with the
    #: version (``aurora_rl.Actor``'s ``verify``): ``"sample"`` (``verify_tensors``
    #: tensors at random), ``"full"`` (every one, O(model)) or ``"off"``. Under tensor
    #: parallelism each rank checks its own shards.
    verify: str = "sample"
    verify_tensors: int = 4

    def __post_init__(self) -> None:
        # It arrives as JSON through the server's routes: refuse what is not one.
        if not isinstance(self.upstreams, list) or not all(isinstance(u, str) for u in self.upstreams):
            raise ValueError(f"upstreams is a list of HOST:PORT strings, not {self.upstreams!r}")
        if not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 0:
            raise ValueError(f"id is a non-negative integer, not {self.id!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify is one of {', '.join(VERIFY_MODES)}, not {self.verify!r}")
        if not isinstance(self.verify_tensors, int) or isinstance(self.verify_tensors, bool) or self.verify_tensors < 1:
            raise ValueError(f"verify_tensors is a positive integer, not {self.verify_tensors!r}")


@dataclass
class AuroraUpdateInfo(WeightTransferUpdateInfo):
    """The version to activate: committed by the trainer, staged or on its way."""

    version: int
    weights_hash: str
    #: Longest wait for the version to be staged and activated.
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0:
            raise ValueError(f"version is a non-negative integer, not {self.version!r}")
        if not (isinstance(self.weights_hash, str) and len(self.weights_hash) == 64
                and all(c in "0123456789abcdef" for c in self.weights_hash)):
            raise ValueError(f"weights_hash is 64 lowercase hex digits, not {self.weights_hash!r}")
        if not isinstance(self.timeout, (int, float)) or not 0 < self.timeout <= 86400:
            raise ValueError(f"timeout is seconds in (0, 86400], not {self.timeout!r}")


class AuroraWeightTransferEngine(WeightTransferEngine[AuroraInitInfo, AuroraUpdateInfo]):
    init_info_cls = AuroraInitInfo
    update_info_cls = AuroraUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        #: Rank 0's: the actor node and the model it drives on every rank.
        self.actor: Optional[aurora_rl.Actor] = None
        self.model_of_ranks: Optional[RankedModel] = None
        #: Another rank's: its group and writer, which follow rank 0's steps.
        self.following: Optional[tuple[RankGroup, ModelWriter]] = None

    def init_transfer_engine(self, init_info: AuroraInitInfo) -> None:
        from vllm.distributed.parallel_state import get_pp_group
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        self.shutdown()
        vllm_config, model = self.vllm_config, self.model

        def reload(tensors: dict[str, torch.Tensor]) -> None:
            reload_weights(vllm_config, model, list(tensors.items()), weights_path=None, is_checkpoint_format=True)

        if get_pp_group().world_size > 1:
            raise aurora_rl.UsageError(
                "the aurora backend takes tensor parallelism, not pipeline parallelism: "
                "every pipeline stage would join as the same actor"
            )
        ranks = RankGroup.of_worker()
        writer = ModelWriter(model, reload)
        if ranks is not None and ranks.rank != 0:
            follow(ranks, writer)
            self.following = (ranks, writer)
            return
        if vllm_config.load_config.load_format != "aurora":
            logger.warning(
                "vLLM was started with load format %r: layers it repacked take versions whole; "
                "load_format='aurora' keeps every weight where elements can be written",
                vllm_config.load_config.load_format,
            )
        ranked = RankedModel(writer, ranks)
        with ranked.leading():
            self.actor = aurora_rl.Actor(
                ranked,
                id=init_info.id,
                region=init_info.region,
                control=init_info.control,
                upstreams=init_info.upstreams,
                token=init_info.token,
                streams=init_info.streams,
                join_timeout=init_info.join_timeout,
                trainer_key=init_info.trainer_key,
                ca=init_info.ca,
                cert=init_info.cert,
                key=init_info.key,
                insecure_plaintext=init_info.insecure_plaintext,
                insecure_closed_network=init_info.insecure_closed_network,
                insecure_unsigned=init_info.insecure_unsigned,
                verify=init_info.verify,
                verify_tensors=init_info.verify_tensors,
            )
        self.model_of_ranks = ranked
        logger.info("joined the aurora fleet at version %d", self.actor.active[0])

    def start_weight_update(self) -> None:
        self._joined()

    def receive_weights(self, update_info: AuroraUpdateInfo) -> None:
        if self.following is not None:
            follow(*self.following)
            return
        actor = self._joined()
        assert actor is not None and self.model_of_ranks is not None
        with self.model_of_ranks.leading():
            deadline = time.monotonic() + update_info.timeout
            while actor.active[0] < update_info.version:
                left = deadline - time.monotonic()
                if left <= 0:
                    why = actor.why_behind()
                    raise aurora_rl.NodeTimeoutError(
                        f"version {update_info.version} was not staged and committed within {update_info.timeout} s "
                        f"(active: {actor.active[0]}{'; ' + why if why else ''})"
                    )
                actor.safe_point(wait=min(left, 1.0))
                self.model_of_ranks.keep_following()
            if actor.active != (update_info.version, update_info.weights_hash):
                raise aurora_rl.TargetMismatchError(
                    f"asked for version {update_info.version} ({update_info.weights_hash}), "
                    f"the fleet's is {actor.active[0]} ({actor.active[1]})"
                )

    def finish_weight_update(self) -> None:
        self._joined()

    def shutdown(self) -> None:
        if self.actor is not None:
            self.actor.close()
        self.actor = self.model_of_ranks = self.following = None

    def _joined(self) -> Optional[aurora_rl.Actor]:
        if self.actor is None and self.following is None:
            raise aurora_rl.UsageError("init_weight_transfer_engine first: the worker has not joined a fleet")
        return self.actor


@dataclass
class AuroraTrainerInitInfo(TrainerInitInfo):
    """The trainer node that publishes, and what each vLLM worker joins with."""

    backend: ClassVar[str] = BACKEND
    #: The trainer node (``aurora_rl.Trainer``) on rank 0; ignored on other ranks.
    trainer: Optional[aurora_rl.Trainer] = None
    #: The workers' ``AuroraInitInfo`` fields beyond what the trainer knows (its control
    #: address, its transport as the last upstream, its token): ``region``, ``id``,
    #: certificates, relays ahead of the hub in ``upstreams``.
    inference: dict[str, Any] = field(default_factory=dict)
    #: The dtype the workers' model holds: each state is exported to it (a copy, so the
    #: trainer's own parameters can change in place after).
    dtype: Any = None


class AuroraTrainerEngine(TrainerWeightTransferEngine[AuroraTrainerInitInfo]):
    init_info_cls = AuroraTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: Optional[WeightSource], trainer: Optional[aurora_rl.Trainer], is_sender: bool) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.trainer = trainer
        #: What the last ``send_weights`` published.
        self.published: Optional[aurora_rl.Published] = None
        self.dtype: Any = None

    @classmethod
    def trainer_init(
        cls,
        init_info: AuroraTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: Optional[WeightSource] = None,
    ) -> AuroraTrainerEngine:
        engine = cls(client=client, source=source, trainer=init_info.trainer, is_sender=init_info.is_sender)
        engine.dtype = init_info.dtype
        if not engine.is_sender:
            return engine
        trainer = init_info.trainer
        if trainer is None:
            raise aurora_rl.UsageError("the sender's AuroraTrainerInitInfo needs its trainer node (aurora_rl.Trainer)")
        if source is None:
            raise aurora_rl.UsageError("the aurora backend publishes what its WeightSource yields: give one")
        # A worker joins from a snapshot: the first version must exist before it does.
        engine.published = engine._publish()
        inference = dict(init_info.inference)
        relays = list(inference.pop("upstreams", []))
        client.init_weight_transfer_engine(
            {
                "control": trainer.control_address,
                "upstreams": relays + [trainer.transport_address],
                "token": trainer.token,
                **inference,
            }
        )
        return engine

    def send_weights(self) -> None:
        """Publishes the source's current state as the next version (a delta), commits
        it, and has every worker activate it: ``start_weight_update``, one
        ``update_weights`` naming the version, ``finish_weight_update`` with the weight
        version ``"<version>:<weights hash>"``."""
        if not self.is_sender:
            # Iterate in lockstep with the sender, for sources whose gather is collective.
            for _ in self.source or ():
                pass
            return
        published = self._publish()
        assert self.trainer is not None
        self.trainer.commit()
        self.client.start_weight_update()
        self.client.update_weights({"version": published.version, "weights_hash": published.weights_hash})
        self.client.finish_weight_update(weight_version=weight_version(published.version, published.weights_hash))
        self.published = published

    def _publish(self) -> aurora_rl.Published:
        import torch

        assert self.trainer is not None and self.source is not None
        dtype = self.dtype or torch.bfloat16
        state = {name: tensor.detach().to(dtype=dtype, copy=True) for name, tensor in self.source}
        published = self.trainer.publish(state)
        logger.info("published version %d (%d bytes)", published.version, published.artifact_bytes)
        return published


def register() -> None:
    """Registers both engines under ``aurora``, once per process."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, AuroraWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, AuroraTrainerEngine)


register()
