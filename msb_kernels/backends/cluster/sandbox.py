"""A kernel on a cluster's engine, as the gateway holds it: the engine's word for its liveness, its task's address."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from msb_kernels.backends.cluster.engine import Engine, TaskState
from msb_kernels.backends.core.base import Sandbox, SandboxSpec
from msb_kernels.backends.core.state import remove_state_dir

log = logging.getLogger("msb_kernels")


class ClusterSandbox(Sandbox):
    """A kernel in a unit of work on some node: its liveness is the engine's word, its address the task's."""

    def __init__(self, spec: SandboxSpec, engine: Engine, backend_name: str, service: str, state: TaskState):
        super().__init__(spec)
        self.engine = engine
        self.backend_name = backend_name
        self.service = service
        self.address = state.address
        self.node = state.node
        self.exit_code: int | None = None
        self._reason: str | None = None
        self._removed_by_us = False

    @property
    def kept(self) -> bool:
        return self.spec.adopt_grace > 0

    def _ended(self, state: TaskState) -> int:
        if self.exit_code is None:
            self.exit_code = state.exit_code if state.exit_code is not None else -signal.SIGKILL
            if state.phase == "lost":
                self._reason = f"the kernel is gone: {state.reason}"
            elif state.reason and self.exit_code not in (0, -signal.SIGKILL, 128 + signal.SIGKILL):
                self._reason = f"{state.reason} on node {state.node}"
        return self.exit_code

    async def poll(self) -> int | None:
        if self.exit_code is not None:
            return self.exit_code
        try:
            state = await asyncio.to_thread(self.engine.state, self.service)
        except Exception as exc:  # an engine that does not answer is not a dead kernel
            log.debug("kernel %s: cannot read its state: %s", self.sandbox_id, exc)
            return None
        if state.phase in ("ended", "lost"):
            return self._ended(state)
        return None

    async def wait(self) -> int | None:
        while (code := await self.poll()) is None:
            await asyncio.sleep(0.2)
        return code

    async def send_signal(self, signum: int) -> None:
        """SIGTERM and SIGKILL stop the kernel's unit of work; SIGINT goes by message (the provisioner's, see
        SandboxBackend.interrupt_by_message); the engine has no way to signal a process on another node."""
        if signum in (signal.SIGTERM, signal.SIGKILL):
            await self.kill()

    async def kill(self) -> None:
        self._removed_by_us = True
        await asyncio.to_thread(self.engine.remove, self.service)

    async def terminate(self) -> None:
        await self.kill()  # the engine sends SIGTERM, then SIGKILL after a grace period

    def exit_reason(self) -> str | None:
        if self._removed_by_us or self.exit_code is None:
            return None
        if self._reason:
            return self._reason
        if self.exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL):  # nothing but the OOM killer, when we did not
            return self.spec.flavor.out_of_memory_message()
        return None

    async def cleanup(self, keep_io_dir: bool = False) -> None:
        if self.exit_code is None:
            self._removed_by_us = True
        reason = self.exit_reason()
        if reason:
            log.warning("kernel %s: %s", self.sandbox_id, reason)
        with contextlib.suppress(Exception):  # an engine that went away: the sweep removes it later
            await asyncio.to_thread(self.engine.remove, self.service)
        remove_state_dir(self.spec.io_dir.parent, keep_io_dir=keep_io_dir)

    def info(self) -> dict:
        return {**super().info(), "backend": self.backend_name, "service": self.service, "node": self.node, "address": self.address}
