"""Control routes: /health (worker state and pid) and /v1/stats (requests, tokens, throughput, pools)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from moeferry.server.supervisor import OK

router = APIRouter()


def _server(request: Request):
    return request.app.state.server


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers probing
async def health(request: Request) -> JSONResponse:
    """200 with status ok when requests are served; 503 with loading (and progress), restarting or
    error (and the reason) otherwise."""
    sup = _server(request).supervisor
    body = {"status": sup.state, "worker_pid": sup.pid, "restarts": sup.restarts}
    if sup.progress is not None:
        body["progress"] = {"phase": sup.progress.phase, "fraction": round(sup.progress.fraction, 3)}
    if sup.reason:
        body["reason"] = sup.reason
    if sup.ready is not None:
        body["engine"] = _headline(sup)
    return JSONResponse(body, status_code=200 if sup.state == OK else 503)


def _headline(sup) -> dict:
    """The resolved sizes and the plan's headline numbers (current: the OOM guard may have shrunk the cache)."""
    sizes = sup.ready.sizes
    experts = sup.worker_stats.get("experts") or {}
    memory = sup.worker_stats.get("memory") or {}
    out = {"context_limit": sizes.max_seq_len, "kv_tokens": sizes.kv_tokens, "state_slots": sizes.num_state_slots,
           "expert_slots": experts.get("slots", sizes.expert_slots),
           "moe_backend": experts.get("backend") or sup.ready.details.get("moe_backend"),
           "cache_shrinks": memory.get("cache_shrinks", 0)}
    plan = sup.ready.plan
    if plan:
        out.update(usable_bytes=plan["usable"]["bytes"], transient_bytes=plan["terms"]["transient"]["bytes"],
                   margin_bytes=plan["terms"]["margin"]["bytes"])
    return out


@router.get("/v1/cache/status")
async def cache_status(request: Request) -> JSONResponse:
    """The memory plan (every term, its bytes and where it came from), the expert cache and the
    pools as they are now."""
    sup = _server(request).supervisor
    if sup.ready is None:
        return JSONResponse({"status": sup.state, "plan": None}, status_code=503)
    worker = sup.worker_stats
    return JSONResponse({"status": sup.state, "engine": _headline(sup), "plan": sup.ready.plan,
                         "plan_table": sup.ready.plan_table, "experts": worker.get("experts"),
                         "memory": worker.get("memory"),
                         "kv": {"tokens_used": worker.get("kv_tokens_used"), "tokens_total": worker.get("kv_tokens_total")},
                         "state_slots": {"used": worker.get("state_slots_used"),
                                         "total": worker.get("state_slots_total")}})


@router.get("/v1/stats")
async def stats(request: Request) -> dict:
    server = _server(request)
    sup = server.supervisor
    worker = dict(sup.worker_stats)
    out = {"status": sup.state, "worker_pid": sup.pid, "restarts": sup.restarts, "in_flight": sup.in_flight,
           **server.stats.snapshot()}
    out["kv"] = {"tokens_used": worker.pop("kv_tokens_used", None), "tokens_total": worker.pop("kv_tokens_total", None)}
    out["state_slots"] = {"used": worker.pop("state_slots_used", None),
                          "total": worker.pop("state_slots_total", None)}
    out["experts"] = worker.pop("experts", None)  # expert backend: cache hits / misses / bytes fetched
    out["memory"] = worker.pop("memory", None)  # OOM guard: errors caught, cache shrinks
    out["scheduler"] = worker  # running, waiting, preemptions, prefix_cache_hit_tokens, ...
    return out
