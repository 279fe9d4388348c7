"""A person is an id, not a name (identity/person_registry.py, issue 53): each (source, name) gets a key and host ids
of the gateway's own, kept, never shared, never a login's unless the operator declares that names are logins."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msb_kernels.errors import ConfigError
from msb_kernels.identity.people import SOURCES, Owner
from msb_kernels.identity.person_registry import PERSON_IDS, PersonRegistry, legacy_slug, person_key
from msb_kernels.identity.volumes import docker_volume
from tests.conftest import TEST_BASE
from tests.host_users import host_user
from tests.parallel import HOST_USERS

pytestmark = HOST_USERS
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="useradd and other owners' ids need root: run the suite as root")
DOCKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # what Docker accepts as a volume's name
owners = st.builds(Owner, st.sampled_from(SOURCES), st.text(min_size=0, max_size=40))


@settings(max_examples=400, deadline=None)
@given(owners, owners)
def test_distinct_people_never_share_a_key_a_directory_or_a_docker_volume(first: Owner, second: Owner) -> None:
    keys = person_key(first), person_key(second)
    for key in keys:
        assert "/" not in key and key not in (".", "..") and "\0" not in key
        assert DOCKER_NAME.match(docker_volume("msb-shared", key)), key
    if first != second:
        assert keys[0] != keys[1]
        assert docker_volume("msb-shared", keys[0]) != docker_volume("msb-shared", keys[1])


PROPERTY_REGISTRY = PersonRegistry(TEST_BASE / "property-people")  # one for every example: a gateway's, over time


@settings(max_examples=150, deadline=None)
@given(owners, owners)
def test_distinct_people_never_share_host_ids_and_one_person_keeps_theirs(first: Owner, second: Owner) -> None:
    entries = PROPERTY_REGISTRY.get(first), PROPERTY_REGISTRY.get(second)
    assert all(entry.own.uid in PERSON_IDS and entry.own.gid == entry.own.uid for entry in entries)
    assert (entries[0].own == entries[1].own) == (first == second)
    assert PersonRegistry(PROPERTY_REGISTRY.state_dir).get(first) == entries[0]  # as a restarted gateway reads it


def test_the_names_whose_escapes_collided_and_one_name_from_two_sources_are_distinct_people() -> None:
    # Each pair shared one directory under the earlier escape (Person.slug) or under a name alone.
    assert legacy_slug("ann 2024") == legacy_slug("ann\u202024") and legacy_slug("bob+12@x") == legacy_slug("bob\u2b12@x")
    pairs = [
        (Owner("hub", "ann 2024"), Owner("hub", "ann\u202024")),
        (Owner("hub", "bob+12@x"), Owner("hub", "bob\u2b12@x")),
        (Owner("hub", "ann"), Owner("users-file", "ann")),
    ]
    for first, second in pairs:
        assert person_key(first) != person_key(second)


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path]:
    labs, shared = tmp_path / "labs", tmp_path / "shared"
    labs.mkdir()
    shared.mkdir()
    return labs, shared


@pytest.fixture
def registry(tmp_path: Path, places) -> PersonRegistry:
    return PersonRegistry(tmp_path / "state", places)


def test_each_person_gets_ids_of_their_own_kept_across_restarts_and_never_given_again(registry, tmp_path, places) -> None:
    people = [Owner("users-file", "ann"), Owner("hub", "ann"), Owner("hub", "ann 2024"), Owner("hub", "ann\u202024")]
    entries = [registry.get(owner) for owner in people]
    ids = [entry.own.uid for entry in entries]
    assert len(set(ids)) == len(ids) and all(uid in PERSON_IDS for uid in ids)
    assert all(entry.own.gid == entry.own.uid for entry in entries)
    assert len({entry.key for entry in entries}) == len(entries)
    # A gateway started again reads the same people back, and gives a newcomer none of their ids.
    again = PersonRegistry(tmp_path / "state", places)
    assert [again.get(owner) for owner in people] == entries
    assert again.get(Owner("hub", "newcomer")).own.uid not in ids
    assert (tmp_path / "state" / "people.json").stat().st_mode & 0o777 == 0o600


def test_two_gateways_registering_at_once_never_give_one_id_twice(tmp_path, places) -> None:
    """Two processes, each registering 30 people of its own into one state directory: 60 distinct ids."""
    code = (
        "import sys; from pathlib import Path\n"
        "from msb_kernels.identity.people import Owner\n"
        "from msb_kernels.identity.person_registry import PersonRegistry\n"
        "registry = PersonRegistry(Path(sys.argv[1]))\n"
        "print(' '.join(str(registry.get(Owner('hub', f'{sys.argv[2]}{n}')).own.uid) for n in range(30)))\n"
    )
    runs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "state"), who], stdout=subprocess.PIPE, text=True) for who in "ab"]
    uids = [int(uid) for run in runs for uid in run.communicate(timeout=60)[0].split()]
    assert len(uids) == 60 and len(set(uids)) == 60


@as_root
def test_an_id_the_host_database_names_or_a_stranger_owns_in_the_places_is_skipped(registry, places) -> None:
    labs, shared = places
    stranger = labs / "someone"
    stranger.mkdir()
    os.chown(stranger, PERSON_IDS.start, PERSON_IDS.start)  # a directory of the first id, left by someone else
    with host_user("msbtdbuser", uid=PERSON_IDS.start + 1):  # the host's database (as LDAP's range may) names the next
        uid = registry.get(Owner("users-file", "carol")).own.uid
    assert uid not in (PERSON_IDS.start, PERSON_IDS.start + 1)


@as_root
def test_a_name_is_a_login_only_where_the_operator_declares_that_source_logins(tmp_path, places) -> None:
    with host_user("msbtlogin", uid=59111):
        account = pwd.getpwnam("msbtlogin")
        undeclared = PersonRegistry(tmp_path / "state", places).get(Owner("users-file", "msbtlogin"))
        assert undeclared.ids.uid in PERSON_IDS and undeclared.ids.uid != account.pw_uid
        declared = PersonRegistry(tmp_path / "state", places, accounts="users-file")
        assert (declared.get(Owner("users-file", "msbtlogin")).ids.uid, declared.get(Owner("users-file", "msbtlogin")).ids.gid) == (
            account.pw_uid,
            account.pw_gid,
        )
        assert declared.get(Owner("hub", "msbtlogin")).ids.uid in PERSON_IDS  # another source: not declared
    with pytest.raises(ConfigError, match="MSB_HOST_ACCOUNTS=users-file") as refused:
        declared.get(Owner("users-file", "nobody"))  # an account, but never a person's
    assert "useradd" in refused.value.suggestions[0]
