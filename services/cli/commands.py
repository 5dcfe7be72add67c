"""The `polyserve` command: start and stop a cluster (up, down), look at it (status, events, health),
and its tools (API keys, LoRA adapters, the length predictor, engine profiles, the simulator, benchmarks)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import ssl
import sys
import time
from pathlib import Path

from polyserve.cli import launcher
from polyserve.shared.auth import redact


def _say(msg: str) -> None:
    print(msg, flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    spec = launcher.ClusterSpec(run_dir=Path(args.run_dir), engine=args.engine, model=args.model or "",
                                model_path=args.model_path or "", host=args.host, port=args.port,
                                prefix=args.prefix, policy=args.policy, reasoning_parser=args.reasoning_parser,
                                min_replicas=args.min_replicas,
                                max_replicas=args.max_replicas, ready_timeout_s=args.timeout,
                                upstream_url=args.upstream_url or "", upstream_model=args.upstream_model or "",
                                upstream_metrics_url=args.upstream_metrics_url or "",
                                config_file=args.config or "", supervise=not args.no_supervisor,
                                admin_key="" if args.no_admin_key else None, insecure=args.insecure,
                                nats_tls=_tls(args), gateways=args.gateways, nats_cluster=args.nats_cluster,
                                dispatchers=args.dispatchers,
                                redis_replica=args.redis_replica)
    if args.gateways < 1:
        _say("polyserve up failed: --gateways must be >= 1")
        return 2
    if args.dispatchers < 1:
        _say("polyserve up failed: --dispatchers must be >= 1")
        return 2
    t0 = time.monotonic()
    try:
        state = launcher.up(spec, progress=_say)
    except (launcher.LaunchError, OSError) as exc:
        _say(f"polyserve up failed: {exc}")
        return 1
    _say(f"\npolyserve is up in {time.monotonic() - t0:.1f}s (engine {state.engine}, model '{state.model}')")
    _say(f"  gateway      {state.gateway_url}/v1   (OpenAI-compatible; try GET {state.gateway_url}/v1/models)"
         + (f"; {spec.gateways} processes on this port" if spec.gateways > 1 else ""))
    if state.admin_key_file:
        _say(f"  admin key    {state.admin_key_file}   (owner-only; admin API: "
             f"curl -H \"Authorization: Bearer $(cat {shlex.quote(str(state.admin_key_file))})\" "
             f"{state.gateway_url}/v1/deployments)")
    else:
        _say("  admin key    none: the admin API is open")
    _say(f"  events       polyserve events      (or: nats sub '{state.prefix}.>' --server {redact(state.nats_url)}, "
         f"password in {state.run_dir}/secrets/credentials.json)")
    if state.nats_nodes or state.redis_nodes:
        from polyserve.cli.topology import describe

        _say(f"  topology     {describe(state)}")
    _say(f"  status       polyserve status      logs in {state.run_dir}/logs")
    if spec.supervise:
        _say(f"  supervisor   restarts a process that dies (pid {state.pids.get('supervisor')}; "
             "logs/supervisor.log)")
    _say("  stop         polyserve down")
    if args.foreground:
        _say("running in the foreground; Ctrl-C stops everything")
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            launcher.down(Path(args.run_dir), progress=_say)
    return 0


def _tls(args: argparse.Namespace):
    if not (args.nats_tls_cert or args.nats_tls_key):
        return None
    if not (args.nats_tls_cert and args.nats_tls_key):
        raise SystemExit("polyserve up: --nats-tls-cert and --nats-tls-key go together")
    from polyserve.shared.auth import TlsFiles

    return TlsFiles(cert=str(Path(args.nats_tls_cert).resolve()), key=str(Path(args.nats_tls_key).resolve()),
                    ca=str(Path(args.nats_tls_ca).resolve()) if args.nats_tls_ca else "")


def cmd_down(args: argparse.Namespace) -> int:
    ok = launcher.down(Path(args.run_dir), timeout=args.timeout, progress=_say)
    return 0 if ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from polyserve.cli.status import cluster_status, render_status

    state = launcher.ClusterState.load(Path(args.run_dir))
    if state is None:
        _say(f"polyserve is not running (no state in {args.run_dir}); start it with `polyserve up`")
        return 1
    try:
        status = cluster_status(state)
    except Exception as exc:  # Redis down
        _say(f"cannot read cluster state from {redact(state.redis_url)}: {exc}")
        return 1
    if args.json:
        _say(json.dumps(status, indent=2))
    else:
        render_status(status)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from polyserve.cli import health

    return health.main(args.service)


def cmd_events(args: argparse.Namespace) -> int:
    """Print events as JSON lines, like `nats sub 'polyserve.>'`; with --since, the stored terminal
    events of that span first (cli/events.py)."""
    import nats

    from polyserve.cli import events
    from polyserve.shared import auth
    from polyserve.shared.bus import connect_options

    try:
        since = events.duration_s(args.since) if args.since else None
    except ValueError as exc:
        _say(f"polyserve events: {exc}")
        return 2
    state = launcher.ClusterState.load(Path(args.run_dir))
    url = args.server or (state.nats_url if state else "nats://127.0.0.1:4222")
    prefix = state.prefix if state else "polyserve"

    async def main() -> None:
        ca = (state.nats_tls_ca if state else "") or os.environ.get("POLYSERVE_NATS_TLS_CA", "")
        nc = await nats.connect(**connect_options(url), inbox_prefix=auth.inbox_prefix(auth.OPERATOR),
                                **({"tls": ssl.create_default_context(cafile=ca)} if ca else {}))
        await events.run(nc, prefix, args.subject or f"{prefix}.>", _say, since, args.count, args.seconds,
                         redact(url))
        await nc.drain()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0


# Subcommands whose module owns its own argument parsing: `main(argv) -> int`.
DELEGATED = {
    "adapter": ("polyserve.worker.lora", "create a random PEFT LoRA adapter (adapter create --rank R --out DIR)"),
    "predictor": ("polyserve.predictor.cli", "train / evaluate the output-length predictor"),
    "profile": ("polyserve.profiler.cli", "profile an engine and fit its performance models"),
    "simulate": ("polyserve.simulator.cli", "trace-driven cluster simulation"),
    "bench": ("polyserve.bench", "benchmarks (polyserve bench lists them: overhead, dispatch, replay, prefix, chaos, ...)"),
    "credentials": ("polyserve.cli.credentials", "write credentials for docker compose or Kubernetes (credentials compose|k8s)"),
    "keys": ("polyserve.cli.keys", "client API keys: keys create|list|show|delete (admin)"),
}
RENAMED = {"bench-dispatch": "dispatch", "bench-embeddings": "embeddings", "bench-lora": "lora"}
"""Old spellings (`polyserve bench-lora`) of what is now `polyserve bench lora`."""


def run_delegated(name: str, argv: list[str]) -> int:
    import importlib

    module, _ = DELEGATED[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        _say(f"`polyserve {name}` is not available in this install ({exc})")
        return 2
    return int(mod.main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polyserve", description=__doc__)
    p.add_argument("--run-dir", default=str(launcher.default_run_dir()),
                   help="where state, logs and server data live (default $POLYSERVE_HOME/run or ~/.polyserve/run)")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start nats, redis and the six services")
    up.add_argument("--engine", default="auto", choices=["auto", "sim", "hf", "vllm", "openai-http"],
                    help="auto: vllm with a GPU and vLLM, else hf, else sim; openai-http: front an "
                         "OpenAI-compatible engine server (--upstream-url)")
    up.add_argument("--model", help="model name to serve (default depends on the engine)")
    up.add_argument("--model-path", help="local Hugging Face checkpoint directory (hf/vllm engines)")
    up.add_argument("--upstream-url", help="openai-http engine: the engine server's address, e.g. "
                    "http://127.0.0.1:8001 (`vllm serve`, SGLang, TGI, `transformers serve`); an API key goes in "
                    "env POLYSERVE_WORKER_UPSTREAM_API_KEY")
    up.add_argument("--upstream-model", help="openai-http engine: the model name the server serves "
                    "(default: the first it lists)")
    up.add_argument("--upstream-metrics-url", help="openai-http engine: its Prometheus metrics "
                    "(default <upstream-url>/metrics; 'off' = none)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--gateways", type=int, default=1, metavar="N",
                    help="gateway processes serving --port together (SO_REUSEPORT; the in-flight limit is "
                         "per process)")
    up.add_argument("--dispatchers", type=int, default=1, metavar="N",
                    help="dispatcher replicas in one queue group (each counts the others' placements from "
                         "`dispatched` events; the supervisor restarts each)")
    up.add_argument("--prefix", default="polyserve")
    up.add_argument("--policy", default="least_outstanding")
    up.add_argument("--reasoning-parser", default="", choices=["", "qwen3", "deepseek_r1"],
                    help="the model thinks between <think> tags (vLLM's parser names): chat answers carry its "
                         "reasoning apart from the content (docs/openai-compatibility.md)")
    up.add_argument("--min-replicas", type=int, default=1)
    up.add_argument("--max-replicas", type=int, default=2)
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    up.add_argument("--config", metavar="FILE", help="desired state (YAML: deployments, adapters; "
                    "docs/configuration.md): applied at start and again whenever Redis has no deployment")
    up.add_argument("--no-supervisor", action="store_true", help="do not restart processes that die")
    up.add_argument("--no-admin-key", action="store_true", help="leave the admin API open (by default `up` "
                    "generates a key into RUN_DIR/secrets/admin.key, or uses $POLYSERVE_GATEWAY_ADMIN_API_KEY)")
    up.add_argument("--insecure", action="store_true", help="allow --host beyond loopback without an admin key")
    up.add_argument("--nats-tls-cert", help="nats-server TLS certificate (PEM); with --nats-tls-key")
    up.add_argument("--nats-tls-key", help="nats-server TLS private key (PEM)")
    up.add_argument("--nats-tls-ca", help="CA (PEM) the services verify nats-server's certificate with")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="run N >= 3 nats-servers as one cluster (routes, JetStream replicated) on this host; "
                         "the services fail over between them (docs/reliability.md)")
    up.add_argument("--redis-replica", action="store_true",
                    help="also run a Redis replica and a Sentinel that promotes it when the primary dies")
    up.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops everything")
    up.set_defaults(fn=cmd_up)

    down = sub.add_parser("down", help="stop everything `up` started, gracefully")
    down.add_argument("--timeout", type=float, default=30.0)
    down.set_defaults(fn=cmd_down)

    st = sub.add_parser("status", help="services, workers and GPUs")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)

    ev = sub.add_parser("events", help="print events (like `nats sub 'polyserve.>'`)")
    ev.add_argument("--subject")
    ev.add_argument("--server")
    ev.add_argument("--count", type=int, default=0, help="stop after this many events")
    ev.add_argument("--seconds", type=float, default=0, help="stop after this long")
    ev.add_argument("--since", metavar="DURATION", help="first the stored completed/failed request events of "
                    "this span (90s, 15m, 2h; the stream keeps an hour), then live events")
    ev.set_defaults(fn=cmd_events)

    hc = sub.add_parser("health", help="container healthcheck: the gateway's /readyz, else a live registration")
    hc.add_argument("service", nargs="?", help="gateway, predictor, dispatcher, planner, gpu-agent, worker "
                                               "(default: the service this container's PID 1 runs)")
    hc.set_defaults(fn=cmd_health)

    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # `polyserve [--run-dir D] <delegated> ...`: hand the rest to that module
    for i, arg in enumerate(argv):
        if arg in RENAMED:
            print(f"note: `polyserve {arg}` is now `polyserve bench {RENAMED[arg]}`", file=sys.stderr)
            return run_delegated("bench", [RENAMED[arg], *argv[i + 1:]])
        if arg in DELEGATED:
            return run_delegated(arg, argv[i + 1:])
        if not arg.startswith("-") and (i == 0 or argv[i - 1] != "--run-dir"):
            break
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
