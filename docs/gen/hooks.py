"""MkDocs hooks (mkdocs.yml `hooks:`): add the generated pages (docs/gen/reference.py), and
point each page's links at the site and its figures at BENCHMARKS.md's."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference  # noqa: E402  (beside this file)


def on_files(files, config):
    pages = {"cli.md": reference.cli_reference(), "api.md": reference.api_reference()}
    for repo_path, page in reference.INCLUDED.items():
        pages[page] = reference.included_page(repo_path)
    for uri, content in pages.items():
        stub = files.get_file_from_path(uri)  # docs/cli.md and docs/api.md: what GitHub shows instead
        if stub is not None:
            files.remove(stub)
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.generated_by is not None or page.file.src_uri in reference.INCLUDED.values():
        return markdown  # generated pages are already the site's
    return reference.docs_page(markdown, page.file.src_uri)
