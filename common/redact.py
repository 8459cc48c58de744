"""Keeping secrets out of logs and error messages: URL passwords become ``***``.

``redact_url`` is for a URL we are about to log or put in an error (``redis://:***@host:port``:
the reader still sees that a password is configured, and where the store is). ``redact_text``
does the same to every URL inside free text (an exception message, a config dump), and
``RedactingFilter`` applies it to log records, for libraries that log URLs themselves (LMCache
logs its remote URL, password included, at INFO).

This module must never log, never talk to the network and never import torch: both the router
and the workers import it.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# scheme://[user]:password@  -- RFC 3986 userinfo holds no '/', '?', '#' or '@' unencoded; a
# match never spans whitespace or a quote either (a URL inside a repr).
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/?#@'\"]*):[^\s/?#@'\"]*@")
# ?password=... or &password=... (redis-py also reads the password from the query string)
_QUERY_SECRET = re.compile(r"(?P<head>[?&](?:password|passwd|pwd|token)=)[^&\s'\"]*", re.I)


def redact_url(url: str) -> str:
    """``url`` with its password (userinfo or ``password=`` query field) replaced by ``***``;
    the user name, host, port, path and other query fields are kept."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        name = user.partition(":")[0]
        netloc = f"{name}:{MASK}@{host}"
    query = _QUERY_SECRET.sub(lambda m: m.group("head") + MASK, "?" + parts.query)[1:]
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def public_url(url: str) -> str:
    """``url`` with user, password and query removed: safe to log or send to a peer."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    text = _USERINFO.sub(lambda m: f"{m.group('head')}:{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: m.group("head") + MASK, text)


class RedactingFilter(logging.Filter):
    """A logging filter that rewrites each record's message (and traceback) through
    ``redact_text``; it never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True


def redact_logger(logger: logging.Logger) -> None:
    """Install one ``RedactingFilter`` on ``logger`` (idempotent). A filter on a logger sees
    only records logged through that very logger, which is what libraries whose loggers do not
    propagate (LMCache) need."""
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())
