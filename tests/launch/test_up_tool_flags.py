"""`bulkhead up --chat-template FILE --tool-call-parser NAME` reaches the router as its own
flags (an absolute template path: the router may run from another directory), and the router
settings refuse a parser name it does not know."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.up import build_parser
from launch.up_options import tool_args
from router.settings import SettingsError, load_settings


def test_up_passes_the_tool_flags_to_the_router(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["--chat-template", "t.jinja",
                                      "--tool-call-parser", "llama3_json"])
    flags = tool_args(args.chat_template, args.tool_call_parser)
    assert flags == ("--chat-template", str(tmp_path / "t.jinja"),
                     "--tool-call-parser", "llama3_json")
    settings = load_settings([*flags, "--model", "m"], env={})
    assert settings.chat_template == str(tmp_path / "t.jinja")
    assert settings.tool_call_parser == "llama3_json"
    assert tool_args("", "") == ()


def test_an_unknown_parser_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(SettingsError, match="tool_call_parser: 'pythonic' is not one of "
                                            "hermes, qwen3, llama3_json"):
        load_settings(["--tool-call-parser", "pythonic"], env={})
