"""Settings from the environment and from Jupyter config files, and their errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from msb_kernels.config import load_settings
from msb_kernels.errors import ConfigError
from msb_kernels.flavors import FLAVORS, get_flavor


def test_flavors_are_the_documented_sizes():
    assert {name: (f.cpus, f.memory_mib) for name, f in FLAVORS.items()} == {
        "small": (1, 1024), "medium": (2, 2048), "large": (4, 4096)}
    assert get_flavor("Medium").memory_bytes == 2048 * 1024 * 1024
    assert FLAVORS["small"].out_of_memory_message() == "out of memory for flavor small (1024 MiB); try medium"
    assert FLAVORS["large"].out_of_memory_message() == (
        "out of memory for flavor large (4096 MiB); free memory (del large objects) or restart the kernel")


def test_defaults_match_the_design():
    settings = load_settings()
    assert (settings.default_flavor, settings.session_timeout_seconds, settings.max_sessions) == ("small", 1800, 10)
    assert settings.shared_volume is None and settings.shared_volume_guest_path == "/shared"
    assert settings.backend == "auto"


def test_environment_sets_every_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("MSB_DEFAULT_FLAVOR", "large")
    monkeypatch.setenv("MSB_SESSION_TIMEOUT_SECONDS", "60")
    monkeypatch.setenv("MSB_MAX_SESSIONS", "3")
    monkeypatch.setenv("MSB_SHARED_VOLUME_PATH", str(tmp_path))
    monkeypatch.setenv("MSB_SHARED_VOLUME_GUEST_PATH", "/data")
    monkeypatch.setenv("MSB_BACKEND", "namespace")
    settings = load_settings()
    assert (settings.default_flavor, settings.session_timeout_seconds, settings.max_sessions) == ("large", 60, 3)
    assert settings.shared_volume == tmp_path and settings.shared_volume_guest_path == "/data"
    assert settings.backend == "namespace"


def test_jupyter_config_file_overrides_the_environment(monkeypatch, tmp_path):
    (tmp_path / "msb_kernels_config.py").write_text("c.MsbSettings.max_sessions = 4\nc.MsbSettings.default_flavor = 'medium'\n")
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("MSB_MAX_SESSIONS", "7")
    monkeypatch.setenv("MSB_SESSION_TIMEOUT_SECONDS", "99")
    settings = load_settings()
    assert settings.max_sessions == 4 and settings.default_flavor == "medium"
    assert settings.session_timeout_seconds == 99  # not in the file: the environment still counts


def test_an_apps_traitlets_config_is_honoured():
    from traitlets.config import Config

    config = Config()
    config.MsbSettings.session_timeout_seconds = 5
    assert load_settings(config).session_timeout_seconds == 5


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("MSB_DEFAULT_FLAVOR", "tiny", "MSB_DEFAULT_FLAVOR (c.MsbSettings.default_flavor)='tiny' is not a flavor; use one of small, medium, large"),
        ("MSB_SESSION_TIMEOUT_SECONDS", "-5", "MSB_SESSION_TIMEOUT_SECONDS (c.MsbSettings.session_timeout_seconds)=-5 is negative; use a whole number of seconds >= 0"),
        ("MSB_SESSION_TIMEOUT_SECONDS", "soon", "is not a whole number"),
        ("MSB_MAX_SESSIONS", "0", "MSB_MAX_SESSIONS (c.MsbSettings.max_sessions)=0 is less than 1; use a whole number >= 1"),
        ("MSB_SHARED_VOLUME_PATH", "/no/such/dir", "MSB_SHARED_VOLUME_PATH (c.MsbSettings.shared_volume_path)='/no/such/dir' does not exist; create the directory first"),
        ("MSB_SHARED_VOLUME_GUEST_PATH", "shared", "is not an absolute path"),
        ("MSB_SHARED_VOLUME_GUEST_PATH", "/usr/lib", "would hide a directory the sandbox needs"),
        ("MSB_BACKEND", "docker", "MSB_BACKEND (c.MsbSettings.backend)='docker' is not a backend; use one of auto, namespace, microsandbox"),
    ],
)
def test_bad_values_name_the_variable_and_the_accepted_values(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert message in str(caught.value)


def test_bad_config_file_value_is_reported_too(monkeypatch, tmp_path):
    (tmp_path / "msb_kernels_config.json").write_text('{"MsbSettings": {"default_flavor": "xl"}}')
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="'xl' is not a flavor"):
        load_settings()


@pytest.mark.parametrize("command", [["doctor"], ["run", "notebooks/hello.ipynb"], ["install"]])
def test_cli_reports_a_bad_setting_without_a_traceback(command, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MSB_DEFAULT_FLAVOR": "tiny", "MSB_RUNTIME_DIR": str(tmp_path / "rt")}
    result = subprocess.run([sys.executable, "-m", "msb_kernels.cli", *command], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "msb-kernels: error: MSB_DEFAULT_FLAVOR (c.MsbSettings.default_flavor)='tiny' is not a flavor; use one of small, medium, large" in result.stderr
