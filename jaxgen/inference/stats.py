"""The engine's statistics, kept in one place: a prometheus_client registry per engine.

    stats = EngineStats(slots=16, queue_length=engine.queue_length, ...)   # live gauges read on demand
    stats.submitted(4); stats.first_token(request); stats.finished(request)
    prometheus_client.generate_latest(stats.registry)                     # what GET /metrics returns
    stats.snapshot()                                                      # the same figures as a dict

Counters count events (requests submitted, finished, cancelled, failed, preempted; tokens generated,
prefilled, recomputed, served from the prefix cache); gauges read the engine's state when collected
(queue, slots, pages); time to first token, time per output token and request latency are histograms
with vLLM's buckets. Every name starts with `jaxgen_`; prometheus_client adds `_total` to counters.

Compilation (issue 45): `jaxgen_compiles_total{program, phase}` counts each trace of one of the engine's
programs (one XLA compilation, or one load from jax's persistent cache, which traces and lowers first),
`phase` "before_ready" or "after_ready" (after `Engine.start`, or `LLM` built): a program compiled after ready
made a request wait. A program loaded from `jaxgen.executables`' store is not traced: it counts only in
`jaxgen_compile_cache_hits_total`, beside the persistent cache's hits. `jaxgen_compile_seconds_total` sums,
per program, the seconds jax reported tracing, lowering and compiling it, and the store's loads.
`jaxgen_startup_seconds{phase}` is what the command line measured at start (import, load, engine).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

from jax import monitoring
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxgen import executables

# snapshot key: (metric name, help). The keys are the names `Engine.metrics()` has always returned.
COUNTERS = {
    "requests_total": ("jaxgen_requests", "sequences submitted"),
    "requests_finished": ("jaxgen_requests_finished", "sequences finished"),
    "requests_cancelled": ("jaxgen_requests_cancelled", "sequences cancelled (clients that went away)"),
    "requests_failed": ("jaxgen_requests_failed", "sequences that failed (their own error or a failed device step)"),
    "requests_preempted": ("jaxgen_requests_preempted", "preemptions: a sequence's pages freed, to recompute later"),
    "generated_tokens_total": ("jaxgen_generated_tokens", "tokens generated"),
    "prompt_tokens_total": ("jaxgen_prompt_tokens", "prompt tokens prefilled (cache hits excluded)"),
    "recomputed_tokens_total": ("jaxgen_recomputed_tokens", "tokens prefilled again after a preemption"),
    "prefix_cache_hit_tokens": ("jaxgen_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache"),
    "prefix_cache_lookup_tokens": ("jaxgen_prefix_cache_lookup_tokens", "prompt tokens looked up in the cache"),
    "busy_seconds": ("jaxgen_engine_busy_seconds", "seconds the scheduler spent in steps"),
    "spec_target_steps": ("jaxgen_spec_target_steps", "speculative decoding: target steps, summed over slots"),
    "spec_draft_tokens": ("jaxgen_spec_draft_tokens", "speculative decoding: draft tokens checked"),
    "spec_accepted_tokens": ("jaxgen_spec_accepted_tokens", "speculative decoding: draft tokens kept"),
}
LIVE = {  # gauges read from the engine when collected: snapshot key: (metric name, help)
    "queue_length": ("jaxgen_queue_length", "requests waiting for a slot or their prefill"),
    "running_slots": ("jaxgen_running_slots", "decode slots generating now"),
    "cache_pages_in_use": ("jaxgen_cache_pages_in_use", "KV-cache pages referenced by sequences"),
    "cache_pages_total": ("jaxgen_cache_pages_total", "KV-cache pages in the pool"),
}
# vLLM's buckets (vllm/engine/metrics.py), in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


# jax's duration events of one compilation (each names the function; the engine's program is the caller's)
COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration", executables.LOAD_DURATION_EVENT,
})  # fmt: skip
CACHE_HIT_EVENTS = frozenset({"/jax/compilation_cache/cache_hits", executables.LOADED_EVENT})
_calling = threading.local()  # .program = (EngineStats, name) while the engine calls one of its programs


class EngineStats:
    """Every statistic of one engine. Thread-safe: the engine thread counts, the HTTP server collects."""

    def __init__(self, slots: int, **live: Callable[[], float]):
        missing = set(LIVE) - set(live)
        if missing:
            raise ValueError(f"EngineStats needs a function for each live gauge; missing {sorted(missing)}")
        self.registry = CollectorRegistry()
        r = self.registry
        self.counters = {key: Counter(name, text, registry=r) for key, (name, text) in COUNTERS.items()}
        self.live = live
        for key, (name, text) in LIVE.items():
            Gauge(name, text, registry=r).set_function(live[key])
        Gauge("jaxgen_slots", "decode slots in all", registry=r).set(slots)
        self.slots = slots
        rate = Gauge("jaxgen_prefix_cache_hit_rate", "share of prompt tokens served from the prefix cache", registry=r)
        rate.set_function(self.prefix_hit_rate)
        speed = Gauge("jaxgen_tokens_per_second", "generated tokens per second of engine work", registry=r)
        speed.set_function(self.tokens_per_second)
        accept = Gauge("jaxgen_spec_acceptance_rate", "speculative decoding: share of draft tokens kept", registry=r)
        accept.set_function(self.acceptance_rate)
        per_step = Gauge("jaxgen_spec_tokens_per_step", "speculative decoding: tokens per slot's target step",
                         registry=r)  # fmt: skip
        per_step.set_function(self.tokens_per_step)
        self.ttft = Histogram("jaxgen_time_to_first_token_seconds", "time from submission to the first token",
                              registry=r, buckets=TTFT_BUCKETS)  # fmt: skip
        self.tpot = Histogram("jaxgen_time_per_output_token_seconds", "time per output token after the first",
                              registry=r, buckets=TPOT_BUCKETS)  # fmt: skip
        self.latency = Histogram("jaxgen_request_latency_seconds", "time from submission to the end (finished)",
                                 registry=r, buckets=LATENCY_BUCKETS)  # fmt: skip
        self.ready = False  # set by Engine.start (or LLM): compilations from then on are "after_ready"
        self.muted = False  # True while the start's warm-up runs (`jaxgen.inference.precompile`): not traffic
        labels = ("program", "phase")
        self.compiles = Counter("jaxgen_compiles", "engine programs traced and compiled (or loaded from the cache)",
                                labels, registry=r)  # fmt: skip
        self.compile_seconds = Counter("jaxgen_compile_seconds", "seconds jax spent tracing, lowering and compiling",
                                       labels, registry=r)  # fmt: skip
        self.cache_hits = Counter("jaxgen_compile_cache_hits", "programs loaded from a cache (jax's, the store)",
                                  labels, registry=r)  # fmt: skip
        self.startup_seconds = Gauge("jaxgen_startup_seconds", "seconds each phase of the start took", ["phase"],
                                     registry=r)  # fmt: skip
        _listen_to_jax()

    # --- events, as the engine sees them -----------------------------------------------------------

    def count(self, key: str, n: float = 1) -> None:
        """Adds `n` to the counter `key` (a key of COUNTERS)."""
        if n and not self.muted:
            self.counters[key].inc(n)

    def submitted(self, n: int) -> None:
        self.count("requests_total", n)

    def ended(self, status: str) -> None:
        """A sequence cancelled or failed (one that finished is `finished`)."""
        self.count("requests_cancelled" if status == "cancelled" else "requests_failed")

    def preempted(self) -> None:
        self.count("requests_preempted")

    def prefilled(self, n: int, recomputed: bool) -> None:
        self.count("recomputed_tokens_total" if recomputed else "prompt_tokens_total", n)

    def prefix_lookup(self, looked_up: int, hits: int) -> None:
        self.count("prefix_cache_lookup_tokens", looked_up)
        self.count("prefix_cache_hit_tokens", hits)

    def first_token(self, seconds: float) -> None:
        if not self.muted:
            self.ttft.observe(seconds)

    def finished(self, t_submit: float, t_first: float | None, t_done: float, tokens: int) -> None:
        if self.muted:
            return
        self.count("requests_finished")
        self.latency.observe(t_done - t_submit)
        if t_first is not None and tokens > 1:
            self.tpot.observe((t_done - t_first) / (tokens - 1))

    # --- compilation -------------------------------------------------------------------------------

    @property
    def phase(self) -> str:
        return "after_ready" if self.ready else "before_ready"

    def compiled(self, program: str) -> None:
        """One trace of the engine's `program` (from `decode.counted`, on the calling thread)."""
        self.compiles.labels(program, self.phase).inc()

    def attributed(self, program: str, fn: Callable) -> Callable:
        """`fn` (one of the engine's jitted programs), its compilations' seconds and cache hits counted as
        `program`'s: jax reports them on the thread that calls, while the call runs."""

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with self.calling(program):
                return fn(*args, **kwargs)

        return call

    @contextlib.contextmanager
    def calling(self, program: str):
        outer = getattr(_calling, "program", None)
        _calling.program = (self, program)
        try:
            yield
        finally:
            _calling.program = outer

    def startup(self, phase: str, seconds: float) -> None:
        """What the start's `phase` took (the command line measures them: import, load, engine)."""
        self.startup_seconds.labels(phase).set(seconds)

    def compile_figures(self) -> dict[tuple[str, str], dict[str, float]]:
        """{(program, phase): {"compiles", "seconds", "cache_hits"}} of every program compiled so far."""
        out: dict[tuple[str, str], dict[str, float]] = {}
        for key, metric in (("compiles", self.compiles), ("seconds", self.compile_seconds),
                            ("cache_hits", self.cache_hits)):  # fmt: skip
            for sample in next(iter(metric.collect())).samples:
                if sample.name.endswith("_total"):
                    where = (sample.labels["program"], sample.labels["phase"])
                    out.setdefault(where, {"compiles": 0, "seconds": 0.0, "cache_hits": 0})[key] = sample.value
        return out

    # --- reading ---------------------------------------------------------------------------------

    def speculated(self, target_steps: int, drafts: int, accepted: int) -> None:
        """A speculative decode chunk: slots' target steps, draft tokens checked and kept."""
        self.count("spec_target_steps", target_steps)
        self.count("spec_draft_tokens", drafts)
        self.count("spec_accepted_tokens", accepted)

    def value(self, key: str) -> float:
        """A counter's total, by its snapshot key."""
        return self.registry.get_sample_value(COUNTERS[key][0] + "_total") or 0.0

    def mean(self, histogram: str) -> float:
        """The mean of everything a histogram observed (0 before anything)."""
        get = self.registry.get_sample_value
        count = get(f"{histogram}_count") or 0.0
        return (get(f"{histogram}_sum") or 0.0) / count if count else 0.0

    def prefix_hit_rate(self) -> float:
        lookups = self.value("prefix_cache_lookup_tokens")
        return self.value("prefix_cache_hit_tokens") / lookups if lookups else 0.0

    def tokens_per_second(self) -> float:
        busy = self.value("busy_seconds")
        return self.value("generated_tokens_total") / busy if busy else 0.0

    def acceptance_rate(self) -> float:
        drafts = self.value("spec_draft_tokens")
        return self.value("spec_accepted_tokens") / drafts if drafts else 0.0

    def tokens_per_step(self) -> float:
        """Each slot's target step gives its drawn token and the drafts it kept."""
        steps = self.value("spec_target_steps")
        return (steps + self.value("spec_accepted_tokens")) / steps if steps else 0.0

    def snapshot(self) -> dict[str, float]:
        """Every figure as a dict (`Engine.metrics()`): counters as ints, histograms as their means."""
        out: dict[str, float] = {key: fn() for key, fn in self.live.items()}
        out["slots"] = self.slots
        out |= {key: int(self.value(key)) for key in COUNTERS if key != "busy_seconds"}
        out["prefix_cache_hit_rate"] = self.prefix_hit_rate()
        out["tokens_per_second"] = self.tokens_per_second()
        out["spec_acceptance_rate"] = self.acceptance_rate()
        out["spec_tokens_per_step"] = self.tokens_per_step()
        out["time_to_first_token_seconds"] = self.mean("jaxgen_time_to_first_token_seconds")
        out["time_per_output_token_seconds"] = self.mean("jaxgen_time_per_output_token_seconds")
        out["request_latency_seconds"] = self.mean("jaxgen_request_latency_seconds")
        return out


def _on_duration(event: str, seconds: float, **_) -> None:
    target = getattr(_calling, "program", None)
    if target is not None and event in COMPILE_EVENTS:
        stats, program = target
        stats.compile_seconds.labels(program, stats.phase).inc(seconds)


def _on_event(event: str, **_) -> None:
    target = getattr(_calling, "program", None)
    if target is not None and event in CACHE_HIT_EVENTS:
        stats, program = target
        stats.cache_hits.labels(program, stats.phase).inc()


@functools.cache
def _listen_to_jax() -> None:
    """jax's monitoring listeners, registered once per process (they cost nothing outside an engine's call)."""
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)
