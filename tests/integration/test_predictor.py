import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest

from polyserve.predictor.config import PredictorSettings
from polyserve.predictor.service import PredictorService
from polyserve.proto import Completed, Keys, Prediction, PredictRequest
from polyserve.shared import infra
from polyserve.shared.bus import BusError
from tests.helpers import running, wait_for

pytestmark = pytest.mark.integration


def completed(i: int, model: str = "m", inp: int = 100, out: int = 50) -> Completed:
    return Completed(request_id=f"r{i}", model=model, worker_id="w", input_tokens=inp, output_tokens=out,
                     e2e_ms=10.0, ttft_ms=1.0)


async def predict(bus, subjects, model: str = "m", inp: int = 100) -> Prediction:
    return await bus.request(subjects.predict, PredictRequest(request_id="q", model=model, input_tokens=inp),
                             Prediction, timeout=2)


def _until(fetch, ok):
    async def check():
        value = await fetch()
        return value if ok(value) else None
    return check


async def test_prior_then_history_persisted_across_restart(make_settings, bus, subjects, state, prefix):
    # A generous Redis timeout: while the proxy model loads, the event loop can stall past
    # the default 0.25 s, and a write that times out but was applied is counted twice on retry.
    cfg = make_settings(PredictorSettings, "predictor", refresh_s=0.2, redis_timeout_s=2.0)
    async with running(PredictorService(cfg)):
        first = await predict(bus, subjects)
        assert (first.source, first.tokens_estimate, first.length_class, first.num_classes) == ("prior", 129, 1, 5)
        for i in range(5):  # input 100 -> bucket 6 (64..127 tokens)
            await bus.publish(subjects.event("completed"), completed(i))

        async def learned():
            p = await predict(bus, subjects)
            return p.source == "history" and p.tokens_estimate == 50 and p

        p = await wait_for(learned, what="a history estimate after 5 completed events")
        assert p.length_class == 0  # "m" is unknown to the shipped artifact: its unseen-model bounds
        # persisted to Redis (a save that timed out anyway is retried after the back-off: wait)
        async def saved():
            return await state.r.hgetall(Keys(prefix).lenstats("m"))

        raw = await wait_for(_until(saved, lambda r: int(r.get(b"n:6", 0)) >= 5), what="all 5 saved")
        assert int(raw[b"n:6"]) == 5 and int(raw[b"sum:6"]) == 250
        # another bucket of the same model falls back to the model-wide mean; other models to the prior
        assert (await predict(bus, subjects, inp=5000)).source == "history"
        assert (await predict(bus, subjects, model="other")).source == "prior"

    async with running(PredictorService(make_settings(PredictorSettings, "predictor"))):
        again = await predict(bus, subjects)
        assert (again.source, again.tokens_estimate) == ("history", 50)


async def test_prediction_is_clamped_to_max_tokens(make_settings, bus, subjects):
    """A prediction never exceeds the request's max_tokens (0 = no cap known); the length
    class is that of the clamped estimate."""
    async def ask(max_tokens: int) -> Prediction:
        return await bus.request(subjects.predict, PredictRequest(request_id="q", model="m", input_tokens=100,
                                                                  max_tokens=max_tokens), Prediction, timeout=2)

    async with running(PredictorService(make_settings(PredictorSettings, "predictor", refresh_s=0.2))):
        p = await ask(20)  # the prior is 129 tokens, class 1
        assert (p.source, p.tokens_estimate, p.length_class) == ("prior", 20, 0)
        assert (await ask(0)).tokens_estimate == 129
        assert (await ask(1000)).tokens_estimate == 129
        for i in range(5):
            await bus.publish(subjects.event("completed"), completed(i, out=300))

        async def learned():
            return (await ask(0)).tokens_estimate == 300

        await wait_for(learned, what="a history estimate of 300 tokens")
        p = await ask(100)
        assert (p.source, p.tokens_estimate, p.length_class) == ("history", 100, 0)


async def test_bad_input_is_400(make_settings, bus, subjects):
    async with running(PredictorService(make_settings(PredictorSettings, "predictor"))):
        with pytest.raises(BusError) as err:
            await bus.request(subjects.predict, PredictRequest(request_id="q", model="m", input_tokens=-1),
                              Prediction, timeout=2)
        assert err.value.code == 400 and "input_tokens" in err.value.description
        with pytest.raises(BusError) as err:
            await bus.request(subjects.predict, PredictRequest(request_id="q", model="", input_tokens=3),
                              Prediction, timeout=2)
        assert err.value.code == 400 and "model" in err.value.description
        with pytest.raises(BusError) as err:
            await bus.request(subjects.predict, {"request_id": "q", "model": "m"}, Prediction, timeout=2)
        assert err.value.code == 400
        assert (await predict(bus, subjects)).source == "prior"  # still serving


async def test_two_predictors_count_each_event_once(make_settings, bus, subjects, state, prefix):
    a = PredictorService(make_settings(PredictorSettings, "predictor", refresh_s=0.1))
    b = PredictorService(make_settings(PredictorSettings, "predictor", refresh_s=0.1))
    async with running(a, b):
        for i in range(20):
            await bus.publish(subjects.event("completed"), completed(i, model="shared", inp=10, out=30))

        async def saved():
            raw = await state.r.hgetall(Keys(prefix).lenstats("shared"))
            return raw and int(raw[b"n:3"]) == 20

        await wait_for(saved, what="20 observations in Redis")
        assert a.handlers.learned + b.handlers.learned == 20
        for svc in (a, b):  # each sees what the other learned, through Redis
            async def seen(svc=svc):
                return (await svc.stats.get("shared")).overall.count == 20

            await wait_for(seen, what=f"{svc.settings.instance} to see all 20 observations")
        p = await predict(bus, subjects, model="shared", inp=10)
        assert (p.source, p.tokens_estimate) == ("history", 30)


@contextlib.contextmanager
def private_redis():
    """A redis-server of this test's own, so it can be stopped without disturbing others."""
    run_dir = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))
    sock = str(run_dir / "r.sock")
    procs = []

    def start():  # without persistence: a restart comes back empty (the data-loss case)
        proc, url = infra.start_redis(run_dir, unix_socket=sock, persist=False)
        procs.append(proc)
        return proc, url

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                infra.stop_pid(proc.pid)
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_redis_outage_answers_from_memory_and_saves_later(make_settings, bus, subjects, prefix):
    with private_redis() as start:
        proc, url = start()
        cfg = make_settings(PredictorSettings, "predictor", redis_url=url, refresh_s=0.1,
                            redis_timeout_s=1.0, redis_retry_s=0.2)
        svc = PredictorService(cfg)
        async with running(svc):
            for i in range(5):
                await bus.publish(subjects.event("completed"), completed(i, out=70))
            await wait_for(lambda: svc.handlers.learned == 5, what="5 learned")
            # written at most every FLUSH_EVERY_S, and by the refresh loop: saved before Redis goes
            await wait_for(lambda: not svc.stats.pending and not svc.stats.flushing, what="the first 5 saved")
            assert (await predict(bus, subjects)).tokens_estimate == 70
            infra.stop_pid(proc.pid)
            proc.wait(5)
            p = await predict(bus, subjects)  # answered from memory, well within the 2 s timeout
            assert (p.source, p.tokens_estimate) == ("history", 70)
            assert (await predict(bus, subjects, model="new")).source == "prior"
            for i in range(5, 10):  # learned while Redis is down: buffered
                await bus.publish(subjects.event("completed"), completed(i, out=170))
            await wait_for(lambda: svc.handlers.learned == 10, what="10 learned")
            assert (await predict(bus, subjects)).tokens_estimate == 120
            assert not svc.stats.redis_ok and svc.stats.pending
            proc, _ = start()  # Redis is back (empty): the buffered observations are written
            r = svc.state.r
            key = Keys(prefix).lenstats("m")

            async def saved():
                raw = await r.hgetall(key)
                return raw and int(raw[b"n:6"]) == 5 and int(raw[b"sum:6"]) == 5 * 170

            # the flush loop settles (nothing buffered or being written, Redis marked reachable)
            # before the hash is read: a read between a write and its bookkeeping proves nothing
            await wait_for(lambda: not (svc.stats.pending or svc.stats.flushing) and svc.stats.redis_ok,
                           timeout=10, what="the buffer written to the restarted Redis")
            assert await saved(), "each buffered observation is written exactly once"


async def test_history_is_shared_by_spellings_of_one_model(make_settings, bus, subjects, state, prefix):
    """Issue 17: names are normalised (core.model_names) before the history is read or written, and
    the history's length class is in the artifact's scheme for the model (its own percentiles)."""
    svc = PredictorService(make_settings(PredictorSettings, "predictor", refresh_s=0.2, redis_timeout_s=2.0))
    async with running(svc):
        for i in range(5):
            await bus.publish(subjects.event("completed"), completed(i, model="GPT-3.5-Turbo-0613", out=300))

        async def learned():
            p = await predict(bus, subjects, model="gpt-35-turbo-0613")
            return p.source == "history" and p.tokens_estimate == 300 and p

        p = await wait_for(learned, what="a history estimate under another spelling")
        gpt = svc.handlers.meta.classes["gpt-3.5-turbo-0613"]  # p50 282, p75 396.5: 300 is class 2
        assert p.length_class == int(gpt.classes([300])[0]) == 2
        raw = await wait_for(_until(lambda: state.r.hgetall(Keys(prefix).lenstats("gpt35turbo0613")),
                                    lambda r: int(r.get(b"n:6", 0)) >= 5), what="saved under the canonical name")
        assert int(raw[b"sum:6"]) == 1500
