"""The rules, their narrowing, the addresses no rule opens, and the wire formats the proxy reads (DNS, a ClientHello,
secrets in headers): fast checks of the pieces the kernel tests (test_proxy.py) exercise end to end."""

from __future__ import annotations

import base64
import ipaddress
import ssl

import pytest

from msb_kernels.egress import dns
from msb_kernels.egress.policy import Policy, PolicyError, parse_rule, refusal_for_address
from msb_kernels.egress.secrets import parse_declarations, substitute_headers
from msb_kernels.egress.tls import HELLO, NEED_MORE, NOT_TLS, read_client_hello
from msb_kernels.errors import ConfigError
from msb_kernels.settings.config import load_settings
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process


def test_rules_read_names_wildcards_networks_and_ports():
    policy = Policy.parse("pypi.org, *.pythonhosted.org:443 198.51.100.0/24:*,[2001:db8::/32]:8000-8010,Example.COM.")
    assert str(policy) == "pypi.org,*.pythonhosted.org:443,198.51.100.0/24:*,[2001:db8::/32]:8000-8010,example.com"
    assert policy.allows_name("pypi.org", 443) and policy.allows_name("pypi.org", 80) and not policy.allows_name("pypi.org", 8080)
    assert policy.allows_name("files.pythonhosted.org", 443) and not policy.allows_name("files.pythonhosted.org", 80)
    assert not policy.allows_name("pythonhosted.org", 443), "a wildcard is the names below it, not the name itself"
    assert not policy.allows_name("evilpythonhosted.org", 443)
    assert policy.allows_address(ipaddress.ip_address("198.51.100.7"), 22)
    assert not policy.allows_address(ipaddress.ip_address("198.51.101.7"), 22)
    assert policy.transparent_ports() == [80, 443]


@pytest.mark.parametrize(
    ("rule", "why"),
    [
        ("127.0.0.0/8", "loopback"),
        ("169.254.169.254", "link-local"),
        ("evil..example", "is not a host name"),
        ("*.*.example", "is not a host name"),
        ("pypi.org:0", "ports must lie in 1-65535"),
        ("pypi.org:http", "is not a port"),
        ("2001:db8::1:443", "brackets"),
    ],
)
def test_a_rule_that_cannot_be_used_is_refused_by_name(rule, why):
    with pytest.raises(PolicyError, match=why):
        parse_rule(rule)


def test_a_session_may_narrow_the_operators_list_and_never_widen_it():
    operator = Policy.parse("*.msb.test,pypi.org,198.51.100.0/24:*")
    assert str(operator.narrowed_to(Policy.parse("api.msb.test:443,*.x.msb.test,198.51.100.128/25:22"))) == (
        "api.msb.test:443,*.x.msb.test,198.51.100.128/25:22"
    )
    for wider in ("*", "*.test", "msb.test", "pypi.org:8443", "198.51.0.0/16", "other.example"):
        with pytest.raises(PolicyError, match="is not within the operator's list"):
            operator.narrowed_to(Policy.parse(wider))
    assert Policy.everything().narrowed_to(Policy.parse("*.example.com:*")), "MSB_ALLOW_NETWORK's list holds any public host"


@pytest.mark.parametrize("operator", ["*:*", "*", "*:443"])
@pytest.mark.parametrize(
    "session",
    [
        "10.0.0.0/8:*,172.16.0.0/12:*,192.168.0.0/16:*",  # tried live under MSB_ALLOW_NETWORK=true, and accepted
        "10.0.0.0/8",
        "10.1.2.3",
        "172.16.5.0/24:443",
        "100.64.0.0/10",
        "[fd00::/8]",
        "8.0.0.0/5",  # public at both ends, 10.0.0.0/8 inside
    ],
)
def test_a_sessions_list_within_the_public_internet_never_reaches_the_lan(operator, session):
    """``*`` (and MSB_ALLOW_NETWORK's list) is any name and any public address: a session's network rule inside a
    private range is not within it, so it never becomes the session's policy, which would open that range."""
    operator_policy = Policy.everything() if operator == "*:*" else Policy.parse(operator)
    with pytest.raises(PolicyError, match="is not within the operator's list"):
        operator_policy.narrowed_to(Policy.parse(session))


def test_a_session_narrows_to_a_public_network_or_a_private_one_the_operator_names():
    assert str(Policy.everything().narrowed_to(Policy.parse("198.51.100.0/24:443"))) == "198.51.100.0/24:443"
    operator = Policy.parse("*:*,10.1.0.0/16:*")  # the operator names a LAN range: a session may narrow to it
    narrowed = operator.narrowed_to(Policy.parse("10.1.2.0/24:5432"))
    assert refusal_for_address(narrowed, ipaddress.ip_address("10.1.2.3")) is None
    assert "private" in refusal_for_address(narrowed, ipaddress.ip_address("10.2.0.1"))
    with pytest.raises(PolicyError):
        operator.narrowed_to(Policy.parse("10.2.0.0/16"))


def test_no_rule_opens_loopback_link_local_or_the_lan_without_naming_it():
    wide = Policy.parse("*:*")
    for address, why in (("127.0.0.1", "loopback"), ("169.254.169.254", "link-local"), ("10.1.2.3", "private"), ("::1", "loopback")):
        assert why in refusal_for_address(wide, ipaddress.ip_address(address))
    assert refusal_for_address(Policy.parse("10.1.2.0/24"), ipaddress.ip_address("10.1.2.3")) is None
    assert refusal_for_address(wide, ipaddress.ip_address("198.51.100.1")) is None


def test_settings_refuse_both_switches_and_a_bad_list(monkeypatch):
    monkeypatch.setenv("MSB_NETWORK_ALLOW", "pypi.org")
    monkeypatch.setenv("MSB_ALLOW_NETWORK", "true")
    with pytest.raises(ConfigError, match="both set; set one"):
        load_settings()
    monkeypatch.delenv("MSB_ALLOW_NETWORK")
    monkeypatch.setenv("MSB_NETWORK_ALLOW", "pypi.org,10.0.0.0/8:70000")
    with pytest.raises(ConfigError, match=r"MSB_NETWORK_ALLOW .*ports must lie in 1-65535.*use host names"):
        load_settings()


def test_dns_answers_carry_the_question_and_a_records():
    query = dns.encode_query("pypi.msb.test", dns.TYPE_A, 4242)
    question = dns.parse_query(query)
    assert (question.name, question.qtype) == ("pypi.msb.test", dns.TYPE_A)
    rcode, found, truncated = dns.decode_addresses(dns.answer(question, addresses=["127.64.1.2"]), 4242)
    assert (rcode, found, truncated) == (0, ["127.64.1.2"], False)
    assert dns.decode_addresses(dns.answer(question, dns.RCODE_NXDOMAIN), 4242)[:2] == (dns.RCODE_NXDOMAIN, [])
    assert dns.error_answer(b"\x12\x34" + bytes(10) + b"junk", dns.RCODE_FORMERR)[:2] == b"\x12\x34"


def test_the_server_name_is_read_from_a_real_client_hello():
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="pypi.msb.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    assert read_client_hello(hello) == (HELLO, "pypi.msb.test")
    assert read_client_hello(hello[:30]) == (NEED_MORE, None)
    assert read_client_hello(b"GET / HTTP/1.1\r\n") == (NOT_TLS, None)


def test_secrets_go_into_their_header_for_their_hosts_over_tls_only():
    declared = parse_declarations('{"TOKEN": {"value": "real-value", "hosts": ["api.msb.test"]}}', "KERNEL_SECRETS")
    from msb_kernels.egress.secrets import Redaction, make_secrets, sendable

    (secret,) = make_secrets(declared, Policy.parse("*.msb.test"), "KERNEL_SECRETS", lambda name: "msb-secret-0123")
    basic = base64.b64encode(b"user:msb-secret-0123")
    headers = [(b"authorization", b"Basic " + basic), (b"x-token", b"Bearer msb-secret-0123")]
    rewritten, sent = substitute_headers(headers, sendable([secret], "api.msb.test", 443, tls=True))
    went = b"Basic " + base64.b64encode(b"user:real-value")
    assert rewritten == [(b"authorization", went), (b"x-token", b"Bearer msb-secret-0123")], "Authorization only, by default"
    assert set(sent) == {("TOKEN", went), ("TOKEN", b"real-value"), ("TOKEN", b"user:real-value")}  # the credential built too
    assert sendable([secret], "other.msb.test", 443, tls=True) == [] and sendable([secret], "api.msb.test", 80, tls=False) == []
    # The operator's own declaration may say plain_http; a session's may not.
    plain = parse_declarations(
        '{"T": {"value": "v1234", "hosts": ["api.msb.test"], "plain_http": true, "header": "X-Key"}}', "F", operator=True
    )
    (operators,) = make_secrets(plain, Policy.parse("*.msb.test"), "F", lambda name: "msb-secret-9")
    assert sendable([operators], "api.msb.test", 80, tls=False) == [operators] and operators.header == "x-key"
    with pytest.raises(PolicyError, match="plain_http is the operator's"):
        parse_declarations('{"T": {"value": "v", "hosts": ["api.msb.test"], "plain_http": true}}', "KERNEL_SECRETS")
    # An answer that repeats the request: every form of what went is masked, across chunk boundaries, a byte a byte.
    redaction = Redaction(sent)
    answer = b'{"authorization": "' + went + b'", "raw": "real-value", "b64": "' + base64.b64encode(b"real-value") + b'"}'
    chunks = [answer[i : i + 7] for i in range(0, len(answer), 7)]
    masked = b"".join(redaction.feed(chunk) for chunk in chunks) + redaction.flush()
    assert len(masked) == len(answer) and b"real-value" not in masked and base64.b64encode(b"real-value") not in masked
    assert went not in masked and masked.count(b"*") >= len(went) + len("real-value")
    for bad, why in (
        ('{"T": {"value": "v", "hosts": ["*"]}}', "not \\* or networks"),
        ('{"T": {"value": "a\\nb", "hosts": ["x.test"]}}', "printable ASCII"),
        ('{"1T": {"value": "v", "hosts": ["x.test"]}}', "not a variable name"),
        ('{"T": {"value": "v", "hosts": ["x.test"], "header": "Host"}}', "header must be a header name"),
        ("[1]", "must be a JSON object"),
    ):
        with pytest.raises(PolicyError, match=why):
            parse_declarations(bad, "KERNEL_SECRETS")
    with pytest.raises(PolicyError, match="does not allow"):
        make_secrets(declared, Policy.parse("pypi.org"), "KERNEL_SECRETS", lambda name: "x")
