"""Output parsers: ``<think>`` reasoning and tool calls (Hermes JSON, Kimi-K2 section tokens),
each usable on a whole text or incrementally on streamed deltas."""

from __future__ import annotations

import json
import re
import uuid


class ReasoningParser:
    """Splits ``<think>...</think>`` into reasoning and content. ``starts_in_reasoning`` for
    models whose template opens the think block itself."""

    START, END = "<think>", "</think>"

    def __init__(self, starts_in_reasoning: bool = False):
        self.in_reasoning = starts_in_reasoning
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        while self.buf:
            tag = self.END if self.in_reasoning else self.START
            i = self.buf.find(tag)
            if i >= 0:
                if self.in_reasoning:
                    reasoning += self.buf[:i]
                else:
                    content += self.buf[:i]
                self.buf = self.buf[i + len(tag) :]
                self.in_reasoning = not self.in_reasoning
                continue
            keep = _partial_suffix(self.buf, tag)  # hold back what may be the start of a tag
            out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            if self.in_reasoning:
                reasoning += out
            else:
                content += out
            break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        out, self.buf = self.buf, ""
        return (out, "") if self.in_reasoning else ("", out)

    @classmethod
    def split(cls, text: str) -> tuple[str | None, str]:
        p = cls()
        r, c = p.feed(text)
        r2, c2 = p.flush()
        reasoning = r + r2
        return (reasoning or None), (c + c2).strip() if reasoning else c + c2


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


_NAME = re.compile(r"[\w\-\.]+")  # fullmatch on a name: linear


class ToolCallParser:
    """Incremental: ``feed`` returns (content delta, completed tool calls)."""

    def __init__(self, kind: str):
        if kind not in ("hermes", "kimi_k2"):
            raise ValueError(f"--tool-call-parser must be hermes or kimi_k2, got {kind!r}")
        self.kind = kind
        self.start = "<tool_call>" if kind == "hermes" else "<|tool_calls_section_begin|>"
        self.buf = ""
        self.in_calls = False

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buf += delta
        content, calls = "", list[dict]()
        if not self.in_calls:
            i = self.buf.find(self.start)
            if i < 0:
                keep = _partial_suffix(self.buf, self.start)
                content, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return content, calls
            content, self.buf, self.in_calls = self.buf[:i], self.buf[i:], True
        calls = self._take_complete()
        return content, calls

    def _take_complete(self) -> list[dict]:
        """Complete calls off the front of the buffer. Plain ``find`` scans, no backtracking regex:
        linear in the buffer (a run of whitespace after an opening tag made the old regex cubic)."""
        calls = []
        if self.kind == "hermes":
            while True:
                i = self.buf.find("<tool_call>")
                j = self.buf.find("</tool_call>", i + 11) if i >= 0 else -1
                if j < 0:
                    break
                body, self.buf = self.buf[i + 11 : j].strip(), self.buf[j + 12 :]
                try:
                    obj = json.loads(body)
                    calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                    continue
        else:
            begin, arg, end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
            while True:
                i = self.buf.find(begin)
                j = self.buf.find(arg, i) if i >= 0 else -1
                k = self.buf.find(end, j) if j >= 0 else -1
                if k < 0:
                    break
                name, args = self.buf[i + len(begin) : j].strip(), self.buf[j + len(arg) : k].strip()
                self.buf = self.buf[k + len(end) :]
                name = name.removeprefix("functions.")
                head, _, index = name.rpartition(":")
                if head and index.isdigit():
                    name = head
                if _NAME.fullmatch(name):
                    calls.append(_call(name, args))
            self.buf = self.buf.replace("<|tool_calls_section_begin|>", "").replace("<|tool_calls_section_end|>", "")
        return calls

    def flush(self) -> tuple[str, list[dict]]:
        calls = self._take_complete() if self.in_calls else []
        rest, self.buf = ("" if self.in_calls else self.buf), ""
        return rest, calls

    @classmethod
    def parse(cls, kind: str, text: str) -> tuple[str, list[dict]]:
        p = cls(kind)
        c, calls = p.feed(text)
        c2, calls2 = p.flush()
        return c + c2, calls + calls2
