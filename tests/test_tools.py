"""bmc/tools.py: the formats a reply's tool calls come in, the Hermes rendering for templates without tools, and
the grammar that forces a call (its output always parses into a call whose arguments validate)."""
from __future__ import annotations

import json

import pytest

import bmc
from bmc.tools import forced_call_grammar, parse_tool_calls, render_messages, template_reads_tools

jsonschema = pytest.importorskip("jsonschema", reason="the tool tests validate arguments with jsonschema")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"], "properties": {
                                                               "city": {"type": "string", "maxLength": 12},
                                                               "unit": {"type": "string", "enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize("text, rest, calls", [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}', None, [("get_weather", {"city": "Lima"})]),
    ('{"name": "delete_everything", "arguments": {}}', '{"name": "delete_everything", "arguments": {}}', []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', []),
    ("The weather is fine.", "The weather is fine.", [])])
def test_each_format_parses_and_anything_else_stays_text(text, rest, calls):
    got_rest, got = parse_tool_calls(text, NAMES)
    assert got_rest == rest
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_a_template_without_tools_gets_the_hermes_convention():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    out, variables = render_messages(messages, [WEATHER], template_has_tools=False)
    assert variables == {} and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>"
    same, variables = render_messages(messages, [WEATHER], template_has_tools=True)
    assert variables == {"tools": [WEATHER]} and same[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert template_reads_tools("{% if tools %}...{% endif %}") and not template_reads_tools("{{ messages }}")


@pytest.mark.parametrize("name", [None, "get_weather"])
def test_a_forced_call_always_parses_and_its_arguments_validate(tiny_dirs, name):
    model = bmc.load(str(tiny_dirs["llama-gqa"]))
    spec = forced_call_grammar([WEATHER, TIME], name)
    out = bmc.generate(model, ["hello", "what is the weather"], max_new_tokens=112, grammar=spec.source,
                       temperature=1.0, seed=5, num_samples=2)
    for c in out:
        assert c.finish_reason == "stop", c.text
        rest, calls = parse_tool_calls(c.text, NAMES)
        assert rest is None and len(calls) == 1 and (name is None or calls[0].name == name)
        schema = WEATHER if calls[0].name == "get_weather" else TIME
        jsonschema.validate(json.loads(calls[0].arguments), schema["function"]["parameters"])
