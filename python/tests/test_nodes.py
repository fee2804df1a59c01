"""The trainer and actor nodes end to end, in Python: a Trainer publishes versions of a
small Qwen3 model from torch tensors, an Actor joins over the wire into a transformers
engine, and every step's rollouts come back generated on the step's version, while the
engine's weights hash to each version the trainer published."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from conftest import run
from test_engines import next_version, next_work, small_qwen3, sparse_step

import aurora_rl
from aurora_rl._tensors import host_tensors
from aurora_rl.engines import Sampling
from aurora_rl.engines.hf import TransformersEngine

STEPS = 3
PROMPTS_PER_STEP = 6


def prompt_tokens(prompt: int) -> list[int]:
    return [1 + prompt % 500, 7, 100 + prompt % 50]


class ActorLoop(threading.Thread):
    """An inference loop: claim, generate, submit, until told to stop."""

    def __init__(self, actor: aurora_rl.Actor) -> None:
        super().__init__(daemon=True)
        self.actor = actor
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.served: dict[int, str] = {}

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                work = self.actor.claim()
                if work is None:
                    self.stop.wait(0.02)
                    continue
                # The engine holds exactly the version the work is for.
                self.served[work.version] = aurora_rl.weights_hash(self.actor.engine.held_weights())
                completions = self.actor.engine.generate(
                    [prompt_tokens(lease.prompt) for lease in work.leases], Sampling(max_tokens=4, temperature=0.0)
                )
                results = [
                    (lease, {"tokens": c.token_ids, "logprobs": c.logprobs}, len(c.token_ids))
                    for lease, c in zip(work.leases, completions)
                ]
                outcomes = self.actor.submit(work, results)
                assert all(outcome["status"] == "accepted" for outcome in outcomes), outcomes
        except BaseException as error:  # reported by the test
            self.error = error

    def results(self, trainer: aurora_rl.Trainer, timeout: float = 300) -> aurora_rl.StepResults:
        """The open step's results, or this loop's error as soon as it has one (a step
        whose only actor died would otherwise wait out the whole timeout)."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            assert self.error is None, self.error
            try:
                return trainer.wait_step(timeout=min(1.0, max(deadline - time.monotonic(), 0.0)))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_qwen3(tmp_path_factory.mktemp("qwen3"))


def fleet(aurora_bin: Path, dir: Path, nodes: list[tuple[str, str, str]]) -> dict[str, dict]:
    """A fleet CA and the trainer's signing key in `dir` (`aurora certs init`), and a
    certificate for each (role, id, region): each node's TLS keyword arguments."""
    run(aurora_bin, "certs", "init", "--dir", dir)
    arguments = {}
    for role, id, region in nodes:
        run(aurora_bin, "certs", "issue", "--dir", dir, "--role", role, "--id", id, "--region", region)
        arguments[id] = {"ca": dir / "ca.pem", "cert": dir / "nodes" / f"{role}-{id}.pem", "key": dir / "nodes" / f"{role}-{id}.key"}
    return arguments


@pytest.mark.parametrize("secure", [True, False], ids=["tls-signed", "insecure-plaintext"])
def test_a_trainer_and_an_actor_run_steps_on_every_version(model_dir, tmp_path, aurora_bin, secure):
    if secure:
        nodes = fleet(aurora_bin, tmp_path / "fleet", [("trainer", "trainer", "hub"), ("actor", "1", "us")])
        trainer_args = {**nodes["trainer"], "signing_key": tmp_path / "fleet" / "signing.key"}
        actor_args = {**nodes["1"], "trainer_key": tmp_path / "fleet" / "signing.pub"}
    else:
        trainer_args = actor_args = {"insecure_plaintext": True}
    with aurora_rl.Trainer(tmp_path / "trainer", snapshot_every=2, **trainer_args) as trainer:
        weights = load_file(str(model_dir / "model.safetensors"))
        published = [trainer.publish(weights)]
        assert published[0].version == 0
        assert published[0].weights_hash == aurora_rl.weights_hash(weights)

        with aurora_rl.Actor(
            TransformersEngine.start(str(model_dir)),
            id=1,
            region="us",
            control=trainer.control_address,
            upstreams=[trainer.transport_address],
            token=trainer.token,
            **actor_args,
        ) as actor:
            assert actor.active == (0, published[0].weights_hash)
            loop = ActorLoop(actor)
            loop.start()
            try:
                for step in range(STEPS):
                    prompts = list(range(step * PROMPTS_PER_STEP, (step + 1) * PROMPTS_PER_STEP))
                    trainer.open_step(prompts)
                    version = trainer.commit()
                    results = loop.results(trainer)
                    assert results.version == version == step
                    assert sorted(r.prompt for r in results.rollouts) == prompts
                    assert all(r.actor == 1 and len(r.payload["tokens"]) == 4 for r in results.rollouts)
                    assert results.unfinished == []
                    # The next version, trained "from" these rollouts.
                    weights = next_version(weights, step)
                    published.append(trainer.publish(weights))
                    assert published[-1].version == step + 1
                    assert 0 < published[-1].artifact_bytes
            finally:
                loop.stop.set()
                loop.join(timeout=60)
            assert loop.error is None, loop.error
            # Every version was generated on with exactly the weights the trainer published.
            assert loop.served == {p.version: p.weights_hash for p in published[:STEPS]}
            status = trainer.status()
            assert status.latest == (published[-1].version, published[-1].weights_hash)
            assert [(a.actor, a.region) for a in status.actors] == [(1, "us")]
            assert status.step is not None and status.step.complete
            assert status.accepted == STEPS * PROMPTS_PER_STEP and status.rejected == {}
        # Leaving the block left the fleet and stopped the node.
        assert actor.closed and trainer.status().actors == []
        with pytest.raises(aurora_rl.NodeClosedError):
            actor.claim()
    assert trainer.closed
    with pytest.raises(aurora_rl.NodeClosedError):
        trainer.commit()


def test_with_certificates_nothing_unsigned_is_served_or_taken_unless_asked_by_name(model_dir, tmp_path, aurora_bin):
    nodes = fleet(aurora_bin, tmp_path / "fleet", [("trainer", "trainer", "hub"), ("actor", "1", "us")])
    with pytest.raises(Exception, match="no signing key.*insecure_unsigned=True"):
        aurora_rl.Trainer(tmp_path / "unsigned", **nodes["trainer"])
    trainer = aurora_rl.Trainer(tmp_path / "trainer", signing_key=tmp_path / "fleet" / "signing.key", **nodes["trainer"])
    assert len(trainer.run_id) == 32 and int(trainer.run_id, 16) != 0
    trainer.publish(load_file(str(model_dir / "model.safetensors")))
    actor_args = dict(id=1, region="us", control=trainer.control_address, upstreams=[trainer.transport_address])
    with pytest.raises(Exception, match="pins no trainer key.*insecure_unsigned=True"):
        aurora_rl.Actor(TransformersEngine.start(str(model_dir)), **actor_args, **nodes["1"])
    # Plaintext stays on loopback unless the network is said closed.
    with pytest.raises(Exception, match="not a loopback address"):
        aurora_rl.Trainer(tmp_path / "open", insecure_plaintext=True, control_listen="0.0.0.0:0")
    with pytest.raises(aurora_rl.UsageError, match="only widens insecure_plaintext"):
        aurora_rl.Trainer(tmp_path / "closed", insecure_closed_network=True, **nodes["trainer"])
    # Another trainer's key verifies nothing: the join fails naming why.
    run(aurora_bin, "certs", "init", "--dir", tmp_path / "other")
    with pytest.raises(aurora_rl.NodeTimeoutError, match="last upstream failure: .*signature"):
        aurora_rl.Actor(TransformersEngine.start(str(model_dir)), **actor_args, **nodes["1"],
                        trainer_key=tmp_path / "other" / "signing.pub", join_timeout=5.0)
    trainer.close()


def test_a_base_changed_in_place_after_publishing_is_refused(tmp_path):
    trainer = aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True)
    weights = {"w": torch.ones(64, 64, dtype=torch.bfloat16)}
    trainer.publish(weights)
    weights["w"].add_(1)  # trained in place: no longer version 0
    with pytest.raises(aurora_rl.UsageError, match="changed in place"):
        trainer.publish({"w": torch.zeros(64, 64, dtype=torch.bfloat16)})
    trainer.close()


def test_a_base_untouched_since_published_is_not_hashed_again(tmp_path):
    """torch's write counts decide whether the base is hashed again: a write made behind
    torch's back (``.data``) is not seen by the trainer, only by the actors, whose target
    hash check refuses the version; one made through torch is seen at once."""
    trainer = aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True)
    weights = {"w": torch.ones(64, 64, dtype=torch.bfloat16)}
    trainer.publish(weights)
    weights["w"].data.add_(1)
    second = {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}
    assert trainer.publish(second).version == 1
    second["w"].add_(1)
    with pytest.raises(aurora_rl.UsageError, match="changed in place"):
        trainer.publish({"w": torch.ones(64, 64, dtype=torch.bfloat16)})
    trainer.close()


def test_a_base_is_hashed_again_unless_it_is_surely_the_latest_version(tmp_path):
    """The write counts are trusted only for a base the node still has as its latest,
    that the new state does not alias, and that torch counts writes to."""
    trainer = aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True)
    live = {"w": torch.ones(64, 64, dtype=torch.bfloat16)}
    trainer.publish(live)
    # The same parameters published again, written behind torch's back in between.
    live["w"].data.add_(1)
    with pytest.raises(aurora_rl.UsageError, match="changed in place"):
        trainer.publish(live)
    trainer.close()

    trainer = aurora_rl.Trainer(tmp_path / "another", insecure_plaintext=True)
    states = [{"w": torch.full((64, 64), float(v), dtype=torch.bfloat16)} for v in range(4)]
    trainer.publish(states[0])
    trainer.publish(states[1])
    # The node's latest moved past the base this process holds (as when a publish fails
    # after its Seal): the base is hashed, and refused.
    trainer._node.publish(host_tensors(states[1]), host_tensors(states[2]))
    with pytest.raises(aurora_rl.UsageError, match="changed in place"):
        trainer.publish(states[3])
    trainer.close()

    # Tensors made in inference mode have no write counts: hashed every time, and fine.
    trainer = aurora_rl.Trainer(tmp_path / "inference", insecure_plaintext=True)
    with torch.inference_mode():
        for v in range(3):
            assert trainer.publish({"w": torch.full((64, 64), float(v), dtype=torch.bfloat16)}).version == v
    trainer.close()


def test_a_reopened_trainer_resumes_from_the_latest_version(tmp_path):
    weights = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64).bfloat16()}
    first = aurora_rl.Trainer(tmp_path / "trainer", token="t" * 64, insecure_plaintext=True)
    first.publish(weights)
    newer = {"w": weights["w"] * 2}
    assert first.publish(newer).version == 1
    first.close()
    again = aurora_rl.Trainer(tmp_path / "trainer", token="t" * 64, insecure_plaintext=True)
    with pytest.raises(aurora_rl.UsageError, match="call resume"):
        again.publish(newer)
    with pytest.raises(aurora_rl.WrongBaseError, match="not to version 1"):
        again.resume(weights)
    assert again.resume(newer) == 1
    assert again.publish({"w": newer["w"] + 1}).version == 2
    again.close()


def test_a_restarted_trainer_resumes_from_its_saved_state_and_rollouts(tmp_path):
    import io
    import json

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64, bias=False)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, optimizer, rollouts: bytes):
        inputs = torch.tensor(json.loads(rollouts)).reshape(-1, 64)
        loss = model(inputs).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def export(model):
        return {"w": model.weight.detach().bfloat16()}

    def state(model, optimizer) -> bytes:
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        return buffer.getvalue()

    def rollouts(version: int) -> bytes:
        return json.dumps([((version * 7 + i) % 13) / 13 for i in range(128)]).encode()

    # The unbroken trainer: a state at version 0, the rollouts of each version kept
    # before it is trained.
    model, optimizer = fresh()
    trainer = aurora_rl.Trainer(tmp_path / "trainer", token="t" * 64, insecure_plaintext=True)
    trainer.publish(export(model))
    trainer.save_state(0, state(model, optimizer))
    for version in (1, 2):
        trainer.save_rollouts(version, rollouts(version))
        train(model, optimizer, rollouts(version))
        trainer.publish(export(model))
    train(model, optimizer, rollouts(3))
    unbroken = export(model)["w"]
    trainer.close()  # the crash: version 3 was trained but not published

    # The restarted trainer: the newest state, then every later version trained again.
    def restore(version: int, saved: bytes):
        assert version == 0
        model, optimizer = fresh()
        checkpoint = torch.load(io.BytesIO(saved))
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        return model, optimizer

    def retrain(trainer, version: int, rollouts: bytes):
        train(*trainer, rollouts)

    again = aurora_rl.Trainer(tmp_path / "trainer", token="t" * 64, insecure_plaintext=True)
    model, optimizer = again.recover(restore, retrain, lambda trainer: export(trainer[0]))
    train(model, optimizer, rollouts(3))
    assert torch.equal(export(model)["w"], unbroken)
    assert again.publish(export(model)).version == 3
    with pytest.raises(aurora_rl.NodeError, match="rollouts"):
        again.rollouts(3)
    again.close()

    # Training that differs is refused at the first version it changes; an exception of
    # the trainer's own is the cause of the error.
    again = aurora_rl.Trainer(tmp_path / "trainer", token="t" * 64, insecure_plaintext=True)
    with pytest.raises(aurora_rl.WrongBaseError, match="version 1 was published with weights"):
        again.recover(restore, lambda trainer, version, rollouts: [train(*trainer, rollouts) for _ in (1, 2)], lambda t: export(t[0]))

    def failing(trainer, version: int, rollouts: bytes):
        raise KeyError("no such batch")

    with pytest.raises(aurora_rl.NodeError, match="training again into version 1") as raised:
        again.recover(restore, failing, lambda t: export(t[0]))
    assert isinstance(raised.value.__cause__, KeyError)
    again.close()


def test_an_actor_started_from_local_weights_takes_only_the_deltas(model_dir, tmp_path):
    import time

    trainer = aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True)
    weights = load_file(str(model_dir / "model.safetensors"))
    first = trainer.publish(weights)
    engine = TransformersEngine.start(str(model_dir))
    address = {
        "control": trainer.control_address,
        "upstreams": [trainer.transport_address],
        "token": trainer.token,
        "insecure_plaintext": True,
    }
    with pytest.raises(aurora_rl.UsageError, match="together"):
        aurora_rl.Actor(engine, id=7, region="eu", weights=weights, **address)
    with pytest.raises(aurora_rl.UsageError, match="behind timeout"):
        aurora_rl.Actor(engine, id=7, region="eu", weights=weights, version=0, behind_timeout=-1.0, **address)
    # Its one upstream is the hub: nothing to return to, and a hub is never given up.
    actor = aurora_rl.Actor(
        engine, id=7, region="eu", weights=weights, version=0, return_after=None, behind_timeout=5.0, **address
    )
    assert actor.active == (0, first.weights_hash)
    newer = trainer.publish(next_version(weights, 1))
    trainer.open_step([1, 2])
    trainer.commit()
    deadline = time.monotonic() + 120
    work = None
    while work is None:
        assert time.monotonic() < deadline, "no work on version 1"
        work = actor.claim()
    assert work.version == 1 and work.weights_hash == newer.weights_hash
    assert aurora_rl.weights_hash(engine.held_weights()) == newer.weights_hash
    actor.leave()
    assert actor.closed
    trainer.close()


def plaintext_trainer(tmp_path: Path, model_dir: Path) -> tuple[aurora_rl.Trainer, dict, dict]:
    """A loopback trainer that published the model as version 0, the model's weights,
    and the keyword arguments an actor joins it with."""
    trainer = aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True)
    weights = load_file(str(model_dir / "model.safetensors"))
    trainer.publish(weights)
    address = {
        "control": trainer.control_address,
        "upstreams": [trainer.transport_address],
        "token": trainer.token,
        "insecure_plaintext": True,
    }
    return trainer, weights, address


def test_an_actor_whose_upstream_went_away_says_why_it_is_behind(model_dir, tmp_path):
    import time

    trainer, weights, address = plaintext_trainer(tmp_path, model_dir)
    actor = aurora_rl.Actor(TransformersEngine.start(str(model_dir)), id=8, region="eu", **address)
    assert actor.why_behind() is None
    trainer.close()
    deadline = time.monotonic() + 60
    while (why := actor.why_behind()) is None:
        assert time.monotonic() < deadline, "the upstream's end was never reported"
        actor.safe_point(wait=0.2)
    assert why.startswith("last upstream failure: "), why
    actor.close()


class FailingEngine(TransformersEngine):
    """An engine whose weight loads fail, as one out of memory would."""

    def load_weights(self, tensors) -> None:
        raise MemoryError("no room for the new weights")


def test_an_engine_that_fails_to_load_a_version_stops_the_actor_with_the_reason(model_dir, tmp_path):
    import time

    trainer, weights, address = plaintext_trainer(tmp_path, model_dir)
    engine = FailingEngine.start(str(model_dir))
    actor = aurora_rl.Actor(engine, id=8, region="eu", weights=weights, version=0, **address)
    trainer.publish(next_version(weights, 1))
    trainer.open_step([1])
    trainer.commit()
    deadline = time.monotonic() + 120
    with pytest.raises(MemoryError, match="no room"):
        while time.monotonic() < deadline:
            actor.claim()
    # The engine's weights are neither version: no claim may serve from them.
    with pytest.raises(aurora_rl.NodeError, match="failed to load version 1"):
        actor.claim()
    with pytest.raises(aurora_rl.NodeError, match="failed to load version 1"):
        actor.safe_point()
    # The control plane heard: the actor left the fleet.
    assert actor.closed and trainer.status().actors == []
    trainer.close()


class RecordingEngine(TransformersEngine):
    """Records the tensors it was told to map, the changes each activation hands it, the
    new tensors they make, and the version its actor's node holds meanwhile, then writes
    them."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.changes: list[dict[str, torch.Tensor | None]] = []
        self.tensors: list[dict[str, torch.Tensor]] = []
        self.node_held: list[int] = []
        self.node_version = lambda: -1
        #: (loads before it, specs) of each ``map_elements`` call.
        self.mapped: list[tuple[int, dict]] = []

    def map_elements(self, specs) -> None:
        self.mapped.append((len(self.changes), dict(specs)))

    def load_changes(self, changes) -> None:
        self.node_held.append(self.node_version())
        self.changes.append({name: None if c.indices is None else c.indices.clone() for name, c in changes.items()})
        self.tensors.append({name: c.tensor.clone() for name, c in changes.items()})
        super().load_changes(changes)


class NewTensorsEngine(RecordingEngine):
    """An element engine that reads every changed tensor whole."""

    needs_new_tensors = True


@pytest.mark.parametrize("engine_class", [RecordingEngine, NewTensorsEngine])
def test_an_element_engine_is_handed_exactly_the_changed_elements(model_dir, tmp_path, engine_class):
    """Changes come before the node's copy has them (the node still holds the version
    before while the engine loads), their new tensors made from them on demand, except
    for an engine that needs the new tensors, which gets them after; both bit-exact. The
    node's copy follows: each next delta is checked against it, so versions 2 and 3
    stage only if it took 1 and 2 exactly."""
    weights = load_file(str(model_dir / "model.safetensors"))
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(weights)
        engine = engine_class.start(str(model_dir))
        address = dict(control=trainer.control_address, upstreams=[trainer.transport_address], token=trainer.token)
        with aurora_rl.Actor(engine, id=3, region="eu", weights=weights, version=0, insecure_plaintext=True, **address) as actor:
            engine.node_version = lambda: actor._node.active()[0]
            for version in (1, 2, 3):
                stepped = sparse_step(weights, 0.01, version)
                published = trainer.publish(stepped)
                trainer.open_step([version])
                trainer.commit()
                work = None
                while work is None:
                    work = actor.claim()
                assert (work.version, work.weights_hash) == (version, published.weights_hash)
                if engine_class is RecordingEngine:
                    assert engine.node_held[-1] == version - 1
                # Otherwise the tensors handed over, the new version's bit for bit (below),
                # are views of the node's copy, which had it; the node's status may report
                # it only a moment after the engine was handed it.
                handed = engine.changes[-1]
                for name, after in stepped.items():
                    moved = torch.nonzero(after.view(torch.int16).reshape(-1) != weights[name].view(torch.int16).reshape(-1))
                    if moved.numel():
                        assert torch.equal(handed[name], moved.reshape(-1)), name
                        assert torch.equal(engine.tensors[-1][name].view(torch.int16), after.view(torch.int16)), name
                    else:
                        assert name not in handed or handed[name].numel() == 0, name
                assert aurora_rl.weights_hash(engine.held_weights()) == published.weights_hash
                outcomes = actor.submit(work, [(lease, None, 1) for lease in work.leases])
                assert [o["status"] for o in outcomes] == ["accepted"], outcomes
                assert trainer.wait_step(timeout=60).version == version
                weights = stepped
            # Every tensor mapped once, before the first load, whatever each version changed.
            specs = {name: (list(t.shape), t.dtype) for name, t in weights.items()}
            assert engine.mapped == [(0, specs)]


class ReadBackEngine(TransformersEngine):
    """Records the tensors each read-back check is asked about; with ``corrupt`` set,
    changes an element of that tensor after each load, as a faulty write would."""

    checked: list[list[str]]
    corrupt: str | None = None

    def load_changes(self, changes) -> None:
        super().load_changes(changes)
        if self.corrupt is not None:
            with torch.no_grad():
                self.model.state_dict()[self.corrupt].view(-1)[0] += 1

    def mismatched(self, expected):
        self.checked.append(sorted(expected))
        return super().mismatched(expected)


def checked_actor(trainer: aurora_rl.Trainer, engine: ReadBackEngine, weights: dict, **verify) -> aurora_rl.Actor:
    engine.checked = []
    return aurora_rl.Actor(engine, id=4, region="eu", weights=weights, version=0, control=trainer.control_address,
                           upstreams=[trainer.transport_address], token=trainer.token, insecure_plaintext=True, **verify)


def run_steps(trainer: aurora_rl.Trainer, actor: aurora_rl.Actor, weights: dict, steps: int) -> dict:
    """``steps`` RL-sized versions after ``weights``, each published, committed, generated
    for on one prompt and taken; returns the last."""
    for version in range(1, steps + 1):
        weights = sparse_step(weights, 0.01, version)
        trainer.publish(weights)
        trainer.open_step([version])
        trainer.commit()
        work = next_work(actor)
        actor.submit(work, [(lease, None, 1) for lease in work.leases])
        trainer.wait_step(timeout=60)
    return weights


def test_a_sampling_actor_reads_back_a_few_tensors_chosen_anew_at_each_version(model_dir, tmp_path):
    weights = load_file(str(model_dir / "model.safetensors"))
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(weights)
        engine = ReadBackEngine.start(str(model_dir))
        with checked_actor(trainer, engine, weights, verify="sample", verify_tensors=3) as actor:
            weights = run_steps(trainer, actor, weights, 3)
        assert [len(names) for names in engine.checked] == [3, 3, 3]
        assert all(set(names) <= set(weights) for names in engine.checked)
        # 3 of this model's tensors, drawn three times: the same draw each time would be a
        # fixed sample, which a fault in the other tensors would never meet.
        assert len({tuple(names) for names in engine.checked}) > 1
        with pytest.raises(aurora_rl.UsageError, match="verify is one of full, sample, off"):
            checked_actor(trainer, engine, weights, verify="some")


def test_a_full_read_back_finds_an_element_the_engine_holds_wrong_and_the_actor_leaves(model_dir, tmp_path):
    weights = load_file(str(model_dir / "model.safetensors"))
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(weights)
        engine = ReadBackEngine.start(str(model_dir))
        actor = checked_actor(trainer, engine, weights, verify="full")
        stepped = sparse_step(weights, 0.01, 1)
        trainer.publish(stepped)
        trainer.open_step([1])
        trainer.commit()
        next_work(actor)
        assert engine.checked == [sorted(weights)]
        engine.corrupt = "model.layers.0.mlp.down_proj.weight"
        trainer.publish(sparse_step(stepped, 0.01, 2))
        trainer.commit()
        with pytest.raises(aurora_rl.TargetMismatchError, match="version 2's model.layers.0.mlp.down_proj.weight"):
            while True:
                actor.safe_point(wait=60.0)
        assert actor.closed and trainer.status().actors == []


class BlindEngine(TransformersEngine):
    """An engine that cannot read its weights back."""

    mismatched = None  # type: ignore[assignment]


def test_an_actor_whose_engine_cannot_read_back_says_so_once(model_dir, tmp_path, caplog):
    weights = load_file(str(model_dir / "model.safetensors"))
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(weights)
        engine = BlindEngine.start(str(model_dir))
        with aurora_rl.Actor(engine, id=5, region="eu", weights=weights, version=0, control=trainer.control_address,
                             upstreams=[trainer.transport_address], token=trainer.token,
                             insecure_plaintext=True) as actor:
            run_steps(trainer, actor, weights, 2)
    said = [r.getMessage() for r in caplog.records if "cannot read its weights back" in r.getMessage()]
    assert said == ["verify='sample', but BlindEngine cannot read its weights back here: versions are not checked in it"]
