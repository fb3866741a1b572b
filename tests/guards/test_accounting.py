from grpod.guards import Action
from grpod.guards.accounting import AccountingGuard
from grpod.guards.config import AccountingConfig
from tests.guards.helpers import batch, report


def guard(**cfg: object) -> AccountingGuard:
    return AccountingGuard(AccountingConfig(**cfg))


def test_strict_passes_an_exact_count() -> None:
    assert guard().after(batch(), report(valid_tokens=10, expected_valid_tokens=10)) == []


def test_zero_valid_tokens_flush_in_both_modes() -> None:
    for mode in ("strict", "nonzero"):
        (finding,) = guard(mode=mode).after(batch(), report(valid_tokens=0))
        assert finding.action is Action.FLUSH and finding.evidence["valid_tokens"] == 0


def test_zero_without_micros_is_not_an_accounting_fault() -> None:
    empty = report(valid_tokens=0, expected_valid_tokens=0, num_micros=0)
    assert guard().after(batch(), empty) == []


def test_strict_flushes_an_off_by_one_count_and_nonzero_lets_it_through() -> None:
    off = report(valid_tokens=9, expected_valid_tokens=10)
    (finding,) = guard().after(batch(), off)
    assert finding.action is Action.FLUSH and "9 != expected 10" in finding.message
    assert guard(mode="nonzero").after(batch(), off) == []
    assert guard(mode="nonzero").after(batch(), report(valid_tokens=1)) == []  # boundary: 1


def test_action_is_configurable() -> None:
    (finding,) = guard(action="HALT").after(batch(), report(valid_tokens=0))
    assert finding.action is Action.HALT


def test_a_global_count_that_is_not_the_ranks_expected_sum_flushes() -> None:
    local = dict(valid_tokens=10, expected_valid_tokens=10)
    good = report(**local, global_valid_tokens=25, rank_expected_valid_tokens=[10, 15])
    assert guard().after(batch(), good) == []
    # a peer rank's count lost a token: this rank's own count is right, the global one is not
    bad = report(**local, global_valid_tokens=24, rank_expected_valid_tokens=[10, 15])
    (finding,) = guard().after(batch(), bad)
    assert finding.action is Action.FLUSH and "global valid_tokens 24 != 25" in finding.message
    assert finding.evidence["expected_global"] == 25
    assert guard(mode="nonzero").after(batch(), bad) == []
