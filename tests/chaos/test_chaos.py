"""Issue 13's chaos suite in CI: each test runs one scenario of `polyserve bench chaos` (the
same harness, services/bench/chaos_run.py) against a fresh `polyserve up`, with a real fault by
signal while about 50 streams of 64 tokens run, and asserts on what the clients and the bus
saw. Where the fault is handled today the issue's targets are asserted (0 silently short, 0
hung, 0 accepted without a terminal event, serving again within 10 s, >= 99% of the requests
not on a killed worker succeed); where it is not yet, what is promised (docs/reliability.md):
whatever fails, fails explicitly, and nothing is lost silently."""
from __future__ import annotations

import pytest

from polyserve.bench import chaos_faults
from tests.chaos.conftest import CONFIG, assert_promised, assert_targets, scenario_row

pytestmark = pytest.mark.chaos

RECOVERY_S = 10.0


def test_worker_sigkill_loses_nothing_and_running_streams_move():
    row = scenario_row("worker-kill")
    assert row["on_killed_worker"] > 0, "the fault hit no running stream"
    assert_targets(row)
    assert row["ok_rate_on_killed"] >= 0.99, row["error_causes"]  # request migration


@pytest.mark.parametrize("victim", ["predictor", "dispatcher"])
def test_killed_predictor_or_dispatcher_costs_no_request(victim):
    row = scenario_row(f"{victim}-kill")
    assert_targets(row)
    assert row["restarts"].get(victim) == 1, "the supervisor restarted it"


def test_redis_sigkill_costs_no_request():
    row = scenario_row("redis-restart")
    assert_targets(row)
    assert row["restarts"].get("redis-server") == 1


def test_gateway_sigterm_drains_running_streams_and_comes_back():
    row = scenario_row("gateway-term")
    assert_promised(row)
    assert row["recovery_s"] is not None and row["recovery_s"] <= RECOVERY_S, row["probe_failures"]
    assert row["restarts"].get("gateway") == 1
    # a stream already running when SIGTERM came ran to its end: the errors are requests refused
    # by the draining gateway (503), sent while no gateway listened, or sent on a keep-alive
    # connection it was closing (a transport error before any response) - never a stream cut
    cut = {cause: n for cause, n in row["error_causes"].items() if "stream cut" in cause}
    assert not cut, f"streams cut by the drain: {cut}"


def test_nats_restart_loses_no_token_silently():
    row = scenario_row("nats-restart")
    assert_promised(row)
    assert row["recovery_s"] is not None and row["recovery_s"] <= RECOVERY_S, row["probe_failures"]


def test_nats_pause_never_ends_a_stream_short_or_hangs_it():
    row = scenario_row("nats-pause")
    assert_promised(row)
    assert row["recovery_s"] is not None, f"serving never resumed: {row['probe_failures']}"
    # every worker stayed healthy: a heartbeat gap that NATS caused fails no stream, and a chunk
    # that overtakes the worker's acceptance fails no request (issue 13)
    assert row["ok"] >= 0.99 * row["sent"], row["error_causes"]


def test_one_of_two_gateways_drains_without_a_transport_error():
    row = scenario_row("gateway-term-of-2")
    assert_promised(row)
    # the draining gateway closes its listener first and retires each keep-alive connection with
    # `Connection: close` after its next response: no connection is closed under a client
    cut = {cause: n for cause, n in row["error_causes"].items() if not cause.startswith("HTTP")}
    assert not cut, f"requests lost on connections the draining gateway closed: {cut}"
    assert row["ok"] >= 0.99 * row["sent"], row["error_causes"]


def test_slow_readers_get_every_token_or_an_explicit_error():
    row = scenario_row("slow-reader")
    assert_promised(row)
    slow = row["slow_readers"]
    assert slow["short"] == 0 and slow["hung"] == 0, slow
    assert slow["ok"] + slow["error"] == CONFIG.slow_readers, slow
    others = row["sent"] - sum(v for k, v in slow.items() if k != "samples")
    assert row["ok"] - slow["ok"] >= 0.99 * others, f"the slow readers hurt the others: {row['error_causes']}"


def test_one_nats_node_of_three_killed_loses_nothing():
    if not chaos_faults.cluster_flag("nats_cluster"):
        pytest.skip("`polyserve up` has no --nats-cluster in this tree")
    row = scenario_row("nats-node-kill")
    assert_targets(row)


def test_overload_40x_admits_what_fits_and_refuses_the_rest_with_429():
    row = scenario_row("overload")
    assert_promised(row)
    ov = row["overload"]
    assert row["fault"]["factor"] >= 30, f"the burst reached only {row['fault']} (load generator too slow)"
    assert ov["rejected_429"] > 0 and ov["429_without_retry_after"] == 0, ov
    assert ov["other_errors"] == 0, row["error_causes"]
    assert ov["admitted_over_budget"] == 0, ov
    # refusing is cheap: the burst is answered as it comes, not queued behind the gateway's loop
    assert ov["429_p50_s"] <= 0.2, ov
