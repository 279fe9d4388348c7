"""The process limits a msb-kernels process lifts for MSB_MAX_SESSIONS (limits.py): ZeroMQ's sockets per context, and
the open-file limit; and the refusal that names them when they run out all the same. The gateway's start is
tests/msb_kernels/gateway/test_lifecycle.py's."""

from __future__ import annotations

import errno

import pytest

from msb_kernels.provisioning.limits import ZMQ_DEFAULT_MAX_SOCKETS, files_needed, over_limit, size_zmq_context, zmq_max_sockets
from tests.conftest import soft_open_files

PAST_THE_DEFAULT = 1100  # ZeroMQ sockets: about what 500 idle kernels hold in the gateway's context


def test_a_context_sized_for_the_sessions_opens_sockets_past_zeromqs_default() -> None:
    import zmq
    import zmq.asyncio

    default, sized = zmq.Context(), zmq.asyncio.Context()
    opened: list = []
    try:
        with soft_open_files(4 * PAST_THE_DEFAULT):  # a socket's mailbox is a descriptor
            assert size_zmq_context(sized, 1000) == zmq_max_sockets(1000) >= 10 * ZMQ_DEFAULT_MAX_SOCKETS
            with pytest.raises(zmq.ZMQError) as refused:
                while len(opened) < PAST_THE_DEFAULT:
                    opened.append(default.socket(zmq.DEALER))
            assert refused.value.errno == errno.EMFILE and len(opened) <= ZMQ_DEFAULT_MAX_SOCKETS
            for socket in opened:
                socket.close(linger=0)
            opened = [sized.socket(zmq.DEALER) for _ in range(PAST_THE_DEFAULT)]
    finally:
        for socket in opened:
            socket.close(linger=0)
        default.term()
        sized.term()

    # What a start that met this EMFILE answers: the limits by name and what moves them, not the ZMQError.
    refusal = over_limit(refused.value, 1000, ZMQ_DEFAULT_MAX_SOCKETS)
    assert refusal is not None and refusal.limit == "open_files", refusal
    assert f"MAX_SOCKETS={ZMQ_DEFAULT_MAX_SOCKETS}" in refusal.message and "RLIMIT_NOFILE=" in refusal.message
    assert any(f"LimitNOFILE={files_needed(1000)}" in s for s in refusal.suggestions), refusal.suggestions
    assert over_limit(RuntimeError("the kernel died"), 1000, 1023) is None
