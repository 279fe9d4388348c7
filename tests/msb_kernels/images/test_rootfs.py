"""Root filesystems for kernel images: where the Debian mirror comes from, and what counts as a CurveZMQ kernel."""

from __future__ import annotations

import subprocess

from msb_kernels.images import rootfs


def test_an_image_without_ipykernel_is_not_taken_for_curve(tmp_path):
    (tmp_path / "usr/lib/python3/dist-packages").mkdir(parents=True)
    assert rootfs.ipykernel_speaks_curve(tmp_path) is False


def test_apt_mirror_from_sources(tmp_path):
    one_line = tmp_path / "sources.list"
    one_line.write_text("# comment\ndeb [arch=amd64] http://mirror.example/debian bookworm main\n")
    deb822 = tmp_path / "debian.sources"
    deb822.write_text("Types: deb\nURIs: http://deb.example/debian\nSuites: bookworm\n")
    assert rootfs.apt_mirror([one_line]) == "http://mirror.example/debian"
    assert rootfs.apt_mirror([deb822]) == "http://deb.example/debian"
    assert rootfs.apt_mirror([tmp_path / "missing"]) == rootfs.DEFAULT_MIRROR


def test_apt_mirror_of_this_host_is_one_apt_uses(monkeypatch):
    """Read from this host's real sources, not the fallback: apt-cache policy lists the same URL."""
    policy = subprocess.run(["apt-cache", "policy"], capture_output=True, text=True, timeout=60).stdout
    monkeypatch.setattr(rootfs, "DEFAULT_MIRROR", "fallback-was-used")
    mirror = rootfs.apt_mirror()
    assert mirror != "fallback-was-used"
    assert f" {mirror} " in policy or f" {mirror}/ " in policy, (mirror, policy[:500])
