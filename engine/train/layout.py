"""How a transport batch runs through the trunk: `TrunkLayout`, and which micros share a pass.

Row packing (engine/data/packing.py) fixes what the loss sees: rows of `seq_len`, sample-isolated.
The trunk need not run those rows as they are: siblings of a GRPO group share their prompt,
and a sample's last token is never read. `trunk_layout` runs each distinct prompt once and
each completion without its unread tail; `trunk_passes` groups consecutive micros whose joint
layout fits one micro's activation budget into one forward and one backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from grpod.engine.batch import TransportBatch
from grpod.engine.data.packing import attention_mask, causal_and_eye, first_fit_decreasing
from grpod.engine.model.parallel import is_replicated, is_sharded
from grpod.engine.model.policy import compute_context
from grpod.engine.model.trunk import trunk_hidden
from grpod.engine.train.kvmask import cell_prompt_lengths, restrict_to_cache


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


def trunk_passes(batch: TransportBatch, joint: bool) -> Iterator[tuple[list[int], TrunkLayout]]:
    """Consecutive micros whose joint trunk layout fits one micro's `rows * seq` slots.

    Shared prompts and dropped tails shrink a micro's trunk work, so several micros often
    fit the activation budget of one; they then run as one forward and one backward (the
    loss, counter and trace stay per micro and per chunk, in order). `joint` is FP32 only:
    under bf16 autocast a joint backward would sum the micros' weight gradients inside a bf16
    matmul, so there each micro runs alone and accumulates into the FP32 grads.
    """
    if not joint:
        for micro in range(batch.num_micros):
            yield [micro], micro_layout(batch, [micro])
        return
    seq = batch.seq_len
    budget = batch.input_ids.shape[1] * seq
    everything = list(range(batch.num_micros))
    layout = micro_layout(batch, everything)
    if layout.input_ids.numel() <= budget:  # the common case: one pass, one layout
        yield everything, layout
        return
    # each micro scanned once; a candidate group's size comes from its scans, and only
    # the groups that run are laid out
    scans = [
        scan_units(
            batch.input_ids[m], batch.position_ids[m], batch.sample_ids[m], batch.loss_mask[m]
        )
        for m in everything
    ]
    micros: list[int] = []
    for micro in everything:
        if micros and joint_slots(scans[micros[0] : micro + 1], seq) > budget:
            yield micros, micro_layout(batch, micros)
            micros = []
        micros.append(micro)
    if micros:
        yield micros, micro_layout(batch, micros)


def micro_layout(batch: TransportBatch, micros: list[int]) -> TrunkLayout:
    """The joint trunk layout of consecutive `micros` (their rows stacked); after a `lastrec`
    rollout its mask is what the sampler's cache kept (engine/train/kvmask.py; h2o trains on full
    attention)."""
    span = slice(micros[0], micros[-1] + 1)
    seq = batch.seq_len
    rows = [
        getattr(batch, name)[span].reshape(-1, seq)
        for name in ("input_ids", "position_ids", "sample_ids", "loss_mask")
    ]
    layout = trunk_layout(*rows)
    if batch.kv_cache is None or batch.kv_cache.policy != "lastrec":
        return layout
    shape = layout.position_ids.shape
    prompt_len = cell_prompt_lengths(layout.source, shape, *rows[1:])
    mask = restrict_to_cache(layout.attention_mask, layout.position_ids, prompt_len, batch.kv_cache)
    return replace(layout, attention_mask=mask)


def run_trunk(
    model: torch.nn.Module, layout: TrunkLayout, dtype: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trunk states `[positions run + 1, H]` (last row zeros) and the layout's source, on
    `device`: `hidden[source[p]]` is the state of micro position p.

    An FSDP2-sharded model runs the Hugging Face forward through FSDP's hooks; the DDP
    trunk (`Parallel.replicate`) runs `trunk_hidden` through DDP's forward, and one process
    runs `trunk_hidden` itself.
    """
    input_ids = layout.input_ids.to(device)
    position_ids = layout.position_ids.to(device)
    mask = layout.attention_mask.to(device)
    with compute_context(dtype, device):
        if is_sharded(model):  # through FSDP's hooks: they gather and reduce the shards
            hidden = model.grpod_trunk(input_ids, position_ids, mask)
        elif is_replicated(model):  # through DDP's forward: its reducer sees the backward
            hidden = model(input_ids, position_ids, mask)
        else:
            hidden = trunk_hidden(model, input_ids, position_ids, mask, dtype)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[-1])])
    return hidden, layout.source.to(device)


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
