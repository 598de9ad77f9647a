"""Tool calls parsed back from model text.

Accepted forms (whitespace and one ```json fence around them are ignored):

* ``{"name": "get_weather", "arguments": {"city": "Paris"}}`` (``parameters`` also accepted);
* a JSON list of such objects, or ``{"tool_calls": [...]}``;
* Cohere's action block ``<|START_ACTION|>[{"tool_name": ..., "parameters": {...}}]<|END_ACTION|>``.

A call counts only when it names one of the request's tools; otherwise the text stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_ACTION = re.compile(r"<\|START_ACTION\|>(.*?)<\|END_ACTION\|>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str  # "call_<hex>"
    name: str  # function name
    arguments: str  # JSON object text

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _calls_from(obj: Any) -> list[dict[str, Any]] | None:
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        obj = obj["tool_calls"]
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for it in items:
        if not isinstance(it, dict):
            return None
        if isinstance(it.get("function"), dict):
            it = it["function"]
        name = it.get("name", it.get("tool_name"))
        args = it.get("arguments", it.get("parameters", {}))
        if not isinstance(name, str):
            return None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        out.append({"name": name, "arguments": args})
    return out or None


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[list[ToolCall], str | None]:
    """(calls, remaining content); ([], text) when the text is not a call of a known tool."""
    body = text.strip()
    m = _ACTION.search(body)
    prefix = None
    if m:
        prefix = body[:m.start()].strip() or None
        body = m.group(1).strip()
    else:
        f = _FENCE.match(body)
        if f:
            body = f.group(1)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return [], text
    calls = _calls_from(obj)
    if not calls or any(c["name"] not in tool_names for c in calls):
        return [], text
    return [ToolCall(f"call_{uuid.uuid4().hex[:24]}", c["name"], json.dumps(c["arguments"]))
            for c in calls], prefix


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    names = set()
    for t in tools or []:
        f = t.get("function") if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            names.add(f["name"])
    return names
