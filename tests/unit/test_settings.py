import pytest

from polyserve.shared.settings import CommonSettings, SettingsError, load

pytestmark = pytest.mark.unit


def test_env_then_service_env_then_flags_override():
    env = {"POLYSERVE_DRAIN_TIMEOUT_S": "4", "POLYSERVE_GATEWAY_DRAIN_TIMEOUT_S": "5"}
    s = load(CommonSettings, "gateway", environ=env)
    assert s.drain_timeout_s == 5.0
    s = load(CommonSettings, "gateway", argv=["--drain-timeout-s", "6"], environ=env)
    assert s.drain_timeout_s == 6.0
    assert s.instance.startswith("gateway-")


def test_bad_values_say_what_to_fix():
    with pytest.raises(SettingsError, match="drain_timeout_s"):
        load(CommonSettings, "x", environ={"POLYSERVE_DRAIN_TIMEOUT_S": "abc"})
    with pytest.raises(SettingsError, match="prefix"):
        load(CommonSettings, "x", environ={"POLYSERVE_PREFIX": "a.b"})
