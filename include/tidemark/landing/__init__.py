"""Landing: where segments are kept and what they look like.

``store`` is the landing store (a local directory, or S3 through boto3) with write-once puts;
``segments`` is the segment format: one writer (`segments.SegmentWriter`, whose Avro framing both
the drain's fast path and `segments.SegmentBuilder` use) and one reader (`segments.read_segment`).
Imports only `tidemark.pgtypes` and `tidemark.errors`.
"""
