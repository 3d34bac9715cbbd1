"""Training data: JSONL lines of chats (`{"messages": [{"role", "content"}, ...]}`, learning the
assistant's turns only, rendered by the model's chat template) or plain text (`{"text": ...}`,
learning every token), tokenised into (token ids, learn mask) examples.

The assistant's tokens are found by rendering the conversation up to each assistant turn (with the
generation prompt) and through it: the characters between the two renderings are the turn's content
and its end-of-turn marker, and the tokens that start there are learned. This needs a template that
renders earlier turns the same whatever follows them, which is checked.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.errors import UserError


@dataclass
class Example:
    tokens: list[int]
    learn: list[bool]  # learn[j]: token j is a target (predicted from the tokens before it)

    @property
    def num_targets(self) -> int:
        return sum(self.learn[1:])


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, record) for each non-blank line, each checked; the first bad line is an error
    naming its number and the problem."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot be read as UTF-8 text ({e}); give a JSONL file") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})"
            ) from None
        problem = _problem(record)
        if problem:
            raise UserError(f"{path}:{number}: {problem}")
        records.append((number, record))
    if not records:
        raise UserError(
            f"{path}: no examples (the file is empty); give one JSON object per line, "
            '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": '
            '...}]} or {"text": ...}'
        )
    return records


def _problem(record) -> str | None:
    """What is wrong with one record, or None."""
    if not isinstance(record, dict) or not ({"messages", "text"} & set(record)):
        return 'a line must be a JSON object with "messages" (a chat) or "text"'
    if "text" in record:
        ok = isinstance(record["text"], str) and record["text"].strip()
        return None if ok else '"text" must be a non-empty string'
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a non-empty list of {"role", "content"} objects'
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            return f'messages[{i}] needs a string "role"'
        if not isinstance(m.get("content"), str):
            return f'messages[{i}] needs a string "content"'
    if not any(m["role"] == "assistant" for m in messages):
        return 'the conversation has no "assistant" message to learn from'
    return None


def tokenize(records: list[tuple[int, dict]], tokenizer, path: str | Path) -> list[Example]:
    """Examples from read_jsonl's records."""
    out = []
    for number, record in records:
        if "text" in record:
            ids = tokenizer.encode(record["text"]) + sorted(tokenizer.eos_ids)[:1]
            out.append(Example(ids, [True] * len(ids)))
        else:
            out.append(_chat(record["messages"], tokenizer, f"{path}:{number}"))
    return out


def _chat(messages: list[dict], tokenizer, where: str) -> Example:
    """A conversation through the chat template, learning the assistant's turns."""
    if not tokenizer.has_chat_template:
        raise UserError(
            f"{where}: this model's tokenizer has no chat template; give plain "
            '{"text": ...} lines or --tokenizer DIR with a template'
        )
    render = tokenizer.chat_prompt
    try:
        full = render(messages, add_generation_prompt=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                before = render(messages[:i], add_generation_prompt=True) if i else ""
                upto = render(messages[: i + 1], add_generation_prompt=False)
                if not (full.startswith(upto) and upto.startswith(before)):
                    raise UserError(
                        f"{where}: the chat template renders turn {i} differently once later "
                        "turns follow, so its tokens cannot be found; split the conversation "
                        "into one example per assistant turn"
                    )
                spans.append((len(before), len(upto)))
    except UserError:
        raise
    except Exception as e:  # the template's own checks (role order, ...) raise from jinja
        raise UserError(f"{where}: the chat template rejected the messages ({e})") from None
    enc = tokenizer.hf(full, add_special_tokens=False, return_offsets_mapping=True)
    learn = [any(s <= start < e for s, e in spans) for start, _ in enc["offset_mapping"]]
    return Example(list(enc["input_ids"]), learn)


@dataclass
class Prepared:
    train: list[Example]
    held_out: list[Example]
    long: int  # examples longer than the limit (truncated or skipped)
    dropped: int  # examples left with no target after truncation, left out


def prepare(path, tokenizer, max_len: int, long: str, eval_fraction: float, seed: int) -> Prepared:
    """The examples of a JSONL file, fitted to `max_len` and split into training and held out."""
    examples = tokenize(read_jsonl(path), tokenizer, path)
    fitted, n_long, dropped = fit_length(examples, max_len, long)
    if not fitted:
        raise UserError(
            f"{path}: no example is left to train on ({n_long} longer than --max-seq-len "
            f"{max_len} were {'skipped' if long == 'skip' else 'cut'}, {dropped} kept no target); "
            "raise --max-seq-len"
        )
    train, held_out = split(fitted, eval_fraction, seed)
    return Prepared(train, held_out, n_long, dropped)


def fit_length(examples: list[Example], max_len: int, long: str) -> tuple[list[Example], int, int]:
    """Examples cut to `max_len` tokens ("truncate") or left out ("skip") when longer; those left
    with nothing to learn are dropped. -> (examples, how many were long, how many dropped)."""
    out, n_long, dropped = [], 0, 0
    for ex in examples:
        if len(ex.tokens) > max_len:
            n_long += 1
            if long == "skip":
                continue
            ex = Example(ex.tokens[:max_len], ex.learn[:max_len])
        if ex.num_targets == 0:
            dropped += 1
            continue
        out.append(ex)
    return out, n_long, dropped


def split(examples: list[Example], fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded random `fraction` held out, at least one example when there are
    two or more and fraction > 0."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n = round(len(examples) * fraction)
    if fraction > 0 and len(examples) >= 2:
        n = min(max(n, 1), len(examples) - 1)
    else:
        n = 0
    held = sorted(order[:n])
    kept = sorted(order[n:])
    return [examples[i] for i in kept], [examples[i] for i in held]


def batches(examples: list[Example], size: int, seed: int, epoch: int) -> list[list[Example]]:
    """The epoch's micro-batches: a seeded shuffle (the same for the same seed and epoch, so that a
    resumed run sees the order the killed one would have), cut into groups of `size`."""
    order = list(range(len(examples)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return [[examples[i] for i in order[k : k + size]] for k in range(0, len(order), size)]
