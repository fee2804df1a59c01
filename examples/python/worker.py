#!/usr/bin/env python3
"""A rollout actor for the aurora hub, in Python's standard library alone.

It speaks the control plane's HTTP API, version 1 (docs/control-api.md): it
registers with the fleet token, then, with the token the hub gave it, claims
leases, generates a rollout for each prompt, and submits the results with their
payloads. It follows every claim answer (work, with or without a Commit first;
catch up; preemption window; no open step), re-registers when the hub has
forgotten it, and retries when the hub is down or busy.

`generate` makes a fake rollout and no weights arrive: this is the control API
alone, for clients that cannot use the aurora_rl package (the hub's tests run it
against a real hub). A real actor, which receives every version and generates with
vLLM, is `grpo/actor.py` on `aurora_rl.Actor`. Each accepted result is printed as
one line, `accepted step=S prompt=P`, so that scripts can follow progress.

    AURORA_TOKEN=... python3 worker.py --hub http://127.0.0.1:7300 --actor 1

SIGTERM is taken as a spot-preemption notice: the worker tells the hub, finishes
nothing new, and leaves. Claims and submissions count as heartbeats; an engine
whose batches take longer than the hub's heartbeat timeout (30 s by default) must
also call /v1/heartbeat while it generates.
"""

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

# Statuses worth retrying: the request timed out, the hub could not do its part, or
# (409) it cannot take the actor yet (nothing published, membership full).
RETRY_STATUSES = {408, 409, 500, 502, 503, 504}
# Longest pause between retries while the hub is unreachable.
MAX_BACKOFF_S = 5.0


class HubError(Exception):
    """The hub refused a request: an HTTP status and the hub's sentence."""

    def __init__(self, status, message):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class Hub:
    """JSON over HTTP to the hub, retrying what is worth retrying."""

    def __init__(self, url, timeout_s):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, method, path, token, body=None):
        backoff_s = 0.1
        while True:
            try:
                return self._call_once(method, path, token, body)
            except HubError as error:
                if error.status not in RETRY_STATUSES:
                    raise
                log(f"{path}: {error}; retrying")
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                log(f"{path}: hub unreachable ({error}); retrying")
            # Exponential, from the upper half of the bound at random: workers that
            # lost the hub together do not all come back at the same instant.
            time.sleep(backoff_s * random.uniform(0.5, 1.0))
            backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)

    def _call_once(self, method, path, token, body):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {token}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")
            try:
                message = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError):
                message = text
            raise HubError(error.code, message) from None


class Worker:
    def __init__(self, args, fleet_token):
        self.hub = Hub(args.hub, args.timeout_s)
        self.fleet_token = fleet_token
        self.actor = args.actor
        self.region = args.region
        self.active = args.active
        self.staged = None
        self.hashes = {}  # version -> weights hash, as the engine would compute it
        self.token = None
        self.poll_s = args.poll_ms / 1000
        self.results_wanted = args.results
        self.accepted = 0
        self.preempted = threading.Event()

    # --- The engine's side: replace these with a real one. ---

    def weights_hash(self, version):
        """h(version), the BLAKE3 hash of the BF16 weights. A real engine hashes its
        own weights; this stand-in asks the hub for the latest published one."""
        if version not in self.hashes:
            latest = self.hub.call("GET", "/v1/status", self.fleet_token)["latest"]
            if latest is None or latest["version"] != version:
                raise RuntimeError(f"h(v{version}) is unknown: v{version} is not the latest")
            self.hashes[version] = latest["weights_hash"]
        return self.hashes[version]

    def generate(self, lease):
        """A fake rollout for the lease's prompt: deterministic text, token ids and
        log-probabilities, as an engine would return them."""
        prompt, version = lease["prompt"], lease["version"]
        seed = hashlib.sha256(f"{prompt}/{version}".encode()).digest()
        token_ids = [byte for byte in seed[: 8 + seed[0] % 16]]
        return {
            "prompt": prompt,
            "version": version,
            "completion": f"rollout of prompt {prompt} on v{version}",
            "token_ids": token_ids,
            "logprobs": [-(byte / 256) for byte in token_ids],
        }

    # --- The protocol. ---

    def register(self):
        body = {
            "actor": self.actor,
            "region": self.region,
            "can_relay": False,
            "active": self.active,
            "staged": self.staged,
        }
        answer = self.hub.call("POST", "/v1/register", self.fleet_token, body)
        self.token = answer["token"]
        log(f"registered as actor {self.actor} on v{self.active}")
        self.follow(answer)

    def actor_call(self, path, body):
        """A call with the actor's token; a hub that forgot the actor (timed out,
        restarted from an older state, token rotated) gets a new registration."""
        for _ in range(2):
            try:
                return self.hub.call("POST", path, self.token, body)
            except HubError as error:
                if error.status not in (401, 404):
                    raise
                log(f"{path}: {error.message}; registering again")
                self.register()
        raise RuntimeError(f"{path}: refused even after registering again")

    def follow(self, readiness):
        """Acts on a readiness answer (`ready` or `catch_up`)."""
        if readiness["kind"] == "catch_up":
            self.catch_up(readiness["target"])

    def catch_up(self, target):
        """Brings the weights to `target`: stages the next version's delta, or replays
        a longer chain from the store, then reports the versions."""
        if target == self.active + 1:
            self.staged = target
        else:
            self.active, self.staged = target, None
        self.weights_hash(target)
        log(f"caught up: active v{self.active}, staged {self.staged}")
        self.report_versions()

    def activate(self, version):
        """Applies the staged delta at a batch boundary (a Commit)."""
        if self.staged != version:
            raise RuntimeError(f"Commit(v{version}) without v{version} staged")
        self.active, self.staged = version, None
        log(f"activated v{version}")
        self.report_versions()

    def report_versions(self):
        body = {"actor": self.actor, "active": self.active, "staged": self.staged}
        self.follow(self.actor_call("/v1/versions", body))

    def submit(self, leases):
        results = []
        for lease in leases:
            payload = self.generate(lease)
            results.append(
                {
                    "lease": lease["lease"],
                    "version": lease["version"],
                    "weights_hash": self.weights_hash(lease["version"]),
                    "tokens": len(payload["token_ids"]),
                    "payload": payload,
                }
            )
        answer = self.actor_call(
            "/v1/submit", {"actor": self.actor, "results": results}
        )
        for lease, outcome in zip(leases, answer["outcomes"]):
            if outcome["status"] == "accepted":
                self.accepted += 1
                print(f"accepted step={lease['lease']['step']} prompt={outcome['prompt']}")
            else:
                print(f"rejected prompt={lease['prompt']} reason={outcome['reason']}")
            sys.stdout.flush()

    def done(self):
        return self.results_wanted and self.accepted >= self.results_wanted

    def run(self):
        self.register()
        while not self.done():
            if self.preempted.is_set():
                # Results are submitted as soon as they exist, so nothing is held.
                self.actor_call("/v1/preempt", {"actor": self.actor})
                log("preempted: the hub is told, and nothing is held")
                return
            answer = self.actor_call("/v1/claim", {"actor": self.actor})
            kind = answer["kind"]
            if kind == "work":
                if answer["commit"] is not None:
                    self.activate(answer["commit"])
                if answer["leases"]:
                    self.submit(answer["leases"])
                else:
                    time.sleep(self.poll_s)
            elif kind == "catch_up":
                self.catch_up(answer["target"])
            elif kind == "leaving":
                # Another process of this actor sent a preemption notice.
                log(f"preempted; the machine goes in {answer['leaving_in_ms']} ms")
                return
            elif kind == "no_open_step":
                time.sleep(self.poll_s)
            else:
                raise RuntimeError(f"unknown claim answer {answer!r}")
        self.actor_call("/v1/leave", {"actor": self.actor})
        log(f"left after {self.accepted} accepted results")


def log(message):
    print(f"worker: {message}", file=sys.stderr, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hub", required=True, help="the hub's URL, http://host:port")
    parser.add_argument("--actor", type=int, required=True, help="this actor's id")
    parser.add_argument("--region", default="local")
    parser.add_argument("--active", type=int, default=1, help="version of the weights")
    parser.add_argument(
        "--results", type=int, default=0, help="leave after this many accepted (0: never)"
    )
    parser.add_argument("--poll-ms", type=int, default=250, help="pause when idle")
    parser.add_argument("--timeout-s", type=float, default=90, help="per request")
    args = parser.parse_args()
    fleet_token = os.environ.get("AURORA_TOKEN")
    if not fleet_token:
        sys.exit("error: set the fleet token in AURORA_TOKEN")
    worker = Worker(args, fleet_token)
    signal.signal(signal.SIGTERM, lambda *_: worker.preempted.set())
    worker.run()


if __name__ == "__main__":
    main()
