"""Settings of the planner (env POLYSERVE_PLANNER_<FIELD>, flags --field-name)."""
from __future__ import annotations

from polyserve.shared.settings import CommonSettings, SettingsError


class PlannerSettings(CommonSettings, frozen=True, kw_only=True):
    """The autoscaler's knobs (the per-deployment scaler policy lives in Redis).

    poll_interval_s: the HPA polling period (thesis §5.1); one reconcile also
        runs at start.
    scale_down_stabilization_s: a scale-down goes no lower than the highest
        recommendation of this many seconds (Kubernetes HPA's
        stabilizationWindowSeconds, whose default is 300 s). 30 s = six polls:
        one quiet poll does not remove a worker the next burst needs, while
        scale-in stays fast, which is the point of the per-token policy
        (thesis §5.2, §7.4). 0 disables it. Scale-up is never delayed.
    max_step: at most this many workers added or removed per decision; 0 = no limit.
    tolerance: keep the current count while |metric/threshold − 1| <= tolerance
        (Kubernetes uses 0.1); 0 = the thesis formula exactly.
    worker_start_grace_s: no further scale-up while a worker started less than
        this long ago has not heartbeated yet; 0 disables the gate.
    reset_window_on_scale: after the planner scales a deployment, only samples
        received after that action count (older ones describe the old replica
        count and would make it overshoot).
    stop_orphans: stop workers whose deployment no longer exists in Redis.
    max_samples: per-deployment bound of the sample window.
    actuator: "agents" (start/stop worker processes through the gpu-agents) or
        "kubernetes" (patch the replicas of one Kubernetes Deployment per
        deployment, `polyserve.planner.k8s`; needs the `kubernetes` package).
    k8s_namespace, k8s_name_template: where that Deployment is and its name
        (`{deployment}` is replaced by the deployment id).
    k8s_in_cluster: use the pod's service account; False = k8s_kubeconfig
        ("" = the default kubeconfig).
    """

    poll_interval_s: float = 5.0
    scale_down_stabilization_s: float = 30.0
    max_step: int = 0
    tolerance: float = 0.0
    worker_start_grace_s: float = 180.0
    reset_window_on_scale: bool = True
    stop_orphans: bool = True
    max_samples: int = 10_000
    actuator: str = "agents"
    k8s_namespace: str = "polyserve"
    k8s_name_template: str = "polyserve-worker-{deployment}"
    k8s_in_cluster: bool = True
    k8s_kubeconfig: str = ""

    def validate(self) -> None:
        super().validate()
        if self.poll_interval_s <= 0:
            raise SettingsError("poll_interval_s must be > 0")
        if self.scale_down_stabilization_s < 0 or self.worker_start_grace_s < 0:
            raise SettingsError("scale_down_stabilization_s and worker_start_grace_s must be >= 0")
        if self.max_step < 0:
            raise SettingsError("max_step must be >= 0 (0 = no limit)")
        if not 0 <= self.tolerance < 1:
            raise SettingsError("tolerance must be in [0, 1)")
        if self.max_samples < 1:
            raise SettingsError("max_samples must be >= 1")
        if self.actuator not in ("agents", "kubernetes"):
            raise SettingsError(f"actuator {self.actuator!r} must be 'agents' or 'kubernetes'")
        if "{deployment}" not in self.k8s_name_template:
            raise SettingsError("k8s_name_template must contain {deployment}")
