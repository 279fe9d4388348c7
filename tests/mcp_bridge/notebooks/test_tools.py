"""The notebook tools against a real JupyterLab (with jupyter-collaboration) whose kernels run on the gateway.

Every notebook here is read back from disk too (JupyterLab saves its room), so what the tools did is
what a person would find in the file: cell ids, execution counts, outputs, valid nbformat.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import uuid

import nbformat
import pytest
from mcp import Client

from tests.conftest import TEST_BASE
from tests.mcp_bridge.conftest import result_error
from tests.mcp_bridge.notebooks.conftest import call, code_cells, finished, mcp_client, wait_for
from tests.mcp_bridge.test_schemas import checked_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def on_disk(lab, path: str) -> nbformat.NotebookNode:
    return nbformat.read(TEST_BASE / f"js-root-{lab.port}" / path, as_version=4)


def saved_cells(lab, path: str) -> list | None:
    """The notebook's cells on disk, or None while Lab is still writing it.

    jupyter_server's atomic writing keeps a backup and rewrites the file in place,
    so a reader can catch it empty or half written.
    """
    try:
        return on_disk(lab, path).cells
    except (nbformat.reader.NotJSONError, ValueError):
        return None


def unique(name: str) -> str:
    return f"work/{name}-{uuid.uuid4().hex[:6]}.ipynb"


async def test_cells_are_inserted_edited_moved_and_run_by_id(notebook_gateway, lab):
    async with mcp_client(notebook_gateway) as assistant:
        client = await checked_client(assistant)
        path = unique("tools")
        opened = (await client.call("use_notebook", {"notebook": path, "create": True})).structured_content
        assert opened["session_id"] and opened["kernel_name"].startswith("msb-python-"), opened

        title = (
            await client.call("insert_cell", {"notebook": path, "source": "# Title", "cell_type": "markdown", "index": 0})
        ).structured_content
        title_id = title["cells"][0]["id"]
        first = (await client.call("insert_execute_code_cell", {"notebook": path, "source": "x = 40\nprint('set', x)"})).structured_content
        first = await finished(assistant, first)
        assert first["status"] == "ok" and first["stdout"] == "set 40\n" and first["execution_count"] == 1, first
        second = await finished(
            assistant, (await client.call("insert_execute_code_cell", {"notebook": path, "source": "x + 2"})).structured_content
        )
        assert second["results"][0]["data"]["text/plain"] == "42" and second["execution_count"] == 2, second

        # A cell put above the assistant's does not move its target: cell ids, not indices.
        await client.call("insert_cell", {"notebook": path, "source": "above = True", "index": 0})
        edited = await client.call(
            "edit_cell_source", {"notebook": path, "cell_id": second["cell_id"], "old_text": "+ 2", "new_text": "+ 3"}
        )
        assert edited.structured_content["cells"][0]["source"] == "x + 3"
        rerun = await finished(
            assistant, (await client.call("execute_cell", {"notebook": path, "cell_id": second["cell_id"]})).structured_content
        )
        assert rerun["results"][0]["data"]["text/plain"] == "43" and rerun["execution_count"] == 3, rerun

        await client.call("overwrite_cell_source", {"notebook": path, "cell_id": title_id, "source": "# Renamed é 😀"})
        await client.call("edit_cell_source", {"notebook": path, "cell_id": title_id, "old_text": "😀", "new_text": "ok"})
        moved = (await client.call("move_cell", {"notebook": path, "cell_id": title_id, "to_index": -1})).structured_content
        assert moved["cells"][0]["id"] == title_id and moved["cells"][0]["source"] == "# Renamed é ok", moved
        error = await finished(
            assistant, (await client.call("insert_execute_code_cell", {"notebook": path, "source": "1/0"})).structured_content
        )
        assert error["status"] == "error" and error["error"]["type"] == "RuntimeError", error
        await client.call("clear_cell_output", {"notebook": path, "cell_id": first["cell_id"]})
        await client.call("delete_cell", {"notebook": path, "cell_id": error["cell_id"]})

        read = (await client.call("read_notebook", {"notebook": path})).structured_content
        assert (read["session_id"], read["kernel_name"]) == (opened["session_id"], opened["kernel_name"]), read
        sources = [cell["source"] for cell in code_cells(read)]
        assert sources == ["above = True", "x = 40\nprint('set', x)", "x + 3", "# Renamed é ok"], sources
        by_id = {cell["id"]: cell for cell in read["cells"]}
        assert by_id[first["cell_id"]]["outputs"] == "" and by_id[first["cell_id"]]["execution_count"] is None
        assert by_id[second["cell_id"]]["outputs"] == "43\n" and by_id[second["cell_id"]]["execution_state"] == "idle"
        one = (await client.call("read_cell", {"notebook": path, "cell_id": second["cell_id"]})).structured_content
        assert one["cells"][0]["index"] == by_id[second["cell_id"]]["index"]

        listed = (await client.call("list_notebooks", {})).structured_content
        assert any(n["notebook"] == path and n["session_id"] == opened["session_id"] for n in listed["notebooks"]), listed
        kernels = (await client.call("list_kernels", {})).structured_content["sessions"]
        assert any(k["id"] == opened["session_id"] and k["notebook_path"] == path for k in kernels), kernels
        files = (await client.call("list_files", {"path": "work"})).structured_content
        assert path in [entry["path"] for entry in files["entries"]], files

        # The same kernel is a session of the other tools, and the notebook's variables are there.
        shared = await call(assistant, "execute_code", code="x", session_id=opened["session_id"])
        assert shared["results"][0]["data"]["text/plain"] == "40"

        def saved() -> bool:
            cells = [c for c in saved_cells(lab, path) or [] if c.source.strip()]
            return bool(cells) and [c.source for c in cells] == sources and cells[2].outputs and cells[2].execution_count == 3

        await wait_for(lambda: asyncio.to_thread(saved), "JupyterLab to save the notebook with the assistant's cells")
        nbformat.validate(on_disk(lab, path))


async def test_bad_requests_name_the_argument_and_change_nothing(notebook_gateway):
    async with mcp_client(notebook_gateway) as assistant:
        client = await checked_client(assistant)
        path = unique("bad")
        await client.call("use_notebook", {"notebook": path, "create": True, "start_kernel": False})
        before = (await client.call("read_notebook", {"notebook": path})).structured_content["cells"]
        cases = {
            ("read_notebook", "../outside.ipynb"): "not a path inside JupyterLab's root",
            ("read_notebook", "work/data.csv"): "not a notebook",
            ("read_notebook", "work/missing.ipynb"): "does not exist",
        }
        for (tool, notebook), expected in cases.items():
            result = await client.call(tool, {"notebook": notebook})
            assert result.is_error and expected in result_error(result)["message"], result.content[0].text
        for arguments, expected in (
            ({"cell_index": 99}, "out of range"),
            ({"cell_id": "nope"}, "no cell with id"),
            ({}, "exactly one of cell_id and cell_index"),
        ):
            result = await client.call("read_cell", {"notebook": path, **arguments})
            assert result.is_error and expected in result_error(result)["message"], result.content[0].text
        result = await client.call("edit_cell_source", {"notebook": path, "cell_index": 0, "old_text": "absent", "new_text": "x"})
        assert result.is_error and "occurs 0 times" in result_error(result)["message"]
        result = await client.call("insert_cell", {"notebook": path, "source": "x", "cell_type": "heading"})
        assert result.is_error and "cell_type" in result_error(result)["message"]
        assert (await client.call("read_notebook", {"notebook": path})).structured_content["cells"] == before


async def test_two_assistants_on_two_notebooks_never_write_into_each_other(notebook_gateway, lab):
    paths = [unique("first"), unique("second")]

    async def work(path: str) -> list[dict]:
        async with mcp_client(notebook_gateway) as client:
            await call(client, "use_notebook", notebook=path, create=True)
            answers = []
            for i in range(20):
                answer = await call(client, "insert_execute_code_cell", notebook=path, source=f"print({path!r}, {i})")
                answers.append(await finished(client, answer))
            return answers

    results = await asyncio.gather(*(work(path) for path in paths))
    async with mcp_client(notebook_gateway) as client:
        for path, answers in zip(paths, results, strict=True):
            assert [a["stdout"] for a in answers] == [f"{path} {i}\n" for i in range(20)]
            assert {a["notebook"] for a in answers} == {path}
            cells = code_cells(await call(client, "read_notebook", notebook=path))
            assert [c["source"] for c in cells] == [f"print({path!r}, {i})" for i in range(20)]
            assert [c["outputs"] for c in cells] == [f"{path} {i}\n" for i in range(20)]
            assert [c["execution_count"] for c in cells] == list(range(1, 21))
    assert results[0][0]["session_id"] != results[1][0]["session_id"]


KILLED_CLIENT = textwrap.dedent(
    """
    import asyncio, sys, httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def main(url, token, path, source):
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=600) as http:
            async with Client(streamable_http_client(url, http_client=http)) as client:
                print("calling", flush=True)
                await client.call_tool("insert_execute_code_cell", {"notebook": path, "source": source})

    asyncio.run(main(*sys.argv[1:]))
    """
)
TEN_SECONDS = "import time\nfor i in range(10):\n    print('line', i, flush=True)\n    time.sleep(1)\n# {marker}"


async def test_outputs_land_in_the_notebook_after_the_client_is_killed_mid_cell(notebook_gateway):
    async with mcp_client(notebook_gateway) as assistant:
        path = unique("killed")
        await call(assistant, "use_notebook", notebook=path, create=True)
        marker = uuid.uuid4().hex
        source = TEN_SECONDS.format(marker=marker)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            KILLED_CLIENT,
            notebook_gateway.url + "/mcp",
            notebook_gateway.token,
            path,
            source,
            stdout=asyncio.subprocess.PIPE,
        )

        async def the_cell() -> dict | None:
            cells = (await call(assistant, "read_notebook", notebook=path))["cells"]
            return next((c for c in cells if marker in c["source"]), None)

        async def running_with_output() -> dict | None:
            cell = await the_cell()
            return cell if cell and cell["execution_state"] == "running" and "line 1" in (cell["outputs"] or "") else None

        try:
            await wait_for(running_with_output, "the killed client's cell to be running with output", timeout=90)
        finally:
            os.kill(process.pid, signal.SIGKILL)
            await process.wait()

        async def complete() -> dict | None:
            cell = await the_cell()
            return cell if cell and cell["execution_state"] == "idle" else None

        cell = await wait_for(complete, "the cell to finish after its client died", timeout=60)
        assert cell["outputs"] == "".join(f"line {i}\n" for i in range(10)), cell
        assert cell["execution_count"] is not None


async def test_a_long_cell_hands_off_to_get_execution_output(notebook_gateway):
    async with mcp_client(notebook_gateway) as assistant:
        path = unique("long")
        await call(assistant, "use_notebook", notebook=path, create=True)
        answer = await call(assistant, "insert_execute_code_cell", notebook=path, source=TEN_SECONDS.format(marker="long"))
        assert answer["status"] == "running" and answer["execution_id"], answer
        done = await finished(assistant, answer)
        assert done["status"] == "ok" and done["cell_id"] == answer["cell_id"], done
        stdout = (
            answer["stdout"]
            + (await call(assistant, "get_execution_output", session_id=answer["session_id"], execution_id=answer["execution_id"]))[
                "stdout"
            ][len(answer["stdout"]) :]
        )
        assert stdout == "".join(f"line {i}\n" for i in range(10))
        cell = (await call(assistant, "read_cell", notebook=path, cell_id=answer["cell_id"]))["cells"][0]
        assert cell["outputs"] == stdout and cell["execution_state"] == "idle"


async def test_a_notebooks_kernel_opens_the_files_beside_it_read_only(notebook_gateway, lab):
    path = unique("data")
    directory = TEST_BASE / f"js-root-{lab.port}" / "work"
    (directory / "data.csv").write_text("city,visits\nLyon,3\n")
    async with mcp_client(notebook_gateway) as assistant:
        await call(assistant, "use_notebook", notebook=path, create=True)
        code = (
            "import os\nprint(os.getcwd())\nprint(open('data.csv').read(), end='')\n"
            "try:\n    open('out.txt', 'w')\nexcept OSError as exc:\n    print('refused', exc.errno)"
        )
        answer = await finished(assistant, await call(assistant, "insert_execute_code_cell", notebook=path, source=code))
    assert answer["stdout"] == f"{directory}\ncity,visits\nLyon,3\nrefused 30\n", answer


async def test_without_a_lab_the_notebook_tools_say_how_to_turn_them_on(mcp_server):
    async with Client(mcp_server) as client:
        result = await client.call_tool("read_notebook", {"notebook": "a.ipynb"})
    assert result.is_error
    error = result_error(result)
    assert "MSB_LAB_URL" in " ".join(error["suggestions"]), json.dumps(error)
