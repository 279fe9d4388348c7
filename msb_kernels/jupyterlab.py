"""What a JupyterLab (a jupyter_server with ``--gateway-url``) in front of the gateway runs, beside its own settings.

``GatewaySessions``: the Lab's session manager (``--ServerApp.session_manager_class=msb_kernels.jupyterlab.
GatewaySessions``; the shipped JupyterHub config sets it for every person's server). jupyter_server's own hands a
notebook's kernel start this whole server's environment with the notebook's path on top (``get_kernel_env``), and its
gateway client logs that start's arguments at INFO: under JupyterHub the environment holds the server's own Hub token
(JUPYTERHUB_API_TOKEN, JPY_API_TOKEN, JUPYTER_GATEWAY_AUTH_TOKEN), which then stood in every log line of a kernel start.
Here a start is given the notebook's path alone; what the Lab sends the gateway is unchanged (its gateway client picks
the KERNEL_* variables and its allowed_envs out of its own environment by itself).

``GatewayKernels``: the Lab's kernel manager (``--ServerApp.kernel_manager_class=msb_kernels.jupyterlab.GatewayKernels``,
set by the shipped JupyterHub config). Lab asks ``/api/resolvePath?path=...&kernel=<id>`` to open a file a kernel
names; jupyter_server's gateway kernel manager has no provisioner, and jupyter_client's ``resolve_path`` asserts one,
so Lab's server answered 500. A gateway kernel's files are not this server's, so it resolves nothing in the kernel's
scope, as jupyter_client's own base provisioner does, and the server's own scope answers. Its servers also drop
tornado's ping warning (msb_kernels.jupyter.server_logs), which every kernel connect printed.
"""

from __future__ import annotations

import gc
import signal
import sys
import threading
from typing import Any

from jupyter_server.gateway.managers import GatewayKernelManager, GatewayMappingKernelManager, GatewaySessionManager
from tornado import web
from traitlets import default

from msb_kernels.jupyter.server_logs import quiet_the_ping_unit_clash
from msb_kernels.provisioning.start_request import NOTEBOOK


class GatewaySessions(GatewaySessionManager):
    def get_kernel_env(self, path: str | None, name: Any = None) -> dict[str, str]:
        """The notebook's path, as jupyter_server resolves it, and nothing of this server's environment."""
        env = super().get_kernel_env(path, name)
        return {NOTEBOOK: env[NOTEBOOK]} if env.get(NOTEBOOK) else {}


class GatewayKernel(GatewayKernelManager):
    def resolve_path(self, path: str) -> str | None:
        """Nothing: the kernel runs in a sandbox on the gateway, whose paths are not this server's files."""
        return None


class GatewayKernels(GatewayMappingKernelManager):
    @default("kernel_manager_class")
    def _default_kernel_manager_class(self) -> str:
        return "msb_kernels.jupyterlab.GatewayKernel"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        quiet_the_ping_unit_clash()
        stop_on_sigint(self.parent)

    async def shutdown_all(self, now: bool = False) -> None:
        """The server's last act with kernels as it stops (jupyter_server's cleanup); then it exits. The interpreter's
        teardown collected cycles over Lab's heap for seconds, which JupyterHub waits out, person by person, as it stops:
        frozen objects are never collected, so the process exits at once (atexit handlers still run).

        A gateway that does not answer has stopped, and its kernels with it: JupyterHub stops its services (the
        gateway) before the people's servers, so at the Hub's Ctrl-C every server met a refused connection here and
        logged it as a traceback."""
        try:
            await super().shutdown_all(now=now)
        except web.HTTPError as exc:
            if exc.status_code not in (502, 503, 504, 599):
                raise
            self.log.info("The gateway did not answer as this server stopped: its kernels stopped with it")
        end_anyio_workers()
        gc.freeze()


def stop_on_sigint(server: Any) -> None:
    """SIGINT stops the server as SIGTERM does, with jupyter_server's cleanup, where it has no terminal to ask on (every
    server JupyterHub starts). There jupyter_server leaves SIGINT to Python: a KeyboardInterrupt ended the loop with no
    cleanup at all, and the process then waited for AnyIO's threads (below) until JupyterHub, which stops a server with
    SIGINT, sent SIGTERM 10 s later and SIGKILL 5 s after that. Called as the server sets up, before its init_signal,
    which installs its question on SIGINT only on a terminal."""
    stop = getattr(server, "_signal_stop", None)
    if stop is None or threading.current_thread() is not threading.main_thread() or (sys.stdin and sys.stdin.isatty()):
        return
    signal.signal(signal.SIGINT, stop)


def end_anyio_workers() -> None:
    """End AnyIO's idle worker threads, as AnyIO itself does when the task that started them ends. jupyter-collaboration
    runs its file and store I/O in them, and under tornado's loop that task never ends: a server that had served a
    collaboration room then never exited (its main thread waited in threading._shutdown, seen with py-spy) until it
    was killed. Called once the server's kernels are shut down, the last of its cleanup that runs extensions' code."""
    try:
        from anyio._backends._asyncio import WorkerThread
    except ImportError:
        return
    for thread in threading.enumerate():
        if isinstance(thread, WorkerThread):
            thread.queue.put_nowait(None)  # AnyIO's own stop: the thread returns once it has done what it holds
