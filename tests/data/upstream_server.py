"""A web host for the egress tests, run inside a test-made network namespace (tests/upstreams.py).

It serves files from --root (a package index among them) over HTTP and, with --cert, HTTPS; /echo answers with the
request's line and headers; /reflect?form=NAME hands back the request's Authorization in that form (REFLECTIONS, a
reflecting host as an attacker meets one); every request is logged as one JSON line (what a server saw: the secret tests read
which host got which Authorization). Standard library only.
"""

import argparse
import base64
import gzip
import json
import os
import ssl
import threading
import time
import urllib.parse
import zlib
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer


def _basic_credential(header: str) -> str:
    """The base64 of ``user:value`` alone, from a Basic header (else the header's value)."""
    return header.split(" ", 1)[1] if header.lower().startswith("basic ") else base64.b64encode(header.encode()).decode()


# What a reflecting host makes of the Authorization it got: (body text, extra response headers) by form.
REFLECTIONS = {
    "as-sent": lambda h: (h, {}),
    "nothing": lambda h: (h, {}),
    "upper": lambda h: (h.upper(), {}),
    "title": lambda h: (h.title(), {}),
    "lower-header": lambda h: ("see the header", {"WWW-Authenticate": h.lower()}),
    "json-slash": lambda h: (json.dumps({"got": h}).replace("/", "\\/"), {}),
    "json-unicode": lambda h: (json.dumps({"got": "".join(f"\\u{ord(c):04x}" for c in h)}).replace("\\\\", "\\"), {}),
    "pieces": lambda h: (h[: len(h) // 2] + " ...and then... " + h[len(h) // 2 :], {}),
    "hex": lambda h: (h.encode().hex(), {}),
    "hex-upper": lambda h: (h.encode().hex().upper(), {}),
    "base64": lambda h: (base64.b64encode(h.encode()).decode(), {}),
    "base64url": lambda h: (base64.urlsafe_b64encode(("x" + h).encode()).decode(), {}),
    "base64-wrapped": lambda h: ("\n".join(base64.b64encode(("xy" + h).encode()).decode()[i : i + 8] for i in range(0, 200, 8)), {}),
    "basic-credential": lambda h: (_basic_credential(h), {}),
    "html": lambda h: ("<p>" + "".join(f"&#{ord(c)};" for c in h) + "</p>", {}),
    "url": lambda h: (urllib.parse.quote(h, safe=""), {}),
    "url-twice": lambda h: (urllib.parse.quote(urllib.parse.quote(h, safe=""), safe=""), {}),
    "shell": lambda h: ("curl -H " + "".join(c if c.isalnum() else "\\" + c for c in h), {}),  # as printf %q writes it
    "octal": lambda h: ("printf '" + "".join(f"\\{ord(c):03o}" for c in h) + "'", {}),
    "location": lambda h: ("moved", {"Location": "https://elsewhere.msb.test/?t=" + urllib.parse.quote(h.upper())}),
    "header-name": lambda h: ("see the header", {"X-" + h.encode().hex(): "1"}),
    "split-headers": lambda h: ("see the headers", {f"X-Part-{i:02d}": h[i : i + 6] for i in range(0, len(h), 6)}),
    "head-body": lambda h: (h[-4:] + " and so on", {"X-Head": h[-10:-4]}),
    "set-cookie": lambda h: ("cookie", {"Set-Cookie": "session=" + base64.urlsafe_b64encode(h.lower().encode()).decode() + "; Path=/"}),
}


STORED: dict = {}  # what /reflect?form=store kept


def handler_for(root: str, log_path: str, scheme: str):
    lock = threading.Lock()

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=root, **kwargs)

        def log_message(self, *args):
            pass

        def _record(self):
            entry = {"scheme": scheme, "method": self.command, "path": self.path, "headers": dict(self.headers.items())}
            with lock, open(log_path, "a") as log:
                log.write(json.dumps(entry) + "\n")

        def do_GET(self):
            self._record()
            if self.path.startswith("/echo"):
                body = json.dumps({"path": self.path, "headers": dict(self.headers.items())}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if self.path.startswith("/reflect"):
                self._reflect(urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query))
                return
            super().do_GET()

        def _reflect(self, query):
            form, got = query.get("form", ["as-sent"])[0], self.headers.get("Authorization", "")
            if form == "store":  # a request bin: keeps what it got, for whoever asks next
                STORED["last"] = got
                form = "nothing"
            if form == "stored":  # ... and hands it back to a request that carried nothing
                form, got = "as-sent", STORED.get("last", "")
            if form == "nothing":
                got = "kept"
            if form in ("reason", "early"):
                return self._reflect_in_head(form, got)
            if form in ("chunks", "trailer", "gzip", "two-encodings", "large", "padded-stream"):
                return self._reflect_framed(form, got, int(query.get("mib", ["2"])[0]))
            text, headers = REFLECTIONS[form](got)
            body = text.encode()
            self.send_response(302 if form == "location" else 200)
            for name, value in {"Content-Type": "text/plain", "Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def _reflect_in_head(self, form, got):
            """In the status line's reason: of a 401 (as send_error writes its message there), or of a 103 before it."""
            if form == "early":
                self.send_response_only(103, "Early " + got.upper())
                self.end_headers()
            self.send_response_only(401, "Invalid token " + got.upper())
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _reflect_framed(self, form, got, mib):
            """As sent, but framed as an attacker would frame it: the value split across two chunks sent apart; in a
            trailer; gzip-compressed though the request asked for no encoding; or mib MiB into a large answer."""
            self.protocol_version = "HTTP/1.1"
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            if form in ("gzip", "two-encodings"):  # the second: a client decodes every Content-Encoding, in turn
                body = gzip.compress(got.upper().encode()) if form == "gzip" else zlib.compress(zlib.compress(got.encode()))
                for coding in ["gzip"] if form == "gzip" else ["identity", "deflate"]:
                    self.send_header("Content-Encoding", coding)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_header("Transfer-Encoding", "chunked")
            if form == "trailer":
                self.send_header("Trailer", "X-Echo")
            self.end_headers()

            def chunk(data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            upper = got.upper().encode()
            if form == "chunks":
                chunk(upper[: len(upper) // 2])
                time.sleep(0.2)
                chunk(upper[len(upper) // 2 :])
            elif form == "padded-stream":  # past the 1 MiB checked whole: each character wide, flushed apart
                chunk(b"a" * (1 << 20) + b"a" * (200 << 10))
                for index, character in enumerate(got):
                    entity = f"&#{'0' * 40}{ord(character)};".encode()
                    chunk(entity[:20])  # an entity cut where the stream is
                    time.sleep(0.01 if index % 8 else 0.05)
                    chunk(entity[20:])
            elif form == "large":
                block = b"0123456789abcdef" * 4096
                for _ in range(mib * 16):
                    chunk(block)
                chunk(upper)
                chunk(block)
            else:
                chunk(b"see the trailer")
            self.wfile.write(b"0\r\n" + (b"X-Echo: " + upper + b"\r\n" if form == "trailer" else b"") + b"\r\n")
            self.close_connection = True

        def do_HEAD(self):
            self._record()
            super().do_HEAD()

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--cert")
    parser.add_argument("--ready", required=True)
    options = parser.parse_args()
    servers = [ThreadingHTTPServer((options.address, 80), handler_for(options.root, options.log, "http"))]
    if options.cert:
        secure = ThreadingHTTPServer((options.address, 443), handler_for(options.root, options.log, "https"))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(options.cert)
        secure.socket = context.wrap_socket(secure.socket, server_side=True)
        servers.append(secure)
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    with open(options.ready, "w") as ready:
        ready.write(str(os.getpid()))
    servers[0].serve_forever()


if __name__ == "__main__":
    main()
