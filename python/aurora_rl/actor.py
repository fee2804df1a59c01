"""The actor side: the node that `aurora run`'s actor processes run (a transport actor
that stages deltas behind generation, and the actor's side of the control plane), in an
inference process, driving an engine adapter (``aurora_rl.engines``).

The inference loop calls ``claim`` between batches: that is the engine's safe point, where
a committed version is activated into the engine (only the tensors that changed, fused
groups whole; an element engine gets their changed elements before the node's copy
does), so no request ever runs on a mix of two versions. It then generates for the
leases and ``submit``s the results, stamped with the version and weights hash they were
generated on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from aurora_rl import _core
from aurora_rl._node import ClosingNode
from aurora_rl._tensors import Tensor, host_tensors, torch_dtype, torch_view
from aurora_rl.engines import (
    Engine,
    TensorChange,
    checks_weights,
    fused_group_names,
    labels_versions,
    maps_elements,
    takes_changes_first,
    weight_version,
    writes_elements,
)

logger = logging.getLogger("aurora_rl.actor")

#: Longest wait for a committed version the control plane says to activate.
ACTIVATION_WAIT_S = 120.0

#: What an actor reads back from its engine after loading a version (``Actor``'s
#: ``verify``): every tensor, ``verify_tensors`` of them chosen at random, or nothing.
VERIFY_MODES = ("full", "sample", "off")


@dataclass(frozen=True)
class LeaseId:
    """Which lease: the step, the job (the prompt's place in the step's batch) and how
    many leases on that job came before (docs/control-api.md)."""

    step: int
    job: int
    attempt: int


@dataclass(frozen=True)
class Lease:
    """One prompt to generate for, until the lease expires."""

    #: The lease's id, handed back with the result.
    id: LeaseId
    prompt: int
    expires_in_ms: int


@dataclass(frozen=True)
class Work:
    """Leases to generate for on the active version."""

    version: int
    weights_hash: str
    leases: list[Lease]


class Actor(ClosingNode):
    """An actor node in this process, feeding ``engine``.

    Without ``weights``, joins over the wire: the newest snapshot comes from an upstream
    (the region's relay or the hub) and is loaded into the engine whole, so the engine may
    start with any weights (vLLM: ``load_format="dummy"``). With ``weights`` (the tensors
    the engine was started from, and their ``version``) it starts from them and takes
    only the deltas after. Then it registers with the control plane, over mutual TLS with
    the actor's certificate (``ca``, ``cert``, ``key``: its id must be ``id``), or, with
    ``insecure_plaintext=True``, over plain HTTP with the fleet ``token`` (loopback only;
    over TLS no token is needed).
    With ``trainer_key`` (the trainer's public key, PEM) it takes only versions and commits
    the trainer signed; with certificates it is required, unless ``insecure_unsigned=True``
    says by name to take unsigned versions. In plaintext the node dials loopback only,
    unless ``insecure_closed_network=True`` says the network between the nodes is closed.

    After each version is loaded, the engine's weights are read back and compared with
    the version: the node's copy, whose weights hash was checked, or, where the changes
    came first, the version before with the changes laid over it (an engine that can: see
    ``aurora_rl.engines.CheckedEngine``): ``verify="sample"`` checks ``verify_tensors``
    tensors chosen at random each time (cheap), ``"full"`` every tensor (as costly as
    reading the model once), ``"off"`` none. A mismatch fails the load: the actor leaves
    the fleet.

    ``close()``, or the end of a ``with`` block, leaves the fleet unless the actor left,
    then stops the node's threads (the engine is the caller's to stop).

    Upstreams come in order of preference. A session on any but the first goes back to
    the first after about ``return_after`` seconds, between versions (``None``: never). A
    relay that brings too little of a version the control plane has committed (nothing
    new but less than 8 MiB of segments) for ``behind_timeout`` seconds is given up for
    the next upstream (docs/wire-protocol.md §6.4).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        id: int,
        region: str,
        control: str,
        upstreams: Sequence[str],
        token: Optional[str] = None,
        streams: int = 4,
        join_timeout: float = 300.0,
        weights: Optional[Mapping[str, Tensor]] = None,
        version: Optional[int] = None,
        trainer_key: Optional[Union[str, Path]] = None,
        ca: Optional[Union[str, Path]] = None,
        cert: Optional[Union[str, Path]] = None,
        key: Optional[Union[str, Path]] = None,
        insecure_plaintext: bool = False,
        insecure_closed_network: bool = False,
        insecure_unsigned: bool = False,
        return_after: Optional[float] = _core.RETURN_AFTER_S,
        behind_timeout: float = _core.BEHIND_TIMEOUT_S,
        verify: str = "sample",
        verify_tensors: int = 4,
    ) -> None:
        if (weights is None) != (version is None):
            raise _core.UsageError("give the local weights and their version together, or neither to join")
        if verify not in VERIFY_MODES:
            raise _core.UsageError(f"verify is one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        if verify_tensors < 1:
            raise _core.UsageError(f"verify_tensors is at least 1, not {verify_tensors}")
        self._verify, self._verify_tensors = verify, verify_tensors
        self._sampler = random.Random()
        self._verify_unavailable_logged = False
        self.engine = engine
        self.id = id
        local = None if weights is None else (version, host_tensors(weights))
        self._node = _core.ActorNodeCore(
            id=id,
            region=region,
            control=control,
            upstreams=list(upstreams),
            token=token or "",
            streams=streams,
            join_timeout_s=join_timeout,
            weights=local,
            trainer_key=None if trainer_key is None else Path(trainer_key),
            ca=ca,
            cert=cert,
            key=key,
            insecure_plaintext=insecure_plaintext,
            insecure_closed_network=insecure_closed_network,
            insecure_unsigned=insecure_unsigned,
            return_after_s=return_after,
            behind_timeout_s=behind_timeout,
            changed_elements=writes_elements(engine),
            changes_first=takes_changes_first(engine),
        )
        # What the last safe point loaded: the transport reports a version active a moment
        # after handing it over, so its status may lag what the engine runs.
        self._loaded: Optional[tuple[int, str]] = None
        # A version the engine failed to load: its weights are then neither that version
        # nor the one before, and the transport hands no activation over twice.
        self._load_failed: Optional[tuple[int, BaseException]] = None
        # Whether the engine was told every tensor to map (``MappedEngine``).
        self._mapped = not maps_elements(engine)
        if weights is None and self.safe_point() is None:
            self.close()
            raise _core.NodeError("joined, but the snapshot never reached the engine")

    @property
    def active(self) -> tuple[int, str]:
        """The version the engine runs and its weights hash."""
        if self._loaded is not None:
            return self._loaded
        active = self._node.active()
        assert active is not None, "an actor runs a version once it has joined"
        return active

    def why_behind(self) -> Optional[str]:
        """Why the engine may not run the version asked of it, for an error that waited
        for one: the last activation, if it failed, and why the last upstream session
        ended, while none is up; None if neither."""
        activation, upstream = self._node.last_failures()
        reasons = [f"{what}: {why}" for what, why in (("last failed activation", activation), ("last upstream failure", upstream)) if why]
        return "; ".join(reasons) or None

    def safe_point(self, wait: float = 0.0) -> Optional[int]:
        """Loads into the engine a version activated since the last call, or one whose
        activation starts within ``wait`` seconds; returns its number, or None. Call it
        only between batches."""
        self._refuse_after_failed_load()
        activation = self._node.at_safe_point(wait)
        if activation is None:
            return None
        try:
            version, changed = activation.version, activation.changed
            weights_hash = activation.weights_hash
            started = time.perf_counter()
            if changed:
                views = activation.tensor_bytes(sorted(fused_group_names(changed)))
                tensors = {name: torch_view(dtype, shape, data) for name, dtype, shape, data in views}
                del views
                changes: Optional[dict[str, TensorChange]] = None
                try:
                    if not self._mapped:
                        specs = {name: (shape, torch_dtype(dtype)) for name, dtype, shape in activation.tensor_specs()}
                        self.engine.map_elements(specs)  # type: ignore[attr-defined]
                        self._mapped = True
                    changes = self._load(activation, tensors)
                    self._check(activation, changes)
                    if labels_versions(self.engine):
                        self.engine.set_weight_version(weight_version(version, weights_hash))  # type: ignore[attr-defined]
                except BaseException as error:
                    self._load_failed = (version, error)
                    # The traceback keeps this frame: its views must not hold the weights
                    # the transport writes in place.
                    del tensors, changes
                    self._leave_after_failed_load(version, error)
                    raise
                del tensors, changes
            logger.info(
                "version %d in the engine: %d tensors changed, loaded in %.3f s",
                version,
                len(changed),
                time.perf_counter() - started,
            )
            self._loaded = (version, weights_hash)
            return version
        finally:
            activation.release()

    def _load(self, activation: Any, tensors: dict[str, Any]) -> Optional[dict[str, TensorChange]]:
        """Hands the engine ``tensors`` (the changed ones and their fused groups): their
        changed elements if it writes them, else the tensors whole. Returns the changes
        handed over, if the engine took changes: where they came first, ``tensors`` are
        the version before and the changes are laid over them."""
        if not writes_elements(self.engine):
            self.engine.load_weights(tensors)
            return None
        import torch

        changed = dict(activation.changed_elements())
        first = activation.changes_first
        changes = {}
        for name, tensor in tensors.items():
            if name not in changed:  # a fused group's unchanged part
                changes[name] = TensorChange(tensor, torch.empty(0, dtype=torch.int64))
            elif changed[name] is None:
                # The node lays changes first only as elements (the transport's rule).
                assert not first, f"{name} came whole before the node's copy had it"
                changes[name] = TensorChange(tensor, None)
            else:
                indices, values = changed[name]
                changes[name] = TensorChange(
                    tensor,
                    torch_view("I64", [-1], indices),
                    torch.from_dlpack(values).view(tensor.dtype),
                    laid_over=first,
                )
        self.engine.load_changes(changes)  # type: ignore[attr-defined]
        return changes

    def _check(self, activation: Any, changes: Optional[dict[str, TensorChange]]) -> None:
        """Reads back from the engine what it computes with, for every tensor or a random
        few (``verify``), and compares it with the activated version, whose weights hash
        the node checked: a mismatch fails the load. Where the changes came first, a
        changed tensor is compared with its changes laid over the version before."""
        if self._verify == "off":
            return
        if not checks_weights(self.engine):
            self._unchecked()
            return
        names = [name for name, _, _ in activation.tensor_specs()]
        if self._verify == "sample":
            names = self._sampler.sample(names, min(self._verify_tensors, len(names)))
        views = activation.tensor_bytes(sorted(names))
        expected = {name: torch_view(dtype, shape, data) for name, dtype, shape, data in views}
        del views
        if activation.changes_first:
            expected = {name: changes[name].tensor if changes and name in changes else t for name, t in expected.items()}
        try:
            mismatched = self.engine.mismatched(expected)  # type: ignore[attr-defined]
        finally:
            # A traceback keeps this frame: its views must not hold the weights.
            del expected
        if mismatched is None:
            self._unchecked()
            return
        if mismatched:
            shown = ", ".join(sorted(mismatched)[:4]) + (" and others" if len(mismatched) > 4 else "")
            raise _core.TargetMismatchError(
                f"the engine does not compute with version {activation.version}'s {shown} "
                f"({len(mismatched)} of {len(names)} tensors read back differ)"
            )
        logger.debug("version %d: %d tensors read back from the engine, all equal", activation.version, len(names))

    def _unchecked(self) -> None:
        """Says once that ``verify`` cannot be honoured with this engine."""
        if not self._verify_unavailable_logged:
            logger.warning(
                "verify=%r, but %s cannot read its weights back here: versions are not checked in it",
                self._verify,
                type(self.engine).__name__,
            )
            self._verify_unavailable_logged = True

    def _leave_after_failed_load(self, version: int, error: BaseException) -> None:
        """The engine's weights are not the version the node holds: the actor leaves the
        fleet, so the control plane hands its leases back at once and counts it out."""
        logger.error("the engine failed to load version %d (%r): leaving the fleet", version, error)
        try:
            self._node.leave()
        except _core.AuroraError as leaving:
            logger.warning("leaving the fleet after the failed load: %s", leaving)

    def _refuse_after_failed_load(self) -> None:
        if self._load_failed is not None:
            version, error = self._load_failed
            raise _core.NodeError(
                f"the engine failed to load version {version} ({error!r}): its weights are "
                "not the node's, so this actor left the fleet; start it again to join afresh"
            ) from error

    def claim(self) -> Optional[Work]:
        """Work on the open step, after activating what the control plane committed; None
        when there is none now (claim again later)."""
        self.safe_point()
        answer = json.loads(self._node.claim())
        if answer["kind"] != "work" or not answer["leases"]:
            return None
        commit = answer["commit"]
        deadline = time.monotonic() + ACTIVATION_WAIT_S
        while commit is not None and self.active[0] < commit:
            if self.safe_point(wait=max(0.0, deadline - time.monotonic())) is None:
                raise _core.NodeTimeoutError(f"version {commit} was not activated within {ACTIVATION_WAIT_S} s")
        version, weights_hash = self.active
        leases = [
            Lease(LeaseId(**lease["lease"]), lease["prompt"], lease["expires_in_ms"])
            for lease in answer["leases"]
            if lease["version"] == version
        ]
        if len(leases) < len(answer["leases"]):
            logger.warning("%d leases for another version: letting them expire", len(answer["leases"]) - len(leases))
        return Work(version, weights_hash, leases) if leases else None

    def submit(self, work: Work, results: Sequence[tuple[Lease, Any, int]]) -> list[dict]:
        """Hands in ``(lease, payload, tokens)`` for leases of ``work``; the payload is any
        JSON value. Returns the control plane's outcome for each, in order."""
        body = [
            {
                "lease": dataclasses.asdict(lease.id),
                "version": work.version,
                "weights_hash": work.weights_hash,
                "tokens": tokens,
                "payload": payload,
            }
            for lease, payload, tokens in results
        ]
        return json.loads(self._node.submit(json.dumps(body)))

    def leave(self) -> None:
        """Leaves the fleet: held leases return to the pool at once. The node is closed
        afterwards."""
        self._node.leave()

