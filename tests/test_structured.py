"""Constrained decoding (llguidance): generate() with a JSON schema, a regex or a Lark grammar gives output that
matches it, the same tokens batched as alone, no speculation for constrained rows, and an uncompilable schema is
refused with the library's reason. The real-model tests (slow) use the OpenAI client against bmc-serve: a pydantic
model through `beta.chat.completions.parse`, and 20 random schemas sent at once."""
from __future__ import annotations

import concurrent.futures
import json
import random
import re

import pytest

import bmc
from bmc.errors import InvalidRequestError

jsonschema = pytest.importorskip("jsonschema", reason="the structured-output tests validate with jsonschema")

PROMPTS = ["hello world", "the answer is"]
BOUNDED = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": -5, "maximum": 99},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "enum": ["a", "bc", "def"]}}}}


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return bmc.load(str(tiny_dirs["llama-gqa"]))


def test_json_schema_output_validates_and_batching_does_not_change_it(model):
    out = bmc.generate(model, PROMPTS, max_new_tokens=100, json_schema=BOUNDED)
    for c in out:
        assert c.finish_reason == "stop", c.text  # the grammar completed (bounded: it always does)
        jsonschema.validate(json.loads(c.text), BOUNDED)
    alone = [bmc.generate(model, [p], max_new_tokens=100, json_schema=BOUNDED)[0].token_ids for p in PROMPTS]
    assert [c.token_ids for c in out] == alone
    plain = bmc.generate(model, PROMPTS, max_new_tokens=20)
    assert [c.text for c in plain] != [c.text for c in out]  # the tiny model's own text is not this JSON


def test_sampled_rows_each_follow_the_schema(model):
    out = bmc.generate(model, PROMPTS, max_new_tokens=100, json_schema=BOUNDED, temperature=1.0, seed=3,
                       num_samples=3)
    assert len({c.text for c in out}) > 1
    for c in out:
        jsonschema.validate(json.loads(c.text), BOUNDED)


def test_regex_and_lark_grammar(model):
    out = bmc.generate(model, PROMPTS, max_new_tokens=30, regex=r"[0-9]{3}-[a-z]{2,4}")
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text) and c.finish_reason == "stop" for c in out)
    lark = 'start: "yes" | "no" | "maybe"'
    out = bmc.generate(model, PROMPTS, max_new_tokens=10, grammar=lark)
    assert all(c.text in ("yes", "no", "maybe") for c in out)


def test_any_json_object_and_max_tokens_cut(model):
    out = bmc.generate(model, PROMPTS, max_new_tokens=5, json_schema=True)
    assert all(c.text.startswith("{") and c.finish_reason == "length" for c in out)  # cut, as OpenAI's length


def test_constrained_rows_do_not_speculate(model):
    kw = dict(max_new_tokens=60, json_schema=BOUNDED)
    plain = bmc.generate(model, PROMPTS, **kw)
    spec = bmc.generate(model, PROMPTS, speculative="ngram", tree="chain:3", **kw)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]


@pytest.mark.parametrize("kw, reason", [
    (dict(json_schema={"type": "nonsense"}), "json_schema cannot be compiled"),
    (dict(json_schema="{not json"), "not valid JSON"), (dict(json_schema=7), "json_schema must be"),
    (dict(regex="(unclosed"), "regex cannot be compiled"), (dict(grammar="start: ???"), "lark cannot be compiled"),
    (dict(json_schema=True, regex="a"), "give one of"),
    (dict(json_schema="[" * 10000 + "]" * 10000), "nested too deeply"), (dict(regex="(" * 500), "regex cannot be")])
def test_uncompilable_constraints_are_refused_with_the_reason(model, kw, reason):
    with pytest.raises(InvalidRequestError, match=reason):
        bmc.generate(model, PROMPTS, max_new_tokens=4, **kw)


# ---- the default model through bmc-serve and the OpenAI client -----------------------------------------------------
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema of OpenAI's strict kind (every property required, no others), with bounded strings, numbers and
    arrays so that a completion always fits its max_tokens."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 16)}
    if kind == "integer":
        lo = rng.randint(-100, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "north", "south", "yes", "no"], 3)}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1, "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "city", "score", "tags", "color", "count", "ok", "kind"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": names, "additionalProperties": False}


@pytest.mark.slow
def test_parse_with_a_pydantic_model_and_twenty_random_schemas(real_server):
    import openai
    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        population_millions: int = pydantic.Field(ge=0, le=1000)  # bounded: a small model's digits can run on

    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="none", timeout=300, max_retries=0)
    name = client.models.list().data[0].id
    r = client.beta.chat.completions.parse(model=name, temperature=0, max_tokens=120, response_format=City,
                                           messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name

    rng = random.Random(0)
    schemas = [{"type": "object", "properties": {"answer": random_schema(rng)}, "required": ["answer"],
                "additionalProperties": False} for _ in range(20)]

    def ask(schema: dict) -> str:
        r = client.chat.completions.create(
            model=name, temperature=0, max_tokens=300,
            messages=[{"role": "user", "content": "Answer with JSON matching this schema: " + json.dumps(schema)}],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                    "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 4 run at once (the server's max-num-seqs), 4 wait
        texts = list(pool.map(ask, schemas))
    for schema, text in zip(schemas, texts):
        jsonschema.validate(json.loads(text), schema)
