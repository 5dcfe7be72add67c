"""`python -m polyserve.gpu_agent`: run one gpu-agent until SIGTERM."""
from polyserve.gpu_agent.config import GpuAgentSettings
from polyserve.gpu_agent.service import GpuAgentService
from polyserve.shared.lifecycle import run_main

if __name__ == "__main__":
    raise SystemExit(run_main(GpuAgentService, GpuAgentSettings))
