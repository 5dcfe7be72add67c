"""Profiling of serving engines.

LLM engines: run one through a grid, fit Aladdin's and CaraServe's models, write a profile.

* `grid`: the grid runner, written against the `Engine` interface (hf, sim, vllm).
* `fit`: least-squares fits (Aladdin §3 prefill/decode/KV, CaraServe §5 BGMV/MBGMV),
  the profile JSON (a superset of the sim engine's profile format) and its reader.
* `bench_batching`: continuous vs static vs one-at-a-time batching, mixed-adapter cost.
* `cli`: `polyserve profile {run,fit-splitwise,list,show,bench-batching}`.
"""
