"""worker: one engine instance behind `<prefix>.v1.worker.<id>.{generate,cancel}`.

Engines (`engines/`): `sim` — a digital twin whose prefill/decode timings follow
Aladdin's performance models with coefficients from a fitted profile
(`polyserve.core.profile_fit`, `polyserve.core.profiles`), always labelled simulated; `hf` and `vllm` run real
models. The worker streams TokenChunks to the requester's inbox, honours
cancellation, and reports its load in heartbeats (NATS + Redis with a TTL).
"""
