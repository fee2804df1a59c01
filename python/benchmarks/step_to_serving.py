"""From the trainer's optimizer step to the actor serving the version, across the emulated
us-canada link: aurora against shipping the whole checkpoint over the same link and
reloading it, in one run.

Run it inside the emulated network (root: network namespaces):

    target/debug/aurora wan exec wan/scenarios/us-canada.toml -- \\
        .venv/bin/python python/benchmarks/step_to_serving.py [--preset 0.6b] [--rounds 3] [--lr 1e-6] [--json FILE]

The trainer runs in region ``us``; one actor, vLLM's CPU build in its own process (load
format ``aurora``), in region ``canada``, behind the link (1 Gbps, 30 ms RTT, 0.1% loss
each way). Each is a process in its region's namespace, with mutual TLS and signed
versions as in production. Each round takes the next version of ``aurora synth``'s chain
(the trainer's state after an Adam-style step, as torch tensors) and times, from the
moment the state is in hand until the actor's vLLM computes with it:

- aurora: ``Trainer.publish`` (the delta extracted, signed, stored and streamed to the
  actor, which stages it) and ``Trainer.commit``, until ``Actor.safe_point`` returns the
  version (its changed elements written into vLLM's parameters);
- the baseline: the state serialized as one safetensors blob, sent over ``--streams``
  parallel TCP connections, deserialized, and loaded whole into vLLM (``load_weights``:
  vLLM's reload from tensors in memory).

After each, outside the timing, the weights vLLM computes with are read back and their
hash compared with the trainer's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def region(name: str, what: str) -> str:
    key = f"AURORA_WAN_{name.upper()}_{what}"
    value = os.environ.get(key)
    if value is None:
        sys.exit(f"{key} is not set: run this under `aurora wan exec wan/scenarios/us-canada.toml -- ...`")
    return value


def in_region(name: str, *command: str) -> list[str]:
    return ["ip", "netns", "exec", region(name, "NETNS"), *command]


def receive_exactly(connection: socket.socket, view: memoryview) -> None:
    while view:
        received = connection.recv_into(view)
        if not received:
            raise ConnectionError("the sender closed early")
        view = view[received:]


def actor_main(args: argparse.Namespace) -> None:
    """The actor's process, in region canada: commands on stdin, one JSON line each;
    answers on the file descriptor ``--answers`` (vLLM writes its logs to stdout)."""
    from safetensors.torch import load, load_file

    import aurora_rl
    from aurora_rl.engines.vllm import VllmEngine

    answers = os.fdopen(args.answers, "w", buffering=1)

    def answer(**fields: Any) -> None:
        answers.write(json.dumps(fields) + "\n")

    engine = VllmEngine.start(str(args.model_dir), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    fleet = Path(args.fleet)
    actor = aurora_rl.Actor(
        engine, id=1, region="canada", control=args.control, upstreams=[args.upstream],
        weights=load_file(args.weights), version=0, trainer_key=fleet / "signing.pub",
        ca=fleet / "ca.pem", cert=fleet / "nodes" / "actor-1.pem", key=fleet / "nodes" / "actor-1.key",
    )
    listener = socket.create_server((region("canada", "ADDRESS"), 0))
    answer(ready=True, port=listener.getsockname()[1])
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "activate":
            while actor.safe_point(wait=60.0) != command["version"]:
                pass
            answer(active=command["version"])
        elif command["do"] == "receive_whole":
            blob = bytearray(command["bytes"])
            connections = [listener.accept()[0] for _ in range(command["streams"])]

            def receive(connection: socket.socket) -> None:
                header = bytearray(16)
                receive_exactly(connection, memoryview(header))
                start, length = int.from_bytes(header[:8], "little"), int.from_bytes(header[8:], "little")
                receive_exactly(connection, memoryview(blob)[start : start + length])
                connection.close()

            threads = [threading.Thread(target=receive, args=(c,)) for c in connections]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            engine.load_weights(load(bytes(blob)))
            answer(loaded=True)
        elif command["do"] == "hash":
            answer(hash=aurora_rl.weights_hash(engine.held_weights()))
        elif command["do"] == "stop":
            actor.close()
            return


def send_whole(address: tuple[str, int], blob: bytes, streams: int) -> None:
    """The blob over ``streams`` connections, each a contiguous part of it."""
    part = -(-len(blob) // streams)

    def send(index: int) -> None:
        start = index * part
        length = max(0, min(part, len(blob) - start))
        with socket.create_connection(address) as connection:
            connection.sendall(start.to_bytes(8, "little") + length.to_bytes(8, "little"))
            connection.sendall(memoryview(blob)[start : start + length])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def trainer_main(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file, save

    import aurora_rl
    from activation import synth_chain

    us = region("us", "ADDRESS")
    with tempfile.TemporaryDirectory(prefix="aurora-bench-step-") as scratch:
        scratch = Path(scratch)
        # The actor's vLLM starts from the first version.
        files, model_dir = synth_chain(args.aurora_bin, args.preset, args.rounds, args.lr, scratch)
        fleet = scratch / "fleet"
        subprocess.run([args.aurora_bin, "certs", "init", "--dir", str(fleet)], check=True, capture_output=True)
        for role, id, where in (("trainer", "trainer", "us"), ("actor", "1", "canada")):
            subprocess.run([args.aurora_bin, "certs", "issue", "--dir", str(fleet), "--role", role, "--id", id,
                            "--region", where], check=True, capture_output=True)
        states = [load_file(str(path)) for path in files]
        trainer = aurora_rl.Trainer(
            scratch / "trainer", snapshot_every=0, control_listen=f"{us}:0", transport_listen=f"{us}:0",
            signing_key=fleet / "signing.key", ca=fleet / "ca.pem", cert=fleet / "nodes" / "trainer-trainer.pem",
            key=fleet / "nodes" / "trainer-trainer.key",
        )
        trainer.publish(states[0])
        trainer.commit()
        answers_read, answers_write = os.pipe()
        actor = subprocess.Popen(
            in_region("canada", sys.executable, __file__, "--role", "actor", "--answers", str(answers_write),
                      "--model-dir", str(model_dir), "--weights", str(files[0]), "--fleet", str(fleet),
                      "--control", trainer.control_address, "--upstream", trainer.transport_address),
            stdin=subprocess.PIPE, text=True, pass_fds=(answers_write,),
            stdout=subprocess.DEVNULL if not args.actor_logs else None,
            stderr=subprocess.DEVNULL if not args.actor_logs else None,
        )
        os.close(answers_write)
        answers = os.fdopen(answers_read)

        def ask(**command: Any) -> dict:
            actor.stdin.write(json.dumps(command) + "\n")
            actor.stdin.flush()
            line = answers.readline()
            if not line:
                raise RuntimeError(f"the actor ended ({actor.wait()})")
            return json.loads(line)

        ready = json.loads(answers.readline() or "{}")
        if not ready.get("ready"):
            raise RuntimeError(f"the actor did not start ({actor.wait()})")
        actor_address = (region("canada", "ADDRESS"), ready["port"])
        rounds = []
        for version in range(1, len(states)):
            state = states[version]
            started = time.perf_counter()
            published = trainer.publish(state)
            publish_s = time.perf_counter() - started
            trainer.commit()
            ask(do="activate", version=version)
            aurora_s = time.perf_counter() - started
            held = ask(do="hash")["hash"]
            assert held == published.weights_hash, f"aurora: vLLM serves {held}, not {published}"
            started = time.perf_counter()
            blob = save(state)
            command = dict(do="receive_whole", bytes=len(blob), streams=args.streams)
            actor.stdin.write(json.dumps(command) + "\n")
            actor.stdin.flush()
            send_whole(actor_address, blob, args.streams)
            if not json.loads(answers.readline() or "{}").get("loaded"):
                raise RuntimeError("the actor did not load the whole checkpoint")
            whole_s = time.perf_counter() - started
            assert ask(do="hash")["hash"] == published.weights_hash, "baseline: vLLM serves the version"
            rounds.append({"version": version, "delta_bytes": published.artifact_bytes,
                           "checkpoint_bytes": len(blob), "aurora_s": aurora_s, "of_which_publish_s": publish_s,
                           "whole_checkpoint_s": whole_s})
            print(json.dumps(rounds[-1]), flush=True)
        actor.stdin.write(json.dumps({"do": "stop"}) + "\n")
        actor.stdin.close()
        actor.wait(timeout=120)
        trainer.close()
    aurora = statistics.median(r["aurora_s"] for r in rounds)
    whole = statistics.median(r["whole_checkpoint_s"] for r in rounds)
    report = {
        "preset": args.preset,
        "lr": args.lr,
        "scenario": "us-canada (1 Gbps, 30 ms RTT, 0.1% loss each way)",
        "baseline_streams": args.streams,
        "rounds": rounds,
        "median_aurora_s": aurora,
        "median_whole_checkpoint_s": whole,
        "speedup": whole / aurora,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="0.6b", choices=["small", "0.6b"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lr", default="1e-6", help="aurora synth's learning rate: sets the density")
    parser.add_argument("--streams", type=int, default=4, help="TCP connections the whole checkpoint is sent over")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--actor-logs", action="store_true", help="show the actor process's output")
    parser.add_argument("--aurora-bin", default=str(REPO / "target" / "debug" / "aurora"))
    parser.add_argument("--role", default="trainer", choices=["trainer", "actor"], help=argparse.SUPPRESS)
    for internal in ("--answers", "--model-dir", "--weights", "--fleet", "--control", "--upstream"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "actor":
        args.answers = int(args.answers)
        actor_main(args)
    elif os.environ.get("AURORA_STEP_BENCH_IN_US"):
        trainer_main(args)
    else:
        # The trainer's side runs in region us, as a process of its own.
        command = in_region("us", "env", "AURORA_STEP_BENCH_IN_US=1", sys.executable, __file__, *sys.argv[1:])
        sys.exit(subprocess.run(command).returncode)


if __name__ == "__main__":
    main()
