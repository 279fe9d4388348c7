"""What the person sees: JupyterLab in headless Chromium while an assistant edits and runs cells of the open notebook.

The notebook is opened the way a person opens one (its URL); the assistant's cells, edits and streamed
output must appear without a reload, and the person's typing must reach the assistant's next read.
One cell is run through the MCP Inspector CLI (the TypeScript SDK) as well as the Python SDK.
"""

from __future__ import annotations

import asyncio
import uuid

import nbformat
import pytest

from tests.conftest import TEST_BASE
from tests.mcp_bridge.notebooks.conftest import call, finished, mcp_client, wait_for
from tests.mcp_bridge.test_inspector import FETCH_PRELOAD, Inspector, inspector_env, inspector_missing
from tests.msb_kernels.gateway.browser import STDOUT, By, LabPage, browser, page  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STREAMING = "import time\nfor i in range(6):\n    print('tick', i, flush=True)\n    time.sleep(1)"


def open_notebook(page: LabPage, lab) -> str:
    path = f"work/shared-{uuid.uuid4().hex[:6]}.ipynb"
    metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    nbformat.write(
        nbformat.v4.new_notebook(metadata=metadata, cells=[nbformat.v4.new_code_cell("")]), TEST_BASE / f"js-root-{lab.port}" / path
    )
    page.driver.get(f"{lab.url}/lab/tree/{path}?reset&token={lab.token}")
    page.wait(lambda: page.find(".jp-NotebookPanel .jp-Cell"), "the notebook to open", 180)
    page.wait_for_kernel("idle")
    return path


def cell_element(page: LabPage, index: int):
    cells = page.find(".jp-NotebookPanel .jp-Cell")
    return cells[index] if len(cells) > index else None


def cell_text(page: LabPage, index: int) -> str | None:
    cell = cell_element(page, index)
    return cell.find_element(By.CSS_SELECTOR, ".cm-content").text if cell else None


async def test_the_person_sees_the_assistants_cells_edits_and_streamed_output_live(page, lab, notebook_gateway):
    path = await asyncio.to_thread(open_notebook, page, lab)
    async with mcp_client(notebook_gateway) as assistant:
        inserted = await call(assistant, "insert_cell", notebook=path, source="print('draft')")
        index, cell_id = inserted["cells"][0]["index"], inserted["cells"][0]["id"]
        await asyncio.to_thread(page.wait, lambda: cell_text(page, index) == "print('draft')", "the inserted cell in the browser", 60)
        await call(assistant, "overwrite_cell_source", notebook=path, cell_id=cell_id, source=STREAMING)
        await asyncio.to_thread(page.wait, lambda: "tick" in (cell_text(page, index) or ""), "the edited source in the browser", 60)

        run = asyncio.create_task(call(assistant, "execute_cell", notebook=path, cell_id=cell_id))
        element = cell_element(page, index)
        await asyncio.to_thread(page.wait_for_text, element, STDOUT, "tick 1", 60)
        assert not run.done(), "the first lines showed only after the cell finished: output did not stream"
        answer = await finished(assistant, await run)
        assert answer["status"] == "ok" and answer["stdout"] == "".join(f"tick {i}\n" for i in range(6)), answer
        await asyncio.to_thread(page.wait_for_text, element, STDOUT, "tick 5", 60)
        count = answer["execution_count"]
        await asyncio.to_thread(page.wait, lambda: page.prompt(element) == f"[{count}]:", f"the prompt [{count}]:", 30)

        # The person types into their own cell; the assistant's next read has it, unsaved.
        editor = cell_element(page, 0).find_element(By.CSS_SELECTOR, ".cm-content")
        editor.click()
        editor.send_keys("person_wrote = 7")

        async def seen() -> bool:
            return (await call(assistant, "read_notebook", notebook=path))["cells"][0]["source"] == "person_wrote = 7"

        await wait_for(seen, "the person's typing in the assistant's read", timeout=30)


@pytest.mark.skipif(inspector_missing() is not None, reason=str(inspector_missing()))
async def test_the_inspector_cli_inserts_edits_and_runs_a_cell_the_person_watches(page, lab, notebook_gateway):
    path = await asyncio.to_thread(open_notebook, page, lab)
    env = inspector_env(NODE_OPTIONS=f"--import={FETCH_PRELOAD.as_uri()}", MSB_TEST_BEARER_TOKEN=notebook_gateway.token)
    inspector = Inspector([notebook_gateway.url + "/mcp"], env)
    inserted = (await inspector.call("insert_cell", notebook=path, source="print('typescript draft')")).structured
    index, cell_id = inserted["cells"][0]["index"], inserted["cells"][0]["id"]
    await asyncio.to_thread(
        page.wait, lambda: cell_text(page, index) == "print('typescript draft')", "the Inspector's cell in the browser", 60
    )
    edited = await inspector.call("overwrite_cell_source", notebook=path, cell_id=cell_id, source=STREAMING.replace("tick", "ts"))
    assert edited.structured["cells"][0]["source"].startswith("import time"), edited.result
    await asyncio.to_thread(page.wait, lambda: "'ts'" in (cell_text(page, index) or ""), "the Inspector's edit in the browser", 60)

    run = asyncio.create_task(inspector.call("execute_cell", notebook=path, cell_id=cell_id))
    element = cell_element(page, index)
    await asyncio.to_thread(page.wait_for_text, element, STDOUT, "ts 1", 60)
    assert not run.done(), "the Inspector's cell showed its first lines only after it finished"
    answer = (await run).structured
    assert answer["notebook"] == path and answer["status"] in ("ok", "running"), answer
    await asyncio.to_thread(page.wait_for_text, element, STDOUT, "ts 5", 60)
