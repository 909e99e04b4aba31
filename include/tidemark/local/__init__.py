"""Development only: the embedded PostgreSQL cluster (``localpg``), the embedded Airflow
(``embedded``) and the demo (``demo``) behind `make demo`. Nothing in the pipeline imports this
package; it may import any other.
"""
