"""GET /: a minimal page to upload a file and ask questions, streaming the answer."""

from __future__ import annotations

import base64
import hashlib
import html as markup
import re
from functools import lru_cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from ..dependencies import ServiceDep

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
async def index(request: Request, service: ServiceDep) -> HTMLResponse:
    html, policy = _page()
    # The answer length field starts at this server's own default and stops at its limit, and the script calls
    # the API under the path prefix the page is served under (markup, not script: the policy's hashes stay those
    # of the file).
    settings = service.settings
    html = html.replace("__ROOT_PATH__", markup.escape(request.scope.get("root_path", ""), quote=True))
    html = html.replace("__DEFAULT_MAX_TOKENS__", str(settings.default_max_tokens))
    html = html.replace("__MAX_NEW_TOKENS__", str(settings.max_new_tokens))
    return HTMLResponse(html, headers={"Content-Security-Policy": policy, "Cache-Control": "no-cache"})
