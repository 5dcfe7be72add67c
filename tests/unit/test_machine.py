"""Every benchmark names its machine (`polyserve.shared.machine`): CPU model with family/model,
which of the SIMD flags that change this project's figures it has and lacks, CPUs, Python, load."""
from __future__ import annotations

import pytest

from polyserve.shared import machine

pytestmark = pytest.mark.unit

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 bmi2 vaes
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 bmi2 vaes avx512f
"""

XEON = EPYC.replace("AMD EPYC", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz").replace(
    "25", "6").replace("vaes", "vaes avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8")


def test_an_avx2_only_epyc_is_named_with_what_it_lacks(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(EPYC)
    facts = machine.describe(str(f))
    assert facts["cpu"] == "AMD EPYC (family 25 model 1)"
    # the first processor's flags (the second's avx512f is not read)
    assert facts["simd"] == ["avx2", "fma"]
    assert facts["no_simd"] == ["avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]
    line = machine.line(facts)
    assert line.startswith("AMD EPYC (family 25 model 1), ")
    assert "avx2 fma, no avx512f/avx512_vnni/avx512_bf16/amx_bf16/amx_int8" in line
    assert f"Python {facts['python']}" in line and "load average" in line


def test_a_xeon_with_amx_lacks_nothing(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(XEON)
    facts = machine.describe(str(f))
    assert facts["cpu"].startswith("Intel(R) Xeon(R) Platinum 8481C") and "family 6" in facts["cpu"]
    assert facts["simd"] == list(machine.SIMD_FLAGS) and facts["no_simd"] == []
    assert ", no " not in machine.line(facts)


def test_arm_features_and_an_unreadable_file(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\n")
    model, flags = machine.cpu(str(f))
    assert model and flags == {"fp", "asimd", "sve"}
    facts = machine.describe(str(tmp_path / "missing"))
    assert facts["cpu"] and facts["simd"] == [] and facts["no_simd"] == []  # nothing read: claim nothing
    assert "no flags read" in machine.line(facts)
