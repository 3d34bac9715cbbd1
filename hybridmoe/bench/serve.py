"""`hybridmoe bench serve`: speed of a running OpenAI-compatible server, as its clients see it.

Like KTransformers' test_speed.py: for each prompt length and each concurrency level, that many
streaming requests are sent at once and timed on arrival of every chunk. Prompts are random token
ids (exact lengths, and no two requests share a prefix, so the prefix cache does not help), and
`ignore_eos` makes every request decode exactly --max-tokens tokens.

Per request: time to first token (TTFT), prefill tok/s = prompt tokens / TTFT, decode tok/s =
(completion tokens - 1) / (last chunk - first chunk), inter-token latencies (gaps between chunks).
Aggregated per level, two ways:

- over the window (the stricter): decode tok/s = all requests' decode tokens / the span from the
  first request's first token to the last request's last token, so it includes the prefill steps of
  requests that started decoding later; prefill tok/s = all prompt tokens / the span from sending to
  the last first token.
- summed, as KTransformers' test_speed.py reports "total decode speed": the sum over the concurrent
  requests of each one's decode tok/s (and likewise prefill tok/s). Each request's speeds come from
  the phase times the server reports in `usage` when asked (`return_speed`, KTransformers'
  extension: prefill_time from being scheduled to the first token, decode_time from the first token
  to the last), else from the client's clock as above. test_speed.py divides all completion tokens
  by decode_time; the first token comes from prefill, so here it is (completion tokens - 1) /
  decode_time.
"""

from __future__ import annotations

import asyncio
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from hybridmoe.bench import prefix_scenarios
from hybridmoe.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="prefill/decode tok/s, TTFT and inter-token latency of a running server",
        description="Benchmark a running `hybridmoe serve` (or any OpenAI-compatible server that "
        "accepts token-id prompts and ignore_eos) at several prompt lengths and "
        "concurrency levels.",
    )
    p.add_argument(
        "--url",
        default="http://127.0.0.1:10002",
        help="server base URL (default http://127.0.0.1:10002)",
    )
    p.add_argument(
        "--model", default=None, help="model name to send (default: the first of /v1/models)"
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--prompt-lens", default="128,1024", help="comma-separated prompt lengths in tokens"
    )
    p.add_argument(
        "--max-tokens", type=int, default=128, help="tokens each request decodes (default 128)"
    )
    p.add_argument(
        "--concurrency", default="1,4,8", help="comma-separated numbers of simultaneous requests"
    )
    p.add_argument(
        "--vocab", type=int, default=32000, help="prompt token ids are drawn from [100, VOCAB)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds allowed for one level (default 1800)"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--scenario",
        choices=("speed", "multi-turn", "shared-prefix", "cached-prefix"),
        default="speed",
        help="speed: the prompt-length x concurrency grid (default); the others measure the "
        "prefix cache (see below)",
    )
    prefix_scenarios.add_arguments(p)
    p.set_defaults(func=run)


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


@dataclass
class RequestTiming:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival time of each chunk with new text
    server_prefill_s: float | None = (
        None  # usage.prefill_time and usage.decode_time, when the server sends them
    )
    server_decode_s: float | None = None

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def decode_s(self) -> float:
        return self.chunks[-1] - self.chunks[0]

    @property
    def decode_tps(self) -> float:
        return _rate(self.completion_tokens - 1, self.decode_s)

    @property
    def reported_prefill_tps(self) -> float:
        """Prompt tokens / prefill time, the server's time when it reports one."""
        return _rate(
            self.prompt_tokens,
            self.ttft if self.server_prefill_s is None else self.server_prefill_s,
        )

    @property
    def reported_decode_tps(self) -> float:
        """Decode tokens / decode time, the server's time when it reports one."""
        return _rate(
            self.completion_tokens - 1,
            self.decode_s if self.server_decode_s is None else self.server_decode_s,
        )

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(
            f"--{what} {text!r}: give comma-separated whole numbers, like 1,4,8"
        ) from None
    if not values or min(values) < 1:
        raise UserError(f"--{what} {text!r}: give positive whole numbers")
    return values


async def _one(client, model: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_speed": True,
    }
    t = RequestTiming(sent=time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise UserError(
                f"the server answered {r.status_code}: {(await r.aread()).decode()[:300]}"
            )
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                t.chunks.append(time.perf_counter())
            if event.get("usage"):
                u = event["usage"]
                t.prompt_tokens, t.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
                t.server_prefill_s, t.server_decode_s = u.get("prefill_time"), u.get("decode_time")
    if not t.chunks:
        raise UserError("the server streamed no text; is --max-tokens at least 1?")
    return t


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarise(prompt_len: int, concurrency: int, timings: list[RequestTiming]) -> dict:
    first = min(t.sent for t in timings)
    decode_span = max(t.chunks[-1] for t in timings) - min(t.chunks[0] for t in timings)
    prefill_span = max(t.chunks[0] for t in timings) - first
    itl = [x for t in timings for x in t.itl]
    ttft = [t.ttft for t in timings]
    return {
        "prompt_len": prompt_len,
        "concurrency": concurrency,
        "requests": len(timings),
        "prompt_tokens": sum(t.prompt_tokens for t in timings),
        "completion_tokens": sum(t.completion_tokens for t in timings),
        "prefill_tps_per_request": statistics.mean(t.prompt_tokens / t.ttft for t in timings),
        "decode_tps_per_request": statistics.mean(t.decode_tps for t in timings),
        "prefill_tps_aggregate": sum(t.prompt_tokens for t in timings) / prefill_span,
        "decode_tps_aggregate": sum(t.completion_tokens - 1 for t in timings) / decode_span
        if decode_span
        else 0.0,
        # KTransformers' "total prefill/decode speed": the sum of the requests' own speeds
        "prefill_tps_sum": sum(t.reported_prefill_tps for t in timings),
        "decode_tps_sum": sum(t.reported_decode_tps for t in timings),
        "speed_times": "server"
        if all(t.server_decode_s is not None for t in timings)
        else "client",
        "ttft_s": {
            "mean": statistics.mean(ttft),
            "p50": _pct(ttft, 50),
            "p90": _pct(ttft, 90),
            "p99": _pct(ttft, 99),
        },
        "itl_ms": {
            "mean": 1e3 * statistics.mean(itl) if itl else 0.0,
            "p50": 1e3 * _pct(itl, 50),
            "p90": 1e3 * _pct(itl, 90),
            "p99": 1e3 * _pct(itl, 99),
        },
        "wall_s": max(t.chunks[-1] for t in timings) - first,
    }


async def _level(args, model: str, prompt_len: int, concurrency: int, rng: random.Random) -> dict:
    import httpx

    prompts = [
        [rng.randrange(100, args.vocab) for _ in range(prompt_len)] for _ in range(concurrency)
    ]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout
    ) as client:
        timings = await asyncio.wait_for(
            asyncio.gather(*(_one(client, model, p, args.max_tokens) for p in prompts)),
            timeout=args.timeout,
        )
    return summarise(prompt_len, concurrency, list(timings))


def _model_name(args) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise UserError(
            f"cannot reach {args.url} ({e}); start `hybridmoe serve` or pass --url"
        ) from None
    if r.status_code != 200:
        raise UserError(f"{args.url}/v1/models answered {r.status_code}; check --api-key")
    return args.model or r.json()["data"][0]["id"]


def _print_table(results: list[dict]) -> None:
    print(
        f"{'prompt':>6} {'conc':>4} | {'prefill tok/s':>13} {'(window)':>8} {'(sum)':>8} | "
        f"{'decode tok/s':>12} {'(window)':>8} {'(sum)':>8} | {'TTFT p50 s':>10} {'p90':>7} | "
        f"{'ITL p50 ms':>10} {'p90':>7} {'p99':>7}"
    )
    for r in results:
        print(
            f"{r['prompt_len']:>6} {r['concurrency']:>4} | {r['prefill_tps_per_request']:>13.1f} "
            f"{r['prefill_tps_aggregate']:>8.1f} {r['prefill_tps_sum']:>8.1f} | "
            f"{r['decode_tps_per_request']:>12.2f} {r['decode_tps_aggregate']:>8.2f} "
            f"{r['decode_tps_sum']:>8.2f} | {r['ttft_s']['p50']:>10.3f} {r['ttft_s']['p90']:>7.3f} "
            f"| {r['itl_ms']['p50']:>10.1f} {r['itl_ms']['p90']:>7.1f} {r['itl_ms']['p99']:>7.1f}"
        )
    times = {r["speed_times"] for r in results}
    print(
        "window: all tokens / the span they took (the first token to the last, across requests); "
        "sum: each request's own tok/s added up, as KTransformers' test_speed.py (times from the "
        f"{'/'.join(times)})"
    )


def run(args) -> int:
    if args.scenario != "speed":
        return prefix_scenarios.run_scenario(args, _model_name(args))
    prompt_lens, levels = (
        _ints(args.prompt_lens, "prompt-lens"),
        _ints(args.concurrency, "concurrency"),
    )
    if args.max_tokens < 2:
        raise UserError(
            f"--max-tokens {args.max_tokens}: give at least 2 (decode speed needs two tokens)"
        )
    model = _model_name(args)
    rng = random.Random(args.seed)
    asyncio.run(
        _level(args, model, 8, 1, rng)
    )  # warm-up: first-touch allocations, kernel selection
    results = []
    for prompt_len in prompt_lens:
        for concurrency in levels:
            results.append(asyncio.run(_level(args, model, prompt_len, concurrency, rng)))
            if not args.json:
                print(f"done: prompt {prompt_len}, concurrency {concurrency}", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {
                    "url": args.url,
                    "model": model,
                    "max_tokens": args.max_tokens,
                    "client": platform.node(),
                    "results": results,
                },
                indent=2,
            )
        )
    else:
        _print_table(results)
    return 0
