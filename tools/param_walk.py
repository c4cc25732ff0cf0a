"""Walk one command-line parameter through tetrad: which source files its value passes through,
in order, and how often the walk returns to a file it already left.

    python tools/param_walk.py lr -- train --model tiny --steps 1 --lr 0.00123 --nproc 2 --dp 2

runs `python -m tetrad <args>` with a profile hook in every process it starts (the launcher, the
spawned or torchrun ranks). A call is a step of the walk when one of its arguments carries the
parameter: the value itself, or an object, dict, list or tuple holding it under the parameter's
name (`args.lr`, `config.lr`, `job.config.lr`), up to three levels down. `self` does not count:
a method called on an object that holds the config is that object's business, not the value's
journey. The walk is the launcher's steps up to the ranks' start, rank 0's, then the launcher's
again; consecutive steps in one file are one visit. Pick a value no default shares, so that
matching by value finds only this parameter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "tetrad") + os.sep
MAX_DEPTH = 3
ENV_DIR, ENV_NAME, ENV_VALUE = "TETRAD_WALK_DIR", "TETRAD_WALK_NAME", "TETRAD_WALK_VALUE"
SITECUSTOMIZE = ("import sys\nsys.path.insert(0, {tools!r})\nimport param_walk\n"
                 "param_walk.install()\n")


def carries(value, name: str, target, depth: int = MAX_DEPTH) -> bool:
    """Whether `value` is `target` or holds it under `name`, at most `depth` containers down."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return type(value) is type(target) and value == target
    if depth == 0 or value is None:
        return False
    if isinstance(value, dict):
        if name in value and carries(value[name], name, target, 0):
            return True
        return any(carries(item, name, target, depth - 1) for item in value.values()
                   if not isinstance(item, (str, int, float)))
    if isinstance(value, (list, tuple)):
        return any(carries(item, name, target, depth - 1) for item in value[:16])
    if dataclasses.is_dataclass(value) or isinstance(value, argparse.Namespace):
        fields = vars(value) if isinstance(value, argparse.Namespace) else {
            field.name: getattr(value, field.name, None) for field in dataclasses.fields(value)}
        if name in fields and carries(fields[name], name, target, 0):
            return True
        return any(carries(item, name, target, depth - 1) for item in fields.values()
                   if not isinstance(item, (str, int, float)))
    return False


def install() -> None:
    """The profile hook of one process: each call whose arguments carry the parameter is a line
    (time, file, function, rank) in this process's file of the walk folder."""
    folder = os.environ.get(ENV_DIR)
    if not folder:
        return
    name, target = os.environ[ENV_NAME], json.loads(os.environ[ENV_VALUE])
    out = open(Path(folder) / f"{os.getpid()}.jsonl", "a", buffering=1)
    state = {"rank": None}

    def hook(frame, event, arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        arguments = {key: frame.f_locals.get(key) for key in names if key not in ("self", "cls")}
        if code.co_name == "_rank_main" and state["rank"] is None:
            state["rank"] = arguments.get("rank")
        if any(carries(value, name, target) for value in arguments.values()):
            path = code.co_filename[len(PACKAGE):]
            out.write(json.dumps([time.monotonic(), path, code.co_name, state["rank"]]) + "\n")

    sys.setprofile(hook)
    import threading
    threading.setprofile(hook)


def read_walk(folder: Path) -> list[tuple[str, str]]:
    """The launcher's steps around rank 0's, in time order (ranks other than 0 walk alike)."""
    steps = []
    for trace in folder.glob("*.jsonl"):
        for line in trace.read_text().splitlines():
            stamp, path, function, rank = json.loads(line)
            if rank in (None, 0):
                steps.append((stamp, path, function))
    return [(path, function) for _, path, function in sorted(steps)]


def visits(steps: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Consecutive steps in one file as one visit: (file, the functions entered there)."""
    merged: list[tuple[str, list[str]]] = []
    for path, function in steps:
        if merged and merged[-1][0] == path:
            if function not in merged[-1][1]:
                merged[-1][1].append(function)
        else:
            merged.append((path, [function]))
    return merged


def parameter_value(name: str, args: list[str]):
    flag = "--" + name.replace("_", "-")
    if flag not in args or args.index(flag) + 1 >= len(args):
        raise SystemExit(f"give {flag} a value in the command, one no default shares")
    text = args[args.index(flag) + 1]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the parameter's field name, e.g. lr or model")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the tetrad command line, e.g. -- train --lr 0.00123 ...")
    options = parser.parse_args()
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    target = parameter_value(options.name, command)
    with tempfile.TemporaryDirectory() as folder:
        hook_dir = Path(folder) / "hook"
        hook_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(
            SITECUSTOMIZE.format(tools=str(Path(__file__).resolve().parent)))
        traces = Path(folder) / "traces"
        traces.mkdir()
        environment = {**os.environ, ENV_DIR: str(traces), ENV_NAME: options.name,
                       ENV_VALUE: json.dumps(target),
                       "PYTHONPATH": os.pathsep.join(
                           [str(hook_dir), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        finished = subprocess.run([sys.executable, "-m", "tetrad", *command], env=environment,
                                  stdout=subprocess.DEVNULL)
        walk = visits(read_walk(traces))
    seen: set[str] = set()
    returns = 0
    for index, (path, functions) in enumerate(walk, 1):
        again = path in seen
        returns += again
        seen.add(path)
        print(f"{index:3d} {'<-' if again else '  '} {path}: {', '.join(functions)}")
    print(f"{len(walk)} visits to {len(seen)} files, {returns} returns to a file already left "
          f"(tetrad exited with {finished.returncode})")
    return finished.returncode


if __name__ == "__main__":
    sys.exit(main())
