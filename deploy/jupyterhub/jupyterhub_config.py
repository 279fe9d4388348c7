# JupyterHub in front of msb-kernels: one JupyterLab per person, every kernel in a sandbox on one shared gateway,
# and each person's kernels theirs alone (the gateway checks each request's Hub token).
#
#   .venv/bin/jupyterhub -f deploy/jupyterhub/jupyterhub_config.py
#
# Run it with the jupyterhub of the venv msb-kernels is installed in: the gateway is started from that venv
# (`<venv>/bin/msb-kernels serve`) and so are the single-user servers (`<venv>/bin/jupyterhub-singleuser`).
# The proxy is configurable-http-proxy from npm (`npm install -g configurable-http-proxy`), found on PATH, else the
# one ./scripts/test installs into the venv.
#
# The gateway's own settings (MSB_BACKEND, MSB_HUB_AUTH_CACHE_SECONDS, ...) are set in the Hub's environment: every
# MSB_* variable but this config's own knobs below passes to it. The knobs have defaults for a plain install:
#
#   MSB_HUB_IP              address the Hub's proxy listens on                 JupyterHub's ("": every interface)
#   MSB_HUB_PORT            the Hub's public port (the proxy's)                8000
#   MSB_HUB_PUBLIC_URL      where people reach the Hub (https://hub.example):  unset
#                           the Hub's public_url, which JupyterHub tells the
#                           gateway (its notebook tools reach people's servers
#                           there)
#   MSB_HUB_PROXY_URL       a gateway setting: where it reaches the Hub's      http://<MSB_HUB_IP or 127.0.0.1>:<port>
#                           proxy, for the notebook tools                      where MSB_HUB_PUBLIC_URL is unset
#   MSB_HUB_API_PORT        the Hub's own port, for the proxy and services     8081
#   MSB_HUB_PROXY_API_PORT  configurable-http-proxy's REST API port            8001
#   MSB_HUB_GATEWAY_PORT    the port msb-kernels serve listens on (loopback)   8765
#   MSB_HUB_GATEWAY_URL     where single-user servers reach the gateway        http://127.0.0.1:<gateway port>/services/msb-kernels/
#   MSB_HUB_STATE_DIR       the Hub's database, cookie secret and pid files    the current directory
#   MSB_HUB_AUTHENTICATOR   the authenticator ("dummy", or a class or name     JupyterHub's (PAM: the host's users)
#                           JupyterHub knows, e.g. "github")
#   MSB_HUB_PASSWORD        the shared password, for MSB_HUB_AUTHENTICATOR=dummy only (tests; JupyterHub 5.3+'s
#                           SharedPasswordAuthenticator.user_password: 8 characters at least)
#   MSB_HUB_ADMIN_PASSWORD  with dummy: the admins' own password (32 characters at least);      unset: admins log in
#                           JupyterHub lets no admin in with the shared one                      some other way
#   MSB_HUB_ALLOWED_USERS   comma-separated names who may log in; * for all    required with PAM (the default)
#   MSB_HUB_ADMIN_USERS     comma-separated Hub admins, who are the gateway's  none
#                           admins too (they see and manage every kernel)
#   MSB_HUB_SPAWNER         "simple" for SimpleLocalProcessSpawner (tests: no  JupyterHub's LocalProcessSpawner
#                           system users needed, no isolation between them)
#   MSB_HUB_ALLOW_ROOT      1: single-user servers may run as root             off
#                           (jupyter's --allow-root; SimpleLocalProcessSpawner as root needs it)
#
# MSB_LAB_ROOT_PATH (a gateway setting) defaults to each person's home, /home/{username} (the spawner's homes for
# "simple"): their kernels see their own server's root there, read-write, as them. Set it to your spawner's
# notebook_dir, with {username}, where that differs.
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

c = get_config()  # noqa: F821 (JupyterHub's config loader defines it)

SERVICE = "msb-kernels"  # the gateway serves under /services/msb-kernels/ and requires this service's scope
SERVICE_SCOPE = f"access:services!service={SERVICE}"
VENV_BIN = Path(sys.executable).parent  # the venv running this Hub, which msb-kernels is installed in


# This config's own knobs (the table above), which stay with the Hub; the gateway's MSB_HUB_* settings pass on.
KNOBS = {"IP", "PORT", "API_PORT", "PROXY_API_PORT", "GATEWAY_PORT", "GATEWAY_URL", "STATE_DIR", "AUTHENTICATOR"}
KNOBS |= {"PASSWORD", "ADMIN_PASSWORD", "ALLOWED_USERS", "ADMIN_USERS", "SPAWNER", "ALLOW_ROOT"}


def knob(name: str, default: str = "") -> str:
    assert name in KNOBS, name
    return os.environ.get(f"MSB_HUB_{name}", default)


def names(value: str) -> set[str]:
    return {name.strip() for name in value.split(",") if name.strip()}


state_dir = Path(knob("STATE_DIR", ".")).resolve()
state_dir.mkdir(parents=True, exist_ok=True)
# The Hub keeps its state in files beside each other, not in whatever directory it happened to start in.
c.JupyterHub.db_url = f"sqlite:///{state_dir / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state_dir / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(state_dir / "jupyterhub.pid")
c.ConfigurableHTTPProxy.pid_file = str(state_dir / "jupyterhub-proxy.pid")

if knob("IP"):
    c.JupyterHub.ip = knob("IP")
c.JupyterHub.port = int(knob("PORT", "8000"))
if os.environ.get("MSB_HUB_PUBLIC_URL"):
    # A gateway setting too (it passes on, unlike the knobs): the notebook tools reach /user/<name>/ through it.
    c.JupyterHub.public_url = os.environ["MSB_HUB_PUBLIC_URL"]
c.JupyterHub.hub_ip = "127.0.0.1"  # the Hub's API is for the proxy, the gateway and local servers only
c.JupyterHub.hub_port = int(knob("API_PORT", "8081"))
chp = VENV_BIN.parent / "share" / "msb-kernels" / "chp" / "node_modules" / ".bin" / "configurable-http-proxy"
if shutil.which("configurable-http-proxy") is None and chp.exists():
    c.ConfigurableHTTPProxy.command = [str(chp)]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{knob('PROXY_API_PORT', '8001')}"

# -- the gateway, as a service the Hub starts and stops ------------------------------------------------------------
gateway_port = int(knob("GATEWAY_PORT", "8765"))
# What the gateway needs from the Hub's environment: its own MSB_* settings, and where `msb-kernels install` put the
# kernelspecs (the Jupyter path variables). Nothing else of the Hub's (its proxy token above all) reaches it.
passed = ("LANG", "LC_ALL", "JUPYTER_PATH", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_PLATFORM_DIRS")
gateway_env = {
    name: value
    for name, value in os.environ.items()
    if name in passed or (name.startswith("MSB_") and name.removeprefix("MSB_HUB_") not in KNOBS)
}
if not os.environ.get("MSB_HUB_PUBLIC_URL"):
    # Where the gateway reaches each person's server for the notebook tools: the proxy, on this host. (With a
    # public_url, JupyterHub tells the gateway that one itself.) Never a request's own Host header.
    proxy_host = knob("IP") if knob("IP") not in ("", "0.0.0.0", "::") else "127.0.0.1"
    gateway_env.setdefault("MSB_HUB_PROXY_URL", f"http://{proxy_host}:{c.JupyterHub.port}")
if "MSB_LAB_ROOT_PATH" not in gateway_env:
    # Each person's kernels see their own server's root, at the same path, and nobody else's: the spawner's homes.
    homes = state_dir / "home" if knob("SPAWNER") == "simple" else Path("/home")
    if knob("SPAWNER") == "simple":
        homes.mkdir(exist_ok=True)
    if homes.is_dir():
        gateway_env["MSB_LAB_ROOT_PATH"] = str(homes / "{username}")
if "MSB_SHARED_VOLUME_PATH" not in gateway_env:
    # Each person's own directory of it holds what `%pip install --user` keeps, and what they share between kernels.
    # Root's and 0755, as an operator makes one; the gateway makes each person's inside. Set the variable to another
    # path, or empty for none.
    volume = state_dir / "volume"
    volume.mkdir(mode=0o755, exist_ok=True)
    gateway_env["MSB_SHARED_VOLUME_PATH"] = str(volume)
if knob("SPAWNER") != "simple":
    # LocalProcessSpawner runs each person's server as the host login of their name: their files are that login's,
    # and so is their home. Only a source declared so ever reaches a login (docs/teams.md, "What a name reaches").
    gateway_env.setdefault("MSB_HOST_ACCOUNTS", "hub")
c.JupyterHub.services = [
    {
        "name": SERVICE,
        # The Hub gives it JUPYTERHUB_API_URL, _API_TOKEN, _SERVICE_NAME, _SERVICE_PREFIX and _SERVICE_URL: from those
        # `msb-kernels serve` binds to this url, serves under /services/msb-kernels/ and checks Hub tokens. No MSB_TOKEN.
        "command": [str(VENV_BIN / "msb-kernels"), "serve"],
        # Loopback only: people reach it through the Hub's proxy, their servers on this host directly.
        "url": f"http://127.0.0.1:{gateway_port}",
        "environment": gateway_env,
        # Not a link on the Hub's home page: the gateway is an API for JupyterLab and MCP clients, with no pages.
        "display": False,
    }
]

# -- who may use it ------------------------------------------------------------------------------------------------
# Every user holds the gateway's scope through the `user` role (which every user has), and keeps what that role
# gives by default ("self"). The gateway refuses any token without the scope, so a site can instead grant this
# role scope to a group only.
c.JupyterHub.load_roles = [{"name": "user", "scopes": ["self", SERVICE_SCOPE]}]
# Hub admins hold access:services (every service's scope) through the admin role; the gateway treats them as its
# admins.
c.Authenticator.admin_users = names(knob("ADMIN_USERS"))
if knob("ALLOWED_USERS").strip() == "*":
    c.Authenticator.allow_all = True
elif knob("ALLOWED_USERS"):
    c.Authenticator.allowed_users = names(knob("ALLOWED_USERS"))

authenticator = knob("AUTHENTICATOR")
if authenticator in ("", "pam"):
    # PAM logs in the host's users: JupyterHub 6 lets no one in without an allow rule ("User 'ann' not allowed"), and
    # logs a KeyError at every start for an admin who is no user here. Said once, at start, with what to do.
    import pwd

    def refuse(message: str, *advice: str) -> None:
        sys.exit(f"deploy/jupyterhub/jupyterhub_config.py: {message}" + "".join(f"\n  - {line}" for line in advice))

    if not knob("ALLOWED_USERS"):
        refuse(
            "MSB_HUB_ALLOWED_USERS is not set, so no one could log in: JupyterHub 6 lets in only whom an allow rule names",
            "set MSB_HUB_ALLOWED_USERS=ann,ben: the host users who may log in",
            "or MSB_HUB_ALLOWED_USERS='*': every host user whose password PAM accepts",
        )
    for variable in ("ALLOWED_USERS", "ADMIN_USERS"):
        for name in sorted(names(knob(variable)) - {"*"}):
            try:
                pwd.getpwnam(name)
            except KeyError:
                refuse(
                    f"MSB_HUB_{variable} names {name!r}, who is no user of this host: PAM logs in the host's users only",
                    f"create the user (useradd -m {name}) or take the name out of MSB_HUB_{variable}",
                )
if authenticator == "dummy":
    # Tests and demos only: anyone allowed logs in with the one shared password. JupyterHub 5.3+ has
    # SharedPasswordAuthenticator for this (its DummyAuthenticator.password is deprecated); an older Hub keeps the dummy.
    try:
        from jupyterhub.authenticators.shared import SharedPasswordAuthenticator
    except ImportError:
        c.JupyterHub.authenticator_class = "jupyterhub.auth.DummyAuthenticator"
        c.DummyAuthenticator.password = knob("PASSWORD")
    else:
        c.JupyterHub.authenticator_class = SharedPasswordAuthenticator
        c.SharedPasswordAuthenticator.user_password = knob("PASSWORD")  # 8 characters at least
        if knob("ADMIN_PASSWORD"):  # admins log in with their own, 32 characters at least, or not at all
            c.SharedPasswordAuthenticator.admin_password = knob("ADMIN_PASSWORD")
        if not knob("ALLOWED_USERS"):
            c.SharedPasswordAuthenticator.allow_all = True  # as the dummy let anyone with the password in
elif authenticator:
    c.JupyterHub.authenticator_class = authenticator

# -- each person's JupyterLab, on the gateway, with its own token ---------------------------------------------------
if knob("SPAWNER") == "simple":
    # No system users needed and no isolation between people's servers: for tests and demos only. Their kernels are
    # still sandboxed, and still their own, on the gateway.
    c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
    c.SimpleLocalProcessSpawner.home_dir_template = str(state_dir / "home" / "{username}")

    def _home_of_their_own(spawner) -> None:
        """Each person's home made theirs before their server makes it (as root, root's): as LocalProcessSpawner's
        homes are their users', so that their kernels write there as them (docs/teams.md, "Your files"). Made by the
        gateway's own rule, as the ids the gateway keeps for them (the Hub shares its MSB_* settings)."""
        from msb_kernels.identity.people import Owner
        from msb_kernels.provisioning import labroot, person_places
        from msb_kernels.settings.config import load_settings

        for name, value in gateway_env.items():  # the gateway's settings, MSB_LAB_ROOT_PATH among them
            if name.startswith("MSB_"):
                os.environ.setdefault(name, value)
        settings = load_settings()
        labroot.root_of(settings, person_places.people_of(settings).get(Owner("hub", spawner.user.name)))

    c.Spawner.pre_spawn_hook = _home_of_their_own
c.Spawner.cmd = [str(VENV_BIN / "jupyterhub-singleuser")]  # the server of this venv, whatever PATH says
c.Spawner.default_url = "/lab"
# A notebook's kernel start is given the notebook's path alone, never the server's environment, which holds its Hub
# token and which jupyter_server's gateway client logs at INFO with every start (msb_kernels/jupyterlab.py).
# Its kernel manager answers Lab's /api/resolvePath for a gateway kernel (jupyter_server's asserted, a 500), and drops
# tornado's ping warning of every kernel connect.
c.Spawner.args = [
    "--ServerApp.session_manager_class=msb_kernels.jupyterlab.GatewaySessions",
    "--ServerApp.kernel_manager_class=msb_kernels.jupyterlab.GatewayKernels",
]
if knob("ALLOW_ROOT") not in ("", "0", "false"):
    c.Spawner.args.append("--allow-root")
# Not the Hub's terminal: on one, a server answers SIGINT (the Hub's first signal as it stops it, at Ctrl-C) by asking
# on that terminal whether to shut down, waits 5 s for a "y", and goes on running until SIGTERM 10 s later.
c.Spawner.popen_kwargs = {"stdin": subprocess.DEVNULL}
# A server's own token (JUPYTERHUB_API_TOKEN) gets JupyterHub's defaults for a server (the `server` role's: post
# activity, be reached) plus the gateway's scope, which it holds only where its user does. Lab sends this token to
# the gateway, so the gateway sees the person, not a shared secret.
c.Spawner.server_token_scopes = ["users:activity!user", "access:servers!server", SERVICE_SCOPE]
c.Spawner.environment = {
    # jupyter_server's GatewayClient reads these: the server runs no kernel of its own; every kernel is the gateway's.
    "JUPYTER_GATEWAY_URL": knob("GATEWAY_URL", f"http://127.0.0.1:{gateway_port}/services/{SERVICE}/"),
    # Called per spawn: the server's own Hub token (above), so each request to the gateway is this person's.
    "JUPYTER_GATEWAY_AUTH_TOKEN": lambda spawner: spawner.api_token,
    # What a Lab session may pass to its kernel's start (msb_kernels.gateway.app.JUPYTERLAB_ALLOWED_ENVS).
    "JUPYTER_GATEWAY_ALLOWED_ENVS": "JPY_SESSION_NAME,KERNEL_FLAVOR",
    # A kernel start is a sandbox start on the gateway; on a busy host that takes longer than jupyter_server's
    # default wait.
    "JUPYTER_GATEWAY_REQUEST_TIMEOUT": "90",
    "JUPYTER_GATEWAY_CONNECT_TIMEOUT": "60",
}
# JupyterLab's first start (its extensions, jupyter-collaboration's among them) takes longer than JupyterHub's default
# 30 s on a small, busy host.
c.Spawner.http_timeout = 90
c.Spawner.start_timeout = 120
