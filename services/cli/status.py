"""`polyserve status`: services, workers and GPUs read from Redis."""
from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from polyserve.cli.launcher import ClusterState, live_json
from polyserve.proto import Keys
from polyserve.shared import infra
from polyserve.shared.auth import redact
from polyserve.shared.state import connect_sync


def cluster_status(state: ClusterState) -> dict:
    """A JSON-able snapshot: processes, services, workers, GPUs (agents + latest telemetry)."""
    keys = Keys(state.prefix)
    r = connect_sync(state.redis_url)  # redis:// or redis+sentinel:// (shared/state.py)
    services = live_json(r, keys.services, lambda m: keys.service(*m.split(":", 1)))
    workers = live_json(r, keys.workers, keys.worker)
    agents = live_json(r, keys.agents, keys.agent)
    for agent in agents:
        raw = r.get(keys.gpu(agent["gpu_id"]))
        agent["telemetry"] = json.loads(raw) if raw else None
        raw = r.get(keys.gpu_energy(agent["gpu_id"], total=True))  # gpu-agent EnergyMeter, since agent start
        agent["energy"] = json.loads(raw) if raw else None
    fits = []
    for w in workers:
        raw = r.get(keys.perf_fit(w["worker_id"]))
        if raw:
            fits.append(json.loads(raw))
    procs = {name: {"pid": pid, "alive": infra.pid_alive(pid), "restarts": state.restarts.get(name, 0)}
             for name, pid in state.pids.items()}
    return {"gateway_url": state.gateway_url, "nats_url": redact(state.nats_url), "redis_url": redact(state.redis_url),
            "admin_key_file": state.admin_key_file,
            "engine": state.engine, "model": state.model, "processes": procs, "services": services,
            "workers": workers, "gpus": agents, "fits": fits}


def render_status(st: dict) -> None:
    console = Console()
    if not console.is_terminal:  # piped or captured: do not wrap the tables at 80 columns
        console = Console(width=200)
    console.print(f"gateway [bold]{st['gateway_url']}[/]  nats {st['nats_url']}  redis {st['redis_url']}")
    restarts = {n: p["restarts"] for n, p in st.get("processes", {}).items() if p.get("restarts")}
    if restarts:
        console.print("restarted by the supervisor: " + ", ".join(f"{n} {c}x" for n, c in sorted(restarts.items())))
    t = Table(title="services")
    for col in ("service", "instance", "state", "pid"):
        t.add_column(col)
    for s in sorted(st["services"], key=lambda s: s["service"]):
        t.add_row(s["service"], s["instance"], s["state"], str(s["pid"]))
    console.print(t)
    t = Table(title="workers")
    for col in ("worker", "deployment", "engine", "gpu", "running", "waiting", "kv used/cap", "adapters"):
        t.add_column(col)
    for w in st["workers"]:
        engine = w["engine"] + (" (simulated)" if w.get("simulated") else "")
        adapters = ", ".join(f"{a['name']}(r{a['rank']})" for a in w.get("adapters", [])) or "-"
        t.add_row(w["worker_id"], w["deployment"], engine, w.get("gpu_id", ""), str(w["running"]),
                  str(w["waiting"]), f"{w['kv_used']}/{w['kv_capacity']}", adapters)
    console.print(t)
    if st.get("fits"):
        t = Table(title="dispatcher's online model fits (aladdin / caraserve deployments)")
        for col in ("worker", "from profile", "prefill n / mean err", "decode n / mean err"):
            t.add_column(col)

        def _err(e: dict) -> str:
            m = e.get("mean_rel_err")
            return f"{e.get('n', 0)} / " + (f"{100 * m:.1f}%" if m is not None else "-")

        for f in st["fits"]:
            t.add_row(f["worker_id"], f["start"], _err(f["errors"]["prefill"]), _err(f["errors"]["decode"]))
        console.print(t)
    t = Table(title="GPUs")
    for col in ("gpu", "name", "power W", "SM MHz", "util %", "mem MB", "J/req", "J/out tok", "workers"):
        t.add_column(col)
    for g in st["gpus"]:
        tel = g.get("telemetry") or {}
        label = tel.get("name", "?") + (" (simulated)" if g.get("simulated") else "")
        en = g.get("energy") or {}
        est = " (model)" if en.get("source") == "model" else ""
        jr = f"{en['j_per_request']:.1f}{est}" if en.get("j_per_request") is not None else "-"
        jt = f"{en['j_per_token']:.2f}{est}" if en.get("j_per_token") is not None else "-"
        t.add_row(g["gpu_id"], label, f"{tel.get('power_w', 0):.0f}", str(tel.get("sm_clock_mhz", "")),
                  f"{tel.get('util_gpu_pct', 0):.0f}", f"{tel.get('mem_used_mb', 0):.0f}/{tel.get('mem_total_mb', 0):.0f}",
                  jr, jt, ", ".join(g.get("workers", {})))
    console.print(t)
