"""`AsyncProxy`: the asyncio face of a synchronous object, used by the async SDK and the async HTTP client."""

from __future__ import annotations

import asyncio
import functools


class AsyncProxy:
    """Every callable attribute of `sync` becomes a coroutine run in a worker thread; other attributes pass through."""

    def __init__(self, target: object):
        self.sync = target

    def __getattr__(self, name: str):
        attr = getattr(self.sync, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        async def call(*args, **kwargs):
            return await asyncio.to_thread(attr, *args, **kwargs)

        return call
