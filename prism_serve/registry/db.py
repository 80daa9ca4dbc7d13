"""Where the registry lives, how it is opened, and its schema (Alembic) kept current.

`open_registry(location)` takes a path or any SQLAlchemy URL (default:
``$PRISM_SERVE_REGISTRY``, else `prism_serve.paths.registry_url()`), refuses a
damaged file, a database that is not a registry and one made by a newer schema,
and upgrades an older schema in place. SQLite runs in WAL mode with a busy
timeout; write sessions take the write lock up front (BEGIN IMMEDIATE) so that
concurrent writers queue instead of failing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from prism_serve.registry.errors import RegistryError

log = logging.getLogger(__name__)
ENV_VAR = "PRISM_SERVE_REGISTRY"
MIGRATIONS = Path(__file__).parent / "migrations"
BUSY_TIMEOUT_MS = 30_000  # writers queue this long for the lock before giving up
REGISTRY_TABLES = {"devices", "programs", "program_sources", "sgraphs", "kernels"}
# The newest migration's revision. A registry already there opens without loading Alembic
# (half a second at every vLLM start); a test keeps this equal to the migrations' head.
SCHEMA_HEAD = "0003"


def resolve_url(location: str | os.PathLike | None = None) -> str:
    """A SQLAlchemy URL from a path, a URL, $PRISM_SERVE_REGISTRY, or the default cache file."""
    if location is None:
        location = os.environ.get(ENV_VAR) or None
    if location is None:
        from prism_serve.paths import registry_url
        location = registry_url()
    location = str(location)
    if "://" in location:
        return location
    path = Path(location).expanduser().resolve()
    return f"sqlite:///{path}"


def describe(url: str) -> str:
    """The URL without its password, for messages."""
    return make_url(url).render_as_string(hide_password=True)


def _alembic_config():
    from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory
    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


def make_engine(url: str) -> Engine:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise RegistryError(f"registry location {url!r} is neither a path nor a database URL: {exc}") from None
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
        _sqlite_events(engine)
        return engine
    try:
        return create_engine(parsed, pool_pre_ping=True)
    except (ImportError, SQLAlchemyError) as exc:
        raise RegistryError(f"cannot use registry {describe(url)}: {exc}") from None


def _sqlite_events(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (pysqlite's is broken for this)
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")


class Registry:
    """An opened, schema-checked registry: an engine and the sessions over it."""

    def __init__(self, url: str, engine: Engine) -> None:
        self.url = url
        self.engine = engine
        self.is_sqlite = engine.dialect.name == "sqlite"
        writer = engine.execution_options(sqlite_begin="IMMEDIATE") if self.is_sqlite else engine
        self._read = sessionmaker(engine, expire_on_commit=False)
        self._write = sessionmaker(writer, expire_on_commit=False)

    def __repr__(self) -> str:
        return f"Registry({describe(self.url)})"

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A session for queries; database errors become RegistryError."""
        with self._guard(), self._read() as session:
            yield session

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        """A session whose work commits as one transaction, or not at all."""
        with self._guard(), self._write() as session, session.begin():
            yield session

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except DBAPIError as exc:
            raise RegistryError(f"registry {describe(self.url)}: database error: {exc.orig}") from exc

    def close(self) -> None:
        self.engine.dispose()


def open_registry(location: str | os.PathLike | None = None, *, upgrade: bool = True) -> Registry:
    """Open (creating or upgrading as needed) the registry at `location`."""
    url = resolve_url(location)
    engine = make_engine(url)
    try:
        revision = ensure_schema(engine, url, upgrade=upgrade)
    except BaseException:
        engine.dispose()
        raise
    log.debug("registry %s at schema %s", describe(url), revision)
    return Registry(url, engine)


def _stored_revision(conn) -> str | None:
    if "alembic_version" not in inspect(conn).get_table_names():
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def ensure_schema(engine: Engine, url: str, *, upgrade: bool = True) -> str:
    """Check the schema revision; create or upgrade it; refuse foreign and newer databases."""
    where = describe(url)
    writer = engine.execution_options(sqlite_begin="IMMEDIATE") if engine.dialect.name == "sqlite" else engine
    try:
        with engine.connect() as conn:  # fast path: already current, no lock and no Alembic
            current = _stored_revision(conn)
        if current != SCHEMA_HEAD:
            _migrate(writer, where, upgrade)
    except RegistryError:
        raise
    except DBAPIError as exc:
        raise RegistryError(f"{where} cannot be read as a registry database: {exc.orig}") from None
    if engine.dialect.name == "sqlite":
        raw = engine.raw_connection()  # WAL is a property of the file, set outside any transaction
        try:
            raw.driver_connection.execute("PRAGMA journal_mode = WAL")
        finally:
            raw.close()
    return SCHEMA_HEAD


def _migrate(writer: Engine, where: str, upgrade: bool) -> None:
    from alembic import command
    from alembic.script import ScriptDirectory
    from alembic.util.exc import CommandError
    cfg = _alembic_config()
    script = ScriptDirectory.from_config(cfg)
    head = script.get_current_head()
    with writer.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(7242001)"))  # one migrator at a time
        tables = set(inspect(conn).get_table_names())
        current = _stored_revision(conn)  # again, under the lock: another process may have migrated
        if current is None and tables - {"alembic_version"}:
            raise RegistryError(
                f"{where} is not a prism-serve registry: it has tables {sorted(tables)} but no schema "
                f"revision; point --registry or ${ENV_VAR} elsewhere")
        if current is not None:
            try:
                script.get_revision(current)
            except CommandError:
                raise RegistryError(
                    f"{where} was written by a newer prism-serve (schema revision {current!r}; this "
                    f"version knows up to {head!r}); upgrade prism-serve to use it") from None
        if current == head:
            return
        if not upgrade:
            raise RegistryError(f"{where} has schema revision {current!r}, needs {head!r}; open it "
                                f"with upgrade=True to migrate")
        if current is not None:
            log.info("upgrading registry %s from schema %s to %s", where, current, head)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return _stored_revision(conn)
