"""`bulkhead router`: parse settings, then serve the app with uvicorn on uvloop until SIGINT/SIGTERM.

uvicorn handles the signals: it stops accepting, lets running requests finish for up to
`GRACEFUL_SHUTDOWN_S`, then runs the app's lifespan shutdown (background Aborts, channels).  This
module must never import torch and never hold state at module level.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence

import uvicorn
import uvloop

from router.app import create_app
from router.http_protocol import EdgeH11Protocol
from router.settings import RouterSettings, SettingsError, load_settings

GRACEFUL_SHUTDOWN_S = 10


async def serve(settings: RouterSettings) -> bool:
    """Serve until a shutdown signal; False if the app failed to start."""
    # h11, not httptools: h11 bounds the request head it buffers (431 past max_header_bytes,
    # router/http_protocol.py), httptools accepts headers of any size
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            loop="none", lifespan="on", log_level=settings.log_level.lower(),
                            http=EdgeH11Protocol,
                            h11_max_incomplete_event_size=settings.max_header_bytes,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False)
    server = uvicorn.Server(config)
    await server.serve()
    return server.started


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv)
    except SettingsError as exc:
        print(f"bulkhead router: {exc}", file=sys.stderr)
        return 2
    if not settings.model:
        from common.default_model import DefaultModelMissing, default_model_path

        try:
            settings = dataclasses.replace(settings, model=str(default_model_path()))
        except DefaultModelMissing as exc:
            print(f"bulkhead router: no --model given and {exc}", file=sys.stderr)
            return 2
    if not settings.decode_workers and not settings.registry_url:
        print("bulkhead router: at least one --decode worker (env BULKHEAD_DECODE_WORKERS) or a "
              "--registry-url (env BULKHEAD_REGISTRY_URL) is required", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = uvloop.run(serve(settings))
    return 0 if started else 1


if __name__ == "__main__":
    sys.exit(main())
