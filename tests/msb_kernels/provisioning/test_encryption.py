"""CurveZMQ on a kernel's channels: refused where it cannot be had, and kept across a restart."""

from __future__ import annotations

import pytest

from tests.kernel_helpers import assert_unanswered_without_keys, execute
from tests.skips import needs_node

pytestmark = pytest.mark.asyncio


@needs_node
async def test_required_encryption_refuses_a_kernel_that_cannot_encrypt(start_kernel):
    """tslab does not speak CurveZMQ, so its kernelspec does not declare it, and jupyter_client refuses a
    'required' start rather than run the kernel in the clear. (Where a kernelspec declares it but the
    backend's kernel cannot, as an offline microVM image's older ipykernel, the provisioner refuses.)"""
    with pytest.raises(RuntimeError) as refused:
        await start_kernel("msb-node-small", transport_encryption="required")
    assert "transport_encryption='required'" in str(refused.value) and "curve" in str(refused.value)


async def test_encryption_keys_are_kept_across_a_restart(start_kernel):
    km, kc = await start_kernel(transport_encryption="required")
    keys = (km.curve_publickey, km.curve_secretkey)
    assert all(keys)
    await execute(kc, "before = 1")
    await km.restart_kernel()
    await kc.wait_for_ready(timeout=120)
    assert (km.curve_publickey, km.curve_secretkey) == keys, "a restart changed the keys a connected client holds"
    result = await execute(kc, "'before' in globals()")
    assert result.result == "False"  # a fresh kernel, reached with the same keys
    await assert_unanswered_without_keys(km)
