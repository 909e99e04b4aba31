"""PostgreSQL types: the catalog (`catalog`), parsing the server's text output (`text`), the
mapping of each type to one canonical kind with its Avro and lake (Arrow) types (`mapping`), and a
column's canonical values as a lake array (`lake_values`).

Owns everything Tidemark knows about PostgreSQL's types. Imports nothing from Tidemark but
`tidemark.errors`; every other package may import it.
"""

from tidemark.pgtypes.catalog import TypeResolver, column_attnums, table_schema_for_oid, table_schema_from_catalog
from tidemark.pgtypes.mapping import (BUILTIN_KINDS, DATE_NEG_INF, DATE_POS_INF, TS_NEG_INF, TS_POS_INF, US_PER_DAY,
                                      Column, TableSchema, arrow_schema, arrow_type, avro_field_names, avro_name,
                                      avro_record_schema, avro_type, lake_name_problem, qualified_name)
from tidemark.pgtypes.lake_values import LakeValueError, lake_array
from tidemark.pgtypes.text import (SESSION_SETTINGS, parse_date, parse_time, parse_timestamp, parse_timestamptz,
                                   session_options, text_parser)

__all__ = [
    "BUILTIN_KINDS", "DATE_NEG_INF", "DATE_POS_INF", "LakeValueError", "SESSION_SETTINGS", "TS_NEG_INF", "TS_POS_INF",
    "US_PER_DAY", "Column", "TableSchema", "TypeResolver", "arrow_schema", "arrow_type", "avro_field_names",
    "avro_name", "avro_record_schema", "avro_type", "column_attnums", "lake_array", "lake_name_problem", "parse_date",
    "parse_time", "parse_timestamp", "parse_timestamptz", "qualified_name", "session_options", "table_schema_for_oid",
    "table_schema_from_catalog", "text_parser",
]
