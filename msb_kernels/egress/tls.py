"""TLS for the egress proxy: the server name a ClientHello asks for, and the certificate authority the proxy signs
with where it opens HTTPS to put a secret into a request.

Why a ClientHello is read at all: a CONNECT names one host, but the TLS inside can name another (domain fronting:
an allowed CDN host in the CONNECT, a forbidden one in the SNI, both served by the same front). The proxy reads the
first record and refuses a name the CONNECT did not ask for, before a byte goes upstream.

Why a CA: a secret goes into an HTTPS request's headers only if the proxy can read them. For the hosts a kernel's
secrets name, and only those, the proxy ends the kernel's TLS with a certificate for the host signed by this CA
(which the kernel's trust bundle holds) and opens its own TLS to the host, verified as any client would. Every other
host's TLS passes through untouched. The CA is made once per runtime dir, readable by its owner only.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import os
import ssl
import struct
import threading
from pathlib import Path

NEED_MORE, NOT_TLS, HELLO = "need more", "not tls", "hello"
MAX_HELLO = 64 * 1024
CA_DIR = "egress-ca"
LEAF_DAYS = 30
CA_DAYS = 3650


def read_client_hello(data: bytes) -> tuple[str, str | None]:
    """(NEED_MORE, None) until the first handshake message is whole; (NOT_TLS, None) for bytes that are not a
    TLS handshake; (HELLO, server name or None) for a ClientHello."""
    if not data:
        return NEED_MORE, None
    if data[0] != 0x16:
        return NOT_TLS, None
    handshake = b""
    offset = 0
    while True:  # a ClientHello may span records
        if len(data) < offset + 5:
            return (NEED_MORE, None) if len(data) < MAX_HELLO else (NOT_TLS, None)
        kind, _, length = struct.unpack_from("!BHH", data, offset)
        if kind != 0x16:
            return NOT_TLS, None
        if len(data) < offset + 5 + length:
            return NEED_MORE, None
        handshake += data[offset + 5 : offset + 5 + length]
        offset += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 0x01:
                return NOT_TLS, None
            needed = 4 + int.from_bytes(handshake[1:4], "big")
            if len(handshake) >= needed:
                try:
                    return HELLO, _server_name(handshake[4:needed])
                except (IndexError, struct.error, UnicodeDecodeError):
                    return NOT_TLS, None


def _server_name(hello: bytes) -> str | None:
    offset = 2 + 32  # version, random
    offset += 1 + hello[offset]  # session id
    offset += 2 + struct.unpack_from("!H", hello, offset)[0]  # cipher suites
    offset += 1 + hello[offset]  # compression methods
    if offset + 2 > len(hello):
        return None  # no extensions
    end = offset + 2 + struct.unpack_from("!H", hello, offset)[0]
    offset += 2
    while offset + 4 <= end:
        kind, length = struct.unpack_from("!HH", hello, offset)
        offset += 4
        if kind == 0:  # server_name: list length, then (type 0, length, name) entries
            inner = offset + 2
            while inner + 3 <= offset + length:
                name_type, name_length = struct.unpack_from("!BH", hello, inner)
                if name_type == 0:
                    return hello[inner + 3 : inner + 3 + name_length].decode("ascii").rstrip(".").lower()
                inner += 3 + name_length
            return None
        offset += length
    return None


class CertificateAuthority:
    """The proxy's CA for one runtime dir: made on first use, kept in <runtime dir>/egress-ca (0700, key 0600)."""

    def __init__(self, runtime_root: Path):
        self.directory = runtime_root / CA_DIR
        self._lock = threading.Lock()
        self._key = None
        self._cert = None
        self.pem = b""

    def load(self) -> bytes:
        """The CA certificate as PEM, making the CA if this runtime dir has none."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        with self._lock:
            if self._cert is not None:
                return self.pem
            key_path, cert_path = self.directory / "ca.key", self.directory / "ca.pem"
            if key_path.exists() and cert_path.exists():
                self._key = serialization.load_pem_private_key(key_path.read_bytes(), None)
                self.pem = cert_path.read_bytes()
                self._cert = x509.load_pem_x509_certificate(self.pem)
                return self.pem
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            key = ec.generate_private_key(ec.SECP256R1())
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"msb-kernels egress proxy ({os.uname().nodename})")])
            now = datetime.datetime.now(datetime.timezone.utc)
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                    critical=True,
                )
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256())
            )
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
            self.pem = cert.public_bytes(serialization.Encoding.PEM)
            cert_path.write_bytes(self.pem)
            self._key, self._cert = key, cert
            return self.pem

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one CA per runtime dir, for the process's life
    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for host, signed by this CA (HTTP/1.1 only)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        self.load()
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            alternative: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alternative = x509.DNSName(host)
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([alternative]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        # ssl loads a chain only from a file: write it private, load it, remove it.
        path = self.directory / f"leaf-{os.getpid()}-{threading.get_ident()}.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(pem)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(path)
        finally:
            path.unlink(missing_ok=True)
        context.set_alpn_protocols(["http/1.1"])
        return context


def system_bundle() -> bytes:
    """The host's trusted CAs as PEM (what the kernel trusts beside the proxy's CA)."""
    paths = ssl.get_default_verify_paths()
    for candidate in (os.environ.get("SSL_CERT_FILE"), paths.cafile, paths.openssl_cafile, "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and os.path.isfile(candidate):
            return Path(candidate).read_bytes()
    try:
        import certifi

        return Path(certifi.where()).read_bytes()
    except ImportError:
        return b""


def upstream_context(extra_ca_file: str | None) -> ssl.SSLContext:
    """How the proxy verifies the hosts it opens TLS to: the system's CAs, and MSB_NETWORK_CA_FILE's."""
    context = ssl.create_default_context()
    if extra_ca_file:
        context.load_verify_locations(cafile=extra_ca_file)
    context.set_alpn_protocols(["http/1.1"])
    return context
