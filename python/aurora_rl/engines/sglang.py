"""SGLang as an aurora engine: its Python ``Engine`` (``sglang.Engine``), whose scheduler
and model run in processes of their own, and its HTTP server on this machine.

A version goes in as element writes: aurora's weight loader (``sglang_worker``), which
SGLang runs in its scheduler through its own extension point (a custom weight loader,
named as the ``load_format`` of ``update_weights_from_tensor``), writes each changed
element into the parameter memory the model computes from, packed or not, and reads it
back to check. The request travels to the scheduler through shared memory (SGLang's own
serializer); nothing leaves the machine. The adapter keeps one weight-update session open
for the engine's life and never closes it: SGLang's ``end_weight_update`` would process
every layer again (``sglang_worker``, "No closing of the session").

No request runs on two versions: the actor calls ``load_changes`` only at its safe point,
between ``generate`` calls; SGLang's server lets the requests in flight finish and holds
new ones while it updates. A version's label (``weight_version``) becomes SGLang's weight
version, which its outputs carry in ``meta_info["weight_version"]``.

SGLang's routes have no authentication and its tensor updates carry pickled payloads: the
adapter drives a server on loopback only, and the WAN stays aurora's.

``SglangEngine.start`` gives defaults for token-id prompts in BF16 on the CPU build; any
``sglang.Engine`` option overrides them. SGLang starts processes with ``spawn``: a script
that starts one must do so under ``if __name__ == "__main__":``. A server is started with
``--custom-weight-loader aurora_rl.engines.sglang_worker.serve`` (``LOAD_FORMAT``).
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import logging
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl.engines import Completion, EngineError, Sampling, TensorChange, fused_group_names, get_json, post_json
from aurora_rl.engines.sglang_worker import (
    ANSWER,
    ANSWER_BYTES,
    DATA,
    INDICES,
    LOAD_FORMAT,
    REQUEST,
    VALUES,
    data_layout,
    dtype_name,
    pack_data,
    read_answer,
)

if TYPE_CHECKING:
    import sglang
    import torch

logger = logging.getLogger("aurora_rl.sglang")


class _ElementWrites:
    """What both faces share: requests to aurora's weight loader in SGLang's scheduler.
    A face supplies how a tensor update reaches SGLang (``_update``) and how its session
    opens (``_begin``)."""

    def __init__(self) -> None:
        #: Per tensor name: whether SGLang's loader transforms it (no element map).
        self._unmapped: dict[str, bool] = {}
        self._session_open = False
        self._writes: Optional[torch.Tensor] = None
        #: The tensors the last ``load_changes`` loaded whole through SGLang's loader.
        self.loaded_whole: list[str] = []

    def _begin(self) -> None:
        raise NotImplementedError

    def _update(self, named: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        raise NotImplementedError

    def _shared(self, size: int) -> torch.Tensor:
        """``size`` bytes of shared memory, which SGLang's serializer passes by reference
        (a tensor not in it is copied there first)."""
        import torch

        return torch.empty(size, dtype=torch.uint8).share_memory_()

    def _write_buffer(self, size: int) -> torch.Tensor:
        """The shared memory write requests reuse (a fresh segment would be paged in on
        every version), grown as a version needs; read-backs take their own."""
        if self._writes is None or self._writes.numel() < size:
            self._writes = self._shared(size + size // 4)
        return self._writes[:size]

    def _ask(self, request: dict[str, Any], tensors: Mapping[str, torch.Tensor], *, changes_weights: bool) -> dict:
        """Runs one request of aurora's weight loader (a tensor update in SGLang's terms)
        with ``tensors`` (copied: the actor's views are of memory its transport owns) and
        returns its answer; its error raises ``EngineError``."""
        import torch

        if not self._session_open:
            self._begin()
            self._session_open = True
        layout, size = data_layout(tensors)
        data = self._write_buffer(size) if changes_weights else self._shared(size)
        pack_data(tensors, layout, data)
        answer = torch.zeros(ANSWER_BYTES, dtype=torch.uint8)
        header = torch.frombuffer(bytearray(json.dumps({**request, "tensors": layout}).encode()), dtype=torch.uint8)
        self._update([(REQUEST, header), (DATA, data), (ANSWER, answer)], changes_weights)
        reply = read_answer(answer)
        if not reply.get("ok"):
            raise EngineError(f"aurora's weight loader in SGLang: {reply.get('error')}")
        return reply

    def map_elements(self, specs: Mapping[str, tuple[list[int], torch.dtype]]) -> None:
        """See ``aurora_rl.engines.MappedEngine``: SGLang's worker probes them once."""
        self._map({name: (list(shape), dtype_name(dtype)) for name, (shape, dtype) in specs.items()})

    def _map(self, specs: Mapping[str, tuple[list[int], str]]) -> None:
        unseen = {name: spec for name, spec in specs.items() if name not in self._unmapped}
        if unseen:
            unmapped = set(self._ask({"op": "probe", "specs": unseen}, {}, changes_weights=False)["unmapped"])
            self._unmapped.update({name: name in unmapped for name in unseen})

    def load_changes(self, changes: Mapping[str, TensorChange]) -> None:
        """See ``aurora_rl.engines.ElementEngine``: changed elements are written in place;
        a tensor SGLang's loader transforms goes whole, with its fused group."""
        started = time.perf_counter()
        specs = {name: (list(c.shape), dtype_name(c.dtype)) for name, c in changes.items()}
        self._map(specs)
        whole = fused_group_names(
            {n for n, c in changes.items() if self._unmapped[n] and (c.indices is None or c.indices.numel())}
        ) | {n for n, c in changes.items() if c.indices is None}
        payload: dict[str, torch.Tensor] = {}
        for name, change in changes.items():
            if name in whole:
                payload[name] = change.tensor
            else:
                payload[name + INDICES] = change.indices
                payload[name + VALUES] = change.values()
        request = {"op": "write", "specs": specs, "whole": sorted(whole)}
        self.loaded_whole = self._ask(request, payload, changes_weights=True)["whole"]
        logger.debug("SGLang took %d tensors' changes in %.3f s", len(changes), time.perf_counter() - started)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """``tensors`` whole (each fused group complete), through the same loader."""
        self.load_changes({name: TensorChange(t, None) for name, t in tensors.items()})

    def mismatched(self, expected: Mapping[str, torch.Tensor]) -> list[str]:
        """See ``aurora_rl.engines.CheckedEngine``: SGLang's scheduler reads each parameter
        as its kernels compute from it and compares (``sglang_worker.ModelWriter``)."""
        return self._ask({"op": "check"}, expected, changes_weights=False)["mismatched"]

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        """None: SGLang's model runs in another process, in its kernels' layout
        (``mismatched`` reads it back there)."""
        return None


class SglangEngine(_ElementWrites):
    """An aurora engine over an ``sglang.Engine`` started with aurora's weight loader
    (``SglangEngine.start`` adds it)."""

    def __init__(self, engine: sglang.Engine) -> None:
        super().__init__()
        if LOAD_FORMAT not in (getattr(engine.server_args, "custom_weight_loader", None) or []):
            raise ValueError(
                f"this sglang.Engine was started without aurora's weight loader: pass "
                f"custom_weight_loader=[{LOAD_FORMAT!r}] (SglangEngine.start does)"
            )
        self.engine = engine

    @classmethod
    def start(cls, model: str, **options: Any) -> SglangEngine:
        """An ``sglang.Engine`` on the Hugging Face checkpoint directory ``model``."""
        import sglang

        settings: dict[str, Any] = {
            "dtype": "bfloat16",
            "skip_tokenizer_init": True,
            "random_seed": 0,
            # Weight updates run between generate calls; the overlap scheduler would keep
            # a batch in flight across them.
            "disable_overlap_schedule": True,
            "log_level": "warning",
        }
        settings.update(options)
        settings["custom_weight_loader"] = [*(settings.get("custom_weight_loader") or []), LOAD_FORMAT]
        return cls(sglang.Engine(model_path=model, **settings))

    def _begin(self) -> None:
        _succeeded("begin_weight_update", self.engine.begin_weight_update())

    def _update(self, named: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        _succeeded(
            "update_weights_from_tensor",
            self.engine.update_weights_from_tensor(named, load_format=LOAD_FORMAT, flush_cache=flush_cache),
        )

    def set_weight_version(self, weight_version: str) -> None:
        """SGLang's weight version, which its outputs report from now on."""
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        request = UpdateWeightVersionReqInput(new_version=weight_version, abort_all_requests=False)
        self.engine.loop.run_until_complete(self.engine.tokenizer_manager.update_weight_version(request))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        outputs = self.engine.generate(
            input_ids=[list(prompt) for prompt in prompts], sampling_params=_sampling_params(sampling), return_logprob=True
        )
        return _completions(outputs)

    def shutdown(self) -> None:
        self.engine.shutdown()


class SglangServerEngine(_ElementWrites):
    """An aurora engine over SGLang's HTTP server on this machine (``python -m
    sglang.launch_server ... --skip-tokenizer-init --custom-weight-loader
    aurora_rl.engines.sglang_worker.serve``: prompts are token ids)."""

    def __init__(self, base_url: str, *, timeout: float = 600.0) -> None:
        super().__init__()
        host = urllib.parse.urlsplit(base_url).hostname or ""
        if not _is_loopback(host):
            raise ValueError(
                f"{base_url}: SGLang's weight routes have no authentication; aurora drives a server on "
                "loopback only (the actor runs beside it)"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _post(self, path: str, body: dict) -> Any:
        return post_json(self.base_url + path, body, self.timeout)

    def _begin(self) -> None:
        # A load format the server does not know fails in its scheduler, which then stops.
        loaders = get_json(self.base_url + "/get_server_info", self.timeout).get("custom_weight_loader") or []
        if LOAD_FORMAT not in loaders:
            raise EngineError(
                f"the SGLang server at {self.base_url} runs without aurora's weight loader: start it with "
                f"--custom-weight-loader {LOAD_FORMAT}"
            )
        answer = self._post("/begin_weight_update", {})
        if not answer.get("success"):
            raise EngineError(f"SGLang's begin_weight_update failed: {answer.get('message')}")

    def _shared(self, size: int) -> torch.Tensor:
        with _shared_by_file_name():
            return super()._shared(size)

    def _update(self, named: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        answer = self._post(
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [_serialized(named)], "load_format": LOAD_FORMAT, "flush_cache": flush_cache},
        )
        if not answer.get("success"):
            raise EngineError(f"SGLang's update_weights_from_tensor failed: {answer.get('message')}")

    def set_weight_version(self, weight_version: str) -> None:
        """SGLang's weight version, which its outputs report from now on."""
        self._post("/update_weight_version", {"new_version": weight_version, "abort_all_requests": False})

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        return _completions(
            self._post(
                "/generate",
                {"input_ids": [list(p) for p in prompts], "sampling_params": _sampling_params(sampling), "return_logprob": True},
            )
        )


@contextlib.contextmanager
def _shared_by_file_name() -> Iterator[None]:
    """Tensors shared meanwhile go by the name of a shared-memory file (torch's
    ``file_system`` strategy): its default, descriptors passed over a socket, needs a
    process started by this one, and a server is not."""
    import torch.multiprocessing as multiprocessing

    before = multiprocessing.get_sharing_strategy()
    multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        multiprocessing.set_sharing_strategy(before)


def _serialized(named: list[tuple[str, torch.Tensor]]) -> str:
    """``named`` as SGLang's server deserializes a tensor update: pickled by torch's
    multiprocessing reductions, base64."""
    import io
    from multiprocessing.reduction import ForkingPickler

    # Importing it registers torch's reductions with ForkingPickler.
    import torch.multiprocessing  # noqa: F401

    buffer = io.BytesIO()
    with _shared_by_file_name():
        ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode()


def _succeeded(call: str, outcome: Any) -> None:
    """SGLang's Python engine answers its update calls with ``(success, message)``."""
    success, message = outcome if isinstance(outcome, tuple) else (True, None)
    if not success:
        raise EngineError(f"SGLang's {call} failed: {message}")


def _sampling_params(sampling: Sampling) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def _completions(outputs: list[dict]) -> list[Completion]:
    """SGLang's outputs, one per prompt: each generated token's (log-probability, token
    id, text) is in ``output_token_logprobs``."""
    return [
        Completion(list(o["output_ids"]), [step[0] for step in o["meta_info"]["output_token_logprobs"]])
        for o in outputs
    ]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
