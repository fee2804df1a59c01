"""The task: two-digit addition with a verifiable reward, and its character tokenizer.

A prompt id names a problem; the trainer posts ids, every actor maps them to the same
tokens. Prompts are "ab+cd=" with zero-padded operands, the answer is the three-digit sum
and an end token. A fifth of the pairs are held out for evaluation and never trained on.
"""

from __future__ import annotations

import random

CHARACTERS = "0123456789+="
EOS = len(CHARACTERS)
PAD = EOS + 1
VOCAB_SIZE = 16
PROMPT_TOKENS = 6
#: Three digits and the end token.
ANSWER_TOKENS = 4


def encode(text: str) -> list[int]:
    return [CHARACTERS.index(c) for c in text]


def held_out(a: int, b: int) -> bool:
    return (a + 7 * b) % 5 == 0


def problem(prompt_id: int) -> tuple[int, int]:
    """The training problem a prompt id names (never a held-out pair)."""
    rng = random.Random(prompt_id * 2654435761 % 2**32)
    while True:
        a, b = rng.randrange(100), rng.randrange(100)
        if not held_out(a, b):
            return a, b


def held_out_problems(count: int) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(100) for b in range(100) if held_out(a, b)]
    return random.Random(0).sample(pairs, count)


def prompt(a: int, b: int) -> list[int]:
    return encode(f"{a:02d}+{b:02d}=")


def answer(a: int, b: int) -> list[int]:
    return encode(f"{a + b:03d}") + [EOS]


def reward(a: int, b: int, completion: list[int]) -> float:
    """1 for exactly the answer (and its end token), else 0."""
    return 1.0 if list(completion[:ANSWER_TOKENS]) == answer(a, b) else 0.0
