"""Hand-written, not generated: what the sync and async faces cannot share by rewriting.

`scripts/unasync.py` makes `sandbox.py` from `async_sandbox.py` by renaming (`AsyncX` -> `X`,
`async_x` -> `x`, `await` dropped). Each name here comes in both shapes because the two differ in
more than the keywords: under asyncio an output callback may be a coroutine function, an
upload body may be an async iterable or an async file object (aiofiles and the like), and a
background command's callbacks are fed by a task while the caller goes on.
"""

from __future__ import annotations

import inspect
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
)
from typing import IO, TYPE_CHECKING, Any, TypedDict

from agentbox.sdk import protocol as p

if TYPE_CHECKING:  # imported where used: the sync face (and the CLI) never loads asyncio
    import asyncio

OutputCallback = Callable[[str], Any]
AsyncOutputCallback = Callable[[str], Any] | Callable[[str], Awaitable[Any]]
WriteData = str | bytes | bytearray | memoryview | IO[bytes] | Iterable[bytes]
AsyncWriteData = WriteData | AsyncIterable[bytes]


class WriteEntry(TypedDict):
    """A file for `files.write_files`: {"path": ..., "data": ...} or WriteEntry(path=, data=)."""

    path: str
    data: WriteData


class AsyncWriteEntry(TypedDict):
    path: str
    data: AsyncWriteData


class LiveOutput:
    """A background command's output on its way to its callbacks. Sync code has no loop to run
    them meanwhile, so they fire during `wait()`, as in E2B's sync SDK."""

    def __init__(self, deliver: Callable[[], None]) -> None:
        self._deliver = deliver

    def wait(self) -> None:
        self._deliver()


# Running tasks are referenced here until done: the loop holds tasks only weakly, and a caller
# that dropped the handle (keeping just the callbacks) must not see its output stop.
_following: set[asyncio.Task[None]] = set()


class AsyncLiveOutput:
    """A background command's output on its way to its callbacks: a task follows the command
    from the start, so the callbacks fire as output arrives while the caller goes on."""

    def __init__(self, deliver: Callable[[], Coroutine[Any, Any, None]]) -> None:
        import asyncio

        self._task = asyncio.get_running_loop().create_task(deliver())
        _following.add(self._task)
        self._task.add_done_callback(_following.discard)

    async def wait(self) -> None:
        """Until the command ended and its output was delivered; raises what the task raised."""
        import asyncio

        await asyncio.shield(self._task)


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
