"""A dense reward for the correlation test: a random policy earns it on ~1 completion in 4."""


def digit_first(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the completion starts with a digit (any digit)."""
    return 1.0 if completion[:1].isdigit() else 0.0
