"""The layer rules of docs/ARCHITECTURE.md, checked on the source: every import statement of every
module of the package (also those inside functions), and every string a module hands to a child
process. A rule broken here is a seam that the next feature would have to cut through."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _toml_table(header: str) -> dict[str, str]:
    """`"key" = "value"` lines of one pyproject.toml table (tomllib is 3.11+; llmrs runs on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    body = text.split(f"[{header}]\n", 1)[1].split("\n[", 1)[0]
    return {k: v for k, v in re.findall(r'^"?([\w.-]+)"?\s*=\s*"([^"]*)"', body, re.M)}


PACKAGE_DIRS = _toml_table("tool.setuptools.package-dir")      # llmrs.compiler -> compiler ...
# where the command lines may live: the console scripts and the one CLI helper module
CONSOLE_SCRIPTS = {v.split(":")[0] for v in _toml_table("project.scripts").values()}
CLI_HELPER = "llmrs.cliutil"
CLI_MODULES = CONSOLE_SCRIPTS | {CLI_HELPER}

# the runtime core: what a device needs to run a plan, behind every interface
RUNTIME_CORE = ("llmrs.runtime.engine", "llmrs.runtime.backends", "llmrs.runtime.kv", "llmrs.runtime.sampler",
                "llmrs.runtime.model", "llmrs.runtime.server", "llmrs.runtime.chat", "llmrs.runtime.chat_session",
                "llmrs.runtime.plan", "llmrs.runtime.calibrate", "llmrs.runtime.batch", "llmrs.runtime.scheduler",
                "llmrs.runtime.text", "llmrs.runtime.speculative")
# what of the compiler the runtime may share: the IR, its interpreter and the plan format
COMPILER_ONLY = ("llmrs.compiler.passes", "llmrs.compiler.codegen", "llmrs.compiler.pipeline",
                 "llmrs.compiler.build", "llmrs.compiler.cli")
MEASURING = ("llmrs.measure",)


@dataclass(frozen=True)
class Import:
    module: str         # the importing module, dotted
    target: str         # the imported module (or module.name), dotted
    line: int


def _packages() -> list[str]:
    """[tool.setuptools] packages: every package the wheel installs."""
    body = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools]\n", 1)[1].split("\n[", 1)[0]
    return re.findall(r'"(llmrs[\w.]*)"', body)


def _folder(package: str) -> Path:
    """llmrs.runtime.kv -> runtime/kv, through package-dir's mapping of the longest prefix."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in PACKAGE_DIRS:
            return ROOT / PACKAGE_DIRS[".".join(parts[:n])] / Path(*parts[n:])
    return ROOT / Path(*parts)


def _module_files() -> dict[str, Path]:
    out = {}
    for package in _packages():
        for path in sorted(_folder(package).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


MODULES = _module_files()


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`: annotations, never run."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports() -> list[Import]:
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                found += [Import(name, a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.stem == "__init__", node)
                found.append(Import(name, base, node.lineno))
                found += [Import(name, f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


IMPORTS = _imports()


def _under(target: str, prefixes) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def _where(imp: Import) -> str:
    return f"{MODULES[imp.module].relative_to(ROOT)}:{imp.line} ({imp.module} imports {imp.target})"


def test_the_package_is_found():
    assert {"llmrs.runtime.engine", "llmrs.compiler.ir", "llmrs.api"} <= set(MODULES)
    assert CONSOLE_SCRIPTS <= set(MODULES), CONSOLE_SCRIPTS - set(MODULES)
    assert CLI_HELPER in MODULES


def test_argparse_only_in_the_command_lines():
    bad = [_where(i) for i in IMPORTS if i.target == "argparse" and i.module not in CLI_MODULES]
    assert not bad, "argparse outside the console scripts and " + CLI_HELPER + ":\n" + "\n".join(bad)


def test_no_library_module_imports_a_command_line():
    bad = [_where(i) for i in IMPORTS
           if i.module not in CLI_MODULES and _under(i.target, CLI_MODULES)]
    assert not bad, "library code imports a CLI module:\n" + "\n".join(bad)


def test_the_runtime_core_imports_no_pass_codegen_or_measuring_tool():
    bad = [_where(i) for i in IMPORTS if _under(i.module, RUNTIME_CORE)
           and (_under(i.target, COMPILER_ONLY) or _under(i.target, MEASURING))]
    assert not bad, "the runtime core reaches into the compiler or a measuring tool:\n" + "\n".join(bad)


def test_the_compiler_and_models_never_import_the_runtime():
    bad = [_where(i) for i in IMPORTS if _under(i.module, ("llmrs.compiler", "llmrs.models"))
           and _under(i.target, ("llmrs.runtime", "llmrs.measure", "llmrs.api"))]
    assert not bad, "\n".join(bad)


def _module_graph(imports: list[Import]) -> dict[str, set[str]]:
    """module -> the package modules it imports (a name imported from a module counts as that module)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in imports:
        target = i.target
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != i.module and not i.module.startswith(target + "."):   # not its own package
            graph[i.module].add(target)
    return graph


def test_no_module_imports_one_that_imports_it_back():
    """Import cycles (also through a late import inside a function) make layers meaningless."""
    import networkx as nx

    cycles = list(nx.simple_cycles(nx.DiGraph([(a, b) for a, bs in _module_graph(IMPORTS).items() for b in bs])))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles)


def _child_commands() -> list[str]:
    """Every string literal a module passes to subprocess (or builds for it with python_argv)."""
    found = []
    for name, path in MODULES.items():
        if name in CLI_MODULES:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            if not (func.startswith("subprocess.") or func.endswith("python_argv") or func.startswith("os.exec")
                    or func in ("os.system", "os.popen")):
                continue
            strings = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {s}" for s in strings]
    return found


def test_library_code_runs_no_command_line_in_a_child_process():
    clis = [m for m in CLI_MODULES] + ["llmrs-", "-m llmrs"]
    bad = [c for c in _child_commands() if any(cli in c for cli in clis) or ".main(" in c or "import main" in c]
    assert not bad, "library code runs a CLI in a child process:\n" + "\n".join(bad)


@pytest.mark.parametrize("rule", ["argparse", "cli", "core", "compiler", "cycle"])
def test_the_checker_catches_what_it_looks_for(rule, monkeypatch):
    """Each rule fails on an import that breaks it (so a rule cannot pass by finding nothing)."""
    planted = {
        "argparse": Import("llmrs.runtime.engine", "argparse", 1),
        "cli": Import("llmrs.runtime.model", "llmrs.runtime.cli.make_backend", 1),
        "core": Import("llmrs.runtime.engine", "llmrs.compiler.codegen.llvm", 1),
        "compiler": Import("llmrs.compiler.ir", "llmrs.runtime.plan", 1),
        "cycle": Import("llmrs.compiler.errors", "llmrs.compiler.ir.Graph", 1),
    }[rule]
    check = {"argparse": test_argparse_only_in_the_command_lines,
             "cli": test_no_library_module_imports_a_command_line,
             "core": test_the_runtime_core_imports_no_pass_codegen_or_measuring_tool,
             "compiler": test_the_compiler_and_models_never_import_the_runtime,
             "cycle": test_no_module_imports_one_that_imports_it_back}[rule]
    monkeypatch.setitem(globals(), "IMPORTS", IMPORTS + [planted])
    with pytest.raises(AssertionError):
        check()
