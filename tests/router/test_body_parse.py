"""The off-loop body parser: the same model or the same errors as FastAPI's own path, and a
child that never outlives the router (killed with SIGKILL, it runs no shutdown)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fastapi.exceptions import RequestValidationError

from router.body_parse import BodyParser
from router.schemas import ChatCompletionRequest, CompletionRequest, InvalidText

REPO = Path(__file__).resolve().parents[2]


async def test_the_child_answers_as_fastapi_would() -> None:
    parser = BodyParser(1)
    try:
        got = await parser.parse(CompletionRequest, b'{"prompt": [1, 2, 3], "max_tokens": 2}')
        assert isinstance(got, CompletionRequest) and got.prompt == [1, 2, 3]
        with pytest.raises(RequestValidationError) as info:
            await parser.parse(CompletionRequest, b'{"prompt": [1, true], "max_tokens": 2}')
        assert all(e["loc"][0] == "body" for e in info.value.errors())
        with pytest.raises(RequestValidationError) as info:
            await parser.parse(ChatCompletionRequest,
                               b'{"messages": [{"role": "user", "content": "a\\ud800"}]}')
        causes = [(e.get("ctx") or {}).get("error") for e in info.value.errors()]
        assert any(isinstance(c, InvalidText) and c.param == "messages[0].content"
                   for c in causes), info.value.errors()
        with pytest.raises(RequestValidationError) as info:
            await parser.parse(CompletionRequest, b'{"prompt": [1, ')
        assert info.value.errors()[0]["type"] == "json_invalid"
    finally:
        parser.close()


def test_the_child_exits_with_a_killed_router(tmp_path: Path) -> None:
    script = tmp_path / "router_like.py"
    script.write_text(textwrap.dedent("""
        import asyncio, os, sys
        from router.body_parse import BodyParser
        from router.schemas import CompletionRequest

        async def main():
            parser = BodyParser(1)
            await parser.parse(CompletionRequest, b'{"prompt": "x"}')
            print(*[p.pid for p in parser._pool._processes.values()], flush=True)
            await asyncio.sleep(60)

        if __name__ == "__main__":
            asyncio.run(main())
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    child = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the parser's child outlived its killed parent")
