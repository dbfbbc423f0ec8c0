"""Tokenizing an agent's turns: the rendered conversation grows by a tool call and its result each
turn and is tokenized again whole. Baseline in the same run: one text on one core (what HF
tokenizers does with a single `encode`), then the same tokenizer encoding in parts on every core,
then the parts with the last turns' encodings reused (`moeferry.text.parts`).

    PYTHONPATH=. python benchmarks/agent_turn_tokens.py --model DIR [--turns 6] [--start-tokens 100000]
"""
from __future__ import annotations

import argparse
import os
import random
import time

from moeferry.text.parts import RecentEncodings
from moeferry.text.tokenizer import Tokenizer

WORDS = ["alpha", "beta", "gamma", "def", "return", "self", "print", "(x)", "{", "}", "\n    ", "# note", "value",
         "42", "\nresult", "\nfile.py:", " error", " the", " a", " to", " import", " os", " path"]


def conversation(tok: Tokenizer, rng: random.Random, start_tokens: int, turns: int) -> list[str]:
    """The rendered prompt of each turn: a long history, then a tool call and result a turn."""
    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    messages = [{"role": "system", "content": text(2000)}]
    while len(tok.apply_chat_template(messages)) < start_tokens * 2:  # ~2 characters a token here
        messages += [{"role": "user", "content": text(400)}, {"role": "assistant", "content": text(200)}]
    prompts = []
    for _ in range(turns):
        messages += [{"role": "assistant", "content": text(50)}, {"role": "user", "content": text(300)}]
        prompts.append(tok.apply_chat_template(messages))
    return prompts


def timed(encode, prompts: list[str]) -> tuple[list[float], list[list[int]]]:
    times, ids = [], []
    for p in prompts:
        start = time.perf_counter()
        ids.append(encode(p))
        times.append(time.perf_counter() - start)
    return times, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory with tokenizer.json")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--start-tokens", type=int, default=100000)
    args = ap.parse_args()
    tok = Tokenizer.from_dir(args.model)
    prompts = conversation(tok, random.Random(0), args.start_tokens, args.turns)
    whole = lambda p: tok._tok.encode(p, add_special_tokens=False).ids  # noqa: E731
    parts = lambda p: RecentEncodings(tok._encode_batch, capacity=0).encode(p)  # noqa: E731  (keeps nothing)
    recent = RecentEncodings(tok._encode_batch)
    runs = {name: timed(f, prompts) for name, f in (("one text, one core", whole), ("parts", parts),
                                                     ("parts + recent", recent.encode))}
    assert runs["parts"][1] == runs["one text, one core"][1] == runs["parts + recent"][1]
    print(f"{os.cpu_count()} cores; {len(prompts)} turns of {len(runs['parts'][1][0])}-"
          f"{len(runs['parts'][1][-1])} tokens; the first turn is the first time the conversation is seen")
    print("| encode | first turn ms | later turns ms (mean) | baseline / this, later turns |")
    print("|---|---|---|---|")
    base = sum(runs["one text, one core"][0][1:]) / (len(prompts) - 1)
    for name, (times, _) in runs.items():
        later = sum(times[1:]) / (len(times) - 1)
        print(f"| {name} | {times[0] * 1e3:.1f} | {later * 1e3:.1f} | {base / later:.1f} |")


if __name__ == "__main__":
    main()
