"""The ids clients choose (request, task and tool call ids): one pattern, checked
wherever such an id arrives (a request header, an MCP call, an approval's scope)."""

from __future__ import annotations

import re

ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
