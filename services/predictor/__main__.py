"""`python -m polyserve.predictor [--flag value ...]`."""
from polyserve.predictor.config import PredictorSettings
from polyserve.predictor.service import PredictorService
from polyserve.shared.lifecycle import run_main

if __name__ == "__main__":
    raise SystemExit(run_main(PredictorService, PredictorSettings))
