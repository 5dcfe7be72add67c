"""`polyserve bench replay`: open-loop replay of a request trace against a running gateway.

Requests leave at their trace arrival times (rescaled, optionally a slice of the
original timeline), never waiting for earlier ones, through the official `openai`
client (AsyncOpenAI, streaming). Each prompt has the trace's input length in the
deployment's tokens and `max_tokens` = `min_tokens` = the trace's output length.
Per request: TTFT (first content chunk), ATGT ((last token − first token) ÷ (output
tokens − 1), as the simulator defines it), end-to-end latency and errors (counted,
never fatal). The results row has the simulator's keys (`simulator.report.metrics`),
labelled "live" and MEASURED; `--simulate PROFILE` adds the same requests through
`simulate_requests`, labelled SIMULATED, for a side-by-side comparison.

Token counts of prompts: the deployment's tokenizer where it can be known — the sim
engine's rule (ceil(1.3 × words)), the random hf model's WordPiece tokenizer, a local
checkpoint directory named by /v1/models or `--tokenizer DIR` — else the same
1.3-tokens-per-word approximation (printed as such). The engine's own count comes
back in `usage` and is what the comparison with the simulator uses.

Rows, the table, plots and files: `bench.replay_report` (its names are importable from
here as well).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from polyserve.bench.replay_report import live_row, plot_cdfs, requests_json, sim_row, table, write_json
from polyserve.simulator.trace import Trace, datasets_dir, load_azure_llm, window

WORDS_TO_TOKENS = 1.3
SHAREGPT = datasets_dir() / "text" / "sharegpt_prompts_1000.json"
_WORDS = ("the a of and to in is that for it with as on this by from we can model token request batch cache "
          "latency queue serve worker power length output input time system data will report table value "
          "answer question write explain summary story code list plan city river music light paper").split()


class ReplayError(ValueError):
    """Bad input to a replay; the message says what to fix."""


# ------------------------------------------------------------------ tokenizers and prompts
class WordsTokenizer:
    """ceil(1.3 × whitespace words): exactly the sim engine's count, else an approximation."""

    def __init__(self, exact: bool):
        self.name = "sim engine rule ceil(1.3 x words)" if exact else "approximation: ceil(1.3 x words)"

    def count(self, text: str) -> int:
        return math.ceil(len(text.split()) * WORDS_TO_TOKENS)

    def fit(self, text: str, n: int) -> str:
        words = text.split()
        w = max(1, int(n / WORDS_TO_TOKENS))
        while w > 1 and math.ceil(w * WORDS_TO_TOKENS) > n:
            w -= 1
        return " ".join(words[:w])


class HFTokenizer:
    """A Hugging Face tokenizer, counting prompt tokens as the hf engine does."""

    def __init__(self, tok, name: str, add_special: bool = True, bos: bool = False):
        self.tok, self.name, self.add_special, self.extra = tok, name, add_special, int(bos and not add_special)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=self.add_special)) + self.extra

    def fit(self, text: str, n: int) -> str:
        ids = self.tok.encode(text, add_special_tokens=False)
        k = max(1, n - (self.count("") if self.add_special else self.extra))
        out = text
        for _ in range(4):  # decode/encode is not exactly invertible: correct the length a few times
            out = self.tok.decode(ids[:k], skip_special_tokens=True)
            diff = n - self.count(out)
            if diff == 0 or k + diff < 1:
                break
            k += diff
        return out


def resolve_tokenizer(spec: str, engine: str, root: str):
    """`spec`: "auto" (from the deployment's engine and model), "words", or a checkpoint directory."""
    if spec == "words":
        return WordsTokenizer(exact=engine == "sim")
    if spec not in ("", "auto"):
        if not Path(spec, "tokenizer_config.json").is_file() and not Path(spec, "tokenizer.json").is_file():
            raise ReplayError(f"--tokenizer {spec}: not a tokenizer directory (no tokenizer.json / "
                              "tokenizer_config.json); pass a local checkpoint directory, 'words' or 'auto'")
        from transformers import AutoTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(spec), spec)
    if engine == "sim":
        return WordsTokenizer(exact=True)
    if engine == "hf" and root and Path(root, "config.json").is_file():
        return resolve_tokenizer(root, engine, root)
    if engine == "hf":  # the random model: WordPiece of all-MiniLM-L6-v2, [CLS] prepended as BOS
        from polyserve.worker.engines.hf_model import fallback_tokenizer

        return HFTokenizer(fallback_tokenizer(), "all-MiniLM-L6-v2 WordPiece (random hf model)", False, True)
    return WordsTokenizer(exact=False)


def _source_words(kind: str, n_words: int, rng: random.Random, sharegpt: list[str]) -> str:
    if kind == "synthetic":
        return " ".join(rng.choice(_WORDS) for _ in range(n_words))
    parts, have = [], 0
    while have < n_words:
        p = rng.choice(sharegpt)
        parts.append(p)
        have += len(p.split())
    return "\n\n".join(parts)


def load_sharegpt(path: str | Path = SHAREGPT) -> list[str]:
    """First human turns of the ShareGPT sample (non-empty)."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ReplayError(f"cannot read ShareGPT prompts {path}: {exc}; use --prompts synthetic") from exc
    out = [c["value"] for r in rows for c in r.get("conversations", [])[:1] if c.get("value", "").strip()]
    if not out:
        raise ReplayError(f"{path}: no prompts")
    return out


def make_prompts(lengths, kind: str, tokenizer, seed: int = 0, sharegpt_path: str | Path = SHAREGPT) -> list[str]:
    """One prompt per target length, `kind` "synthetic" (random common words) or "sharegpt"."""
    if kind not in ("synthetic", "sharegpt"):
        raise ReplayError(f"--prompts {kind!r}: choose sharegpt or synthetic")
    rng = random.Random(seed)
    pool = load_sharegpt(sharegpt_path) if kind == "sharegpt" else []
    out = []
    for n in lengths:
        n = max(1, int(n))
        text = _source_words(kind, int(n * 1.2) + 16, rng, pool)
        while tokenizer.count(text) < n:  # short source: take more
            text += "\n" + _source_words(kind, n, rng, pool)
        out.append(tokenizer.fit(text, n))
    return out


# ------------------------------------------------------------------ trace
def parse_slice(text: str) -> tuple[float, float | None]:
    """"A:B" seconds of the original trace ("A:" = to the end; "" = all)."""
    if not text:
        return 0.0, None
    a, sep, b = text.partition(":")
    try:
        start, end = float(a or 0), (float(b) if b else None)
    except ValueError:
        raise ReplayError(f"--slice {text!r}: expected START:END in seconds, e.g. 0:600") from None
    if not sep or start < 0 or (end is not None and end <= start):
        raise ReplayError(f"--slice {text!r}: expected START:END seconds with 0 <= START < END")
    return start, end


def load_trace(path: str | Path, slice_: str = "", rate_scale: float = 1.0, duration_s: float | None = None,
               max_requests: int = 0) -> Trace:
    """The trace's requests to replay: slice, rescale, cut to duration and count."""
    if not Path(path).is_file():
        raise ReplayError(f"--trace {path}: no such file (an Azure LLM trace CSV: TIMESTAMP,ContextTokens,"
                          f"GeneratedTokens, e.g. {datasets_dir() / 'traces' / 'azure_llm_2023_conv.csv'})")
    if rate_scale <= 0:
        raise ReplayError(f"--rate-scale {rate_scale}: must be > 0 (2 = twice the trace's rate)")
    if duration_s is not None and duration_s <= 0:
        raise ReplayError(f"--duration {duration_s}: must be > 0 seconds")
    start, end = parse_slice(slice_)
    try:
        tr = window(load_azure_llm(path), start_s=start, end_s=end, rate_scale=rate_scale, duration_s=duration_s)
    except (KeyError, ValueError) as exc:
        raise ReplayError(f"--trace {path}: {exc}") from exc
    if max_requests > 0 and len(tr) > max_requests:
        tr = Trace(tr.name, tr.arrival[:max_requests], tr.input_len[:max_requests], tr.output_len[:max_requests])
    return tr


# ------------------------------------------------------------------ the open-loop client
@dataclass
class LiveRequest:
    """One replayed request (seconds from the replay's start; latencies in ms; nan when failed)."""

    idx: int
    arrival_s: float  # scheduled (trace) offset
    sent_s: float  # when the client issued it
    input_tokens: int  # trace
    output_tokens: int  # trace
    prompt_tokens: int = -1  # engine's count (usage), -1 if unknown
    completion_tokens: int = -1
    ttft_ms: float = float("nan")
    atgt_ms: float = float("nan")
    e2e_ms: float = float("nan")
    error: str = ""
    request_id: str = ""  # the gateway's id (the stream's `id`), to match request events


def _error_text(exc: BaseException) -> str:
    import openai

    if isinstance(exc, openai.APIStatusError):
        return f"http {exc.status_code}: {str(exc.message)[:160]}"
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return f"connection: {exc.__cause__ or exc}"[:160]
    return f"{type(exc).__name__}: {exc}"[:160]


async def _one(client, model: str, r: LiveRequest, prompt: str, t0: float, loop) -> LiveRequest:
    r.sent_s = loop.time() - t0
    first = last = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=int(r.output_tokens), stream=True, temperature=0,
            stream_options={"include_usage": True}, extra_body={"min_tokens": int(r.output_tokens)})
        async for chunk in stream:
            now = loop.time()
            r.request_id = r.request_id or chunk.id
            if chunk.choices and (chunk.choices[0].text or chunk.choices[0].finish_reason):
                first = now if first is None else first
                last = now
            if chunk.usage is not None:
                r.prompt_tokens, r.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
        end = loop.time()
        if first is None:
            raise RuntimeError("stream ended without a token")
        start = t0 + r.sent_s
        r.ttft_ms, r.e2e_ms = (first - start) * 1e3, (end - start) * 1e3
        n = r.completion_tokens if r.completion_tokens > 0 else r.output_tokens
        r.atgt_ms = (last - first) * 1e3 / (n - 1) if n > 1 else 0.0
    except Exception as exc:  # noqa: BLE001 - every failure is a counted error, never fatal to the replay
        r.error = _error_text(exc)
    return r


async def replay(url: str, model: str, trace: Trace, prompts: list[str], *, progress: bool = True,
                 timeout_s: float = 600.0, api_key: str = "unused", lead_s: float = 0.2) -> list[LiveRequest]:
    """Send every request at its arrival offset (open loop) and return them in trace order."""
    import openai
    from tqdm.auto import tqdm

    if len(prompts) != len(trace):
        raise ReplayError("need one prompt per request")
    loop = asyncio.get_running_loop()
    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0,
                                timeout=timeout_s)
    reqs = [LiveRequest(k, float(trace.arrival[k]), float("nan"), int(trace.input_len[k]),
                        int(trace.output_len[k])) for k in range(len(trace))]
    bar = tqdm(total=len(reqs), unit="req", desc="replay", disable=not progress, mininterval=0.5)
    errors = 0

    def done(task: asyncio.Task) -> None:
        nonlocal errors
        errors += bool(task.result().error)
        bar.update(1)
        bar.set_postfix(errors=errors, refresh=False)

    tasks = []
    t0 = loop.time() + lead_s
    try:
        for r, prompt in zip(reqs, prompts):
            delay = t0 + r.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(client, model, r, prompt, t0, loop))
            task.add_done_callback(done)
            tasks.append(task)
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
        await client.close()
    return reqs


async def deployment_info(url: str, model: str, api_key: str = "unused") -> dict:
    """The /v1/models entry of `model` (raises ReplayError naming the served models when absent)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10) as c:
            resp = await c.get(url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {api_key}"})
            resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise ReplayError(f"--url {url}: cannot reach the gateway ({exc}); is polyserve up?") from exc
    data = resp.json().get("data", [])
    for m in data:
        if m.get("id") == model:
            return m
    raise ReplayError(f"--model {model!r} is not served at {url}; served: {[m.get('id') for m in data]}")


# ------------------------------------------------------------------ CLI
def validate_args(args) -> None:
    """Raise ReplayError naming the flag to fix."""
    if not args.url.startswith(("http://", "https://")):
        raise ReplayError(f"--url {args.url!r}: expected http://HOST:PORT of a polyserve gateway")
    for flag in ("ttft_slo_ms", "atgt_slo_ms", "timeout"):
        if getattr(args, flag) <= 0:
            raise ReplayError(f"--{flag.replace('_', '-')} must be > 0")
    if getattr(args, "simulate", None) and (args.workers < 1 or args.max_batch < 1):
        raise ReplayError("--workers and --max-batch must be >= 1")


async def run(args) -> dict:
    """Resolve the tokenizer, build prompts, replay, and (with --simulate) simulate the same requests."""
    validate_args(args)
    trace = load_trace(args.trace, args.slice, args.rate_scale, args.duration, args.max_requests)
    info = await deployment_info(args.url, args.model)
    tok = resolve_tokenizer(args.tokenizer, str(info.get("engine", "")), str(info.get("root", "")))
    prompts = make_prompts(trace.input_len, args.prompts, tok, seed=args.seed)
    say = print if args.progress else (lambda *a, **k: None)
    say(f"replaying {len(trace)} requests over {trace.duration_s:.1f}s ({trace.rate:.2f} req/s, {trace.name}) "
        f"to {args.url} model {args.model} (engine {info.get('engine', '?')}); prompt tokens: {tok.name}")
    reqs = await replay(args.url, args.model, trace, prompts, progress=args.progress, timeout_s=args.timeout)
    row, lat = live_row(reqs, args.ttft_slo_ms, args.atgt_slo_ms, workers=None)
    row.update(load=args.rate_scale, tokenizer=tok.name, engine=info.get("engine"))
    rows, lats = [row], {"live (measured)": lat}
    if getattr(args, "simulate", None):
        srow, slat, _ = sim_row(reqs, args.simulate, workers=args.workers, max_batch=args.max_batch,
                                ttft_slo_ms=args.ttft_slo_ms, atgt_slo_ms=args.atgt_slo_ms)
        srow["load"] = args.rate_scale
        rows.append(srow)
        lats["simulator (SIMULATED)"] = slat
    return {"trace": {"path": str(args.trace), "slice": args.slice, "rate_scale": args.rate_scale,
                      "duration_s": args.duration, "requests": len(trace), "rate": trace.rate},
            "rows": rows, "latencies": lats, "requests": reqs}


def main(args) -> int:
    """`polyserve bench replay`."""
    try:
        res = asyncio.run(run(args))
    except ReplayError as exc:
        print(f"error: {exc}")
        return 2
    title = f"{res['trace']['requests']} requests of {Path(args.trace).name}, rate x{args.rate_scale:g}"
    text = table(res["rows"], title)
    print(text)
    live = res["rows"][0]
    if live["errors"]:
        print(f"errors: {live['errors']} e.g. {live['error_examples'][:2]}")
    lag = live["send_lag_ms"]
    print(f"send lag (ms, sent - scheduled): mean {lag['mean']:.1f}, max {lag['max']:.1f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {"measured": True, "note": "row 'live' is measured against a running "
                                      "gateway; rows with simulated=true are SIMULATED", "trace": res["trace"],
                                      "rows": res["rows"], "requests": requests_json(res["requests"])})
    (out / "results.txt").write_text(text + "\n")
    paths = [out / "results.json", out / "results.txt"]
    if not args.no_plots:
        paths.append(plot_cdfs(res["latencies"], out / "latency_cdf.png", title))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    p.add_argument("--model", required=True, help="a model (deployment) id from /v1/models")
    p.add_argument("--trace", default=str(datasets_dir() / "traces" / "azure_llm_2023_conv.csv"),
                   help="Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="rate multiplier (0.5 = half the trace's rate)")
    p.add_argument("--slice", default="", help="START:END seconds of the original trace (before rescaling)")
    p.add_argument("--duration", type=float, default=None, help="replay the first S seconds (after rescaling)")
    p.add_argument("--max-requests", type=int, default=0, help="at most N requests (0 = all)")
    p.add_argument("--prompts", choices=("sharegpt", "synthetic"), default="sharegpt",
                   help=f"prompt text: ShareGPT first turns ({SHAREGPT}) or random common words")
    p.add_argument("--tokenizer", default="auto",
                   help="'auto' (from the deployment's engine), 'words' (1.3 tokens/word) or a tokenizer directory")
    p.add_argument("--ttft-slo-ms", type=float, default=1600.0, help="default: Aladdin Table 2, Llama2-70B")
    p.add_argument("--atgt-slo-ms", type=float, default=75.0, help="default: Aladdin Table 2, Llama2-70B")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--simulate", default="", metavar="PROFILE",
                   help="also run the same requests through the simulator with this profile JSON")
    p.add_argument("--workers", type=int, default=1, help="workers of the simulated cluster (--simulate)")
    p.add_argument("--max-batch", type=int, default=64, help="max batch of the simulated workers (--simulate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="replay-out", help="output folder")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", dest="progress", action="store_false")
