"""`python -m polyserve.planner`: run the planner until SIGTERM."""
from polyserve.planner.config import PlannerSettings
from polyserve.planner.service import PlannerService
from polyserve.shared.lifecycle import run_main

if __name__ == "__main__":
    raise SystemExit(run_main(PlannerService, PlannerSettings))
