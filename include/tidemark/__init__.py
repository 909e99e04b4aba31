"""Tidemark: change data capture from PostgreSQL into Delta Lake, in Airflow-orchestrated micro-batches."""

__version__ = "0.1.0"
