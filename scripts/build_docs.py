"""Build the documentation site into build/docs (`make docs`): Sphinx with MyST-NB, warnings as errors, then every
link between the built pages checked.

The source is put together in build/docs-src: docs/ (pages, conf.py, screenshots) and the notebooks with the
outputs the kernel layer gave them (build/notebooks, written by tests/kernel/test_notebooks.py on today's stack).
A notebook that no test ran since it last changed is executed here first, as the test runs it.

Usage: python scripts/build_docs.py
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
EXECUTED = ROOT / "build" / "notebooks"
SOURCE = ROOT / "build" / "docs-src"
SITE = ROOT / "build" / "docs"
STAMP = "accel_magic_source_sha256"  # the executed copy's metadata: the notebook it was executed from


def source_hash(notebook: Path) -> str:
    return hashlib.sha256(notebook.read_bytes()).hexdigest()


def save_executed(nb: nbformat.NotebookNode, notebook: Path) -> Path:
    """Keep an executed notebook for the site, stamped with the notebook it came from."""
    EXECUTED.mkdir(parents=True, exist_ok=True)
    nb.metadata[STAMP] = source_hash(notebook)
    target = EXECUTED / notebook.name
    nbformat.write(nb, target)
    return target


def executed(notebook: Path) -> Path:
    """The executed copy of `notebook`: the kernel layer's when it ran this very notebook, else executed now (in a
    folder of its own, as the test runs it: a notebook may write files)."""
    target = EXECUTED / notebook.name
    if target.exists() and nbformat.read(target, as_version=4).metadata.get(STAMP) == source_hash(notebook):
        return target
    if str(ROOT / "scripts") not in sys.path:  # as when this file is run; not when a test loads it
        sys.path.insert(0, str(ROOT / "scripts"))
    from run_notebook import run

    print(f"executing {notebook.name} (the tests have not run it as it is now)", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        return save_executed(run(str(notebook), folder=folder), notebook)


def assemble() -> None:
    shutil.rmtree(SOURCE, ignore_errors=True)
    shutil.copytree(ROOT / "docs", SOURCE)
    (SOURCE / "notebooks").mkdir()
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        shutil.copy(executed(notebook), SOURCE / "notebooks" / notebook.name)


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(found["id"] or "")
        for name in ("href", "src"):
            value = found.get(name)
            if value and not (tag == "link" and found.get("rel") in ("preconnect", "dns-prefetch")):
                self.links.append(value)


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def pages(site: Path) -> list[Path]:
    """The site's pages (the theme's templates in _static left out)."""
    return [page for page in sorted(site.rglob("*.html")) if "_static" not in page.relative_to(site).parts]


def broken_links(site: Path) -> list[str]:
    """Every link of the site's pages to a file of the site that is missing, or to an anchor its page lacks."""
    parsed_pages = {page: _parse(page) for page in pages(site)}
    broken = []
    for page, parsed in parsed_pages.items():
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {link} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = parsed_pages[target].ids if target in parsed_pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{page.relative_to(site)}: {link} (no such anchor)")
    return broken


def main() -> int:
    assemble()
    shutil.rmtree(SITE, ignore_errors=True)
    build = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(SOURCE), str(SITE)]
    if subprocess.run(build, cwd=ROOT).returncode:
        return 1
    broken = broken_links(SITE)
    for line in broken:
        print(f"broken link: {line}", file=sys.stderr)
    if broken:
        return 1
    print(f"the site is in {SITE.relative_to(ROOT)}/index.html ({len(pages(SITE))} pages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
