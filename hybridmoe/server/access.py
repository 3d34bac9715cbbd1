"""Who may call which route: the API key on every route but the liveness probe, a key of its own
for /metrics if given, and JSON bodies only, so that a web page cannot post a "simple" cross-site
request (text/plain, a form) that a browser sends without asking the server first."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.requests import Request

from hybridmoe.server.protocol import ApiError

OPEN_PATHS = frozenset({"/health"})  # a bare liveness probe: no key, nothing to read


@dataclass(frozen=True)
class Access:
    api_key: str | None = None
    metrics_key: str | None = None  # None: /metrics takes the API key
    allowed_origins: tuple[str, ...] = ()  # CORS; none: browsers may not read answers cross-site

    def check(self, request: Request) -> None:
        """Raise the 401 that refuses `request` if it lacks the key its route needs."""
        path = request.url.path
        if path in OPEN_PATHS or request.method == "OPTIONS":  # CORS preflights carry no key
            return
        key = self.metrics_key if path == "/metrics" and self.metrics_key else self.api_key
        if key is not None:
            _check_key(request, key)


def require_json(request: Request) -> None:
    """A 415 unless the body is declared JSON (each route that reads a body calls this)."""
    if not _is_json(request.headers.get("content-type", "")):
        raise ApiError(
            415,
            "The request body must be JSON: send 'Content-Type: application/json'.",
            code="unsupported_media_type",
        )


def _check_key(request: Request, key: str) -> None:
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        what = "No API key was provided" if not given else "Incorrect API key provided"
        raise ApiError(
            401, f"{what}; send it as 'Authorization: Bearer KEY'.", code="invalid_api_key"
        )


def _is_json(content_type: str) -> bool:
    """application/json, with parameters (charset) or not; also application/*+json types."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )
