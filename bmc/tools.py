"""Tool calls for /v1/chat/completions: the tools rendered into the prompt, the model's output parsed back into
OpenAI `tool_calls`, and the grammar that forces a call (tool_choice "required" or a named function).

Rendering: a chat template that reads `tools` (Qwen2.5's, Llama 3.1's, ...) gets them and the messages as they
are; one that does not (SmolLM2's ChatML) gets the Hermes convention Qwen2.5's template writes: the tools as JSON
in a system message, an assistant's calls as `<tool_call>{...}</tool_call>`, a tool's result as a user turn in
`<tool_response>` tags.

Parsing, in order: Hermes `<tool_call>{"name", "arguments"}</tool_call>` (Qwen2.5/3, SmolLM2, Hermes), Mistral
`[TOOL_CALLS][{...}]`, Llama 3.1/3.2 JSON `{"name", "parameters"}` (after an optional `<|python_tag|>`), and a
plain-JSON fallback (the whole reply one object with `name` and `arguments`). A call names one of the request's
tools; anything else stays text."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .grammar import JSON_STYLE, GrammarSpec

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def template_reads_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_has_tools: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages (and extra template variables) for a chat template. `messages` are OpenAI's: an assistant's
    `tool_calls` (arguments as JSON text) and `tool` messages with `tool_call_id`."""
    if template_has_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):  # HF templates read the arguments as a mapping
                m["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]
                m.setdefault("content", "")
                if m["content"] is None:
                    m["content"] = ""
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    if tools:
        text = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            text = messages[0]["content"] + "\n\n" + text
            messages = messages[1:]
        out.append({"role": "system", "content": text})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _loads(
                c["function"]["arguments"])}, ensure_ascii=False) + "\n</tool_call>" for c in m["tool_calls"])
            content = ((m.get("content") or "") + "\n" + calls).strip("\n")
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out, {}


def _loads(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text left, the calls) of a reply; calls only to tools the request named, with object arguments."""
    calls: list[ToolCall] = []
    if "<tool_call>" in text:
        for body in _HERMES.findall(text):
            call = _call(_json(body), tool_names)
            if call is not None:
                calls.append(call)
        if calls:
            rest = _HERMES.sub("", text).strip()
            return rest or None, calls
    stripped = text.strip()
    if stripped.startswith("[TOOL_CALLS]"):
        items = _json(stripped[len("[TOOL_CALLS]"):])
        if isinstance(items, list):
            calls = [c for c in (_call(i, tool_names) for i in items) if c is not None]
            if calls and len(calls) == len(items):
                return None, calls
    body = stripped.removeprefix("<|python_tag|>")
    if body.startswith("{"):
        call = _call(_json(body), tool_names)
        if call is not None:
            return None, [call]
    return text, []


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(obj: Any, tool_names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _json(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def forced_call_grammar(tools: list[dict[str, Any]], name: str | None) -> GrammarSpec:
    """A Hermes-style call to one of `tools` (or to `name`), its arguments under the function's JSON schema: what
    tool_choice "required" or a named function constrains the reply to (one call)."""
    options = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        options.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"const": f["name"]},
                                       "arguments": f.get("parameters") or {"type": "object"}}})
    schema = dict(options[0] if len(options) == 1 else {"anyOf": options}, **{"x-guidance": JSON_STYLE})
    return GrammarSpec("lark", 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema))
