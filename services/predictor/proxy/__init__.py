"""µ-Serve's output-length proxy model (§3.3) and semantic cache.

* `labels`: per-model percentile class bounds, class medians, metrics (pure).
* `data`: the training set from `../shared/datasets/text/`, split by prompt.
* `model`: encoder (all-MiniLM-L6-v2 by default) + LoRA + a two-layer head.
* `train`, `evaluate`: two-phase fine-tuning and µ-Serve's Table 2.
* `artifact`: the small on-disk artifact (head, LoRA, bounds, tokenizer, data hash).
* `cache`: the semantic cache of true output lengths (faiss, persisted in Redis).
* `runtime`, `buckets`: loading in a thread, micro-batched inference with a budget.
* `semantic`: the cache as the service uses it (pending requests, Redis sync).
* `infer`, `bench`: a loaded artifact; latency and throughput figures.

`labels`, `data`, `artifact`, `buckets`, `runtime` and `semantic` import no torch;
`cache` needs faiss-cpu; the rest need the `hf` extra (torch, transformers,
peft). The predictor service imports them lazily and keeps the historical mean
as its fallback when they are missing.
"""
