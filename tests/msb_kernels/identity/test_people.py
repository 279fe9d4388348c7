"""Who may see a kernel, and the users file: the one rule and the one store, without a gateway."""

from __future__ import annotations

import asyncio
import json

import pytest

from msb_kernels.errors import ConfigError
from msb_kernels.identity import users_file
from msb_kernels.identity.people import SYSTEM, Person, acting, acting_as, may_see
from msb_kernels.identity.tokens import Tokens
from msb_kernels.identity.users_file import Entry, new_token, token_digest
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process


def test_a_person_sees_their_own_kernels_an_admin_and_the_system_every_one_and_nobody_none():
    alice, bob, ops = Person("alice", source="users-file"), Person("bob", source="users-file"), Person("ops", admin=True)
    assert may_see(alice, alice.owner) and not may_see(alice, bob.owner) and not may_see(alice, None)
    assert may_see(ops, bob.owner) and may_see(ops, None)
    assert may_see(SYSTEM, bob.owner) and may_see(SYSTEM, None)  # the system, said explicitly: the culler, the pool, adoption
    # Nobody (a path that forgot to say who it acts for) sees nothing: it fails closed, never as an admin.
    assert not may_see(None, bob.owner) and not may_see(None, None)
    # An owner is the source and the name together: the single token's person named after the login user, a
    # users-file person and a Hub person of that name are three owners.
    token_root, file_root, hub_root = (Person("root", source=source) for source in ("token", "users-file", "hub"))
    assert len({token_root.owner, file_root.owner, hub_root.owner}) == 3
    assert not may_see(file_root, token_root.owner) and not may_see(hub_root, file_root.owner)
    # A users-file person named "system" is not the system.
    assert not Person("system", source="users-file").is_system and not may_see(Person("system", source="users-file"), alice.owner)
    assert acting() is None  # nobody, unless someone says who acts
    with acting_as(bob):
        assert acting() is bob
        with acting_as(None):
            assert acting() is None
        assert acting() is bob
    assert acting() is None


async def test_tokens_become_people_from_the_single_token_and_the_users_file(tmp_path):
    path = tmp_path / "users.json"
    alice_token, ops_token = new_token(), new_token()
    users_file.write(path, {"alice": Entry("alice", token_digest(alice_token)), "ops": Entry("ops", token_digest(ops_token), admin=True)})
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert alice_token not in path.read_text()  # only the digest is kept
    tokens = Tokens(single="one-token", users_file=path)
    assert await tokens.person("one-token") == Person(tokens.single_person.name, admin=True, source="token")
    assert await tokens.person(alice_token) == Person("alice", False, "users-file")
    assert (await tokens.person(ops_token)).admin
    assert await tokens.person("nobody's") is None and await tokens.person("") is None and await tokens.person(None) is None
    # The file changes under a running gateway: the next request sees it.
    users_file.write(path, {"ops": Entry("ops", token_digest(ops_token), admin=True)})
    await asyncio.sleep(0.01)
    assert await tokens.person(alice_token) is None


def test_a_users_file_others_can_read_or_a_broken_one_is_refused_by_name(tmp_path):
    path = tmp_path / "users.json"
    path.write_text(json.dumps({"users": {}}))
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=f"chmod 600 {path}|0644"):
        users_file.read(path)
    path.chmod(0o600)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        users_file.read(path)
    path.write_text(json.dumps({"users": {"alice": {"token_sha256": "short"}}}))
    with pytest.raises(ConfigError, match="'alice' is malformed"):
        users_file.read(path)


def test_a_users_file_name_is_one_line_of_the_allowed_characters():
    """A trailing newline passed "$" (`users add $'vbob\\n'`): a look-alike of vbob that `users list` printed as vbob."""
    from msb_kernels.errors import InvalidRequest
    from msb_kernels.identity.users_file import check_name

    assert check_name("alice.b+1@x") == "alice.b+1@x"
    for name in ("vbob\n", "vbob\r", "\nvbob", "a b", "b\u043eb", ".", "a/b"):
        with pytest.raises(InvalidRequest, match="is not a user name here"):
            check_name(name)
