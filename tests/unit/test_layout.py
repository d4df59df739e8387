"""The source tree's folders are its process roles, and imports flow one way between them.

Read off the source with :mod:`ast` (every ``import``, at module level or inside a function or
``TYPE_CHECKING`` block); nothing is imported. In ``server/kv/``:

- ``scheduler/`` (vLLM's scheduler thread) imports no torch, not even through another module
  of ``server/kv``, and nothing of ``worker/``: the plan and the report in ``metadata.py`` are
  the whole interface. It may import ``registry/`` (the engine's registry thread lives here)
  and ``tiers/`` (Redis existence checks, the disk scan at start; those modules are torch-free).
- ``worker/`` imports nothing of ``scheduler/`` or ``registry/``.
- ``registry/`` imports no torch and nothing of ``scheduler/``, ``worker/`` or ``tiers/``.
- ``tiers/`` imports nothing of ``scheduler/``, ``worker/`` or ``registry/``: only the shared
  top-level modules and each other.
- The shared top-level modules (``server/kv/*.py``) import none of the subpackages, with the
  edges in :data:`SHARED_TO_SUBPACKAGE` as the only exceptions:
  ``layout.py`` -> ``tiers/manifest.py`` (the layout *is* the tiers' ``Manifest``, built
  from vLLM's config; the manifest's fingerprint names the disk folder and the Redis prefix).
- ``connector.py`` is the facade vLLM loads in both roles, so it may import every folder;
  ``server/kv/__init__.py`` re-exports the API process's session control
  (``registry/control.py``) and nothing else.

In ``langgraph_kvcache/checkpoint/``, the session lifecycle (``sessions/``) is imported only
by the two savers (``sync.py``, ``aio.py``) that build it; ``sessions/`` itself may import the
checkpoint core (``base``, ``hooks``, ``schema``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHARED_TO_SUBPACKAGE = {("layout", "tiers.manifest")}
"""(importer, imported) edges below ``server.kv``: a shared top-level module into a subpackage."""

SUBPACKAGES = ("scheduler", "worker", "registry", "tiers")


def module_imports(root: Path, package: str) -> dict[str, set[str]]:
    """Every module under ``root`` (named from ``package``) -> the modules it imports.

    ``from pkg import name`` counts as importing ``pkg.name`` where that is a module here,
    else ``pkg``.
    """
    raw: dict[str, list[tuple[str, list[str]]]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        is_init = parts[-1] == "__init__"
        if is_init:
            parts.pop()
        found = raw.setdefault(".".join(parts), [])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.extend((alias.name, []) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = parts[: len(parts) - node.level + (1 if is_init else 0)]
                    module = ".".join(base + ([module] if module else []))
                found.append((module, [alias.name for alias in node.names]))
    graph: dict[str, set[str]] = {}
    for name, found in raw.items():
        graph[name] = set()
        for module, names in found:
            subs = {f"{module}.{n}" for n in names} & raw.keys()
            graph[name] |= subs or {module}
    return graph


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    """``start`` and every module of ``graph`` it imports, directly or not (packages included)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        parents = [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]
        todo.extend([*graph[name], *parents])
    return seen


def role(name: str, package: str) -> str:
    rest = name.removeprefix(package).lstrip(".").split(".")
    if rest == [""]:
        return "init"
    if rest[0] in SUBPACKAGES:
        return rest[0]
    return "connector" if rest == ["connector"] else "shared"


def kv_violations(root: Path, package: str = "server.kv") -> list[str]:
    """Each import that breaks the rules of the module docstring, as ``importer -> imported``."""
    graph = module_imports(root, package)
    bad = []

    def sub(target: str) -> str | None:
        return role(target, package) if target.startswith(package + ".") else None

    def uses_torch(name: str) -> bool:
        return any(
            m == "torch" or m.startswith("torch.") for n in closure(graph, name) for m in graph[n]
        )

    forbidden = {
        "scheduler": {"worker"},
        "worker": {"scheduler", "registry"},
        "registry": {"scheduler", "worker", "tiers"},
        "tiers": {"scheduler", "worker", "registry"},
        "shared": set(SUBPACKAGES),
        "init": set(SUBPACKAGES),
        "connector": set(),
    }
    for name, imported in graph.items():
        mine = role(name, package)
        for target in sorted(imported):
            edge = (name.removeprefix(package + "."), target.removeprefix(package + "."))
            if edge in SHARED_TO_SUBPACKAGE or (mine, edge[1]) == ("init", "registry.control"):
                continue
            if sub(target) in forbidden[mine]:
                bad.append(f"{name} -> {target}")
        if mine in ("scheduler", "registry") and uses_torch(name):
            bad.append(f"{name} -> torch")
    return bad


def test_kv_imports_flow_one_way() -> None:
    root = ROOT / "server" / "kv"
    graph = module_imports(root, "server.kv")
    for folder in SUBPACKAGES:  # the rules see every folder (a rename would make them vacuous)
        assert any(role(n, "server.kv") == folder for n in graph), folder
    assert kv_violations(root) == []


def test_checkpoint_sessions_imported_by_the_savers_only() -> None:
    root = ROOT / "langgraph_kvcache"
    graph = module_imports(root, "langgraph_kvcache")
    sessions = "langgraph_kvcache.checkpoint.sessions"
    users = {
        name
        for name, imported in graph.items()
        if not name.startswith(sessions) and any(m.startswith(sessions) for m in imported)
    }
    assert users == {"langgraph_kvcache.checkpoint.sync", "langgraph_kvcache.checkpoint.aio"}


def test_the_check_fails_on_upward_imports(tmp_path: Path) -> None:
    files = {
        "__init__.py": "from pkg.registry.control import SessionControl\n",
        "connector.py": "from pkg.scheduler.plan import x\nfrom pkg.worker.copy import y\n",
        "layout.py": "from pkg.tiers.manifest import Manifest\n",
        "keys.py": "from pkg.tiers import disk\n",  # shared -> tiers: not an allowed edge
        "scheduler/__init__.py": "",
        "scheduler/plan.py": "from pkg import keys\nfrom pkg.worker import copy\n",
        "scheduler/lookups.py": "from .helper import f\n",
        "scheduler/helper.py": "import torch.nn\n",
        "worker/__init__.py": "",
        "worker/copy.py": "import torch\nfrom ..scheduler.plan import x\n",
        "registry/__init__.py": "",
        "registry/control.py": "from pkg.tiers.disk import Manifest\n",
        "tiers/__init__.py": "",
        "tiers/disk.py": "from pkg import keys\n\ndef f():\n    from pkg.registry import control\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert sorted(kv_violations(tmp_path, "pkg")) == [
        "pkg.keys -> pkg.tiers.disk",
        "pkg.registry.control -> pkg.tiers.disk",
        "pkg.scheduler.helper -> torch",
        "pkg.scheduler.lookups -> torch",
        "pkg.scheduler.plan -> pkg.worker.copy",
        "pkg.scheduler.plan -> torch",
        "pkg.tiers.disk -> pkg.registry.control",
        "pkg.worker.copy -> pkg.scheduler.plan",
    ]
