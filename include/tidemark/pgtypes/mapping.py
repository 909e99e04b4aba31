"""PostgreSQL types, the mapping: one canonical *kind* per type, the canonical Python value segments
store, its Avro encoding and its lake (Arrow) type (the table of kinds: docs/internals/storage.md).

Enums, composites, ranges and other types are ``text`` with their type name recorded; domains take
their base type. An array is kind ``array`` (``elem_kind``: its element's kind, ``dims``: the declared
dimensions, at least 1): segments carry its text and `lake_values.lake_array` parses it into lists. A
value the lists cannot hold is a `LakeValueError` with ``fallback = "text"``: the column is then held as
PostgreSQL's text (`Column.as_text`). Shapes of kind ``array`` without ``dims`` (landed by earlier
versions) carry Avro arrays.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
DATE_POS_INF, DATE_NEG_INF = 2**31 - 1, -(2**31)
TS_POS_INF, TS_NEG_INF = INT64_MAX, INT64_MIN
US_PER_DAY = 86_400_000_000


# Built-in type OIDs -> kind (the common ones; others are resolved from pg_type).
BUILTIN_KINDS: dict[int, str] = {
    16: "bool", 17: "bytes", 18: "text", 19: "text", 20: "int64", 21: "int16", 23: "int32", 25: "text",
    26: "int64", 114: "json", 142: "text", 700: "float32", 701: "float64", 1042: "text", 1043: "text",
    1082: "date", 1083: "time", 1114: "timestamp", 1184: "timestamptz", 1186: "interval", 1266: "timetz",
    1700: "numeric", 2950: "uuid", 3802: "jsonb",
}
BUILTIN_NAMES: dict[int, str] = {
    16: "bool", 17: "bytea", 18: "char", 19: "name", 20: "int8", 21: "int2", 23: "int4", 25: "text",
    26: "oid", 114: "json", 142: "xml", 700: "float4", 701: "float8", 1042: "bpchar", 1043: "varchar",
    1082: "date", 1083: "time", 1114: "timestamp", 1184: "timestamptz", 1186: "interval", 1266: "timetz",
    1700: "numeric", 2950: "uuid", 3802: "jsonb",
}


_PLAIN_IDENT_RE = re.compile(r"[a-z_][a-z0-9_]*")


def qualified_name(schema: str, name: str) -> str:
    """``schema.table`` for a table, each part double-quoted (as in SQL) when it is not a plain
    lower-case identifier, so that the text names exactly one table (``"Sales Data"."Order.Items"``)
    and `tidemark.config.TableRef.parse` reads it back."""
    def part(p: str) -> str:
        return p if _PLAIN_IDENT_RE.fullmatch(p) else '"' + p.replace('"', '""') + '"'

    return f"{part(schema)}.{part(name)}"


# Column names Tidemark itself uses next to a table's columns (the lake's ``_bucket`` partition, the
# changelog's ``_time``/``_diff``/``_commit_ts``/``_commit_date``, consolidation's working columns).
LAKE_RESERVED_NAMES = ("_bucket", "_time", "_diff", "_commit_ts", "_commit_date", "_n")
LAKE_RESERVED_PREFIXES = ("_tm_", "_p_", "_r_")


def lake_name_problem(names) -> str | None:
    """Why columns with these names cannot be lake columns, or None: a name Tidemark reserves, or two
    names that differ only in case (Delta Lake and Spark do not tell them apart)."""
    seen: dict[str, str] = {}
    for n in names:
        if n.lower() in LAKE_RESERVED_NAMES or n.lower().startswith(LAKE_RESERVED_PREFIXES):
            return (f"column {n!r} has a name Tidemark reserves in the lake ({', '.join(LAKE_RESERVED_NAMES)}, "
                    f"or starting with {', '.join(LAKE_RESERVED_PREFIXES)}); rename it in the source")
        if n.lower() in seen:
            return (f"columns {seen[n.lower()]!r} and {n!r} differ only in case, which Delta Lake and Spark "
                    "do not tell apart; rename one in the source")
        seen[n.lower()] = n
    return None


@dataclass(frozen=True)
class Column:
    """One column of a captured table."""

    name: str                    # PostgreSQL column name, exactly
    kind: str                    # canonical kind (see module doc)
    type_name: str               # e.g. 'int4', 'numeric', 'public.mood', '_int4'
    type_oid: int
    typmod: int = -1
    key: bool = False            # part of the replica identity key (primary key)
    elem_kind: str | None = None  # for kind == 'array' (and an array held as text, `as_text`)
    nullable: bool = True
    dims: int = 0                # an array's declared dimensions (>= 1); 0 for every other column

    @property
    def held_as_text(self) -> bool:
        """An array column the lake holds as PostgreSQL's text (a value its lists cannot hold came)."""
        return self.kind == "text" and self.dims > 0

    def as_text(self) -> "Column":
        """This array column held as PostgreSQL's text (its ``dims`` and ``elem_kind`` kept: the
        shape tells it from a text column)."""
        return replace(self, kind="text") if self.kind == "array" else self

    def element(self) -> "Column":
        """The column of an array's elements (its kind, the column's typmod: ``numeric(10,2)[]``)."""
        return Column(name="item", kind=self.elem_kind or "text", type_name=self.type_name.removesuffix("[]"),
                      type_oid=0, typmod=self.typmod)

    def to_json(self) -> dict:
        """The column as the table's shape records it: ``dims`` only for arrays, so the shapes (and
        fingerprints) of tables without arrays are what earlier versions recorded."""
        doc = asdict(self)
        if not self.dims:
            del doc["dims"]
        return doc

    @property
    def declared_type(self) -> str:
        """The type as declared, for messages: ``numeric(10,2)`` for a numeric with a precision."""
        ps = self.numeric_precision_scale
        if self.held_as_text:
            return f"{self.type_name} (held as its text)"
        return f"{self.type_name}({ps[0]},{ps[1]})" if ps else self.type_name

    @property
    def numeric_precision_scale(self) -> tuple[int, int] | None:
        """(precision, scale) of a declared numeric(p, s), else None."""
        if self.kind != "numeric" or self.typmod < 4:
            return None
        mod = self.typmod - 4
        return (mod >> 16) & 0xFFFF, ((mod & 0x7FF) ^ 1024) - 1024


@dataclass(frozen=True)
class TableSchema:
    """The shape of a table at one point of the stream (a Relation message or a catalog read)."""

    schema: str
    name: str
    oid: int
    columns: tuple[Column, ...]
    replica_identity: str = "d"   # d(efault) f(ull) i(ndex) n(othing)

    @property
    def qualified(self) -> str:
        return qualified_name(self.schema, self.name)

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.key)

    @property
    def fingerprint(self) -> str:
        """A short stable hash of the table's name and columns (names, kinds, types, keys)."""
        doc = json.dumps([self.schema, self.name, [c.to_json() for c in self.columns]], sort_keys=True)
        return hashlib.sha1(doc.encode()).hexdigest()[:12]

    @property
    def record_name(self) -> str:
        """The Avro record name of this shape, e.g. ``public_orders_3fa1c2d4e5f6``."""
        return f"{avro_name(self.schema)}_{avro_name(self.name)}_{self.fingerprint}"

    def to_json(self) -> dict:
        return {"schema": self.schema, "name": self.name, "oid": self.oid,
                "replica_identity": self.replica_identity, "columns": [c.to_json() for c in self.columns]}

    @classmethod
    def from_json(cls, doc: dict) -> "TableSchema":
        return cls(schema=doc["schema"], name=doc["name"], oid=doc["oid"],
                   replica_identity=doc.get("replica_identity", "d"),
                   columns=tuple(Column(**c) for c in doc["columns"]))

    def with_text(self, names) -> "TableSchema":
        """This shape with the array columns ``names`` held as PostgreSQL's text (`Column.as_text`)."""
        names = set(names or ())
        if not any(c.name in names and c.kind == "array" for c in self.columns):
            return self
        return replace(self, columns=tuple(c.as_text() if c.name in names else c for c in self.columns))

    @property
    def held_as_text(self) -> list[str]:
        """The array columns this shape holds as PostgreSQL's text."""
        return [c.name for c in self.columns if c.held_as_text]


_AVRO_NAME_RE = re.compile(r"[^A-Za-z0-9_]")


def avro_name(text: str) -> str:
    """A valid Avro name for an arbitrary PostgreSQL identifier (not reversible: keep the original)."""
    out = _AVRO_NAME_RE.sub("_", text)
    if not out or out[0].isdigit():
        out = "_" + out
    return out


def avro_field_names(columns: tuple[Column, ...]) -> list[str]:
    """Avro field names for the columns: the name itself when valid, else ``c<i>_<sanitized>``."""
    return [c.name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", c.name) and not c.name.startswith("c_")
            else f"c{i}_{avro_name(c.name)}" for i, c in enumerate(columns)]


_AVRO_PRIMITIVE = {
    "int16": "int", "int32": "int", "int64": "long", "float32": "float", "float64": "double", "bool": "boolean",
    "numeric": "string", "text": "string", "bytes": "bytes", "date": "int", "time": "long", "timetz": "string",
    "timestamp": "long", "timestamptz": "long", "interval": "string", "uuid": "string", "json": "string",
    "jsonb": "string",
}


def avro_type(col: Column) -> Any:
    """The Avro type of a column's values (always nullable)."""
    if col.kind == "array" and not col.dims:     # a shape landed by earlier versions
        elem = _AVRO_PRIMITIVE[col.elem_kind or "text"]
        return ["null", {"type": "array", "items": ["null", elem]}, "string"]
    if col.kind == "array":
        return ["null", "string"]                # its text: the lake parses it
    return ["null", _AVRO_PRIMITIVE[col.kind]]


def avro_record_schema(table: TableSchema) -> dict:
    """The Avro record for rows of one table shape (the ``data`` of an update)."""
    fields = [{"name": f, "type": avro_type(c)} for f, c in zip(avro_field_names(table.columns), table.columns)]
    return {"type": "record", "name": table.record_name, "namespace": "tidemark.data", "fields": fields}


def arrow_type(col: Column):
    """The lake (Arrow) type of a column."""
    import pyarrow as pa

    simple = {
        "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(), "float32": pa.float32(),
        "float64": pa.float64(), "bool": pa.bool_(), "text": pa.string(), "bytes": pa.binary(),
        "date": pa.date32(), "time": pa.string(), "timetz": pa.string(), "timestamp": pa.timestamp("us"),
        "timestamptz": pa.timestamp("us", tz="UTC"), "interval": pa.string(), "uuid": pa.string(),
        "json": pa.string(), "jsonb": pa.string(),
    }
    if col.kind == "numeric":
        ps = col.numeric_precision_scale
        if ps and ps[0] <= 38 and ps[1] >= 0:
            return pa.decimal128(ps[0], ps[1])
        return pa.string()
    if col.kind == "array":
        out = arrow_type(col.element())
        for _ in range(col.dims or 1):
            out = pa.list_(out)
        return out
    return simple[col.kind]


def arrow_schema(table: TableSchema):
    import pyarrow as pa

    return pa.schema([pa.field(c.name, arrow_type(c), nullable=True) for c in table.columns])


def _value_text(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
