"""MkDocs hooks (mkdocs.yml `hooks:`): add the generated pages (docs/gen/reference.py)."""

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
        files.append(File.generated(config, uri, content=content))
    return files
