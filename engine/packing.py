"""Packing samples into a `TransportBatch`: rows of `seq_len`, grouped into micro-batches."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from grpod.engine.batch import TransportBatch
from grpod.engine.errors import EngineError


@dataclass(frozen=True)
class Sample:
    """One prompt + completion, target-aligned: `trainable[p]` marks completion token p."""

    tokens: list[int]
    prompt_len: int
    advantage: float
    sampler_logprobs: list[float]  # one per completion token
    group: int


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per row: longest first, each into the first row it fits."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def pack(
    samples: list[Sample],
    *,
    seq_len: int,
    micro_batch_rows: int,
    pack_rows: bool,
    pad_token_id: int,
    rewards: torch.Tensor,
    step: int,
    config_digest: str,
    sequence_chunks: int = 1,
    meta: dict | None = None,
) -> TransportBatch:
    """Lay samples into rows (first-fit decreasing, or one per row), rows into micros."""
    lengths = [len(s.tokens) for s in samples]
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise EngineError(f"sample {i}: {n} tokens do not fit seq_len {seq_len}")
        if samples[i].prompt_len < 1:
            raise EngineError(f"sample {i}: an empty prompt leaves nothing to score token 0")
    rows = (
        first_fit_decreasing(lengths, seq_len) if pack_rows else [[i] for i in range(len(samples))]
    )
    micros = -(-len(rows) // micro_batch_rows)
    shape = (micros * micro_batch_rows, seq_len)
    size = shape[0] * seq_len
    # host lists filled slice by slice, then one tensor per field (no per-sample tensors)
    input_ids, position_ids = [pad_token_id] * size, [0] * size
    loss_mask, advantages, sampler_lp = [False] * size, [0.0] * size, [0.0] * size
    sample_ids, group_ids = [-1] * size, [-1] * size
    for r, members in enumerate(rows):
        at = r * seq_len
        for i in members:
            s, n = samples[i], lengths[i]
            start, end = at + s.prompt_len, at + n
            if len(s.sampler_logprobs) != n - s.prompt_len:
                raise EngineError(
                    f"sample {i}: {len(s.sampler_logprobs)} sampler logprobs for "
                    f"{n - s.prompt_len} completion tokens"
                )
            input_ids[at:end] = s.tokens
            position_ids[at:end] = range(n)
            loss_mask[start:end] = [True] * (end - start)
            advantages[start:end] = [s.advantage] * (end - start)
            sampler_lp[start:end] = s.sampler_logprobs
            sample_ids[at:end] = [i] * n
            group_ids[at:end] = [s.group] * n
            at = end

    def fold(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).reshape(micros, micro_batch_rows, seq_len)

    return TransportBatch(
        input_ids=fold(input_ids, torch.int64),
        position_ids=fold(position_ids, torch.int64),
        loss_mask=fold(loss_mask, torch.bool),
        advantages=fold(advantages, torch.float32),
        sampler_logprobs=fold(sampler_lp, torch.float32),
        sample_ids=fold(sample_ids, torch.int32),
        group_ids=fold(group_ids, torch.int32),
        rewards=rewards.float(),
        sample_group_ids=torch.tensor([s.group for s in samples], dtype=torch.int32),
        completion_lengths=torch.tensor(
            [n - s.prompt_len for s, n in zip(samples, lengths)], dtype=torch.int32
        ),
        step=step,
        config_digest=config_digest,
        sequence_chunks=sequence_chunks,
        meta=meta or {},
    )


@functools.lru_cache(maxsize=64)
def causal_and_eye(
    width: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[width, width]` bool lower-triangular and identity masks, built once per width (read
    only: callers combine them into new tensors). `tril` opens a parallel region even for one
    small matrix, which on a busy machine waits for a second core to be scheduled: measured
    ~8 ms per call there, against ~5 us on an idle one."""
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return causal, torch.eye(width, dtype=torch.bool, device=device)


def attention_mask(sample_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask `[rows, 1, seq, seq]` bool from `sample_ids: [rows, seq]`.

    A token attends to earlier tokens of its own sample only; padding attends to itself so
    no softmax row is empty.
    """
    seq = sample_ids.shape[-1]
    same = sample_ids[:, :, None] == sample_ids[:, None, :]
    causal, eye = causal_and_eye(seq)
    return ((same & causal) | eye)[:, None]


@dataclass(frozen=True)
class TrunkLayout:
    """What one micro runs through the trunk, and where each micro position's state comes from.

    Siblings of a GRPO group carry identical prompts, and a sample's last token is never
    read (nothing after it is scored). The trunk therefore runs each distinct prompt of a
    micro once, followed by every sample's completion tokens up to the one before its last
    trainable token; a completion attends to its shared prompt and to itself only, which is
    exactly what it sees in its own packed row. `source[p]` is the row of the flattened
    trunk output holding the state of micro position p (a final all-zero row for positions
    that are not run: padding and tokens after a sample's last scoring position).
    """

    input_ids: torch.Tensor  # [rows', width] int64
    position_ids: torch.Tensor  # [rows', width] int64
    attention_mask: torch.Tensor  # [rows', 1, width, width] bool
    source: torch.Tensor  # [rows * seq] int64 into the flattened [rows' * width + 1, H] output
    tokens: int  # real (non-padding) tokens run


@dataclass(frozen=True)
class UnitScan:
    """The units of a stretch of rows (`units` None: it must run as laid out), the samples
    it holds, and its `[rows, seq]` sample ids."""

    units: dict[tuple, list[list[int]]] | None
    samples: frozenset[int]
    sample_ids: torch.Tensor

    def used_rows(self) -> int:
        """Rows holding any sample (what a plain layout runs)."""
        return int((self.sample_ids >= 0).any(-1).sum())


def scan_units(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    ids: list[int] | None = None,
    pos: list[int] | None = None,
) -> UnitScan:
    """One pass over `[rows, seq]` rows: each sample's span and first / last trainable
    position, grouped into units, one per distinct (prompt tokens, prompt positions), members
    in row order as `[start, first, last]` flat positions."""
    ids = input_ids.reshape(-1).tolist() if ids is None else ids
    pos = position_ids.reshape(-1).tolist() if pos is None else pos
    sid = sample_ids.reshape(-1)
    values, counts = torch.unique_consecutive(sid, return_counts=True)
    spans: dict[int, list[int]] = {}
    at = 0
    plain = False
    for s, n in zip(values.tolist(), counts.tolist()):
        if s >= 0:
            if s in spans:  # a sample in two places is not a packed batch: run it as laid out
                plain = True
            spans[s] = [at, at + n, -1, -1]
        at += n
    samples = frozenset(spans)
    if plain:
        return UnitScan(None, samples, sample_ids)
    owner = sid.tolist()
    for p in loss_mask.reshape(-1).nonzero().squeeze(-1).tolist():
        span = spans.get(owner[p])
        if span is None:
            return UnitScan(None, samples, sample_ids)
        if span[2] < 0:
            span[2] = p
        span[3] = p
    units: dict[tuple, list[list[int]]] = {}
    for start, _, first, last in spans.values():
        if first < 0:
            continue  # nothing scored in this sample: it is not run at all
        if first == start:  # token p scored by p-1 outside the sample: keep the plain layout
            return UnitScan(None, samples, sample_ids)
        key = (tuple(ids[start:first]), tuple(pos[start:first]))
        units.setdefault(key, []).append([start, first, last])
    return UnitScan(units, samples, sample_ids)


def joint_slots(scans: list[UnitScan], seq: int) -> int:
    """`trunk_layout(...).input_ids.numel()` of the scans' rows stacked in order, without
    building it: what the trainer needs to decide which micros share one trunk pass."""
    samples = [scan.samples for scan in scans]
    merged: dict[tuple, list[int]] = {}  # key -> [prompt length, member tokens]
    packed = all(scan.units is not None for scan in scans)
    if packed and sum(map(len, samples)) == len(frozenset().union(*samples)):
        for scan in scans:
            for key, members in scan.units.items():  # type: ignore[union-attr]
                start, first, _ = members[0]
                entry = merged.setdefault(key, [first - start, 0])
                entry[1] += sum(last - m_first for _, m_first, last in members)
    if not merged:  # the plain layout: every used row as packed
        return max(1, sum(scan.used_rows() for scan in scans)) * seq
    lengths = [prompt + members for prompt, members in merged.values()]
    width, placed = _tightest_rows(lengths, max(seq, *lengths))
    return len(placed) * width


def trunk_layout(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    loss_mask: torch.Tensor,
) -> TrunkLayout:
    """The shared-prompt, tail-free trunk layout of one micro (`[rows, seq]` inputs)."""
    rows, seq = input_ids.shape
    ids = input_ids.reshape(-1).tolist()
    pos = position_ids.reshape(-1).tolist()
    units = scan_units(input_ids, position_ids, sample_ids, loss_mask, ids, pos).units
    if not units:
        return _plain_layout(input_ids, position_ids, sample_ids)
    lengths = [
        (first - start) + sum(m_last - m_first for _, m_first, m_last in members)
        for members in units.values()
        for start, first, _ in members[:1]
    ]
    width, placed = _tightest_rows(lengths, max(seq, *lengths))
    flat = len(placed) * width
    c_ids, c_pos = [0] * flat, [0] * flat
    c_unit, c_member = [-1] * flat, [-1] * flat
    source = [flat] * (rows * seq)  # the zero row appended after the trunk
    unit_list = list(units.values())
    member_no = 0
    for r, unit_indices in enumerate(placed):
        at = r * width
        for u in unit_indices:
            members = unit_list[u]
            start, first, _ = members[0]
            prompt_at = at
            for q in range(start, first):
                c_ids[at], c_pos[at], c_unit[at] = ids[q], pos[q], u
                at += 1
            for m_start, m_first, m_last in members:
                for k, q in enumerate(range(m_start, m_first)):
                    source[q] = prompt_at + k
                for q in range(m_first, m_last):
                    c_ids[at], c_pos[at], c_unit[at], c_member[at] = ids[q], pos[q], u, member_no
                    source[q] = at
                    at += 1
                member_no += 1
    shape = (len(placed), width)
    unit = torch.tensor(c_unit).reshape(shape)
    member = torch.tensor(c_member).reshape(shape)
    same_unit = unit[:, :, None] == unit[:, None, :]
    visible = (member[:, None, :] == -1) | (member[:, :, None] == member[:, None, :])
    causal, eye = causal_and_eye(width)
    return TrunkLayout(
        input_ids=torch.tensor(c_ids).reshape(shape),
        position_ids=torch.tensor(c_pos).reshape(shape),
        attention_mask=((same_unit & visible & causal) | eye)[:, None],
        source=torch.tensor(source),
        tokens=sum(lengths),
    )


def _tightest_rows(lengths: list[int], widest: int) -> tuple[int, list[list[int]]]:
    """A row width in `[max(lengths), widest]` and its first-fit-decreasing packing with few
    slots (rows x width): every slot runs through every matmul, padding included.

    From the row count of the widest rows (the fewest) up to 8 more rows, it takes for each
    count the narrowest width (within 8 of the average) whose packing needs no more rows.
    """
    total, longest = sum(lengths), max(lengths)
    placed = first_fit_decreasing(lengths, widest)
    best = (len(placed) * widest, widest, placed)
    for rows in range(len(placed), len(placed) + 9):
        start = max(longest, -(-total // rows))
        for width in range(start, min(widest, start + 8)):
            if rows * width >= best[0]:
                break
            placed = first_fit_decreasing(lengths, width)
            if len(placed) <= rows:
                best = (len(placed) * width, width, placed)
                break
    return best[1], best[2]


def _plain_layout(
    input_ids: torch.Tensor, position_ids: torch.Tensor, sample_ids: torch.Tensor
) -> TrunkLayout:
    """Every used row as packed (trailing all-padding rows skipped)."""
    rows, seq = input_ids.shape
    used = max(1, int((sample_ids >= 0).any(-1).sum()))
    source = torch.arange(rows * seq)
    source[used * seq :] = used * seq  # the zero row
    return TrunkLayout(
        input_ids=input_ids[:used],
        position_ids=position_ids[:used],
        attention_mask=attention_mask(sample_ids[:used]),
        source=source,
        tokens=int((sample_ids >= 0).sum()),
    )
