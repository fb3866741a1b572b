"""Rewards of the SmolLM2 arithmetic campaign (examples/smollm2-arith).

`correct` reads the completion's last number, so a chatty answer that ends on the sum
("3 + 4 = 7") scores and one cut off by the token budget mid-sentence does not: the base
model gets some right, and the policy learns to reach the answer within the budget.
`number_only` rewards the format the system prompt asks for: the bare number.
"""

import re

NUMBER = re.compile(r"-?\d+")


def correct(prompt: str, completion: str, answer: str) -> float:
    numbers = NUMBER.findall(completion)
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def number_only(prompt: str, completion: str, answer: str) -> float:
    return 1.0 if NUMBER.fullmatch(completion.strip().rstrip(".")) else 0.0
