"""Import rules of the package layout: caches below the engine, tiers below the tree, core code below the server."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kestrel"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (TYPE_CHECKING blocks and function bodies included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _offenders(files, banned: str) -> list[str]:
    return [
        str(f.relative_to(ROOT)) for f in files if any(m == banned or m.startswith(banned + ".") for m in _imports(f))
    ]


def test_cache_package_does_not_import_the_engine():
    assert _offenders(sorted((ROOT / "cache").rglob("*.py")), "kestrel.engine") == []


def test_hicache_does_not_import_the_radix_tree():
    assert _offenders([ROOT / "cache" / "hicache.py"], "kestrel.cache.radix") == []


def test_core_code_does_not_import_the_server():
    core = [f for f in sorted(ROOT.rglob("*.py")) if f.relative_to(ROOT).parts[0] != "server" and f != ROOT / "cli.py"]
    assert core and _offenders(core, "kestrel.server") == []


def test_disaggregation_hooks_in_from_the_engine_not_from_the_scheduler_or_caches():
    below = sorted((ROOT / "cache").rglob("*.py")) + [ROOT / "engine" / "scheduler.py", ROOT / "engine" / "request.py"]
    assert _offenders(below, "kestrel.disagg") == []
