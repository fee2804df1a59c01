"""The trainer side: the node that `aurora run`'s trainer process runs (control plane,
transport hub, checkpoint store), in the user's PyTorch process.

The user trains; the ``Trainer`` publishes each new BF16 export (extracted against the
previous version in Rust, streamed cut-through to relays and actors, stored), commits it,
posts each step's prompts and hands back the accepted rollouts: those that came back
within their lease, generated on the step's version with its weights hash, once each.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

from aurora_rl import _core
from aurora_rl._node import ClosingNode
from aurora_rl._tensors import HostTensor, Tensor, host_tensors, shares_memory, write_counts

#: A trainer a caller brings back with :meth:`Trainer.recover`.
T = TypeVar("T")

logger = logging.getLogger("aurora_rl.trainer")


@dataclass(frozen=True)
class Published:
    version: int
    weights_hash: str
    #: Bytes streamed out: the delta (the snapshot for the first version).
    artifact_bytes: int


@dataclass(frozen=True)
class Rollout:
    prompt: int
    #: The actor that generated it.
    actor: int
    #: What the actor submitted, parsed from JSON.
    payload: Any


@dataclass(frozen=True)
class StepResults:
    step: int
    #: The version every accepted rollout was generated on.
    version: int
    rollouts: list[Rollout]
    #: Prompts without an accepted rollout (a partial batch), to post again or drop.
    unfinished: list[int]


@dataclass(frozen=True)
class ActorStatus:
    """One registered actor, as the control plane sees it."""

    actor: int
    region: str
    #: The version it runs, and the one it holds staged.
    active: int
    staged: Optional[int]
    #: Its throughput estimate, in thousandths of a token per second.
    estimate_milli_tokens_per_s: int
    #: In a preemption window: it gets no new work.
    leaving: bool


@dataclass(frozen=True)
class StepStatus:
    """The current or last step's counts."""

    step: int
    version: int
    batch_size: int
    accepted: int
    #: Prompts under a live lease.
    leased: int
    #: Prompts in the pool, reserved or not; of those, reserved for an actor.
    pooled: int
    reserved: int
    complete: bool


@dataclass(frozen=True)
class Status:
    """The control plane's monitoring view (``GET /v1/status``, docs/control-api.md)."""

    #: The latest published version and its weights hash, None before the first.
    latest: Optional[tuple[int, str]]
    #: The lifetime a lease issued now would get, in milliseconds.
    lease_ms: int
    actors: list[ActorStatus]
    step: Optional[StepStatus]
    #: Results accepted and leases expired since the state was created, and results
    #: rejected, by reason.
    accepted: int
    expired: int
    rejected: dict[str, int]


@dataclass(frozen=True)
class _Base:
    """The latest published version's tensors, the base of the next delta, kept as the
    caller gave them (no copy)."""

    tensors: list[HostTensor]
    #: The version and weights hash they were published or checked as.
    version: tuple[int, str]
    #: torch's write counts when they were hashed (``write_counts``).
    writes: Optional[tuple[int, ...]]

    def untouched(self, latest: Optional[tuple[int, str]], target: list[HostTensor]) -> bool:
        """Whether these tensors are still the node's latest version without hashing them
        again (``publish_over_latest``): the node's latest is the version they were,
        torch counted no write to them since, and the target does not alias them (the
        same parameters, written between two publishes whatever the counts say)."""
        return (
            self.writes is not None
            and latest == self.version
            and write_counts(self.tensors) == self.writes
            and not shares_memory(self.tensors, target)
        )


class Trainer(ClosingNode):
    """A trainer node in this process.

    ``close()``, or the end of a ``with`` block, stops the control plane and the
    transport hub; the directory keeps everything published and stored.

    ``directory`` holds the checkpoint store and the control plane's database; reopening
    it carries on from both. Actors and relays join with the addresses and the token.
    The control plane is served over mutual TLS with the trainer's certificate (``ca``,
    ``cert``, ``key``: files from ``aurora certs``), or, with ``insecure_plaintext=True``,
    over plain HTTP with the token, which anyone on the path can read (loopback only).
    ``control`` overrides the control plane's settings for a new database, nested as in
    ``aurora_control::Config`` (for example ``{"heartbeat_timeout_ms": 4000, "lease":
    {"initial_ms": 20000}}``); unknown names are refused. ``signing_key`` is the trainer's
    ed25519 key (PKCS#8 PEM, mode 0600, as ``aurora certs init`` and ``aurora run``
    write ``signing.key``): every version and commit is then signed, and actors given
    the public key (``Actor(trainer_key=...)``) take nothing else (docs/security.md). With certificates
    the signing key is required, unless ``insecure_unsigned=True`` says by name that
    versions travel unsigned. In plaintext the node listens on loopback only, unless
    ``insecure_closed_network=True`` says the network between the nodes is closed.
    """

    def __init__(
        self,
        directory: Union[str, Path],
        *,
        token: Optional[str] = None,
        control_listen: str = "127.0.0.1:0",
        transport_listen: str = "127.0.0.1:0",
        streams: int = 4,
        snapshot_every: int = 10,
        encoding: str = "aurora",
        control: Optional[Mapping[str, Any]] = None,
        signing_key: Optional[Union[str, Path]] = None,
        ca: Optional[Union[str, Path]] = None,
        cert: Optional[Union[str, Path]] = None,
        key: Optional[Union[str, Path]] = None,
        insecure_plaintext: bool = False,
        insecure_closed_network: bool = False,
        insecure_unsigned: bool = False,
    ) -> None:
        self.token = token if token is not None else secrets.token_hex(32)
        #: The chunk encoding of every delta this node publishes.
        self.encoding = encoding
        self._node = _core.TrainerNodeCore(
            directory=Path(directory),
            token=self.token,
            control_listen=control_listen,
            transport_listen=transport_listen,
            streams=streams,
            snapshot_every=snapshot_every,
            encoding=encoding,
            control=json.dumps(dict(control or {})),
            signing_key=None if signing_key is None else Path(signing_key),
            ca=ca,
            cert=cert,
            key=key,
            insecure_plaintext=insecure_plaintext,
            insecure_closed_network=insecure_closed_network,
            insecure_unsigned=insecure_unsigned,
        )
        # The base of the next delta, None where this process does not hold it.
        self._base: Optional[_Base] = None
        logger.info("trainer node: control %s, transport %s", self.control_address, self.transport_address)

    @property
    def control_address(self) -> str:
        return self._node.control_address

    @property
    def run_id(self) -> str:
        """The run's id (32 hex digits), fixed when the node's store was made: every
        version and commit it signs names it, and actors pin it (docs/security.md §5)."""
        return self._node.run_id

    @property
    def transport_address(self) -> str:
        return self._node.transport_address

    def publish(self, state: Mapping[str, Tensor]) -> Published:
        """Publishes ``state`` (BF16 under Hugging Face names, above all) as the next
        version: the first as a snapshot, which joining nodes take, then each as a delta
        from the one before. Keep the tensors unchanged until the next publish: they are
        its base (an export, such as ``{k: v.to(torch.bfloat16) ...}``, is a new tensor
        each step; parameters trained in place are not, and the next publish says so).
        A base is not hashed again where it is surely still the latest version: the node
        still has it as its latest, torch counted no write to it, and the new state does
        not alias it. One written behind torch's back (``.data``, a NumPy view) in memory
        the new state does not share makes a version every actor refuses by its target
        hash."""
        tensors = host_tensors(state)
        writes = write_counts(tensors)
        latest = self._node.latest()
        if self._base is None and latest is None:
            result = self._node.publish_first(0, tensors)
        elif self._base is None:
            raise _core.UsageError(
                "this store already holds published versions: call resume() with the latest "
                "version's weights first"
            )
        else:
            result = self._node.publish(self._base.tensors, tensors, self._base.untouched(latest, tensors))
        published = Published(*result)
        self._base = _Base(tensors, (published.version, published.weights_hash), writes)
        logger.info("published version %d (%d bytes)", published.version, published.artifact_bytes)
        return published

    def publish_shards(self, tensors: list[tuple[str, str, list[int]]], parts: list[bytes]) -> Published:
        """Publishes the next version from the parts of a sharded trainer's ranks, each
        encoded where its shards are (``aurora_rl.ShardedPublisher`` makes and gathers
        them; ``tensors`` is the checkpoint's table, ``(name, dtype, shape)`` each): no
        process holds the model whole. Refused unless the parts cover every tensor once
        and their base is the latest version as published."""
        published = Published(*self._node.publish_shards(tensors, list(parts)))
        # The base of the next version is held by the ranks now, not here.
        self._base = None
        logger.info("published version %d from %d shards (%d bytes)", published.version, len(parts), published.artifact_bytes)
        return published

    def check_shards(self, tensors: list[tuple[str, str, list[int]]], parts: list[bytes]) -> int:
        """Checks that the ranks' parts (each extracted with its shards as both base and
        target) hold the latest published version, by the weights hash they compose: a
        sharded trainer's :meth:`resume`. Returns that version."""
        version, expected = self._latest_or_refuse()
        actual = _core.shards_weights_hash(tensors, list(parts), self.encoding)
        if actual != expected:
            raise _core.WrongBaseError(f"the shards hash to {actual}, not to version {version}'s {expected}")
        self._base = None
        return version

    def _latest_or_refuse(self) -> tuple[int, str]:
        latest = self._node.latest()
        if latest is None:
            raise _core.UsageError("nothing is published in this directory: publish the first version")
        return latest

    def resume(self, state: Mapping[str, Tensor]) -> int:
        """Carries on from a reopened directory: ``state`` must be the latest published
        version's weights (checked by their hash), the base of the next publish. Returns
        that version."""
        version, expected = self._latest_or_refuse()
        tensors = host_tensors(state)
        writes = write_counts(tensors)
        actual = _core.weights_hash(tensors)
        if actual != expected:
            raise _core.WrongBaseError(f"these weights hash to {actual}, not to version {version}'s {expected}")
        self._base = _Base(tensors, (version, expected), writes)
        return version

    def recover(
        self,
        restore: Callable[[int, bytes], T],
        retrain: Callable[[T, int, bytes], None],
        export: Callable[[T], Mapping[str, Tensor]],
    ) -> T:
        """Brings a restarted trainer back to the latest published version (what
        :meth:`resume` checks, done whole): ``restore(version, state)`` rebuilds it from
        the newest state kept with :meth:`save_state` at or below that version, then
        ``retrain(trainer, version, rollouts)`` trains each later version once more on
        the rollouts kept with :meth:`save_rollouts`. Training must be deterministic:
        every version's ``export(trainer)`` must hash to the weights it was published
        with, else ``WrongBaseError`` names the first that differs. The latest export is
        the base of the next :meth:`publish`. Returns the trainer; an exception a
        callable raises is the cause of the ``NodeError`` raised."""
        latest: list[Any] = []
        writes: list[Optional[tuple[int, ...]]] = [None]

        def hashed(trainer: T, version: int) -> list[Any]:
            latest[:] = host_tensors(export(trainer))
            writes[0] = write_counts(latest)
            return latest

        trainer, version, restored_from = self._node.recover(restore, retrain, hashed)
        self._base = _Base(list(latest), self._latest_or_refuse(), writes[0])
        logger.info(
            "recovered version %d from version %d's state (%d trained again)", version, restored_from, version - restored_from
        )
        return trainer

    def save_state(self, version: int, data: bytes) -> None:
        """Keeps the trainer's own state once it produced ``version`` (master weights,
        optimizer moments, data-loader and RNG positions: serialise it as you like, for
        example ``torch.save`` of the state dicts into an ``io.BytesIO``) in the store,
        hashed and written crash-safely. Save one every few versions; a restarted trainer
        comes back from the newest with :meth:`recover`."""
        self._node.save_trainer_data("state", version, bytes(data))

    def load_state(self) -> Optional[tuple[int, bytes]]:
        """The newest state kept with :meth:`save_state` and its version, or ``None``
        (:meth:`recover` takes the newest at or below the latest version itself)."""
        versions = self._node.trainer_data_versions("state")
        if not versions:
            return None
        return versions[-1], self._node.trainer_data("state", versions[-1])

    def save_rollouts(self, version: int, data: bytes) -> None:
        """Keeps what ``version`` is trained on (the step's rollouts, serialised as you
        like) in the store before the next step opens, which drops them from the control
        plane: after a crash, :meth:`rollouts` gives them back for training again."""
        self._node.save_trainer_data("rollouts", version, bytes(data))

    def rollouts(self, version: int) -> bytes:
        """What :meth:`save_rollouts` kept for ``version``, verified against its hash."""
        return self._node.trainer_data("rollouts", version)

    def commit(self) -> int:
        """Commits the latest version: actors activate it at their next safe point, and
        steps opened from now on generate on it. Returns its number."""
        version, _ = self._node.commit()
        return version

    def open_step(self, prompts: list[int]) -> int:
        """Posts a step's prompts (ids the actors map to inputs) on the latest published
        version: actors that run it, or hold it staged, are given leases. Commit it next."""
        return self._node.open_step(list(prompts))

    def status(self) -> Status:
        """The control plane's monitoring view, as ``GET /v1/status`` gives it
        (docs/control-api.md): the latest version, every registered actor, the step's
        progress and the result counts."""
        status = json.loads(self._node.status())
        latest = status["latest"]
        return Status(
            latest=None if latest is None else (latest["version"], latest["weights_hash"]),
            lease_ms=status["lease_ms"],
            actors=[ActorStatus(**actor) for actor in status["actors"]],
            step=None if status["step"] is None else StepStatus(**status["step"]),
            accepted=status["accepted"],
            expired=status["expired"],
            rejected=status["rejected"],
        )

    def wait_step(self, timeout: float = 3600.0) -> StepResults:
        """The open step's accepted rollouts, once every prompt has one."""
        return _step_results(self._node.wait_step(timeout))

    def taken_step(self, step: int) -> Optional[StepResults]:
        """``step``'s results if :meth:`wait_step` handed them over before and the next
        step has not opened: a trainer that stopped before keeping them
        (:meth:`save_rollouts`) reads them again after its restart."""
        results = self._node.taken_step(step)
        return None if results is None else _step_results(results)


def _step_results(text: str) -> StepResults:
    results = json.loads(text)
    return StepResults(
        step=results["step"],
        version=results["version"],
        rollouts=[Rollout(r["prompt"], r["actor"], r["payload"]) for r in results["rollouts"]],
        unfinished=results["unfinished"],
    )
