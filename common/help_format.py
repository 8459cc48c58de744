"""The argparse help formatter of every ``bulkhead`` command that builds its own parser.

`--help` shows every option's default, as vLLM's does, so nobody reads the source to learn what
they get without a flag. Torch-free and stateless: any package may use it.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default; a required option says so instead of `default: None`,
    and an empty-string default shows as '' rather than nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required:
            return f"{action.help or ''} (required)"
        if action.default == "" and action.help:
            return f"{action.help} (default: '')"
        return super()._get_help_string(action)
