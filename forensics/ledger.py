"""The prompt ledger: what became of every prompt of the data stream (schema 0007_prompt_ledger).

A prompt is named by its position in the run's data stream, `prompt_id` = generation x
prompts_per_step + its group (as `replay --by-sample` names it); with a fixed prompt list of
N prompts it is in epoch `prompt_id // N`, at task row `epoch_order(N, seed, epoch)[prompt_id
% N]` (engine/data/tasks.py). Each decided step writes one row per prompt of its batch, in the
step's own commit (forensics/recorder.py: no transaction of its own), with its fate:

- `trained`: the step's update was applied.
- `flushed`: a guard flushed the step. Its prompts are dropped for the epoch, not requeued:
  what a step trains is a function of its number alone (replay, ranks and resume rely on it),
  and a batch a guard flushed is kept whole in its incident, not spread over later steps.
- `skipped`: flushed without compute (the reorder guard's skip-fast of an all-long batch), or
  a rollout or reward that failed (the run stops; a resume from that step supersedes it).
- `eval`: a prompt of the held-out eval set (`eval_task`), once per evaluation; not part of
  any epoch's coverage.

A rollout dropped as too stale (max_staleness, engine/rollout/ahead.py) is sampled again for
the same step: its prompts keep that step's fate and the row counts the drop in
`stale_drops`. Under torchrun rank 0 records every rank's batch; each row names the rank that
trained its prompt.

Resume: rows are keyed by (epoch, prompt_id) and carry their step. A run restored from the
checkpoint before step c re-runs steps c on, so at its start every row of step >= c (an eval
row: step > c, an eval at c ran after that checkpoint and is not repeated) is marked
`superseded`, and the re-run writes them anew. `grpod fsck` counts the rows that are not
superseded: every prompt of the steps up to the last one is accounted for exactly once per
pass over its generation (`epochs` > 1 trains a generation's prompts at each of its steps).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update

from grpod.engine.data.tasks import epoch_order
from grpod.forensics.models import PromptFate, Run
from grpod.forensics.ranks import rank_columns

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from grpod.engine.batch import TransportBatch
    from grpod.forensics.store import Store

FATES = ("trained", "flushed", "skipped", "eval")
FATE_OF_OUTCOME = {"applied": "trained", "flushed": "flushed", "skipped": "skipped"}
NAMED = 10  # prompts a problem line names (the JSON lists all)


@dataclass(frozen=True)
class LedgerSpec:
    """How a run walks its data stream: the engine's `prompts_per_step`, `epochs` (optimizer
    steps per generation), `seed`, and the task's prompts (None: a generated task)."""

    prompts_per_step: int
    epochs: int = 1
    epoch_size: int | None = None
    seed: int = 0

    def locate(self, prompt_id: int) -> tuple[int, int | None]:
        """`(epoch, task row)` of the stream's prompt `prompt_id` (row None: generated)."""
        if not self.epoch_size:
            return 0, None
        epoch, index = divmod(prompt_id, self.epoch_size)
        return epoch, _order(self.epoch_size, self.seed, epoch)[index]

    def prompt_ids(self, step: int) -> range:
        """The stream positions step `step` trains (its generation's prompts)."""
        first = step // self.epochs * self.prompts_per_step
        return range(first, first + self.prompts_per_step)

    @classmethod
    def of_config(cls, config_json: str, epoch_size: int | None = None) -> LedgerSpec | None:
        """The spec a run's stored config states (None: not a grpod engine's config)."""
        try:
            engine = json.loads(config_json)["engine"]
            return cls(
                int(engine["prompts_per_step"]),
                int(engine.get("epochs", 1)),
                epoch_size,
                int(engine.get("seed", 0)),
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class LedgerRow:
    """One prompt's row (without run_id and recorded_at). The defaults are an eval prompt's:
    in no epoch, at no task row, rank 0, never dropped; a row is written live (not superseded).
    """

    step: int
    fate: str
    prompt_id: int
    epoch: int | None = None
    epoch_size: int | None = None
    task_row: int | None = None
    generation_pass: int = 0
    rank: int = 0
    stale_drops: int = 0
    reason: str = ""
    superseded: bool = False

    def columns(self) -> dict[str, Any]:
        """The row as the table's column values (a shallow copy: `dataclasses.asdict`'s
        recursive deep copy cost the recorder's writer ~0.3 ms a W1 step)."""
        return dict(vars(self))


@lru_cache(maxsize=4)
def _order(total: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(epoch_order(total, seed, epoch))


def step_rows(
    spec: LedgerSpec,
    batch: TransportBatch,
    report: dict[str, Any],
    verdict: dict[str, Any],
    outcome: str,
    stale_drops: int = 0,
) -> list[dict[str, Any]]:
    """The ledger rows of one decided step (without run_id and recorded_at): one per prompt
    (group) of its batch, the global batch under torchrun."""
    groups = batch.sample_group_ids.tolist()
    ranks = rank_columns(report)
    if ranks:
        rank_of: dict[int, int] = {}
        for columns in ranks:
            start = columns["first_sample"]
            for group in groups[start : start + columns["num_samples"]]:
                rank_of.setdefault(group, columns["rank"])
    else:  # one process: rank 0 trained every prompt
        rank_of = dict.fromkeys(groups, 0)
    fate = FATE_OF_OUTCOME.get(outcome, outcome)
    # the step's columns once, each prompt's four on top: a LedgerRow per prompt (a frozen
    # dataclass, ~9 us to build on a slow core) cost the writer ~0.15 ms of a W1 step
    shared = LedgerRow(
        batch.step,
        fate,
        prompt_id=-1,
        epoch_size=spec.epoch_size,
        generation_pass=batch.step % spec.epochs,
        stale_drops=stale_drops,
        reason="" if fate == "trained" else _reason(verdict),
    ).columns()
    first = batch.generation * spec.prompts_per_step
    rows = []
    for group in sorted(rank_of):
        epoch, row = spec.locate(first + group)
        rows.append(
            {
                **shared,
                "prompt_id": first + group,
                "epoch": epoch,
                "task_row": row,
                "rank": rank_of[group],
            }
        )
    return rows


def eval_rows(step: int, samples: int) -> list[dict[str, Any]]:
    """The ledger rows of one held-out evaluation: its `samples` prompts, positions 0.. of
    the eval set (engine/grpo/eval.py)."""
    return [LedgerRow(step, "eval", index).columns() for index in range(samples)]


def _reason(verdict: dict[str, Any]) -> str:
    """The guards behind a step that was not trained (its findings of the highest action)."""
    findings = verdict.get("findings") or []
    order = ["PASS", "WARN", "FLUSH", "HALT"]
    top = max((order.index(f.get("action", "PASS")) for f in findings), default=0)
    names = [
        f"{f['guard']}/{f['kind']}" if f.get("kind") else str(f["guard"])
        for f in findings
        if order.index(f.get("action", "PASS")) == top
    ]
    return ", ".join(dict.fromkeys(names))[:200]


def supersede(session: Session, run_ids: list[str], next_step: int) -> int:
    """A run resumed before step `next_step`: the rows it will write again are superseded
    (training rows of step >= next_step, eval rows of step > next_step); how many."""
    live = (PromptFate.run_id.in_(run_ids), PromptFate.superseded.is_(False))
    trained = (PromptFate.fate != "eval", PromptFate.step >= next_step)
    evals = (PromptFate.fate == "eval", PromptFate.step > next_step)
    count = 0
    for where in (trained, evals):
        result = session.execute(update(PromptFate).where(*live, *where).values(superseded=True))
        count += result.rowcount or 0
    return count


# ------------------------------------------------------------------------------ the check
@dataclass
class LedgerCheck:
    """What `grpod fsck` found in the ledger (`checked` False: nothing to check, `note`)."""

    checked: bool = False
    note: str = ""
    last_step: int | None = None
    missing: list[dict[str, Any]] = field(default_factory=list)
    duplicated: list[dict[str, Any]] = field(default_factory=list)
    epochs: dict[str, dict[str, Any]] = field(default_factory=dict)  # by epoch, as a JSON key
    eval_rows: int = 0
    superseded_rows: int = 0

    def problems(self) -> list[str]:
        """One line each: the missing prompts, the duplicated ones, named (the first NAMED)."""
        out = []
        for what, items in (("missing", self.missing), ("duplicated", self.duplicated)):
            if not items:
                continue
            names = ", ".join(_name(item) for item in items[:NAMED])
            more = f" and {len(items) - NAMED} more" if len(items) > NAMED else ""
            out.append(f"ledger: {len(items)} prompts {what}: {names}{more}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _name(item: dict[str, Any]) -> str:
    row = "" if item.get("task_row") is None else f" (task row {item['task_row']})"
    steps = item.get("steps") or [item.get("step")]
    at = ", ".join(str(s) for s in steps)
    return f"epoch {item['epoch']} prompt {item['prompt_id']}{row} at step {at}"


def check_ledger(session: Session, run_ids: list[str]) -> LedgerCheck:
    """Every prompt of the stream up to the ledger's last step accounted for exactly once
    (per pass over its generation) by the rows that are not superseded."""
    check = LedgerCheck()
    if not run_ids:
        check.note = "no run recorded"
        return check
    rows = session.execute(
        select(
            PromptFate.step,
            PromptFate.fate,
            PromptFate.prompt_id,
            PromptFate.epoch_size,
            PromptFate.generation_pass,
            PromptFate.superseded,
        ).where(PromptFate.run_id.in_(run_ids))
    ).all()
    check.superseded_rows = sum(1 for r in rows if r.superseded)
    live = [r for r in rows if not r.superseded]
    check.eval_rows = sum(1 for r in live if r.fate == "eval")
    training = [r for r in live if r.fate != "eval"]
    if not training:
        check.note = "no prompt recorded in the ledger (a store before 0007_prompt_ledger)"
        return check
    newest = session.get(Run, run_ids[-1])
    sizes = {r.epoch_size for r in training if r.epoch_size}
    spec = LedgerSpec.of_config(newest.config_json, max(sizes, default=None))
    if spec is None:
        check.note = f"run {newest.id}: its config names no prompts_per_step"
        return check
    check.checked = True
    check.last_step = max(r.step for r in training)
    seen: dict[tuple[int, int], list[Any]] = defaultdict(list)
    for r in training:
        seen[(r.prompt_id, r.generation_pass)].append(r)
    for step in range(check.last_step + 1):
        for prompt_id in spec.prompt_ids(step):
            if (prompt_id, step % spec.epochs) not in seen:
                epoch, row = spec.locate(prompt_id)
                check.missing.append(
                    dict(epoch=epoch, prompt_id=prompt_id, task_row=row, step=step)
                )
    for (prompt_id, _), found in sorted(seen.items()):
        if len(found) > 1:
            epoch, row = spec.locate(prompt_id)
            check.duplicated.append(
                dict(
                    epoch=epoch,
                    prompt_id=prompt_id,
                    task_row=row,
                    steps=sorted(r.step for r in found),
                    fates=[r.fate for r in sorted(found, key=lambda r: r.step)],
                )
            )
    check.epochs = _epoch_counts(spec, seen)
    return check


def _epoch_counts(
    spec: LedgerSpec, seen: dict[tuple[int, int], list[Any]]
) -> dict[str, dict[str, Any]]:
    """Per epoch: its size, the prompts accounted for (every pass of them), and the fates."""
    prompts: dict[int, Counter] = defaultdict(Counter)  # epoch -> prompt_id -> passes seen
    fates: dict[int, Counter] = defaultdict(Counter)
    for (prompt_id, _), found in seen.items():
        epoch = spec.locate(prompt_id)[0]
        prompts[epoch][prompt_id] += 1
        fates[epoch].update(r.fate for r in found)
    out = {}
    for epoch in sorted(prompts):
        accounted = sum(1 for n in prompts[epoch].values() if n == spec.epochs)
        out[str(epoch)] = dict(
            size=spec.epoch_size,
            prompts=accounted,
            complete=spec.epoch_size is not None and accounted == spec.epoch_size,
            fates={fate: fates[epoch][fate] for fate in FATES if fates[epoch][fate]},
        )
    return out


def check_store(store: Store) -> LedgerCheck:
    """`check_ledger` over every run of `store`'s run directory (`grpod status`)."""
    with store.session() as session:
        return check_ledger(session, store.run_ids(session))


def coverage_line(ledger: dict[str, Any]) -> str:
    """The ledger in one line: the epochs' coverage (`LedgerCheck.to_dict()`)."""
    if not ledger.get("checked"):
        return f"ledger: {ledger.get('note') or 'not checked'}"
    epochs = "; ".join(
        f"epoch {epoch} {e['prompts']}/{e['size'] or '?'} prompts"
        + (f" ({', '.join(f'{k} {v}' for k, v in e['fates'].items())})" if e["fates"] else "")
        for epoch, e in ledger["epochs"].items()
    )
    bad = []
    for key in ("missing", "duplicated"):  # lists (fsck) or counts (status)
        found = ledger[key]
        count = found if isinstance(found, int) else len(found)
        if count:
            bad.append(f"{count} {key}")
    return f"ledger through step {ledger['last_step']}: {epochs}" + (
        f"; {', '.join(bad)}" if bad else ""
    )
