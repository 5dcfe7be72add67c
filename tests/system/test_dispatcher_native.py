"""The optional mypyc build of the dispatcher (`polyserve.dispatcher.native`) decides exactly
as the pure-Python modules do.

Two Python processes run the same random workloads (every dispatch policy: upserts,
removals, placements, completions interleaved with decisions, as tests/unit/
test_dispatch_index.py; and 2,400-request bursts over 1,200 alike workers for aladdin and
caraserve), one on the pure-Python modules (POLYSERVE_DISPATCHER_NATIVE=0), one on a
compiled build (a copy of the one scripts/install made when that one is fresh, else one
compiled here); every decision, the pure scan's too, and the final views must be equal.
Skipped, saying why, where mypyc or a C compiler is missing. A build older than
its sources is never loaded.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from polyserve.dispatcher import native

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]

# Runs in the child: the workloads, and which build ran them.
TRACE = r"""
import json, random, sys
from dataclasses import replace
from polyserve.dispatcher import index as ix, native, policy as p
from tests.unit.test_dispatch_index import PERFS, random_request, random_view

def ops(policy, seed, steps, same=None):
    rng = random.Random(seed)
    arlo = policy.startswith("arlo")
    index = ix.WorkerIndex(policies=(policy,) if seed % 2 else ())
    for _ in range(rng.randint(1, 40)):
        index.upsert(random_view(rng, f"w{rng.randint(0, 999):03d}", arlo, same))
    fast, pure = ix.FAST_POLICIES[policy], ix.PURE_POLICIES[policy]
    state, placed, out = p.PolicyState(), [], []
    for i in range(steps):
        op = rng.random()
        if op < 0.12:
            index.upsert(random_view(rng, f"w{rng.randint(0, 999):03d}", arlo, same))
        elif op < 0.17 and len(index) > 1:
            index.remove(rng.choice(index.views()).worker_id)
        elif op < 0.32 and placed:
            wid, rid = placed.pop(rng.randrange(len(placed)))
            index.finished(wid, rid)
        else:
            req = random_request(rng, i, arlo)
            s = rng.random()
            got = fast(index, req, state, random.Random(s))
            want = pure(index.views(), req, state, random.Random(s))
            out.append([got.worker_id, got.scale_out, want.worker_id, want.scale_out])
            state = got.state
            index.placed(got.worker_id, req)
            placed.append((got.worker_id, req.request_id))
    out.append([[w.worker_id, w.outstanding, [r.request_id for r in w.requests]] for w in index.views()])
    return out

def burst(policy, n_workers, n_requests):
    rng = random.Random(7)
    index = ix.WorkerIndex(policies=(policy,))
    for k in range(n_workers):
        index.upsert(random_view(rng, f"w{k:04d}", False, PERFS[1]))
    fast, state, out = ix.FAST_POLICIES[policy], p.PolicyState(), []
    for i in range(n_requests):
        req = random_request(rng, i)
        d = fast(index, req, state, random.Random(i))
        state = d.state
        index.placed(d.worker_id, req)
        out.append(d.worker_id)
    return out

trace = {"native": native.is_native(), "mode": native.STATE["mode"]}
for policy in sorted(ix.FAST_POLICIES):
    trace[policy] = [ops(policy, seed, 160) for seed in range(6)]
for policy in ("aladdin", "caraserve"):
    trace[policy + " alike"] = [ops(policy, seed, 160, PERFS[1]) for seed in range(4)]
    trace[policy + " burst"] = burst(policy, int(sys.argv[1]), int(sys.argv[2]))
print(json.dumps(trace))
"""


def _no_toolchain() -> str | None:
    try:
        import mypyc  # noqa: F401
    except ImportError:
        return "mypyc is not installed (`pip install mypy`): the native build cannot be made here"
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")[:1]
    if not cc or shutil.which(cc[0]) is None:
        return f"no C compiler ({cc[0] if cc else 'CC unset'}) for the native build"
    return None


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    src = native.__file__.rsplit(os.sep, 1)[0]
    out = tmp_path_factory.mktemp("native") / "build"
    installed = os.path.join(src, native.FOLDER)
    if native.check(installed, src) is None:
        # scripts/install (what CI runs first) has just compiled these very sources: a copy of
        # that build is what the test needs (compiling again costs ~40 s of the suite on a
        # 2-core machine); a missing or stale build is compiled for the test below
        shutil.copytree(installed, out)
        return str(out)
    why = _no_toolchain()
    if why:
        pytest.skip(why)
    return native.build(src, str(out))


def _trace(setting: str, workers: int = 1200, requests: int = 2400) -> dict:
    env = {**os.environ, native.ENV: setting}
    run = subprocess.run([sys.executable, "-c", TRACE, str(workers), str(requests)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_compiled_and_pure_modules_make_identical_decisions(build_dir):
    pure, compiled = _trace("0"), _trace(build_dir)
    assert (pure["native"], pure["mode"]) == (False, "pure")
    assert (compiled["native"], compiled["mode"]) == (True, "native")
    policies = [k for k in pure if k not in ("native", "mode")]
    assert len(policies) == 15  # 11 policies, 2 alike-cluster runs, 2 bursts
    for key in policies:
        assert compiled[key] == pure[key], key
    # the workloads decide something: many decisions, bursts spread over many workers
    assert sum(len(run) - 1 for run in pure["caraserve"]) > 400
    assert len(set(pure["aladdin burst"])) > 100 and len(set(pure["caraserve burst"])) > 100


def test_a_build_older_than_its_sources_is_not_used(build_dir, tmp_path):
    stale = tmp_path / "stale"
    shutil.copytree(build_dir, stale)
    stamp = json.loads((stale / native.STAMP).read_text())
    stamp["sources"]["index_cara"] = "0" * 64  # as if index_cara.py had been edited since
    (stale / native.STAMP).write_text(json.dumps(stamp))
    code = "from polyserve.dispatcher import native, index; print(native.is_native()); print(native.describe())"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, native.ENV: str(stale)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    is_native, line = run.stdout.splitlines()
    assert is_native == "False"
    assert "pure Python" in line and "index_cara.py changed since the build" in line
    assert "rerun scripts/build-dispatcher-native" in run.stderr  # the warning at import


def test_without_a_build_the_dispatcher_says_it_runs_pure_python(tmp_path):
    code = "from polyserve.dispatcher import native, index; print(native.is_native()); print(native.describe())"
    for setting, reason in (("0", f"{native.ENV}=0"), (str(tmp_path / "none"), "no usable stamp")):
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, native.ENV: setting},
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines()[0] == "False"
        assert "pure Python" in run.stdout and reason in run.stdout
