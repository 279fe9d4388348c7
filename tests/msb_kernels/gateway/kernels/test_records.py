"""What the gateway reads of a kernel while jupyter_server is still starting it (records.py)."""

from __future__ import annotations

import pytest
from jupyter_server.services.kernels.kernelmanager import ServerKernelManager
from traitlets import TraitError

from msb_kernels.gateway.kernels.records import last_activity_of
from msb_kernels.jupyter.compat import utcnow


def test_a_kernel_whose_start_has_not_returned_has_no_last_activity_yet() -> None:
    # jupyter_server sets last_activity once its start returns; the adoption records' timer and the stats read it
    # at any time, and at 1,000 sessions the timer met a start in between (a traceback each time, issue 39).
    km = ServerKernelManager()
    with pytest.raises(TraitError):
        km.last_activity  # noqa: B018 - what getattr(km, "last_activity", None) raised
    assert last_activity_of(km) is None
    km.last_activity = now = utcnow()
    assert last_activity_of(km) == now
