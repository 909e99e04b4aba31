"""Tidemark's Airflow integration: a hook over the library, thin operators and a gap sensor.

Imported by the DAG files (the ``plugins`` folder is on Airflow's ``sys.path``); importing it is
cheap: the library is imported only when a task runs.
"""
