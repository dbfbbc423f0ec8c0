"""A worker factory whose "model" says what the prompt tells it to: the text between the last
`REPLY[[` and `]]END` of the decoded prompt, one token per step, then <|im_end|>. It lets tests drive
the real HTTP stack (parsers, SSE, SDK clients) with exact model outputs: tool calls, reasoning,
malformed calls."""
from __future__ import annotations

import time

from moeferry.scheduler.request import TokenEvent
from moeferry.scheduler.scheduler import RequestRejected
from moeferry.engine.config import derive_sizes
from moeferry.text.tokenizer import Tokenizer

OPEN, CLOSE = "REPLY[[", "]]END"
NAME = "scripted"


def scripted_config(model_dir: str, *extra: str):
    """The ServeConfig of a scripted server (CPU, 4096-token context) with extra serve flags."""
    import argparse

    from moeferry.config import ServeConfig, add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return ServeConfig.from_args(p.parse_args(["--model", model_dir, "--device", "cpu", "--served-model-name", NAME,
                                               "--max-seq-len-override", "4096", *extra]))


class FakeSchedulerBase:
    """What the worker loop drives (add / abort / has_work / step / stats), over a dict of live
    requests; subclasses decide what add and step do."""

    def __init__(self):
        self.reqs: dict[str, list] = {}

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return bool(self.reqs)

    def stats(self) -> dict:
        return {"running": len(self.reqs), "waiting": 0}


class ScriptedScheduler(FakeSchedulerBase):
    def __init__(self, tokenizer: Tokenizer, max_seq_len: int):
        super().__init__()
        self.tok, self.max_seq_len = tokenizer, max_seq_len
        self.eos = tokenizer.token_to_id("<|im_end|>")

    def add(self, req) -> None:
        if len(req.prompt_ids) >= self.max_seq_len:
            raise RequestRejected("prompt too long", "context_length_exceeded", "messages")
        prompt = self.tok.decode(req.prompt_ids, skip_special_tokens=False)
        start = prompt.rfind(OPEN)
        reply = prompt[start + len(OPEN):prompt.index(CLOSE, start)] if start >= 0 else "ok"
        self.reqs[req.request_id] = [req, self.tok.encode(reply) + [self.eos], 0]

    def step(self) -> list[TokenEvent]:
        time.sleep(0.002)
        events = []
        for rid, entry in list(self.reqs.items()):
            req, script, n = entry
            entry[2] = n + 1
            stop = n + 1 == len(script)
            length = not stop and req.params.max_tokens is not None and n + 1 >= req.params.max_tokens
            if stop or length:
                del self.reqs[rid]
            events.append(TokenEvent(rid, [script[n]], None, stop or length,
                                     "stop" if stop else "length" if length else None, len(req.prompt_ids), 0))
        return events


def factory(spec, progress):
    tok = Tokenizer.from_dir(spec.engine.model_dir)
    sizes = derive_sizes(spec.engine, 4096)
    return ScriptedScheduler(tok, sizes.max_seq_len), dict(vocab_size=tok.vocab_size, sizes=sizes,
                                                           eos_token_ids=(tok.token_to_id("<|im_end|>"),))


def serve_in_thread(server, timeout: float = 120.0):
    """Run the app of `server` with uvicorn in a thread of this process until its worker is ok.
    Returns (base url, stop function)."""
    import socket
    import threading

    import httpx
    import uvicorn

    from moeferry.server.app import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").json()["status"] == "ok":
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        raise AssertionError("the in-process server did not come up")

    def stop():
        uv.should_exit = True
        thread.join(20)

    return url, stop
