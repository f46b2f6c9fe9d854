"""Bearer-token check for /v1/* when the server was started with --api-key."""

from __future__ import annotations

import hmac

from fastapi import Depends, Request

from server.errors import APIError


def _check_api_key(request: Request) -> None:
    expected = request.app.state.aerie.settings.api_key
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), expected):
        raise APIError(
            401,
            "Incorrect or missing API key. Pass it as 'Authorization: Bearer KEY'.",
            code="invalid_api_key",
        )


require_api_key = Depends(_check_api_key)
