"""common/redact.py: URL passwords never reach a log line or an error message."""

from __future__ import annotations

import logging

import pytest

from common.redact import redact_logger, redact_text, redact_url


@pytest.mark.parametrize("url, expected", [
    ("redis://:s3cret@cache:6379", "redis://:***@cache:6379"),
    ("rediss://bob:s3cret@cache:6380/2?ssl_ca_certs=/etc/ca.pem",
     "rediss://bob:***@cache:6380/2?ssl_ca_certs=/etc/ca.pem"),
    ("redis://cache:6379/0?password=s3cret&db=1", "redis://cache:6379/0?password=***&db=1"),
    ("redis://bob@cache:6379", "redis://bob@cache:6379"),  # a user name is no secret
    ("lm://127.0.0.1:65432", "lm://127.0.0.1:65432"),
])
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_redact_text_finds_urls_anywhere() -> None:
    text = ("config {'remote_url': 'redis://:s3cret@h:1', 'x': \"rediss://u:p4ss@h2:2/0\"} "
            "then http://h:80/path?q=1 and redis://h:3")
    out = redact_text(text)
    assert "s3cret" not in out and "p4ss" not in out
    assert "'redis://:***@h:1'" in out and '"rediss://u:***@h2:2/0"' in out
    assert "http://h:80/path?q=1" in out and "redis://h:3" in out  # nothing else changes


def test_filter_masks_messages_args_and_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.redact.lib")
    redact_logger(logger)
    redact_logger(logger)  # idempotent
    assert len(logger.filters) == 1
    with caplog.at_level(logging.DEBUG, logger="tests.redact.lib"):
        logger.info("connecting to %s", "redis://:s3cret@h:1")
        try:
            raise ValueError("bad url redis://u:s3cret@h:2")
        except ValueError:
            logger.exception("failed")
    text = caplog.text
    assert "redis://:***@h:1" in text and "redis://u:***@h:2" in text
    assert "s3cret" not in text
