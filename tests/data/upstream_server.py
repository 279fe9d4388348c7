"""A web host for the egress tests, run inside a test-made network namespace (tests/upstreams.py).

It serves files from --root (a package index among them) over HTTP and, with --cert, HTTPS; /echo answers with the
request's line and headers; every request is logged as one JSON line (what a server saw: the secret tests read
which host got which Authorization). Standard library only.
"""

import argparse
import json
import os
import ssl
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer


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
            super().do_GET()

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
