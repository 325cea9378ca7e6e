"""Prometheus metrics of one server.

The engine thread records finished requests here and, after every step, a snapshot of
`engine.stats()` (the engine is not thread-safe, so /metrics must not call it); engine
totals (pages, steps, tokens, speculation counts, chosen draft lengths) are read from
that snapshot when /metrics renders. Each server has its own registry, so that several
servers can live in one process (tests).
"""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tidal.request import RequestOutput

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.stats: dict = {}
        self.registry.register(EngineStatsCollector(self))
        r = self.registry
        self.ttft = Histogram("tidal_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tidal_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tidal_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.finished = Counter("tidal_requests_finished", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("tidal_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("tidal_cached_prompt_tokens",
                                            "Prompt tokens served by the prefix cache", registry=r)

    def update_stats(self, stats: dict) -> None:
        self.stats = stats

    def record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        completion = out.outputs[0]
        self.finished.labels(completion.finish_reason).inc()
        self.prompt_tokens.inc(m["num_prompt_tokens"])
        self.cached_prompt_tokens.inc(m["num_cached_prompt_tokens"])
        self.e2e.observe(m["finish_time"] - m["arrival_time"])
        if m["first_token_time"] is not None:
            self.ttft.observe(m["first_token_time"] - m["arrival_time"])
            if len(completion.token_ids) > 1:
                self.tpot.observe((m["finish_time"] - m["first_token_time"]) / (len(completion.token_ids) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineStatsCollector:
    """Turns the latest `engine.stats()` snapshot into metric families at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.stats
        yield GaugeMetricFamily("tidal_num_requests_running", "Requests in the running batch", s["num_running"])
        yield GaugeMetricFamily("tidal_num_requests_waiting", "Requests waiting to be admitted", s["num_waiting"])
        yield GaugeMetricFamily("tidal_kv_cache_pages", "KV cache pages in all", s["num_pages"])
        yield GaugeMetricFamily("tidal_kv_cache_free_pages", "KV cache pages not held by a request",
                                s["num_free_pages"])
        yield GaugeMetricFamily("tidal_kv_cache_usage", "Fraction of KV cache pages held by requests",
                                1 - s["num_free_pages"] / s["num_pages"])
        yield CounterMetricFamily("tidal_prefix_cache_hit_pages", "Pages reused from the prefix cache",
                                  s["prefix_cache_hit_pages"])
        yield CounterMetricFamily("tidal_preemptions", "Requests preempted for lack of KV pages",
                                  s["num_preemptions"])
        yield CounterMetricFamily("tidal_steps", "Engine forward steps", s["num_steps"])
        yield CounterMetricFamily("tidal_steps_ahead", "Steps queued on the device behind the one before "
                                  "(async scheduling)", s["num_steps_ahead"])
        yield CounterMetricFamily("tidal_generation_tokens", "Output tokens committed", s["num_generated_tokens"])
        yield CounterMetricFamily("tidal_kernel_compiles_while_serving", "Triton kernels built after start-up "
                                  "(each a stall in the step that needed it)", s["kernel_compiles_while_serving"])
        spec = s["spec"]
        yield CounterMetricFamily("tidal_spec_draft_tokens", "Draft tokens proposed and verified",
                                  spec["num_drafted"])
        yield CounterMetricFamily("tidal_spec_accepted_tokens", "Draft tokens accepted", spec["num_accepted"])
        yield CounterMetricFamily("tidal_spec_draft_steps", "Request-steps in which drafts were verified",
                                  spec["num_steps"])
        yield GaugeMetricFamily("tidal_spec_mean_accepted_length",
                                "Tokens committed per drafting step (accepted drafts + 1)",
                                spec["mean_accepted_length"])
        acceptance = GaugeMetricFamily("tidal_spec_acceptance_rate", "Acceptance rate of each draft position",
                                       labels=["position"])
        for position, rate in enumerate(spec["acceptance_per_position"], start=1):
            acceptance.add_metric([str(position)], rate)
        yield acceptance
        yield from self.goodput(s["policy"])
        counts = s["policy"]["draft_len_counts"]  # [K] = decoding requests the policy gave K drafts
        cumulative = list(itertools.accumulate(counts))
        yield HistogramMetricFamily(
            "tidal_spec_draft_length", "Draft length K chosen for a decoding request in a step (0 = plain decode)",
            buckets=[(str(k), n) for k, n in enumerate(cumulative)] + [("+Inf", cumulative[-1])],
            sum_value=sum(k * n for k, n in enumerate(counts)))

    @staticmethod
    def goodput(policy: dict):
        """The goodput policy's decisions and how well its cost model predicts step times."""
        if policy["name"] != "goodput":
            return
        yield CounterMetricFamily("tidal_policy_decisions", "Draft-length decisions made", policy["num_decisions"])
        yield CounterMetricFamily("tidal_policy_held_decisions", "Decisions that kept the previous K (hysteresis)",
                                  policy["num_held"])
        yield CounterMetricFamily("tidal_policy_probes", "One-token probes of requests sitting at K = 0",
                                  policy["num_probes"])
        yield CounterMetricFamily("tidal_policy_explored_decisions", "Decisions that ran a neighbouring K to see "
                                  "its step's price", policy["num_explored"])
        times = policy["step_time"]
        step = GaugeMetricFamily("tidal_policy_step_seconds", "The last observed step's time, as predicted and "
                                 "as observed", labels=["kind"])
        step.add_metric(["predicted"], times["predicted_s"])
        step.add_metric(["observed"], times["observed_s"])
        yield step
        yield GaugeMetricFamily("tidal_policy_step_time_error", "Mean absolute relative error of predicted step "
                                "times (exponential average)", times["mean_abs_rel_error"])
