"""Plant one-line bugs and see which the tests catch (mutation testing, small and our own).

Each mutant changes one expression on one line of a module that decides numbers -- a comparison
flipped or loosened (`<` -> `<=`), an arithmetic operator swapped (`+` -> `-`), `and` <-> `or`,
a `not` dropped, a number moved by one, `True` <-> `False` -- and runs the tests that exercise that
module against it, in a copy of the tree so the working checkout is never touched. A mutant is
*killed* when the tests fail (or time out), *survives* when they pass. docs/testing.md says how to
read the result and lists the survivors that are equivalent (no behaviour changes).

    python tools/mutants.py --list tetrad/inference/worker/sampler.py          # the mutants, not run
    python tools/mutants.py --sample 20 --seed 3 tetrad/planner/*.py   # 20 drawn at random
    python tools/mutants.py tetrad/parallel/zero.py --tests tests/test_zero.py

Which tests run for a module: `--tests` when given, else its entry in TEST_MAP below, else the
test files that name the module (its dotted path or `from tetrad.x import module`), else the whole
suite.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                 ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
                 ast.In: ast.NotIn, ast.NotIn: ast.In}
BINARY_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
                ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult,
                ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr,
                ast.BitOr: ast.BitAnd}


@dataclass(frozen=True)
class Mutant:
    path: str  # relative to the repository root
    line: int
    column: int
    before: str  # the expression as written
    after: str  # the expression planted instead

    def describe(self) -> str:
        return f"{self.path}:{self.line}: {self.before}  ->  {self.after}"


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes whose mutation cannot change behaviour or only changes a message: docstrings,
    annotations, f-strings, the arguments of `raise`, `assert` messages and logging/printing."""
    skipped: set[int] = set()

    def skip(node: ast.AST | None) -> None:
        if node is not None:
            skipped.update(id(inner) for inner in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skip(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skip(node.returns)
            for argument in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                skip(argument.annotation)
        if isinstance(node, ast.AnnAssign):
            skip(node.annotation)
        if isinstance(node, ast.JoinedStr):
            skip(node)
        if isinstance(node, ast.Raise):
            skip(node.exc)
        if isinstance(node, ast.Assert):
            skip(node.msg)
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name in {"print", "warn", "warning", "info", "debug", "write"}:
                skip(node)
    return skipped


def _variants(node: ast.AST) -> list[ast.AST]:
    """The one-change variants of `node` itself (not of its children)."""
    out: list[ast.AST] = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        swap = COMPARE_SWAPS.get(type(node.ops[0]))
        if swap:
            out.append(ast.Compare(node.left, [swap()], node.comparators))
    elif isinstance(node, (ast.BinOp, ast.AugAssign)):
        swap = BINARY_SWAPS.get(type(node.op))
        if swap:
            changed = copy.copy(node)
            changed.op = swap()
            out.append(changed)
    elif isinstance(node, ast.BoolOp):
        out.append(ast.BoolOp(ast.Or() if isinstance(node.op, ast.And) else ast.And(), node.values))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append(node.operand)
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        out.append(ast.Constant(not node.value))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        out.append(ast.Constant(node.value + 1))
        if node.value != 0:
            out.append(ast.Constant(node.value - 1 if type(node.value) is int else 0.0))
    return out


def mutants_of(path: Path) -> list[Mutant]:
    source = path.read_text()
    tree = ast.parse(source)
    skipped = _skipped_nodes(tree)
    lines = source.splitlines()
    found: list[Mutant] = []
    for node in ast.walk(tree):
        if id(node) in skipped or not hasattr(node, "lineno") or node.lineno != node.end_lineno:
            continue
        before = ast.get_source_segment(source, node)
        if before is None:
            continue
        for variant in _variants(node):
            after = ast.unparse(variant)
            if isinstance(node, ast.AugAssign):
                after = after.strip()
            line = lines[node.lineno - 1]
            # ast's offsets count UTF-8 bytes; the line is indexed by characters.
            column = len(line.encode()[:node.col_offset].decode())
            if after != before:
                found.append(Mutant(str(path.resolve().relative_to(ROOT)), node.lineno,
                                    column, before, after))
    return sorted(set(found), key=lambda m: (m.path, m.line, m.before, m.after))


def planted_source(mutant: Mutant, source: str) -> str:
    lines = source.splitlines(keepends=True)
    line = lines[mutant.line - 1]
    start, end = mutant.column, mutant.column + len(mutant.before)
    assert line[start:end] == mutant.before, "the module changed since the mutants were listed"
    lines[mutant.line - 1] = line[:start] + mutant.after + line[end:]
    return "".join(lines)


# The tests that exercise a module when no test file names it (it is reached through another
# module), or when the files that do are slow to spawn: the smallest set that still reaches it.
# Arguments after a "-k" select tests inside those files.
NOT_FOUR_RANKS = ["-k", "not four_ranks"]
TP_TESTS = ["tests/test_parallel_mutants_tp.py", "tests/test_tensor_parallel.py", *NOT_FOUR_RANKS]
PIPELINE_TESTS = ["tests/test_pipeline.py", *NOT_FOUR_RANKS]
PS_TESTS = ["tests/test_parameter_server_units.py", "tests/test_parameter_server.py", "-k",
            "not dead and not hung and not another and not async_converges"]
# The planner and the schedules: their in-process tests (test_report*.py spawn runs to compare),
# the hand counts of each estimate's parts first (seconds each: most planted bugs fail there).
PLANNER_TESTS = [f"tests/test_{name}.py" for name in (
    "planner_mutants_checks", "planner_mutants_collectives", "planner_mutants_kernels",
    "planner_mutants_memory", "planner_mutants_training", "planner_mutants_serving",
    "planner_mutants_stats",
    "planner_accuracy", "planner_comm", "planner_memory", "planner_ps", "planner_search",
    "eager_time", "schedules", "planner_model", "planner_mutants_partition",
    "planner_mutants_compute", "planner_mutants_rules", "planner_mutants_eager",
    "planner_mutants_search", "planner_mutants_layouts",
    "planner_mutants_timeline", "planner_mutants_report",
    "planner_mutants_schedules", "planner_mutants_ps")]
# The search, the step's timeline, the report and the schedules: their own checks first (a bug
# planted there fails within seconds), then the rest of the planner's.
LAYOUT_TESTS = [f"tests/test_planner_mutants_{name}.py" for name in (
    "schedules", "timeline", "layouts", "report", "ps")]
LAYOUT_MODULES = [f"tetrad/planner/{name}.py" for name in (
    "search", "timeline", "report", "parameter_server", "stacks", "__init__")]
# The eager profile's checks against hand counts and the runtime built in-process, first (the
# fastest first): a bug planted in the eager modules fails within seconds there.
EAGER_TESTS = [f"tests/test_planner_mutants_eager_{name}.py" for name in (
    "comm", "layout", "overlap", "time", "runtime")]
# The attention backends, which tests reach through the package's names.
ATTENTION_TESTS = ["tests/test_inference_mutants_attention.py", "tests/test_paged_attention.py",
                   "tests/test_attention_backends.py"]
TEST_MAP = {
    "tetrad/parallel/comm.py": ["tests/test_parallel_mutants_comm.py", "tests/test_comm.py"],
    "tetrad/parallel/tensor_parallel.py": ["tests/test_tensor_parallel.py", *NOT_FOUR_RANKS],
    "tetrad/parallel/tp_operators.py": TP_TESTS,
    "tetrad/parallel/vocab_parallel.py": TP_TESTS,
    "tetrad/parallel/tp_overlap.py": ["tests/test_parallel_mutants_tp.py", "tests/test_overlap.py"],
    "tetrad/parallel/expert_parallel.py": ["tests/test_expert_parallel.py", *NOT_FOUR_RANKS],
    "tetrad/parallel/pipeline/executor.py": PIPELINE_TESTS,
    "tetrad/parallel/pipeline/stage.py": PIPELINE_TESTS,
    "tetrad/parallel/fsdp.py": ["tests/test_zero.py"],
    "tetrad/parallel/zero_optimizer.py": ["tests/test_zero.py"],
    "tetrad/parallel/engine.py": ["tests/test_parallel_mutants_engine.py",
                                  "tests/test_parallel_mutants_model.py", "tests/test_overlap.py"],
    "tetrad/parallel/parallelize.py": ["tests/test_parallel_mutants_model.py",
                                       "tests/test_train_composition.py", "-k", "four_ranks"],
    **{f"tetrad/parallel/ps/{name}.py": PS_TESTS
       for name in ("clock", "keys", "protocol", "server", "worker")},
    **{str(module.relative_to(ROOT)): PLANNER_TESTS for folder in ("planner", "schedules")
       for module in (ROOT / "tetrad" / folder).glob("*.py")},
    **{str(module.relative_to(ROOT)): [*EAGER_TESTS, *PLANNER_TESTS]
       for module in (ROOT / "tetrad" / "planner").glob("eager*.py")},
    **{module: [*LAYOUT_TESTS, *(t for t in PLANNER_TESTS if t not in LAYOUT_TESTS)]
       for module in [*LAYOUT_MODULES, *(str(path.relative_to(ROOT)) for path in
                                         (ROOT / "tetrad" / "schedules").glob("*.py"))]},
    **{str(module.relative_to(ROOT)): ATTENTION_TESTS
       for module in (ROOT / "tetrad" / "inference" / "worker" / "attention").glob("*.py")},
}


def tests_for(module: str) -> list[str]:
    """TEST_MAP's entry for `module`, else the test files that name it (tetrad/planner/search.py
    -> `tetrad.planner.search` or `from tetrad.planner import search`), else the whole suite."""
    if module in TEST_MAP:
        return TEST_MAP[module]
    dotted = module.removesuffix(".py").replace("/", ".")
    package, _, stem = dotted.rpartition(".")
    needles = (dotted, f"from {package} import {stem}")
    found = [str(test.relative_to(ROOT)) for test in sorted((ROOT / "tests").glob("test_*.py"))
             if any(needle in test.read_text() for needle in needles)]
    return found or ["tests"]


def copy_of_tree(destination: Path) -> None:
    """The committed tree plus uncommitted changes to tracked files, as the working copy has them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def run_tests(tree: Path, tests: list[str], timeout_s: float) -> tuple[str, float]:
    environment = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=tree, env=environment, capture_output=True,
                                timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start
    seconds = time.perf_counter() - start
    return ("survived" if result.returncode == 0 else "killed"), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="+", help="module files under tetrad/")
    parser.add_argument("--tests", nargs="*", help="test files to run (default: those naming "
                        "the module)")
    parser.add_argument("--sample", type=int, help="draw this many mutants over all modules")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    parser.add_argument("--results", help="append one JSON line per mutant to this file")
    args = parser.parse_args()

    mutants = [m for module in args.modules for m in mutants_of(Path(module))]
    if args.sample is not None:
        mutants = random.Random(args.seed).sample(mutants, min(args.sample, len(mutants)))
    if args.list:
        print("\n".join(m.describe() for m in mutants))
        print(f"{len(mutants)} mutants", file=sys.stderr)
        return 0

    with tempfile.TemporaryDirectory(prefix="tetrad-mutants-") as scratch:
        tree = Path(scratch)
        copy_of_tree(tree)
        baselines: dict[tuple[str, ...], float] = {}
        counts = {"killed": 0, "survived": 0, "timeout": 0}
        for number, mutant in enumerate(mutants, 1):
            tests = tuple(args.tests or tests_for(mutant.path))
            if tests not in baselines:
                outcome, seconds = run_tests(tree, list(tests), timeout_s=1800)
                if outcome != "survived":
                    print(f"the unmutated tree fails {' '.join(tests)}: fix that first",
                          file=sys.stderr)
                    return 1
                baselines[tests] = seconds
            target = tree / mutant.path
            original = target.read_text()
            target.write_text(planted_source(mutant, original))
            try:
                outcome, seconds = run_tests(tree, list(tests), 3 * baselines[tests] + 30)
            finally:
                target.write_text(original)
            counts[outcome] += 1
            print(f"[{number}/{len(mutants)}] {outcome:8} {seconds:6.1f}s  {mutant.describe()}",
                  flush=True)
            if args.results:
                with open(args.results, "a") as results:
                    results.write(json.dumps({**asdict(mutant), "outcome": outcome,
                                              "tests": list(tests), "seconds": seconds}) + "\n")
    caught = counts["killed"] + counts["timeout"]
    print(f"{caught} of {len(mutants)} caught ({100 * caught / max(len(mutants), 1):.0f}%): "
          f"{counts['killed']} failed, {counts['timeout']} timed out, "
          f"{counts['survived']} survived")
    return 0


if __name__ == "__main__":
    sys.exit(main())
