"""The schema the migrations build, pinned: a fresh SQLite store upgraded to head has exactly
the `sqlite3 .schema` of tests/forensics/schema_head.sql. Migrations are history; a change
that alters what an old revision creates (a shared column helper edited, a revision
rewritten) fails here. A new revision updates the file with what it adds."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from grpod.forensics import Store

EXPECTED = Path(__file__).with_name("schema_head.sql")


def sqlite_schema(path: Path) -> str:
    """What `sqlite3 <path> .schema` prints: every object's SQL in creation order."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY rowid")
        return "".join(f"{sql};\n" for (sql,) in rows)


def test_a_fresh_store_at_head_has_the_pinned_schema(tmp_path: Path) -> None:
    store = Store(tmp_path, "")
    store.upgrade()
    store.close()
    assert sqlite_schema(tmp_path / "grpod.sqlite") == EXPECTED.read_text()
