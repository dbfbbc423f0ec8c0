"""Control routes: /health (worker state and pid) and /v1/stats (requests, tokens, throughput, pools)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from moeferry.server.supervisor import OK

router = APIRouter()


def _server(request: Request):
    return request.app.state.server


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 with status ok when requests are served; 503 with loading (and progress), restarting or
    error (and the reason) otherwise."""
    sup = _server(request).supervisor
    body = {"status": sup.state, "worker_pid": sup.pid, "restarts": sup.restarts}
    if sup.progress is not None:
        body["progress"] = {"phase": sup.progress.phase, "fraction": round(sup.progress.fraction, 3)}
    if sup.reason:
        body["reason"] = sup.reason
    return JSONResponse(body, status_code=200 if sup.state == OK else 503)


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
    out["scheduler"] = worker  # running, waiting, preemptions, prefix_cache_hit_tokens, ...
    return out
