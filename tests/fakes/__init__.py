"""Fakes of third-party APIs that cannot be installed here, and stand-in processes
(see each module's docstring)."""
from pathlib import Path

FAKE_WORKER_PROC = Path(__file__).with_name("fake_worker_proc.py")  # a stand-in worker process
