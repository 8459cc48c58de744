"""What the router needs of a tokenizer, and how it loads one from the model path.

The router tokenizes prompts, renders chat templates and detokenizes outputs itself; workers only
see token ids.  `RouterTokenizer` is the subset of `common.tokenizer.Tokenizer` the router uses,
so tests may hand in any object with these methods.  This module must never import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class RouterTokenizer(Protocol):
    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str: ...


def load_tokenizer(model_path: str) -> RouterTokenizer:
    """Load the tokenizer (and chat template) of an HF folder or a .gguf file."""
    from common.tokenizer import Tokenizer  # imported here: common/ is torch-free, stays lazy

    return Tokenizer.from_path(model_path)


def with_chat_template_file(tokenizer: RouterTokenizer, path: str) -> RouterTokenizer:
    """``tokenizer`` with the chat template in ``path`` (``--chat-template``); SettingsError
    when the file cannot be read or the template does not compile, so the router stops at
    start-up instead of refusing every chat request."""
    from common.chat_template import ChatTemplateError
    from common.settings_loader import SettingsError

    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"chat_template: cannot read {path}: {exc}") from None
    override = getattr(tokenizer, "with_chat_template", None)
    if override is None:
        raise SettingsError("chat_template: this tokenizer cannot take another template")
    try:
        return override(source)
    except ChatTemplateError as exc:
        raise SettingsError(f"chat_template: {path}: {exc}") from None
