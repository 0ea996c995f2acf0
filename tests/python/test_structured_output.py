"""Structured output and forced tool calls through `orchid serve` on the bundled model
(models/orchid-tiny), with the clients people use: the official `openai` SDK
(`chat.completions.parse` with Pydantic models), LangChain (`ChatOpenAI.with_structured_output`)
and litellm. The model is tiny and knows nothing of JSON: every well-formed answer here is the
grammar's doing (greedy decoding keeps it deterministic). Grammar construction and mask
application have Rust unit tests (crates/orchid-engine constraint, crates/orchid-server
structured)."""

from __future__ import annotations

import enum
import json
import threading
from typing import Literal, Optional

import pytest
from pydantic import BaseModel, Field

import test_server_support as S

pytestmark = pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))

MODEL = "orchid-tiny"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
BUDGET = 400


@pytest.fixture(scope="module")
def server():
    s = S.Server(S.REPO / "models" / "orchid-tiny", "--max-context", "4096", "--model-id", MODEL, name="structured").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


# ---- ten Pydantic models ---------------------------------------------------------------

class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)


class Address(BaseModel):
    street: str = Field(max_length=40)
    city: str = Field(max_length=30)


class Customer(BaseModel):
    person: Person
    address: Address


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Paint(BaseModel):
    color: Color
    glossy: bool


class Tagged(BaseModel):
    tags: list[str] = Field(max_length=3)
    scores: list[int]


class Profile(BaseModel):
    nickname: Optional[str] = Field(default=None, max_length=20)
    height_cm: Optional[float] = None


class Weather(BaseModel):
    temperature: float = Field(ge=-50, le=50)
    humidity: int = Field(ge=0, le=100)


class Flight(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{2}[0-9]{3}$")
    date: str = Field(pattern=r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$")


class Ticket(BaseModel):
    status: Literal["open", "closed", "pending"]
    priority: int = Field(ge=1, le=5)


class LineItem(BaseModel):
    sku: str = Field(pattern=r"^[a-z]{3}[0-9]{2}$")
    qty: int = Field(ge=1, le=10)


class Order(BaseModel):
    items: list[LineItem] = Field(max_length=3)
    express: bool


class Department(BaseModel):
    name: str = Field(max_length=20)
    headcount: int = Field(ge=0, le=1000)


class Company(BaseModel):
    name: str = Field(max_length=30)
    ceo: Person
    departments: list[Department] = Field(max_length=2)


MODELS = [Person, Customer, Paint, Tagged, Profile, Weather, Flight, Ticket, Order, Company]


def parse_api(client):
    """`client.chat.completions.parse` (openai >= 1.92) or the older `beta` spelling."""
    chat = client.chat.completions
    return chat.parse if hasattr(chat, "parse") else client.beta.chat.completions.parse


@pytest.mark.parametrize("model", MODELS, ids=[m.__name__ for m in MODELS])
def test_parse_returns_a_valid_object(client, model):
    r = parse_api(client)(model=MODEL, messages=ASK, response_format=model, max_tokens=BUDGET, temperature=0, extra_body=NO_THINK)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(c.message.parsed, model), c.message.content
    model.model_validate_json(c.message.content)


def test_json_object_always_parses(client):
    for prompt in ["Say hi.", "List three fruits.", "What is two plus two?"]:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=BUDGET,
                                           temperature=0, response_format={"type": "json_object"}, extra_body=NO_THINK)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schema_streamed_and_after_reasoning(client):
    schema = Weather.model_json_schema()
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    text = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=BUDGET, temperature=0, response_format=rf,
                                                stream=True, extra_body=NO_THINK):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    Weather.model_validate_json(text)
    # Thinking on: the reasoning is free, the answer after </think> follows the schema.
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=600, temperature=0, response_format=rf)
    m = r.choices[0].message
    if r.choices[0].finish_reason == "stop":
        Weather.model_validate_json(m.content)
    else:  # the model never closed its reasoning within the budget: nothing was constrained yet
        assert r.choices[0].finish_reason == "length"


def test_guided_choice_regex_and_grammar(client, server):
    choices = ["positive", "negative", "neutral"]
    for prompt in ["I love it", "Terrible.", "The sky", "Once upon a time"]:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=20, temperature=0,
                                           extra_body={"guided_choice": choices, **NO_THINK})
        assert r.choices[0].message.content in choices
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}, **NO_THINK})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="Phone number:", max_tokens=30, temperature=0,
                                  extra_body={"guided_regex": r"\(0[0-9]{2}\) [0-9]{3}-[0-9]{4}"})
    import re
    assert re.fullmatch(r"\(0[0-9]{2}\) [0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    grammar = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    r = client.completions.create(model=MODEL, prompt="Q: 2+2? A:", max_tokens=30, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", r.choices[0].text), r.choices[0].text
    status, _, body = server.json("POST", "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}, "max_tokens": 200})
    assert status == 200 and isinstance(json.loads(body["choices"][0]["text"]), dict)


def test_bad_constraints_are_400(server):
    cases = [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}}, "guided_json"),
        ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "response_format"),
    ]
    for extra, param in cases:
        status, _, body = server.json("POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, **extra})
        assert status == 400, body
        assert body["error"]["param"] == param, body
        assert body["error"]["message"]


# ---- forced tool calls ---------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        }, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "book_table", "description": "Book a restaurant table", "parameters": {
        "type": "object", "properties": {
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "vegetarian": {"type": "boolean"},
            "dishes": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        }, "required": ["people"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [[{"role": "user", "content": q}] for q in ["What is the weather in Oslo?", "Book a table for four."]]
TOOL_BUDGET = 160


def validate_call(name, arguments):
    import jsonschema

    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def stream_calls(client, **kw):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        for t in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(t.index, ["", ""])
            if t.function.name:
                c[0] = t.function.name
            c[1] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(c) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", ["required", "get_weather", "book_table"])
def test_forced_tool_calls_validate(client, choice):
    tc = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    for q in QUESTIONS:
        kw = dict(model=MODEL, messages=q, tools=TOOLS, tool_choice=tc, max_tokens=TOOL_BUDGET, temperature=0)
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            validate_call(call.function.name, call.function.arguments)
            if choice != "required":
                assert call.function.name == choice
        streamed, finish = stream_calls(client, **kw)
        assert finish == "tool_calls"
        assert streamed == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        one = client.chat.completions.create(**kw, parallel_tool_calls=False)
        assert len(one.choices[0].message.tool_calls) == 1


# ---- unconstrained requests are unchanged --------------------------------------------------

def test_unconstrained_greedy_output_is_unchanged_next_to_a_constrained_one(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=60, temperature=0, extra_body=NO_THINK)
    alone = client.chat.completions.create(**kw).choices[0].message.content
    out = {}

    def constrained():
        out["json"] = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=BUDGET, temperature=0,
                                                     response_format={"type": "json_object"}, extra_body=NO_THINK)

    t = threading.Thread(target=constrained)
    t.start()
    together = client.chat.completions.create(**kw).choices[0].message.content
    t.join()
    assert together == alone
    json.loads(out["json"].choices[0].message.content)


# ---- LangChain and litellm -----------------------------------------------------------------

def test_langchain_with_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=MODEL, base_url=server.base + "/v1", api_key="unused", temperature=0, max_tokens=BUDGET,
                        max_retries=0, extra_body=NO_THINK)
    for model in (Person, Ticket, Order):
        obj = llm.with_structured_output(model, method="json_schema").invoke("Describe it as JSON.")
        assert isinstance(obj, model)
    # json_mode: any JSON object (parsed into a dict by LangChain).
    obj = llm.with_structured_output(None, method="json_mode").invoke("Reply in JSON.")
    assert isinstance(obj, dict)


def test_litellm_response_format(server):
    litellm = pytest.importorskip("litellm")
    common = dict(model="openai/" + MODEL, api_base=server.base + "/v1", api_key="unused", temperature=0, max_tokens=BUDGET,
                  extra_body=NO_THINK, messages=ASK)
    r = litellm.completion(response_format=Weather, **common)
    Weather.model_validate_json(r.choices[0].message.content)
    r = litellm.completion(response_format={"type": "json_object"}, **common)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
