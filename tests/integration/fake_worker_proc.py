"""A stand-in worker process for gpu-agent tests (run as `python fake_worker_proc.py`).

It prints its identity (to the agent's log file), then sleeps until SIGTERM and
exits 0. FAKE_WORKER_EXIT=<rc> makes it exit at once with that code;
FAKE_WORKER_IGNORE_TERM=1 makes it ignore SIGTERM (so the agent must SIGKILL it).
"""
import os
import signal
import sys
import time

stopping = False


def on_term(signum, frame):
    global stopping
    stopping = True


if __name__ == "__main__":
    env = os.environ
    sys.stdout.write(f"fake worker {env.get('POLYSERVE_WORKER_WORKER_ID')} "
                     f"deployment={env.get('POLYSERVE_WORKER_DEPLOYMENT')} prefix={env.get('POLYSERVE_PREFIX')}\n")
    sys.stdout.flush()
    if env.get("FAKE_WORKER_EXIT"):
        sys.exit(int(env["FAKE_WORKER_EXIT"]))
    signal.signal(signal.SIGTERM, signal.SIG_IGN if env.get("FAKE_WORKER_IGNORE_TERM") else on_term)
    while not stopping:
        time.sleep(0.05)
    sys.exit(0)
