"""gpu-agent: one per GPU; NVML (or simulated) telemetry and the worker processes on its GPU."""
