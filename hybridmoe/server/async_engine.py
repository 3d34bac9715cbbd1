"""The engine on its own thread, and asyncio streams of its outputs for the HTTP handlers.

The engine is single-threaded: only its thread touches it. Handlers send it commands (add, abort)
through a queue; it delivers each request's outputs to that request's asyncio queue. Between
steps it takes the commands, so requests join and leave the batch at every step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

import torch

from hybridmoe.engine.llm_engine import LLMEngine, RequestOutput
from hybridmoe.engine.sampler import SamplingParams

log = logging.getLogger("hybridmoe.server")


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._threads = torch.get_num_threads()  # OpenMP settings are per thread: carry them over
        self._thread = threading.Thread(target=self._loop, name="hybridmoe-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them. Leaving early (a disconnect) aborts it."""
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(("add", request_id, prompt_ids, params, (asyncio.get_running_loop(), sink)))
        finished = False
        try:
            while not finished:
                out = await sink.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    # ---- the engine thread ----
    def _loop(self) -> None:
        torch.set_num_threads(self._threads)
        while not self._stopping:
            self._take_commands(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug: fail the requests in flight, keep serving new ones
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
                if out.finished:
                    self._sinks.pop(out.request_id, None)

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            while True:
                self._run_command(cmd)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _run_command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, request_id, prompt_ids, params, sink = cmd
            self._sinks[request_id] = sink
            try:
                self.engine.add_request(prompt_ids, params, request_id)
            except Exception as e:  # ValueError: refused (a 400); anything else is a bug (a 500)
                self._deliver(request_id, e if isinstance(e, ValueError) else RuntimeError(str(e)))
                self._sinks.pop(request_id, None)
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
            self._sinks.pop(cmd[1], None)

    def _deliver(self, request_id: str, item) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        loop, q = sink
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            pass

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver(request_id, RuntimeError(f"the engine failed: {error}"))
        self._sinks.clear()
