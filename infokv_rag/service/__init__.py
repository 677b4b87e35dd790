"""The HTTP service: upload a document, then ask about it (JSON, SSE, OpenAI-compatible).

`create_app(settings)` builds the FastAPI application (for tests and any ASGI server); `serve()` runs it
with uvicorn (`infokv-rag serve`). The core package knows nothing of HTTP: everything web lives here.
"""

from .settings import Settings

__all__ = ["Settings", "create_app", "serve"]


def __getattr__(name: str):  # lazy: importing the settings must not import FastAPI
    if name in ("create_app", "serve"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
