"""One call of a reward function: a real number back within `reward_timeout_seconds`, or a
`RewardError` naming the function, the sample, the prompt and the reason. Preflight, the
run and the held-out eval all call rewards through `call_reward`; what a NaN or infinite
value is differs between them, and each says which `NonFinite` policy it takes.

Any real scalar is a number: Python's int and float, numpy's scalar types (float32 included),
and 0-d numpy arrays and torch tensors of a real dtype; bool and complex are
not. The time limit is SIGALRM (an interval timer) on the main thread, where the daemon's loop
runs: it interrupts Python code (a loop, `time.sleep`, a blocking socket read) but not a C
call that never returns to the interpreter; off the main thread there is no limit.
"""

from __future__ import annotations

import enum
import math
import numbers
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from grpod.base.oneline import one_line
from grpod.engine.errors import RewardError


class NonFinite(enum.Enum):
    """What a reward's NaN or infinite value is (a real number all the same, unlike a string).

    - `REFUSE`: bad input, a `RewardError` (exit 2). Preflight: a reward that is not finite on
      the first prompt with its own answer would poison every step; nothing is created.
    - `PASS`: the value itself. The run: a step fault, not the input's; the step's rewards
      carry it to the `finite` guard, which flushes the step (weights untouched, the step
      and its batch recorded), never an exit. The eval: the mean it enters is NaN, stored
      and published as that eval's value (no warning, no stop; an eval trains nothing).
    """

    REFUSE = "refuse"
    PASS = "pass"


class RewardTimeout(BaseException):
    """Raised into a reward past its time limit; a BaseException, so that the function's own
    `except Exception` does not swallow it."""


def real_value(value: Any) -> float | None:
    """`value` as a float when it is a real scalar (see the module doc), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):  # numpy registers its integer and floating types
        return float(value)
    if tuple(getattr(value, "shape", (1,))) == () and hasattr(value, "item"):  # 0-d array
        dtype = str(getattr(value, "dtype", ""))
        return None if "complex" in dtype or "bool" in dtype else real_value(value.item())
    return None


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `RewardTimeout` in this thread after `seconds` (0, or off the main thread: none)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise RewardTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call_reward(
    fn: Callable[[str, str, str], Any],
    name: str,
    prompt: str,
    completion: str,
    answer: str,
    *,
    where: str,
    sample: int,
    non_finite: NonFinite,
    timeout_seconds: float = 0.0,
) -> float:
    """`fn(prompt, completion, answer)` as a float; a NaN or inf as `non_finite` says (the
    caller's decision, see `NonFinite`); `where` names the sample in errors ("task t.jsonl:
    ... on sample 5")."""
    about = f"on sample {sample} (prompt {prompt[:40]!r})"
    try:
        with time_limit(timeout_seconds):
            value = fn(prompt, completion, answer)
    except RewardTimeout:
        raise RewardError(
            f"{where}reward {name} took longer than reward_timeout_seconds "
            f"{timeout_seconds:g} {about}",
            reward=name,
            sample=sample,
        ) from None
    except Exception as exc:
        raise RewardError(
            f"{where}reward {name} raised {about}: {one_line(exc)}", reward=name, sample=sample
        ) from None
    number = real_value(value)
    if number is None:
        raise RewardError(
            f"{where}reward {name} returned {type(value).__name__}, not a number, {about}",
            reward=name,
            sample=sample,
        )
    if non_finite is NonFinite.REFUSE and not math.isfinite(number):
        raise RewardError(
            f"{where}reward {name} returned {number}, not a finite number, {about}",
            reward=name,
            sample=sample,
        )
    return number
