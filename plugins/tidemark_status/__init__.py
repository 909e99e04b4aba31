"""The CDC status page in the Airflow UI: a FastAPI app (`app`) behind Airflow's authentication that
renders (`page`) what `tidemark.status.overview` reads from the control database."""
