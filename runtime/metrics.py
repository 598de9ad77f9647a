"""Prometheus metrics of the serving engine, on a registry of their own (one per server, so tests
can build several apps in one process).

The engine calls the ``on_*`` hooks from its own thread; prometheus-client objects are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mkc_requests", "Requests finished, by endpoint outcome",
                                ["finish_reason"], registry=r)
        self.http_errors = Counter("mkc_http_errors", "Requests rejected with an error status",
                                   ["status"], registry=r)
        self.prompt_tokens = Counter("mkc_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("mkc_generated_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("mkc_preemptions", "Requests preempted (requeued) for KV space", registry=r)
        self.prefix_hit_tokens = Counter("mkc_prefix_cache_hit_tokens", "Prompt tokens served from the "
                                         "prefix cache", registry=r)
        self.ttft = Histogram("mkc_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mkc_inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("mkc_decode_step_seconds", "One batched decode step",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.prefilled_tokens = Counter("mkc_prefilled_tokens", "Prompt positions prefilled (prefix-cache hits "
                                        "not counted)", registry=r)
        self.prefill_time = Counter("mkc_prefill_seconds", "Time spent prefilling: prefilled tokens over it is "
                                    "the prefill rate", registry=r)
        self.running = Gauge("mkc_running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge("mkc_waiting_requests", "Requests queued (new or preempted)", registry=r)
        self.batch_occupancy = Gauge("mkc_batch_occupancy", "Running requests / max batch", registry=r)
        self.slots_in_use = Gauge("mkc_kv_slots_in_use", "KV cache slots (batch rows) held", registry=r)
        self.pages_in_use = Gauge("mkc_kv_pages_in_use", "KV pages held by running requests", registry=r)
        self.pages_cached = Gauge("mkc_kv_pages_cached", "KV pages held by the prefix cache", registry=r)
        self.pages_total = Gauge("mkc_kv_pages_total", "KV pages in the pool", registry=r)

    # -- hooks the engine calls -------------------------------------------------------------------
    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_token(self, gap_seconds: float | None) -> None:
        self.generated_tokens.inc()
        if gap_seconds is not None:
            self.itl.observe(gap_seconds)

    def on_finish(self, reason: str, prompt_tokens: int) -> None:
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)

    def on_preempt(self) -> None:
        self.preemptions.inc()

    def on_prefix_hit(self, tokens: int) -> None:
        self.prefix_hit_tokens.inc(tokens)

    def on_step(self, seconds: float) -> None:
        self.step_time.observe(seconds)

    def on_prefill(self, tokens: int, seconds: float) -> None:
        """``seconds`` of prefill work that finished ``tokens`` positions (0 for a part of a chunk)."""
        self.prefilled_tokens.inc(tokens)
        self.prefill_time.inc(seconds)

    def on_state(self, *, running: int, waiting: int, max_batch: int, pages_used: int, pages_cached: int,
                 pages_total: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.batch_occupancy.set(running / max_batch)
        self.slots_in_use.set(running)
        self.pages_in_use.set(pages_used)
        self.pages_cached.set(pages_cached)
        self.pages_total.set(pages_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
