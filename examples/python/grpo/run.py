"""GRPO on two-digit addition with aurora: a PyTorch trainer, two regions with a relay
each, and vLLM actors as separate processes, all on this machine's CPU.

The trainer is a Hugging Face ``Qwen3ForCausalLM`` built from a config (no downloads), or
with ``--moe`` a ``Qwen3MoeForCausalLM`` (eight experts, two per token: each version
carries the experts the step's tokens reached, written into vLLM's fused expert weights
in place), given a short supervised warm-up so that the base policy solves some problems. Each step
it posts prompts; actors sample groups of completions with vLLM and return them with
their log-probabilities; the trainer takes the accepted ones, makes a GRPO update to its
FP32 weights and publishes the BF16 export as the next version, which reaches every actor
as an aurora delta through its region's relay. Midway one actor is killed and a new one
joins by snapshot; the job goes on.

    python examples/python/grpo/run.py                  # the full run, ~15 minutes here
    python examples/python/grpo/run.py --steps 6 ...    # a short form (CI runs one)
    python examples/python/grpo/run.py --moe ...        # the mixture-of-experts model

It writes ``metrics.jsonl`` (a line per step) and the processes' logs into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

import addition

import aurora_rl
from aurora_rl.export import export_bf16

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
logger = logging.getLogger("grpo")


def model_config(moe: bool = False) -> transformers.PretrainedConfig:
    """About 3 million parameters; with ``moe``, 8 experts of a quarter of the dense MLP's
    width each, 2 per token (about 5 million, 2.5 active)."""
    common = dict(
        vocab_size=addition.VOCAB_SIZE,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        eos_token_id=addition.EOS,
        pad_token_id=addition.PAD,
        bos_token_id=None,
    )
    # Saved without a model, the config would not say what it is for, and vLLM would also
    # serve it for scoring, which needs a tokenizer.
    if moe:
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=768, moe_intermediate_size=192, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"],
        )
    return transformers.Qwen3Config(**common, intermediate_size=768, architectures=["Qwen3ForCausalLM"])


def build(config: transformers.PretrainedConfig) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_config(config)


@torch.no_grad()
def accuracy(model: torch.nn.Module, problems: list[tuple[int, int]]) -> float:
    """Greedy held-out accuracy of the BF16 weights the actors hold."""
    policy = build(model.config).to(torch.bfloat16).eval()
    policy.load_state_dict({name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()})
    tokens = torch.tensor([addition.prompt(a, b) for a, b in problems])
    for _ in range(addition.ANSWER_TOKENS):
        logits = policy(input_ids=tokens).logits[:, -1]
        tokens = torch.cat([tokens, logits.argmax(dim=-1, keepdim=True)], dim=1)
    completions = tokens[:, addition.PROMPT_TOKENS :].tolist()
    return sum(addition.reward(a, b, c) for (a, b), c in zip(problems, completions)) / len(problems)


def warm_up(model, held_out, target: float, max_steps: int, seed: int) -> tuple[float, int]:
    """Supervised steps on training problems until the held-out accuracy reaches
    ``target`` (checked every 25 steps)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    score, step = accuracy(model, held_out), 0
    while score < target and step < max_steps:
        for _ in range(25):
            problems = [addition.problem(rng.randrange(2**31)) for _ in range(32)]
            tokens = torch.tensor([addition.prompt(a, b) + addition.answer(a, b) for a, b in problems])
            labels = tokens.clone()
            labels[:, : addition.PROMPT_TOKENS] = -100
            loss = model(input_ids=tokens, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
        score = accuracy(model, held_out)
        logger.info("warm-up step %d: loss %.3f, held-out accuracy %.3f", step, loss.item(), score)
    return score, step


def grpo_step(model, optimizer, results: aurora_rl.StepResults, clip: float = 0.2) -> dict:
    """One GRPO update from a step's accepted groups: advantages normalised within each
    group, the clipped ratio against the log-probabilities the actors sampled with."""
    tokens, masks, advantages, behaviour, rewards, with_signal = [], [], [], [], [], 0
    for rollout in results.rollouts:
        a, b = addition.problem(rollout.prompt)
        samples, logprobs = rollout.payload["samples"], rollout.payload["logprobs"]
        group = torch.tensor([addition.reward(a, b, s) for s in samples])
        rewards.append(group.mean().item())
        if group.std() == 0:
            continue
        with_signal += 1
        normalised = (group - group.mean()) / (group.std() + 1e-4)
        for sample, sampled_logprobs, advantage in zip(samples, logprobs, normalised.tolist()):
            sample, sampled_logprobs = sample[: addition.ANSWER_TOKENS], sampled_logprobs[: addition.ANSWER_TOKENS]
            pad = addition.ANSWER_TOKENS - len(sample)
            tokens.append(addition.prompt(a, b) + sample + [addition.PAD] * pad)
            masks.append([1.0] * len(sample) + [0.0] * pad)
            behaviour.append(sampled_logprobs + [0.0] * pad)
            advantages.append(advantage)
    stats = {"reward": sum(rewards) / max(len(rewards), 1), "groups_with_signal": with_signal}
    if not tokens:
        return stats | {"loss": 0.0}
    tokens, masks = torch.tensor(tokens), torch.tensor(masks)
    logits = model(input_ids=tokens).logits[:, addition.PROMPT_TOKENS - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(2, tokens[:, addition.PROMPT_TOKENS :].unsqueeze(2)).squeeze(2)
    ratio = torch.exp(logprobs - torch.tensor(behaviour))
    advantage = torch.tensor(advantages).unsqueeze(1)
    objective = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    loss = -(objective * masks).sum() / masks.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return stats | {"loss": loss.item()}


class Fleet:
    """The run's trust: a fleet CA and the trainer's signing key (``aurora certs init``),
    and a certificate for each node as it starts (``aurora certs issue``), so every
    connection runs mutual TLS and every version is signed, as across the internet."""

    def __init__(self, directory: Path, aurora_bin: str):
        self.directory, self.aurora_bin = directory, aurora_bin
        subprocess.run([aurora_bin, "certs", "init", "--dir", str(directory)], check=True, capture_output=True)
        self.signing_key = directory / "signing.key"
        self.trainer_key = directory / "signing.pub"

    def issue(self, role: str, id: str, region: str) -> dict[str, Path]:
        """A node's certificate and key, issued now: its ``ca``, ``cert`` and ``key`` files."""
        subprocess.run(
            [self.aurora_bin, "certs", "issue", "--dir", str(self.directory),
             "--role", role, "--id", id, "--region", region],
            check=True, capture_output=True,
        )
        nodes = self.directory / "nodes"
        return {"ca": self.directory / "ca.pem", "cert": nodes / f"{role}-{id}.pem", "key": nodes / f"{role}-{id}.key"}

    def flags(self, role: str, id: str, region: str) -> list[str]:
        """The command-line flags of a node's certificate and the trainer's public key."""
        files = self.issue(role, id, region)
        return [f"--{name}={path}" for name, path in files.items()] + [f"--trainer-key={self.trainer_key}"]


class Processes:
    """The relays and actors this run started, with their logs in the run directory."""

    def __init__(self, out: Path, aurora_bin: str, trainer: aurora_rl.Trainer, fleet: Fleet, model_dir: Path, engine: str):
        self.out, self.aurora_bin, self.trainer, self.fleet = out, aurora_bin, trainer, fleet
        self.model_dir, self.engine = model_dir, engine
        self.relays: dict[str, str] = {}
        self.actors: dict[int, subprocess.Popen] = {}
        self.all: list[subprocess.Popen] = []

    def _start(self, command: list[str], name: str) -> subprocess.Popen:
        log = open(self.out / f"{name}.log", "w")
        env = {**os.environ, "NO_COLOR": "1"}
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.all.append(process)
        return process

    def start_relay(self, region: str) -> None:
        process = self._start(
            [self.aurora_bin, "relay", "--transport-listen", "127.0.0.1:0", "--upstream", self.trainer.transport_address,
             *self.fleet.flags("relay", f"relay-{region}", region)],
            f"relay-{region}",
        )
        line = read_line(process, 120, f"relay {region}")
        self.relays[region] = line.removeprefix("listening on ").strip()

    def start_actor(self, actor: int, region: str) -> None:
        self.actors[actor] = self._start(
            [sys.executable, str(HERE / "actor.py"), "--id", str(actor), "--region", region,
             "--control", self.trainer.control_address, "--upstream", self.relays[region],
             "--upstream", self.trainer.transport_address, "--model-dir", str(self.model_dir),
             "--engine", self.engine, *self.fleet.flags("actor", str(actor), region)],
            f"actor-{actor}",
        )

    def wait_joined(self, actor: int, timeout: float) -> None:
        read_line(self.actors[actor], timeout, f"actor {actor}")

    def kill_actor(self, actor: int) -> None:
        self.actors.pop(actor).send_signal(signal.SIGKILL)

    def check_alive(self) -> None:
        for process in self.all:
            if process.poll() is not None and process.returncode != -signal.SIGKILL:
                raise RuntimeError(f"{process.args[:3]} exited with {process.returncode}: see its log in {self.out}")

    def stop(self) -> None:
        for process in self.all:
            if process.poll() is None:
                process.kill()
            process.wait()


def wait_step(trainer: aurora_rl.Trainer, processes: Processes, timeout: float) -> aurora_rl.StepResults:
    """The step's results, failing as soon as a process this run did not kill dies."""
    deadline = time.monotonic() + timeout
    while True:
        processes.check_alive()
        try:
            return trainer.wait_step(timeout=min(5.0, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise


def wait_for_version(
    trainer: aurora_rl.Trainer, processes: Processes, version: int, timeout: float
) -> list[aurora_rl.ActorStatus]:
    """Waits until every actor this run has alive (the one that joined late included)
    is registered and runs ``version``; returns what the control plane says of them."""
    deadline = time.monotonic() + timeout
    while True:
        processes.check_alive()
        live = [actor for actor in trainer.status().actors if actor.actor in processes.actors]
        if len(live) == len(processes.actors) and all(actor.active == version for actor in live):
            return live
        if time.monotonic() > deadline:
            raise RuntimeError(f"the actors did not all reach version {version}: {live}")
        time.sleep(0.2)


def read_line(process: subprocess.Popen, timeout: float, what: str) -> str:
    """The process's next stdout line, within ``timeout`` seconds."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError(f"{what} said nothing within {timeout} s")
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} exited with {process.wait()} before it was ready: see its log")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--actors-per-region", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=None, help="step at which actor 1 is killed and a new one joins (default: halfway)")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--warmup-accuracy", type=float, default=0.15)
    parser.add_argument("--warmup-max-steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=7e-4)
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--moe", action="store_true", help="a mixture-of-experts model (Qwen3-MoE) instead of a dense one")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "grpo")
    parser.add_argument("--aurora-bin", default=shutil.which("aurora") or str(REPO / "target" / "debug" / "aurora"))
    args = parser.parse_args()
    kill_at = args.steps // 2 if args.kill_at is None else args.kill_at

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
        handlers=[logging.StreamHandler(), logging.FileHandler(args.out / "trainer.log")],
    )
    torch.manual_seed(args.seed)
    config = model_config(args.moe)
    model = build(config)
    model_dir = args.out / "model"
    config.save_pretrained(model_dir)  # what actors start their engine from; the weights come from aurora
    held_out = addition.held_out_problems(args.held_out)
    started = time.monotonic()
    base_accuracy, warmup_steps = warm_up(model, held_out, args.warmup_accuracy, args.warmup_max_steps, args.seed)
    logger.info("%d parameters; warm-up: %d steps, held-out accuracy %.3f", model.num_parameters(), warmup_steps, base_accuracy)

    fleet = Fleet(args.out / "fleet", args.aurora_bin)
    trainer = aurora_rl.Trainer(
        args.out / "trainer",
        snapshot_every=5,
        control={"heartbeat_timeout_ms": 4000, "lease": {"initial_ms": 20000, "min_ms": 3000, "max_ms": 60000}},
        signing_key=fleet.signing_key,
        **fleet.issue("trainer", "trainer", "us"),
    )
    weights = export_bf16(model)  # a new tensor each: the previous export stays the next delta's base
    dense_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    trainer.publish(weights)
    processes = Processes(args.out, args.aurora_bin, trainer, fleet, model_dir, args.engine)
    metrics = open(args.out / "metrics.jsonl", "w")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    try:
        regions = ["us", "eu"]
        for region in regions:
            processes.start_relay(region)
        actor_ids = list(range(1, 1 + args.actors_per_region * len(regions)))
        for actor in actor_ids:
            processes.start_actor(actor, regions[(actor - 1) % len(regions)])
        for actor in actor_ids:
            processes.wait_joined(actor, 600)
        logger.info("actors %s joined after %.0f s", actor_ids, time.monotonic() - started)
        next_actor = actor_ids[-1] + 1
        accuracy_now = base_accuracy
        for step in range(args.steps):
            record: dict = {"step": step}
            if step == kill_at and args.steps > 1:
                processes.kill_actor(1)
                processes.start_actor(next_actor, regions[0])
                record["events"] = [f"killed actor 1; actor {next_actor} joins by snapshot"]
                next_actor += 1
            opened = time.monotonic()
            prompts = list(range(step * args.prompts_per_step, (step + 1) * args.prompts_per_step))
            trainer.open_step(prompts)
            record["version"] = trainer.commit()
            results = wait_step(trainer, processes, timeout=900)
            record["generation_s"] = time.monotonic() - opened
            record["actors"] = sorted({r.actor for r in results.rollouts})
            training = time.monotonic()
            record |= grpo_step(model, optimizer, results)
            record["training_s"] = time.monotonic() - training
            weights = export_bf16(model)
            published = trainer.publish(weights)
            record |= {
                "published": published.version,
                "weights_hash": published.weights_hash,
                "delta_bytes": published.artifact_bytes,
                "dense_bytes": dense_bytes,
            }
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                accuracy_now = accuracy(model, held_out)
                record["accuracy"] = accuracy_now
            record["elapsed_s"] = time.monotonic() - started
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            logger.info(
                "step %d on version %d: reward %.3f, accuracy %.3f, delta %d of %d bytes, actors %s",
                step, record["version"], record["reward"], accuracy_now, published.artifact_bytes, dense_bytes, record["actors"],
            )
        actors = wait_for_version(trainer, processes, trainer.commit(), timeout=600)
    finally:
        processes.stop()
    summary = {
        "base_accuracy": base_accuracy,
        "final_accuracy": accuracy_now,
        "steps": args.steps,
        "elapsed_s": time.monotonic() - started,
        "actors": [dataclasses.asdict(actor) for actor in actors],
    }
    (args.out / "summary.json").write_text(json.dumps(summary))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
