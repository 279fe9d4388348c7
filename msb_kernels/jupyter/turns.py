"""Passes over every session that take turns with the gateway's other requests.

A step of such a pass that awaits nothing (a kernel that is not idle, for the culler; a session's description, for
get_sessions: some 0.2 ms each) keeps the event loop, so a pass over a thousand sessions held every other request of
the gateway for 200 ms and more (bench/scale.py). in_turns lets them in every SESSIONS_PER_TURN steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

SESSIONS_PER_TURN = 50

T = TypeVar("T")


async def in_turns(items: Iterable[T]) -> AsyncIterator[T]:
    """items, yielding to the event loop before every SESSIONS_PER_TURN-th after the first."""
    for number, item in enumerate(items):
        if number and number % SESSIONS_PER_TURN == 0:
            await asyncio.sleep(0)
        yield item
