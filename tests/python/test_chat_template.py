"""Chat template parity: `orchid render-chat` must render byte-identically to transformers'
`apply_chat_template(messages, tools=.., add_generation_prompt=.., tokenize=False, **kwargs)`.

Templates: the Qwen3.5 one (assets/qwen3.5/chat_template.jinja, reference built
with `PreTrainedTokenizerFast(tokenizer_file=.., chat_template=..)` since that folder has no
tokenizer_config.json) and the Qwen3 one (`chat_template` in qwen3/tokenizer_config.json,
reference from `AutoTokenizer.from_pretrained`). orchid converts tool-call `arguments` given as
JSON strings into objects, as vLLM does; the reference gets the converted messages.

Run: cargo build --release -p orchid && .venv/bin/python -m pytest tests/python/test_chat_template.py -q
"""

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets"
ORCHID = Path(os.environ.get("ORCHID_BIN", REPO / "target" / "release" / "orchid"))

# ------------------------------------------------------------------------------------------
# Conversation pieces

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city. Returns °C; use \"metric\" <units>.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. München or 東京"},
            "units": {"type": "string", "enum": ["metric", "imperial"], "default": "metric"},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        }, "required": ["city"]},
    }},
    {"type": "function", "function": {
        "name": "search_flights",
        "description": "Search flights.\nSupports multi-leg trips.",
        "parameters": {"type": "object", "properties": {
            "legs": {"type": "array", "items": {"type": "object", "properties": {
                "from": {"type": "string"}, "to": {"type": "string"},
                "date": {"type": "string", "format": "date"}}, "required": ["from", "to"]}},
            "passengers": {"type": "object", "properties": {
                "adults": {"type": "integer"}, "children": {"type": "integer", "default": 0}}},
            "max_price": {"type": ["number", "null"], "exclusiveMinimum": 0.5},
            "flexible": {"type": "boolean"},
        }, "required": ["legs"], "additionalProperties": False},
    }},
    {"type": "function", "function": {
        "name": "run_sql", "description": "Run a query; backslashes \\ and tabs\t are literal.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    }},
]

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
USER = {"role": "user", "content": "What's the weather in Paris and Tokyo? 天気は？"}

CALL_WEATHER = {"id": "call_1", "type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Paris", "units": "metric", "days": 3}}}
CALL_FLIGHTS = {"id": "call_2", "type": "function", "function": {
    "name": "search_flights", "arguments": {
        "legs": [{"from": "CDG", "to": "NRT", "date": "2026-12-01"}, {"from": "NRT", "to": "CDG"}],
        "passengers": {"adults": 2, "children": 0}, "max_price": 1234.5, "flexible": True,
        "note": None, "ratio": 1.0, "tiny": 1e-05, "huge": 1e20, "neg": -7,
        "text": "multi\nline \"quoted\" ünïcode 🚀"}}}
CALL_SQL_STR = {"id": "call_3", "type": "function", "function": {
    "name": "run_sql", "arguments": "{\"query\": \"SELECT * FROM t WHERE x > 1\", \"limit\": 10, \"opts\": {\"a\": [1, 2.5]}}"}}

TOOL_RESULT_1 = {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 18, \"sky\": \"cloudy\"}"}
TOOL_RESULT_2 = {"role": "tool", "tool_call_id": "call_2", "content": "3 flights found"}
TOOL_RESULT_3 = {"role": "tool", "tool_call_id": "call_3", "content": "[]"}


def turns_with_reasoning():
    return [
        SYSTEM,
        {"role": "user", "content": "Hi! What is 2+2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Simple arithmetic: 2+2=4."},
        {"role": "user", "content": "And the weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "\nNeed the tool.\n",
         "tool_calls": [CALL_WEATHER]},
        TOOL_RESULT_1,
        {"role": "assistant", "content": "It is 18 °C and cloudy.", "reasoning_content": "Got it."},
    ]


CASES_QWEN35 = {
    "user_only": dict(messages=[USER]),
    "system_user": dict(messages=[SYSTEM, USER]),
    "thinking_off": dict(messages=[SYSTEM, USER], kwargs={"enable_thinking": False}),
    "thinking_on": dict(messages=[USER], kwargs={"enable_thinking": True}),
    "no_generation_prompt": dict(messages=[SYSTEM, USER, {"role": "assistant", "content": "Sure."}], agp=False),
    "tools_with_system": dict(messages=[SYSTEM, USER], tools=TOOLS),
    "tools_no_system": dict(messages=[USER], tools=TOOLS, kwargs={"enable_thinking": False}),
    "tools_empty_list": dict(messages=[SYSTEM, USER], tools=[]),
    "one_tool_call": dict(messages=[SYSTEM, USER, {"role": "assistant", "content": "", "tool_calls": [CALL_WEATHER]},
                                    TOOL_RESULT_1], tools=TOOLS),
    "several_tool_calls_with_text": dict(messages=[USER, {"role": "assistant", "content": "Checking both.",
                                                          "tool_calls": [CALL_WEATHER, CALL_FLIGHTS, CALL_SQL_STR]},
                                                   TOOL_RESULT_1, TOOL_RESULT_2, TOOL_RESULT_3], tools=TOOLS),
    "tool_call_null_content": dict(messages=[USER, {"role": "assistant", "content": None,
                                                    "tool_calls": [CALL_FLIGHTS]}, TOOL_RESULT_2]),
    "string_arguments": dict(messages=[USER, {"role": "assistant", "content": "",
                                              "tool_calls": [CALL_SQL_STR]}, TOOL_RESULT_3], tools=TOOLS),
    "reasoning_history": dict(messages=turns_with_reasoning(), tools=TOOLS),
    "reasoning_history_no_agp": dict(messages=turns_with_reasoning(), tools=TOOLS, agp=False),
    "reasoning_mid_tool_loop": dict(messages=turns_with_reasoning()[:-1]),
    "reasoning_alias_field": dict(messages=[USER, {"role": "assistant", "content": "x", "reasoning": "via alias",
                                                   "tool_calls": [CALL_WEATHER]}, TOOL_RESULT_1]),
    "think_inline_in_content": dict(messages=[USER, {"role": "assistant", "content": "<think>\nhidden\n</think>\n\nshown"},
                                              {"role": "user", "content": "next"},
                                              {"role": "assistant", "content": "<think>kept</think>answer"}], agp=False),
    "content_parts": dict(messages=[{"role": "system", "content": [{"type": "text", "text": "Sys "}, {"type": "text", "text": "part."}]},
                                    {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world "}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
                                    {"role": "user", "content": [{"type": "text", "text": "More?"}]}]),
    "tool_result_parts": dict(messages=[USER, {"role": "assistant", "content": "", "tool_calls": [CALL_WEATHER]},
                                        {"role": "tool", "content": [{"type": "text", "text": "<b>18</b>"}]}]),
    "preserve_thinking_kwarg": dict(messages=turns_with_reasoning(), kwargs={"preserve_thinking": True}),
    "whitespace_and_unicode": dict(messages=[{"role": "system", "content": "  \n padded system \n\n"},
                                             {"role": "user", "content": "\n\t Ωμέγα — “quotes” 🙂 \n"}]),
    "tool_call_without_arguments": dict(messages=[USER, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather"}},
        {"type": "function", "function": {"name": "run_sql", "arguments": ""}}]}, TOOL_RESULT_1, TOOL_RESULT_3]),
    "reasoning_and_inline_think": dict(messages=[USER, {"role": "assistant", "content": "<think>inline</think>\n\nshown",
                                                        "reasoning_content": "field wins", "tool_calls": [CALL_WEATHER]},
                                                 TOOL_RESULT_1]),
    "long_tool_loop": dict(messages=[SYSTEM, USER,
                                     {"role": "assistant", "content": "", "reasoning_content": "first", "tool_calls": [CALL_WEATHER]},
                                     TOOL_RESULT_1,
                                     {"role": "assistant", "content": "two more", "reasoning_content": "second",
                                      "tool_calls": [CALL_FLIGHTS, CALL_SQL_STR]},
                                     TOOL_RESULT_2, TOOL_RESULT_3], tools=TOOLS, kwargs={"enable_thinking": True}),
    "tool_response_like_user": dict(messages=[USER, {"role": "assistant", "content": "ok"},
                                              {"role": "user", "content": "<tool_response>x</tool_response>"}]),
}

CASES_QWEN3 = {
    "user_only": dict(messages=[USER]),
    "system_user": dict(messages=[SYSTEM, USER]),
    "thinking_off": dict(messages=[SYSTEM, USER], kwargs={"enable_thinking": False}),
    "no_generation_prompt": dict(messages=[SYSTEM, USER, {"role": "assistant", "content": "Sure."}], agp=False),
    "tools_with_system": dict(messages=[SYSTEM, USER], tools=TOOLS),
    "tools_no_system": dict(messages=[USER], tools=TOOLS),
    "tool_calls_and_results": dict(messages=[SYSTEM, USER, {"role": "assistant", "content": "Checking.",
                                                            "tool_calls": [CALL_WEATHER, CALL_FLIGHTS]},
                                             TOOL_RESULT_1, TOOL_RESULT_2], tools=TOOLS),
    "tool_call_empty_content": dict(messages=[USER, {"role": "assistant", "content": "", "tool_calls": [CALL_SQL_STR]},
                                              TOOL_RESULT_3], tools=TOOLS),
    "reasoning_history": dict(messages=turns_with_reasoning(), tools=TOOLS),
    "reasoning_history_no_agp": dict(messages=turns_with_reasoning(), agp=False),
    "think_inline_in_content": dict(messages=[USER, {"role": "assistant", "content": "<think>\nhidden\n</think>\n\nshown"},
                                              {"role": "user", "content": "next"}]),
    "system_not_first": dict(messages=[USER, {"role": "assistant", "content": "a"}, SYSTEM, {"role": "user", "content": "b"}]),
}

ERROR_CASES_QWEN35 = {
    "no_user_query": dict(messages=[SYSTEM]),
    "system_not_first": dict(messages=[USER, SYSTEM]),
    "image_content": dict(messages=[{"role": "user", "content": [{"type": "image", "image": "x.png"}]}]),
    "unknown_role": dict(messages=[USER, {"role": "robot", "content": "x"}]),
}

# A template that exercises the jinja2/Python behaviours chat templates rely on, beyond what the
# two Qwen templates use (Python reprs, tojson options, string methods, tests, slicing, loop vars).
SEMANTICS_TEMPLATE = r"""
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
{%- set ns.n = ns.n + 1 %}
[{{ loop.index }}/{{ loop.length }} {{ m.role|upper }} prev={{ loop.previtem.role if loop.previtem else none }}]
{{ m.content|trim }}|{{ m.content.strip(' .') }}|{{ m.content.split() }}|{{ m.content.split('a', 1) }}|{{ m.content.rstrip() }}
{%- if m.meta is defined %}
{{ m.meta }} {{ m.meta|tojson }} {{ m.meta|tojson(indent=2) }} {{ m.meta|tojson(indent=1, sort_keys=true) }} {{ m.meta|string }}
{%- for k, v in m.meta.items() %} {{ k }}={{ v }}({{ v is sequence }},{{ v is mapping }},{{ v is string }},{{ v is iterable }}){%- endfor %}
{{ m.meta.get('x', 'dflt') }} {{ m.meta.get('nope', 'dflt') }} {{ m.meta.keys()|list }} {{ m.meta['list'][::-1] }} {{ m.meta['list'][1:3] }}
{%- for k, v in m.meta|items %}{{ k }}{% if not loop.last %},{% endif %}{% endfor %}
{%- endif %}
{%- endfor %}
{{ ns.n }} {{ messages|length > 1 }} {{ 7 // 2 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1.5 * 2 }} {{ 'x' * 3 }} {{ (1, 2) }} {{ [] }} {{ {} }}
{{ messages[0].content.startswith(('Hel', 'x')) }} {{ messages[0].content.endswith('!') }} {{ messages[0].content.replace('l', 'L') }}
{{ 'a,b,,c'.split(',') }} {{ 'a b c'.rsplit(' ', 1) }} {{ '  x  '.lstrip() }}| {{ none is none }} {{ undefined_thing is defined }} {{ undefined_thing }}|
{{ tools|tojson if tools else 'no tools' }} {{ add_generation_prompt }} {{ custom }} {{ custom_num }} {{ custom_list|join(', ') }}
{%- if add_generation_prompt %}
{{ '<|im_start|>assistant\n' }}
{%- endif %}
"""

SEMANTICS_CASE = dict(
    messages=[{"role": "user", "content": "Hello, a world!  "},
              {"role": "assistant", "content": " alpha beta\tgamma\n", "meta": {
                  "x": 1.0, "list": [1, "two", 3.5, True, None, 1e-07, 12345678901234], "nested": {"k": "v<&>'\""},
                  "flag": False, "s": "str", "empty": [], "uni": "ünï 🚀"}}],
    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
    kwargs={"custom": "hello", "custom_num": 2.5, "custom_list": ["a", "b"]},
)

# ------------------------------------------------------------------------------------------
# Helpers


def vllm_postprocess(messages):
    """vLLM's conversion of tool-call arguments (JSON string -> object; empty -> {})."""
    messages = copy.deepcopy(messages)
    for m in messages:
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            for item in m["tool_calls"]:
                args = item["function"].get("arguments")
                if args:
                    if not isinstance(args, (dict, list)):
                        item["function"]["arguments"] = json.loads(args)
                else:
                    item["function"]["arguments"] = {}
    return messages


def reference(tok, case):
    return tok.apply_chat_template(vllm_postprocess(case["messages"]), tools=case.get("tools"),
                                   add_generation_prompt=case.get("agp", True), tokenize=False,
                                   **case.get("kwargs", {}))


def orchid_render(model_dir: Path, case, tmp_path: Path) -> subprocess.CompletedProcess:
    request = {"messages": case["messages"], "add_generation_prompt": case.get("agp", True)}
    if "tools" in case:
        request["tools"] = case["tools"]
    request.update(case.get("kwargs", {}))
    f = tmp_path / "request.json"
    f.write_text(json.dumps(request, ensure_ascii=False), encoding="utf-8")
    return subprocess.run([str(ORCHID), "render-chat", "--model", str(model_dir), "--request", str(f)],
                          capture_output=True)


def require_binary():
    if not ORCHID.exists():
        pytest.skip(f"orchid binary not found at {ORCHID} (build with cargo build --release -p orchid)")


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    require_binary()
    d = tmp_path_factory.mktemp("qwen3_5")
    for f in ["tokenizer.json", "chat_template.jinja"]:
        shutil.copy(ASSETS / "qwen3.5" / f, d / f)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"),
                                  chat_template=(d / "chat_template.jinja").read_text(encoding="utf-8"))
    return d, tok


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    require_binary()
    d = tmp_path_factory.mktemp("qwen3")
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(ASSETS / "qwen3" / f, d / f)
    return d, AutoTokenizer.from_pretrained(str(d))


def check(model, case, tmp_path):
    model_dir, tok = model
    want = reference(tok, case)
    got = orchid_render(model_dir, case, tmp_path)
    assert got.returncode == 0, got.stderr.decode()
    assert got.stdout.decode("utf-8") == want

# ------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("name", list(CASES_QWEN35))
def test_qwen35_matches_transformers(qwen35, name, tmp_path):
    check(qwen35, CASES_QWEN35[name], tmp_path)


@pytest.mark.parametrize("name", list(CASES_QWEN3))
def test_qwen3_matches_transformers(qwen3, name, tmp_path):
    check(qwen3, CASES_QWEN3[name], tmp_path)


@pytest.mark.parametrize("name", list(ERROR_CASES_QWEN35))
def test_qwen35_errors_like_transformers(qwen35, name, tmp_path):
    model_dir, tok = qwen35
    case = ERROR_CASES_QWEN35[name]
    with pytest.raises(Exception) as ref_err:
        reference(tok, case)
    got = orchid_render(model_dir, case, tmp_path)
    assert got.returncode != 0
    assert str(ref_err.value) in got.stderr.decode()


def test_jinja_semantics_match_transformers(tmp_path):
    require_binary()
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(ASSETS / "qwen3.5" / "tokenizer.json", d / "tokenizer.json")
    (d / "chat_template.jinja").write_text(SEMANTICS_TEMPLATE, encoding="utf-8")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=SEMANTICS_TEMPLATE)
    check((d, tok), SEMANTICS_CASE, tmp_path)


def test_missing_template_is_a_clear_error(tmp_path):
    require_binary()
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"messages": [USER]}))
    got = subprocess.run([str(ORCHID), "render-chat", "--model", str(tmp_path), "--request", str(f)],
                         capture_output=True)
    assert got.returncode != 0 and b"no chat template" in got.stderr
