"""A GRPO-style loop for the model-family tests (mixture-of-experts, LoRA): real rollouts
from the actor's engine, a real update of the trainer's model, each version published and
taken by the actor at its next claim (which checks it as the actor's ``verify`` says)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from test_engines import next_work

import aurora_rl
from aurora_rl.engines import Sampling

#: Four prompts of three tokens; the reward is the share of even tokens in a completion.
PROMPTS = {prompt: [1 + prompt, 7, 100 + prompt] for prompt in range(4)}
GROUP = 4


def verifying_actor(trainer: aurora_rl.Trainer, engine: object, weights: dict[str, torch.Tensor]) -> aurora_rl.Actor:
    """An actor on ``engine``, which holds ``weights`` (the trainer's version 0), reading
    every version back in full before it serves it."""
    return aurora_rl.Actor(engine, id=1, region="eu", weights=weights, version=0, control=trainer.control_address,
                           upstreams=[trainer.transport_address], token=trainer.token, insecure_plaintext=True,
                           verify="full")


def grpo_steps(
    trainer: aurora_rl.Trainer,
    actor: aurora_rl.Actor,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    export: Callable[[torch.nn.Module], dict[str, torch.Tensor]],
    steps: int,
) -> list[tuple[aurora_rl.Published, dict[str, torch.Tensor]]]:
    """``steps`` steps from the trainer's version 0, which the actor serves; returns each
    version published after them, with the tensors published. The actor ends on the last."""
    published = []
    for step in range(steps):
        trainer.open_step(list(PROMPTS))
        trainer.commit()
        work = next_work(actor)
        assert work.version == step
        # A group per prompt, each sample drawn with its own seed.
        groups = [
            [actor.engine.generate([PROMPTS[lease.prompt]], Sampling(max_tokens=6, temperature=1.0, seed=100 * step + i))[0]
             for i in range(GROUP)]
            for lease in work.leases
        ]
        actor.submit(work, [(lease, [c.token_ids for c in group], 6 * GROUP) for lease, group in zip(work.leases, groups)])
        results = trainer.wait_step(timeout=120)
        assert sorted(r.prompt for r in results.rollouts) == list(PROMPTS)
        loss = torch.zeros(())
        for rollout in results.rollouts:
            samples = torch.tensor([PROMPTS[rollout.prompt] + sample for sample in rollout.payload])
            rewards = (samples[:, 3:] % 2 == 0).float().mean(dim=1)
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            logprobs = torch.log_softmax(model(input_ids=samples).logits[:, 2:-1].float(), dim=-1)
            loss = loss - (advantages * logprobs.gather(2, samples[:, 3:].unsqueeze(2)).squeeze(2).sum(dim=1)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        weights = export(model)
        published.append((trainer.publish(weights), weights))
        assert published[-1][0].version == step + 1
    trainer.open_step([len(PROMPTS) + 1])
    trainer.commit()
    work = next_work(actor)
    assert (work.version, work.weights_hash) == (steps, published[-1][0].weights_hash)
    return published
