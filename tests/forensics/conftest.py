"""Fixtures: a store URL per backend (SQLite file, PostgreSQL schema) and a recorded campaign."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, text

from grpod.forensics import ForensicsConfig, Store
from grpod.forensics.models import Blob
from tests.forensics.campaign import Campaign, run_campaign

PG_URL = os.environ.get("GRPOD_TEST_PG_URL", "")
FAULT_STEP = 7


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest) -> str:
    """'' (the run dir's SQLite file) or a PostgreSQL URL whose search_path is a fresh schema."""
    if request.param == "sqlite":
        yield ""
    else:
        yield from _fresh_pg_schema()


@pytest.fixture
def pg_store_url() -> str:
    """A PostgreSQL URL on a fresh schema, for what only a shared store does."""
    yield from _fresh_pg_schema()


def _fresh_pg_schema() -> Iterator[str]:
    if not PG_URL:
        pytest.skip("GRPOD_TEST_PG_URL is not set (make test starts a server and sets it)")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in PG_URL else "?"
    yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


@pytest.fixture(scope="session")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    """13 steps, checkpoints at 0, 5, 10, a NaN loss injected at step 7 (flushed: an incident)."""
    run_dir = tmp_path_factory.mktemp("recorded") / "run"
    return run_campaign(run_dir, 13, checkpoint_every=5, faults={"nan_loss_steps": [FAULT_STEP]})


@pytest.fixture(scope="session")
def recorded_files(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    """The same campaign with every batch blob in a file (`inline_blob_bytes = 0`)."""
    run_dir = tmp_path_factory.mktemp("recorded-files") / "run"
    return run_campaign(
        run_dir,
        13,
        checkpoint_every=5,
        forensics=ForensicsConfig(inline_blob_bytes=0),
        faults={"nan_loss_steps": [FAULT_STEP]},
    )


@pytest.fixture(params=["inline", "files"])
def run_copy(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A private copy of a recorded run dir, for tests that damage it: its blobs inline in
    the store (the default for batches this small), or in files."""
    campaign = request.getfixturevalue(
        "recorded" if request.param == "inline" else "recorded_files"
    )
    copy = tmp_path / "run"
    shutil.copytree(campaign.run_dir, copy)
    return copy


def blob_rows(run_dir: Path) -> dict[str, str]:
    """digest -> path ("" when inline) of every blob row."""
    store = Store(run_dir, create=False)
    with store.session() as session:
        rows = dict(session.execute(select(Blob.sha256, Blob.path)).all())
    store.close()
    return rows


def damage_blob(run_dir: Path, digest: str, offset: int = -1) -> None:
    """Flip one byte of a stored blob, in its file or in its row."""
    path = blob_rows(run_dir)[digest]
    if path:
        data = bytearray((run_dir / path).read_bytes())
        data[offset] ^= 0x10
        (run_dir / path).write_bytes(bytes(data))
        return
    store = Store(run_dir, create=False)
    with store.session() as session:
        blob = session.get(Blob, digest)
        data = bytearray(blob.data)
        data[offset] ^= 0x10
        blob.data = bytes(data)
    store.close()  # the last connection: SQLite folds the WAL into the file
