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
    tracking_hold_s: a `target_tracking` deployment removes a worker after its P98
        latency stayed below half its SLO this long (Arlo §4: 60 s).
    stop_orphans: stop workers whose deployment was deleted: one this planner saw
        in Redis and then no longer finds while Redis kept its data (an explicit
        delete). An empty or failed read after a Redis restart or data loss never
        stops a worker (`reconcile.OrphanTracker`).
    orphan_grace_s: workers of a deployment this planner never saw (it restarted
        after the delete) are stopped after the deployment stayed absent this long
        while Redis kept its data; 0 = never.
    desired_state_file: a desired-state YAML file (`polyserve up --config FILE`,
        docs/configuration.md); applied whenever Redis holds no deployment. "" = none.
    desired_state_interval_s: how often the planner checks Redis for deployments
        when desired_state_file is set (one SCARD).
    max_samples: per-deployment bound of the sample window.
    max_replicas_limit: no deployment gets more workers than this, whatever its scaler
        policy in Redis says (the gateway refuses larger ones; a policy written into Redis
        directly is clamped, with a warning). Nothing the planner does loops over more.
    max_starts_per_tick: at most this many workers of one deployment are started per
        reconcile (or scale signal); a larger scale-out continues on the next ones.
    actuator: "agents" (start/stop worker processes through the gpu-agents) or
        "kubernetes" (patch the replicas of one Kubernetes Deployment per
        deployment, `polyserve.planner.k8s`; needs the `kubernetes` package).
    k8s_namespace, k8s_name_template: where that Deployment is and its name
        (`{deployment}` is replaced by the deployment id).
    k8s_in_cluster: use the pod's service account; False = k8s_kubeconfig
        ("" = the default kubeconfig).

    Scale signals (`ScaleSignal` on `<prefix>.v1.events.plan.signal.<deployment>`):
    honoured only by deployments whose scaler type is signal-driven
    (`polyserve.core.names.SIGNAL_SCALERS`; their sources: `policy.SIGNAL_SOURCES`).
    signal_cooldown_s: after the planner acted on a signal of a deployment, further
        signals of it are dropped for this long (a burst starts one worker); signals
        are also dropped while a worker started earlier has not heartbeated yet
        (within worker_start_grace_s).

    Arlo runtime re-planning (§3.3/§4; `arlo_live.py`) of deployments whose engine is
    `encoder`:
    arlo_enabled: run the re-plan loop.
    arlo_period_s: its period (Arlo: 120 s); the request lengths of the last period
        make the per-bin demand.
    arlo_apply: carry the plan out through the gpu-agents (stop the instances of
        runtimes that lose, start the new runtime on the same GPU). When a moving
        instance is not managed by a live gpu-agent the plan is published with
        applied=false and the reason. False = publish only.
    arlo_profile: EncoderProfile JSON (`polyserve profile --encoder`) with the
        runtimes; "" = the one a worker of the deployment reports in its heartbeat
        when the planner can read it, else the shipped CPU MiniLM profile.
    arlo_min_gain: keep the current allocation when its objective is within this
        fraction of the optimum (re-loading instances is not free).
    arlo_batch: instances re-loaded per batch (Arlo §4); batches run in order.
    """

    poll_interval_s: float = 5.0
    scale_down_stabilization_s: float = 30.0
    max_step: int = 0
    tolerance: float = 0.0
    worker_start_grace_s: float = 180.0
    reset_window_on_scale: bool = True
    tracking_hold_s: float = 60.0
    stop_orphans: bool = True
    orphan_grace_s: float = 600.0
    desired_state_file: str = ""
    desired_state_interval_s: float = 1.0
    max_samples: int = 10_000
    max_replicas_limit: int = 1024
    max_starts_per_tick: int = 64
    actuator: str = "agents"
    k8s_namespace: str = "polyserve"
    k8s_name_template: str = "polyserve-worker-{deployment}"
    k8s_in_cluster: bool = True
    k8s_kubeconfig: str = ""
    signal_cooldown_s: float = 10.0
    arlo_enabled: bool = True
    arlo_period_s: float = 120.0
    arlo_apply: bool = True
    arlo_profile: str = ""
    arlo_min_gain: float = 0.05
    arlo_batch: int = 2

    def validate(self) -> None:
        super().validate()
        if self.poll_interval_s <= 0:
            raise SettingsError("poll_interval_s must be > 0")
        if min(self.scale_down_stabilization_s, self.worker_start_grace_s, self.tracking_hold_s) < 0:
            raise SettingsError("scale_down_stabilization_s, worker_start_grace_s and tracking_hold_s must be >= 0")
        if self.orphan_grace_s < 0 or self.desired_state_interval_s <= 0:
            raise SettingsError("need orphan_grace_s >= 0 and desired_state_interval_s > 0")
        if self.max_step < 0:
            raise SettingsError("max_step must be >= 0 (0 = no limit)")
        if not 0 <= self.tolerance < 1:
            raise SettingsError("tolerance must be in [0, 1)")
        if min(self.max_samples, self.max_replicas_limit, self.max_starts_per_tick) < 1:
            raise SettingsError("max_samples, max_replicas_limit and max_starts_per_tick must be >= 1")
        if self.actuator not in ("agents", "kubernetes"):
            raise SettingsError(f"actuator {self.actuator!r} must be 'agents' or 'kubernetes'")
        if self.signal_cooldown_s < 0:
            raise SettingsError("signal_cooldown_s must be >= 0")
        if self.arlo_period_s <= 0 or self.arlo_min_gain < 0 or self.arlo_batch < 1:
            raise SettingsError("need arlo_period_s > 0, arlo_min_gain >= 0 and arlo_batch >= 1")
        if "{deployment}" not in self.k8s_name_template:
            raise SettingsError("k8s_name_template must contain {deployment}")
