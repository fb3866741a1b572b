"""`Store`: the forensic database (SQLAlchemy 2 + Alembic); SQLite in the run dir or PostgreSQL.

The default store is `<run_dir>/grpod.sqlite` (WAL, busy_timeout, foreign keys on); a
`postgresql+psycopg://...` URL moves it to a server shared by several nodes, in which case
the runs of one run directory are told apart by `runs.run_dir`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Engine,
    Insert,
    create_engine,
    event,
    func,
    inspect,
    make_url,
    select,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from grpod.base.oneline import first_line
from grpod.forensics.config import PASSWORD_REFUSED, has_password, run_dir_config
from grpod.forensics.errors import ForensicsError
from grpod.forensics.models import Checkpoint, Eval, Incident, Run, Step, StepRank
from grpod.forensics.ranks import RankRecord, rank_records

SQLITE_NAME = "grpod.sqlite"
ALEMBIC_INI = Path(__file__).with_name("alembic.ini")


# Typed, detached results for readers outside forensics/ (which never see SQL or a session).
@dataclass(frozen=True)
class NotedCheckpoint:
    step: int  # the engine cursor when it was saved
    path: Path  # absolute (a relative record is resolved against the run dir)


@dataclass(frozen=True)
class StepPoint:
    """The last record of one step: the numbers `grpod plot` draws (None: not finite)."""

    step: int
    outcome: str  # applied | flushed | skipped
    valid_tokens: int
    expected_valid_tokens: int
    loss: float | None
    reward_mean: float | None
    reward_std: float | None
    grad_norm: float | None
    entropy: float | None = None  # nats (schema 0003)


@dataclass(frozen=True)
class EvalTotal:
    step: int  # the engine cursor when evaluated
    total: float  # the weighted mean reward (NaN: not finite)


@dataclass(frozen=True)
class IncidentMark:
    id: int
    step: int  # the episode's first step
    action: str  # WARN | FLUSH | HALT
    guard: str = ""  # "" before schema 0003
    last_step: int | None = None


@dataclass(frozen=True)
class RunSummary:
    """Recorded steps of a run directory by outcome, its re-runs, last record and incidents."""

    outcomes: dict[str, int]
    reruns: int
    last_step: int | None
    last_outcome: str | None
    last_verdict_action: str | None
    incident_steps: tuple[int, ...]  # in incident order


def resolve_store_url(run_dir: str | os.PathLike, store_url: str = "") -> str:
    """The store URL of a run dir: `store_url`, else `[forensics] store_url` of its
    config.toml, else the SQLite file in the run dir."""
    run_dir = Path(run_dir)
    store_url = store_url or run_dir_config(run_dir).store_url
    return store_url or f"sqlite:///{(run_dir / SQLITE_NAME).resolve()}"


def refuse_password(url: str) -> None:
    """ForensicsError when the store URL `url` carries a password (named without it)."""
    if has_password(url):
        raise ForensicsError(f"store {_without_password(url)}: {PASSWORD_REFUSED}")


class Store:
    """The database of one run directory. `create=False` refuses a missing SQLite file."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        store_url: str = "",
        *,
        create: bool = True,
        busy_timeout_ms: int = 10_000,
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.url = resolve_store_url(self.run_dir, store_url)
        self.is_sqlite = self.url.startswith("sqlite")
        self.shared = bool(store_url or not self.url.endswith(f"/{SQLITE_NAME}"))
        self.label = _without_password(self.url)  # for messages
        refuse_password(self.url)  # a --store-url (a config's is refused when loaded)
        if self.is_sqlite and not create:
            path = Path(self.url.split("///", 1)[-1])
            if not path.is_file():
                raise ForensicsError(f"store {path}: no such file (is {self.run_dir} a run dir?)")
        if self.is_sqlite and create:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.engine: Engine = create_engine(self.url)
        except (SQLAlchemyError, ImportError, ValueError) as exc:
            raise ForensicsError(f"store {self.label}: {exc}") from None
        if self.is_sqlite:
            _sqlite_pragmas(self.engine, busy_timeout_ms)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._lock_conn: Any = None  # the connection holding the advisory lock, if any
        self._lock_key = 0

    def close(self) -> None:
        if self._lock_conn is not None:
            # unlocked here, not left to the session's end: closing a pooled connection only
            # returns it to the pool, and a disposed one's server process exits (and drops
            # the lock) some time after close() has returned
            with contextlib.suppress(SQLAlchemyError):  # a broken connection holds nothing
                self._lock_conn.execute(
                    text("SELECT pg_advisory_unlock(:k)"), {"k": self._lock_key}
                )
                self._lock_conn.commit()
            self._lock_conn.close()
            self._lock_conn = None
        self.engine.dispose()

    def lock_run_dir(self) -> None:
        """PostgreSQL: hold a session advisory lock on this run directory until close(), so
        two hosts sharing the server cannot both write one run (SQLite: the run dir's flock
        is enough). ForensicsError when another session holds it."""
        if self.is_sqlite or self._lock_conn is not None:
            return
        key = int.from_bytes(hashlib.sha256(f"grpod:{self.run_dir}".encode()).digest()[:8], "big")
        key -= 1 << 63  # pg advisory keys are signed bigints
        try:
            conn = self.engine.connect()
            held = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()
            conn.commit()
        except SQLAlchemyError as exc:
            raise ForensicsError(f"store {self.label}: {_driver_message(exc)}") from None
        if not held:
            conn.close()
            raise ForensicsError(
                f"store {self.label}: run dir {self.run_dir} is locked by another grpod run "
                "(PostgreSQL advisory lock)"
            )
        self._lock_conn, self._lock_key = conn, key

    def insert_keeping(self, model: type, key: str) -> Insert:
        """An INSERT of `model` rows under which a row whose `key` the store has already keeps
        its values (ON CONFLICT DO NOTHING: SQLite and PostgreSQL spell it alike)."""
        dialect = sqlite if self.is_sqlite else postgresql
        return dialect.insert(model).on_conflict_do_nothing(index_elements=[key])

    def rows_insert(self, statement: Insert) -> RowsInsert:
        """`statement`, an INSERT of one table, run for many rows at a time by the driver
        (`RowsInsert`)."""
        return RowsInsert(statement, self.engine.dialect)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on error."""
        with self._sessions() as session:
            try:
                yield session
                session.commit()
            except SQLAlchemyError as exc:
                session.rollback()
                raise ForensicsError(f"store {self.label}: {_driver_message(exc)}") from None
            except BaseException:
                session.rollback()
                raise

    # ----------------------------------------------------------------- schema
    def _alembic(self):
        from alembic.config import Config
        from alembic.script import ScriptDirectory

        config = Config(str(ALEMBIC_INI))
        return config, ScriptDirectory.from_config(config)

    def revision(self) -> str | None:
        """The store's Alembic revision, or None for an empty database."""
        try:
            with self.engine.connect() as conn:
                if not inspect(conn).has_table("alembic_version"):
                    return None
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except SQLAlchemyError as exc:
            raise ForensicsError(f"store {self.label}: {_driver_message(exc)}") from None

    def head(self) -> str:
        return self._alembic()[1].get_current_head()

    def _refuse_newer(self, current: str | None) -> None:
        if current is None:
            return
        from alembic.util import CommandError

        try:
            known = self._alembic()[1].get_revision(current)
        except CommandError:
            known = None
        if known is None:
            raise ForensicsError(
                f"store {self.label}: written by a newer grpod: schema revision {current} is "
                f"newer than this grpod (head {self.head()}); upgrade grpod"
            )

    def upgrade(self) -> str:
        """Migrate to the newest schema (idempotent); returns the head revision."""
        from alembic import command

        self._refuse_newer(self.revision())
        config, _ = self._alembic()
        try:
            with self.engine.begin() as conn:
                config.attributes["connection"] = conn
                command.upgrade(config, "head")
        except SQLAlchemyError as exc:
            raise ForensicsError(
                f"store {self.label}: upgrade failed: {_driver_message(exc)}"
            ) from None
        return self.head()

    def check_schema(self) -> None:
        """Refuse a store that is empty, older or newer than this grpod's schema."""
        current = self.revision()
        if current is None:
            raise ForensicsError(f"store {self.label}: no grpod schema; run `grpod db upgrade`")
        self._refuse_newer(current)
        if current != self.head():
            raise ForensicsError(
                f"store {self.label}: schema {current} is older than {self.head()}; "
                "run `grpod db upgrade`"
            )

    def integrity_problems(self, *, quick: bool = False) -> list[str]:
        """The database's own consistency check, one line ([] = healthy): SQLite's
        `PRAGMA integrity_check` (`quick_check` when `quick`); a server store (PostgreSQL
        checks its own pages) only answers. The schema revision is `check_schema`'s."""
        try:
            with self.engine.connect() as conn:
                if not self.is_sqlite:
                    conn.exec_driver_sql("SELECT 1")
                    return []
                pragma = "quick_check" if quick else "integrity_check"
                rows = [str(r[0]) for r in conn.exec_driver_sql(f"PRAGMA {pragma}")]
        except SQLAlchemyError as exc:
            return [f"store {self.label}: {_driver_message(exc)}"]
        if rows == ["ok"]:
            return []
        more = f" (+{len(rows) - 3} more)" if len(rows) > 3 else ""
        return [f"store {self.label}: {pragma}: {'; '.join(rows[:3])}{more}"]

    def file_bytes(self) -> int:
        """Bytes of the SQLite file with its WAL and shared-memory files (0 for a server)."""
        if not self.is_sqlite:
            return 0
        path = self.url.split("///", 1)[-1]
        return sum(
            os.path.getsize(p) for p in (path, path + "-wal", path + "-shm") if os.path.exists(p)
        )

    def truncate_wal(self) -> None:
        """SQLite: fold the WAL into the file and truncate it (retention counts it against the
        budget); a busy reader only postpones it."""
        if self.is_sqlite:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")

    def refuse_corrupt(self) -> None:
        """ForensicsError when the database fails its quick check: nothing is written into a
        corrupt store."""
        problems = self.integrity_problems(quick=True)
        if problems:
            raise ForensicsError(f"{problems[0]}; refusing to write into it (see `grpod fsck`)")

    # ----------------------------------------------------------------- queries
    def run_ids(self, session: Session) -> list[str]:
        """The runs of this run directory (all runs of a SQLite file in it), oldest first."""
        query = select(Run.id).order_by(Run.started_at, Run.id)
        if self.shared:
            query = query.where(Run.run_dir == str(self.run_dir))
        return list(session.scalars(query))

    def run(self, session: Session, run_id: str) -> Run:
        run = session.get(Run, run_id)
        if run is None:
            raise ForensicsError(f"run {run_id}: not in store {self.label}")
        return run

    def latest_step(self, session: Session, step: int) -> Step:
        """The last record of `step` in this run directory."""
        row = session.scalars(
            select(Step)
            .where(Step.run_id.in_(self.run_ids(session)), Step.step == step)
            .order_by(Step.id.desc())
            .limit(1)
        ).first()
        if row is None:
            raise ForensicsError(f"step {step}: not recorded in {self.run_dir}")
        return row

    def step_ranks(self, session: Session, step: Step) -> list[RankRecord]:
        """Each rank's part of the step record `step`, by rank ([] for a one-process step):
        its `step_ranks` rows, or for a record before schema 0005 its report's ranks. A
        re-run's record has its own (the latest of a step: `latest_step`)."""
        rows = session.scalars(
            select(StepRank).where(StepRank.step_id == step.id).order_by(StepRank.rank)
        ).all()
        return rank_records(list(rows), step.report_json)

    def incident(self, session: Session, incident_id: int) -> Incident:
        row = session.get(Incident, incident_id)
        if row is None or row.run_id not in self.run_ids(session):
            raise ForensicsError(f"incident {incident_id}: no such incident in {self.run_dir}")
        return row

    def incidents(self, session: Session) -> list[Incident]:
        runs = self.run_ids(session)
        return list(
            session.scalars(select(Incident).where(Incident.run_id.in_(runs)).order_by(Incident.id))
        )

    def open_incidents(self, session: Session) -> list[Incident]:
        """The episodes still open in this run directory, oldest first."""
        return [i for i in self.incidents(session) if i.status == "open"]

    def unpin_unless_referenced(
        self, session: Session, checkpoint_id: int, incident_id: int
    ) -> None:
        """Unpin a checkpoint that no incident but `incident_id` (now past it) refers to."""
        refers = (Incident.checkpoint_id == checkpoint_id) | (
            Incident.worst_checkpoint_id == checkpoint_id
        )
        others = select(Incident.id).where(refers, Incident.id != incident_id).limit(1)
        row = session.get(Checkpoint, checkpoint_id)
        own = session.get(Incident, incident_id)
        if row is not None and session.scalar(others) is None and own.checkpoint_id != row.id:
            row.pinned = False

    def evals(self, session: Session) -> list[Eval]:
        """Held-out evaluations of this run directory, by step (a re-run's evaluation last)."""
        query = select(Eval).where(Eval.run_id.in_(self.run_ids(session)))
        return list(session.scalars(query.order_by(Eval.step, Eval.id)))

    def checkpoints(self, session: Session, *, include_deleted: bool = False) -> list[Checkpoint]:
        query = select(Checkpoint).where(Checkpoint.run_id.in_(self.run_ids(session)))
        if not include_deleted:
            query = query.where(Checkpoint.deleted.is_(False))
        return list(session.scalars(query.order_by(Checkpoint.step, Checkpoint.id)))

    def checkpoint_at_or_before(
        self, session: Session, step: int, *, on_disk: bool = False
    ) -> Checkpoint | None:
        """The newest noted checkpoint taken at or before `step` (its directory present when
        `on_disk`: the daemon may remove old checkpoints itself)."""
        candidates = [
            c
            for c in self.checkpoints(session)
            if c.step <= step and (not on_disk or self.checkpoint_path(c).is_dir())
        ]
        return candidates[-1] if candidates else None

    def decided_steps(self, session: Session, first: int, target: Step) -> list[Step]:
        """The record that decided each step in [first, target.step), then `target`: the last
        record of each step made no later than the target's (a resumed run re-records)."""
        rows = session.scalars(
            select(Step)
            .where(
                Step.run_id.in_(self.run_ids(session)),
                Step.step >= first,
                Step.step < target.step,
                Step.id <= target.id,
            )
            .order_by(Step.step, Step.id)
        ).all()
        latest = {row.step: row for row in rows}
        return [*latest.values(), target]

    # ----------------------------------------------------------------- typed reads
    def noted_checkpoints(self) -> list[NotedCheckpoint]:
        """The run directory's checkpoints that retention has not deleted, oldest first."""
        with self.session() as session:
            rows = self.checkpoints(session)
        return [NotedCheckpoint(c.step, self.checkpoint_path(c)) for c in rows]

    def last_recorded_step(self) -> int | None:
        """The highest step recorded in this run directory (None: none yet)."""
        with self.session() as session:
            runs = self.run_ids(session)
            last = session.scalar(select(func.max(Step.step)).where(Step.run_id.in_(runs)))
        return None if last is None else int(last)

    def step_points(self) -> list[StepPoint]:
        """The last record of every recorded step (a re-run's replaces the first), by step."""
        with self.session() as session:
            rows = session.execute(
                select(
                    Step.step,
                    Step.outcome,
                    Step.valid_tokens,
                    Step.expected_valid_tokens,
                    Step.loss,
                    Step.reward_mean,
                    Step.reward_std,
                    Step.grad_norm,
                    Step.entropy,
                )
                .where(Step.run_id.in_(self.run_ids(session)))
                .order_by(Step.step, Step.id)
            ).all()
        last = {row.step: StepPoint(*row) for row in rows}
        return [last[step] for step in sorted(last)]

    def eval_totals(self) -> list[EvalTotal]:
        """Each held-out evaluation's step and weighted total reward, by step."""
        with self.session() as session:
            return [
                EvalTotal(e.step, float(json.loads(e.rewards_json)["total"]))
                for e in self.evals(session)
            ]

    def incident_marks(self) -> list[IncidentMark]:
        """Every incident of the run directory, oldest first."""
        with self.session() as session:
            return [
                IncidentMark(i.id, i.step, i.action, i.guard or "", i.last_step)
                for i in self.incidents(session)
            ]

    def summary(self) -> RunSummary:
        """What `grpod status` reports from the store."""
        with self.session() as session:
            runs = self.run_ids(session)
            in_run = Step.run_id.in_(runs)
            outcomes = session.execute(
                select(Step.outcome, func.count()).where(in_run).group_by(Step.outcome)
            ).all()
            reruns = session.scalar(select(func.count()).where(in_run, Step.rerun.is_(True)))
            last = session.execute(
                select(Step.step, Step.outcome, Step.verdict_action)
                .where(in_run)
                .order_by(Step.id.desc())
                .limit(1)
            ).first()
            incident_steps = session.scalars(
                select(Incident.step).where(Incident.run_id.in_(runs)).order_by(Incident.id)
            ).all()
        return RunSummary(
            outcomes={outcome: int(count) for outcome, count in outcomes},
            reruns=int(reruns or 0),
            last_step=None if last is None else last.step,
            last_outcome=None if last is None else last.outcome,
            last_verdict_action=None if last is None else last.verdict_action,
            incident_steps=tuple(incident_steps),
        )

    def checkpoint_path(self, checkpoint: Checkpoint) -> Path:
        path = Path(checkpoint.path)
        return path if path.is_absolute() else self.run_dir / path

    def relative(self, path: str | os.PathLike) -> str:
        """`path` relative to the run dir when inside it (the run dir can move), else absolute."""
        path = Path(path).resolve()
        try:
            return str(path.relative_to(self.run_dir))
        except ValueError:
            return str(path)


class RowsInsert:
    """An INSERT of many rows of one table, run by the driver's own executemany.

    SQLAlchemy's executemany builds and processes every row's parameters in Python, and on
    SQLite it formats every row's timestamp. Here the statement is compiled once per set of
    columns, the columns that need the dialect's processing (on SQLite its DateTime text, its
    Boolean and Float) are found once, and a value consecutive rows share (a group's
    timestamp, `False`) is processed once. On the recorder's writer SQLAlchemy's way cost
    ~0.25 ms more a W1 step (a step row, a blob row and 16 prompt rows) on a slow core. Rows
    given together share their keys; errors are SQLAlchemy's (DBAPIError), as from
    `Connection.execute`."""

    def __init__(self, statement: Insert, dialect: Any) -> None:
        self.statement, self.dialect = statement, dialect
        self._compiled: dict[tuple[str, ...], tuple[Any, ...]] = {}

    def __call__(self, conn: Any, rows: list[dict[str, Any]]) -> None:
        """Insert `rows` on `conn` (a Connection in the caller's transaction)."""
        if not rows:
            return
        keys = tuple(rows[0])
        plan = self._compiled.get(keys) or self._compile(keys)
        sql, names, positional, processed = plan
        values = (
            list(map(itemgetter(*names), rows))
            if len(names) > 1
            else [(row[names[0]],) for row in rows]
        )
        if processed:
            values = [list(v) for v in values]
            for index, process in processed:
                last = done = _UNSET  # a value the rows share (by identity) is processed once
                for row in values:
                    value = row[index]
                    if value is not last:
                        last, done = value, process(value)
                    row[index] = done
            values = list(map(tuple, values))  # the drivers take tuples or dicts
        params = values if positional else [dict(zip(names, v)) for v in values]
        conn.exec_driver_sql(sql, params)

    def _compile(self, keys: tuple[str, ...]) -> tuple[Any, ...]:
        compiled = self.statement.compile(  # for executemany: no RETURNING of the ids
            dialect=self.dialect, column_keys=list(keys), for_executemany=True
        )
        positional = bool(compiled.positional)
        names = tuple(compiled.positiontup if positional else compiled.binds)
        if set(names) - set(keys):  # a column default SQLAlchemy would fill in: none here
            raise ValueError(f"rows_insert: rows lack the columns {sorted(set(names) - set(keys))}")
        table = self.statement.table
        processed = []
        for index, name in enumerate(names):
            process = table.c[name].type.dialect_impl(self.dialect).bind_processor(self.dialect)
            if process is not None:
                processed.append((index, process))
        plan = (compiled.string, names, positional, tuple(processed))
        self._compiled[keys] = plan
        return plan


_UNSET = object()


def _sqlite_pragmas(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=FULL")  # a committed row survives power loss
        cursor.close()


def _without_password(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return "<unparsable store URL>"


def _driver_message(exc: BaseException) -> str:
    """The first line of what the database driver said (SQLAlchemy's `orig`), or of `exc`."""
    return first_line(getattr(exc, "orig", None) or exc)
