"""The one way the host touches what a sandbox can write, without a kernel: a directory laid out as a hostile kernel
leaves it, and what each of the host's reads, pins and clears makes of it."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from msb_kernels.backends.core import iodir
from msb_kernels.errors import SandboxError
from tests.parallel import ALONE


def made(tmp_path: Path) -> Path:
    return iodir.make_dirs(tmp_path, "k1", bounded=False)


@ALONE  # "never blocks" is read as a deadline of 0.5 s
def test_a_guest_file_is_read_only_as_a_small_regular_file_never_through_a_link_or_a_fifo(tmp_path):
    io = made(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("-9")
    (io / "exit_status").write_text("3")
    assert iodir.read_guest_file(io, "exit_status") == b"3"
    for name, make in (
        ("link", lambda p: os.symlink(victim, p)),
        ("fifo", os.mkfifo),
        ("dir", os.mkdir),
        ("huge", lambda p: p.write_bytes(b"1" * 4096)),
        ("missing", lambda p: None),
    ):
        make(io / name)
        started = time.monotonic()
        assert iodir.read_guest_file(io, name) is None, name
        assert time.monotonic() - started < 0.5, f"{name}: the read blocked"


def test_channels_are_pinned_sockets_and_a_name_swapped_later_is_never_followed(tmp_path):
    io = made(tmp_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(io / "kernel-1"))
    server.listen(4)
    pins = iodir.pin_channels(io, {1: "kernel-1"}, os.geteuid())
    try:
        # The kernel's code swaps the name for a link to another socket (another sandbox's): the pin holds.
        elsewhere = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        elsewhere.bind(str(tmp_path / "bobs"))
        elsewhere.listen(4)
        os.rename(io / "kernel-1", io / "moved")
        os.symlink(tmp_path / "bobs", io / "kernel-1")
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.append(server.accept()))
        thread.start()
        client.connect(str(iodir.channels_dir(io) / "kernel-1"))
        thread.join(5)
        assert accepted, "the pinned socket, the kernel's own, took the connection"
        elsewhere.settimeout(0.2)
        with pytest.raises(socket.timeout):
            elsewhere.accept()
        client.close()
    finally:
        pins.close()
    assert not (iodir.channels_dir(io) / "kernel-1").exists()
    # What the kernel left now is a link: refused by name, whatever it points at.
    with pytest.raises(SandboxError, match="kernel-1 is a link, not a socket its sandbox bound"):
        iodir.pin_channels(io, {1: "kernel-1"}, os.geteuid())
    os.unlink(io / "kernel-1")
    os.mkfifo(io / "kernel-1")
    with pytest.raises(SandboxError, match="is a FIFO"):
        iodir.pin_channels(io, {1: "kernel-1"}, os.geteuid())
    os.unlink(io / "kernel-1")
    again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    again.bind(str(io / "kernel-1"))
    with pytest.raises(SandboxError, match="uid"):
        iodir.pin_channels(io, {1: "kernel-1"}, os.geteuid() + 1)  # a socket of another uid: not the sandbox's


def test_a_dead_sandboxs_leavings_are_cleared_without_following_anything(tmp_path):
    io = made(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("host's")
    os.symlink(outside, io / "link-to-dir")
    os.symlink(outside / "keep", io / "link-to-file")
    (io / "dir").mkdir()
    os.symlink(outside, io / "dir" / "inner")
    os.mkfifo(io / "fifo")
    (io / "file").write_text("x")
    iodir.clear(io)
    assert os.listdir(io) == [] and (outside / "keep").read_text() == "host's"


def test_what_the_host_writes_goes_where_the_sandbox_cannot_write(tmp_path):
    io = made(tmp_path)
    path = iodir.write_host_file(io, "connection.json", "{}")
    assert path.parent == iodir.host_dir(io) and path.read_text() == "{}"
    assert oct(path.stat().st_mode & 0o777) == "0o640"
    iodir.remove(io.parent)
    assert not io.parent.exists()
