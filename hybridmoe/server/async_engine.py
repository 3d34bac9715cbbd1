"""The engine on its own thread, and asyncio streams of its outputs for the HTTP handlers.

The engine is single-threaded: only its thread drives it. Handlers send it commands (AddRequest,
Abort: server/messages.py) through a queue; it delivers each request's outputs to that request's
Sink, an asyncio queue. Between steps it takes the commands, so requests join and leave the batch
at every step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

import torch

from hybridmoe.engine.llm_engine import LLMEngine, RequestOutput
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.server.messages import Abort, AddRequest, Command, Sink, Wake

log = logging.getLogger("hybridmoe.server")


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stopping = False
        self._threads = torch.get_num_threads()  # OpenMP settings are per thread: carry them over
        self._thread = threading.Thread(target=self._loop, name="hybridmoe-engine", daemon=True)

    # ---- what the HTTP handlers may read (fixed at construction, or plain counters) ----
    @property
    def max_model_len(self) -> int:
        """Prompt and output together, in tokens."""
        return self._engine.max_model_len

    @property
    def max_tokens_default(self) -> int | None:
        """What a request without max_tokens may generate (None: the rest of the context)."""
        return self._engine.config.max_tokens_default

    @property
    def vocab_size(self) -> int:
        return self._engine.model.vocab_size

    @property
    def adapters(self) -> frozenset[str]:
        """The LoRA adapters requests may name as their `model`."""
        return self._engine.adapters

    @property
    def metrics_source(self) -> LLMEngine:
        """The engine, for GET /metrics to read its counters from the HTTP thread: plain numbers,
        read without a lock, so a scrape may see a step half-counted."""
        return self._engine

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(Wake())
        self._thread.join(timeout=10)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        adapter: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them (with LoRA adapter `adapter`). Leaving
        early (a disconnect) aborts it."""
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(AddRequest(request_id, prompt_ids, params, sink, adapter))
        finished = False
        try:
            while not finished:
                out = await sink.queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._commands.put(Abort(request_id))

    # ---- the engine thread ----
    def _loop(self) -> None:
        torch.set_num_threads(self._threads)
        while not self._stopping:
            self._take_commands(block=not self._engine.has_unfinished())
            if not self._engine.has_unfinished():
                continue
            try:
                outputs = self._engine.step()
            except Exception as e:  # a bug: fail the requests in flight, keep serving new ones
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                failed = RuntimeError(f"the engine failed on this request: {out.error}")
                self._deliver(out.request_id, out if out.error is None else failed)
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

    def _run_command(self, cmd: Command) -> None:
        match cmd:
            case AddRequest(request_id, prompt_ids, params, sink, adapter):
                self._sinks[request_id] = sink
                try:
                    self._engine.add_request(prompt_ids, params, request_id, adapter)
                except (
                    Exception
                ) as e:  # ValueError: refused (a 400); anything else is a bug (a 500)
                    self._deliver(
                        request_id, e if isinstance(e, ValueError) else RuntimeError(str(e))
                    )
                    self._sinks.pop(request_id, None)
            case Abort(request_id):
                self._engine.abort(request_id)
                self._sinks.pop(request_id, None)
            case Wake():
                pass  # it woke the loop, which now sees _stopping

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.put(item)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._engine.requests):
            self._engine.fail(request_id)
            self._deliver(request_id, RuntimeError(f"the engine failed: {error}"))
        self._sinks.clear()
