"""Chat templates render exactly as transformers' ``apply_chat_template`` renders them."""

from __future__ import annotations

import _tokenizer_fixtures
import pytest

from ruvllm.errors import ModelFormatError, RequestError
from ruvllm.tokenizer import Tokenizer

smollm2_tokenizer = _tokenizer_fixtures.smollm2_tokenizer
hf_smollm2_tokenizer = _tokenizer_fixtures.hf_smollm2_tokenizer

WITHOUT_SYSTEM = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in words, en français ? 🙂"},
]
WITH_SYSTEM = [{"role": "system", "content": "You answer in one word."}, *WITHOUT_SYSTEM]

# Exercises what transformers adds to plain Jinja: trim_blocks/lstrip_blocks whitespace, raise_exception,
# tojson without HTML escaping, strftime_now, namespace, loop controls, the {% generation %} tag and
# the bos_token/eos_token variables.
FEATURE_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role: ' + message['role']) }}
    {%- endif %}
    {% if loop.index0 >= 3 %}{% break %}{% endif %}
{{ message['role'] | upper }}: {{ message['content'] }}
    {% generation %}
{% if message.role == 'assistant' %}[end of answer]{% endif %}
    {% endgeneration %}
{% endfor %}
{% if tools %}
TOOLS: {{ tools | tojson }}
{% endif %}
{% set ns = namespace(count=0) %}
{% for m in messages %}{% set ns.count = ns.count + 1 %}{% endfor %}
count={{ ns.count }} year={{ strftime_now('%Y') }}
{% if add_generation_prompt %}ASSISTANT:{% endif %}{{ eos_token }}"""

TOOLS = [{"type": "function", "function": {"name": "météo", "description": "<weather> & \"rain\"", "parameters": {}}}]


def _hf_render(hf, messages, **kw):
    return hf.apply_chat_template(messages, tokenize=False, **kw)


@pytest.mark.parametrize("messages", [WITHOUT_SYSTEM, WITH_SYSTEM], ids=["no-system", "system"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(
    smollm2_tokenizer, hf_smollm2_tokenizer, messages, add_generation_prompt
):
    ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == _hf_render(hf_smollm2_tokenizer, messages, add_generation_prompt=add_generation_prompt)
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_encode_chat_matches_transformers_ids(smollm2_tokenizer, hf_smollm2_tokenizer):
    ref = hf_smollm2_tokenizer.apply_chat_template(WITH_SYSTEM, tokenize=True, add_generation_prompt=True)
    ref_ids = ref if isinstance(ref, list) else ref["input_ids"]
    ids = smollm2_tokenizer.encode_chat(WITH_SYSTEM)
    assert ids == ref_ids
    assert ids[0] == 1 and ids.count(1) == len(WITH_SYSTEM) + 1  # one <|im_start|> per turn, plus the prompt


def test_list_of_text_parts_is_joined(smollm2_tokenizer, hf_smollm2_tokenizer):
    content = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second."}]
    parts = [{"role": "user", "content": content}]
    ours = smollm2_tokenizer.apply_chat_template(parts)
    joined = [{"role": "user", "content": "First part.\nSecond."}]
    assert ours == _hf_render(hf_smollm2_tokenizer, joined, add_generation_prompt=True)
    assert isinstance(parts[0]["content"], list)  # the caller's messages are left alone


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_transformers_template_features(smollm2_tokenizer, hf_smollm2_tokenizer, add_generation_prompt):
    tok = Tokenizer(smollm2_tokenizer.inner, bos_token_id=1, eos_token_ids=[2], chat_template=FEATURE_TEMPLATE)
    messages = [*WITH_SYSTEM, {"role": "assistant", "content": "quatre"}]  # 5 turns: the loop breaks after 3
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=TOOLS)
    ref = _hf_render(
        hf_smollm2_tokenizer, messages, chat_template=FEATURE_TEMPLATE, add_generation_prompt=add_generation_prompt,
        tools=TOOLS,
    )
    assert ours == ref
    assert '"météo"' in ours and "<weather> & \\\"rain\\\"" in ours  # tojson: no HTML or ASCII escaping
    assert ours.startswith("<|im_start|>") and ours.endswith("<|im_end|>")
    assert "count=5" in ours and "USER: And in words" not in ours


def test_template_raise_exception_is_a_request_error(smollm2_tokenizer):
    tok = Tokenizer(smollm2_tokenizer.inner, bos_token_id=1, eos_token_ids=[2], chat_template=FEATURE_TEMPLATE)
    with pytest.raises(RequestError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_model_without_template_raises_request_error(smollm2_tokenizer):
    tok = Tokenizer(smollm2_tokenizer.inner, bos_token_id=1, eos_token_ids=[2], chat_template=None)
    with pytest.raises(RequestError, match="no chat template"):
        tok.apply_chat_template(WITHOUT_SYSTEM)
    with pytest.raises(RequestError, match="no chat template"):
        tok.encode_chat(WITHOUT_SYSTEM)


def test_broken_template_is_a_format_error(smollm2_tokenizer):
    tok = Tokenizer(smollm2_tokenizer.inner, bos_token_id=1, eos_token_ids=[2], chat_template="{% for m in messages %}")
    with pytest.raises(ModelFormatError, match="not valid Jinja"):
        tok.apply_chat_template(WITHOUT_SYSTEM)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "must be a list"),
        ([{"content": "no role"}], "string 'role'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text content"),
        ([{"role": "user", "content": 42}], "string or a list of text parts"),
    ],
)
def test_malformed_messages_raise_request_error(smollm2_tokenizer, messages, match):
    with pytest.raises(RequestError, match=match):
        smollm2_tokenizer.apply_chat_template(messages)


def test_template_cannot_escape_the_sandbox(smollm2_tokenizer):
    hostile = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(smollm2_tokenizer.inner, bos_token_id=1, eos_token_ids=[2], chat_template=hostile)
    with pytest.raises(RequestError, match=r"unsafe"):
        tok.apply_chat_template(WITHOUT_SYSTEM)
