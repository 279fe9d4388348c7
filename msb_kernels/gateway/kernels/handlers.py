"""The kernel service's REST handlers (``/api/kernels``): jupyter_server's, with the gateway's JSON errors.

``POST /api/kernels`` reads the body's ``env`` (KERNEL_* variables, as the Jupyter kernel gateway reads them, and the
session's own) into the kernel's StartRequest (msb_kernels.provisioning.start_request), so that ``KERNEL_FLAVOR`` picks the flavor;
who the caller is (the owner, the volume) the kernel manager adds from the token alone.
"""

from __future__ import annotations

import json

from jupyter_server.auth.decorator import authorized
from jupyter_server.services.kernels.handlers import KernelActionHandler, KernelHandler, MainKernelHandler
from jupyter_server.utils import ensure_async, url_escape, url_path_join
from tornado import web

from msb_kernels.gateway.http_errors import MsbErrorsMixin
from msb_kernels.provisioning.start_request import START_REQUEST, StartRequest


class MsbMainKernelHandler(MsbErrorsMixin, MainKernelHandler):
    @web.authenticated
    @authorized
    async def post(self) -> None:
        km = self.kernel_manager
        model = self.get_json_body() or {}
        kernel_name = str(model.get("name") or km.default_kernel_name)
        # What the client asks for; who it is (the owner, the volume) the kernel manager adds from its token alone.
        request = StartRequest.from_variables(model.get("env"))
        kernel_id = await ensure_async(
            km.start_kernel(kernel_name=kernel_name, kernel_id=model.get("kernel_id"), **{START_REQUEST: request})
        )
        model = await ensure_async(km.kernel_model(kernel_id))
        self.set_header("Location", url_path_join(self.base_url, "api", "kernels", url_escape(kernel_id)))
        self.set_status(201)
        self.finish(json.dumps(model, default=str))


class MsbKernelHandler(MsbErrorsMixin, KernelHandler):
    pass


class MsbKernelActionHandler(MsbErrorsMixin, KernelActionHandler):
    """``POST /api/kernels/{id}/interrupt|restart``: jupyter_server's, but a kernel that does not exist for the caller
    (gone, or another person's) is a 404, where jupyter_server answers a failed restart with a 500. The lookup is the
    kernel manager's own (get_kernel), so the refusal of another person's kernel reaches the audit trail as on every
    other route."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        self.kernel_manager.get_kernel(kernel_id)
        await super().post(kernel_id, action)
