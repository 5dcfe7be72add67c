
import pytest

from polyserve.proto import Prediction, PredictRequest
from polyserve.shared.bus import Bus, BusError
from polyserve.shared.telemetry import make_tracer

pytestmark = pytest.mark.integration


async def test_request_reply_errors_and_trace_propagation(infra_servers, subjects, span_exporter):
    tracer, _ = make_tracer("srv", exporter=span_exporter)
    server = await Bus.connect(infra_servers.nats_url, tracer, "srv")
    ctracer, _ = make_tracer("cli", exporter=span_exporter)
    client = await Bus.connect(infra_servers.nats_url, ctracer, "cli")

    async def handler(req: PredictRequest) -> Prediction:
        if req.input_tokens < 0:
            raise BusError(400, "input_tokens must be >= 0")
        if req.input_tokens == 999:
            raise RuntimeError("boom")
        return Prediction(request_id=req.request_id, model=req.model, length_class=1,
                          tokens_estimate=req.input_tokens * 2, source="prior")

    await server.serve(subjects.predict, PredictRequest, handler)
    await server.nc.flush()
    ok = await client.request(subjects.predict, PredictRequest(request_id="r", model="m", input_tokens=3),
                              Prediction, timeout=2)
    assert ok.tokens_estimate == 6
    with pytest.raises(BusError) as err:
        await client.request(subjects.predict, PredictRequest(request_id="r", model="m", input_tokens=-1),
                             Prediction, timeout=2)
    assert err.value.code == 400 and "input_tokens" in err.value.description
    with pytest.raises(BusError) as err:
        await client.request(subjects.predict, PredictRequest(request_id="r", model="m", input_tokens=999),
                             Prediction, timeout=2)
    assert err.value.code == 500 and "boom" in err.value.description
    with pytest.raises(BusError) as err:  # malformed payload
        await client.request(subjects.predict, {"request_id": 5}, Prediction, timeout=2)
    assert err.value.code == 400
    with pytest.raises(BusError) as err:  # nobody listening
        await client.request(subjects.dispatch, PredictRequest(request_id="r", model="m", input_tokens=1),
                             Prediction, timeout=1)
    assert err.value.code == 503
    spans = span_exporter.get_finished_spans()
    client_span = [s for s in spans if s.kind.name == "CLIENT"][0]
    server_span = [s for s in spans if s.kind.name == "SERVER"][0]
    assert server_span.context.trace_id == client_span.context.trace_id
    assert server_span.parent.span_id == client_span.context.span_id
    await server.close()
    await client.close()
