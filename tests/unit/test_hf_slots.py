"""LoRA device slots (`hf_slots`): an evicted adapter's PEFT modules take the next adapter of the
same shape by a copy, with the outputs of PEFT's own install; other shapes are installed by PEFT
and parked modules never outlive the next install or the last adapter."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from polyserve.worker.engines.hf_slots import shape_key  # noqa: E402
from polyserve.worker.lora import create_random_adapter, load_host_lora, read_adapter  # noqa: E402
from tests.unit.test_hf_coldstart import PROMPT, _engine, _run, _tier  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]  # torch: builds the hf engine


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("slots")
    qv = ("q_proj", "v_proj")
    return {"a": create_random_adapter("random", 8, root / "a", seed=1, targets=qv),
            "b": create_random_adapter("random", 8, root / "b", seed=2, targets=qv, alpha=32.0),  # a's shape
            "c": create_random_adapter("random", 16, root / "c", seed=3, targets=qv)}  # another rank


def test_the_shape_ignores_alpha_and_refuses_what_a_copy_cannot_carry(dirs):
    a, b, c = (load_host_lora(read_adapter(dirs[n])) for n in "abc")
    assert shape_key(a.config, a.state) == shape_key(b.config, b.state) != shape_key(c.config, c.state)
    a.config.use_dora = True
    assert shape_key(a.config, a.state) is None


async def test_an_evicted_adapters_modules_take_the_next_one_of_its_shape(dirs):
    eng = _engine(lora_device_slots=4, lora_host_slots=8, lora_prefetch=False, lora_cold_start="on_demand")
    await eng.start()
    try:
        for n in "abc":
            await eng.load_adapter(n, str(dirs[n]), wait=True)
        fresh = {n: await _run(eng, f"fresh-{n}", PROMPT, n) for n in "abc"}
        assert len(set(fresh.values())) == 3
        slots = eng._batch.slots
        for n in "abc":
            await eng.demote_adapter(n)
        assert slots.parked == 3 and {_tier(eng, n) for n in "abc"} == {"host"}
        # b comes back into a's modules (parked first, same shape; b's own alpha): PEFT's outputs
        assert await _run(eng, "again-b", PROMPT, "b") == fresh["b"]
        assert slots.reused == 1 and slots.parked == 0 and len(eng._batch.model.peft_config) == 1
        assert eng.lora_stats["slot_reuses"] == 1
        # nothing parked now: PEFT installs a
        assert await _run(eng, "again-a", PROMPT, "a") == fresh["a"]
        await eng.demote_adapter("a")
        assert slots.parked == 1
        # c (rank 16) cannot take a's rank-8 modules: they are deleted, PEFT installs c
        assert await _run(eng, "again-c", PROMPT, "c") == fresh["c"]
        assert slots.reused == 1 and slots.parked == 0 and len(eng._batch.model.peft_config) == 2
        assert await _run(eng, "b-still", PROMPT, "b") == fresh["b"]
    finally:
        await eng.stop()


async def test_unloading_the_last_adapter_deletes_parked_modules_too(dirs):
    eng = _engine(lora_device_slots=4, lora_host_slots=8, lora_prefetch=False)
    await eng.start()
    try:
        base = await _run(eng, "base", PROMPT)
        for n in "ab":
            await eng.load_adapter(n, str(dirs[n]), wait=True)
        await eng.demote_adapter("a")  # parked
        await eng.unload_adapter("b")  # the last one on the device
        assert eng._batch.slots.parked == 0 and eng._batch.lora is False
        await eng.unload_adapter("a")
        assert eng.load().adapters == [] and eng._batch.lora is False
        assert await _run(eng, "base-again", PROMPT) == base
    finally:
        await eng.stop()


def test_weights_peft_placed_under_other_names_are_never_copied_into(dirs):
    import types

    from polyserve.worker.engines.hf_model import build_random_model
    from polyserve.worker.engines.hf_slots import AdapterSlots

    batch = types.SimpleNamespace(model=build_random_model(0), lora=False)
    slots, host = AdapterSlots(), load_host_lora(read_adapter(dirs["a"]))
    slots.install(batch, "a", host.config, dict(host.state))
    peft_name = slots.peft_name("a")
    assert peft_name != "a" and batch.lora and slots._live["a"].key is not None
    odd = {"base_model.model.nowhere.lora_A.weight": next(iter(host.state.values()))}
    assert AdapterSlots._describe(batch.model, peft_name, ("any",), odd).key is None
    slots.remove(batch, "a", park=False)
    assert batch.lora is False and slots.parked == 0
