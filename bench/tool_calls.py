"""Tool calls under tool_choice "auto" on the default model: 50 requests that each ask for one of three tools,
rendered and parsed exactly as bmc-serve renders and parses them (bmc/tools.py), greedy. Reports the share that
came back as a call to the right tool whose arguments validate against its schema, the share with any call, and
the share with "required" (the call forced by the grammar) for comparison.

    python bench/tool_calls.py --out bench/results/cpu/tool_calls
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": {"type": "object", "required": ["city"], "properties": {
                                          "city": {"type": "string", "description": "the city name"}}}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount of money",
                                      "parameters": {"type": "object", "required": ["amount", "from", "to"],
                                                     "properties": {"amount": {"type": "number"},
                                                                    "from": {"type": "string"},
                                                                    "to": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web for a query",
                                      "parameters": {"type": "object", "required": ["query"], "properties": {
                                          "query": {"type": "string"}}}}},
]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Madrid", "Nairobi", "Seoul",
          "Berlin", "Mumbai", "Quito", "Dublin", "Hanoi", "Rome", "Denver"]
CURRENCIES = [(100, "USD", "EUR"), (50, "GBP", "JPY"), (20, "EUR", "CHF"), (75, "CAD", "USD"), (10, "AUD", "NZD"),
              (300, "JPY", "USD"), (42, "USD", "MXN"), (15, "SEK", "NOK"), (60, "INR", "USD"), (5, "EUR", "GBP"),
              (1000, "KRW", "USD"), (250, "USD", "BRL"), (80, "CHF", "EUR"), (33, "NZD", "AUD"), (12, "USD", "CAD"),
              (90, "EUR", "USD")]
QUERIES = ["latest Python release", "tallest mountain in Africa", "who won the 2022 World Cup", "recipe for pancakes",
           "population of Canada", "how do bees make honey", "distance from Earth to Mars", "best hiking trails in Peru",
           "history of the printing press", "how to learn the piano", "what is a KV cache", "origin of chess",
           "symptoms of the flu", "fastest land animal", "how solar panels work", "meaning of the word serendipity",
           "largest ocean"]


def requests() -> list[tuple[str, str]]:
    out = [(f"What's the weather like in {c} right now?", "get_weather") for c in CITIES]
    out += [(f"Convert {a} {f} to {t}.", "convert_currency") for a, f, t in CURRENCIES]
    out += [(f"Search the web: {q}", "search_web") for q in QUERIES]
    return out[:50]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default="bench/out/tool_calls")
    args = ap.parse_args()
    import jsonschema

    import bmc
    from bmc.tools import forced_call_grammar, parse_tool_calls, render_messages, template_reads_tools

    model = bmc.load()
    tok = model.tokenizer
    names = {t["function"]["name"] for t in TOOLS}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    asks = requests()
    prompts = []
    for text, _ in asks:
        rendered, variables = render_messages([{"role": "user", "content": text}], TOOLS,
                                              template_reads_tools(tok.chat_template))
        prompts.append(tok.encode(tok.apply_chat_template(rendered, add_generation_prompt=True, **variables)))
    report: dict = {"host": platform.node(), "cores": os.cpu_count(), "model": str(model.path), "requests": len(asks)}
    for mode in ("auto", "required"):
        kw = {"grammar": forced_call_grammar(TOOLS, None).source} if mode == "required" else {}
        out = bmc.generate(model, prompts, max_new_tokens=args.max_new_tokens, **kw)
        right = any_call = 0
        samples = []
        for (text, want), c in zip(asks, out):
            _, calls = parse_tool_calls(c.text, names)
            ok = False
            if calls:
                any_call += 1
                call = calls[0]
                try:
                    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
                    ok = call.name == want
                except jsonschema.ValidationError:
                    ok = False
            right += ok
            samples.append({"ask": text, "want": want, "reply": c.text, "valid_right_call": ok})
        report[mode] = {"valid_right_call_share": right / len(asks), "any_call_share": any_call / len(asks),
                        "samples": samples[:10]}
        print(f"{mode:8s}: valid call to the right tool {right}/{len(asks)}, any parsed call {any_call}/{len(asks)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tool_calls.json").write_text(json.dumps(report, indent=1))
    plot(report, out_dir / "tool_calls.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["auto", "required"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    w = 0.38
    ax.bar([i - w / 2 for i in range(2)], [report[m]["any_call_share"] for m in modes], w, label="a call parsed")
    ax.bar([i + w / 2 for i in range(2)], [report[m]["valid_right_call_share"] for m in modes], w,
           label="right tool, valid arguments")
    ax.set_xticks(range(2), [f'tool_choice="{m}"' for m in modes])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(f"share of {report['requests']} requests")
    ax.set_title("tool calls, default model, greedy", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
