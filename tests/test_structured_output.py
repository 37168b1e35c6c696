"""Constrained decoding (llguidance) on the real SmolLM2: JSON schemas, JSON objects, regexes, choices
and grammars in the engine, every output checked by an independent validator (``jsonschema``,
``re``); compile errors name the request parameter; a constraint that cannot finish within
max_tokens ends with ``length``.

The schemas come from hypothesis: nested objects, arrays, enums, required and optional properties,
numbers and integers with bounds. They are decoded together in one engine run (continuous batching
with a mask per sequence)."""

from __future__ import annotations

import json
import operator
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.errors import RequestError
from ruvllm.sampling import SamplingParams
from ruvllm.structured import StructuredOutput

NAMES = ["id", "name", "title", "count", "price", "tags", "kind", "active", "score", "items", "owner", "size"]


def _leaf() -> st.SearchStrategy[dict]:
    bounds = st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(lambda t: (t[0], t[0] + t[1]))
    return st.one_of(
        bounds.map(lambda b: {"type": "integer", "minimum": b[0], "maximum": b[1]}),
        bounds.map(lambda b: {"type": "number", "minimum": b[0], "maximum": b[1]}),
        st.integers(1, 16).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "boolean"}),
        st.lists(
            st.sampled_from(["red", "green", "blue", "small", "large", "none"]), min_size=1, max_size=4, unique=True
        ).map(lambda xs: {"enum": xs}),
    )


def _object(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    @st.composite
    def build(draw) -> dict:
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
        props = {n: draw(children) for n in names}
        required = [n for n in names if draw(st.booleans())]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return build()


def _array(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(children, st.integers(0, 1), st.integers(1, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )


SCHEMAS = st.recursive(_leaf(), lambda ch: st.one_of(_object(ch), _array(ch)), max_leaves=6).filter(
    lambda s: s.get("type") in ("object", "array")
)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model

    llm = load_model(str(smollm2_path), backend="jax", options=LoadOptions(quantization="auto"))
    return LLMEngine(llm, EngineConfig(num_blocks=1024, max_num_seqs=32))


def _prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def _run(engine, prompt: list[int], spec: StructuredOutput, **kw) -> list[tuple[str, str]]:
    params = SamplingParams(structured=spec, **{"max_tokens": 200, "temperature": 0.0, **kw})
    (outs,) = engine.generate([GenerationRequest(prompt, params)])
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for o in outs:
        for d in o.deltas:
            texts[d.index] = texts.get(d.index, "") + d.text
            if d.finish_reason:
                reasons[d.index] = d.finish_reason
    return [(texts[i], reasons[i]) for i in sorted(texts)]


@settings(max_examples=1, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(SCHEMAS, min_size=30, max_size=30))
def test_thirty_generated_json_schemas_all_validate(engine, schemas):
    prompt = _prompt(engine, "Write a JSON document with some example data.")
    requests = [
        GenerationRequest(
            prompt, SamplingParams(max_tokens=300, temperature=0.0, structured=StructuredOutput.json_schema(s))
        )
        for s in schemas
    ]
    results = engine.generate(requests)
    for schema, outs in zip(schemas, results, strict=True):
        text = "".join(d.text for o in outs for d in o.deltas)
        reason = outs[-1].deltas[-1].finish_reason
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_parses_and_sampling_with_n_keeps_each_choice_valid(engine):
    prompt = _prompt(engine, 'What is 2+2? Answer with a JSON object like {"answer": ...}.')
    [(text, reason)] = _run(engine, prompt, StructuredOutput("json_object"), max_tokens=400)
    assert reason == "stop" and isinstance(json.loads(text), dict)
    # Closed (no other properties, a bounded string): every sampled choice must end within max_tokens,
    # whatever path the sampling takes.
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}},
        "required": ["name"],
        "additionalProperties": False,
    }
    outs = _run(engine, prompt, StructuredOutput.json_schema(schema), n=3, temperature=1.0, seed=7)
    assert len(outs) == 3
    for text, reason in outs:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_grammar(engine):
    prompt = _prompt(engine, "Give me a code.")
    [(text, _)] = _run(engine, prompt, StructuredOutput("regex", r"[A-Z]{3}-[0-9]{4}"))
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", text)
    [(text, reason)] = _run(
        engine, _prompt(engine, "Is the sky blue?"), StructuredOutput.choice(["yes", "no", "maybe"])
    )
    assert text in ("yes", "no", "maybe") and reason == "stop"
    lark = 'start: "(" expr ")"\nexpr: NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/\n'
    [(text, reason)] = _run(engine, _prompt(engine, "Add some numbers."), StructuredOutput("grammar", lark))
    assert reason == "stop" and re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text)
    gbnf = 'root ::= "x" [0-9] [0-9]'
    [(text, reason)] = _run(engine, prompt, StructuredOutput("grammar", gbnf))
    assert re.fullmatch(r"x[0-9]{2}", text) and reason == "stop"


def test_a_constraint_that_cannot_finish_in_max_tokens_ends_with_length(engine):
    schema = {"type": "array", "items": {"type": "string", "minLength": 50}, "minItems": 5}
    [(text, reason)] = _run(
        engine, _prompt(engine, "List things."), StructuredOutput.json_schema(schema), max_tokens=12
    )
    assert reason == "length" and text.startswith("[")


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        (lambda: StructuredOutput("grammar", "start: ( unclosed", "guided_grammar"), "guided_grammar"),
        (lambda: StructuredOutput("regex", "a(b", "structured_outputs.regex"), "structured_outputs.regex"),
        (
            lambda: StructuredOutput.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
            "response_format.json_schema.schema",
        ),
        (lambda: StructuredOutput.json_schema("{not json", "guided_json"), "guided_json"),
        (lambda: StructuredOutput.choice([], "guided_choice"), "guided_choice"),
    ],
    ids=["grammar-syntax", "regex", "schema-ref", "schema-json", "empty-choice"],
)
def test_constraints_that_do_not_compile_name_the_parameter(engine, spec, param):
    with pytest.raises(RequestError) as info:
        engine.add_request(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=4, structured=spec())))
    assert info.value.param == param and str(info.value).startswith(param) and "\n" not in str(info.value)
    assert not engine.has_unfinished()


def test_compiled_grammars_are_cached_by_text(engine):
    compiler = engine.grammar_compiler()
    spec = StructuredOutput("regex", "[a-z]{2,5}", "guided_regex")
    compiler.grammar(spec)
    hits = compiler.hits
    compiler.grammar(StructuredOutput("regex", "[a-z]{2,5}", "structured_outputs.regex"))
    assert compiler.hits == hits + 1


def _accepts(compiler, grammar: str, text: str) -> bool:
    from llguidance import LLMatcher

    matcher = LLMatcher(compiler.ll_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in compiler.ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


KEEPS = {
    "minimum": operator.ge,
    "maximum": operator.le,
    "exclusiveMinimum": operator.gt,
    "exclusiveMaximum": operator.lt,
}


@pytest.mark.parametrize("kind", ["number", "integer"])
def test_bounded_numbers_take_at_most_sixteen_fraction_digits_and_keep_their_bounds(engine, kind):
    from decimal import Decimal

    compiler = engine.grammar_compiler()
    texts = ["0", "1", "-1", "7", "10", "99", "100", "-100", "0.5", "-0.5", "2.25", "2.250", "2.2501", "-2.5", "-2.51"]
    texts += ["0.1234567890123456", "0.12345678901234567", "1e2", "01", "1.", "-3.14", "-3.1400", "-3.1401"]
    bounds = [
        {"minimum": 0, "maximum": 10},
        {"minimum": -5, "exclusiveMaximum": 7},
        {"exclusiveMinimum": -3.14, "maximum": 2.25},
        {"minimum": -1000, "maximum": -3},
        {"exclusiveMinimum": 0},
        {"maximum": -0.5},
    ]
    for bound in bounds:
        schema = {"type": kind, **bound}
        grammar = compiler.grammar(StructuredOutput.json_schema(schema))
        for text in texts:
            capped = re.fullmatch(r"-?(0|[1-9][0-9]*)" + ("" if kind == "integer" else r"(\.[0-9]{1,16})?"), text)
            if capped and text.startswith("-") and Decimal(text) == 0:
                continue  # -0 is in or out as the grammar likes
            want = bool(capped) and all(KEEPS[k](Decimal(text), Decimal(str(v))) for k, v in bound.items())
            assert _accepts(compiler, grammar, text) == want, (schema, text)
