"""A pass over every session lets the gateway's other requests in as it goes."""

from __future__ import annotations

import asyncio

from msb_kernels.jupyter.turns import SESSIONS_PER_TURN, in_turns


async def test_a_pass_over_many_sessions_lets_another_task_run_every_turn() -> None:
    seen: list[tuple[int, int]] = []  # (step of the pass, turns the other task had by then)
    turns = 0

    async def other_request() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_request())
    await asyncio.sleep(0)
    async for step in in_turns(range(3 * SESSIONS_PER_TURN)):
        seen.append((step, turns))
    other.cancel()
    assert [step for step, _ in seen] == list(range(3 * SESSIONS_PER_TURN))
    # Within a turn the pass keeps the loop; between turns the other task runs once.
    assert [had for step, had in seen if step % SESSIONS_PER_TURN == 0] == [1, 2, 3]
    assert all(had == seen[step - step % SESSIONS_PER_TURN][1] for step, had in seen)
