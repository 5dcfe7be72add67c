"""The tier rules of tests/tiers.py, run on tiny test trees by an inner pytest (pytester):
a unit test that asks for a server fixture fails (an error at setup, with the reason) before
the fixture starts, a tier marker that disagrees with the folder fails, and `-m unit`
selects the unit folder."""
from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.unit

CONFTEST = '''
import pytest

from tests.tiers import pytest_collection_modifyitems, pytest_configure, pytest_runtest_setup  # as tests/conftest.py


@pytest.fixture(scope="session")
def infra_servers():
    print("SERVERS STARTED")  # stands in for nats-server + redis-server
    return "servers"


@pytest.fixture
def bus(infra_servers):
    return "bus on " + infra_servers


@pytest.fixture
def helper():  # not a server fixture
    return 42
'''


@pytest.fixture
def tree(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini("[pytest]\naddopts = -p no:asyncio -p no:cacheprovider\n")
    pytester.makeconftest(CONFTEST)
    return pytester


def test_a_unit_test_asking_for_a_server_fixture_fails_and_no_server_starts(tree):
    tree.mkpydir("unit")
    tree.path.joinpath("unit", "test_bad.py").write_text(
        "def test_direct(infra_servers):\n    pass\n\n"
        "def test_through_another_fixture(bus):\n    pass\n\n"
        "def test_pure(helper):\n    assert helper == 42\n")
    result = tree.runpytest("-s")
    result.assert_outcomes(passed=1, errors=2)  # an error at setup: the fixtures never ran
    result.stdout.fnmatch_lines([
        "*unit/test_bad.py::test_direct is a unit test but requests the server fixture(s) infra_servers;*",
        ("*unit/test_bad.py::test_through_another_fixture is a unit test but requests the server fixture(s) "
         "bus, infra_servers;*"),
    ])
    result.stdout.no_fnmatch_line("*SERVERS STARTED*")


def test_integration_and_system_tests_may_use_servers(tree):
    for tier in ("integration", "system"):
        tree.mkpydir(tier)
        tree.path.joinpath(tier, f"test_{tier}.py").write_text(
            "def test_servers(bus):\n    assert bus == 'bus on servers'\n")
    tree.runpytest().assert_outcomes(passed=2)


def test_the_tier_marker_comes_from_the_folder_and_must_agree_with_it(tree):
    tree.mkpydir("unit")
    tree.mkpydir("integration")
    tree.path.joinpath("unit", "test_marks.py").write_text(
        "import pytest\n\n"
        "def test_unmarked():\n    pass\n\n"
        "@pytest.mark.unit\ndef test_marked_alike():\n    pass\n\n"
        "@pytest.mark.integration\ndef test_marked_otherwise():\n    pass\n")
    tree.path.joinpath("integration", "test_it.py").write_text("def test_it():\n    pass\n")
    tree.path.joinpath("test_loose.py").write_text(
        "import pytest\n\n"
        "def test_no_tier():\n    pass\n\n"
        "@pytest.mark.system\ndef test_explicit_tier():\n    pass\n\n"
        "@pytest.mark.unit\n@pytest.mark.system\ndef test_two_tiers():\n    pass\n")

    result = tree.runpytest()
    result.assert_outcomes(passed=4, errors=3)
    result.stdout.fnmatch_lines_random([
        "*unit/test_marks.py::test_marked_otherwise is in the unit folder but marked integration;*",
        "*test_loose.py::test_no_tier has no tier:*",
        "*test_loose.py::test_two_tiers carries the tier markers system, unit;*",
    ])

    unit = tree.runpytest("-m", "unit", "-v")  # the folder's marker is there for -m
    unit.stdout.fnmatch_lines_random(["*unit/test_marks.py::test_unmarked PASSED*",
                                      "*unit/test_marks.py::test_marked_alike PASSED*",
                                      "*unit/test_marks.py::test_marked_otherwise ERROR*"])
    unit.stdout.no_fnmatch_line("*integration/test_it.py*")
    integration = tree.runpytest("-m", "integration", "-v")
    integration.stdout.fnmatch_lines(["*integration/test_it.py::test_it PASSED*"])
    integration.stdout.no_fnmatch_line("*test_unmarked*")


def test_the_project_registers_the_tier_and_torch_markers(pytestconfig):
    names = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert {"unit", "integration", "system", "torch"} <= names
