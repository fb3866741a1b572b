"""How a replayed number is compared with its record: bit-exact in the recorded topology,
within REPLAY_RTOL in another (the same sums in another reduction order)."""

from __future__ import annotations

import math
import struct

# another topology, another reduction order: measured 6e-8 relative on the grad norm of a
# 2-rank step replayed in one process (CPU, gloo); a real divergence is orders beyond
REPLAY_RTOL = 1e-6


def bit_equal(a: float | int, b: float | int) -> bool:
    """Bit equality of two numbers; any NaN equals any NaN (the record keeps no payload)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)


def close(a: float | int, b: float | int, rtol: float = REPLAY_RTOL) -> bool:
    """|a - b| <= rtol * max(|a|, |b|) (NaN only with NaN, infinities only when equal)."""
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return bit_equal(a, b)
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def topology(recorded: int, replayed: int, rank: int | None, steps: int) -> str:
    """Why the replay runs in another reduction order than the record ('' when it does not)."""

    def name(world: int) -> str:
        return "1 process" if world == 1 else f"{world} ranks"

    if rank is not None:  # the rank's own part: its own sums, unless other steps came first
        if steps == 1:
            return ""
        return (
            f"rank {rank}'s part, after {steps - 1} steps recorded on {name(recorded)} "
            "replayed in 1 process: reduction order differs"
        )
    if recorded == replayed:
        return ""
    return f"recorded on {name(recorded)}, replayed in {name(replayed)}: reduction order differs"
