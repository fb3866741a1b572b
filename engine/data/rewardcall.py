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


class _Alarm:
    """The main thread's SIGALRM handler, while `reward_alarm` has it installed."""

    installed = False
    in_call = False  # a reward is running under its time limit: the alarm is its timeout


def _expire(signum: int, frame: Any) -> None:
    if _Alarm.in_call:
        raise RewardTimeout


@contextmanager
def reward_alarm(seconds: float) -> Iterator[None]:
    """SIGALRM's handler, installed once around many rewards' calls (a step's scoring): each
    call then only arms and disarms its timer. Installing a handler costs ~4 us (two
    `signal.signal` calls), arming ~0.6 us: at W1's 128 calls a step, 0.45 ms saved. An
    alarm between two calls raises nothing. A nested or off-main-thread use does nothing."""
    main = threading.current_thread() is threading.main_thread()
    if seconds <= 0 or not main or _Alarm.installed:
        yield
        return
    previous = signal.signal(signal.SIGALRM, _expire)
    _Alarm.installed = True
    try:
        yield
    finally:
        _Alarm.installed = False
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `RewardTimeout` in this thread after `seconds` (0, or off the main thread: none)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    with reward_alarm(seconds):  # installed here unless a caller holds it for its batch
        _Alarm.in_call = True
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _Alarm.in_call = False


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
    try:
        with time_limit(timeout_seconds):
            value = fn(prompt, completion, answer)
    except RewardTimeout:
        raise RewardError(
            f"{where}reward {name} took longer than reward_timeout_seconds "
            f"{timeout_seconds:g} {_about(sample, prompt)}",
            reward=name,
            sample=sample,
        ) from None
    except Exception as exc:
        raise RewardError(
            f"{where}reward {name} raised {_about(sample, prompt)}: {one_line(exc)}",
            reward=name,
            sample=sample,
        ) from None
    number = real_value(value)
    if number is None:
        raise RewardError(
            f"{where}reward {name} returned {type(value).__name__}, not a number, "
            f"{_about(sample, prompt)}",
            reward=name,
            sample=sample,
        )
    if non_finite is NonFinite.REFUSE and not math.isfinite(number):
        raise RewardError(
            f"{where}reward {name} returned {number}, not a finite number, "
            f"{_about(sample, prompt)}",
            reward=name,
            sample=sample,
        )
    return number


def _about(sample: int, prompt: str) -> str:
    """The sample an error names (made only when one is raised: a step scores 128 calls)."""
    return f"on sample {sample} (prompt {prompt[:40]!r})"
