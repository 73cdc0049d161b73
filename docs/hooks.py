"""MkDocs hook: fills the reference pages from the code at build time.

A line `<!-- reference: NAME -->` in a page becomes `switchyard.reference.PAGES[NAME]()`
(the configuration, errors, headers, CLI and routes), so the reference is the code's.
"""

from __future__ import annotations

import re
from typing import Any

from switchyard.reference import PAGES

_MARKER = re.compile(r"^<!-- reference: ([a-z]+) -->$", re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in PAGES:
            raise ValueError(f"{page.file.src_path}: no reference page named {name!r}")
        return PAGES[name]()

    return _MARKER.sub(fill, markdown)
