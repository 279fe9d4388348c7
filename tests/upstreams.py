"""Hosts beyond the egress proxy, for tests: a network namespace the test makes, holding a web host
(tests/data/upstream_server.py: HTTP, HTTPS with a test CA, a package index, a log of every request) and dnsmasq,
which answers every name under ``msb.test`` with the web host's address and logs each query.

Why a namespace: tests send traffic only to addresses on this machine, and the proxy refuses the host's own
addresses and loopback by design. A veth pair joins the host (``.1``) to the namespace (``.2``) on a /30 of
198.18.0.0/15 (RFC 2544's benchmarking range, which no real network uses), with no other route in or out.

API::

    UpstreamUnavailable(reason)
    Upstream(base).start() / .stop()
        .address  .dns  .ca_file  .index_url  .url(name, path, scheme="http")
        .requests() -> [{"scheme", "method", "path", "headers"}]   .dns_queries() -> [name, ...]
    tiny_wheel(directory, name, version) -> Path   a pure-Python wheel that pip installs
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import time
import zipfile
from pathlib import Path

from tests.conftest import REPO

NAMES = ("pypi.msb.test", "other.msb.test", "api.msb.test", "evil.msb.test")
_SBIN = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SERVER = REPO / "tests" / "data" / "upstream_server.py"


class UpstreamUnavailable(Exception):
    """The upstream host cannot be made here; the message says why (and what to install)."""


def _run(*argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, env={"PATH": _SBIN}, timeout=30)
    if done.returncode:
        raise UpstreamUnavailable(f"{' '.join(argv)} failed: {(done.stderr or done.stdout).strip()}")
    return done


def _taken() -> list[ipaddress.IPv4Network]:
    text = _run("ip", "-4", "-o", "addr").stdout + _run("ip", "-4", "route").stdout
    found = []
    for word in text.split():
        try:
            found.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    return found


class Upstream:
    """One namespace with a web host and its DNS server; start() makes it, stop() removes every trace."""

    def __init__(self, base: Path):
        self.base = base
        self.tag = f"{os.getpid() % 10000}{random.randrange(1000):03d}"
        self.netns = f"msbt-up-{self.tag}"
        self.link = f"msbu{self.tag}"
        self.processes: list[subprocess.Popen] = []
        self.address = self.host_address = ""
        self.started = False

    @property
    def dns(self) -> str:
        return self.address

    @property
    def index_url(self) -> str:
        return "http://pypi.msb.test/simple/"

    @staticmethod
    def url(name: str, path: str = "/echo", scheme: str = "http") -> str:
        return f"{scheme}://{name}{path}"

    def start(self) -> Upstream:
        if os.geteuid() != 0:
            raise UpstreamUnavailable("a test-made network namespace needs root")
        for tool in ("ip", "dnsmasq"):
            if not shutil.which(tool, path=_SBIN):
                raise UpstreamUnavailable(
                    f"{tool} is not installed (as root: bash scripts/apt-install {'dnsmasq-base' if tool == 'dnsmasq' else 'iproute2'})"
                )
        self.base.mkdir(parents=True, exist_ok=True)
        taken = _taken()
        for _ in range(64):
            subnet = ipaddress.ip_network(f"198.18.{random.randrange(128, 255)}.{4 * random.randrange(64)}/30")
            if not any(subnet.overlaps(net) for net in taken if net.prefixlen > 0):
                break
        else:
            raise UpstreamUnavailable("no free /30 in 198.18.128.0/17")
        self.host_address, self.address = str(subnet[1]), str(subnet[2])
        self.started = True
        _run("ip", "netns", "add", self.netns)
        _run("ip", "link", "add", self.link, "type", "veth", "peer", "name", "eth-up", "netns", self.netns)
        _run("ip", "addr", "add", f"{self.host_address}/30", "dev", self.link)
        _run("ip", "link", "set", self.link, "up")
        inside = ("ip", "netns", "exec", self.netns)
        _run(*inside, "ip", "addr", "add", f"{self.address}/30", "dev", "eth-up")
        _run(*inside, "ip", "link", "set", "eth-up", "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        self.ca_file, cert = self._certificates()
        (self.base / "root").mkdir(exist_ok=True)
        ready = self.base / "server.ready"
        self._spawn(
            *inside,
            "python3",
            str(SERVER),
            "--address",
            self.address,
            "--root",
            str(self.base / "root"),
            "--log",
            str(self.base / "requests.jsonl"),
            "--cert",
            str(cert),
            "--ready",
            str(ready),
        )
        self._spawn(
            *inside,
            shutil.which("dnsmasq", path=_SBIN),
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            "--user=root",
            f"--listen-address={self.address}",
            "--bind-interfaces",
            f"--address=/msb.test/{self.address}",
            "--log-queries",
            f"--log-facility={self.base / 'dns.log'}",
            f"--pid-file={self.base / 'dnsmasq.pid'}",
        )
        deadline = time.monotonic() + 20
        while not (ready.exists() and (self.base / "dns.log").exists()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.processes):
                self.stop()
                raise UpstreamUnavailable("the upstream host's web server or dnsmasq did not start")
            time.sleep(0.05)
        return self

    def _spawn(self, *argv: str) -> None:
        log = open(self.base / "processes.log", "a")
        self.processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={"PATH": _SBIN}))
        log.close()

    def _certificates(self) -> tuple[str, Path]:
        """A test CA, and a certificate for every name signed by it (one PEM with the key, for the server)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.timezone.utc)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "msb-kernels tests upstream CA")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAMES[0])]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in NAMES]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        ca_path, cert_path = self.base / "upstream-ca.pem", self.base / "upstream-server.pem"
        ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        cert_path.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        return str(ca_path), cert_path

    def requests(self) -> list[dict]:
        path = self.base / "requests.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def dns_queries(self) -> list[str]:
        """Every name dnsmasq was asked for, in order."""
        path = self.base / "dns.log"
        if not path.exists():
            return []
        names = []
        for line in path.read_text().splitlines():
            words = line.split()
            if "query[" in line:
                names.append(words[words.index(next(w for w in words if w.startswith("query["))) + 1])
        return names

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        self.processes.clear()
        if self.started:
            subprocess.run(["ip", "link", "del", self.link], capture_output=True, env={"PATH": _SBIN})
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, env={"PATH": _SBIN})
            self.started = False


def tiny_wheel(directory: Path, name: str = "msbtiny", version: str = "0.1") -> Path:
    """A pure-Python wheel (one module whose VALUE is its version), for pip to install from the test index."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VALUE = {version!r}\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: msb-kernels-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            data = text.encode()
            archive.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
        archive.writestr(f"{dist_info}/RECORD", "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n")
    return wheel


def serve_package(upstream: Upstream, name: str = "msbtiny", version: str = "0.1") -> None:
    """Put a wheel of name on the upstream's index, as PEP 503 pages pip reads."""
    root = upstream.base / "root"
    wheel = tiny_wheel(root / "files", name, version)
    page = root / "simple" / name
    page.mkdir(parents=True, exist_ok=True)
    (page / "index.html").write_text(f'<html><body><a href="/files/{wheel.name}">{wheel.name}</a></body></html>\n')
    (root / "simple" / "index.html").write_text(f'<html><body><a href="/simple/{name}/">{name}</a></body></html>\n')


def serve_npm_package(upstream: Upstream, name: str = "msbtiny", version: str = "0.1.0") -> str:
    """Put a package on an npm registry at the upstream's /npm/ (its metadata document and tarball); the registry URL."""
    import io
    import tarfile

    registry = upstream.base / "root" / "npm"
    registry.mkdir(parents=True, exist_ok=True)
    files = {
        "package/package.json": json.dumps({"name": name, "version": version, "main": "index.js"}),
        "package/index.js": f"module.exports = {version!r};\n",
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    tarball = registry / f"{name}-{version}.tgz"
    tarball.write_bytes(buffer.getvalue())
    url = "http://pypi.msb.test/npm/"
    document = {
        "name": name,
        "dist-tags": {"latest": version},
        "versions": {
            version: {
                "name": name,
                "version": version,
                "dist": {"tarball": f"{url}{tarball.name}", "shasum": hashlib.sha1(tarball.read_bytes()).hexdigest()},
            }
        },
    }
    (registry / name).write_text(json.dumps(document))
    return url
