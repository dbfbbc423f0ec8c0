"""/metrics: the server's counters, latency histograms and pool use in Prometheus' text format.

`ServerMetrics` is a prometheus_client collector over the objects that already count things
(ServerStats, the supervisor and the worker's stats), read at scrape time, in a registry of
its own per app, so nothing is counted twice and no global registry is touched.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moeferry.server.supervisor import OK

router = APIRouter()

# worker stats key -> (metric name, help)
WORKER_GAUGES = {
    "running": ("moeferry_requests_running", "Requests in the running batch"),
    "waiting": ("moeferry_requests_waiting", "Requests queued for admission"),
    "kv_tokens_used": ("moeferry_kv_cache_used_tokens", "KV cache tokens in use"),
    "kv_tokens_total": ("moeferry_kv_cache_capacity_tokens", "KV cache capacity in tokens"),
    "prefix_cache_tokens": ("moeferry_prefix_cache_tokens", "Tokens held by the prefix cache"),
    "state_slots_used": ("moeferry_state_slots_used", "Recurrent-state slots in use"),
    "state_slots_total": ("moeferry_state_slots_total", "Recurrent-state slots"),
    "expert_slots_used": ("moeferry_expert_cache_used_slots", "Expert-cache slots holding an expert"),
    "expert_slots_total": ("moeferry_expert_cache_slots", "Expert-cache slots on the device"),
}
WORKER_COUNTERS = {
    "preemptions": ("moeferry_preemptions", "Requests preempted to free KV pages"),
    "prefix_cache_hit_tokens": ("moeferry_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    "steps": ("moeferry_engine_steps", "Engine steps run"),
    "expert_cache_hits": ("moeferry_expert_cache_hits", "Expert lookups served from the device cache"),
    "expert_cache_misses": ("moeferry_expert_cache_misses", "Expert lookups that had to be fetched"),
}


class ServerMetrics:
    def __init__(self, server):
        self.server = server

    def collect(self):
        stats, sup = self.server.stats, self.server.supervisor
        requests = CounterMetricFamily("moeferry_requests", "Requests by outcome", labels=["outcome"])
        for outcome in ("finished", "failed", "aborted", "rejected"):
            requests.add_metric([outcome], getattr(stats, f"requests_{outcome}"))
        yield requests
        tokens = CounterMetricFamily("moeferry_tokens", "Tokens by kind", labels=["kind"])
        for kind in ("prompt", "cached", "completion"):
            tokens.add_metric([kind], getattr(stats, f"{kind}_tokens"))
        yield tokens
        yield CounterMetricFamily("moeferry_worker_restarts", "Engine worker restarts", value=sup.restarts)
        yield GaugeMetricFamily("moeferry_requests_in_flight", "Requests the API process is serving",
                                value=sup.in_flight)
        yield GaugeMetricFamily("moeferry_worker_up", "1 while the engine worker serves requests",
                                value=1 if sup.state == OK else 0)
        worker = dict(sup.worker_stats)
        for key, (name, doc) in WORKER_GAUGES.items():
            if worker.get(key) is not None:
                yield GaugeMetricFamily(name, doc, value=worker[key])
        for key, (name, doc) in WORKER_COUNTERS.items():
            if worker.get(key) is not None:
                yield CounterMetricFamily(name, doc, value=worker[key])
        for histogram in (stats.ttft, stats.itl, stats.e2e):
            yield from histogram.collect()


def registry_for(server) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerMetrics(server))
    return registry


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)
