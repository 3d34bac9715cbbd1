"""Tool calls in the format of the Hermes and Qwen chat templates: the model writes

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the server returns each block as one of OpenAI's `tool_calls`. With tool_choice "required" or a
named function the output is held to that format by a grammar (engine/grammar.py), so even a weak
model's call parses; with "auto" the model chooses, and text that is not a call stays content.
"""

from __future__ import annotations

import json
import re
import uuid

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the text outside the calls, or None if none is left; OpenAI's tool_calls). A block
    that is not JSON with a name stays in the text."""
    calls, kept, at = [], [], 0
    for m in CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(name, str):
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        )
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None), calls


class CallStream:
    """Streamed text with tool calls in it: what may be sent now as content (all but a possible
    start of a call), and each call as soon as its block closes."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.pending = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, calls = [], []
        while (start := self.pending.find(self.OPEN)) >= 0:
            content.append(self.pending[:start])
            end = self.pending.find(self.CLOSE, start)
            if end < 0:  # the call is still being written
                self.pending = self.pending[start:]
                return "".join(content), calls
            block, self.pending = (
                self.pending[start : end + len(self.CLOSE)],
                self.pending[end + len(self.CLOSE) :],
            )
            found = parse_tool_calls(block)[1]
            calls += found
            content.append("" if found else block)
        keep = next(  # the longest end of the text that could open a call
            (n for n in range(len(self.OPEN) - 1, 0, -1) if self.pending.endswith(self.OPEN[:n])),
            0,
        )
        content.append(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep :]
        return "".join(content), calls

    def flush(self) -> str:
        """What is left at the end (an unfinished call stays text)."""
        out, self.pending = self.pending, ""
        return out


def tool_grammar(tools: list[dict], name: str | None) -> str:
    """llguidance's grammar of one call to the function `name` (None: any of `tools`), its
    arguments following the function's parameter schema."""
    import llguidance

    def call(tool: dict) -> dict:
        f = tool["function"]
        return {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    schema = call(chosen[0]) if len(chosen) == 1 else {"anyOf": [call(t) for t in chosen]}
    schema["x-guidance"] = {"whitespace_flexible": False}
    lark = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema)
    return llguidance.grammar_from("lark", lark)


def template_arguments(messages: list[dict]) -> list[dict]:
    """Assistant tool_calls as chat templates read them: arguments as objects, not JSON text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            m["tool_calls"] = [_with_object_arguments(c) for c in calls]
        out.append(m)
    return out


def _with_object_arguments(call: dict) -> dict:
    f = dict(call.get("function") or {})
    if isinstance(f.get("arguments"), str):
        try:
            f["arguments"] = json.loads(f["arguments"])
        except ValueError:
            pass
    return {**call, "function": f}
