"""Resolve connection ids to libpq DSNs, from Airflow connections or environment variables.

Order: an explicit resolver registered by the Airflow plugin (which asks Airflow's connection
API), then ``AIRFLOW_CONN_<ID>`` (URI or JSON form, as Airflow itself reads them), then
``TIDEMARK_CONN_<ID>`` (a URI or a libpq key=value string). Credentials never live in code.
"""

from __future__ import annotations

import json
import os
from typing import Callable
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from tidemark.errors import TidemarkError

_resolver: Callable[[str], str | None] | None = None
_extras_resolver: Callable[[str], dict | None] | None = None


# libpq connection parameters a connection's extras may carry (TLS above all): kept in the DSN, for
# normal and replication connections alike; other extras (Airflow's, Spark's) are not libpq's
LIBPQ_EXTRAS = frozenset((
    "sslmode", "sslrootcert", "sslcert", "sslkey", "sslcrl", "sslcrldir", "sslpassword", "sslcompression", "sslsni",
    "ssl_min_protocol_version", "ssl_max_protocol_version", "requiressl", "channel_binding", "gssencmode",
    "krbsrvname", "target_session_attrs", "connect_timeout", "keepalives", "keepalives_idle",
    "keepalives_interval", "keepalives_count", "tcp_user_timeout", "options", "passfile"))


def libpq_extras(extras: dict | None) -> dict[str, str]:
    """The libpq parameters among a connection's extras (`LIBPQ_EXTRAS`), as text."""
    return {k: str(v) for k, v in (extras or {}).items() if k in LIBPQ_EXTRAS and v not in (None, "")}


def connection_dsn(conn) -> str | None:
    """The libpq DSN of an Airflow connection object of type postgres (host, port, login, password,
    schema, and its extras' libpq parameters such as ``sslmode``/``sslrootcert``/``sslcert``), or None
    for another type. Shared by the task hook and the status page."""
    from psycopg2.extensions import make_dsn

    if conn.conn_type not in ("postgres", "postgresql"):
        return None
    parts = {"host": conn.host, "port": conn.port, "user": conn.login, "password": conn.password,
             "dbname": conn.schema, **libpq_extras(getattr(conn, "extra_dejson", None))}
    return make_dsn(**{k: v for k, v in parts.items() if v not in (None, "")})


def set_resolver(fn: Callable[[str], str | None] | None) -> None:
    """Install a function conn_id -> DSN (or None to fall through), e.g. Airflow's connection API."""
    global _resolver
    _resolver = fn


def set_extras_resolver(fn: Callable[[str], dict | None] | None) -> None:
    """Install a function conn_id -> the connection's extras (or None to fall through), e.g. Airflow's."""
    global _extras_resolver
    _extras_resolver = fn


def connection_extras(conn_id: str) -> dict:
    """The extras of connection ``conn_id`` (e.g. ``spark_default``'s Spark settings), empty when it is
    not defined: the registered resolver (Airflow), then ``AIRFLOW_CONN_<ID>`` / ``TIDEMARK_CONN_<ID>``
    in JSON form (its ``extra``, a mapping or JSON text) or URI form (the query: ``__extra__`` JSON
    or ``key=value`` pairs, as Airflow reads them)."""
    if _extras_resolver is not None:
        extras = _extras_resolver(conn_id)
        if extras is not None:
            return dict(extras)
    for prefix in ("AIRFLOW_CONN_", "TIDEMARK_CONN_"):
        value = (os.environ.get(_env_name(prefix, conn_id)) or "").strip()
        if not value:
            continue
        try:
            if value.startswith("{"):
                extra = json.loads(value).get("extra") or {}
                return dict(json.loads(extra) if isinstance(extra, str) else extra)
            if "://" in value:
                query = dict(parse_qsl(urlsplit(value).query, keep_blank_values=True))
                return dict(json.loads(query["__extra__"])) if "__extra__" in query else query
        except (ValueError, TypeError, AttributeError) as exc:
            raise TidemarkError(f"connection {conn_id!r} ({_env_name(prefix, conn_id)}): its extras are not "
                                f"readable: {exc}") from exc
        return {}
    return {}


def _env_name(prefix: str, conn_id: str) -> str:
    return prefix + conn_id.upper().replace("-", "_")


CONNECT_TIMEOUT_SECONDS = 10    # libpq's connect_timeout when a DSN sets none (it waits forever by default)


def with_connect_timeout(dsn: str, seconds: int = CONNECT_TIMEOUT_SECONDS) -> str:
    """``dsn`` with libpq's ``connect_timeout`` set to ``seconds`` unless it sets one itself (an
    unreachable server then fails the connection instead of hanging). A DSN libpq cannot parse is
    returned unchanged (connecting says what is wrong with it)."""
    from psycopg2 import ProgrammingError
    from psycopg2.extensions import make_dsn, parse_dsn

    try:
        if "connect_timeout" in parse_dsn(dsn):
            return dsn
        return make_dsn(dsn, connect_timeout=seconds)
    except ProgrammingError:
        return dsn


def endpoint(dsn: str) -> str:
    """``host:port`` of a DSN, for messages (never the password); a port libpq would refuse is shown
    as written."""
    from psycopg2 import ProgrammingError
    from psycopg2.extensions import parse_dsn

    try:
        parts = parse_dsn(dsn)
    except ProgrammingError:
        if "://" not in dsn:
            return "?"
        netloc = urlsplit(dsn).netloc.rsplit("@", 1)[-1]
        host, _, port = netloc.rpartition(":") if ":" in netloc else (netloc, "", "")
        return f"{unquote(host) or 'localhost'}:{port or 5432}"
    return f"{parts.get('host') or parts.get('hostaddr') or 'localhost'}:{parts.get('port') or 5432}"


def connect_failure(exc: BaseException, *, stream: str, role: str, conn_id: str, dsn: str) -> TidemarkError:
    """One line for a connection that could not be opened: the stream, the connection id, host:port,
    what failed (libpq's message on one line) and what to do. ``role`` says which database it is
    (``the source``, ``the control database``). Raise it ``from exc``: `tidemark.failures.is_transient`
    then tells a refused connection (retry) from a wrong password (do not)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    low = text.lower()
    where = f"connection '{conn_id}' ({_env_name('AIRFLOW_CONN_', conn_id)} or the Airflow connection)"
    if "password" in low and ("authentication failed" in low or "no password" in low):
        todo = f"fix the login or password of {where}"
    elif "port" in low and ("invalid integer" in low or "invalid port" in low):
        todo = f"fix the port of {where}: a number from 1 to 65535"
    elif "ssl" in low or "certificate" in low or "tls" in low:
        todo = (f"check the server's TLS set-up and the TLS extras (sslmode, sslrootcert, sslcert, sslkey) of "
                f"{where}")
    elif "database" in low and "does not exist" in low:
        todo = f"fix the database (schema) of {where}"
    elif "role" in low and "does not exist" in low:
        todo = f"fix the login of {where}"
    elif "could not translate host name" in low:
        todo = f"fix the host of {where} (this host cannot resolve it)"
    elif "pg_hba.conf" in low:
        todo = f"let this host and user in through the server's pg_hba.conf, or fix the login of {where}"
    else:
        todo = (f"check that PostgreSQL runs at {endpoint(dsn)} and that this host reaches it, or fix the "
                f"host and port of {where}")
    return TidemarkError(f"stream {stream}: cannot connect to {role} (connection '{conn_id}', "
                         f"{endpoint(dsn)}): {text}; {todo}")


def _from_json(text: str) -> str:
    doc = json.loads(text)
    user = quote(doc.get("login") or "", safe="")
    pw = doc.get("password")
    auth = f"{user}:{quote(pw, safe='')}@" if pw else (f"{user}@" if user else "")
    host = doc.get("host") or "localhost"
    port = f":{doc['port']}" if doc.get("port") else ""
    db = doc.get("schema") or ""
    extra = doc.get("extra") or {}
    query = libpq_extras(json.loads(extra) if isinstance(extra, str) else extra)
    return f"postgresql://{auth}{host}{port}/{db}" + (f"?{urlencode(query)}" if query else "")


CONN_FILE_ENV = "TIDEMARK_CONN_FILE"
# Spark's own redaction (secret, password, token, access key) and our connections' variable names:
# Spark hides the values of settings and environment variables so named in its UI and event logs
REDACTION_REGEX = r"(?i)secret|password|token|access[.]?key|tidemark_conn|airflow_conn"


def write_connection_file(env: dict[str, str]) -> str:
    """Write ``{TIDEMARK_CONN_<ID>: dsn}`` to a new file only its owner can read; return its path.
    spark-submit ships it with ``--files`` where environment variables would become command-line
    values (YARN, Kubernetes, cluster deploy mode); the job finds it by `CONN_FILE_ENV`."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="tidemark-conns-", suffix=".json")
    with os.fdopen(fd, "w") as fh:       # mkstemp creates it with mode 0600
        json.dump(env, fh)
    return path


def _from_file(name: str) -> str | None:
    """The value of environment variable ``name`` from the connection file (`write_connection_file`)
    named by ``TIDEMARK_CONN_FILE``: a path, or a file name in the working directory (YARN and
    Kubernetes put ``--files`` there) or in Spark's files directory."""
    ref = os.environ.get(CONN_FILE_ENV)
    if not ref:
        return None
    candidates = [ref] if os.path.isabs(ref) else [os.path.join(os.getcwd(), ref)]
    if not os.path.isabs(ref):
        try:
            from pyspark import SparkFiles

            candidates.append(SparkFiles.get(ref))
        except Exception:  # noqa: BLE001 - no SparkContext yet
            pass
    for path in candidates:
        if os.path.isfile(path):
            try:
                with open(path) as fh:
                    return json.load(fh).get(name)
            except (OSError, ValueError) as exc:
                raise TidemarkError(f"the connection file {path} ({CONN_FILE_ENV}) cannot be read: {exc}") from exc
    raise TidemarkError(f"{CONN_FILE_ENV}={ref}: no such file (looked in {', '.join(candidates)})")


def resolve_dsn(conn_id: str) -> str:
    """Return a DSN for ``conn_id`` or raise naming the places that were looked at."""
    if _resolver is not None:
        dsn = _resolver(conn_id)
        if dsn:
            return dsn
    for prefix in ("AIRFLOW_CONN_", "TIDEMARK_CONN_"):
        value = os.environ.get(_env_name(prefix, conn_id)) or (
            _from_file(_env_name(prefix, conn_id)) if prefix == "TIDEMARK_CONN_" else None)
        if value:
            value = value.strip()
            if value.startswith("{"):
                try:
                    return _from_json(value)
                except (ValueError, TypeError, AttributeError) as exc:
                    raise TidemarkError(f"connection {conn_id!r}: {_env_name(prefix, conn_id)} is not a valid "
                                        f"connection in JSON form: {exc}") from None
            if "://" in value:      # Airflow writes postgres://, libpq reads both
                scheme = urlsplit(value).scheme
                if scheme not in ("postgres", "postgresql"):
                    raise TidemarkError(f"connection URI scheme {scheme!r} is not postgres/postgresql")
                return value.replace(scheme + "://", "postgresql://", 1)
            return value  # libpq key=value form
    raise TidemarkError(
        f"connection {conn_id!r} is not defined: set {_env_name('AIRFLOW_CONN_', conn_id)} "
        f"(or {_env_name('TIDEMARK_CONN_', conn_id)}) to a postgresql:// URI, or define it in Airflow"
    )
