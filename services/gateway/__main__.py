"""`python -m polyserve.gateway`: the HTTP front door."""
from polyserve.shared.lifecycle import run_main

from .config import GatewaySettings
from .service import GatewayService

if __name__ == "__main__":
    raise SystemExit(run_main(GatewayService, GatewaySettings))
