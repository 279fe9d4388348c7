"""Names that met before (issue 53), through a real JupyterHub (its HubAuth) with a users file beside it.

``ann 2024`` and ``ann\u202024``, and ``bob+12@x`` and ``bob\u2b12@x``, shared one directory under the earlier escape;
a Hub person and a users-file person both named ``ann`` shared one volume directory and one Lab root. Here each is a
person of their own: their kernels (started over MCP, as an assistant's are) write into their own volume and Lab
root, see nothing of the others', and each person's files are one host id that no other person has.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import TEST_BASE
from tests.hub import Hub, launch_hub
from tests.msb_kernels.gateway.conftest import add_user, registered
from tests.skips import needs_hub

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    needs_hub,
    pytest.mark.skipif(os.geteuid() != 0, reason="people's own host ids need root"),
]
HUB_PEOPLE = ("ann 2024", "ann\u202024", "bob+12@x", "bob\u2b12@x", "ann")
PROBE = """
import json, os
before = {{n: open("/shared/" + n).read() for n in os.listdir("/shared") if os.path.isfile("/shared/" + n)}}
open("/shared/mine.txt", "w").write({who!r})
open(os.path.join({root!r}, "mine.txt"), "w").write({who!r})
print(json.dumps({{"before": before, "labs": sorted(os.listdir({labs!r}))}}))
"""


@pytest.fixture(scope="module")
async def hub_and_file() -> AsyncIterator[tuple[Hub, str, Path]]:
    """The Hub's five people, and a users file beside it with its own ann (her token too)."""
    shared = TEST_BASE / "hub-names-shared"
    shared.mkdir(mode=0o755)
    users_file = TEST_BASE / "hub-names-users.json"
    file_ann = add_user(users_file, "ann")
    server = await launch_hub(users=HUB_PEOPLE, env={"MSB_USERS_FILE": str(users_file), "MSB_SHARED_VOLUME_PATH": str(shared)})
    yield server, file_ann, shared
    server.stop()


async def run_as(server: Hub, token: str, who: str) -> dict | str:
    """Over MCP through the Hub's proxy, as an assistant of ``who``: a session, the probe; its output or its refusal."""
    labs = server.state_dir / "home"
    async with server.mcp(token) as client:
        started = await client.call_tool("start_session", {})
        if started.is_error:
            return started.structured_content["error"]["message"]
        (session,) = [s["id"] for s in started.structured_content["sessions"]]
        ran = await client.call_tool(
            "execute_code", {"session_id": session, "code": PROBE.format(who=who, root=str(labs / who), labs=str(labs))}
        )
        assert not ran.is_error, ran.structured_content
        await client.call_tool("stop_session", {"session_id": session})
        return json.loads(ran.structured_content["stdout"])


async def test_names_that_shared_a_directory_before_are_people_of_their_own(hub_and_file) -> None:
    server, file_ann, shared = hub_and_file
    seen = {}
    for who in HUB_PEOPLE:
        seen[who] = await run_as(server, await server.token_for(who), who)
        assert isinstance(seen[who], dict), (who, seen[who])
        # Their volume held nothing of anyone else's before they wrote; their Lab roots' parent shows only their own.
        assert seen[who]["before"] == {}, (who, seen[who])
        assert seen[who]["labs"] == [who], (who, seen[who])
    people = [registered(who, "hub") for who in HUB_PEOPLE]
    assert len({p.key for p in people}) == len({p.own.uid for p in people}) == len(HUB_PEOPLE)
    for person in people:
        volume, root = shared / person.key, server.state_dir / "home" / person.owner.name
        assert (volume / "mine.txt").read_text() == (root / "mine.txt").read_text() == person.owner.name
        assert {volume.stat().st_uid, (volume / "mine.txt").stat().st_uid, root.stat().st_uid} == {person.own.uid}

    # The users file's ann is not the Hub's: her Lab root would be the Hub ann's, so her start is refused, naming why,
    # and nothing of the Hub ann's is read or changed.
    refused = await run_as(server, file_ann, "ann")
    assert isinstance(refused, str) and "MSB_LAB_ROOT_PATH" in refused and "not theirs" in refused, refused
    hub_ann = registered("ann", "hub")
    assert (shared / hub_ann.key / "mine.txt").read_text() == "ann"
    file_ann_volume = shared / registered("ann").key
    assert file_ann_volume != shared / hub_ann.key and not (file_ann_volume / "mine.txt").exists()
