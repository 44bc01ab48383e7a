"""What multiprocessing's forkserver for the workers does before it forks any of them.
`worker_start.start_method` names this module as the server's whole preload list.

multiprocessing offers no hook but that list, so importing this module is the hook:
- the collector is tuned first (training/gc_tuning.py), as in every gradline process;
- the engine's preload is imported (`worker_start.PRELOAD`: the worker, MLflow's store,
  TorchDynamo);
- then the heap is frozen (`gc.freeze`).

Why freeze: a forked worker shares the server's memory until it writes to a page. When
the worker's garbage collector runs a full collection, it writes to every object it
walks. Unfrozen, that copied ~35,000 pages (~140 MB) and cost ~0.3 s of CPU in every
worker, and again in rank 0's tracking helper, at a moment nobody chose. Measured for a
2-rank, 2-step GPT job:
- a rank: 0.69 -> 0.35 CPU-s;
- the helper: 0.43 -> 0.11 CPU-s;
- the job: 1.24 -> 0.64 s.
Frozen objects are never walked. The stage host, and the server forked from a stage
(`worker_start._fork_server`), freeze just before they fork, for the same reason.
"""

from __future__ import annotations

import gc

from training.engine.worker_start import import_preload
from training.gc_tuning import tune_collector


def prepare_server() -> None:
    tune_collector()
    import_preload()
    gc.freeze()


prepare_server()
