"""gradline's core library: config, data, models, the distributed engine, tracking.

Nothing here imports prefect, and mlflow is imported lazily, so the engine runs on a
machine that has only torch and pyarrow.
"""
