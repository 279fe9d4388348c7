"""A person's directory of the shared volume (identity/volumes.py): made theirs alone, whatever the volume's owner and
mode, kept as the same host ids from then on, and taken over from an earlier version without following a link."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

from msb_kernels.identity.people import Person
from msb_kernels.identity.volumes import PERSON_IDS, WHOLE_VOLUME, docker_volume, volume_for

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a person's own host ids need a root gateway: run the suite as root")


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    root = tmp_path / "shared"
    root.mkdir(mode=0o755)  # as an operator makes it
    return root


@as_root
def test_each_person_gets_a_directory_of_their_own_ids_kept_from_then_on(volume):
    alice, bob = volume_for(volume, "alice"), volume_for(volume, "bob")
    assert alice == volume / "alice" and bob == volume / "bob"
    for own in (alice, bob):
        st = own.stat()
        assert st.st_uid in PERSON_IDS and st.st_gid == st.st_uid and st.st_mode & 0o777 == 0o700, own
    assert alice.stat().st_uid != bob.stat().st_uid
    first = alice.stat().st_uid
    assert volume_for(volume, "alice").stat().st_uid == first  # the directory's owner is the record
    assert volume.stat().st_uid == 0 and volume.stat().st_mode & 0o777 == 0o755  # the volume itself is left as it was


@as_root
def test_a_person_with_a_host_account_keeps_their_files_as_that_account(volume):
    name = "msbtperson"
    subprocess.run(["userdel", name], capture_output=True)
    subprocess.run(["useradd", "--no-create-home", "--uid", "59123", "--user-group", name], check=True, capture_output=True)
    try:
        own = volume_for(volume, name)
        account = pwd.getpwnam(name)
        assert (own.stat().st_uid, own.stat().st_gid) == (account.pw_uid, account.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)
    # nobody (65534) is an account, but never a person's
    assert volume_for(volume, "nobody").stat().st_uid in PERSON_IDS


@as_root
def test_a_directory_an_earlier_version_made_as_root_becomes_the_persons_without_following_links(volume, tmp_path):
    old = volume / "alice"
    (old / ".python").mkdir(parents=True)
    (old / ".python" / "pkg.py").write_text("x = 1\n")
    os.chown(old / ".python" / "pkg.py", 2_000_000_005, 2_000_000_000)  # what one of its sandboxes wrote
    outside = tmp_path / "host-file"
    outside.write_text("the host's\n")
    (old / "link").symlink_to(outside)
    own = volume_for(volume, "alice")
    uid = own.stat().st_uid
    assert uid in PERSON_IDS
    for path in (own, own / ".python", own / ".python" / "pkg.py", own / "link"):
        assert path.lstat().st_uid == uid, path
    assert outside.stat().st_uid == 0  # the link was not followed


def test_each_persons_docker_volume_is_theirs_and_no_two_names_share_one():
    """On a cluster (MSB_SHARED_VOLUME_NAME=msb-shared): the whole volume, a person's own by name, and one whose slug
    Docker's names cannot hold, in hex after a second dash, which no plain name (it starts with a letter or digit) has."""
    assert docker_volume("msb-shared", WHOLE_VOLUME) == "msb-shared"
    assert docker_volume("msb-shared", "alice") == "msb-shared-alice"
    odd = Person("ré:x", source="hub").slug
    assert docker_volume("msb-shared", odd) == "msb-shared--" + odd.encode().hex()
    names = {docker_volume("msb-shared", Person(name, source="hub").slug) for name in ("a", "A", "a.b", "a%b", "a:b", "-a", "x2d61")}
    assert len(names) == 7
