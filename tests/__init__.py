"""gradline's test suite. Each test process tunes Python's garbage collector as gradline's
own processes do (training/gc_tuning.py), before collecting the test modules imports
torch, MLflow, Prefect and DVC."""

from training.gc_tuning import tune_collector

tune_collector()
