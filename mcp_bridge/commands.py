"""execute_command: a process run inside the session's sandbox by the kernel itself.

The kernel runs a small runner that starts the process with an argv list (no shell
unless the caller asks for one), copies its stdout and stderr to the kernel's own
streams as they come, and prints a marker with a per-call nonce and the exit status
last. The request is silent and stores no history, and the Python runner runs in a
fresh globals dict, so the user's namespace and history do not change.
"""

from __future__ import annotations

import json
import uuid

_PYTHON_RUNNER = r'''
import codecs, os, selectors, signal, subprocess, sys

def run(argv, marker):
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except FileNotFoundError:
        sys.stderr.write("command not found: %s\n" % argv[0])
        code = 127
    except PermissionError as exc:
        sys.stderr.write("cannot run %s: %s\n" % (argv[0], exc.strerror))
        code = 126
    except OSError as exc:
        sys.stderr.write("cannot run %s: %s\n" % (argv[0], exc))
        code = 126
    else:
        targets = {proc.stdout.fileno(): (sys.stdout, codecs.getincrementaldecoder("utf-8")("replace")),
                   proc.stderr.fileno(): (sys.stderr, codecs.getincrementaldecoder("utf-8")("replace"))}
        selector = selectors.DefaultSelector()
        for fd in targets:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while targets:
                for key, _ in selector.select(0.5):
                    stream, decoder = targets[key.fd]
                    data = os.read(key.fd, 65536)
                    if data:
                        stream.write(decoder.decode(data))
                    else:
                        stream.write(decoder.decode(b"", final=True))
                        selector.unregister(key.fd)
                        del targets[key.fd]
                    stream.flush()
            code = proc.wait()
        except KeyboardInterrupt:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            proc.wait()
            sys.stderr.write("\n[interrupted: the command was killed]\n")
            code = 130
        finally:
            selector.close()
            proc.stdout.close()
            proc.stderr.close()
        if code < 0:
            code = 128 - code
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout.write("%s:%d\n" % (marker, code))
    sys.stdout.flush()
'''

_NODE_RUNNER = r'''await new Promise((resolve) => {
  const argv = ARGV;
  const marker = MARKER;
  let finished = false;
  let child = null;
  const onSigint = () => { if (child) { try { process.kill(-child.pid, "SIGKILL"); } catch (e) { child.kill("SIGKILL"); } } };
  const done = (code) => {
    if (finished) { return; }
    finished = true;
    process.removeListener("SIGINT", onSigint);
    process.stdout.write(marker + ":" + code + "\n");
    resolve(undefined);
  };
  process.on("SIGINT", onSigint);
  try {
    child = require("child_process").spawn(argv[0], argv.slice(1), { stdio: ["ignore", "pipe", "pipe"], detached: true });
  } catch (e) {
    process.stderr.write("cannot run " + argv[0] + ": " + e.message + "\n");
    done(126);
    return;
  }
  child.stdout.on("data", (d) => process.stdout.write(d.toString()));
  child.stderr.on("data", (d) => process.stderr.write(d.toString()));
  child.on("error", (e) => {
    if (Reflect.get(e, "code") === "ENOENT") { process.stderr.write("command not found: " + argv[0] + "\n"); done(127); }
    else { process.stderr.write("cannot run " + argv[0] + ": " + e.message + "\n"); done(126); }
  });
  child.on("close", (code, signal) => {
    if (signal === "SIGKILL" || signal === "SIGINT") { process.stderr.write("\n[interrupted: the command was killed]\n"); }
    done(code === null ? 130 : code);
  });
})'''


def new_marker() -> str:
    return f"\x1eMSB-EXIT-{uuid.uuid4().hex}"


def command_argv(command: str, args: list[str], shell: bool) -> list[str]:
    if shell:
        # The command is shell text the caller wrote; args stay positional parameters ($1, $2, ...).
        return ["/bin/sh", "-c", command, "sh", *args]
    return [command, *args]


def runner_code(language: str, argv: list[str], marker: str) -> str:
    """Code for an execute request that runs argv and reports its exit status after ``marker``."""
    if language == "python":
        source = _PYTHON_RUNNER + f"\nrun({list(argv)!r}, {marker!r})\n"
        return f"exec(compile({source!r}, '<msb-command>', 'exec'), {{'__name__': '__msb_command__'}})"
    return _NODE_RUNNER.replace("MARKER", json.dumps(marker)).replace("ARGV", json.dumps(list(argv)))
