"""A griffe extension for the API reference: reads the packages' reST markup as Markdown.

The docstrings of ``poller`` and ``buffer`` are Google style with Sphinx cross-reference roles
(``:class:`~buffer.seam.Policy```) and ``::`` literal-block openers. mkdocstrings renders
Markdown, where those would show as they are typed; this rewrites each docstring as it is loaded:
a role becomes inline code of its target (the last part only after ``~``), and a paragraph
ending in ``::`` ends in ``:`` (the indented block after it is a code block in Markdown too).
The sources are not changed.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")
_LITERAL_OPENER = re.compile(r"(?m)^([ \t]*)(.*?)[ \t]*::[ \t]*$")


def _role(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _opener(match: re.Match[str]) -> str:
    indent, text = match.groups()
    return f"{indent}{text}:" if text else ""


def markdown_of(text: str) -> str:
    """The docstring ``text`` with its roles and ``::`` openers rewritten as Markdown."""
    return _LITERAL_OPENER.sub(_opener, _ROLE.sub(_role, text))


class SphinxRolesAsCode(Extension):
    """Rewrites every docstring griffe loads (see the module docstring)."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_of(obj.docstring.value)
