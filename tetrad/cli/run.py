"""`tetrad run PATH`: chat with a model in the terminal, tokens streaming as they come.
Commands: /set NAME VALUE (temperature, top_p, top_k, repetition_penalty, max_tokens, seed,
system), /show, /clear, /bye. Ctrl-C stops the current answer."""

from __future__ import annotations

import argparse
import sys

from tetrad.cli.generate import add_engine_arguments, add_sampling_arguments, build_engine

SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "repetition_penalty": float,
            "max_tokens": int, "seed": int}
HELP = ("/set NAME VALUE   change a setting: " + ", ".join(SETTABLE) + ", or system TEXT\n"
        "/show             settings, model and KV cache\n"
        "/clear            forget the conversation\n"
        "/bye              quit")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("run", help="chat with a model in the terminal",
                                   description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--system", help="system message that starts the chat (default: the "
                                          "stored model's SYSTEM)")
    add_sampling_arguments(parser)
    parser.set_defaults(run=run)


class Chat:
    def __init__(self, llm, params, system: str):
        from tetrad.inference.entrypoints.chat import ChatFormatter, load_chat_template

        self.llm, self.params, self.system = llm, params, system
        self.formatter = ChatFormatter(load_chat_template(llm.path))
        self.history: list[dict] = []

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def command(self, line: str) -> bool:
        """Handle a /command; False means quit."""
        from tetrad.errors import TetradError

        name, _, rest = line[1:].partition(" ")
        if name in ("bye", "exit", "quit"):
            return False
        if name == "clear":
            self.history = []
            print("(conversation cleared)")
        elif name == "show":
            settings = {key: getattr(self.params, key) for key in SETTABLE}
            print(f"model: {self.llm.model_config.name}, context {self.llm.max_model_len} tokens")
            print(self.llm.kv_plan.describe())
            print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
            print(f"system: {self.system!r}; {len(self.history)} messages in the conversation")
        elif name == "set":
            key, _, value = rest.strip().partition(" ")
            key = key.replace("-", "_")
            try:
                if key == "system":
                    self.system = value
                elif key in SETTABLE:
                    self.params = self.params.replace(**{key: SETTABLE[key](value)})
                else:
                    raise TetradError(f"cannot set {key!r}: settable are "
                                      f"{', '.join(SETTABLE)}, system")
                print(f"set {key} = {value}")
            except (ValueError, TetradError) as error:
                print(f"error: {error}")
        else:
            print(HELP)
        return True

    def answer(self, text: str) -> None:
        """Stream the model's reply to `text`; oldest turns go when the context is full."""
        from tetrad.inference.core.params import RequestRejected

        self.history.append({"role": "user", "content": text})
        params = self.params.replace(stop=self.params.stop + self.formatter.stop)
        reply, stream = "", None
        try:
            while stream is None:
                try:
                    stream = self.llm.stream(self.formatter.render(self.messages()), params)
                    output = next(stream)
                except RequestRejected as error:
                    stream = None
                    if len(self.history) <= 1:
                        self.history.pop()
                        print(f"error: {error}")
                        return
                    self.history = self.history[2:]  # drop the oldest exchange, try again
            while True:
                print(output.outputs[0].delta_text, end="", flush=True)
                reply += output.outputs[0].delta_text
                output = next(stream)
        except StopIteration:
            pass
        except KeyboardInterrupt:
            if stream is not None:
                stream.close()  # aborts the request, freeing its blocks
        print()
        self.history.append({"role": "assistant", "content": reply.strip()})


def run(args: argparse.Namespace) -> int:
    from tetrad.cli.generate import sampling_params

    with build_engine(args) as llm:
        stored = args.stored
        system = args.system if args.system is not None else (stored and stored.system) or ""
        chat = Chat(llm, sampling_params(args), system)
        chat.history = list(stored.messages) if stored else []  # the Modelfile's MESSAGEs
        converse(chat)
    return 0


def converse(chat: Chat) -> None:
    """Messages and /commands from stdin until /bye or the end of the input."""
    interactive = sys.stdin.isatty()
    if interactive:
        print("Type a message, /? for help, /bye to quit.")
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print()
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not chat.command(line):
                break
            continue
        chat.answer(line)
