"""common/chat_template.py renders like transformers' render_jinja_template, inside a sandbox."""

from __future__ import annotations

import re

import pytest

from common.chat_template import ChatTemplate, ChatTemplateError

# Exercises what real templates use: namespace, loop controls, tojson with non-ASCII, tools,
# message fields that may be None, whitespace control, bos/eos variables, extra kwargs.
TOOL_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% if not loop.last %},{% endif %}{% endfor %}</tools>
{% endif %}
{%- for m in messages %}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
<|{{ m.role }}|>{{ m.content if m.content is defined else '' }}
  {%- if m.tool_calls is defined %}{% for c in m.tool_calls %}<call>{{ c.function | tojson(sort_keys=True) }}</call>{% endfor %}{% endif %}
  {%- if loop.index0 == ns.last_user %} (last user){% endif %}{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Sé breve."},
    {"role": "user", "content": "Weather in Zürich? 🌦"},
    {"role": "skip", "content": "ignored"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get", "arguments": {"city": "Zürich"}}}
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "user", "content": "Thanks", "name": None},
]
TOOLS = [{"type": "function", "function": {"name": "get", "description": "Wetter für eine Stadt"}}]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}])
def test_render_equals_transformers(add_generation_prompt, extra):
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = ChatTemplate(TOOL_TEMPLATE, SPECIALS).render(
        MESSAGES, add_generation_prompt=add_generation_prompt, tools=TOOLS, **extra
    )
    messages = [{k: v for k, v in m.items() if v is not None} for m in MESSAGES]  # as HF normalizes
    (theirs,), _ = render_jinja_template(
        conversations=[messages],
        tools=TOOLS,
        chat_template=TOOL_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        **SPECIALS,
        **extra,
    )
    assert ours == theirs
    assert "Zürich" in ours and "\\u00fc" not in ours  # tojson keeps non-ASCII
    assert "ignored" not in ours  # loop controls work
    assert ours.startswith("<s>")
    assert ("<think></think>" in ours) == (add_generation_prompt and bool(extra))


def test_helpers_and_errors():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([])
    today = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", today)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="messages\\[0\\]"):
        ChatTemplate("{{ messages }}").render(["not a dict"])  # type: ignore[list-item]


def test_sandbox_blocks_python_internals():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])
    mutate = "{% set _ = messages.append(1) %}{{ messages | length }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(mutate).render([{"role": "user", "content": "x"}])
