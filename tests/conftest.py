from html.parser import HTMLParser

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny GEMMs: one intra-op thread is far faster than two on a shared, loaded machine.

    Use per module: `pytestmark = pytest.mark.usefixtures("one_torch_thread")`.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class HtmlPage(HTMLParser):
    """What a reader of an HTML page gets: every start tag, the text of each <td>/<th> by
    row (<tr>), of each <code>, and all the text."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags, self.rows, self.code, self.text = [], [], [], ""
        self._cell = self._code = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.rows[-1].append("")
            self._cell = True
        elif tag == "code":
            self.code.append("")
            self._code = True

    def handle_endtag(self, tag):
        self._cell = self._cell and tag not in ("td", "th")
        self._code = self._code and tag != "code"

    def handle_data(self, data):
        self.text += data
        if self._cell:
            self.rows[-1][-1] += data
        if self._code:
            self.code[-1] += data


@pytest.fixture(scope="session")
def html_page():
    """html_page(text) -> HtmlPage: .tags, .rows, .code, .text of an HTML page."""
    return HtmlPage
