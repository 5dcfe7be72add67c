"""The test tiers, enforced (a pytest plugin; tests/conftest.py imports its hooks).

Every test carries exactly one tier marker, taken from its folder:

    tests/unit -> unit            pure tests, no servers, no processes
    tests/integration -> integration   real nats-server and redis-server (session fixtures)
    tests/system -> system        the services as processes
    tests/chaos -> chaos          faults injected by signal into the services as processes,
                                  under load (the chaos suite: services/bench/chaos*.py)

so `pytest -m unit` selects exactly tests/unit. A test marked with another tier than its
folder's, or with two tiers, fails; so does a unit test that requests a server fixture
(SERVER_FIXTURES, directly or through another fixture: `item.fixturenames` is the whole
closure). The failure happens before any fixture is set up, so no server starts for it.
Tests outside the four folders need one explicit tier marker.
"""
from __future__ import annotations

import pytest

TIERS = ("unit", "integration", "system", "chaos")
TIER_DOC = {
    "unit": "pure tests, no I/O",
    "integration": "real nats-server and redis-server started by session fixtures",
    "system": "the services as processes, driven over HTTP",
    "chaos": "faults by signal into the services as processes under streaming load (polyserve bench chaos)",
}

# Fixtures that start servers or processes (tests/conftest.py, tests/integration/conftest.py,
# tests/system/conftest.py). Fixtures built on them (e.g. a module's own `env(infra_servers)`)
# are caught through the closure, since they request one of these.
SERVER_FIXTURES = frozenset({
    "infra_servers",  # nats-server + redis-server for the session
    "make_settings",  # settings pointed at those servers
    "bus",  # a NATS connection
    "state",  # a Redis connection
    "plane",  # gateway, dispatcher, predictor and a worker in-process, on the servers
    "cluster",  # the whole of `polyserve up` as processes
})

_PROBLEM = pytest.StashKey[str]()


def folder_tier(item: pytest.Item) -> str | None:
    """The tier named by the test file's folder (the first of unit/integration/system/chaos below the rootdir)."""
    try:
        parts = item.path.relative_to(item.config.rootpath).parts
    except ValueError:
        parts = item.path.parts
    return next((p for p in parts[:-1] if p in TIERS), None)


def tier_problem(item: pytest.Item) -> str | None:
    """Why this test breaks the tier rules, or None."""
    folder = folder_tier(item)
    marked = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
    where = item.nodeid
    if len(marked) > 1:
        return f"{where} carries the tier markers {', '.join(marked)}; a test has exactly one tier"
    if folder is not None and marked and marked[0] != folder:
        return (f"{where} is in the {folder} folder but marked {marked[0]}; the tier marker must match the folder "
                f"(tests/unit -> unit, tests/integration -> integration, tests/system -> system, "
                f"tests/chaos -> chaos): "
                f"move the test or drop the marker")
    if folder is None and not marked:
        return (f"{where} has no tier: put it under tests/unit, tests/integration, tests/system or tests/chaos, "
                f"or mark it with one of {', '.join(TIERS)}")
    tier = folder or marked[0]
    servers = sorted(SERVER_FIXTURES.intersection(item.fixturenames))
    if tier == "unit" and servers:
        return (f"{where} is a unit test but requests the server fixture(s) {', '.join(servers)}; unit tests "
                f"start no servers or processes: move it to tests/integration (or tests/system)")
    return None


def pytest_configure(config: pytest.Config) -> None:
    known = {line.split(":")[0].strip() for line in config.getini("markers")}
    for name in TIERS:
        if name not in known:
            config.addinivalue_line("markers", f"{name}: {TIER_DOC[name]}")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the folder's tier marker must be there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        problem = tier_problem(item)
        if problem:
            item.stash[_PROBLEM] = problem
        folder = folder_tier(item)
        if folder is not None and folder not in {m.name for m in item.iter_markers()}:
            item.add_marker(folder)


@pytest.hookimpl(tryfirst=True)  # before fixtures are set up: a misplaced test starts no server
def pytest_runtest_setup(item: pytest.Item) -> None:
    problem = item.stash.get(_PROBLEM, None)
    if problem:
        pytest.fail(f"test tiers: {problem}", pytrace=False)
