import torch

from grpod.guards import Action, GuardPolicy
from grpod.guards.config import ReorderConfig
from grpod.guards.reorder import ReorderGuard
from tests.guards.helpers import batch

# 3 micros of one 8-token row, 2 chunks of 4: chunk-0 valid counts 1, 3, 0
MIXED = [[0, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0]]
ALL_LONG = [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1, 0]]


def active_guard() -> ReorderGuard:
    return ReorderGuard(ReorderConfig())


def test_the_policy_runs_the_reorder_only_for_a_per_micro_counter() -> None:
    b = batch(MIXED, chunks=2)
    out, findings, skip = GuardPolicy().before(b, per_micro_accounting=False)
    assert out is b and not skip and not [f for f in findings if f.guard == "reorder"]
    out, findings, skip = GuardPolicy().before(b, per_micro_accounting=True)
    assert out.micro_order == [0, 2, 1] and not skip and findings[0].guard == "reorder"


def test_the_micro_with_the_largest_chunk0_count_runs_last() -> None:
    b = batch(MIXED, chunks=2)
    assert b.chunk_valid_counts()[:, 0].tolist() == [1, 3, 0]
    out, (finding,) = active_guard().before(b)
    assert out.micro_order == [0, 2, 1]
    assert out.chunk_valid_counts()[-1, 0] == 3
    assert torch.equal(out.loss_mask[-1], b.loss_mask[1])
    assert finding.action is Action.PASS and finding.evidence["moved_micro"] == 1


def test_already_last_is_not_reordered() -> None:
    b = batch([MIXED[2], MIXED[1]], chunks=2)
    out, findings = active_guard().before(b)
    assert out is b and findings == []


def test_counts_chunk0_on_the_flattened_micro() -> None:
    # 2 rows of 4 per micro, 2 chunks of the flattened 8 tokens: chunk 0 is row 0. Per row,
    # micro 1 would win (its row 1 starts with 2 tokens); flattened, micro 0 does (1 vs 0).
    b = batch([[0, 0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0]], chunks=2, rows=2)
    assert b.chunk_valid_counts()[:, 0].tolist() == [1, 0]
    out, _ = active_guard().before(b)
    assert out.micro_order == [1, 0]


def test_all_long_batch_is_skip_fast_and_counted() -> None:
    guard = active_guard()
    for n in (1, 2):
        out, (finding,) = guard.before(batch(ALL_LONG, chunks=2))
        assert out is None and finding.action is Action.FLUSH
        assert guard.skip_fast_total == n and finding.evidence["skip_fast_total"] == n
    assert guard.state_dict()["skip_fast_total"] == 2


def test_single_micro_with_chunk0_tokens_stays() -> None:
    out, findings = active_guard().before(batch([MIXED[1]], chunks=2))
    assert out is not None and findings == []
