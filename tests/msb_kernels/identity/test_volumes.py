"""A person's directory of the shared volume (identity/volumes.py): ``<volume>/<their key>``, made theirs alone as
their registry ids, whatever the volume's owner and mode; an earlier version's directory of their name moved under the
key and made theirs, walked without ever following or opening a link, even one swapped in during the walk."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import pytest

from msb_kernels.identity.people import Owner
from msb_kernels.identity.person_registry import PERSON_IDS, Ids, PersonRegistry, person_key
from msb_kernels.identity.volumes import WHOLE_VOLUME, docker_volume, make_own, opened, own_volume
from tests.host_users import host_user
from tests.parallel import HOST_USERS

pytestmark = HOST_USERS
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a person's own host ids need a root gateway: run the suite as root")


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    root = tmp_path / "shared"
    root.mkdir(mode=0o755)  # as an operator makes it
    return root


@pytest.fixture
def registry(tmp_path: Path, volume: Path) -> PersonRegistry:
    return PersonRegistry(tmp_path / "state", [volume])


@as_root
def test_each_person_gets_a_directory_under_their_key_as_their_own_ids(volume, registry):
    alice, bob = registry.get(Owner("users-file", "alice")), registry.get(Owner("users-file", "bob"))
    assert own_volume(volume, alice, registry) == volume / alice.key and own_volume(volume, bob, registry) == volume / bob.key
    for person in (alice, bob):
        st = (volume / person.key).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (person.own.uid, person.own.gid, 0o700)
    assert alice.own.uid != bob.own.uid
    assert volume.stat().st_uid == 0 and volume.stat().st_mode & 0o777 == 0o755  # the volume itself is left as it was


@as_root
def test_a_name_like_a_login_keeps_its_files_as_its_own_ids_unless_declared(volume, tmp_path):
    with host_user("msbtperson", uid=59123) as account:
        registry = PersonRegistry(tmp_path / "state", [volume])
        undeclared = registry.get(Owner("users-file", "msbtperson"))
        own = own_volume(volume, undeclared, registry)
        assert own.stat().st_uid in PERSON_IDS and own.stat().st_uid != account.pw_uid  # never the login's
        registry = PersonRegistry(tmp_path / "state", [volume], accounts="users-file")
        own = own_volume(volume, registry.get(Owner("users-file", "msbtperson")), registry)
        assert (own.stat().st_uid, own.stat().st_gid) == (account.pw_uid, account.pw_gid)


@as_root
def test_an_earlier_versions_directory_moves_under_the_key_and_becomes_the_persons_without_following_links(volume, registry, tmp_path):
    old = volume / "bob%2B12%40x"  # Person.slug's name for bob+12@x
    (old / ".python").mkdir(parents=True)
    (old / ".python" / "pkg.py").write_text("x = 1\n")
    os.chown(old / ".python" / "pkg.py", 2_000_000_005, 2_000_000_000)  # what one of its sandboxes wrote
    outside = tmp_path / "host-file"
    outside.write_text("the host's\n")
    (old / "link").symlink_to(outside)
    os.link(outside, old / "hard")  # a file of someone else's, linked in: left as it is
    os.chown(old, 1_000_777_002, 1_000_777_002)  # the id the earlier version chose for this directory
    person = registry.get(Owner("users-file", "bob+12@x"))
    own = own_volume(volume, person, registry)
    assert own == volume / person.key and not os.path.lexists(old)
    for path in (own, own / ".python", own / ".python" / "pkg.py", own / "link"):
        assert path.lstat().st_uid == person.own.uid, path
    assert outside.stat().st_uid == 0  # neither the link nor the hard link gave it away


@as_root
def test_a_name_never_takes_another_persons_directory_nor_the_operators(volume, registry):
    """A name that is another person's key, or the name of a directory of root's (an operator's) at the volume's top:
    neither is moved nor given away; the person named so gets a new directory of their own."""
    bob = registry.get(Owner("users-file", "bob"))
    own_volume(volume, bob, registry)
    (volume / bob.key / "secret.txt").write_text("bob's\n")
    os.chown(volume / bob.key / "secret.txt", bob.own.uid, bob.own.gid)  # what his kernel wrote
    (volume / "teamdata").mkdir()
    (volume / "teamdata" / "data.txt").write_text("the operator's\n")
    for name in (bob.key, "teamdata"):
        thief = registry.get(Owner("users-file", name))
        assert os.listdir(own_volume(volume, thief, registry)) == []
    assert (volume / bob.key / "secret.txt").read_text() == "bob's\n" and (volume / bob.key / "secret.txt").stat().st_uid == bob.own.uid
    assert (volume / "teamdata" / "data.txt").stat().st_uid == 0


IN_OPEN, IN_NONBLOCK = 0x20, os.O_NONBLOCK  # inotify(7)


@as_root
def test_a_link_swapped_in_during_the_walk_is_never_opened_nor_followed(volume, tmp_path):
    """A directory of the person's is swapped for a link to a host directory, back and forth, while the walk runs 300
    times: inotify says whether root ever opened the host directory, and its owner whether anything there changed."""
    host = tmp_path / "host-dir"
    host.mkdir()
    (host / "file").write_text("the host's\n")
    own = volume / "person"
    (own / "sub" / "deeper").mkdir(parents=True)
    libc = ctypes.CDLL(None, use_errno=True)
    watch = libc.inotify_init1(IN_NONBLOCK)
    assert watch >= 0 and libc.inotify_add_watch(watch, str(host).encode(), IN_OPEN) >= 0
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.rename(own / "sub", own / "sub.real")
            os.symlink(host, own / "sub")
            os.unlink(own / "sub")
            os.rename(own / "sub.real", own / "sub")

    racer = threading.Thread(target=swap)
    racer.start()
    try:
        with opened(volume) as parent:
            for round in range(300):
                make_own(parent, "person", Ids(PERSON_IDS.start + 7 + round % 2, PERSON_IDS.start + 7))
    finally:
        stop.set()
        racer.join()
    try:
        events = os.read(watch, 4096)
    except BlockingIOError:
        events = b""
    finally:
        os.close(watch)
    assert events == b"", "root opened the host directory through a swapped-in link"
    assert host.stat().st_uid == 0 and (host / "file").stat().st_uid == 0


def test_each_persons_docker_volume_is_named_by_their_key():
    """On a cluster (MSB_SHARED_VOLUME_NAME=msb-shared): the whole volume, and a person's own by their key."""
    assert docker_volume("msb-shared", WHOLE_VOLUME) == "msb-shared"
    key = person_key(Owner("hub", "ré:x"))
    assert docker_volume("msb-shared", key) == f"msb-shared-{key}" and key.startswith("hub-r__x-")
