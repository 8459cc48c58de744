"""Renders a model's jinja chat template the way transformers' ``apply_chat_template`` does:
a sandboxed environment with ``trim_blocks``/``lstrip_blocks``, loop controls, HF's helpers
(``raise_exception``, a non-escaping ``tojson``, ``strftime_now``) and the special tokens
(``bos_token``, ``eos_token``, ...) as variables; messages with None-valued keys dropped.

Templates come from model files, i.e. untrusted code: the environment is always
``ImmutableSandboxedEnvironment`` and this module never hands the template live objects beyond
plain JSON data. Torch-free (the router renders prompts).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template failed to compile or raised while rendering (``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _plain(value: Any) -> Any:
    """A copy made of JSON types only, so the sandbox never sees caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    raise ChatTemplateError(f"chat template data must be JSON-like, got {type(value).__name__}")


class ChatTemplate:
    """One compiled template; ``render`` is safe to call from several threads."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e}") from e
        self.source = source
        # bos_token, eos_token, unk_token, pad_token: variables every HF template may read.
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` (OpenAI-style dicts); extra kwargs reach the template
        (for example ``enable_thinking=False``)."""
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(
                    f"messages[{i}] must be a mapping, got {type(message).__name__}"
                )
            chat.append({k: _plain(v) for k, v in message.items() if v is not None})
        variables = {**self.special_tokens, **{k: _plain(v) for k, v in kwargs.items()}}
        try:
            return self._template.render(
                messages=chat,
                tools=_plain(list(tools)) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
