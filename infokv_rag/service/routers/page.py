"""GET /: a minimal page to upload a file and ask questions, streaming the answer."""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["page"])


@lru_cache(maxsize=1)
def _page() -> tuple[str, str]:
    html = resources.files("infokv_rag.service").joinpath("static/index.html").read_text(encoding="utf-8")
    hashes = []
    for kind in ("script", "style"):
        for body in re.findall(rf"<{kind}>(.*?)</{kind}>", html, flags=re.S):
            digest = base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode()
            hashes.append((kind, f"'sha256-{digest}'"))
    scripts = " ".join(h for k, h in hashes if k == "script")
    styles = " ".join(h for k, h in hashes if k == "style")
    # Only this page's own inline script and style run; it talks to this origin only.
    policy = (
        f"default-src 'none'; script-src {scripts}; style-src {styles}; connect-src 'self'; "
        "img-src 'self' data:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
    )
    return html, policy


@router.get("/", response_class=HTMLResponse, summary="A minimal web page: upload a document, ask, stream answers")
async def index() -> HTMLResponse:
    html, policy = _page()
    return HTMLResponse(html, headers={"Content-Security-Policy": policy, "Cache-Control": "no-cache"})
