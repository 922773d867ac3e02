"""The package's shape: no two packages or modules import each other, and no module grows past what fits in a head."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "draftlab"
MAX_MODULE_LINES = 400


def _unit(module: str) -> str:
    """The package (draftlab.perf) or top-level module (draftlab.api) a dotted module name belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every draftlab module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("draftlab.")}


def unit_graph() -> dict[str, set[str]]:
    """draftlab's units (packages and top-level modules) -> the other units each imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in SOURCE.rglob("*.py"):
        source = _unit(_module_name(path))
        graph[source] |= {_unit(name) for name in _imports(path)} - {source, "draftlab"}
    return graph


def test_no_two_packages_import_each_other():
    graph = unit_graph()
    packages = {p.name for p in SOURCE.iterdir() if (p / "__init__.py").exists()}
    mutual = sorted(
        (a, b) for a in graph for b in graph[a]
        if a < b and a in graph.get(b, set()) and {a.split(".")[1], b.split(".")[1]} & packages
    )
    assert not mutual, f"packages importing each other: {mutual}"


def module_graph() -> dict[str, set[str]]:
    """draftlab's modules -> the draftlab modules each imports (at the top, inside a function, or for type checks)."""
    return {_module_name(path): _imports(path) - {_module_name(path)} for path in SOURCE.rglob("*.py")}


def test_no_two_modules_import_each_other():
    graph = module_graph()
    mutual = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, set()))
    assert not mutual, f"modules importing each other: {mutual}"


def test_the_graph_sees_known_imports():
    graph = unit_graph()
    assert "draftlab.backends" in graph["draftlab.engine"]
    assert "draftlab.perf" in graph["draftlab.study"]  # the report shows the model's validation
    assert "draftlab.study.run.store" in module_graph()["draftlab.study.run.sweep"]


def test_no_module_is_over_the_limit():
    long = {str(p.relative_to(SOURCE)): n for p in SOURCE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def _role_classes() -> dict[str, str]:
    """Drafter and model classes -> where they may be asked for: the module that defines them (drafters/,
    models.py), or the backends package for the engines' own model classes (engine choices live there)."""
    defined = {}
    for path in [*(SOURCE / "drafters").glob("*.py"), SOURCE / "backends" / "gguf.py", SOURCE / "models.py"]:
        owner = "draftlab.backends" if path.parent.name == "backends" else _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined[node.name] = owner
    return defined


def test_no_module_probes_drafter_or_model_classes_it_does_not_define():
    """Stages talk through contracts: no isinstance on another module's drafter or model class, no getattr/hasattr
    on a drafter, draft or model object (configs, tokenizers and arguments may be read that way)."""
    defined = _role_classes()
    probed = re.compile(r"(drafter|draft|inner|source|helper|guide)$|(^|\.)model$")
    found = []
    for path in SOURCE.rglob("*.py"):
        module, tree = _module_name(path), ast.parse(path.read_text())
        for call in _calls(tree, "isinstance"):
            classes = call.args[1].elts if isinstance(call.args[1], ast.Tuple) else [call.args[1]]
            names = {c.id for c in classes if isinstance(c, ast.Name)}
            found += [f"{module}: isinstance(..., {n})" for n in names if not module.startswith(defined.get(n, module))]
        for call in [*_calls(tree, "getattr"), *_calls(tree, "hasattr")]:
            target = ast.unparse(call.args[0])
            if probed.search(target):
                found.append(f"{module}: {call.func.id}({target}, ...)")
    assert not found, f"probes between stages: {found}"


def test_only_the_backends_registry_and_cli_name_the_llamacpp_engine():
    """The rest of the package asks a target's engine what it can do (`backends.engines.Engine`)."""
    allowed = ("draftlab.backends", "draftlab.registry", "draftlab.cli")
    named = [_module_name(p) for p in SOURCE.rglob("*.py") if '"llamacpp"' in p.read_text()
             and not _module_name(p).startswith(allowed)]
    assert not named, f"modules comparing engine names: {named}"


def test_every_timed_decode_goes_through_the_measurement_loop():
    """No module outside `draftlab.measure` reads a clock around a decode (`generate`, a contender's `run`); the
    engine's own stopwatch times its phases inside one generation."""
    decodes = {"generate", "hf_generate", "run", "run_once"}
    timed = []
    for path in SOURCE.rglob("*.py"):
        module, tree = _module_name(path), ast.parse(path.read_text())
        if module.startswith("draftlab.measure"):
            continue
        clocks = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("perf_counter", "time")
                  and isinstance(n.value, ast.Name) and n.value.id == "time"]
        called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                  for n in ast.walk(tree) if isinstance(n, ast.Call)}
        if clocks and called & decodes:
            timed.append(f"{module}: {sorted(called & decodes)}")
    assert not timed, f"timed decodes outside draftlab.measure: {timed}"


ENGINE_NAMES = {"torch", "llamacpp", "llama.cpp", "llama-server", "vllm", "sglang"}
TABLES = ("draftlab.contenders.methods", "draftlab.backends.engines")  # where methods and engines are named


def _string_constants(node: ast.AST) -> set[str]:
    """The string literals an operand of a comparison is, or holds (a tuple, list, set or dict of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {v for e in node.elts for v in _string_constants(e)}
    return set()


def _names_a_method(node: ast.AST) -> bool:
    """Whether an operand reads a method's name: `x.method`, `row["method"]`, `method`, `plain_method`..."""
    text = ast.unparse(node)
    return bool(re.search(r"(^|\.|_)method$|\[['\"]method['\"]\]$", text))


def name_comparisons() -> list[str]:
    """Comparisons of a method name with a string literal, or of anything with an engine's name, outside the
    tables."""
    found = []
    for path in SOURCE.rglob("*.py"):
        module, tree = _module_name(path), ast.parse(path.read_text())
        if module in TABLES:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            literals = set().union(*(_string_constants(o) for o in operands))
            if literals and any(_names_a_method(o) for o in operands):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
            elif literals & ENGINE_NAMES:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_method_or_engine_name_is_compared_with_a_string_outside_the_tables():
    """A method is asked of its entry in `contenders.methods`, an engine of its entry in `backends.engines`."""
    found = name_comparisons()
    assert not found, "names compared with strings outside the tables:\n" + "\n".join(found)


def test_the_name_check_finds_a_comparison(tmp_path):
    tree = ast.parse('if cell.method == "sps" or row["method"] in ("ar", "hf") or engine != "llama-server": pass')
    compare = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert len(compare) == 3 and all(_string_constants(c.comparators[0]) for c in compare)
    assert _names_a_method(compare[0].left) and _names_a_method(compare[1].left)
    assert _string_constants(compare[2].comparators[0]) & ENGINE_NAMES


SPEC_READERS = ("draftlab.registry", "draftlab.drafters.kinds")  # where a drafter spec string is read
DRAFTER_KINDS = {"none", "ar", "ngram", "suffix", "layers", "model", "designed", "eagle3", "tree", "staged", "merged",
                 "adapt"}


def _reads_a_drafter_spec(node: ast.AST) -> bool:
    """Whether an operand is a drafter spec or a cell's drafter label: `drafter`, `cell.drafter`, `draft`, `spec`..."""
    return bool(re.search(r"(^|\.|_)(drafter|draft|spec)$|^pick\[0\]$", ast.unparse(node)))


def drafter_spec_reads(tree: ast.AST) -> list[int]:
    """Lines where a drafter spec is compared with a drafter kind's name, or tested for its prefix, by string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = set().union(*(_string_constants(o) for o in operands))
            if literals & DRAFTER_KINDS and any(_reads_a_drafter_spec(o) for o in operands):
                found.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
              and _reads_a_drafter_spec(node.func.value)):
            prefixes = set().union(*(_string_constants(a) for a in node.args))
            if any(prefix.rstrip("/:") in DRAFTER_KINDS for prefix in prefixes):
                found.append(node.lineno)
    return found


def test_drafter_specs_are_read_in_one_place():
    """What a drafter spec means (plain decoding, lookup, suffix, adapting) is asked of `draftlab.drafters.kinds`
    (`is_plain_drafter`, `is_lookup`, `learns_across_requests`, `is_adapting`), never read off the string."""
    found = [f"{_module_name(path)}:{line}" for path in SOURCE.rglob("*.py") if _module_name(path) not in SPEC_READERS
             for line in drafter_spec_reads(ast.parse(path.read_text()))]
    assert not found, f"drafter specs read by string outside the registry: {found}"


def test_the_drafter_check_finds_a_read():
    source = 'a = cell.drafter == "none" or s.drafter.startswith("suffix") or spec.startswith(("adapt/", "adapt:"))'
    assert drafter_spec_reads(ast.parse(source)) == [1, 1, 1] and not drafter_spec_reads(ast.parse('key == "tree"'))


def test_the_units_form_layers_and_few_modules_lie_loose_at_the_top():
    """Packages and top-level modules import one another without a cycle of any length (so each stands on a layer
    and imports only those below it), and every module but a few lives in a package named for its role."""
    from graphlib import CycleError, TopologicalSorter

    graph = unit_graph()
    try:
        layers = list(TopologicalSorter({unit: deps for unit, deps in graph.items()}).static_order())
    except CycleError as exc:
        raise AssertionError(f"units in a cycle: {exc.args[1]}") from None
    assert "draftlab.errors" in layers and "draftlab.study" in layers
    loose = sorted(p.name for p in SOURCE.glob("*.py"))
    assert len(loose) <= 12, f"{len(loose)} modules directly in src/draftlab: {loose}"


def test_the_study_runs_on_one_side_and_answers_on_the_other():
    """`draftlab.study` is two packages: the run side (plans and measures) never imports the answer side (reads and
    tells), so what is measured cannot depend on how it is reported; no module lies loose beside them."""
    study = SOURCE / "study"
    assert sorted(p.name for p in study.glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in study.iterdir() if (p / "__init__.py").exists()) == ["answer", "run"]
    graph = module_graph()
    crossing = sorted((module, name) for module, names in graph.items() if module.startswith("draftlab.study.run")
                      for name in names if name.startswith("draftlab.study.answer"))
    assert not crossing, f"run-side modules importing the answer side: {crossing}"
    assert any(name.startswith("draftlab.study.run") for name in graph["draftlab.study.answer.results"])
