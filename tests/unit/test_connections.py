"""Connections keep their libpq settings (TLS above all) from an Airflow connection's extras, in every
form a connection can take; other extras stay out of the DSN."""

from __future__ import annotations

import json
from types import SimpleNamespace

import psycopg2.extensions as ext
import pytest

from tidemark.connections import connection_dsn, resolve_dsn


def _params(dsn: str) -> dict:
    return ext.parse_dsn(dsn)


def test_an_airflow_connections_tls_extras_are_kept():
    conn = SimpleNamespace(conn_type="postgres", host="db.example", port=5432, login="u", password="p w",
                           schema="src", extra_dejson={"sslmode": "verify-full", "sslrootcert": "/etc/ca.pem",
                                                       "sslcert": "/etc/c.pem", "sslkey": "/etc/k.pem",
                                                       "spark.executor.memory": "2g", "tidemark_installed": True})
    p = _params(connection_dsn(conn))
    assert (p["sslmode"], p["sslrootcert"], p["sslcert"], p["sslkey"]) == ("verify-full", "/etc/ca.pem",
                                                                            "/etc/c.pem", "/etc/k.pem")
    assert p["password"] == "p w" and "spark.executor.memory" not in p and "tidemark_installed" not in p


@pytest.mark.parametrize("extra", [{"sslmode": "require", "sslrootcert": "/ca.pem"},
                                   json.dumps({"sslmode": "require", "sslrootcert": "/ca.pem"})])
def test_the_json_form_of_a_connection_keeps_them_too(monkeypatch, extra):
    monkeypatch.setenv("AIRFLOW_CONN_TLS_SRC", json.dumps({"conn_type": "postgres", "host": "h", "login": "u",
                                                           "password": "x", "schema": "d", "extra": extra}))
    p = _params(resolve_dsn("tls_src"))
    assert (p["sslmode"], p["sslrootcert"], p["host"], p["dbname"]) == ("require", "/ca.pem", "h", "d")


def test_the_uri_form_keeps_its_query():
    import os

    os.environ["TIDEMARK_CONN_TLS_URI"] = "postgres://u:x@h:5433/d?sslmode=verify-ca&sslrootcert=%2Fca.pem"
    try:
        p = _params(resolve_dsn("tls_uri"))
    finally:
        del os.environ["TIDEMARK_CONN_TLS_URI"]
    assert (p["sslmode"], p["sslrootcert"], p["port"]) == ("verify-ca", "/ca.pem", "5433")
