"""planner: periodic decisions; in this issue the per-token-latency HPA autoscaler."""
