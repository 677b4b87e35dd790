"""/healthz: liveness plus what the worker is doing (open: no API key, no document data)."""

from __future__ import annotations

import time

from fastapi import APIRouter

from ..dependencies import ServiceDep
from ..schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness, queue lengths and counters")
async def healthz(service: ServiceDep) -> Health:
    assert service.worker is not None
    return Health(
        model=service.model_id,
        uptime_seconds=round(time.time() - service.started_at, 3),
        documents=service.registry.counts(),
        queue=service.worker.queue_state(),
        counters={**service.worker.counters, **service.registry.counters},
    )
