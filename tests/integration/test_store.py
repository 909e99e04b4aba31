"""The landing store: a local directory and S3 through boto3 against a real S3-compatible HTTP server
(moto's server mode on a free loopback port), behind one interface; a snapshot landing on S3."""

from __future__ import annotations

import secrets
from collections import Counter

import boto3
import psycopg2
import pytest

from refapply import arrow_rows, source_rows
from tidemark.errors import TidemarkError
from tidemark.pgtypes import session_options, table_schema_from_catalog
from tidemark.capture.snapshot import load_manifest, read_snapshot_table, snapshot_stream
from tidemark.landing.store import LocalStore, S3Store, open_store, put_if_absent, read_uri

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3-compatible HTTP server on 127.0.0.1 for this module; stopped afterwards."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch):
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    name = f"tm-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(f"file://{tmp_path}/landing")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/some/prefix", endpoint_url=endpoint)


def test_open_store_picks_the_implementation(tmp_path, s3_bucket, s3_endpoint):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    s3 = open_store(f"s3://{s3_bucket}/p", endpoint_url=s3_endpoint)
    assert isinstance(s3, S3Store) and s3.bucket == s3_bucket and s3.prefix == "p"
    with pytest.raises(TidemarkError, match="s3://bucket/prefix"):
        S3Store("s3:///nobucket")


def test_put_get_exists_list_delete(store):
    assert not store.exists("a/b/one.bin")
    uri = store.put("a/b/one.bin", b"\x00one")
    store.put("a/two.bin", b"two")
    store.put("c/three.bin", b"")
    assert store.exists("a/b/one.bin") and store.get("a/b/one.bin") == b"\x00one"
    assert store.get("c/three.bin") == b""
    assert sorted(store.list("a/")) == ["a/b/one.bin", "a/two.bin"]
    assert sorted(store.list("")) == ["a/b/one.bin", "a/two.bin", "c/three.bin"]
    assert list(store.list("nothing/")) == []
    assert uri == store.uri("a/b/one.bin")
    assert read_uri(uri, endpoint_url=getattr(store, "endpoint_url", None)) == b"\x00one"
    store.put("a/two.bin", b"two again")          # put replaces (atomically)
    assert store.get("a/two.bin") == b"two again"
    store.delete("a/two.bin")
    store.delete("a/two.bin")                     # deleting a missing key is not an error
    assert not store.exists("a/two.bin")
    with pytest.raises(TidemarkError, match="does not exist"):
        store.get("a/two.bin")


def test_put_if_absent_keeps_landed_files_immutable(store):
    uri, written = put_if_absent(store, "seg/x.avro", b"payload")
    assert written and store.get("seg/x.avro") == b"payload"
    assert put_if_absent(store, "seg/x.avro", b"payload") == (uri, False)   # an identical retry
    with pytest.raises(TidemarkError, match="immutable"):
        put_if_absent(store, "seg/x.avro", b"other bytes")
    assert store.get("seg/x.avro") == b"payload"


def test_s3_keys_live_under_the_prefix(s3_bucket, s3_endpoint):
    store = open_store(f"s3://{s3_bucket}/deep/prefix", endpoint_url=s3_endpoint)
    store.put("k/v", b"1")
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint)
            .list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert keys == ["deep/prefix/k/v"]
    assert store.uri("k/v") == f"s3://{s3_bucket}/deep/prefix/k/v"


def test_local_store_refuses_keys_outside_its_root(tmp_path):
    store = LocalStore(tmp_path / "root")
    with pytest.raises(TidemarkError, match="escapes"):
        store.put("../outside", b"x")


def test_snapshot_lands_on_s3(make_stream, source_conn, source_db, s3_bucket, s3_endpoint):
    with source_conn.cursor() as cur:
        cur.execute("""CREATE TABLE items (id int PRIMARY KEY, name text, price numeric(10, 2), photo bytea);
                       INSERT INTO items SELECT g, 'item ' || g, g * 1.25, decode(md5(g::text), 'hex')
                         FROM generate_series(1, 1200) g;""")
    cfg = make_stream(["public.items"], landing={"url": f"s3://{s3_bucket}/landing", "endpoint_url": s3_endpoint})
    result = snapshot_stream(cfg, chunk_pages=4, parallelism=2)
    assert result.tables == {"public.items": 1200}
    store = open_store(cfg.landing.url, endpoint_url=cfg.landing.endpoint_url)
    manifest = load_manifest(store, cfg.stream, result.snapshot_id)
    files = manifest["tables"]["public.items"]["files"]
    assert len(files) > 1
    prefix = f"{cfg.stream}/snapshots/{result.snapshot_id}/"
    assert sorted(store.list(prefix)) == sorted([*files, prefix + "manifest.json"])
    assert result.manifest_uri == f"s3://{s3_bucket}/landing/{prefix}manifest.json"
    conn = psycopg2.connect(source_db, options=session_options())
    try:
        want = Counter(source_rows(conn, table_schema_from_catalog(conn, "public", "items")))
    finally:
        conn.close()
    assert Counter(arrow_rows(read_snapshot_table(store, manifest, "public.items"))) == want


def test_large_segment_spills_to_disk_and_lands_by_managed_multipart(store, monkeypatch):
    """A segment bigger than the writer's block spills to a temporary file as it is built; it lands
    from that file (S3: boto3's managed transfer, multipart above the threshold: the ETag says how
    many parts) with exactly the bytes `build` gives; landing it again writes nothing."""
    from tidemark.landing.segments import BLOCK_BYTES, SegmentWriter, avro_long, avro_string, read_segment
    from tidemark.landing.store import S3Store, put_stream_if_absent

    monkeypatch.setattr(S3Store, "TRANSFER_CHUNK", 5 << 20)        # S3's smallest part size
    seg = SegmentWriter("s", 7, 1000, codec="null")     # uncompressed: big enough for multipart
    detail = avro_string('{"pad": "' + "x" * 100_000 + '"}')
    n = 130
    for i in range(n):
        seg.append(b"\x04" + avro_string("truncate") + avro_string("public.t") + avro_long(1000 + i // 10)
                   + avro_long(42) + avro_long(i % 10) + avro_long(1_700_000_000_000_000) + detail)
        seg.counts[1000 + i // 10] = seg.counts.get(1000 + i // 10, 0) + 1
    assert seg.spilled_bytes > 10 * BLOCK_BYTES
    uri, written, size, digest = put_stream_if_absent(store, "s/segments/big.avro", lambda fh: seg.write(fh, 2000))
    data = store.get("s/segments/big.avro")
    assert written and data == seg.build(2000) and size == len(data) > 13_000_000
    assert len(read_segment(data, "big").events) == n
    if isinstance(store, S3Store):
        etag = store.client.head_object(Bucket=store.bucket, Key=store._key("s/segments/big.avro"))["ETag"]
        assert etag.strip('"').endswith(f"-{-(-size // (5 << 20))}"), etag
    assert put_stream_if_absent(store, "s/segments/big.avro", lambda fh: seg.write(fh, 2000))[1] is False
    with pytest.raises(TidemarkError, match="already exists with different content"):
        put_stream_if_absent(store, "s/segments/big.avro", lambda fh: seg.write(fh, 2001))
    assert [k for k in store.list("s/") if ".tmp-" in k] == []
    seg.close()
