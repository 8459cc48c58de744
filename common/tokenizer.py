"""Text <-> token ids for a model, built from its Hugging Face folder (tokenizer.json,
tokenizer_config.json, chat_template.jinja) or from a GGUF file's tokenizer metadata, encoding
exactly as transformers' AutoTokenizer does on the same files. Streaming detokenization and
stop strings live in common/detokenizer.py (re-exported here).

Torch-free and engine-free: the router imports it. It never downloads anything and never
guesses a tokenizer the files do not describe.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from common.chat_template import ChatTemplate
from common.detokenizer import IncrementalDetokenizer, StopMatch, find_stop
from common.gguf_metadata import GGUFFormatError, read_gguf_header
from common.token_bound import max_token_bytes

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# llama.cpp's tokenizer.ggml.pre -> the split regex its merges were learned with (as transformers'
# integrations/gguf/gguf_tokenizer_mapping.py); other names use GPT-2's byte-level regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


__all__ = [
    "IncrementalDetokenizer",  # re-exported: streaming lives in common/detokenizer.py
    "StopMatch",
    "Tokenizer",
    "TokenizerError",
    "find_stop",
]

DECODE_BATCH_FROM = 4096  # ids from which decode runs without the GIL


class TokenizerError(ValueError):
    """The tokenizer files are missing, unreadable or of a kind we do not build."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


class Tokenizer:
    """encode/decode, chat template and special ids of one model."""

    def __init__(
        self,
        backend: Backend,
        special_tokens: Mapping[str, str | None],
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        clean_up_tokenization_spaces: bool = False,
        source: Path | None = None,
    ) -> None:
        self.backend = backend
        # transformers encodes without the truncation/padding a tokenizer.json may carry, and
        # matches special tokens in text; so must we.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False
        self.special_tokens = dict(special_tokens)
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos else None
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template_source = chat_template
        self._chat_template = (
            ChatTemplate(chat_template, self.special_tokens) if chat_template else None
        )
        # transformers skips this clean-up for BPE models (it corrupts them); so do we.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        self.source = source
        self.special_token_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """An HF folder (tokenizer.json), a .gguf file, or a folder holding exactly one .gguf."""
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            return cls.from_gguf(path)
        if path.is_dir():
            if (path / "tokenizer.json").is_file():
                return cls.from_hf_folder(path)
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls.from_gguf(ggufs[0])
            if len(ggufs) > 1:
                raise TokenizerError(f"{path} holds several .gguf files; pass the file itself")
            raise TokenizerError(f"{path} has neither tokenizer.json nor a .gguf file")
        raise TokenizerError(f"tokenizer path {path} does not exist or is not a folder/.gguf")

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise TokenizerError(f"cannot read {folder / 'tokenizer.json'}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        specials = {name: _token_content(config.get(name)) for name in _SPECIAL_NAMES}
        # transformers registers these as special tokens unless tokenizer.json already adds them.
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        for name in _SPECIAL_NAMES:
            content = specials[name]
            if content and content not in added and backend.token_to_id(content) is not None:
                backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        # Like transformers 5: with a tokenizer.json, its post-processor alone decides BOS/EOS
        # (tokenizer_config's add_bos_token/add_eos_token are ignored).
        eos_ids = [backend.token_to_id(specials["eos_token"])] if specials["eos_token"] else []
        eos_ids += _as_ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
        template = _hf_chat_template(folder, config)
        return cls(
            backend,
            specials,
            [i for i in eos_ids if i is not None],
            template,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            source=folder,
        )

    @classmethod
    def from_gguf(cls, file: Path) -> Tokenizer:
        try:
            md = read_gguf_header(file).metadata
        except (OSError, GGUFFormatError) as e:
            raise TokenizerError(f"cannot read GGUF file {file}: {e}") from e
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"{file}: tokenizer.ggml.model={model!r}; only byte-level BPE ('gpt2') GGUF "
                f"tokenizers are supported, use the model's Hugging Face folder instead"
            )
        backend = _gguf_byte_level_backend(md)
        tokens = md["tokenizer.ggml.tokens"]

        def token(key: str) -> str | None:
            i = md.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None else None

        specials = {
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "unk_token": token("unknown_token_id"),
            "pad_token": token("padding_token_id"),
        }
        for name in _SPECIAL_NAMES:
            if specials[name]:
                backend.add_special_tokens(
                    [AddedToken(specials[name], special=True, normalized=False)]
                )
        backend.post_processor = _bos_eos_processor(
            backend,
            specials,
            bool(md.get("tokenizer.ggml.add_bos_token", False)),
            bool(md.get("tokenizer.ggml.add_eos_token", False)),
        )
        eos_ids = [
            md[f"tokenizer.ggml.{k}"]
            for k in ("eos_token_id", "eot_token_id", "eom_token_id")
            if f"tokenizer.ggml.{k}" in md
        ]
        return cls(backend, specials, eos_ids, md.get("tokenizer.chat_template"), source=file)

    # --- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt
        # tokenized in a thread then leaves the router's event loop free. Same ids.
        (enc,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(enc.ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > DECODE_BATCH_FROM:
            # decode_batch releases the GIL while it works (decode does not: 0.5 s of a held
            # GIL for 1M ids); for a few ids, as a stream decodes them, decode is cheaper
            (text,) = self.backend.decode_batch([list(ids)],
                                                skip_special_tokens=skip_special_tokens)
        else:
            text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        if self._chat_template is None:
            raise TokenizerError(f"{self.source}: the model has no chat template")
        return self._chat_template.render(messages, add_generation_prompt, tools, **kwargs)

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer with another chat template (``--chat-template FILE``); raises
        ChatTemplateError when it does not compile."""
        other = copy.copy(self)
        other._chat_template = ChatTemplate(source, self.special_tokens)
        other.chat_template_source = source
        return other

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_bytes(self) -> int | None:
        """Most input bytes one token stands for (None: no sound bound), see token_bound."""
        return max_token_bytes(self.backend)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of vocabulary, merges and special tokens: equal iff two tokenizers agree."""
        state = json.loads(self.backend.to_str())
        model = state.get("model", {})
        payload = {
            "vocab": sorted(self.backend.get_vocab(with_added_tokens=True).items()),
            "merges": model.get("merges", []),
            "specials": sorted(self.special_token_ids),
            "special_tokens": sorted((k, v) for k, v in self.special_tokens.items() if v),
        }
        return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def _gguf_byte_level_backend(md: Mapping[str, Any]) -> Backend:
    """Byte-level BPE as transformers builds it from a GGUF (GPT2Tokenizer + added tokens)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in md.get("tokenizer.ggml.merges", [])]
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _GGUF_SPLITS.get(md.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    types = list(md.get("tokenizer.ggml.token_type") or [])
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: not added.
    control = [
        t for t, k in zip(tokens, types, strict=False) if k == _CONTROL and set(t) <= alphabet
    ]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, k in zip(tokens, types, strict=False) if k == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend


def _bos_eos_processor(
    backend: Backend, specials: Mapping[str, str | None], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    bos, eos = specials.get("bos_token"), specials.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    special = [(bos, backend.token_to_id(bos))] if add_bos else []
    special += [(eos, backend.token_to_id(eos))] if add_eos else []
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    return d if isinstance(d, dict) else {}


def _clean_up_spaces(text: str) -> str:
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text
