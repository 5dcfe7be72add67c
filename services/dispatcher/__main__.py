"""`python -m polyserve.dispatcher [--flag value ...]`."""
from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.service import DispatcherService
from polyserve.shared.lifecycle import run_main

if __name__ == "__main__":
    raise SystemExit(run_main(DispatcherService, DispatcherSettings))
