"""Alembic environment: runs on the connection the store hands over, or on `-x url=...`."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from grpod.forensics.models import Base

target_metadata = Base.metadata


def _begin_sqlite(connection: Connection) -> None:
    """The store's one transaction: pysqlite opens it before DML only, so open it before the
    DDL too, so that a migration that fails (a refused downgrade) rolls back whole, its first
    DROP TABLE included."""
    dbapi = connection.connection.dbapi_connection
    if connection.dialect.name == "sqlite" and not dbapi.in_transaction:
        connection.exec_driver_sql("BEGIN")


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata)
        _begin_sqlite(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("forensics migrations: pass -x url=<store URL>")
    with create_engine(url).connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
