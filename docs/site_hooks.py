"""mkdocs hooks: the site's home page is README.md, and the figures the results pages show from benches/results/
are served beside them, so that the same Markdown reads right on the repository and on the site."""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The API reference reads the sources statically (griffe), by import name; pyproject maps the import names onto
# the design card's folders (package-dir), which griffe does not read: a tree of links shows it the names.
SOURCES = os.path.join(ROOT, ".docs-sources")


def _link_sources() -> None:
    package = os.path.join(SOURCES, "torch_stagehand")
    os.makedirs(package, exist_ok=True)
    links = {name: os.path.join(ROOT, "stagehand", name) for name in os.listdir(os.path.join(ROOT, "stagehand"))}
    links.update({folder: os.path.join(ROOT, folder) for folder in ("compiler", "runtime", "kernels")})
    for name, target in links.items():
        link = os.path.join(package, name)
        if os.path.islink(link) and os.path.realpath(link) == os.path.realpath(target):
            continue
        if os.path.islink(link):  # a checkout moved or copied: its links point into the other tree
            os.unlink(link)
        try:
            os.symlink(os.path.relpath(target, package), link)
        except FileExistsError:  # another process (a parallel test run) made it meanwhile
            pass


_link_sources()
RESULTS_LINK = re.compile(r"\]\(\.\./\.\./benches/results/([\w.-]+\.png)\)")


def on_files(files, config):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        files.append(File.generated(config, "index.md", content=f.read()))
    for page in files.documentation_pages():
        text = open(page.abs_src_path, encoding="utf-8").read() if page.abs_src_path else ""
        for name in RESULTS_LINK.findall(text):
            if files.get_file_from_path(f"results/figures/{name}") is None:
                files.append(File.generated(config, f"results/figures/{name}",
                                            abs_src_path=os.path.join(ROOT, "benches", "results", name)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "index.md":  # README.md links into docs/ from the repository's root
        return re.sub(r"\]\(docs/", "](", markdown)
    markdown = markdown.replace("](../../README.md", "](../index.md")  # the repository's README is the home page
    return RESULTS_LINK.sub(r"](figures/\1)", markdown)
