"""Alembic environment for the specdec-llm store.

The URL comes from the caller (``specdec_llm.store.db.upgrade`` puts it in
``config.attributes["url"]``) or else from the same settings as the app
(``SPECDEC_DATABASE_URL``, default: the SQLite file in the data directory), so
``alembic upgrade head`` run from the repository root works too.
"""

from logging.config import fileConfig

from alembic import context
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from specdec_llm.settings import get_settings
from specdec_llm.store.db import make_engine
from specdec_llm.store.models import Base

config = context.config
if config.config_file_name:  # run as `alembic ...` with alembic.ini
    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = Base.metadata
url = config.attributes.get("url") or get_settings().effective_database_url

# Any number: the PostgreSQL advisory lock that serialises concurrent upgrades
# (several workers starting at once on an empty database).
MIGRATION_LOCK_ID = 5_371_902


def run_migrations_offline() -> None:
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            sqlite = connection.dialect.name == "sqlite"
            if sqlite:
                # batch mode copies tables; foreign keys must not fire meanwhile
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()  # end the autobegun transaction so Alembic owns its own
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=sqlite,  # SQLite can't ALTER most things: recreate tables
                compare_type=True,
            )
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
