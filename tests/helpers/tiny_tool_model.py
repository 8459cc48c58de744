"""The tiny random Llama of ``tiny_model.py`` with a Hermes/Qwen-style chat template that renders
tools, assistant tool calls and tool results, so the router reads the ``<tool_call>`` syntax
from it (random weights: tests constrain the calls with tool_choice required / named)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.tiny_model import write_tiny_llama

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a function with <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% if not tools %}<|im_start|>system\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] is defined %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_tool_llama(folder: Path) -> Path:
    write_tiny_llama(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder
