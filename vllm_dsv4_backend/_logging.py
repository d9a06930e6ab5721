# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Route ``vllm_dsv4_backend.*`` log records through vLLM's handlers.

vLLM configures only the ``vllm`` logger (its own handler, format and level,
``propagate=False``); a logger named ``vllm_dsv4_backend.x`` sits outside that
tree and would reach only Python's last-resort stderr handler (WARNING and
up, unformatted). :func:`attach_to_vllm` gives the package logger one
forwarding handler that hands each record to the *current* handlers of the
``vllm`` logger and filters by that logger's *current* level, so our lines
look like vLLM's (``(EngineCore pid=…) INFO …``) and follow
``VLLM_LOGGING_LEVEL``, even if vLLM re-configures logging later in a
process. With vLLM logging disabled (``VLLM_CONFIGURE_LOGGING=0``, no handlers
on ``vllm``) records go to the root logger's handlers instead.

Use :func:`init_logger` everywhere in the package (``%s`` formatting, no
f-strings); it never imports vLLM.
"""

from __future__ import annotations

import logging
from collections import deque

__all__ = ["PACKAGE_LOGGER", "attach_to_vllm", "init_logger"]

PACKAGE_LOGGER = "vllm_dsv4_backend"
_MAX_PENDING = 64


class _ForwardToVllm(logging.Handler):
    """Hands records to the ``vllm`` logger's handlers at emit time.

    Records emitted before any handler exists (the API server loads plugins
    while parsing arguments, before vLLM configures logging) are kept (at most
    :data:`_MAX_PENDING`) and replayed once vLLM has configured its handlers.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.NOTSET)
        self.name = "vllm_dsv4_backend->vllm"
        self._pending: deque[logging.LogRecord] = deque(maxlen=_MAX_PENDING)

    @staticmethod
    def _target() -> logging.Logger | None:
        for name in ("vllm", None):
            lg = logging.getLogger(name)
            if lg.handlers:
                return lg
        return None

    def _deliver(self, target: logging.Logger, record: logging.LogRecord) -> None:
        if record.levelno < target.getEffectiveLevel():
            return
        if not hasattr(record, "vllm_process_name"):
            # Created before vLLM installed its record factory.
            record.vllm_process_name = record.processName
        for handler in target.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)

    def flush_pending(self) -> None:
        target = self._target()
        if target is None:
            return
        while self._pending:
            self._deliver(target, self._pending.popleft())

    def emit(self, record: logging.LogRecord) -> None:
        target = self._target()
        if target is None:
            self._pending.append(record)
            return
        self.flush_pending()
        self._deliver(target, record)


def init_logger(name: str) -> logging.Logger:
    """Logger ``name`` inside the ``vllm_dsv4_backend`` tree."""
    if name != PACKAGE_LOGGER and not name.startswith(PACKAGE_LOGGER + "."):
        name = f"{PACKAGE_LOGGER}.{name}"
    return logging.getLogger(name)


def attach_to_vllm() -> None:
    """Install the forwarding handler on the package logger (idempotent).

    Also makes ``vllm.logger.configure_logging`` replay records logged before
    vLLM configured its handlers (when that function exists).
    """
    pkg = logging.getLogger(PACKAGE_LOGGER)
    if any(isinstance(h, _ForwardToVllm) for h in pkg.handlers):
        return
    handler = _ForwardToVllm()
    pkg.addHandler(handler)
    # Level filtering happens in the handler against vLLM's live level, so the
    # package logger itself lets everything through to it.
    pkg.setLevel(logging.DEBUG)
    pkg.propagate = False
    try:
        import vllm.logger as vllm_logger
    except ImportError:
        return
    configure = getattr(vllm_logger, "configure_logging", None)
    if callable(configure) and not getattr(configure, "_vllm_dsv4_flush", False):

        def configure_logging(*args, **kwargs):
            result = configure(*args, **kwargs)
            handler.flush_pending()
            return result

        configure_logging._vllm_dsv4_flush = True  # type: ignore[attr-defined]
        vllm_logger.configure_logging = configure_logging
