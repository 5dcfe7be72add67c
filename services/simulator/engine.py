"""One simulated worker: continuous batching with a KV budget, timed by the profile.

The iteration follows the project's `sim` engine (`polyserve.worker.engines.sim`) so the
two can be compared: each step admits waiting requests in queue order while batch
slots and KV allow (head-of-line, `polyserve.core.queue_order.admit_count`), runs one
prefill of the admitted prompts (which yields their first token), then one decode step
of the requests admitted before (one token each). Durations come from Aladdin's models
(`polyserve.core.perf.prefill_ms` / `decode_ms`) plus the LoRA share of the
worker's kernel (CaraServe BGMV/MBGMV, `perf_models.WorkerPerf.lora_ms`), and a
cold adapter's load time in the prefill.

KV (`kv_mode`):
* ``grow`` (vLLM's paged KV): a sequence holds kv(l_in + generated); admission needs
  kv(prompt + 1) on top of this step's growth; when a decode step would overflow, the
  latest admitted request is preempted (recompute: back to the queue, re-prefilled
  with its prompt and the tokens it had generated; its first-token time stands).
* ``reserve`` (the `sim` engine): admission reserves kv(l_in + reserved output) until
  the request ends; nothing is preempted.

Every running request advances one token per decode step, so the state of the batch is
kept as sums (Σ context = S + b·D for the decode-step counter D) and a heap of finish
steps: a step costs O(log n), not O(batch).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from polyserve.core import perf as core_perf
from polyserve.core import queue_order as wp
from polyserve.core.perf import WorkerPerf
from polyserve.gpu_agent import gpu_model


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request's life in the simulation (times in seconds)."""

    idx: int
    request_id: str
    arrival: float
    input_len: int
    output_len: int  # true length
    predicted_tokens: int = 0
    length_class: int = -1
    priority: int = 0
    adapter: str | None = None
    rank: int = 0
    client: int = -1  # the sending client where the trace has one (ServeGen)
    # filled by the worker
    worker: str = ""
    key: object = None
    seqs: int = 1
    kv_demand: int = 0
    prefill_len: int = 0  # prompt (+ generated, after a preemption) to prefill
    generated: int = 0  # tokens produced before the current residency
    g0: int = 0
    d0: int = 0
    admitted: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    preemptions: int = 0
    pauses: int = 0
    held_kv: int = 0  # KV kept while paused (refine_preempt): it resumes without a prefill
    in_queue: bool = False
    promoted: bool = False  # past a guard (overtake bound, tail guard): FCFS ahead of the rest, never paused
    rejected: str = ""

    @property
    def true_tokens(self) -> int:  # oracle SJF's key
        return self.output_len


@dataclass
class WorkerConfig:
    max_batch: int = 64
    kv_capacity: int = 0
    kv_mode: str = "grow"  # "grow" | "reserve"
    kernel: str = "bgmv"
    max_adapters: int = 0  # 0 = no limit
    adapter_load_ms_per_rank: float = 0.125  # cold adapter load (≈ rank-64 Llama2-7B adapter, 100 MiB, PCIe)
    max_waiting: int = 0  # 0 = unbounded
    max_prefill_tokens: int = 0  # prompt tokens per prefill (vLLM max_num_batched_tokens); 0 = no limit
    tp: int = 1  # GPUs of one worker
    # Shortest-expected-remaining-first (core.queue_order.Preemptor): with a full batch, pause a
    # running request whose refined key sorts behind a waiting one's (ssjf: its remaining size
    # given what it generated; sjf_oracle: its true remaining). Checked every preempt_quantum
    # decode steps; a paused request keeps its KV while memory allows (pause_kv), else it
    # re-prefills prompt + generated tokens when it resumes.
    refine_preempt: bool = False
    preempt_quantum: int = 16
    pause_kv: bool = True
    refine_by_client: bool = False  # the remaining-length tables also per client (RemainingEstimator.by_client)
    # ssjf: a request overtaken by more than ⌈this × the completions of the last P99 JCT⌉ others goes
    # first, FCFS among such (0 = off); on by default, as in a live worker's ssjf (core.size_rule)
    overtake_bound: float = wp.OVERTAKE_BOUND
    # ssjf: a request waiting past this quantile of recent JCTs goes first, FCFS among such (0 = off,
    # the default since the overtake bound; P70 before it)
    tail_guard: float = wp.TAIL_GUARD


@dataclass
class _Step:
    t0: float
    prefill_ms: float  # at the worker's clock
    new: list
    decoded: bool
    duration_ms: float = 0.0  # prefill + decode at the worker's clock
    base_prefill_ms: float = 0.0  # the same work at the maximum clock
    base_decode_ms: float = 0.0


class SimWorker:
    """A continuous-batching engine instance in simulated time."""

    def __init__(self, worker_id: str, perf: WorkerPerf, cfg: WorkerConfig, order_key, started_at: float = 0.0):
        self.id = worker_id
        self.perf = perf
        self.cfg = cfg
        self.order_key = order_key
        self.rule = None  # the queue order's state where it has one (core.queue_order.SizeRule)
        self.refined_key = None  # (request, generated, tokens to prefill) -> its key now (refine_preempt; cluster)
        self.preemptor = wp.Preemptor(cfg.preempt_quantum) if cfg.refine_preempt else None
        self.refine_preemptions = 0  # pauses
        self.paused_dropped = 0  # paused requests whose KV was freed for others (they re-prefill)
        self.kv_paused = 0  # grow mode: KV held by paused requests
        self.paused: dict[int, SimRequest] = {}
        self._ages: list[tuple[float, int, SimRequest]] = []  # waiting requests by arrival (lazy), for the guards
        self.promoted = 0
        self.started_at = started_at
        self.stopped_at: float | None = None
        self.ready_at = started_at
        self.waiting: list[tuple[object, int, SimRequest]] = []
        self.running: dict[int, SimRequest] = {}  # decode set, in admission order
        self._fin: list[tuple[int, int, SimRequest]] = []
        self.D = 0  # decode steps done
        self.S = 0  # Σ(l_in + g0 − d0) over the decode set: Σ context = S + b·D
        self.kv_reserved = 0  # reserve mode
        self.rank_count: dict[int, int] = {}
        self.sum_rank = 0
        self.adapters: OrderedDict[str, int] = OrderedDict()  # resident adapter -> rank (LRU order)
        self.adapter_refs: dict[str, int] = {}
        self.step: _Step | None = None
        self.busy_ms = 0.0
        self.steps = 0
        self.preemptions = 0
        self.kv_overflows = 0
        self.idle_since = started_at
        self.clock_x = 1.0  # SM clock / maximum clock; step times follow gpu_model's latency curve
        self.draining = False  # being stopped by an autoscaler: no new requests, stops when idle
        self._seq = 0

    # ------------------------------------------------------------------ views
    @property
    def b(self) -> int:
        return len(self.running)

    def n_waiting(self) -> int:
        return len(self.waiting)

    def in_flight(self) -> int:
        return len(self.running) + len(self.waiting) + (len(self.step.new) if self.step else 0)

    def kv_used(self) -> int:
        if self.cfg.kv_mode == "reserve":
            return self.kv_reserved
        h, j = self.perf.base.h, self.perf.base.j
        ctx = self.S + self.b * self.D
        held = sum(self.perf.kv(r.prefill_len + 1) for r in self.step.new) if self.step else 0.0
        return int(h * ctx + j * self.b + held) + self.kv_paused

    def max_rank(self) -> int:
        return max((r for r, c in self.rank_count.items() if c > 0), default=0)

    def generated_of(self, r: SimRequest) -> int:
        return r.g0 + self.D - r.d0

    def idle(self) -> bool:
        return self.step is None and not self.running and not self.waiting

    # ------------------------------------------------------------------ queue
    def enqueue(self, r: SimRequest, now: float) -> bool:
        """Queue a request; False (and r.rejected set) when the queue is full or it cannot fit."""
        if self.cfg.max_waiting and len(self.waiting) >= self.cfg.max_waiting:
            r.rejected = "queue full"
            return False
        if self.cfg.kv_capacity and self.perf.kv(r.input_len + 1) > self.cfg.kv_capacity:
            r.rejected = "prompt exceeds KV capacity"
            return False
        r.worker = self.id
        r.prefill_len = r.input_len + r.generated
        r.held_kv = 0
        if r.key is None:
            r.key = self.order_key(r)
            if self.rule is not None and self.rule.overtake_bound:  # FCFS would start it after those waiting
                self.rule.note_arrival(r, len(self.waiting))
        self._push(r)
        return True

    def _push(self, r: SimRequest) -> None:
        """Into the waiting queue under r.key (and the arrival heap the guards watch)."""
        self._seq += 1
        heapq.heappush(self.waiting, (r.key, self._seq, r))
        r.in_queue = True
        if self.rule is not None and (self.rule.tail_guard or self.rule.overtake_bound) and not r.promoted:
            heapq.heappush(self._ages, (r.arrival, self._seq, r))

    def rekey_waiting(self) -> None:
        """Waiting requests' keys again from `order_key` (the rule's W became warm); a paused or
        promoted request keeps the key its pause or a guard gave it."""
        if not self.waiting:
            return
        entries = []
        for _, seq, r in self.waiting:
            if not r.promoted and not r.pauses:
                r.key = self.order_key(r)
            entries.append((r.key, seq, r))
        heapq.heapify(entries)
        self.waiting = entries

    def _promote_overdue(self, now: float) -> None:
        """The guards (`core.queue_order.overdue`: the overtake bound, the tail guard): the requests
        past them go first, FCFS among such; checked from the earliest arrival on."""
        g, m = self.rule.guard(), self.rule.overtake_limit(now)
        while (g is not None or m is not None) and self._ages:
            a, _, r = self._ages[0]
            if r.in_queue and not r.promoted and not wp.overdue(self.rule, r, now, m):
                return
            heapq.heappop(self._ages)
            if not r.in_queue or r.promoted:
                continue
            r.promoted = True
            self.promoted += 1
            r.key = (a - 1e12, a)
            idx = next(i for i, e in enumerate(self.waiting) if e[2] is r)
            self.waiting[idx] = (r.key, self.waiting[idx][1], r)
            heapq.heapify(self.waiting)

    def remove_waiting(self, request_id: str) -> SimRequest | None:
        """Take a not-yet-started request out of the queue (Aladdin re-balancing)."""
        for k, (_, _, r) in enumerate(self.waiting):
            if r.request_id == request_id:
                self.waiting.pop(k)
                heapq.heapify(self.waiting)
                r.in_queue = False
                if self.paused.pop(r.idx, None) is not None:  # a paused request leaves its KV here
                    self.kv_paused -= r.held_kv if self.cfg.kv_mode == "grow" else 0
                    self._release(r)
                    r.held_kv = 0
                return r
        return None

    # ------------------------------------------------------------------ steps
    def start_step(self, now: float) -> float | None:
        """Begin the next iteration at `now`; its end time, or None when there is nothing to do."""
        cfg, perf = self.cfg, self.perf
        if self._ages and self.waiting:
            self._promote_overdue(now)
        preempted = self._preempt_for_growth() if cfg.kv_mode == "grow" and self.running else False
        if (not preempted and self.preemptor is not None and self.waiting and self.b >= cfg.max_batch
                and self.D % cfg.preempt_quantum == 0):
            self._pause_for_shorter(now)
        new: list[SimRequest] = []
        if self.waiting and not preempted:
            new = self._admit()
        if not new and not self.running:
            self.idle_since = now
            return None
        pre = 0.0
        if new:
            pre = perf.prefill_ms(sum(r.prefill_len for r in new)) + self._load_adapters(new)
            for r in new:
                if r.admitted < 0:
                    r.admitted = now
        dec = 0.0
        b = self.b
        if b:
            l_avg = (self.S + b * self.D) / b
            dec = perf.decode_ms(l_avg, b) + perf.lora_ms(cfg.kernel, b, self.max_rank(), self.sum_rank)
        pre_x, dec_x = pre, dec
        if self.clock_x < 1.0:  # prefill is compute bound, decode memory bound (gpu_model.llm_request)
            pre_x = gpu_model.llm_request(pre, 0.0).at(self.clock_x) if pre else 0.0
            dec_x = gpu_model.llm_request(0.0, dec).at(self.clock_x) if dec else 0.0
        self.step = _Step(now, pre_x, new, b > 0, pre_x + dec_x, pre, dec)
        self.busy_ms += pre_x + dec_x
        self.steps += 1
        return now + (pre_x + dec_x) / 1000.0

    def end_step(self, now: float) -> list[SimRequest]:
        """Finish the iteration begun by `start_step`; the requests that completed."""
        st, self.step = self.step, None
        done: list[SimRequest] = []
        if st.decoded:
            self.D += 1
            while self._fin and self._fin[0][0] <= self.D:
                _, _, r = heapq.heappop(self._fin)
                r.finish = now
                self._leave(r)
                done.append(r)
        t_first = st.t0 + st.prefill_ms / 1000.0
        for r in st.new:
            if r.first_token < 0:
                r.first_token = t_first
            r.g0 = r.generated + 1
            if r.g0 >= r.output_len:
                r.finish = t_first
                self._release(r)
                done.append(r)
                continue
            r.d0 = self.D
            self._join(r)
        return done

    def _join(self, r: SimRequest) -> None:
        """`r` (its `g0`, `d0` set) joins the decode set: the running sums and its finish event."""
        self.running[r.idx] = r
        self.S += r.input_len + r.g0 - r.d0
        self.rank_count[r.rank] = self.rank_count.get(r.rank, 0) + 1
        self.sum_rank += r.rank
        self._seq += 1
        heapq.heappush(self._fin, (self.D + r.output_len - r.g0, self._seq, r))

    # ------------------------------------------------------------------ internals
    def _admit(self) -> list[SimRequest]:
        cfg = self.cfg
        new: list[SimRequest] = []
        seqs, prompt = self.b, 0
        cap = cfg.kv_capacity or 1 << 62
        if cfg.kv_mode == "reserve":
            kv = self.kv_reserved
        else:  # this step's growth of the running sequences is spoken for
            kv = self.kv_used() + int(self.perf.base.h * self.b + 0.999)
        while self.waiting:
            r = self.waiting[0][2]
            if r.held_kv:  # paused with its KV: it rejoins the decode set, no prefill
                if seqs + 1 > cfg.max_batch:
                    break
                heapq.heappop(self.waiting)
                r.in_queue = False
                self._resume(r)
                seqs += 1
                continue
            r.kv_demand = self._demand(r)
            if wp.admit_count([r], seqs, kv, cfg.max_batch, cap) == 0 and self.paused \
                    and seqs + 1 <= cfg.max_batch:  # memory held by paused requests goes to the queue's head
                kv -= self._drop_paused(kv + r.kv_demand - cap)
            if wp.admit_count([r], seqs, kv, cfg.max_batch, cap) == 0 or not self._adapter_slot(r):
                break
            if cfg.max_prefill_tokens and new and prompt + r.prefill_len > cfg.max_prefill_tokens:
                break
            prompt += r.prefill_len
            heapq.heappop(self.waiting)
            r.in_queue = False
            new.append(r)
            seqs += 1
            kv += r.kv_demand
            if cfg.kv_mode == "reserve":
                self.kv_reserved += r.kv_demand
            if r.adapter is not None:
                self.adapter_refs[r.adapter] = self.adapter_refs.get(r.adapter, 0) + 1
        return new

    def _demand(self, r: SimRequest) -> int:
        if self.cfg.kv_mode == "reserve":
            out = min(r.predicted_tokens, r.output_len) if r.predicted_tokens > 0 else r.output_len
            return core_perf.kv_demand(self.perf.base, r.input_len, out)
        return int(self.perf.kv(r.prefill_len + 1) + 0.999)

    def _adapter_slot(self, r: SimRequest) -> bool:
        if r.adapter is None or r.adapter in self.adapters or not self.cfg.max_adapters:
            return True
        if len(self.adapters) < self.cfg.max_adapters:
            return True
        return any(self.adapter_refs.get(a, 0) == 0 for a in self.adapters)

    def _load_adapters(self, new: list[SimRequest]) -> float:
        """Make the adapters of `new` resident (LRU eviction of unused ones); load time in ms."""
        ms = 0.0
        for r in new:
            if r.adapter is None:
                continue
            if r.adapter in self.adapters:
                self.adapters.move_to_end(r.adapter)
                continue
            if self.cfg.max_adapters and len(self.adapters) >= self.cfg.max_adapters:
                victim = next((a for a in self.adapters if self.adapter_refs.get(a, 0) == 0), None)
                if victim is not None:
                    del self.adapters[victim]
            self.adapters[r.adapter] = r.rank
            ms += self.cfg.adapter_load_ms_per_rank * r.rank
        return ms

    def _pause_for_shorter(self, now: float) -> None:
        """Shortest expected remaining first (`core.queue_order.Preemptor`): pause the running
        requests whose key now sorts behind the best waiting keys; the waiting ones take their
        slots in this step's admission. Keys stay <= arrival + W (ssjf's starvation bound)."""
        keep = self.cfg.pause_kv
        rule, m = self.rule, self.rule.overtake_limit(now) if self.rule is not None else None
        running = [(self.refined_key(r, g, 0 if keep else r.input_len + g), self.D - r.d0, r)  # overdue: never paused
                   for r in self.running.values()
                   if not r.promoted and (rule is None or not wp.overdue(rule, r, now, m))
                   for g in (self.generated_of(r),)]
        heads = [k for k, _, _ in heapq.nsmallest(len(running), self.waiting)]
        margin = wp.PREEMPT_MARGIN * self.rule.window if self.rule is not None else 0.0
        for r in self.preemptor.victims(running, heads, margin):
            r.key = next(k for k, _, x in running if x is r)
            self.refine_preemptions += 1
            r.pauses += 1
            if keep:
                self._pause(r)
            else:
                self._requeue(r)

    def _pause(self, r: SimRequest) -> None:
        """Take running `r` out of the decode set; its KV (and adapter) stay until it resumes or
        the memory is needed (`_drop_paused`)."""
        r.generated = self.generated_of(r)
        self.running.pop(r.idx, None)
        self.S -= r.input_len + r.g0 - r.d0
        self.rank_count[r.rank] -= 1
        self.sum_rank -= r.rank
        self._fin = [(d, s, x) for d, s, x in self._fin if x is not r]
        heapq.heapify(self._fin)
        r.prefill_len = r.input_len + r.generated  # if its KV is dropped
        r.held_kv = max(1, int(self.perf.kv(r.input_len + r.generated) + 0.999)) if self.cfg.kv_mode == "grow" \
            else max(1, r.kv_demand)
        if self.cfg.kv_mode == "grow":
            self.kv_paused += r.held_kv
        self.paused[r.idx] = r
        self._push(r)

    def _resume(self, r: SimRequest) -> None:
        """A paused request with its KV rejoins the decode set where it stopped."""
        self.paused.pop(r.idx, None)
        if self.cfg.kv_mode == "grow":
            self.kv_paused -= r.held_kv
        r.held_kv = 0
        r.g0, r.d0 = r.generated, self.D
        self._join(r)

    def _drop_paused(self, need: float) -> int:
        """Free paused requests' KV (the worst-keyed first) until `need` tokens are free; those
        requests re-prefill prompt + generated tokens when they resume. Returns the KV freed."""
        freed = 0
        for r in sorted(self.paused.values(), key=lambda x: x.key, reverse=True):
            if freed >= need:
                break
            del self.paused[r.idx]
            freed += r.held_kv
            if self.cfg.kv_mode == "grow":
                self.kv_paused -= r.held_kv
            self._release(r)
            r.held_kv = 0
            self.paused_dropped += 1
        return freed

    def _requeue(self, r) -> None:
        """Preempt running `r` (recompute): back to the waiting queue under its key, to prefill
        its prompt and what it generated so far again."""
        r.generated = self.generated_of(r)
        self._leave(r)
        self._fin = [(d, s, x) for d, s, x in self._fin if x is not r]
        heapq.heapify(self._fin)
        r.preemptions += 1
        self.preemptions += 1
        r.prefill_len = r.input_len + r.generated
        self._push(r)

    def _preempt_for_growth(self) -> bool:
        """vLLM recompute preemption: while this decode step would overflow the KV budget,
        send the latest admitted request back to the queue."""
        cap = self.cfg.kv_capacity
        if not cap:
            return False
        h = self.perf.base.h
        hit = False
        if self.paused and self.kv_used() + h * self.b > cap:
            self._drop_paused(self.kv_used() + h * self.b - cap)
        while self.running and self.kv_used() + h * self.b > cap:
            if self.b == 1:  # alone and still out of room: let it overflow rather than livelock
                self.kv_overflows += 1
                return hit
            self._requeue(next(reversed(self.running.values())))
            hit = True
        return hit

    def _leave(self, r: SimRequest) -> None:
        self.running.pop(r.idx, None)
        self.S -= r.input_len + r.g0 - r.d0
        self.rank_count[r.rank] -= 1
        self.sum_rank -= r.rank
        self._release(r)

    def _release(self, r: SimRequest) -> None:
        if self.cfg.kv_mode == "reserve":
            self.kv_reserved -= r.kv_demand
        if r.adapter is not None:
            self.adapter_refs[r.adapter] = self.adapter_refs.get(r.adapter, 1) - 1
