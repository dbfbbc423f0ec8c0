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
    "expert_cache_misses": ("moeferry_expert_cache_misses", "Expert lookups the device cache lacked"),
    "expert_bytes_fetched": ("moeferry_expert_fetched_bytes", "Expert bytes copied host -> device"),
    "experts_on_cpu": ("moeferry_experts_on_cpu", "Experts computed on the CPU (cpu and hybrid lanes, --moe-cpu-layers)"),
    "oom_caught": ("moeferry_oom_errors", "Out-of-memory errors the OOM guard caught in a step"),
    "cache_shrinks": ("moeferry_expert_cache_shrinks", "Times the OOM guard shrank the expert cache"),
}


def flat_worker_stats(worker: dict) -> dict:
    """The worker's stats with the expert backend's and the OOM guard's counters at the top level."""
    out = dict(worker)
    experts, memory = out.pop("experts", None) or {}, out.pop("memory", None) or {}
    out.update(expert_slots_total=experts.get("slots"), expert_slots_used=experts.get("slots_used"),
               expert_cache_hits=experts.get("hits"), expert_cache_misses=experts.get("misses"),
               expert_bytes_fetched=experts.get("bytes_fetched"), experts_on_cpu=experts.get("cpu_experts"),
               oom_caught=memory.get("oom_caught"),
               cache_shrinks=memory.get("cache_shrinks"))
    return out


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
        worker = flat_worker_stats(sup.worker_stats)
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
