"""`python -m polyserve.worker [--flag value ...]` (env `POLYSERVE_WORKER_*`).

The worker_id is generated (`w-<hex6>`) when not given.
"""
from polyserve.shared.lifecycle import run_main
from polyserve.worker.config import WorkerSettings
from polyserve.worker.service import WorkerService

if __name__ == "__main__":
    raise SystemExit(run_main(WorkerService, WorkerSettings))
