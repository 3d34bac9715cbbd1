"""`hybridmoe bench serve --scenario ...`: what the prefix cache and its tiers buy the clients.

- multi-turn: C conversations of T turns through the chat API, one request at a time, each turn
  resending the whole conversation (its replies included); time to first token per turn, and the
  prompt tokens the server took from its prefix cache.
- shared-prefix: N completions sharing a P-token system prompt, each with its own S-token tail, K at
  a time; time to first token and wall time.
- cached-prefix: time to first token of a P-token prompt the server has seen (sent to --warm-url
  first: the other replica; or before a restart, with --warm-only) against a P-token prompt it has
  not (computed), alternating, R times; medians and their ratio.

Run each against a server with the tiers on and one with them off (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

from hybridmoe.errors import UserError


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def _stream(client, path: str, body: dict) -> dict:
    """One streaming request: its TTFT, wall time, text and usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    sent, first, text, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise UserError(f"the server answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text.append(piece)
            usage = event.get("usage") or usage
    end = time.perf_counter()
    first = end if first is None else first  # every token decoded to no text (a random model)
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": first - sent,
        "wall": end - sent,
        "text": "".join(text),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": details.get("cached_tokens", 0),
    }


def _words(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of made-up words (two or three tokens a word in a BPE vocabulary)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join(
        "".join(rng.choice(letters) for _ in range(rng.randrange(3, 8))) for _ in range(tokens // 2)
    )


def _client(url: str, api_key: str | None, timeout: float):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout)


async def multi_turn(args, model: str) -> dict:
    rng = random.Random(args.seed)
    system = {"role": "system", "content": _words(rng, args.prefix_len)}
    chats = [[system] for _ in range(args.conversations)]
    turns = []
    async with _client(args.url, args.api_key, args.timeout) as client:
        for turn in range(args.turns):
            for chat in chats:
                chat.append({"role": "user", "content": _words(rng, args.turn_len)})
                body = {"model": model, "messages": chat, "max_tokens": args.max_tokens}
                body["ignore_eos"] = True  # replies of one length, whatever the model says
                r = await _stream(client, "/v1/chat/completions", body)
                chat.append({"role": "assistant", "content": r["text"]})
                turns.append({**r, "turn": turn})
    later = [t for t in turns if t["turn"] > 0]
    return {
        "scenario": "multi-turn",
        "conversations": args.conversations,
        "turns": args.turns,
        "ttft_mean_s": statistics.mean(t["ttft"] for t in turns),
        "ttft_later_turns_p50_s": _pct([t["ttft"] for t in later], 50) if later else 0.0,
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "cached_tokens": sum(t["cached_tokens"] for t in turns),
        "last_prompt_tokens": turns[-1]["prompt_tokens"],
        "wall_s": sum(t["wall"] for t in turns),
    }


async def shared_prefix(args, model: str) -> dict:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(100, args.vocab) for _ in range(args.prefix_len)]
    prompts = [
        prefix + [rng.randrange(100, args.vocab) for _ in range(args.tail_len)]
        for _ in range(args.requests)
    ]
    gate = asyncio.Semaphore(args.at_once)

    async def one(client, prompt):
        async with gate:
            body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens}
            return await _stream(client, "/v1/completions", {**body, "ignore_eos": True})

    t0 = time.perf_counter()
    async with _client(args.url, args.api_key, args.timeout) as client:
        results = await asyncio.gather(*(one(client, p) for p in prompts))
    ttft = [r["ttft"] for r in results]
    return {
        "scenario": "shared-prefix",
        "requests": args.requests,
        "at_once": args.at_once,
        "prefix_len": args.prefix_len,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "wall_s": time.perf_counter() - t0,
    }


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(length)]


async def _drained(client, seconds: float = 600) -> None:
    """Until the server has written every block it queued for its tiers (its /metrics)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        queued = [ln for ln in text.splitlines() if ln.startswith("hybridmoe_prefix_cache_write_q")]
        if not queued or float(queued[0].rsplit(" ", 1)[1]) == 0:
            return
        await asyncio.sleep(0.1)
    raise UserError("the warm server's prefix-cache write queue did not drain")


async def cached_prefix(args, model: str) -> dict:
    seeds = [args.seed * 1000 + r for r in range(args.repeats)]
    body = {"model": model, "max_tokens": 2, "ignore_eos": True}
    if args.warm_url:
        async with _client(args.warm_url, args.api_key, args.timeout) as warm:
            for s in seeds:
                await _stream(
                    warm,
                    "/v1/completions",
                    {**body, "prompt": _prompt(s, args.prefix_len, args.vocab)},
                )
            await _drained(warm)
    if args.warm_only:
        return {"scenario": "cached-prefix", "warmed": len(seeds), "prefix_len": args.prefix_len}
    cached, computed, hits = [], [], []
    async with _client(args.url, args.api_key, args.timeout) as client:
        for r, s in enumerate(seeds):
            fresh = {**body, "prompt": _prompt(s + 500_000, args.prefix_len, args.vocab)}
            seen = {**body, "prompt": _prompt(s, args.prefix_len, args.vocab)}
            order = [(seen, cached), (fresh, computed)]
            for req, into in order if r % 2 == 0 else order[::-1]:  # alternate A/B
                out = await _stream(client, "/v1/completions", req)
                into.append(out["ttft"])
                if into is cached:
                    hits.append(out["cached_tokens"])
    return {
        "scenario": "cached-prefix",
        "prefix_len": args.prefix_len,
        "repeats": args.repeats,
        "ttft_cached_p50_s": statistics.median(cached),
        "ttft_computed_p50_s": statistics.median(computed),
        "speedup": statistics.median(computed) / statistics.median(cached),
        "cached_tokens_min": min(hits),
        "ttft_cached_s": cached,
        "ttft_computed_s": computed,
    }


SCENARIOS = {
    "multi-turn": multi_turn,
    "shared-prefix": shared_prefix,
    "cached-prefix": cached_prefix,
}


def add_arguments(p) -> None:
    g = p.add_argument_group(
        "prefix-cache scenarios (--scenario multi-turn|shared-prefix|cached-prefix)"
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=2000,
        help="system prompt / cached prefix tokens (default 2000)",
    )
    g.add_argument(
        "--conversations", type=int, default=4, help="multi-turn: conversations (default 4)"
    )
    g.add_argument("--turns", type=int, default=6, help="multi-turn: turns each (default 6)")
    g.add_argument(
        "--turn-len", type=int, default=200, help="multi-turn: tokens of a user turn (default 200)"
    )
    g.add_argument("--requests", type=int, default=32, help="shared-prefix: requests (default 32)")
    g.add_argument(
        "--tail-len",
        type=int,
        default=32,
        help="shared-prefix: tokens after the shared prefix (default 32)",
    )
    g.add_argument(
        "--at-once", type=int, default=4, help="shared-prefix: requests in flight (default 4)"
    )
    g.add_argument(
        "--repeats", type=int, default=5, help="cached-prefix: prompts of each kind (default 5)"
    )
    g.add_argument(
        "--warm-url",
        default=None,
        help="cached-prefix: send the cached prompts here first (the other replica, or the server "
        "before its restart)",
    )
    g.add_argument(
        "--warm-only",
        action="store_true",
        help="cached-prefix: only send them to --warm-url (then restart the server and measure)",
    )


def run_scenario(args, model: str) -> int:
    for name in (
        "prefix_len",
        "conversations",
        "turns",
        "turn_len",
        "requests",
        "tail_len",
        "at_once",
        "repeats",
    ):
        if getattr(args, name) < 1:
            raise UserError(
                f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number"
            )
    if args.warm_only and not args.warm_url:
        raise UserError("--warm-only needs --warm-url: the server to send the prompts to")
    result = asyncio.run(SCENARIOS[args.scenario](args, model))
    result |= {"url": args.url, "model": model}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v:.3f}" if isinstance(v, float) else f"{k:>24}: {v}")
    return 0
