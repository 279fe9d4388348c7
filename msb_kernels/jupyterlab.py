"""What a JupyterLab (a jupyter_server with ``--gateway-url``) in front of the gateway runs, beside its own settings.

``GatewaySessions``: the Lab's session manager (``--ServerApp.session_manager_class=msb_kernels.jupyterlab.
GatewaySessions``; the shipped JupyterHub config sets it for every person's server). jupyter_server's own hands a
notebook's kernel start this whole server's environment with the notebook's path on top (``get_kernel_env``), and its
gateway client logs that start's arguments at INFO: under JupyterHub the environment holds the server's own Hub token
(JUPYTERHUB_API_TOKEN, JPY_API_TOKEN, JUPYTER_GATEWAY_AUTH_TOKEN), which then stood in every log line of a kernel start.
Here a start is given the notebook's path alone; what the Lab sends the gateway is unchanged (its gateway client picks
the KERNEL_* variables and its allowed_envs out of its own environment by itself).
"""

from __future__ import annotations

from typing import Any

from jupyter_server.gateway.managers import GatewaySessionManager

from msb_kernels.start_request import NOTEBOOK


class GatewaySessions(GatewaySessionManager):
    def get_kernel_env(self, path: str | None, name: Any = None) -> dict[str, str]:
        """The notebook's path, as jupyter_server resolves it, and nothing of this server's environment."""
        env = super().get_kernel_env(path, name)
        return {NOTEBOOK: env[NOTEBOOK]} if env.get(NOTEBOOK) else {}
