"""A stand-in worker process for gpu-agent tests (run as `python fake_worker_proc.py`;
tests name it with `tests.fakes.FAKE_WORKER_PROC`).

It prints its identity (to the agent's log file), then waits for SIGTERM and exits 0.
FAKE_WORKER_EXIT=<rc> makes it exit at once with that code; FAKE_WORKER_IGNORE_TERM=1
makes it ignore SIGTERM (so the agent must SIGKILL it). The signal disposition is set
before the identity line, so a test that has seen the line may signal it at once.
"""
import os
import signal
import sys

if __name__ == "__main__":
    env = os.environ
    if env.get("FAKE_WORKER_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:  # block SIGTERM and take it with sigwait: no handler/sleep race, no polling
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    sys.stdout.write(f"fake worker {env.get('POLYSERVE_WORKER_WORKER_ID')} "
                     f"deployment={env.get('POLYSERVE_WORKER_DEPLOYMENT')} prefix={env.get('POLYSERVE_PREFIX')}\n")
    sys.stdout.flush()
    if env.get("FAKE_WORKER_EXIT"):
        sys.exit(int(env["FAKE_WORKER_EXIT"]))
    if env.get("FAKE_WORKER_IGNORE_TERM"):
        while True:  # only SIGKILL ends it
            signal.pause()
    signal.sigwait({signal.SIGTERM})
    sys.exit(0)
