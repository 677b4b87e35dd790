"""/healthz: liveness for anyone (no API key needed); what the server is doing for an admin key only.

The counts cover every tenant: a prefill's token count or a queue's length would show one tenant when and
how much another uploads and asks.
"""

from __future__ import annotations

import time

from fastapi import APIRouter

from ..dependencies import OptionalCallerDep, ServiceDep
from ..schemas import Health, error_responses

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    response_model=Health,
    response_model_exclude_none=True,
    summary="Liveness; with an admin key also queue lengths and counters",
    responses=error_responses(401),
    openapi_extra={"security": [{}]},  # beside the key schemes FastAPI lists: no key is needed for liveness
)
async def healthz(service: ServiceDep, caller: OptionalCallerDep) -> Health:
    assert service.worker is not None
    health = Health(model=service.model_id, uptime_seconds=round(time.time() - service.started_at, 3))
    if caller is None or not caller.admin:
        return health
    return health.model_copy(
        update={
            "documents": service.registry.counts(),
            "queue": service.worker.queue_state(),
            "counters": {**service.worker.counters, **service.registry.counters},
        }
    )
