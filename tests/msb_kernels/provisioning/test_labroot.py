"""JupyterLab's root in the sandboxes (MSB_LAB_ROOT_PATH): shown at its own path, read-only unless asked, and a
notebook's kernel started in its notebook's directory, on every backend."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from msb_kernels.errors import ConfigError
from msb_kernels.identity.volumes import WHOLE_VOLUME
from msb_kernels.provisioning.labroot import lab_directories, working_dir
from msb_kernels.settings.config import load_settings
from tests.conftest import TEST_BASE
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
        lab_directories(load_settings(), WHOLE_VOLUME)


def test_only_a_directory_inside_the_root_becomes_the_working_dir(monkeypatch, tmp_path):
    root, project, sibling = lab_root()
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(root))
    settings = load_settings()
    assert working_dir(settings, str(project), WHOLE_VOLUME) == str(project)
    assert working_dir(settings, str(root), WHOLE_VOLUME) == str(root)
    assert working_dir(settings, str(project / ".." / ".." / "private"), WHOLE_VOLUME) is None
    assert working_dir(settings, str(sibling), WHOLE_VOLUME) is None
    assert working_dir(settings, str(root) + "-evil", WHOLE_VOLUME) is None
    (root / "link").symlink_to(sibling)
    assert working_dir(settings, str(root / "link"), WHOLE_VOLUME) is None
    assert working_dir(settings, None, WHOLE_VOLUME) is None


def test_one_root_is_the_host_users_and_a_persons_root_is_theirs_alone(monkeypatch, tmp_path):
    """MSB_LAB_ROOT_PATH without {username} is one Lab's: never shown to a person of the users file or the Hub (their
    kernels' volume is their own directory). With it, each person sees their own root, made theirs on first use, and
    the host's own user (the whole volume) sees none."""
    root, project, _ = lab_root()
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(root))
    settings = load_settings()
    assert [d.path for d in lab_directories(settings, WHOLE_VOLUME)] == [str(root)]
    assert lab_directories(settings, "alice") == [] and working_dir(settings, str(project), "alice") is None

    people = tmp_path / "labs"
    people.mkdir()
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", str(people / "{username}"))
    settings = load_settings()
    assert lab_directories(settings, WHOLE_VOLUME) == []
    shown = lab_directories(settings, "alice")
    assert [(d.path, d.writable) for d in shown] == [(str(people / "alice"), True)]
    if os.geteuid() == 0:  # made as hers: 0700, of her own host ids
        assert (people / "alice").stat().st_mode & 0o777 == 0o700 and (people / "alice").stat().st_uid >= 1000
    (people / "alice" / "project").mkdir()
    assert working_dir(settings, str(people / "alice" / "project"), "alice") == str(people / "alice" / "project")
    assert working_dir(settings, str(people / "alice" / "project"), "bob") is None
