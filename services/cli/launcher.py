"""Start and stop a whole polyserve cluster on one machine: nats-server,
redis-server and the six services as separate processes. `polyserve up/down`
and the system tests use this same code path.

Once everything is ready, `up` hands the processes to a supervisor
(`polyserve.cli.supervisor`, its pid under "supervisor" in state.json) that restarts
any that dies, with backoff; `down` stops the supervisor first, then the rest."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec
import redis

from polyserve.cli import credentials, topology
from polyserve.proto import Deployment, Keys, ScalerPolicy
from polyserve.shared import auth, infra, lifecycle
from polyserve.shared.state import connect_sync

SERVICES = ("predictor", "dispatcher", "gpu_agent", "planner", "gateway")  # start order; workers via gpu-agent
SERVICE_NAMES = {"gpu_agent": "gpu-agent"}
STOP_ORDER = ("gateway", "planner", "gpu_agent", "dispatcher", "predictor")


class LaunchError(RuntimeError):
    """polyserve could not be started or stopped; the message says what to do."""


@dataclass
class ClusterSpec:
    run_dir: Path
    engine: str = "auto"
    model: str = ""
    model_path: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    nats_port: int = 4222
    redis_port: int = 6379
    prefix: str = "polyserve"
    policy: str = "least_outstanding"
    reasoning_parser: str = ""  # the deployment's (proto Deployment.reasoning_parser): "", qwen3, deepseek_r1
    min_replicas: int = 1
    max_replicas: int = 2
    scaler: str = "pertoken"
    threshold_ms: float = 50.0
    extra_env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 120.0
    upstream_url: str = ""  # openai-http engine: the engine server polyserve fronts
    upstream_model: str = ""
    upstream_metrics_url: str = ""
    config_file: str = ""  # desired-state YAML (planner.reconcile): applied at start, re-applied on data loss
    supervise: bool = True  # restart services, nats-server and redis-server that die
    auth: bool = True  # NATS and Redis users per service (shared/auth.py, docs/security.md)
    admin_key: str | None = None  # None: $POLYSERVE_GATEWAY_ADMIN_API_KEY, else the run dir's, else a new one; "": none
    insecure: bool = False  # allow a gateway beyond loopback without an admin key
    nats_tls: auth.TlsFiles | None = None  # nats-server TLS certificate and key (and the CA clients verify with)
    gateways: int = 1  # gateway processes sharing `port` (SO_REUSEPORT); each its own in-flight limit
    dispatchers: int = 1  # dispatcher replicas in one queue group, sharing placements through `dispatched`
    nats_cluster: int = 1  # nats-servers: 1, or a cluster of >= 3 (cli/topology.py)
    redis_replica: bool = False  # a Redis replica and a Sentinel that promotes it (cli/topology.py)


@dataclass
class ClusterState:
    run_dir: str
    prefix: str
    nats_url: str
    nats_monitor_port: int
    redis_url: str
    gateway_url: str
    engine: str
    model: str
    pids: dict[str, int]
    restarts: dict[str, int] = field(default_factory=dict)  # by the supervisor, per process
    nats_config: str = ""  # the generated nats-server/redis-server configurations (secrets/)
    redis_config: str = ""
    admin_key_file: str = ""  # "" = the admin API is open
    nats_tls_ca: str = ""
    nats_nodes: list[dict] = field(default_factory=list)  # a NATS cluster's nodes (infra.NatsNode)
    redis_nodes: dict = field(default_factory=dict)  # ports of primary, replica and Sentinel

    def __repr__(self) -> str:  # no passwords in tracebacks and test reports
        return (f"ClusterState(run_dir={self.run_dir!r}, prefix={self.prefix!r}, nats_url={auth.redact(self.nats_url)!r}, "
                f"redis_url={auth.redact(self.redis_url)!r}, gateway_url={self.gateway_url!r}, pids={self.pids!r})")

    def save(self) -> None:
        """Owner-only (0600): the URLs carry the operator's credentials. Atomic: readers never see half a file."""
        auth.write_private(Path(self.run_dir, "state.json"), json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, run_dir: Path) -> "ClusterState | None":
        path = run_dir / "state.json"
        if not path.exists():
            return None
        return cls(**json.loads(path.read_text()))


def default_run_dir() -> Path:
    return Path(os.environ.get("POLYSERVE_HOME", Path.home() / ".polyserve")) / "run"


def pick_engine(engine: str) -> str:
    """`auto`: vllm when a GPU and vLLM are present, else hf when torch+transformers are, else sim."""
    if engine != "auto":
        return engine
    import importlib.util

    has = importlib.util.find_spec
    if has("vllm") and has("torch"):
        import torch

        if torch.cuda.is_available():
            return "vllm"
    if has("torch") and has("transformers") and has("polyserve.worker.engines.hf"):
        return "hf"
    return "sim"


def default_model(engine: str) -> str:
    return {"sim": "sim-llama2-70b", "hf": "tiny-llama-random", "vllm": "vllm-model",
            "openai-http": "upstream-model"}.get(engine, engine)


def upstream_env(spec: ClusterSpec) -> dict[str, str]:
    """The openai-http worker settings `up` passes on (workers inherit the gpu-agent's env)."""
    env = {}
    for name in ("upstream_url", "upstream_model", "upstream_metrics_url"):
        if getattr(spec, name):
            env[f"POLYSERVE_WORKER_{name.upper()}"] = getattr(spec, name)
    return env


def reasoning_env(spec: ClusterSpec, env: dict[str, str]) -> dict[str, str]:
    """vLLM's own reasoning parser for a vllm worker of a `--reasoning-parser` deployment, so its
    structured outputs are constrained after the thinking (gateway/reasoning.py `gate`); engine args
    the operator set in POLYSERVE_WORKER_VLLM_ENGINE_ARGS win."""
    if not spec.reasoning_parser:
        return {}
    args = json.loads(env.get("POLYSERVE_WORKER_VLLM_ENGINE_ARGS") or "{}")
    return {"POLYSERVE_WORKER_VLLM_ENGINE_ARGS": json.dumps({"reasoning_parser": spec.reasoning_parser, **args})}


def _port(wanted: int) -> int:
    return wanted if wanted and not infra.port_in_use(wanted) else infra.free_port()


def _env(state: ClusterState, spec: ClusterSpec) -> dict[str, str]:
    """What every service's environment starts from: no credentials (`spawn_service` adds each its own)."""
    env = dict(os.environ)
    env.update({"POLYSERVE_NATS_URL": auth.strip_userinfo(state.nats_url),
                "POLYSERVE_REDIS_URL": auth.strip_userinfo(state.redis_url),
                "POLYSERVE_PREFIX": state.prefix, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    if state.nats_tls_ca:
        env["POLYSERVE_NATS_TLS_CA"] = state.nats_tls_ca
    env.update(spec.extra_env)
    env.pop(credentials.ADMIN_KEY_ENV, None)  # only the gateway gets it (spawn_service)
    return env


def gateway_names(n: int) -> list[str]:
    """The process names of `n` gateways: "gateway", then "gateway-2", "gateway-3", ..."""
    return ["gateway"] + [f"gateway-{i}" for i in range(2, n + 1)]


def dispatcher_names(n: int) -> list[str]:
    """The process names of `n` dispatcher replicas: "dispatcher", then "dispatcher-2", ..."""
    return ["dispatcher"] + [f"dispatcher-{i}" for i in range(2, n + 1)]


REPLICATED = ("gateway", "dispatcher")  # services `up` may start several of; each logs to <name>.log


def replica_names(svc: str, spec: ClusterSpec) -> list[str]:
    """The process names `up` starts for `svc` (as in SERVICES)."""
    if svc == "gateway":
        return gateway_names(spec.gateways)
    if svc == "dispatcher":
        return dispatcher_names(spec.dispatchers)
    return [SERVICE_NAMES.get(svc, svc)]


def module_of(name: str) -> str:
    """The module (`svc` as in SERVICES) a process name of state.json runs: "gateway-2" -> "gateway"."""
    for svc in REPLICATED:
        if name.startswith(f"{svc}-"):
            return svc
    return {v: k for k, v in SERVICE_NAMES.items()}.get(name, name)


def spawn_service(svc: str, env: dict[str, str], run_dir: Path, name: str = "") -> subprocess.Popen:
    """One service process (`svc` as in SERVICES) with its own credentials (every gateway
    process the gateway user's), its output appended to logs/<name or svc>.log."""
    env = credentials.service_env(SERVICE_NAMES.get(svc, svc), env, run_dir)
    log = open(Path(run_dir) / "logs" / f"{name or svc}.log", "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", f"polyserve.{svc}"], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    finally:
        log.close()


def load_config(spec: ClusterSpec):
    """The validated desired-state file of `spec` (None without one); LaunchError says what is wrong."""
    if not spec.config_file:
        return None
    from polyserve.planner.reconcile import ConfigError, load_desired_state

    try:
        return load_desired_state(spec.config_file)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from exc


def apply_config(redis_url: str, prefix: str, desired) -> None:
    import asyncio

    from polyserve.planner.reconcile import apply_desired_state
    from polyserve.shared.state import State, connect

    async def run() -> None:
        st = State(connect(redis_url), Keys(prefix))
        try:
            await apply_desired_state(st, desired)
        finally:
            await st.close()

    asyncio.run(run())


def start_supervisor(state: ClusterState, env: dict[str, str]) -> int:
    """Hand the processes to `polyserve.cli.supervisor` (it inherits the services' env)."""
    log = open(Path(state.run_dir) / "logs" / "supervisor.log", "ab")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "polyserve.cli.supervisor", state.run_dir], stdout=log,
                                stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    finally:
        log.close()
    state.pids["supervisor"] = proc.pid
    state.save()
    return proc.pid


def _ensure_deployment(r: redis.Redis, keys: Keys, spec: ClusterSpec, engine: str, model: str) -> str:
    """The deployment of `model` (created unless Redis has it); its id."""
    dep_id = "".join(c if c.isalnum() or c in "-_" else "-" for c in model)[:64]
    if r.exists(keys.deployment(dep_id)):
        return dep_id
    dep = Deployment(id=dep_id, model=model, engine=engine, policy=spec.policy,
                     reasoning_parser=spec.reasoning_parser,
                     scaler=ScalerPolicy(type=spec.scaler, min_replicas=spec.min_replicas,
                                         max_replicas=spec.max_replicas, threshold_ms=spec.threshold_ms))
    r.set(keys.deployment(dep_id), msgspec.json.encode(dep))
    r.sadd(keys.deployments, dep_id)
    return dep_id


def live_json(r: redis.Redis, index: str, key_of) -> list[dict]:
    """The live entries of a Redis registry index (members scored with their expiry), as JSON."""
    members = [m.decode() for m in r.zrangebyscore(index, time.time(), "+inf")]
    raws = r.mget([key_of(m) for m in members]) if members else []
    return [json.loads(x) for x in raws if x]


def live_counts(r: redis.Redis, keys: Keys, deployment: str = "") -> tuple[set[str], int, int]:
    """(live service names, live workers (of `deployment` when given), live gateway instances)
    in the Redis registry."""
    now = time.time()
    names = [m.decode().split(":", 1)[0] for m in r.zrangebyscore(keys.services, now, "+inf")]
    if deployment:
        workers = sum(1 for w in live_json(r, keys.workers, keys.worker) if w.get("deployment") == deployment)
    else:
        workers = r.zcount(keys.workers, now, "+inf")
    return set(names), workers, names.count("gateway")


def _check(spec: ClusterSpec) -> tuple[str, str, object]:
    """The engine, the model and the desired state `up` will start with; LaunchError if it cannot."""
    old = ClusterState.load(spec.run_dir)
    if old and any(infra.pid_alive(p) for p in old.pids.values()):
        raise LaunchError(f"polyserve is already running from {spec.run_dir} (gateway {old.gateway_url}); "
                          "run `polyserve down` first")
    if spec.nats_cluster != 1 and spec.nats_cluster < 3:
        raise LaunchError(f"--nats-cluster {spec.nats_cluster}: 1, or 3 or more nodes (JetStream's replicated "
                          "stream needs a majority of three to survive the loss of one)")
    desired = load_config(spec)
    engine = pick_engine(spec.engine)
    if engine == "vllm" and not spec.model_path:
        raise LaunchError("the vllm engine needs a model: pass --model-path DIR (a local checkpoint)")
    if engine == "openai-http" and not (spec.upstream_url or spec.extra_env.get("POLYSERVE_WORKER_UPSTREAM_URL")
                                        or os.environ.get("POLYSERVE_WORKER_UPSTREAM_URL")):
        raise LaunchError("the openai-http engine needs the engine server's address: pass --upstream-url URL "
                          "(e.g. http://127.0.0.1:8001 where `vllm serve` listens)")
    if not auth.is_loopback(spec.host) and spec.admin_key == "" and not spec.insecure:
        raise LaunchError(f"refusing to expose the gateway on {spec.host} without an admin API key: anyone who "
                          "reaches it could change deployments and adapters. Drop --no-admin-key, or pass "
                          "--insecure if this network is trusted")
    model = spec.model or (spec.upstream_model if engine == "openai-http" else "") or default_model(engine)
    if desired is not None and desired.deployments:  # the file's deployments replace the default one
        engine, model = desired.deployments[0].engine, desired.deployments[0].model
    return engine, model, desired


def up(spec: ClusterSpec, progress=print) -> ClusterState:
    """Start everything, wait until every service and one worker report ready, then hand
    the processes to the supervisor (unless `spec.supervise` is off)."""
    run_dir = spec.run_dir
    engine, model, desired = _check(spec)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)  # state, logs and secrets: the owner's only
    sec, files = credentials.secure(spec, progress)
    progress(f"starting nats-server and redis-server (run dir {run_dir})")
    pids: dict[str, int] = {}
    try:
        nats, red = _start_infra(spec, sec, files, pids)
        nats_url, redis_url = nats.url, red.url
        port = _port(spec.port)
        if sec is not None:  # the launcher, the supervisor and `polyserve status/events` act as the operator
            nats_url = auth.with_userinfo(nats_url, auth.OPERATOR, sec.nats[auth.OPERATOR])
            redis_url = auth.with_userinfo(redis_url, auth.OPERATOR, sec.redis[auth.OPERATOR])
        state = ClusterState(run_dir=str(run_dir), prefix=spec.prefix, nats_url=nats_url,
                             nats_monitor_port=nats.monitor_port, redis_url=redis_url,
                             gateway_url=f"http://{spec.host}:{port}", engine=engine,
                             model=model, pids=pids, **files, **nats.extra, **red.extra)
        state.save()
        keys = Keys(spec.prefix)
        r = connect_sync(redis_url)
        wait_redis(r, 10.0)
        if desired is not None:
            apply_config(redis_url, spec.prefix, desired)
        dep_id = ""  # with a config file, any worker; else one of the deployment of `model`
        if desired is None or not desired.deployments:
            dep_id = _ensure_deployment(r, keys, spec, engine, model)
        env = _service_env(state, spec, port)
        for svc in SERVICES:
            for name in replica_names(svc, spec):
                pids[name] = spawn_service(svc, env, run_dir, name if svc in REPLICATED else "").pid
                state.save()
        progress(f"started {', '.join(SERVICE_NAMES.get(s, s) for s in SERVICES)}; waiting for them and a "
                 f"{engine} worker{f' of {dep_id}' if dep_id else ''} to report ready")
        wait_ready(r, keys, state, spec.ready_timeout_s, progress, gateways=spec.gateways, deployment=dep_id)
        if spec.supervise:
            start_supervisor(state, env)
        return state
    except BaseException:
        st = ClusterState.load(run_dir)
        if st:
            down(run_dir, progress=lambda *_: None)
        else:
            topology.stop(pids)
        raise


def _start_infra(spec: ClusterSpec, sec, files: dict[str, str], pids: dict[str, int]):
    """nats-server(s) and redis-server(s) as `spec` asks; their pids go into `pids` as they start."""
    if spec.nats_cluster > 1:
        nats = topology.start_nats_cluster(spec, sec, _port(spec.nats_port))
    else:
        proc, url, mon = infra.start_nats(spec.run_dir / "nats", port=_port(spec.nats_port),
                                          config=files.get("nats_config"))
        nats = topology.Started({"nats-server": proc.pid}, url, mon)
    pids.update(nats.pids)
    redis_port = _port(spec.redis_port)
    if spec.redis_replica:
        red = topology.start_redis_replicated(spec, files, redis_port)
    else:
        proc, url = infra.start_redis(spec.run_dir / "redis", port=redis_port, config=files.get("redis_config"))
        red = topology.Started({"redis-server": proc.pid}, url)
    pids.update(red.pids)
    return nats, red


def read_admin_key(run_dir: Path) -> str:
    """The admin API key `up` stored for this run dir ("" when the admin API is open)."""
    state = ClusterState.load(Path(run_dir))
    path = Path(state.admin_key_file) if state and state.admin_key_file else Path(run_dir) / "secrets" / "admin.key"
    return path.read_text().strip() if path.exists() else ""


def _service_env(state: ClusterState, spec: ClusterSpec, port: int) -> dict[str, str]:
    env = _env(state, spec)
    env.update({"POLYSERVE_GATEWAY_PORT": str(port), "POLYSERVE_GATEWAY_HOST": spec.host,
                "POLYSERVE_GPU_AGENT_WORKER_LOG_DIR": str(spec.run_dir / "logs" / "workers")})
    if spec.model_path:
        env["POLYSERVE_WORKER_MODEL_PATH"] = spec.model_path
    if spec.config_file:
        env["POLYSERVE_PLANNER_DESIRED_STATE_FILE"] = str(Path(spec.config_file).resolve())
    env.update(upstream_env(spec))
    env.update(reasoning_env(spec, env))
    if spec.gateways > 1:  # one port for all of them: the kernel spreads the connections
        env["POLYSERVE_GATEWAY_REUSE_PORT"] = "true"
    env.setdefault("POLYSERVE_GATEWAY_ADAPTER_ROOTS", str(default_run_dir().parent / "adapters"))  # issue 14
    return env


def wait_redis(r: redis.Redis, timeout: float) -> None:
    """Until Redis answers (it loads its append-only file before it does)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r.ping()
            return
        except (redis.BusyLoadingError, redis.ConnectionError):
            if time.monotonic() > deadline:
                raise LaunchError(f"redis-server did not answer within {timeout:.0f}s") from None
            time.sleep(0.05)


def _failed_workers(log_dir: Path, known: dict[Path, str], since: float) -> dict[Path, str]:
    """Worker logs (the gpu-agent's, `logs/workers`) written since `since` (wall clock; older ones
    are earlier runs') whose last line says the worker stopped with an error and that are not in
    `known` yet: {log: the error}; `known` gains them."""
    new = {}
    for log in sorted(log_dir.glob("*.log")) if log_dir.is_dir() else ():
        if log in known:
            continue
        try:
            if log.stat().st_mtime < since:
                continue
            with open(log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            continue
        if lines and lifecycle.FATAL in lines[-1]:
            new[log] = known[log] = lines[-1].split(lifecycle.FATAL, 1)[1]
    return new


def wait_ready(r: redis.Redis, keys: Keys, state: ClusterState, timeout: float, progress=print,
               gateways: int = 1, deployment: str = "") -> None:
    """Until every service, `gateways` gateways and a worker (of `deployment` when given: a run
    folder may keep other deployments, whose workers can be ready first) are in the registry."""
    want = {SERVICE_NAMES.get(s, s) for s in SERVICES}
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    failed: dict[Path, str] = {}
    since = time.time() - 1.0
    while time.monotonic() < deadline:
        for log, error in _failed_workers(Path(state.run_dir, "logs", "workers"), failed, since).items():
            progress(f"  a worker stopped: {error} (log {log})")
            if deployment:  # the one deployment `up` started: its worker cannot start as configured
                raise LaunchError(f"the {state.engine} worker of {deployment} could not start: {error}; "
                                  f"log {log}")
        for name, pid in state.pids.items():
            if not infra.pid_alive(pid):
                log = Path(state.run_dir, "logs", f"{name if name.startswith(REPLICATED) else module_of(name)}.log")
                raise LaunchError(f"{name} exited during start-up; see {log}")
        services, workers, live_gateways = live_counts(r, keys, deployment)
        for name in sorted((services & want) - seen):
            progress(f"  {name} ready")
        seen |= services & want
        if want <= services and workers >= 1 and live_gateways >= gateways:
            progress(f"  worker ready ({workers})")
            return
        time.sleep(0.2)
    worker = f"a worker of {deployment}" if deployment else "worker"
    missing = sorted(want - seen) + ([] if live_counts(r, keys, deployment)[1] else [worker])
    raise LaunchError(f"not ready within {timeout:.0f}s: {', '.join(missing)}; logs in {state.run_dir}/logs")


def down(run_dir: Path, timeout: float = 30.0, progress=print) -> bool:
    """Stop the supervisor (no more restarts), then SIGTERM the services (gateway first),
    then redis and nats; True if all exited gracefully."""
    state = ClusterState.load(run_dir)
    if state is None:
        progress(f"nothing to stop: no polyserve started from {run_dir}")
        return True
    graceful = True
    sup = state.pids.get("supervisor")
    if sup and infra.pid_alive(sup):
        graceful &= infra.stop_pid(sup, timeout=15.0)  # it finishes a restart under way, then exits
        state = ClusterState.load(run_dir) or state  # the pids it restarted
        n = sum(state.restarts.values())
        progress(f"stopped the supervisor (pid {sup}; {n} restart{'s' if n != 1 else ''})")
    extra_replicas = sorted(n for n in state.pids if n.startswith(("gateway-", "dispatcher-")))
    nats_nodes = sorted(n for n in state.pids if n.startswith("nats-") and n != "nats-server")
    order = (extra_replicas + [SERVICE_NAMES.get(s, s) for s in STOP_ORDER]
             + [topology.SENTINEL, topology.REPLICA, "redis-server", "nats-server", *nats_nodes])
    for name in order:
        pid = state.pids.get(name)
        if pid and infra.pid_alive(pid):
            ok = infra.stop_pid(pid, timeout=timeout)
            graceful &= ok
            progress(f"stopped {name} (pid {pid})" + ("" if ok else " forcibly after timeout"))
    Path(run_dir, "state.json").unlink(missing_ok=True)
    for name in ("credentials.json", "nats.conf", "redis.conf", "sentinel.conf",  # regenerated by the next `up`
                 *(f"{n}.conf" for n in nats_nodes)):
        Path(run_dir, "secrets", name).unlink(missing_ok=True)
    return graceful
