"""A person's directory shown to a sandbox's user as its own (core/idmap.py), on real idmapped mounts, and a sandbox's
removal that never walks into one (iodir.remove)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from msb_kernels.backends.core import idmap, iodir
from msb_kernels.errors import SandboxError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="idmapped mounts need root: run the suite as root")

PERSON, SANDBOX, STRANGER = idmap.Owner(1_000_000_007, 1_000_000_007), idmap.Owner(2_000_900_001, 2_000_900_001), 5001


def as_sandbox(code: str, where: Path) -> subprocess.CompletedProcess:
    """code run as the sandbox's host uid, as its kernel runs, in where (its parents are root's alone, as a state dir's)."""
    return subprocess.run(
        ["setpriv", f"--reuid={SANDBOX.uid}", f"--regid={SANDBOX.gid}", "--clear-groups", sys.executable, "-I", "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=where,
    )


@pytest.fixture
def shown(tmp_path: Path):
    """A person's directory with one of their files and one of a stranger's, attached idmapped at tmp_path/shown."""
    own = tmp_path / "alice"
    own.mkdir(mode=0o700)
    (own / "theirs.txt").write_text("the person's\n")
    (own / "stranger.txt").write_text("not the person's\n")
    for path in (own, own / "theirs.txt"):
        os.chown(path, PERSON.uid, PERSON.gid)
    os.chown(own / "stranger.txt", STRANGER, STRANGER)
    os.chmod(own / "stranger.txt", 0o644)
    target = tmp_path / "state" / "volume"
    target.mkdir(parents=True)
    tree = idmap.detached(str(own), PERSON, SANDBOX)
    try:
        idmap.attach(tree, str(target))
    finally:
        os.close(tree)
    yield own, target
    iodir.detach(target)


def test_the_persons_files_are_the_sandboxs_and_what_it_writes_is_the_persons(shown):
    own, target = shown
    done = as_sandbox(
        "import os; t = '.'\n"
        "open(t + '/theirs.txt', 'a').write('edited\\n')\n"
        "open(t + '/new.txt', 'w').write('made\\n'); os.mkdir(t + '/sub')\n"
        "print(os.stat(t).st_uid, os.stat(t + '/stranger.txt').st_uid)\n"
        "try:\n    open(t + '/stranger.txt', 'a')\nexcept PermissionError:\n    print('refused')\n",
        target,
    )
    assert done.returncode == 0, done.stderr
    seen_owner, stranger_seen, refused = done.stdout.split()
    assert int(seen_owner) == SANDBOX.uid and int(stranger_seen) == 65534 and refused == "refused", done.stdout
    assert (own / "theirs.txt").read_text() == "the person's\nedited\n"
    for name in ("theirs.txt", "new.txt", "sub"):
        assert (own / name).stat().st_uid == PERSON.uid and (own / name).stat().st_gid == PERSON.gid, name
    assert (own / "stranger.txt").stat().st_uid == STRANGER


def test_the_mount_is_nosuid_and_nodev(shown):
    _, target = shown
    assert os.statvfs(target).f_flag & os.ST_NOSUID and os.statvfs(target).f_flag & os.ST_NODEV


def test_a_directory_of_root_or_a_daemon_is_never_shown_as_the_sandboxs(tmp_path: Path):
    for uid, gid in ((0, 0), (33, 33), (PERSON.uid, 0)):
        directory = tmp_path / f"{uid}-{gid}"
        directory.mkdir()
        os.chown(directory, uid, gid)
        assert idmap.owner_of(str(directory)) is None, (uid, gid)
    person = tmp_path / "person"
    person.mkdir()
    os.chown(person, PERSON.uid, PERSON.gid)
    assert idmap.owner_of(str(person)) == PERSON


def test_removing_a_sandbox_detaches_its_volume_and_never_deletes_the_persons_files(shown):
    own, target = shown
    state_dir = target.parent
    (state_dir / "io").mkdir()
    iodir.remove(state_dir)  # the state dir holds a bind of the same filesystem: os.path.ismount cannot see it
    assert not state_dir.exists()
    assert sorted(p.name for p in own.iterdir()) == ["stranger.txt", "theirs.txt"]
    assert stat.S_ISDIR(own.stat().st_mode)


def test_a_filesystem_without_idmapped_mounts_is_refused_with_what_to_do():
    """procfs, like NFS, has no idmapped mounts: the start is refused with the fix, never shown with the wrong owner."""
    with pytest.raises(SandboxError) as refused:
        idmap.detached("/proc", PERSON, SANDBOX)
    assert "cannot show /proc" in str(refused.value) and "idmapped mounts" in " ".join(refused.value.suggestions), refused.value
