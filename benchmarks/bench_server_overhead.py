"""What the HTTP server costs: the same requests through `tetrad serve` (a real server process,
one client thread of this process sending them all at once) and through `LLM.generate` in
process, in one run.

Long prompts (3,000 tokens by default) make the per-step work of the server visible: it used to
deep-copy every request's whole output, prompt ids included, on every step. Runs alternate
between the sides, every side runs once untimed first, and each side keeps its best; the median
over rounds of each round's ratio is printed too, so a shared machine's noise favours no side.
Then where each run's time went (Linux /proc): the engine-stepping thread's seconds on a CPU,
waiting for one (the machine's other work) and off it by itself (waiting for the GIL, for
requests), and the CPU seconds of the server's other threads (its event loop) and of the client.

    .venv/bin/python benchmarks/bench_server_overhead.py                 # 16 x 3,000-token prompts
    .venv/bin/python benchmarks/bench_server_overhead.py --prompt-len 200 --requests 32
    .venv/bin/python benchmarks/bench_server_overhead.py --against ../main   # an A/B of servers

With --against, a second server runs from another checkout of tetrad, its sides (`@against`)
rotating in the same rounds: two versions of the server compared against one `generate`, a
minute apart at most, where two runs of the script drift apart with a shared machine's load.
Run it both ways: with both servers from one tree, the second came out 0.024 higher streamed
(docs/serving.md).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tetrad.inference.engine import LLM
from tetrad.inference.core.params import SamplingParams
from tetrad.models.hf import save_hf
from tetrad.models.transformer import Transformer
from tetrad.spec.presets import resolve_model


def engine_flags(args) -> dict:
    return {"max_num_seqs": args.requests, "max_num_batched_tokens": args.batched_tokens,
            "block_size": 16, "kv_memory": args.kv_memory}


def run_generate(llm: LLM, prompts: list[list[int]], args) -> tuple[float, float, dict]:
    """(generated tokens per second, CPU seconds per generated token, the stepping thread's
    times) of LLM.generate, called on a thread other than the main one, as the server steps its
    engine: on this machine the same steps ran up to 3x slower on the main thread (2 torch
    threads; cause not pinned down)."""
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    outputs, ends = [], []

    def work() -> None:  # its own times, read before the thread (and its /proc entry) ends
        me = threading.get_native_id()
        ends.append((thread_times(os.getpid())[me], time.perf_counter()))
        outputs.extend(llm.generate(prompts, params))
        ends.append((thread_times(os.getpid())[me], time.perf_counter()))

    worker = threading.Thread(target=work)
    start, cpu = time.perf_counter(), time.process_time()
    worker.start()
    worker.join()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outputs)
    (before, began), (after, ended) = ends
    return tokens / elapsed, cpu / tokens, stepping_thread({0: before}, {0: after}, ended - began)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_times(pid: int) -> dict[int, tuple[float, float, int]]:
    """Each thread of a process: (seconds on a CPU, seconds runnable but waiting for one,
    times it went off the CPU by itself) (Linux /proc schedstat and status)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            on_cpu_ns, waiting_ns, _ = (task / "schedstat").read_text().split()
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        sleeps = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        times[int(task.name)] = (int(on_cpu_ns) / 1e9, int(waiting_ns) / 1e9, sleeps)
    return times


def stepping_thread(before: dict, after: dict, elapsed: float) -> dict:
    """Where the run's time went for the thread that steps the engine (the busiest one): on a
    CPU, waiting for a CPU (other work on the machine, the process's other threads), and off the
    CPU by its own doing (waiting for the GIL or for requests); and the other threads' CPU."""
    used = {tid: [now - then for now, then in zip(times, before.get(tid, (0, 0, 0)))]
            for tid, times in after.items()}
    engine = max(used, key=lambda tid: used[tid][0])
    on_cpu, waiting, sleeps = used.pop(engine)
    return {"on_cpu_s": on_cpu, "waiting_s": waiting, "off_cpu_s": elapsed - on_cpu - waiting,
            "went_off_cpu": sleeps, "other_threads_cpu_s": sum(u[0] for u in used.values())}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(folder: Path, port: int, args, tree: str | None = None) -> subprocess.Popen:
    """`tetrad serve` from `tree` (a checkout's root folder), or from this process's PYTHONPATH."""
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in engine_flags(args).items()]
    if args.stream_interval != 1:  # a checkout from before the flag (--against) serves too
        flags.append(f"--stream-interval={args.stream_interval}")
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    if tree is not None:
        env["PYTHONPATH"] = str(Path(tree).resolve())
    # Started in the model's folder: `python -m` puts the working directory first on sys.path,
    # and PYTHONPATH must choose the tetrad that serves (the benchmark compares two trees).
    server = subprocess.Popen([sys.executable, "-m", "tetrad.cli.main", "serve", str(folder),
                               "--port", str(port), *flags], env=env, cwd=folder,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("tetrad serve did not start")


def http_post(port: int, path: str, body: dict) -> bytes:
    """The request bytes of one POST that closes its connection after the answer."""
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


def answer_body(raw: bytes) -> bytes:
    """The body of an HTTP/1.1 answer, chunked (a stream) or not."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {head.splitlines()[0]!r}: {body[:200]!r}")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    parts, position = [], 0
    while True:
        line_end = body.index(b"\r\n", position)
        size = int(body[position:line_end], 16)
        if size == 0:
            return b"".join(parts)
        parts.append(body[line_end + 2:line_end + 2 + size])
        position = line_end + 2 + size + 2


def tokens_answered(body: bytes, stream: bool, args) -> int:
    if stream:  # ignore_eos: a stream that ends with "length" generated max_tokens
        events = [json.loads(line[6:]) for line in body.decode().splitlines()
                  if line.startswith("data: {")]
        return args.output_len if events[-1]["choices"][0]["finish_reason"] == "length" else 0
    return json.loads(body)["usage"]["completion_tokens"]


def run_server(server: subprocess.Popen, port: int, prompts: list[list[int]], args,
               stream: bool) -> tuple[float, float, dict]:
    """(generated tokens per second, the server's CPU seconds per generated token, its threads'
    times and this client's CPU) through HTTP, all requests sent at once.

    One client thread sends every request on its own connection and reads all the answers
    through a selector, as a load generator would: with a thread per request (16 client threads
    in this process, each woken by every server-sent event and parsing HTTP in Python), the
    client's wake-ups competed for the 2 cores with the server's engine thread, a cost the
    generate side does not pay and a real server, whose clients are elsewhere, does not either."""
    selector = selectors.DefaultSelector()
    answers: dict[socket.socket, list[bytes]] = {}
    threads, client_cpu = thread_times(server.pid), time.process_time()
    start, cpu = time.perf_counter(), process_cpu_s(server.pid)
    for prompt in prompts:
        connection = socket.create_connection(("127.0.0.1", port))
        connection.sendall(http_post(port, "/v1/completions", {
            "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True, "stream": stream}))
        selector.register(connection, selectors.EVENT_READ)
        answers[connection] = []
    still_open = len(answers)
    while still_open:
        for key, _ in selector.select():
            data = key.fileobj.recv(1 << 16)
            if data:
                answers[key.fileobj].append(data)
            else:  # the server closed the connection: the answer is whole
                selector.unregister(key.fileobj)
                key.fileobj.close()
                still_open -= 1
    elapsed, cpu = time.perf_counter() - start, process_cpu_s(server.pid) - cpu
    times = stepping_thread(threads, thread_times(server.pid), elapsed)
    times["client_cpu_s"] = time.process_time() - client_cpu
    selector.close()
    counted = sum(tokens_answered(answer_body(b"".join(parts)), stream, args)
                  for parts in answers.values())
    expected = len(prompts) * args.output_len
    if counted != expected:
        raise RuntimeError(f"the server returned {counted} of {expected} tokens")
    return expected / elapsed, cpu / expected, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="preset with random weights")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=3000)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads, both sides (default 1)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the servers' --stream-interval (default 1: an event every step)")
    parser.add_argument("--against", metavar="TREE",
                        help="also serve from this checkout of tetrad (its root folder), in the "
                             "same rounds")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = resolve_model(args.model).replace(
        max_seq_len=max(resolve_model(args.model).max_seq_len,
                        args.prompt_len + args.output_len))
    rng = random.Random(0)

    def new_prompts() -> list[list[int]]:  # fresh ones each run: no prefix-cache hits
        return [[rng.randrange(config.vocab_size) for _ in range(args.prompt_len)]
                for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        save_hf(Transformer(config), folder)
        port = free_port()
        server = start_server(Path(folder), port, args)
        servers = [server]
        llm = LLM(folder, log=None, **engine_flags(args))
        runs = {"generate": [], "serve_stream": [], "serve": []}
        try:
            sides = {"generate": lambda prompts: run_generate(llm, prompts, args),
                     "serve_stream": lambda prompts: run_server(server, port, prompts, args, True),
                     "serve": lambda prompts: run_server(server, port, prompts, args, False)}
            if args.against:
                other_port = free_port()
                other = start_server(Path(folder), other_port, args, args.against)
                servers.append(other)
                sides["serve_stream@against"] = lambda prompts: run_server(
                    other, other_port, prompts, args, True)
                sides["serve@against"] = lambda prompts: run_server(other, other_port, prompts,
                                                                    args, False)
                runs.update({"serve_stream@against": [], "serve@against": []})
            for run in sides.values():  # every path once, so no side's first call is timed
                run(new_prompts()[:2])
            order = list(sides)
            for _ in range(args.repeats):
                # The order rotates each round: whichever side runs last in a round was measured
                # slower (the machine's state drifts within a round), so no side always goes last.
                for name in order:
                    runs[name].append(sides[name](new_prompts()))
                order = order[1:] + order[:1]
        finally:
            for each in servers:
                each.terminate()
                each.wait()
    # Each side's best run: its fastest, and its fewest CPU seconds per token (the CPU measure
    # holds on a loaded machine, where wall times swing from run to run).
    speed = {name: max(run[0] for run in values) for name, values in runs.items()}
    cpu = {name: min(run[1] for run in values) for name, values in runs.items()}
    # And the median over rounds of each round's ratio to generate: a round's runs are minutes
    # apart at most, so a load that comes and goes moves both sides of a ratio.
    per_round = {name: statistics.median(run[0] / base[0] for run, base in
                                         zip(values, runs["generate"]))
                 for name, values in runs.items()}
    results = {"model": args.model, "against": args.against, "requests": args.requests,
               "prompt_len": args.prompt_len,
               "output_len": args.output_len, "threads": torch.get_num_threads(),
               "tokens_per_s": speed, "cpu_s_per_token": cpu,
               "median_round_ratio": per_round, "runs": runs}
    import tetrad

    print(f"{args.requests} requests x {args.prompt_len}-token prompts, {args.output_len} "
          f"tokens each, {args.model}, {torch.get_num_threads()} threads, tetrad from "
          f"{Path(tetrad.__file__).parent.parent}"
          + (f"; @against: tetrad from {Path(args.against).resolve()}" if args.against else ""))
    for name in runs:
        print(f"  {name:20s} {speed[name]:8.1f} tokens/s ({speed[name] / speed['generate']:.3f}x "
              f"generate; median of rounds {per_round[name]:.3f}x)   {cpu[name] * 1e3:7.2f} CPU "
              f"ms/token (generate / this = {cpu['generate'] / cpu[name]:.3f})")
    print("  median per run, seconds: the engine-stepping thread on a CPU / waiting for one / "
          "off it by itself (times); the server's other threads on a CPU; the client's CPU")
    for name, values in runs.items():
        median = {key: statistics.median(run[2][key] for run in values) for key in values[0][2]}
        print(f"  {name:20s} {median['on_cpu_s']:.2f} / {median['waiting_s']:.2f} / "
              f"{median['off_cpu_s']:.2f} ({median['went_off_cpu']:.0f})" + (
                  f"; {median['other_threads_cpu_s']:.2f}; {median['client_cpu_s']:.2f}"
                  if name != "generate" else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
