"""JupyterLab's root in the sandboxes (MSB_LAB_ROOT_PATH): shown at its own path, read-only unless asked, and a
notebook's kernel started in its notebook's directory, on every backend."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from msb_kernels.errors import ConfigError
from msb_kernels.identity.people import Owner
from msb_kernels.provisioning.labroot import lab_directories, working_dir
from msb_kernels.provisioning.person_places import people_of
from msb_kernels.settings.config import load_settings
from tests.conftest import TEST_BASE
from tests.host_users import host_user
from tests.kernel_helpers import execute
from tests.skips import every_builtin_backend

PROBE = """
import json, os
outcome = {"cwd": os.getcwd(), "data": open("data.csv").read(), "listing": sorted(os.listdir(".."))}
for name, path in (("write_here", "new.txt"), ("write_inside", "../inside.txt")):
    try:
        open(path, "w").write("x")
        outcome[name] = "written"
    except OSError as exc:
        outcome[name] = type(exc).__name__ + ":" + str(exc.errno)
outcome["sibling"] = os.path.exists(SIBLING)
print(json.dumps(outcome))
"""


def lab_root() -> tuple[Path, Path, Path]:
    """A Lab root with project/data.csv, beside a directory that must stay out of sight; both world-writable on the host."""
    base = TEST_BASE / f"lab-{uuid.uuid4().hex[:6]}"
    root, sibling = base / "root", base / "private"
    (root / "project").mkdir(parents=True)
    sibling.mkdir()
    (sibling / "secret.txt").write_text("secret")
    (root / "project" / "data.csv").write_text("a,b\n1,2\n")
    for directory in (root, root / "project"):
        os.chmod(directory, 0o777)  # so that a write refused inside the sandbox is the mount's doing, not the mode's
    return root, root / "project", sibling


@pytest.mark.slow
@pytest.mark.parametrize("writable", [False, True], ids=["read-only", "writable"])
@pytest.mark.parametrize("backend", every_builtin_backend())
async def test_a_kernel_starts_in_its_notebooks_directory_inside_the_lab_root(start_kernel, monkeypatch, backend, writable):
    root, project, sibling = lab_root()
    monkeypatch.setenv("MSB_BACKEND", backend)
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(root))
    monkeypatch.setenv("MSB_LAB_ROOT_WRITABLE", str(writable).lower())
    _, kc = await start_kernel(env={"KERNEL_WORKING_DIR": str(project)})

    reply = await execute(kc, f"SIBLING = {str(sibling / 'secret.txt')!r}\n" + PROBE)
    assert reply.error is None, reply.traceback
    seen = json.loads(reply.stdout)
    assert seen["cwd"] == str(project) and seen["data"] == "a,b\n1,2\n", seen
    assert seen["sibling"] is False, "a directory beside the Lab root is visible"
    assert seen["listing"] == ["project"], seen
    if writable:
        assert seen["write_here"] == seen["write_inside"] == "written", seen
        assert (project / "new.txt").read_text() == "x" and (root / "inside.txt").exists()
    else:
        assert seen["write_here"].startswith("OSError:30") and seen["write_inside"].startswith("OSError:30"), seen  # EROFS
        assert not (project / "new.txt").exists()


@pytest.mark.slow
async def test_without_a_lab_root_the_working_dir_of_the_request_is_ignored(start_kernel, monkeypatch):
    root, project, _ = lab_root()
    monkeypatch.delenv("MSB_LAB_ROOT_PATH", raising=False)
    _, kc = await start_kernel(env={"KERNEL_WORKING_DIR": str(project)})
    reply = await execute(kc, f"import os; print(os.getcwd(), os.path.exists({str(root)!r}))")
    assert reply.stdout.split() == ["/home/sandbox", "False"], reply.stdout


def test_bad_lab_roots_are_refused_with_the_setting_named(monkeypatch, tmp_path):
    for value, problem in (
        ("relative/dir", "is not an absolute path"),
        (str(tmp_path / "missing"), "is not an existing directory"),
        ("/", "system directory"),
        ("/usr/share", "system directory"),
        ("/home", "system directory"),
        ("/home/{username}/work", "must end in a person's directory"),
        (str(tmp_path / "missing" / "{username}"), "must end in a person's directory"),
        ("/etc/{username}", "system directory"),
        ("/home/{user}", "names a field other than {username}"),
        ("/srv/{username}{x}", "names a field other than {username}"),
    ):
        monkeypatch.setenv("MSB_LAB_ROOT_PATH", value)
        with pytest.raises(ConfigError, match="MSB_LAB_ROOT_PATH") as raised:
            load_settings()
        assert problem in str(raised.value), str(raised.value)

    # A root holding the runtime dir would show every kernel's sockets to every sandbox.
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(tmp_path))
    monkeypatch.setenv("MSB_RUNTIME_DIR", str(tmp_path / "rt"))
    with pytest.raises(ConfigError, match="MSB_RUNTIME_DIR"):
        lab_directories(load_settings(), None)


def test_only_a_directory_inside_the_root_becomes_the_working_dir(monkeypatch, tmp_path):
    root, project, sibling = lab_root()
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(root))
    settings = load_settings()
    assert working_dir(settings, str(project), None) == str(project)
    assert working_dir(settings, str(root), None) == str(root)
    assert working_dir(settings, str(project / ".." / ".." / "private"), None) is None
    assert working_dir(settings, str(sibling), None) is None
    assert working_dir(settings, str(root) + "-evil", None) is None
    (root / "link").symlink_to(sibling)
    assert working_dir(settings, str(root / "link"), None) is None
    assert working_dir(settings, None, None) is None


def person(name: str, source: str = "users-file"):
    """A person as the gateway's registry holds them (the suite's MSB_STATE_DIR)."""
    return people_of(load_settings()).get(Owner(source, name))


def test_one_root_is_the_host_users_and_a_persons_root_is_theirs_alone(monkeypatch, tmp_path):
    """MSB_LAB_ROOT_PATH without {username} is one Lab's: never shown to a person of the users file or the Hub (their
    kernels' volume is their own directory). With it, each person sees their own root, made theirs on first use, and
    the host's own user (the whole volume) sees none."""
    root, project, _ = lab_root()
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(root))
    settings = load_settings()
    assert [d.path for d in lab_directories(settings, None)] == [str(root)]
    assert lab_directories(settings, person("alice")) == [] and working_dir(settings, str(project), person("alice")) is None

    people = tmp_path / "labs"
    people.mkdir()
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(people / "{username}"))
    settings = load_settings()
    assert lab_directories(settings, None) == []
    shown = lab_directories(settings, person("alice"))
    assert [(d.path, d.writable) for d in shown] == [(str(people / "alice"), True)]
    if os.geteuid() == 0:  # made as hers: 0700, of her own host ids
        st = (people / "alice").stat()
        assert (st.st_mode & 0o777, st.st_uid) == (0o700, person("alice").own.uid)
    (people / "alice" / "project").mkdir()
    assert working_dir(settings, str(people / "alice" / "project"), person("alice")) == str(people / "alice" / "project")
    assert working_dir(settings, str(people / "alice" / "project"), person("bob")) is None


as_root = pytest.mark.skipif(os.geteuid() != 0, reason="other owners' directories and useradd need root: run the suite as root")


@as_root
def test_a_name_reaches_no_login_no_strangers_directory_and_no_link(monkeypatch, tmp_path):
    """Issue 53: a person named like a host login, like root's directory, like a directory of another's ids, or whose
    root is a link, is shown none of it; the start is refused naming MSB_LAB_ROOT_PATH and MSB_HOST_ACCOUNTS."""
    labs = tmp_path / "labs"
    labs.mkdir()
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(labs / "{username}"))
    stranger = labs / "stranger"
    stranger.mkdir()
    os.chown(stranger, person("someone-else").own.uid, person("someone-else").own.gid)  # another person's root
    (labs / "rootdir").mkdir()  # root's, as another gateway's state directory would be
    (labs / "linked").symlink_to(tmp_path)
    (labs / "ops%40corp").mkdir()  # root's, named as an earlier version escaped ops@corp: not hers to take
    with host_user("msbtlogin", uid=59222) as login:
        (labs / "msbtlogin").mkdir()
        os.chown(labs / "msbtlogin", login.pw_uid, login.pw_gid)  # the login's own home
        settings = load_settings()
        for name in ("msbtlogin", "rootdir", "stranger", "linked"):
            with pytest.raises(ConfigError, match="MSB_LAB_ROOT_PATH") as refused:
                lab_directories(settings, person(name))
            assert "MSB_HOST_ACCOUNTS" in " ".join(refused.value.suggestions), name
        assert (labs / "msbtlogin").stat().st_uid == login.pw_uid and (labs / "rootdir").stat().st_uid == 0
        lab_directories(settings, person("ops@corp"))  # a new root of her own; root's stays where and whose it was
        assert (labs / "ops%40corp").stat().st_uid == 0 and (labs / "ops@corp").stat().st_uid == person("ops@corp").own.uid

        # Declared: a hub person is their login, and their login's home is theirs; a users-file one of that name is not.
        monkeypatch.setenv("MSB_HOST_ACCOUNTS", "hub")
        settings = load_settings()
        assert [d.path for d in lab_directories(settings, people_of(settings).get(Owner("hub", "msbtlogin")))] == [str(labs / "msbtlogin")]
        with pytest.raises(ConfigError):
            lab_directories(settings, people_of(settings).get(Owner("users-file", "msbtlogin")))


@as_root
def test_an_earlier_versions_root_becomes_its_persons_and_ids_of_another_person_never_do(monkeypatch, tmp_path):
    labs = tmp_path / "labs"
    labs.mkdir()
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(labs / "{username}"))
    old = labs / "dora"
    (old / "notes").mkdir(parents=True)
    (old / "link").symlink_to("/etc")
    earlier = 1_000_777_001  # an id an earlier version chose for her, which the registry never gave anyone
    for path in (old, old / "notes"):
        os.chown(path, earlier, earlier)
    settings = load_settings()
    dora = people_of(settings).get(Owner("users-file", "dora"))
    assert [d.path for d in lab_directories(settings, dora)] == [str(old)]
    assert {(old / p).lstat().st_uid for p in ("", "notes", "link")} == {dora.own.uid}
    assert os.stat("/etc").st_uid == 0
