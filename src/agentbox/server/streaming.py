"""Streamed answers: NDJSON event streams and byte streams whose source is always closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

_closings: set[asyncio.Task[None]] = set()


class Streamed(StreamingResponse):
    """A streamed response whose source is closed when the response ends, however it ends:
    sent in full, the client gone, or an error on the way.

    Starlette does not close a half-read body iterator; an async generator left so is closed
    only when the garbage collector gets to it, and its cleanup (unmounting a kept workspace,
    killing tar, letting go of an agent stream) would wait for that.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                # To its end even when this task is being cancelled.
                task = asyncio.ensure_future(aclose())
                _closings.add(task)
                task.add_done_callback(_closings.discard)
                await asyncio.shield(task)


def ndjson(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield (json.dumps(event, separators=(",", ":")) + "\n").encode()
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    return Streamed(
        body(),
        media_type="application/x-ndjson",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
