"""A warm pool: sandboxed kernels started ahead of time, handed out whole.

A new session then gets a kernel that already answered kernel_info, instead of
waiting for a sandbox and an interpreter to start. A pooled kernel has never run
user code; it belongs to no session until it is taken, and is never handed out twice.
It is started by the system for the system's StartRequest (the whole shared volume, no
variables of a session's), and handed only to a request whose sandbox would be the same;
from then on the request it was handed to is the one its restarts use.

The pool plugs into jupyter_client's AsyncMultiKernelManager (and so into
jupyter_server's kernel manager): ``start_from_pool`` registers a pooled kernel
under its own id where a fresh start would have registered a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from jupyter_client.manager import AsyncKernelManager
from jupyter_client.multikernelmanager import AsyncMultiKernelManager

from msb_kernels.identity.people import SYSTEM, acting_as
from msb_kernels.identity.volumes import WHOLE_VOLUME
from msb_kernels.jupyter.compat import jupyter_client_shutdown_all, jupyter_client_start_kernel, kernels_of, use_start_request
from msb_kernels.kernelspecs.choice import KernelChoice
from msb_kernels.kernelspecs.flavors import Flavor
from msb_kernels.provisioning import labroot, person_places
from msb_kernels.provisioning.registry import SandboxRegistry, registry_of
from msb_kernels.provisioning.start_request import START_REQUEST, StartRequest
from msb_kernels.settings.config import load_settings

log = logging.getLogger("msb_kernels")

# What the pool's kernels are started for: the system's, with nothing of a session's. On a backend that hands out
# (SandboxBackend.hands_out), with nothing of anyone's: each is shown its taker's volume and Lab root at hand-out, so the
# pool serves people too. Elsewhere with the whole shared volume, for starts that mount it (the host's own user's).
POOL_REQUEST = StartRequest(volume=WHOLE_VOLUME, for_pool=True)
READY_TIMEOUT = 120.0
RETRY_SECONDS = 10.0


async def run_silently(client: Any, code: str) -> None:
    """Run code as a silent cell and wait for its reply; what it raises is the pool's to ignore, not a session's."""
    msg_id = client.execute(code, silent=True, store_history=False)
    deadline = time.monotonic() + READY_TIMEOUT
    while (remaining := deadline - time.monotonic()) > 0:
        reply = await client.get_shell_msg(timeout=remaining)
        if reply["parent_header"].get("msg_id") == msg_id:
            return


def hands_out(km: AsyncKernelManager) -> bool:
    """Whether a pooled kernel's sandbox waits for its taker's directories (SandboxSpec.handout)."""
    sandbox = getattr(getattr(km, "provisioner", None), "sandbox", None)
    return sandbox is not None and sandbox.spec.handout


def request_of(kwargs: dict[str, Any]) -> StartRequest:
    """The StartRequest a start's keyword arguments carry; for a local start without one, what the provisioner makes of
    its env (StartRequest.for_local_start)."""
    request = kwargs.get(START_REQUEST)
    if isinstance(request, StartRequest):
        return request
    return StartRequest.for_local_start(kwargs["env"] if kwargs.get("env") is not None else os.environ)


class KernelPool:
    """Keeps `sizes[kernel_name]` started, idle kernels per kernelspec, refilled in the background."""

    def __init__(self, manager: AsyncMultiKernelManager, sizes: dict[str, int], counts_as_sessions: bool = False):
        self.manager = manager
        self.sizes = dict(sizes)
        self.counts_as_sessions = counts_as_sessions
        self.ready: dict[str, list[AsyncKernelManager]] = {name: [] for name in self.sizes}
        self.starting: dict[str, int] = {name: 0 for name in self.sizes}
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.handed_out = 0
        self.hand_outs_failed = 0  # kernels that could not be shown their taker's directories: each start went on fresh
        self.reserved: dict[str, AsyncKernelManager] = {}

    @property
    def registry(self) -> SandboxRegistry:
        """The manager's registry, which its kernels' provisioners read too: where the waiting kernels are marked."""
        return registry_of(self.manager)

    # -- filling --------------------------------------------------------------------

    def fill(self) -> None:
        """Start whatever is missing, in the background."""
        if self._closed:
            return
        for name, size in self.sizes.items():
            for _ in range(size - len(self.ready[name]) - self.starting[name]):
                self.starting[name] += 1
                task = asyncio.ensure_future(self._start_one(name))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _start_one(self, kernel_name: str) -> None:
        with acting_as(SYSTEM):  # whoever's start asked for a refill, the pool's kernels are the system's
            await self._start_for_system(kernel_name)

    async def _start_for_system(self, kernel_name: str) -> None:
        km = None
        try:
            km, _, kernel_id = self.manager.pre_start_kernel(kernel_name, {})
            if not self.counts_as_sessions:
                self.registry.pooled_kernel_ids.add(kernel_id)
            await km.start_kernel(kernel_id=kernel_id, **{START_REQUEST: POOL_REQUEST})
            client = km.client()
            client.start_channels()
            try:
                await client.wait_for_ready(timeout=READY_TIMEOUT)
                template = getattr(km.provisioner, "template_spec", None)
                if template is not None and (code := template.warm_up_code()):
                    await run_silently(client, code)
            finally:
                client.stop_channels()
            if self._closed:
                raise asyncio.CancelledError
            self.ready[kernel_name].append(km)
            log.info("warm pool: %s kernel %s ready (%d waiting)", kernel_name, kernel_id, len(self.ready[kernel_name]))
        except BaseException as exc:
            if km is not None:
                self.registry.pooled_kernel_ids.discard(km.kernel_id)
                with contextlib.suppress(Exception):
                    await km.shutdown_kernel(now=True)
            if not isinstance(exc, (asyncio.CancelledError, GeneratorExit)) and not self._closed:
                log.warning("warm pool: could not start a %s kernel (%s); retrying in %.0f s", kernel_name, exc, RETRY_SECONDS)
                self.starting[kernel_name] += 1
                self._later(RETRY_SECONDS, kernel_name)
        finally:
            self.starting[kernel_name] -= 1

    def _later(self, delay: float, kernel_name: str) -> None:
        async def retry() -> None:
            await asyncio.sleep(delay)
            self.starting[kernel_name] -= 1
            self.fill()

        task = asyncio.ensure_future(retry())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- taking -------------------------------------------------------------------

    def can_serve(self, kernel_name: str, kwargs: dict[str, Any]) -> bool:
        """Whether a waiting kernel fits this start: a sandbox of the same shape as the pool's (StartRequest.sandbox_shape:
        no variable a fresh kernel would get, no narrower network, no other volume), of the same flavor.

        The notebook's path and the client's own name describe the request, not the sandbox, so a kernel started
        before it serves it as well; so does a working directory on the client's own host, which no sandbox shows.
        """
        request = request_of(kwargs)
        if self._closed or not self.ready.get(kernel_name) or kwargs.get("kernel_id"):
            return False
        settings = load_settings(getattr(self.manager, "config", None))
        choice = KernelChoice.from_kernel_name(kernel_name)
        flavor = (request.flavor or "").strip().lower()
        if flavor and (choice is None or choice.flavor.name != flavor):
            return False
        if hands_out(self.ready[kernel_name][0]):
            # Its volume, Lab root and working directory come at hand-out: any request's, a person's or the host's
            # user's. Only one without a volume where the host has one is left to a fresh start (its kernel has no
            # PYTHONUSERBASE, which a waiting one has).
            if request.volume is None and settings.shared_volume is not None:
                return False
            return request.sandbox_shape(False) == POOL_REQUEST.sandbox_shape(False)
        if (
            request.working_dir
            and labroot.working_dir(settings, request.working_dir, person_places.whose(settings, request.owner, request.volume)) is not None
        ):
            return False  # a kernel for a notebook in the Lab root starts in its directory, which a waiting one is not in
        volume = settings.has_shared_volume
        return request.sandbox_shape(volume) == POOL_REQUEST.sandbox_shape(volume)

    def take(self, kernel_name: str, kwargs: dict[str, Any]) -> AsyncKernelManager | None:
        """A ready kernel for this start request, or None when the request must start its own."""
        if not self.can_serve(kernel_name, kwargs):
            return None
        waiting = self.ready[kernel_name]
        while waiting:
            km = waiting[0]
            if km.has_kernel and km.provisioner is not None and km.provisioner.sandbox is not None:
                # From here the kernel is a session: it counts (it stays in the pool when refused).
                self.registry.claim_session(km.kernel_id, load_settings(getattr(self.manager, "config", None)).max_sessions)
            waiting.pop(0)
            self.registry.pooled_kernel_ids.discard(km.kernel_id)
            if km.has_kernel and km.provisioner is not None and km.provisioner.sandbox is not None:
                self.handed_out += 1
                self.fill()
                return km
        self.fill()
        return None

    def reserve(self, kernel_name: str, kwargs: dict[str, Any]) -> str | None:
        """Take a kernel for a start that is about to happen under its id (as jupyter_server starts them)."""
        km = self.take(kernel_name, kwargs)
        if km is None:
            return None
        self.reserved[km.kernel_id] = km
        return km.kernel_id

    async def hand_out(self, km: AsyncKernelManager, request: StartRequest) -> None:
        """Show a waiting kernel what a fresh start of request would: its volume and Lab root (the provisioner's
        hand_out), then its working directory and the person's own packages, in the kernel (Template.hand_out_code)."""
        began = time.monotonic()
        shown, working_dir = await km.provisioner.hand_out(request)
        if not shown:
            return  # its home, as a fresh start's, and no volume of packages: nothing changes in the kernel
        template = getattr(km.provisioner, "template_spec", None)
        if template is not None and (code := template.hand_out_code(working_dir)):
            client = km.client()
            client.start_channels()
            try:
                await run_silently(client, code)
            finally:
                client.stop_channels()
        log.info("warm pool: kernel %s handed out with its directories in %.0f ms", km.kernel_id, (time.monotonic() - began) * 1000)

    async def release(self, kernel_id: str) -> None:
        """A reserved kernel whose start failed: stop it."""
        km = self.reserved.pop(kernel_id, None)
        if km is not None:
            await km.shutdown_kernel(now=True)

    def waiting(self) -> int:
        return sum(len(kernels) for kernels in self.ready.values())

    def waiting_flavors(self) -> list[Flavor]:
        """The flavors of the waiting kernels, for limits that count them (MSB_POOL_COUNTS_AS_SESSIONS)."""
        return [KernelChoice.from_kernel_name(name).flavor for name, kernels in self.ready.items() for _ in kernels]

    def kernel_ids(self) -> set[str]:
        return {km.kernel_id for kernels in self.ready.values() for km in kernels}

    def stats(self) -> dict:
        return {
            "sizes": self.sizes,
            "waiting": {name: len(k) for name, k in self.ready.items()},
            "starting": dict(self.starting),
            "handed_out": self.handed_out,
            "hand_outs_failed": self.hand_outs_failed,
            "counts_as_sessions": self.counts_as_sessions,
        }

    # -- stopping -------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop every pooled kernel and any start under way."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        kernels = [km for waiting in self.ready.values() for km in waiting] + list(self.reserved.values())
        for waiting in self.ready.values():
            waiting.clear()
        self.reserved.clear()
        for km in kernels:
            self.registry.pooled_kernel_ids.discard(km.kernel_id)
        await asyncio.gather(*(km.shutdown_kernel(now=True) for km in kernels), return_exceptions=True)


async def start_from_pool(
    manager: AsyncMultiKernelManager, pool: KernelPool | None, kernel_name: str | None, kwargs: dict[str, Any], start: Callable
) -> str:
    """AsyncMultiKernelManager._async_start_kernel, served from the pool when it can be."""
    name = kernel_name or manager.default_kernel_name
    km = None
    if pool is not None:
        km = pool.reserved.pop(kwargs.get("kernel_id"), None) or pool.take(name, kwargs)
    if km is None:
        return await start(manager, kernel_name=kernel_name, **kwargs)
    request = request_of(kwargs)
    use_start_request(km, request)  # the requester's from now on: a restart starts the kernel it asked for
    if hands_out(km):
        try:
            await pool.hand_out(km, request)  # type: ignore[union-attr]
        except Exception as exc:  # that kernel goes; the request starts its own, as without a pool
            pool.hand_outs_failed += 1  # type: ignore[union-attr]
            log.warning("warm pool: kernel %s could not be handed out (%s); starting a fresh one", km.kernel_id, exc)
            with contextlib.suppress(Exception):
                await km.shutdown_kernel(now=True)
            return await start(manager, kernel_name=kernel_name, **kwargs)
    kernels_of(manager)[km.kernel_id] = km
    return km.kernel_id


class PooledMultiKernelManager(AsyncMultiKernelManager):
    """An AsyncMultiKernelManager that serves starts from a warm pool (for msb-mcp standalone)."""

    pool: KernelPool | None = None

    # The names jupyter_client's start_kernel and shutdown_all are, and jupyter_server calls (compat.serve_starts_through).
    async def _async_start_kernel(self, *, kernel_name: str | None = None, **kwargs: Any) -> str:
        return await start_from_pool(self, self.pool, kernel_name, kwargs, jupyter_client_start_kernel)

    start_kernel = _async_start_kernel  # type: ignore[assignment]

    async def _async_shutdown_all(self, now: bool = False) -> None:
        if self.pool is not None:
            await self.pool.shutdown()
        await jupyter_client_shutdown_all(self, now=now)

    shutdown_all = _async_shutdown_all  # type: ignore[assignment]
