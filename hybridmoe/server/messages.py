"""What the HTTP handlers send the engine's thread (AsyncEngine's command queue), and where the
engine's thread sends a request's outputs back (its Sink)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from hybridmoe.engine.llm_engine import RequestOutput
from hybridmoe.engine.sampler import SamplingParams


@dataclass(frozen=True)
class Sink:
    """A request's asyncio queue and the event loop of the handler that reads it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        """From the engine's thread: hand `item` to the handler's loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            pass


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    adapter: str | None = None  # the LoRA adapter it asked for by its `model`


@dataclass(frozen=True)
class Abort:
    """The client went away: cancel the request and free its blocks."""

    request_id: str


@dataclass(frozen=True)
class Wake:
    """No work: wakes the engine's thread from waiting for a command, to see that it should stop."""


Command = AddRequest | Abort | Wake
