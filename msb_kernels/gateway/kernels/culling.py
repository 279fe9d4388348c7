"""Culling: jupyter_server's culler, with the per-kernelspec timeout honoured (0 = never, server-wide or per kernelspec),
and the reason a culled or dead kernel stopped kept for the stats."""

from __future__ import annotations

import time

from msb_kernels.identity.people import SYSTEM, set_acting
from msb_kernels.jupyter.compat import kernels_of, start_culler
from msb_kernels.jupyter.turns import in_turns
from msb_kernels.observability import metrics


class CullingMixin:
    """MsbKernelManager's culling. The culling traits' defaults (MSB_* variables) stay on the manager, where traitlets
    finds them."""

    def kernel_died(self, kernel_id: str) -> None:  # compat.MappingKernelManagerHooks
        if (record := self.records.get(kernel_id)) is not None:
            record.stop_reason = "died"

    def initialize_culler(self) -> None:
        """Poll for idle kernels even when the default timeout is 0 (never): a kernelspec may set its own."""
        if not start_culler(self):
            super().initialize_culler()

    async def cull_kernels(self) -> None:
        """jupyter_server's pass over every kernel (cull_kernel_if_idle each, in turn), taking turns with
        the gateway's other requests (turns.in_turns); a pass that culled nothing is timed (msb_cull_pass_seconds).
        As the system: its timer runs on in the context of whatever started it, and it looks at every kernel."""
        set_acting(SYSTEM)
        began = time.monotonic()
        kernel_ids = list(kernels_of(self))
        async for kernel_id in in_turns(kernel_ids):
            try:
                await self.cull_kernel_if_idle(kernel_id)
            except Exception as exc:  # one kernel's failure must not stop the pass over the others
                self.log.error("could not check whether kernel %s is idle: %s", kernel_id, exc)
        if all(kernel_id in kernels_of(self) for kernel_id in kernel_ids):
            metrics.CULL_PASSES.observe(time.monotonic() - began)

    def effective_cull_timeout(self, kernel_id: str) -> int:
        kernel = kernels_of(self)[kernel_id]
        return int(kernel.kernel_spec.metadata.get("cull_idle_timeout", self.cull_idle_timeout) or 0)

    async def cull_kernel_if_idle(self, kernel_id: str) -> None:
        kernel = kernels_of(self).get(kernel_id)
        if kernel is None:
            return
        if getattr(kernel, "execution_state", None) != "dead" and self.effective_cull_timeout(kernel_id) <= 0:
            return  # 0 means never, for the server default and for a kernelspec's override alike
        record = self.records.get(kernel_id)
        refused = self.hibernation_refused(kernel_id)
        if record is not None:
            record.stop_reason = "culled after being idle" + (f" (it could not hibernate: {refused})" if refused else "")
        try:
            await super().cull_kernel_if_idle(kernel_id)
        finally:
            if record is not None and kernel_id in self:
                record.stop_reason = None  # not culled: it runs on
