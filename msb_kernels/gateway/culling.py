"""Culling: jupyter_server's culler, with the per-kernelspec timeout honoured (0 = never, server-wide or per kernelspec),
and the reason a culled or dead kernel stopped kept for the stats."""

from __future__ import annotations

from tornado.ioloop import PeriodicCallback


class CullingMixin:
    """MsbKernelManager's culling. The culling traits' defaults (MSB_* variables) stay on the manager, where traitlets
    finds them."""

    def _handle_kernel_died(self, kernel_id: str) -> None:
        if (record := self.records.get(kernel_id)) is not None:
            record.stop_reason = "died"
        super()._handle_kernel_died(kernel_id)

    def initialize_culler(self) -> None:
        """Poll for idle kernels even when the default timeout is 0 (never): a kernelspec may set its own."""
        if self.cull_idle_timeout > 0 or self._initialized_culler or self._culler_callback is not None:
            super().initialize_culler()
            return
        self._culler_callback = PeriodicCallback(self.cull_kernels, 1000 * self.cull_interval)
        self._culler_callback.start()
        self._initialized_culler = True

    def effective_cull_timeout(self, kernel_id: str) -> int:
        kernel = self._kernels[kernel_id]
        return int(kernel.kernel_spec.metadata.get("cull_idle_timeout", self.cull_idle_timeout) or 0)

    async def cull_kernel_if_idle(self, kernel_id: str) -> None:
        kernel = self._kernels.get(kernel_id)
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
