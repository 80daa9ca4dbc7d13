"""Where the registry lives, how it is opened, and its schema (Alembic) kept current.

`open_registry(location)` takes a path or any SQLAlchemy URL (default:
``$PRISM_SERVE_REGISTRY``, else `prism_serve.paths.registry_url()`), refuses a
damaged file, a database that is not a registry and one made by a newer schema,
and upgrades an older schema in place. SQLite runs in WAL mode with a busy
timeout; write sessions take the write lock up front (BEGIN IMMEDIATE) so that
concurrent writers queue instead of failing.

`open_registry(location, readonly=True)` (listing, the doctor, the vLLM plugin) never
writes and never creates: a missing file is `MissingRegistry`, an older schema is an
error rather than a migration, and SQLite is opened `mode=ro`. A WAL-mode file in a
folder this process cannot write (a read-only volume) is read as immutable when it has
no write-ahead log pending; `seal()` turns a registry into one self-contained
rollback-journal file for shipping read-only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from prism_serve.errors import PrismError
from prism_serve.registry.errors import MissingRegistry, RegistryError

log = logging.getLogger(__name__)
ENV_VAR = "PRISM_SERVE_REGISTRY"
MIGRATIONS = Path(__file__).parent / "migrations"
BUSY_TIMEOUT_MS = 30_000  # writers queue this long for the lock before giving up
REGISTRY_TABLES = {"devices", "programs", "program_sources", "sgraphs", "kernels"}
# The newest migration's revision. A registry already there opens without loading Alembic
# (half a second at every vLLM start); a test keeps this equal to the migrations' head.
SCHEMA_HEAD = "0004"


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


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL, for plain and URI-style (`sqlite:///file:PATH?...&uri=true`)
    URLs alike; None for other databases and in-memory ones."""
    parsed = make_url(url)
    db = parsed.database
    if parsed.get_backend_name() != "sqlite" or not db or db == ":memory:":
        return None
    if str(parsed.query.get("uri", "")).lower() in ("true", "1") and db.startswith("file:"):
        if parsed.query.get("mode") == "memory":
            return None
        rest = db.removeprefix("file:").split("?", 1)[0].split("#", 1)[0]
        if rest.startswith("//"):  # file://host/path: only an empty host or localhost are local
            rest = "/" + rest[2:].split("/", 1)[1] if "/" in rest[2:] else "/"
        return Path(unquote(rest))
    return Path(db)


def make_engine(url: str, readonly: bool = False) -> Engine:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise RegistryError(f"registry location {url!r} is neither a path nor a database URL: {exc}") from None
    if parsed.get_backend_name() == "sqlite":
        path = sqlite_file(url)
        if readonly:
            parsed = _readonly_sqlite(parsed, path)
        elif path is not None:
            check_registry_writable(url)
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
        _sqlite_events(engine)
        return engine
    options = {"postgresql_readonly": True} if readonly and parsed.get_backend_name() == "postgresql" else {}
    try:
        return create_engine(parsed, pool_pre_ping=True, execution_options=options)
    except (ImportError, SQLAlchemyError) as exc:
        raise RegistryError(f"cannot use registry {describe(url)}: {exc}") from None


def check_registry_writable(location: str | os.PathLike | None = None) -> None:
    """RegistryError unless a SQLite registry file at `location` could be created or written (other
    databases are checked when they are opened)."""
    from prism_serve.paths import check_writable
    path = sqlite_file(resolve_url(location))
    if path is not None:
        try:
            check_writable(path, "registry", make_folders=True)
        except PrismError as exc:
            raise RegistryError(str(exc)) from None


def _readonly_sqlite(parsed, path: Path | None):
    """The URL that opens this SQLite file without writing or creating anything."""
    if path is None:
        return parsed
    if not path.is_file():
        raise MissingRegistry(f"no registry at {path}" + ("" if path.parent.is_dir() else
                                                          f" (there is no folder {path.parent})"))
    query = dict(parsed.query)
    if query.get("immutable") not in ("1", "true") and "mode" not in query:
        query["mode"] = "immutable" if _immutable_only(path) else "ro"
    if query.get("mode") == "immutable":
        query.pop("mode")
        query["immutable"] = "1"
    if str(query.get("uri", "")).lower() not in ("true", "1"):
        query["uri"] = "true"
        parsed = parsed.set(database=f"file:{quote(str(path.resolve()))}")
    return parsed.set(query=query)


def _immutable_only(path: Path) -> bool:
    """A WAL-mode file in a folder this process cannot write, with no write-ahead log pending:
    SQLite cannot make its shared-memory file there, but the file alone is the whole database
    and nobody here can change it, so it reads as immutable."""
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return False
    wal = path.with_name(path.name + "-wal")
    wal_mode = len(header) == 20 and header[18] == header[19] == 2
    return wal_mode and not os.access(path.parent, os.W_OK) and (not wal.exists() or wal.stat().st_size == 0)


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

    def __init__(self, url: str, engine: Engine, readonly: bool = False) -> None:
        self.url = url
        self.engine = engine
        self.readonly = readonly
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
        if self.readonly:
            raise RegistryError(f"registry {describe(self.url)} was opened read-only")
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


def open_registry(location: str | os.PathLike | None = None, *, readonly: bool = False) -> Registry:
    """Open the registry at `location`: for writing, creating or upgrading it as needed; with
    `readonly`, as it is (MissingRegistry when there is none, an error for an older schema)."""
    url = resolve_url(location)
    engine = make_engine(url, readonly)
    try:
        revision = ensure_schema(engine, url, upgrade=not readonly)
    except BaseException:
        engine.dispose()
        raise
    log.debug("registry %s at schema %s", describe(url), revision)
    return Registry(url, engine, readonly)


def seal(location: str | os.PathLike | None = None) -> Path:
    """Fold a SQLite registry's write-ahead log into its file and switch it to a rollback
    journal, so the one file is the whole database and reads from a read-only volume (a later
    write switches it back to WAL). Returns the file."""
    url = resolve_url(location)
    path = sqlite_file(url)
    if path is None:
        raise RegistryError(f"registry {describe(url)} is not a SQLite file: only files are sealed")
    if not path.is_file():
        raise MissingRegistry(f"no registry at {path}")
    reg = open_registry(url)
    try:
        raw = reg.engine.raw_connection()
        try:
            raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            mode = raw.driver_connection.execute("PRAGMA journal_mode = DELETE").fetchone()[0]
        finally:
            raw.close()
    except DBAPIError as exc:
        raise RegistryError(f"cannot seal registry {path}: {exc.orig}") from None
    finally:
        reg.close()
    if mode != "delete":
        raise RegistryError(f"cannot seal registry {path}: it stays in {mode} mode (is another process using it?)")
    return path


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
            _migrate(writer if upgrade else engine, where, upgrade)
    except RegistryError:
        raise
    except DBAPIError as exc:
        raise RegistryError(f"{where} cannot be read as a registry database: {exc.orig}") from None
    if engine.dialect.name == "sqlite" and upgrade:
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
            if current is None:
                raise RegistryError(f"{where} is empty: not a prism-serve registry (yet)")
            raise RegistryError(f"{where} has schema revision {current!r}, this prism-serve reads {head!r}; "
                                f"a command that writes to it (e.g. `prism-serve registry gc`) upgrades it")
        if current is not None:
            log.info("upgrading registry %s from schema %s to %s", where, current, head)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return _stored_revision(conn)
