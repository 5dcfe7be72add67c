"""The optional compiled build of the dispatcher's hot modules (mypyc), and its loader.

`scripts/build-dispatcher-native` (`python -m polyserve.dispatcher.native build`) compiles
`MODULES` with mypyc (from PyPI's `mypy`; needs a C compiler) into one C extension per
module plus their shared library, kept in the package's `_native/` folder (git-ignored)
with a stamp of the sources they were compiled from. The pure-Python modules stay the
fallback and the default: when the package is imported, `install` puts a finder for the
compiled modules in front of the import system only if that build is there, matches the
Python it runs under and was compiled from the sources as they are now — a build older
than an edit of any of them is never used (the stale build is named in a warning).
`POLYSERVE_DISPATCHER_NATIVE=0` forces pure Python; a folder path uses the build there.

Why, and what it gains: docs/benchmarks/dispatch.md, sixth round. The decisions are the
same (tests/system/test_dispatcher_native.py compares both builds on random workloads).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import logging
import os
import sys

logger = logging.getLogger(__name__)

PACKAGE = "polyserve.dispatcher"
# The modules a decision and its update run through (the index, its structures, the policy
# functions it shares with the pure scan, and the views they read).
MODULES = ("views", "policy", "policy_aladdin", "policy_caraserve", "policy_arlo",
           "index_structs", "index_models", "index_cara", "index")
GROUP = f"{PACKAGE}._native"  # mypyc's group: its shared library is `GROUP + "__mypyc"`
SHARED = "_native__mypyc"
FOLDER = "_native"
STAMP = "STAMP.json"
ENV = "POLYSERVE_DISPATCHER_NATIVE"

# What `install` found: "native" or "pure", and why (logged by the service at start).
STATE = {"mode": "pure", "reason": "not checked"}


def _suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def _digest(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _platform() -> dict:
    return {"python": sys.version.split()[0], "cache_tag": sys.implementation.cache_tag, "suffix": _suffix()}


def stamp_of(src_dir: str) -> dict:
    """What a build is valid for: this Python, and the sources' digests."""
    return {**_platform(), "sources": {m: _digest(os.path.join(src_dir, m + ".py")) for m in MODULES}}


def check(build_dir: str, src_dir: str) -> str | None:
    """None when `build_dir` holds a complete build of the sources in `src_dir` as they
    are now, for this Python; else why it cannot be used."""
    try:
        with open(os.path.join(build_dir, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError) as exc:
        return f"no usable stamp in {build_dir} ({exc.__class__.__name__})"
    for key, value in _platform().items():
        if stamp.get(key) != value:
            return f"built for {key} {stamp.get(key)!r}, running {value!r}"
    now = stamp_of(src_dir)["sources"]
    changed = [m for m in MODULES if stamp.get("sources", {}).get(m) != now[m]]
    if changed:
        return f"{', '.join(m + '.py' for m in changed)} changed since the build"
    missing = [n for n in (*MODULES, SHARED) if not os.path.isfile(os.path.join(build_dir, n + _suffix()))]
    if missing:
        return f"{', '.join(missing)} missing from the build"
    return None


class _Loader(importlib.machinery.ExtensionFileLoader):
    def exec_module(self, module) -> None:
        super().exec_module(module)
        # mypyc initialises the group's other modules it imports itself, giving them a
        # path that does not exist: name their real files (tracebacks, `inspect`)
        folder = os.path.dirname(self.path)
        for n in MODULES:
            mod = sys.modules.get(f"{PACKAGE}.{n}")
            if mod is not None and not os.path.exists(getattr(mod, "__file__", "") or ""):
                mod.__file__ = os.path.join(folder, n + _suffix())


class _Finder:
    """Finds the compiled modules (and their shared library) in the build folder (a
    `sys.meta_path` finder; not derived from `importlib.abc`, which costs 9 ms to import)."""

    def __init__(self, build_dir: str):
        self.files = {f"{PACKAGE}.{n}": os.path.join(build_dir, n + _suffix()) for n in (*MODULES, SHARED)}

    def find_spec(self, fullname, path=None, target=None):
        f = self.files.get(fullname)
        return None if f is None else importlib.util.spec_from_file_location(fullname, f, loader=_Loader(fullname, f))


def install(src_dir: str) -> dict:
    """Use the compiled modules when a fresh build is there (see the module docstring);
    called by the package's `__init__` before any of `MODULES` is imported."""
    env = os.environ.get(ENV, "").strip()
    if env == "0":
        STATE.update(mode="pure", reason=f"{ENV}=0")
        return STATE
    build_dir = env or os.path.join(src_dir, FOLDER)
    if not env and not os.path.isdir(build_dir):
        STATE.update(mode="pure", reason="no native build (scripts/build-dispatcher-native makes one)")
        return STATE
    why = check(build_dir, src_dir)
    if why is not None:
        STATE.update(mode="pure", reason=f"native build not used: {why}; rerun scripts/build-dispatcher-native")
        logger.warning("dispatcher: %s", STATE["reason"])
        return STATE
    loaded = [m for m in MODULES if f"{PACKAGE}.{m}" in sys.modules]
    if loaded:  # (cannot happen through the package's __init__; a reload would mix builds)
        STATE.update(mode="pure", reason=f"native build not used: {', '.join(loaded)} already imported")
        return STATE
    sys.meta_path.insert(0, _Finder(build_dir))
    STATE.update(mode="native", reason=f"mypyc build in {build_dir}")
    return STATE


def describe() -> str:
    """One line for the service's start log: which build decides."""
    if STATE["mode"] == "native":
        return f"dispatch index: compiled modules ({STATE['reason']})"
    return f"dispatch index: pure Python ({STATE['reason']})"


def is_native() -> bool:
    """True when the compiled modules are the ones imported (not just found)."""
    spec = getattr(sys.modules.get(f"{PACKAGE}.index"), "__spec__", None)
    return spec is not None and str(spec.origin).endswith(_suffix())


# ------------------------------------------------------------------ building
_SETUP = """\
from setuptools import setup
from mypyc.build import mypycify
paths = {paths!r}
setup(name="polyserve-dispatcher-native", packages=[], script_args=["build_ext", "--inplace"],
      ext_modules=mypycify(["--follow-imports=silent"] + paths, group_name={group!r}, opt_level="3"))
"""


def _tree(tmp: str) -> str:
    """A copy of the `polyserve` package (its three roots) under `tmp`: mypyc names a module
    by its path, and in the checkout `polyserve` is the folder `services`."""
    import shutil

    import polyserve
    import polyserve.proto
    import polyserve.shared

    root = os.path.join(tmp, "polyserve")
    skip = shutil.ignore_patterns("__pycache__", "*.so", FOLDER + "*")
    shutil.copytree(polyserve.__path__[0], root, ignore=skip)
    for sub in (polyserve.proto, polyserve.shared):
        dst = os.path.join(root, sub.__name__.rsplit(".", 1)[1])
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(sub.__path__[0], dst, ignore=skip)
    return os.path.join(root, "dispatcher")


def build(src_dir: str, out_dir: str | None = None, quiet: bool = True) -> str:
    """Compile `MODULES` of `src_dir` into `out_dir` (default: `src_dir/_native`), replacing
    what is there; returns `out_dir`. Raises RuntimeError naming what to fix."""
    import shutil
    import subprocess
    import tempfile

    try:
        import mypyc  # noqa: F401
    except ImportError:
        raise RuntimeError("mypyc is not installed: `.venv/bin/pip install mypy` (mypyc ships with it)") from None
    out_dir = out_dir or os.path.join(src_dir, FOLDER)
    with tempfile.TemporaryDirectory(prefix="polyserve-native-") as tmp:
        pkg = _tree(tmp)
        stamp = stamp_of(pkg)  # of the copies compiled (an edit during the build makes it stale)
        paths = [f"polyserve/dispatcher/{m}.py" for m in MODULES]
        with open(os.path.join(tmp, "setup.py"), "w") as f:
            f.write(_SETUP.format(paths=paths, group=GROUP))
        run = subprocess.run([sys.executable, "setup.py"], cwd=tmp, capture_output=quiet, text=True)
        if run.returncode != 0:
            tail = "\n".join(((run.stdout or "") + (run.stderr or "")).splitlines()[-30:])
            raise RuntimeError(f"mypyc build failed (exit {run.returncode}):\n{tail}")
        staging = out_dir + ".new"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        for n in (*MODULES, SHARED):
            shutil.copy2(os.path.join(pkg, n + _suffix()), staging)
        with open(os.path.join(staging, STAMP), "w") as f:
            json.dump(stamp, f, indent=1)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)
    return out_dir


def clean(src_dir: str) -> bool:
    """Remove the build in `src_dir/_native`; True when there was one."""
    import shutil

    path = os.path.join(src_dir, FOLDER)
    if not os.path.isdir(path):
        return False
    shutil.rmtree(path)
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m polyserve.dispatcher.native build|clean|status`."""
    import argparse
    import time

    ap = argparse.ArgumentParser(prog="build-dispatcher-native", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("build", "clean", "status"), nargs="?", default="build")
    ap.add_argument("--out", help="build into this folder instead of the package's _native/")
    ap.add_argument("-v", "--verbose", action="store_true", help="show the compiler's output")
    args = ap.parse_args(argv)
    import polyserve.dispatcher as pkg

    src = pkg.__path__[0]
    if args.action == "clean":
        print("removed the native build" if clean(src) else "no native build to remove")
        return 0
    if args.action == "status":
        why = check(args.out or os.path.join(src, FOLDER), src)
        print("fresh native build: the dispatcher uses it" if why is None else f"not used: {why}")
        return 0 if why is None else 1
    t0 = time.monotonic()
    try:
        out = build(src, args.out, quiet=not args.verbose)
    except RuntimeError as exc:
        print(f"build-dispatcher-native: {exc}", file=sys.stderr)
        return 1
    print(f"built {len(MODULES)} modules into {out} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
