"""Settings from the environment and from Jupyter config files, and their errors."""

from __future__ import annotations

import ssl

import pytest

from msb_kernels.errors import ConfigError
from msb_kernels.kernelspecs.flavors import FLAVORS, get_flavor
from msb_kernels.settings.config import MsbSettings, load_settings
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process


def test_flavors_are_the_documented_sizes():
    assert {name: (f.cpus, f.memory_mib) for name, f in FLAVORS.items()} == {"small": (1, 1024), "medium": (2, 2048), "large": (4, 4096)}
    assert get_flavor("Medium").memory_bytes == 2048 * 1024 * 1024
    assert FLAVORS["small"].out_of_memory_message() == "out of memory for flavor small (1024 MiB); try medium"
    assert FLAVORS["large"].out_of_memory_message() == (
        "out of memory for flavor large (4096 MiB); free memory (del large objects) or restart the kernel"
    )


def test_defaults_are_the_documented_ones(monkeypatch):
    monkeypatch.delenv("MSB_BACKEND")  # the suite's own choice (tests/conftest.py)
    settings = load_settings()
    assert (settings.default_flavor, settings.session_timeout_seconds, settings.max_sessions) == ("small", 1800, 10)
    assert settings.shared_volume is None and settings.shared_volume_guest_path == "/shared"
    assert settings.backend == "auto"


# A valid value other than the default for every setting, as the environment spells it, and as read.
SAMPLES: dict[str, tuple[str, object]] = {
    "default_flavor": ("large", "large"),
    "session_timeout_seconds": ("60", 60),
    "max_sessions": ("3", 3),
    "shared_volume_path": ("{tmp}", "{tmp}"),
    "shared_volume_guest_path": ("/data", "/data"),
    "shared_volume_name": ("msb-team", "msb-team"),
    "backend": ("namespace", "namespace"),
    "transport": ("tcp", "tcp"),
    "max_processes": ("64", 64),
    "concurrent_starts": ("3", 3),
    "runtime_dir": ("{tmp}/rt", "{tmp}/rt"),
    "state_dir": ("{tmp}/state", "{tmp}/state"),
    "host_accounts": ("hub", "hub"),
    "environments_dir": ("{tmp}/envs", "{tmp}/envs"),
    "scratch_dir": ("{tmp}/scratch", "{tmp}/scratch"),
    "disk_reserve": ("false", False),
    "require_limits": ("true", True),
    "fork_kernels": ("false", False),
    "port_range": ("9100-9199", "9100-9199"),
    "allow_network": ("yes", True),
    "python_image": ("registry.example/py:1", "registry.example/py:1"),
    "node_image": ("registry.example/node:1", "registry.example/node:1"),
    "boot_timeout_seconds": ("45", 45),
    "swarm_network": ("msb-team-kernels", "msb-team-kernels"),
    "swarm_owner": ("msb_gateway", "msb_gateway"),
    "swarm_egress_host": ("msb_gateway", "msb_gateway"),
    "swarm_egress_port": ("3200", 3200),
    "host": ("0.0.0.0", "0.0.0.0"),
    "port": ("9999", 9999),
    "metrics_port": ("9101", 9101),
    "metrics_host": ("127.0.0.2", "127.0.0.2"),
    "token": ("s3cret-token", "s3cret-token"),
    "capacity_memory_mib": ("8192", 8192),
    "users_file": ("{tmp}/users.json", "{tmp}/users.json"),
    "hub_auth_cache_seconds": ("5", 5),
    "hub_proxy_url": ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    "runsc": ("/bin/true", "/bin/true"),
    "runsc_platform": ("ptrace", "ptrace"),
    "max_sessions_per_user": ("3", 3),
    "user_memory_mib": ("4096", 4096),
    "capacity_cpus": ("6", 6),
    "cull_interval_seconds": ("5", 5),
    "cull_connected": ("1", True),
    "cull_busy": ("true", True),
    "offline_buffer_mib": ("64", 64),
    "keep_kernels": ("true", True),
    "adopt_grace_seconds": ("30", 30),
    "hibernate_after_seconds": ("120", 120),
    "hibernate_dir": ("{tmp}/hibernate", "{tmp}/hibernate"),
    "hibernate_key_file": ("{tmp}/hibernate.key", "{tmp}/hibernate.key"),
    "hibernate_disk_mib": ("2048", 2048),
    "pool_size": ("python-small=2,node-medium=1", "python-small=2,node-medium=1"),
    "pool_counts_as_sessions": ("true", True),
    "mcp_running_after_seconds": ("7.5", 7.5),
    "mcp_default_timeout_seconds": ("30", 30.0),
    "mcp_max_timeout_seconds": ("600", 600.0),
    "mcp_max_output_chars": ("5000", 5000),
    "mcp_max_code_chars": ("7000", 7000),
    "mcp_progress_interval_seconds": ("2", 2.0),
    "mcp_kept_executions": ("4", 4),
    "mcp_kernel_start_timeout_seconds": ("90", 90.0),
    "lab_url": ("http://127.0.0.1:8888", "http://127.0.0.1:8888"),
    "lab_token": ("lab-token", "lab-token"),
    "lab_root_path": ("{tmp}", "{tmp}"),
    "lab_root_writable": ("true", True),
    "network_allow": ("pypi.org,*.example.com", "pypi.org,*.example.com"),
    "network_dns": ("192.0.2.53,[2001:db8::53]:5353", "192.0.2.53,[2001:db8::53]:5353"),
    "network_ca_file": (ssl.get_default_verify_paths().openssl_cafile, ssl.get_default_verify_paths().openssl_cafile),
    "network_secrets_file": ("{tmp}/secrets.json", "{tmp}/secrets.json"),
}
# Settings that exclude another (set one or the other): each is read in a pass of its own.
EXCLUSIVE = {"network_allow": "allow_network"}

# A bad value for every setting that can have one, and the start of the advice the error must carry.
BAD_VALUES: dict[str, str] = {
    "default_flavor": "tiny",
    "session_timeout_seconds": "-1",
    "max_sessions": "0",
    "shared_volume_path": "/no/such/dir",
    "shared_volume_guest_path": "/proc/x",
    "shared_volume_name": "db-data",
    "backend": "docker",
    "transport": "udp",
    "max_processes": "8",
    "concurrent_starts": "0",
    "require_limits": "maybe",
    "fork_kernels": "often",
    "disk_reserve": "sometimes",
    "port_range": "9000-8000",
    "allow_network": "perhaps",
    "python_image": " ",
    "node_image": " ",
    "boot_timeout_seconds": "0",
    "swarm_network": "no/such network",
    "swarm_egress_host": "a b",
    "swarm_egress_port": "0",
    "host": "a b",
    "port": "70000",
    "metrics_port": "0",
    "metrics_host": "a b",
    "capacity_memory_mib": "0",
    "users_file": "/etc/hostname-missing",
    "hub_auth_cache_seconds": "-1",
    "hub_proxy_url": "127.0.0.1:8000",
    "runsc": "/etc/passwd",
    "runsc_platform": "hardware",
    "max_sessions_per_user": "0",
    "user_memory_mib": "0",
    "capacity_cpus": "0",
    "cull_interval_seconds": "0",
    "cull_connected": "sometimes",
    "cull_busy": "often",
    "offline_buffer_mib": "-1",
    "keep_kernels": "maybe",
    "adopt_grace_seconds": "-1",
    "hibernate_after_seconds": "-5",
    "hibernate_key_file": "/etc/hostname",
    "hibernate_disk_mib": "0",
    "pool_size": "python-huge=1",
    "environments_dir": "relative/envs",
    "pool_counts_as_sessions": "2",
    "mcp_running_after_seconds": "0",
    "mcp_default_timeout_seconds": "-3",
    "mcp_max_timeout_seconds": "zero",
    "mcp_max_output_chars": "10",
    "mcp_max_code_chars": "10",
    "mcp_progress_interval_seconds": "60",
    "mcp_kept_executions": "0",
    "mcp_kernel_start_timeout_seconds": "0.5",
    "lab_url": "127.0.0.1:8888",
    "lab_root_path": "/usr/share",
    "lab_root_writable": "perhaps",
    "host_accounts": "ldap",
    "network_allow": "pypi.org:99999",
    "network_dns": "dns.example",
    "network_ca_file": "/etc/hostname",
    "network_secrets_file": "/no/such/file",
}
# A blank variable means unset (a token is then generated), so a blank token can only come from a config file.
BAD_CONFIG_VALUES: dict[str, str] = {"token": " ", "swarm_owner": " "}
FREE_FORM = {
    "runtime_dir",
    "state_dir",
    "scratch_dir",
    "hibernate_dir",
    "lab_token",
}  # any path (a bad one shows at first use, naming the setting); any token


def _settings_names() -> set[str]:
    from msb_kernels.settings.config import MsbSettings

    return set(MsbSettings.class_trait_names(config=True))


def test_every_setting_is_covered_here():
    """A new setting must get a sample and a bad value below, so the next two tests walk it too."""
    assert set(SAMPLES) == _settings_names()
    assert set(BAD_VALUES) | set(BAD_CONFIG_VALUES) | FREE_FORM == _settings_names()


def test_environment_sets_every_setting(monkeypatch, tmp_path):
    (tmp_path / "secrets.json").write_text('{"TOKEN": {"value": "x", "hosts": ["api.example.com"]}}')
    (tmp_path / "secrets.json").chmod(0o600)
    (tmp_path / "hibernate.key").write_text("ab" * 32)
    (tmp_path / "hibernate.key").chmod(0o600)
    (tmp_path / "users.json").write_text('{"users": {}}')
    (tmp_path / "users.json").chmod(0o600)
    for name, (raw, _) in SAMPLES.items():
        if name not in EXCLUSIVE:
            monkeypatch.setenv(f"MSB_{name.upper()}", raw.format(tmp=tmp_path))
    settings = load_settings()
    for name, (_, expected) in SAMPLES.items():
        if isinstance(expected, str):
            expected = expected.format(tmp=tmp_path)
        actual = getattr(settings, name)
        if name not in EXCLUSIVE:
            assert (str(actual) if name == "shared_volume_path" else actual) == expected, name
    assert settings.shared_volume == tmp_path
    for name, other in EXCLUSIVE.items():
        monkeypatch.delenv(f"MSB_{other.upper()}")
        monkeypatch.setenv(f"MSB_{name.upper()}", SAMPLES[name][0])
        assert getattr(load_settings(), name) == SAMPLES[name][1]


@pytest.mark.parametrize("name", sorted(BAD_VALUES) + sorted(BAD_CONFIG_VALUES))
def test_every_setting_rejects_a_bad_value_by_name(monkeypatch, name):
    from traitlets.config import Config

    from msb_kernels.settings.config import _ACCEPTED

    variable = f"MSB_{name.upper()}"
    config = Config()
    if name in BAD_VALUES:
        monkeypatch.setenv(variable, BAD_VALUES[name])
    else:
        config.MsbSettings[name] = BAD_CONFIG_VALUES[name]
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    message = str(caught.value)
    assert message.startswith(f"{variable} (c.MsbSettings.{name})="), message
    assert _ACCEPTED[name] in message or "use true or false" in message, message


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
        (
            "MSB_DEFAULT_FLAVOR",
            "tiny",
            "MSB_DEFAULT_FLAVOR (c.MsbSettings.default_flavor)='tiny' is not a flavor; use one of small, medium, large",
        ),
        (
            "MSB_SESSION_TIMEOUT_SECONDS",
            "-5",
            "MSB_SESSION_TIMEOUT_SECONDS (c.MsbSettings.session_timeout_seconds)=-5 is negative; use a whole number of seconds >= 0",
        ),
        ("MSB_SESSION_TIMEOUT_SECONDS", "soon", "is not a whole number"),
        ("MSB_MAX_SESSIONS", "0", "MSB_MAX_SESSIONS (c.MsbSettings.max_sessions)=0 is less than 1; use a whole number >= 1"),
        (
            "MSB_SHARED_VOLUME_PATH",
            "/no/such/dir",
            "MSB_SHARED_VOLUME_PATH (c.MsbSettings.shared_volume_path)='/no/such/dir' does not exist; create the directory first",
        ),
        ("MSB_SHARED_VOLUME_GUEST_PATH", "shared", "is not an absolute path"),
        ("MSB_SHARED_VOLUME_GUEST_PATH", "/usr/lib", "would hide a directory the sandbox needs"),
        ("MSB_SHARED_VOLUME_NAME", "db-data", "is not a Docker volume name that starts with msb-; use a Docker volume name"),
        ("MSB_SHARED_VOLUME_NAME", "msb-../x", "is not a Docker volume name that starts with msb-"),
        (
            "MSB_BACKEND",
            "docker",
            "MSB_BACKEND (c.MsbSettings.backend)='docker' is not a backend; use one of auto, namespace, gvisor, microsandbox",
        ),
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


@pytest.mark.parametrize("variable", ["MSB_NETWORK_SECRETS_FILE", "MSB_USERS_FILE", "MSB_HIBERNATE_KEY_FILE"])
def test_a_private_file_others_can_read_is_refused_with_the_chmod(monkeypatch, tmp_path, variable):
    path = tmp_path / "private"
    path.write_text('{"TOKEN": {"value": "x", "hosts": ["api.example.com"]}}' if "SECRETS" in variable else "ab" * 32)
    path.chmod(0o644)
    if "SECRETS" in variable:
        monkeypatch.setenv("MSB_NETWORK_ALLOW", "api.example.com")
    monkeypatch.setenv(variable, str(path))
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert f"{variable} " in str(caught.value)
    assert f"has mode 0644, which lets other users read or change it (run chmod 600 {path})" in str(caught.value)


@pytest.mark.parametrize(("backend", "refused", "accepted"), [("swarm", "ipc", "tcp"), ("microsandbox", "ipc", "tcp")])
def test_a_transport_the_backend_lacks_is_refused_by_name(backend, refused, accepted):
    from msb_kernels.backends import backend_classes

    cls = backend_classes()[backend]
    assert cls.transport_for(MsbSettings(transport="auto")) == accepted
    with pytest.raises(ConfigError) as caught:
        cls.transport_for(MsbSettings(transport=refused))
    assert str(caught.value) == f"MSB_TRANSPORT={refused}: the {backend} backend reaches its kernels only over {accepted}"
    assert f"set MSB_TRANSPORT to auto or {accepted}" in caught.value.suggestions[0]


def test_gvisor_reaches_its_kernels_over_its_network_stack_where_they_hibernate():
    """ipc by default (host Unix sockets, the quickest); tcp where kernels hibernate, which runsc cannot do with those."""
    from msb_kernels.backends import backend_classes

    gvisor = backend_classes()["gvisor"]
    assert gvisor.transport_for(MsbSettings(transport="auto")) == "ipc"
    assert gvisor.transport_for(MsbSettings(transport="auto", hibernate_after_seconds=60)) == "tcp"
    assert gvisor.transport_for(MsbSettings(transport="tcp")) == "tcp"
