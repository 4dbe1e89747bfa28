"""Hand-written, not generated: what the sync and async faces cannot share by rewriting.

`scripts/unasync.py` makes `sandbox.py` from `async_sandbox.py` by renaming (`AsyncX` -> `X`,
`async_x` -> `x`, `await` dropped). Each name here comes in both shapes because the two differ in
more than the keywords: under asyncio an output callback may be a coroutine function, and an
upload body may be an async iterable or an async file object (aiofiles and the like).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import IO, Any

from agentbox.sdk import protocol as p

OutputCallback = Callable[[str], Any]
AsyncOutputCallback = Callable[[str], Any] | Callable[[str], Awaitable[Any]]
WriteData = str | bytes | bytearray | memoryview | IO[bytes] | Iterable[bytes]
AsyncWriteData = WriteData | AsyncIterable[bytes]


def deliver(callback: Callable[[Any], Any] | None, data: Any) -> None:
    if callback is not None:
        callback(data)


async def async_deliver(callback: Callable[[Any], Any] | None, data: Any) -> None:
    if callback is None:
        return
    result = callback(data)
    if inspect.isawaitable(result):
        await result


def upload_body(data: WriteData) -> bytes | Iterator[bytes]:
    if isinstance(data, str | bytes | bytearray | memoryview):
        return p.upload_parts(bytes(data) if not isinstance(data, str) else data)
    read = getattr(data, "read", None)
    if callable(read):
        return _file_chunks(read)
    return (p.upload_parts(chunk) for chunk in data)


def _file_chunks(read: Callable[[int], Any]) -> Iterator[bytes]:
    # Chunked upload: a file object is never read into memory as a whole.
    while True:
        chunk = read(p.CHUNK_SIZE)
        if not chunk:
            return
        yield p.upload_parts(chunk)


def async_upload_body(data: AsyncWriteData) -> bytes | AsyncIterator[bytes]:
    if isinstance(data, str | bytes | bytearray | memoryview):
        return p.upload_parts(bytes(data) if not isinstance(data, str) else data)
    return _async_chunks(data)


async def _async_chunks(data: Any) -> AsyncIterator[bytes]:
    # Chunked upload: a file object is never read into memory as a whole.
    read = getattr(data, "read", None)
    if callable(read):
        while True:
            chunk = read(p.CHUNK_SIZE)
            if inspect.isawaitable(chunk):  # an async file object
                chunk = await chunk
            if not chunk:
                return
            yield p.upload_parts(chunk)
    elif hasattr(data, "__aiter__"):
        async for chunk in data:
            yield p.upload_parts(chunk)
    else:
        for chunk in data:
            yield p.upload_parts(chunk)
