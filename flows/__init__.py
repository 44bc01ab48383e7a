"""Entry layer: the `gradline` CLI and the Prefect flow(s)."""
