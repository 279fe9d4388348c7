"""One count for MSB_MAX_SESSIONS (issue 47): SandboxRegistry.sessions_counted, which every claim checks."""

from __future__ import annotations

import pytest

from msb_kernels.errors import ResourceLimitExceeded
from msb_kernels.provisioning.registry import SandboxRegistry
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process


def test_a_claim_past_the_one_count_is_refused_naming_the_limit_and_a_release_makes_room():
    registry = SandboxRegistry()
    registry.claim_session("a", 2)
    registry.claim_session("a", 2)  # claimed already: no second count
    registry.claim_session("b", 2)
    with pytest.raises(ResourceLimitExceeded, match=r"2 of MSB_MAX_SESSIONS=2") as refused:
        registry.claim_session("c", 2, ["stop one"])
    assert refused.value.limit == "max_sessions" and refused.value.suggestions == ["stop one"]
    assert registry.session_kernel_ids == {"a", "b"}
    registry.release_session("a")
    registry.claim_session("c", 2)
    assert registry.sessions_counted() == 2


def test_waiting_pooled_kernels_count_only_where_the_pool_counts_as_sessions_and_a_handout_counts_once():
    registry = SandboxRegistry()
    registry.pooled_kernel_ids.add("pooled")
    registry.claim_session("mine", 2)
    registry.claim_session("yours", 2)  # the waiting kernel is nobody's: not counted
    registry.release_session("yours")
    registry.pool_counts_as_sessions = True
    assert registry.sessions_counted() == 2
    with pytest.raises(ResourceLimitExceeded):
        registry.claim_session("yours", 2)
    registry.claim_session("pooled", 2)  # handed out: it counted as pooled, and moves without a check
    registry.pooled_kernel_ids.discard("pooled")
    assert registry.session_kernel_ids == {"mine", "pooled"} and registry.sessions_counted() == 2
