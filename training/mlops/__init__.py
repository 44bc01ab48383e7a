"""MLOps around the ML core: the job's MLflow run and its lifecycle, tracking, the
registry gate, lineage, serving the registered model, the data version, and
`compare-updates`.

    jobs        run_job: the one lifecycle of a training job (train stage, comparisons,
                benchmarks)
    runs        the job's MLflow run: created or resumed, params and tags from JobSpec
    tracking    the MLflow store, rank 0's journal and the helper that ships it
    registry    model versions and the gate that moves `champion`
    lineage     where a model version came from
    serving     the registered model as an MLflow pyfunc model, and re-scoring it
    versioning  the data version (DVC's md5 of data/raw)
    compare     `gradline compare-updates` (compare_report: its table and plots)

mlflow is imported inside functions here (an optional dependency): importing these
modules costs nothing, and the engine runs where mlflow is absent.
"""
