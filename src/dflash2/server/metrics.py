"""``GET /metrics`` in Prometheus text format (prometheus_client), read from the engine at scrape time."""

from __future__ import annotations

import gc
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..engine.stats import LATENCY_BUCKETS, LatencyHistogram
from ..engine.gc_utils import GCPauses


def _histogram(name: str, doc: str, h: LatencyHistogram) -> HistogramMetricFamily:
    cum, buckets = 0, []
    for bound, n in zip([str(b) for b in LATENCY_BUCKETS] + ["+Inf"], h.counts):
        cum += n
        buckets.append((bound, cum))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.total)


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e, s = self.engine, self.engine.stats
        yield GaugeMetricFamily("dflash2_num_running_reqs", "Requests running", value=len(e.scheduler.running))
        yield GaugeMetricFamily("dflash2_num_waiting_reqs", "Requests waiting", value=len(e.scheduler.waiting))
        yield CounterMetricFamily("dflash2_generation_tokens", "Tokens generated", value=s.generated_tokens)
        yield CounterMetricFamily(
            "dflash2_requests_completed", "Requests finished normally (stop or length)", value=s.completed
        )
        yield CounterMetricFamily("dflash2_requests_aborted", "Requests aborted (client gone)", value=s.aborted)
        yield CounterMetricFamily("dflash2_requests_failed", "Requests ended by an error", value=s.failed)
        yield GaugeMetricFamily(
            "dflash2_engine_healthy", "1 while the engine loop is stepping", value=0.0 if e.health() else 1.0
        )
        yield CounterMetricFamily(
            "dflash2_spec_verify_steps", "Verification steps (one per request per step)", value=s.verify_steps
        )
        yield CounterMetricFamily("dflash2_preemptions", "Requests preempted", value=s.preemptions)
        pos = CounterMetricFamily(
            "dflash2_spec_accepted_tokens", "Draft tokens accepted, by position", labels=["position"]
        )
        for i, n in enumerate(s.accepted_by_position):
            pos.add_metric([str(i + 1)], n)
        yield pos
        yield GaugeMetricFamily(
            "dflash2_spec_accept_length",
            "Generated tokens per verification step",
            value=s.generated_tokens / s.verify_steps if s.verify_steps else 0.0,
        )
        yield GaugeMetricFamily(
            "dflash2_gen_throughput",
            "Generated tokens per second since start",
            value=s.generated_tokens / max(time.perf_counter() - s.started, 1e-9),
        )
        by_width = CounterMetricFamily("dflash2_spec_steps_by_width", "Batched steps by verify width", labels=["width"])
        for w, n in sorted(s.steps_by_width.items()):
            by_width.add_metric([str(w)], n)
        yield by_width
        steps = sum(s.steps_by_width.values())
        yield GaugeMetricFamily(
            "dflash2_spec_mean_width",
            "Verify width per batched step, averaged",
            value=sum(w * n for w, n in s.steps_by_width.items()) / steps if steps else 0.0,
        )
        yield CounterMetricFamily(
            "dflash2_spec_steps_trimmed",
            "Drafting steps verified narrower than drafted (the planner, from the draft's confidence)",
            value=s.steps_trimmed,
        )
        # calibration: the planner's per-draft acceptance estimate beside what the drafts did
        yield GaugeMetricFamily(
            "dflash2_spec_planner_alpha", "Planner's prior per-draft acceptance", value=e.planner.prior_alpha()
        )
        calib = e.planner.calibration
        fit = GaugeMetricFamily(
            "dflash2_spec_confidence_fit",
            "Acceptance from the draft's confidence: logistic (bias, slope) on logit(confidence) per position",
            labels=["position", "term"],
        )
        for i, (bias, slope) in enumerate(calib.coef if calib.fitted else ()):
            fit.add_metric([str(i + 1), "bias"], float(bias))
            fit.add_metric([str(i + 1), "slope"], float(slope))
        yield fit
        yield CounterMetricFamily(
            "dflash2_spec_requests_not_drafting",
            "Requests admitted without drafting (the planner: drafting could not pay at that load)",
            value=s.requests_not_drafting,
        )
        yield CounterMetricFamily(
            "dflash2_spec_requests_retired",
            "Requests that stopped drafting while running (the planner: drafting stopped paying)",
            value=s.requests_retired,
        )
        yield CounterMetricFamily(
            "dflash2_prompts_mixed",
            "Prompts that ran inside a decode step's forward (--enable-mixed-chunk)",
            value=s.prompts_mixed,
        )
        tried = s.drafts_proposed
        yield GaugeMetricFamily(
            "dflash2_spec_observed_accept_rate",
            "Accepted over proposed drafts, all steps",
            value=sum(s.accepted_by_position) / tried if tried else 0.0,
        )
        yield CounterMetricFamily("dflash2_prompt_tokens", "Prompt tokens prefilled", value=s.prompt_tokens)
        latency = (
            ("time_to_first_token_seconds", "Arrival to first token", s.ttft),
            ("e2e_request_latency_seconds", "Arrival to finish, finished requests", s.e2e),
            ("inter_token_latency_seconds", "Mean gap between a request's output tokens", s.itl),
        )
        for name, doc, h in latency:
            yield _histogram(f"dflash2_{name}", doc, h)
        # SGLang's names for what its dashboards and bench_serving read
        yield GaugeMetricFamily("sglang:num_running_reqs", "Requests running", value=len(e.scheduler.running))
        yield GaugeMetricFamily("sglang:num_queue_reqs", "Requests waiting", value=len(e.scheduler.waiting))
        yield CounterMetricFamily("sglang:prompt_tokens", "Prompt tokens prefilled", value=s.prompt_tokens)
        yield CounterMetricFamily("sglang:generation_tokens", "Tokens generated", value=s.generated_tokens)
        yield GaugeMetricFamily(
            "sglang:spec_accept_length",
            "Generated tokens per verification step",
            value=s.generated_tokens / s.verify_steps if s.verify_steps else 0.0,
        )
        for name, doc, h in latency:
            yield _histogram(f"sglang:{name}", doc, h)
        used, total = e.pool_usage()
        yield GaugeMetricFamily("dflash2_kv_blocks_used", "KV pool blocks in use", value=used)
        yield GaugeMetricFamily("dflash2_kv_blocks_total", "KV pool blocks", value=total)


class _GCCollector:
    def __init__(self, pauses: GCPauses):
        self.pauses = pauses

    def collect(self):
        yield CounterMetricFamily(
            "dflash2_gc_pause_seconds",
            "Seconds the server spent in Python garbage collections",
            value=self.pauses.seconds,
        )
        by_gen = CounterMetricFamily(
            "dflash2_gc_collections", "Python garbage collections, by generation", labels=["generation"]
        )
        for g, n in enumerate(self.pauses.count):
            by_gen.add_metric([str(g)], n)
        yield by_gen
        yield GaugeMetricFamily(
            "dflash2_gc_frozen_objects",
            "Objects no collection walks (frozen after start-up)",
            value=gc.get_freeze_count(),
        )


def render_metrics(engine, gc_pauses: GCPauses | None = None) -> str:
    reg = CollectorRegistry()
    reg.register(_EngineCollector(engine))
    if gc_pauses is not None:
        reg.register(_GCCollector(gc_pauses))
    return generate_latest(reg).decode()
