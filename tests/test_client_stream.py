"""WorkerClient.ask(on_text=...) streams the answer from a real supervised `deskeye-worker --engine ocr` and hands
the growing summary to the caller (the overlay), then returns the same Answer as without streaming."""

from __future__ import annotations

import pytest

from deskeye.worker.client import WorkerClient, partial_summary
from deskeye.errors import AnswerError
from deskeye.worker.supervisor import WorkerSupervisor
from tests.fixtures.text_image import render_text_png
from tests.test_supervisor import ocr_settings

pytestmark = [pytest.mark.subprocess]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    supervisor = WorkerSupervisor(ocr_settings())
    supervisor.start()
    client = WorkerClient(supervisor, supervisor.settings)
    yield client
    client.close()
    supervisor.stop()


@pytest.mark.slow
def test_on_text_gets_the_summary_as_it_grows_and_ask_returns_the_whole_answer(client):
    png = render_text_png(["Quarterly budget review", "Meeting at 3pm in room 4", "Revenue up 12%"])
    seen: list[str] = []
    streamed = client.ask("What is on this screen?", png, on_text=seen.append)
    whole = client.ask("What is on this screen?", png)
    assert len(seen) >= 3, seen
    assert all(later.startswith(earlier) and later != earlier for earlier, later in zip(seen, seen[1:])), seen
    assert seen[-1] == streamed.summary == whole.summary
    assert streamed.key_objects == whole.key_objects and streamed.engine == "ocr"


def test_an_error_event_in_the_stream_is_an_answer_error(client):
    """The OCR engine refuses a question without an image once the stream has started."""
    seen: list[str] = []
    with pytest.raises(AnswerError, match="reads the text in an image"):
        client.ask("What time is it?", None, on_text=seen.append)
    assert seen == []


@pytest.mark.parametrize("text, summary", [
    ("", None),
    ('{"summ', None),
    ('{"summary": "', ""),
    ('{"summary": "A terminal wi', "A terminal wi"),
    ('{"summary": "caf\\u00', "caf"),                        # an escape cut in two waits for its end
    ('{"summary": "caf\\u00e9 \\"open\\"", "key_objects": ["x"]}', 'café "open"'),
    ('{"key_objects": [], "summary": "late"}', None),        # summary not first: nothing to show early
    ("A plain-text answer", None),
])
def test_partial_summary_reads_the_summary_of_an_unfinished_answer(text, summary):
    assert partial_summary(text) == summary
