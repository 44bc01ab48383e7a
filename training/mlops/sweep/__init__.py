"""`gradline sweep`: a hyperparameter search over the job's keys with Optuna.

plan     the sweep section checked against the config (plan_sweep, trial_config)
study    the Optuna study in sweeps/<name>/optuna.db: fingerprint, budget, resumes
trial    one trial: its job through run_job, pruned from its journal
report   the trials table, the plots and the best trial on the parent run
driver   the trial threads under one parent run, signals (run_sweep)
apply    the best trial's keys into params.yaml (apply_best)
"""

from training.mlops.sweep.apply import apply_best
from training.mlops.sweep.driver import SweepInterrupted, SweepReport, run_sweep
from training.mlops.sweep.plan import SweepPlan, plan_sweep

__all__ = ["SweepInterrupted", "SweepPlan", "SweepReport", "apply_best", "plan_sweep", "run_sweep"]
