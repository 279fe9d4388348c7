"""Log lines of jupyter_server and tornado that say nothing an operator can act on, dropped in every server of ours:
the gateway (``msb-kernels serve``) and each JupyterLab in front of it (msb_kernels.jupyterlab)."""

from __future__ import annotations

import logging


def _not_the_ping_unit_clash(record: logging.LogRecord) -> bool:
    """Drop tornado's "websocket_ping_timeout (90000) cannot be longer than the websocket_ping_interval (30000)",
    which every kernel connect printed about settings no operator set. jupyter_server's WebSocketMixin answers
    tornado's ping_interval and ping_timeout with its own keepalive's milliseconds (30000, 90000), where tornado 6.5
    reads seconds (jupyter_server issue 1612): tornado's own ping would come every 30000 s, so its clamp of the timeout
    changes nothing, while the mixin's timer pings every 30 s and closes a socket silent for 90 s, as meant. Setting
    the timeout to the interval instead would have that timer close sockets that answer a little late."""
    return not str(record.msg).startswith("The websocket_ping_timeout (")


def quiet_the_ping_unit_clash() -> None:
    """Install the filter above on tornado's logger, once however often called."""
    logger = logging.getLogger("tornado.general")
    if _not_the_ping_unit_clash not in logger.filters:
        logger.addFilter(_not_the_ping_unit_clash)
