"""mkdocs hook (mkdocs.yml ``hooks``): mq's docstrings use Sphinx cross-reference roles
(``:class:`MQ```), which mkdocstrings shows verbatim. The rendered pages show them as plain code,
as Sphinx would (``~a.b.C`` as ``C``), and an RST literal-block marker (``::``) as a colon."""

from __future__ import annotations

import re

_ROLES = r":(?:class|meth|func|mod|data|attr|exc|obj):"
_SHORT = re.compile(_ROLES + r"<code>~(?:\w+\.)*(\w+)</code>")
_FULL = re.compile(_ROLES + r"<code>([\w.]+)</code>")


def on_page_content(html: str, **_: object) -> str:
    html = _FULL.sub(r"<code>\1</code>", _SHORT.sub(r"<code>\1</code>", html))
    return html.replace("<p>::</p>\n", "").replace("::</p>", ":</p>")
