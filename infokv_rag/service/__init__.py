"""The HTTP service: upload a document, then ask about it (JSON, SSE, OpenAI-compatible).

`create_app(settings)` builds the FastAPI application (for tests and any ASGI server); `serve()` runs it
with uvicorn (`infokv-rag serve`). The core package knows nothing of HTTP: everything web lives here.

    INFOKV_API_KEYS=tenantA:$(python -c 'import secrets; print(secrets.token_urlsafe(32))') \
        infokv-rag serve --model tiny --port 8000 --data-dir ./service-data
    curl -H "X-API-Key: $KEY" -F file=@contract.pdf http://127.0.0.1:8000/v1/documents      # 202 {"id": ...}
    curl -H "X-API-Key: $KEY" http://127.0.0.1:8000/v1/documents/$ID                       # status, progress
    curl -H "X-API-Key: $KEY" -H 'content-type: application/json' \
        -d '{"question": "What is the notice period?", "stream": true}' http://127.0.0.1:8000/v1/documents/$ID/ask
    # OpenAI clients: base_url=http://127.0.0.1:8000/v1, extra_body={"document_id": ID}. Page: /, API docs: /docs

Settings (`Settings`, or `INFOKV_<FIELD>` environment variables): API keys, each of a tenant (required
unless INFOKV_ALLOW_ANONYMOUS=1; see `tenants`), limits (upload bytes, pages, characters, question
characters, max tokens), queue sizes and each tenant's share of them, the prefill chunk of uploads, and how
many compressed caches stay in memory. Run one process per data directory (it is locked): the model worker in
it owns the model.
"""

from typing import Any

from .settings import Settings

__all__ = ["Settings", "create_app", "serve"]


def __getattr__(name: str) -> Any:  # lazy: importing the settings must not import FastAPI
    if name in ("create_app", "serve"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
