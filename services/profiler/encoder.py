"""`polyserve profile --encoder`: the offline profiler of Arlo (§3.1 ③, §3.3) for an encoder model.

1. **Staircase scan** (batch size 1): a static runtime prepared for each length
   of `--scan` (default 1 and every multiple of 8 up to 512) and the one dynamic
   runtime (DT) on unpadded input of that length; `--passes` sweeps, the minimum
   kept per length, so bursts of load from other processes do not fake steps.
2. **Steps**: whether a staircase (latency padded to a tile of 16/32/64/128
   tokens) explains the curve much better than a line (`find_steps`); the
   runtimes' max_lengths are then the ends of the plateaus, or, when the curve has
   no staircase (a CPU computes roughly in proportion to length), K lengths at
   equal latency increments (`choose_runtimes`).
3. **Grid**: latency of static and dynamic runtimes over `--lengths` x
   `--batches` (default: length 1 and the chosen max_lengths, batch sizes 1-8).
4. **Runtime profiles**: for each chosen max_length, L_i (latency by batch size,
   measured at that exact shape) and M_i (sequences one instance holds within
   the SLO at the deployed batch size, `capacity_within_slo`).

Output: an `EncoderProfile` JSON (proto/messages.py) for the planner's ILP, the
simulator and the encoder engine's replay mode.

    python -m polyserve.profiler.encoder --out profiles/minilm-cpu.json [--quick]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from polyserve.proto import EncoderProfile, RuntimeProfile
from polyserve.worker.engines.encoder import capacity_within_slo

DEFAULT_SCAN = (1,) + tuple(range(8, 513, 8))
DEFAULT_BATCHES = tuple(range(1, 9))
QUICK_SCAN = (1, 16, 32, 48, 64, 96, 128, 192, 256)
QUICK_LENGTHS = (1, 64, 128, 256)
QUICK_BATCHES = (1, 2, 4)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- pure analysis
def _rss(x, y) -> float:
    import numpy as np

    a = np.column_stack([np.ones(len(x)), np.asarray(x, dtype=float)])
    coef, *_ = np.linalg.lstsq(a, np.asarray(y, dtype=float), rcond=None)
    return float(((a @ coef - y) ** 2).sum())


def find_steps(lengths: list[int], ms: list[float], tiles: tuple[int, ...] = (16, 32, 64, 128),
               gain: float = 0.5, min_length: int = 8) -> list[int]:
    """The staircase: lengths after which latency jumps, or [] when the curve has none.

    Two models of latency are fitted by least squares over the lengths >= `min_length`:
    proportional to the length (`a + b·L`) and a staircase padded to a tile
    (`a + b·ceil(L/T)·T`, the GPU pattern of Arlo Fig. 2, T = 64 for BERT on
    TensorRT). A tile counts when its staircase leaves at most `gain` of the
    proportional model's squared error; the best such tile wins and its multiples
    are the steps. Comparing whole-curve fits, not neighbouring points, keeps bursts
    of noise on a shared host from passing for steps."""
    pts = [(n, v) for n, v in zip(lengths, ms) if n >= min_length]
    if len(pts) < 6:
        return []
    xs, ys = [n for n, _ in pts], [v for _, v in pts]
    linear = _rss(xs, ys)
    best, best_rss = 0, gain * linear
    for t in tiles:
        if t >= max(xs) - min(xs):
            continue
        rss = _rss([-(-n // t) * t for n in xs], ys)
        if rss < best_rss:
            best, best_rss = t, rss
    if not best:
        return []
    return [k * best for k in range(1, max(xs) // best + 1) if k * best < max(xs)]


def staircase_fit(lengths: list[int], ms: list[float], tiles: tuple[int, ...] = (16, 32, 64, 128),
                  min_length: int = 8) -> dict[int, float]:
    """For each tile, the staircase model's squared error over the linear model's (< 1: steps fit better)."""
    pts = [(n, v) for n, v in zip(lengths, ms) if n >= min_length]
    xs, ys = [n for n, _ in pts], [v for _, v in pts]
    linear = _rss(xs, ys) or 1e-12
    return {t: _rss([-(-n // t) * t for n in xs], ys) / linear for t in tiles}


def choose_runtimes(lengths: list[int], ms: list[float], steps: list[int], max_runtimes: int = 8,
                    granularity: int = 8) -> list[int]:
    """max_lengths of the runtimes, shortest first, always ending at the longest length.

    With a staircase, one runtime at the end of each plateau (the largest jumps when
    there are more than `max_runtimes`). Without one, `max_runtimes` lengths at equal
    latency increments from the shortest to the longest, rounded up to `granularity`."""
    top = lengths[-1]
    if steps:
        if len(steps) >= max_runtimes:
            rise = {s: ms[lengths.index(s) + 1] - ms[lengths.index(s)] for s in steps}
            steps = sorted(sorted(steps, key=lambda s: -rise[s])[:max_runtimes - 1])
        return sorted(set(steps) | {top})
    lo, hi = ms[0], ms[-1]
    chosen: list[int] = []
    for k in range(1, max_runtimes):
        target = lo + (hi - lo) * k / max_runtimes
        n = next((length for length, v in zip(lengths, ms) if v >= target), top)
        n = min(top, -(-n // granularity) * granularity)
        if n < top and (not chosen or n > chosen[-1]):
            chosen.append(n)
    return chosen + [top]


def plateau_spread(lengths: list[int], ms: list[float], runtimes: list[int]) -> list[float]:
    """For each runtime, (latency at its max_length / latency at the first length it serves) - 1:
    how much a request at the bottom of the bin pays for padding (Arlo: < 5% on a GPU staircase)."""
    out, lo = [], 0
    for r in runtimes:
        inside = [v for length, v in zip(lengths, ms) if lo < length <= r]
        out.append((inside[-1] / inside[0] - 1.0) if inside else 0.0)
        lo = r
    return out


# ---------------------------------------------------------------------- measurement
def _timer(run: Callable[[], object], repeats: int, warmup: int, stat: str = "min", clock: str = "wall") -> float:
    """Latency of `run` in ms: the minimum (default) or median of `repeats` timed calls.

    `clock="cpu"` times the calling thread's CPU time (`time.thread_time`): with one
    torch thread all the compute runs in this thread, so this is what the call costs
    on a core of its own, unaffected by other processes taking the CPU away (a shared
    host scatters wall-clock figures upwards by 2-4x here). The minimum is the
    estimate least disturbed by the noise that remains."""
    now = time.thread_time if clock == "cpu" else time.perf_counter
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        t = now()
        run()
        samples.append((now() - t) * 1e3)
    return min(samples) if stat == "min" else statistics.median(samples)


class Measurer:
    """Times static runtimes (one per shape) and the dynamic runtime of one encoder."""

    def __init__(self, backend: str, dynamic_backend: str, repeats: int, warmup: int, model_path: str = "",
                 device: str = "cpu", stat: str = "min", clock: str = "wall"):
        from polyserve.worker.engines.encoder_runtime import Runtime, load_encoder

        self.Runtime = Runtime
        self.enc = load_encoder(model_path, device)
        self.backend = backend
        self.repeats = repeats
        self.warmup = warmup
        self.dynamic = {}  # batch -> dynamic runtime
        self.dynamic_backend = dynamic_backend
        self.stat = stat
        self.clock = clock
        self.prepare_s: list[float] = []

    def _rows(self, length: int, rows: int) -> list[list[int]]:
        cls, sep = self.enc.cls_id or 101, self.enc.sep_id or 102
        row = [cls] + [1000 + (i % 500) for i in range(max(0, length - 2))] + ([sep] if length >= 2 else [])
        return [row[:length]] * rows

    def static_ms(self, length: int, batch: int) -> float:
        rt = self.Runtime(self.enc, batch_size=batch, max_length=length, shape="static", backend=self.backend)
        rt.prepare()
        self.prepare_s.append(rt.prepare_s)
        rows = self._rows(length, batch)
        return _timer(lambda: rt.run(rows), self.repeats, self.warmup, self.stat, self.clock)

    def dynamic_ms(self, length: int, batch: int) -> float:
        rt = self.dynamic.get(batch)
        if rt is None:
            rt = self.Runtime(self.enc, batch_size=batch, max_length=self.enc.max_positions, shape="dynamic",
                              backend=self.dynamic_backend).prepare()
            self.dynamic[batch] = rt
        rows = self._rows(length, batch)
        return _timer(lambda: rt.run(rows), self.repeats, self.warmup, self.stat, self.clock)


def _passes(measure: Callable[[int], float], points: list[int], passes: int) -> list[float]:
    """Sweep `points` `passes` times and keep each point's minimum: a burst of load from
    another process spoils one sweep at a point, rarely all of them."""
    best = [float("inf")] * len(points)
    for _ in range(max(1, passes)):
        for i, n in enumerate(points):
            best[i] = min(best[i], measure(n))
    return best


def profile(args: argparse.Namespace) -> EncoderProfile:
    """Measure, analyse and build the EncoderProfile (blocking; minutes on a CPU)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = args.clock if args.clock != "auto" else ("cpu" if args.device == "cpu" and
                                                      torch.get_num_threads() == 1 else "wall")
    m = Measurer(args.backend, args.dynamic_backend, args.repeats, args.warmup, args.model_path, args.device,
                 args.stat, clock)
    scan = [n for n in args.scan if n <= m.enc.max_positions]
    t0 = time.monotonic()
    _say(f"encoder {m.enc.name} on {args.device}, {torch.get_num_threads()} threads; static backend "
         f"{args.backend}, dynamic backend {args.dynamic_backend}; SLO {args.slo_ms:.0f} ms; "
         f"{args.passes} passes over {len(scan)} lengths; {clock} clock")
    scan_static = _passes(lambda n: m.static_ms(n, 1), scan, args.passes)
    scan_dynamic = _passes(lambda n: m.dynamic_ms(n, 1), scan, args.passes)
    for n, a, b in zip(scan, scan_static, scan_dynamic):
        _say(f"  scan len {n:4d}: static {a:8.2f} ms   dynamic {b:8.2f} ms")
    steps = find_steps(scan, scan_static, gain=args.gain)
    runtimes = args.runtimes or choose_runtimes(scan, scan_static, steps, args.max_runtimes)
    _say(f"staircase steps after lengths {steps or 'none (no clear step: latency rises smoothly)'}; "
         f"runtimes {runtimes}")
    lengths = sorted({n for n in (args.lengths or (1, *runtimes)) if n <= m.enc.max_positions})
    grid_s, grid_d = [], []
    for b in args.batches:
        grid_s.append(_passes(lambda n, b=b: m.static_ms(n, b), lengths, args.grid_passes))
        grid_d.append(_passes(lambda n, b=b: m.dynamic_ms(n, b), lengths, args.grid_passes))
        _say(f"  grid batch {b}: static " + " ".join(f"{v:.1f}" for v in grid_s[-1])
             + " | dynamic " + " ".join(f"{v:.1f}" for v in grid_d[-1]))
    profiles = []
    for r in runtimes:
        lat = [grid_s[bi][lengths.index(r)] if r in lengths else m.static_ms(r, b)
               for bi, b in enumerate(args.batches)]
        lat_by_batch = _by_batch(args.batches, lat)
        b = min(args.deploy_batch, len(lat_by_batch))
        profiles.append(RuntimeProfile(name=f"static-b{b}-l{r}-{args.backend}", max_length=r, batch_size=b,
                                       latency_ms=[round(v, 3) for v in lat_by_batch],
                                       capacity=capacity_within_slo(args.slo_ms, lat_by_batch[b - 1], b),
                                       shape="static", backend=args.backend))
    top = max(lengths)
    dyn_lat = _by_batch(args.batches, [grid_d[bi][lengths.index(top)] for bi in range(len(args.batches))])
    b = min(args.deploy_batch, len(dyn_lat))
    dynamic = RuntimeProfile(name=f"dynamic-b{b}-{args.dynamic_backend}", max_length=0, batch_size=b,
                             latency_ms=[round(v, 3) for v in dyn_lat],
                             capacity=capacity_within_slo(args.slo_ms, dyn_lat[b - 1], b), shape="dynamic",
                             backend=args.dynamic_backend)
    spread = plateau_spread(scan, scan_static, runtimes)
    fit = staircase_fit(scan, scan_static)
    notes = (f"measured in {time.monotonic() - t0:.0f}s; {clock} clock"
             + (" (thread CPU time: the cost on a core of its own)" if clock == "cpu" else "")
             + f"; per point the {args.stat} of {args.repeats} runs "
             f"(after {args.warmup} warm-up), minimum over {args.passes} scan / {args.grid_passes} grid passes; "
             f"static prepare {statistics.median(m.prepare_s):.2f}s median per shape; "
             "staircase fit (squared error of a tile-T staircase / of a line; < 0.5 = a staircase): "
             + ", ".join(f"T={t}: {r:.2f}" for t, r in fit.items()) + "; "
             "padding cost within each runtime's bin (latency at max_length / at the bin's shortest - 1): "
             + ", ".join(f"{r}: {s:.0%}" for r, s in zip(runtimes, spread))
             + f"; capacities for a deployed batch size of {args.deploy_batch}. Other processes on a shared "
               "host inflate and scatter these figures.")
    _say(notes)
    return EncoderProfile(
        model=m.enc.name, device=args.device, backend=args.backend, slo_ms=args.slo_ms,
        threads=torch.get_num_threads(), lengths=lengths, batches=list(args.batches),
        static_ms=[[round(v, 3) for v in row] for row in grid_s],
        dynamic_ms=[[round(v, 3) for v in row] for row in grid_d], scan_lengths=scan,
        scan_static_ms=[round(v, 3) for v in scan_static], scan_dynamic_ms=[round(v, 3) for v in scan_dynamic],
        steps=steps, runtimes=profiles, dynamic=dynamic,
        host=f"{platform.node()} {platform.processor() or platform.machine()} ({os.cpu_count()} cpus)",
        notes=notes)


def _by_batch(batches: list[int], values: list[float]) -> list[float]:
    """Latency for every batch size 1..max(batches), interpolating unmeasured sizes."""
    from polyserve.worker.engines.encoder import interp

    return [interp(list(batches), list(values), b) for b in range(1, max(batches) + 1)]


def staircase_text(p: EncoderProfile) -> str:
    """A small table of the scan: length, static and dynamic latency, and where the steps are."""
    lines = ["length  static_ms  dynamic_ms  dyn/static"]
    for n, s, d in zip(p.scan_lengths, p.scan_static_ms, p.scan_dynamic_ms or [0.0] * len(p.scan_lengths)):
        mark = "  <- step" if n in p.steps else ""
        lines.append(f"{n:6d}  {s:9.2f}  {d:10.2f}  {d / s if s else 0:9.2f}{mark}")
    lines.append("runtimes: " + ", ".join(f"{r.max_length} (L_1 {r.latency_ms[0]:.1f} ms, M {r.capacity})"
                                          for r in p.runtimes))
    return "\n".join(lines)


# ---------------------------------------------------------------------- CLI
def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="polyserve profile --encoder", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", action="store_true", help="accepted for `polyserve profile --encoder`")
    ap.add_argument("--model-path", default="", help="checkpoint directory (default: packaged all-MiniLM-L6-v2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="jit", choices=("compile", "jit", "eager"),
                    help="how static runtimes are prepared (default jit: see encoder_runtime.py)")
    ap.add_argument("--dynamic-backend", default="eager", choices=("compile", "eager"),
                    help="the DT runtime (default eager: PyTorch on unpadded input)")
    ap.add_argument("--scan", type=_ints, default=None, help="lengths of the batch-1 staircase scan")
    ap.add_argument("--lengths", type=_ints, default=None,
                    help="lengths of the batch grid (default: 1 and the chosen runtimes' max_lengths)")
    ap.add_argument("--batches", type=_ints, default=None, help="batch sizes of the grid (default 1-8)")
    ap.add_argument("--runtimes", type=_ints, default=None, help="force these max_lengths")
    ap.add_argument("--max-runtimes", type=int, default=8)
    ap.add_argument("--gain", type=float, default=0.5,
                    help="a staircase must leave at most this share of the linear fit's squared error")
    ap.add_argument("--slo-ms", type=float, default=1000.0)
    ap.add_argument("--deploy-batch", type=int, default=1, help="batch size runtimes are deployed with")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one core per instance)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--passes", type=int, default=2, help="sweeps of the staircase scan (minimum kept)")
    ap.add_argument("--clock", default="auto", choices=("auto", "cpu", "wall"),
                    help="auto: thread CPU time with one CPU thread (robust on a shared host), else wall")
    ap.add_argument("--grid-passes", type=int, default=1, help="sweeps of the batch grid (minimum kept)")
    ap.add_argument("--stat", default="min", choices=("min", "median"),
                    help="latency statistic over the repeats (min: least disturbed by other processes)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a small grid (seconds; for tests)")
    ap.add_argument("--out", default="", help="write the EncoderProfile JSON here (default: stdout)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.scan = tuple(args.scan or (QUICK_SCAN if args.quick else DEFAULT_SCAN))
    args.lengths = tuple(args.lengths or (QUICK_LENGTHS if args.quick else ()))
    args.batches = tuple(sorted(args.batches or (QUICK_BATCHES if args.quick else DEFAULT_BATCHES)))
    args.runtimes = sorted(args.runtimes) if args.runtimes else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prof = profile(args)
    data = msgspec.json.format(msgspec.json.encode(prof), indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_bytes(data + b"\n")
        _say(f"wrote {args.out}")
    else:
        sys.stdout.write(data.decode() + "\n")
    _say(staircase_text(prof))
    return 0


if __name__ == "__main__":
    sys.exit(main())
