"""The distributed training engine: topology, parallelize, the loop, checkpoints, launch.

Imports neither prefect nor mlflow at module level: it runs where only torch and pyarrow
are installed (tracking off).
"""
