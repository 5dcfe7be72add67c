"""Versioned NATS subjects and namespaced Redis keys; catalogue in proto/README.md.

Both take a prefix ("polyserve" by default) so tests can isolate themselves on
one nats-server and one redis-server.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Subjects:
    prefix: str = "polyserve"

    @property
    def predict(self) -> str:
        return f"{self.prefix}.v1.predict"

    @property
    def predict_batch(self) -> str:
        """PredictBatch -> Predictions: the gateway's predictions nobody waits for, gathered."""
        return f"{self.prefix}.v1.predict_batch"

    @property
    def dispatch(self) -> str:
        return f"{self.prefix}.v1.dispatch"

    def generate(self, worker_id: str) -> str:
        return f"{self.prefix}.v1.worker.{worker_id}.generate"

    def cancel(self, worker_id: str) -> str:
        return f"{self.prefix}.v1.worker.{worker_id}.cancel"

    def adapters(self, deployment: str) -> str:
        """Broadcast to every worker of a deployment: AdapterCommand (load/unload)."""
        return f"{self.prefix}.v1.adapters.{deployment}"

    def agent(self, gpu_id: str, action: str) -> str:
        return f"{self.prefix}.v1.agent.{gpu_id}.{action}"

    @property
    def prefixes(self) -> str:
        """PrefixPlaced, gateway to gateways: the prompt starts each placed (gateway/prefixes.py)."""
        return f"{self.prefix}.v1.gateway.prefixes"

    def event(self, kind: str) -> str:
        """Request events: admitted, predicted, dispatched, first_token, completed, failed."""
        return f"{self.prefix}.v1.events.request.{kind}"

    def worker_event(self, kind: str) -> str:
        """heartbeat, up, down."""
        return f"{self.prefix}.v1.events.worker.{kind}"

    def service_event(self, name: str) -> str:
        return f"{self.prefix}.v1.events.service.{name}"

    def scale(self, deployment: str) -> str:
        return f"{self.prefix}.v1.events.plan.scale.{deployment}"

    def gpu_telemetry(self, gpu_id: str) -> str:
        return f"{self.prefix}.v1.telemetry.gpu.{gpu_id}"

    def gpu_clock(self, gpu_id: str) -> str:
        """ClockDecision (MIAD) of one GPU."""
        return f"{self.prefix}.v1.telemetry.clock.{gpu_id}"

    def gpu_energy(self, gpu_id: str) -> str:
        """EnergyReport of one GPU."""
        return f"{self.prefix}.v1.telemetry.energy.{gpu_id}"

    def scale_signal(self, deployment: str) -> str:
        """ScaleSignal: dispatcher or gpu-agent asks the planner for one more worker."""
        return f"{self.prefix}.v1.events.plan.signal.{deployment}"

    def runtime_plan(self, deployment: str) -> str:
        """RuntimePlan (Arlo re-plan) of one deployment."""
        return f"{self.prefix}.v1.events.plan.runtimes.{deployment}"

    def withdraw(self, worker_id: str) -> str:
        """Withdraw -> WithdrawReply: take back a request that has not started."""
        return f"{self.prefix}.v1.worker.{worker_id}.withdraw"

    def replay(self, worker_id: str) -> str:
        """ReplayRequest -> ReplayReply: re-send chunks of a stream (a `seq` gap, or a liveness probe)."""
        return f"{self.prefix}.v1.worker.{worker_id}.replay"

    def credit(self, worker_id: str) -> str:
        """Credit (no reply): flow control of the streams on one worker (slow readers)."""
        return f"{self.prefix}.v1.worker.{worker_id}.credit"

    def embed(self, worker_id: str) -> str:
        """An encoder worker's embeddings: EmbedRequest -> EmbedReply."""
        return f"{self.prefix}.v1.worker.{worker_id}.embed"

    @property
    def all(self) -> str:
        return f"{self.prefix}.>"


@dataclass(frozen=True)
class Keys:
    prefix: str = "polyserve"

    def deployment(self, dep_id: str) -> str:
        return f"{self.prefix}:deployment:{dep_id}"

    @property
    def deployments(self) -> str:
        return f"{self.prefix}:deployments"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def service(self, name: str, instance: str) -> str:
        return f"{self.prefix}:service:{name}:{instance}"

    @property
    def services(self) -> str:
        return f"{self.prefix}:services"

    def agent(self, gpu_id: str) -> str:
        return f"{self.prefix}:agent:{gpu_id}"

    @property
    def agents(self) -> str:
        return f"{self.prefix}:agents"

    def gpu(self, gpu_id: str) -> str:
        return f"{self.prefix}:gpu:{gpu_id}"

    def gpu_energy(self, gpu_id: str, total: bool = False) -> str:
        """Latest `EnergyReport` of a GPU (`total`: the running sum since its agent started)."""
        return f"{self.prefix}:gpu:{gpu_id}:energy" + (":total" if total else "")

    def lenstats(self, model: str) -> str:
        return f"{self.prefix}:lenstats:{model}"

    def adapter(self, name: str) -> str:
        return f"{self.prefix}:adapter:{name}"

    @property
    def adapters(self) -> str:
        return f"{self.prefix}:adapters"

    def plan(self, deployment: str) -> str:
        return f"{self.prefix}:plan:{deployment}"

    def predcache(self, space: str, model: str) -> str:
        """Semantic cache entries of one target model in one embedding space."""
        return f"{self.prefix}:predcache:{space}:m:{model}"

    def predcache_index(self, space: str) -> str:
        """Semantic cache eviction index of one embedding space."""
        return f"{self.prefix}:predcache:{space}:index"

    def runtime_plan(self, deployment: str) -> str:
        return f"{self.prefix}:runtimeplan:{deployment}"

    def perf_fit(self, worker_id: str) -> str:
        """A dispatcher's online performance-model fit of one worker (coefficients, errors)."""
        return f"{self.prefix}:perffit:{worker_id}"

    def response(self, response_id: str) -> str:
        """A stored Responses API response and its conversation (`/v1/responses`), with a TTL."""
        return f"{self.prefix}:response:{response_id}"
