"""upload_file and download_file: files in and out of a session's sandbox, on every backend that runs here, through a
real MCP client; and what code in the kernel can plant (symlinks, devices) must not turn into a way out."""

from __future__ import annotations

import base64
import hashlib
import os
import time

import pytest
from mcp import Client

from mcp_bridge.local_sessions import ManagedKernelSessions
from mcp_bridge.server import build_server
from msb_kernels.identity.people import local_person
from msb_kernels.settings.config import load_settings
from tests.mcp_bridge.conftest import TEST_OPTIONS, result_error
from tests.skips import every_builtin_backend

pytestmark = pytest.mark.slow


@pytest.fixture(params=every_builtin_backend())
async def files_server(request, monkeypatch):
    """A bridge whose sessions run in the backend of the parameter, and one Python session of it."""
    monkeypatch.setenv("MSB_BACKEND", request.param)
    sessions = ManagedKernelSessions(start_timeout=120)
    server = build_server(sessions, load_settings(), TEST_OPTIONS, local_caller=local_person())
    try:
        async with Client(server) as client:
            started = await client.call_tool("execute_code", {"code": "import os; print(os.environ['MSB_SANDBOX'])"})
        assert not started.is_error, started.content[0].text
        assert started.structured_content["stdout"] == request.param + "\n"
        yield server, started.structured_content["session_id"]
    finally:
        await sessions.close()


async def run(client: Client, session_id: str, code: str) -> str:
    result = await client.call_tool("execute_code", {"code": code, "session_id": session_id})
    assert not result.is_error, result.content[0].text
    return result.structured_content["stdout"]


async def test_ten_mib_of_random_bytes_round_trip_unchanged(files_server):
    server, session = files_server
    async with Client(server) as client:
        await round_trip(client, session)


async def round_trip(client: Client, session: str) -> None:
    data = os.urandom(10 * 1024 * 1024)
    started = time.monotonic()
    uploaded = await client.call_tool(
        "upload_file", {"session_id": session, "path": "data/random.bin", "content": base64.b64encode(data).decode(), "encoding": "base64"}
    )
    took_up = time.monotonic() - started
    assert not uploaded.is_error, uploaded.content[0].text
    assert uploaded.structured_content["path"] == "/home/sandbox/data/random.bin"
    assert uploaded.structured_content["size"] == len(data) and uploaded.structured_content["sha256"] == hashlib.sha256(data).hexdigest()
    inside = await run(client, session, "import hashlib; print(hashlib.sha256(open('data/random.bin', 'rb').read()).hexdigest())")
    assert inside.strip() == hashlib.sha256(data).hexdigest(), "the kernel reads other bytes than were sent"
    started = time.monotonic()
    downloaded = await client.call_tool("download_file", {"session_id": session, "path": "/home/sandbox/data/random.bin"})
    took_down = time.monotonic() - started
    assert not downloaded.is_error, downloaded.content[0].text
    assert downloaded.structured_content["encoding"] == "base64"
    assert base64.b64decode(downloaded.structured_content["content"]) == data
    print(f"10 MiB: upload {took_up:.2f} s, download {took_down:.2f} s")
    # Text both ways, into /tmp, and a file is replaced only when asked.
    text = {"session_id": session, "path": "/tmp/notes.txt", "content": "naïve café\n"}
    assert not (await client.call_tool("upload_file", text)).is_error
    again = await client.call_tool("upload_file", {**text, "content": "second"})
    assert result_error(again)["type"] == "InvalidRequest" and "overwrite" in " ".join(result_error(again)["suggestions"])
    assert not (await client.call_tool("upload_file", {**text, "content": "second", "overwrite": True})).is_error
    read = await client.call_tool("download_file", {"session_id": session, "path": "/tmp/notes.txt"})
    assert read.structured_content["encoding"] == "text" and read.structured_content["content"] == "second"
    assert read.content[0].text == "second"


async def test_paths_out_of_the_sessions_files_are_refused_whatever_the_kernel_planted(files_server):
    server, session = files_server
    async with Client(server) as client:
        await escapes(client, session)


async def escapes(client: Client, session: str) -> None:
    await run(
        client,
        session,
        "import os\n"
        "open('/home/sandbox/victim.txt', 'w').write('untouched')\n"
        "os.symlink('/etc/passwd', '/tmp/passwd-link')\n"
        "os.symlink('/etc', '/tmp/etc-dir')\n"
        "os.symlink('/home/sandbox/victim.txt', '/tmp/victim-link')\n"
        "os.symlink('/dev/zero', '/tmp/zero-link')",
    )
    refused = {
        "download /etc/passwd": ("download_file", {"path": "/etc/passwd"}),
        "download through ..": ("download_file", {"path": "/tmp/../etc/passwd"}),
        "download a relative escape": ("download_file", {"path": "../../etc/passwd"}),
        "download a planted symlink": ("download_file", {"path": "/tmp/passwd-link"}),
        "download through a planted directory link": ("download_file", {"path": "/tmp/etc-dir/passwd"}),
        "download a device": ("download_file", {"path": "/tmp/zero-link"}),
        "download /dev/zero": ("download_file", {"path": "/dev/zero"}),
        "download the kernel's io dir": ("download_file", {"path": "/run/kernel/connection.json"}),
        "download a missing file": ("download_file", {"path": "/tmp/no-such-file"}),
        "upload to /etc": ("upload_file", {"path": "/etc/msb-upload", "content": "x"}),
        "upload through a planted directory link": ("upload_file", {"path": "/tmp/etc-dir/msb-upload", "content": "x"}),
        "upload to the root": ("upload_file", {"path": "/msb-upload", "content": "x"}),
        "upload over the home itself": ("upload_file", {"path": "/home/sandbox", "content": "x", "overwrite": True}),
        "bad base64": ("upload_file", {"path": "/tmp/b", "content": "not base64!", "encoding": "base64"}),
    }
    for what, (tool, arguments) in refused.items():
        result = await client.call_tool(tool, {"session_id": session, **arguments})
        error = result_error(result)
        assert error["type"] == "InvalidRequest", (what, error)
    # An upload onto a planted symlink replaces the link; the file it pointed to keeps its content.
    replaced = await client.call_tool(
        "upload_file", {"session_id": session, "path": "/tmp/victim-link", "content": "new", "overwrite": True}
    )
    assert not replaced.is_error, replaced.content[0].text
    seen = await run(client, session, "import os; print(open('/home/sandbox/victim.txt').read(), os.path.islink('/tmp/victim-link'))")
    assert seen.split() == ["untouched", "False"], seen
    leftovers = await run(client, session, "import glob; print(glob.glob('/tmp/.msb-upload-*') + glob.glob('/home/sandbox/.msb-upload-*'))")
    assert leftovers.strip() == "[]", "a refused upload left its temporary file"
    # The kernel's own state is the user's: nothing of the transfers in its namespace or history.
    names = await run(client, session, "print(sorted(n for n in globals() if 'msb' in n))")
    assert names.strip() == "[]", names


async def test_a_relative_path_is_the_kernels_own_from_its_working_directory(files_server):
    """A notebook's kernel works in the notebook's folder: `out.csv` there is what `open('out.csv')` in a cell reads,
    and what an assistant uploads as `rel-assistant.txt` is what the next cell opens by that name (issue 55, point 7)."""
    server, session = files_server
    async with Client(server) as client:
        await run(
            client,
            session,
            "import os; os.makedirs('/tmp/work/nb', exist_ok=True); os.chdir('/tmp/work/nb'); open('out.csv', 'w').write('a,b\\n1,2\\n')",
        )
        read = await client.call_tool("download_file", {"session_id": session, "path": "out.csv"})
        assert not read.is_error, read.content[0].text
        assert read.structured_content["path"] == "/tmp/work/nb/out.csv" and read.structured_content["content"] == "a,b\n1,2\n"
        wrote = await client.call_tool("upload_file", {"session_id": session, "path": "rel-assistant.txt", "content": "from the assistant"})
        assert not wrote.is_error, wrote.content[0].text
        assert wrote.structured_content["path"] == "/tmp/work/nb/rel-assistant.txt"
        assert (await run(client, session, "print(open('rel-assistant.txt').read())")).strip() == "from the assistant"
        escape = await client.call_tool("download_file", {"session_id": session, "path": "../../../etc/passwd"})
        assert result_error(escape)["type"] == "InvalidRequest", escape.content[0].text
