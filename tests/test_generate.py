"""Generation through the scheduler equals transformers' greedy generate."""
from __future__ import annotations

import pytest
import torch

from moeferry import LLM
from moeferry.scheduler.sampling import SamplingParams
from tests.test_model_parity import prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
ARCHS = ["qwen3_moe", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    cache = {}

    def run(name, ids, n=32):
        key = (name, tuple(ids), n)
        if key not in cache:
            with torch.no_grad():
                out = hf_model(name).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)
            cache[key] = out[0, len(ids):].tolist()
        return cache[key]

    return run


PROMPTS = [prompt(n, 100 + n) for n in (3, 16, 17, 40, 9, 31, 5, 50)]


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_equals_transformers_and_batching(name, checkpoint, hf_greedy):
    """8 prompts (some longer than max_extend_tokens) with 3 running at once."""
    llm = LLM(str(checkpoint(name)), dtype="float32", max_running_requests=3, max_extend_tokens=16,
              prefix_cache=False)
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(name, p)
        assert o.finish_reason == "length"
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS[2:4]]  # one prompt over the chunk limit
    assert alone == [o.token_ids for o in outs[2:4]]


@pytest.mark.parametrize("name", ARCHS)
def test_preemption_keeps_outputs(name, checkpoint, hf_greedy):
    llm = LLM(str(checkpoint(name)), dtype="float32", max_running_requests=3, max_extend_tokens=16,
              num_tokens=110, prefix_cache=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(name, p) for p in PROMPTS]
    assert llm.scheduler.stats()["kv_tokens_used"] == 0


@pytest.mark.parametrize("name", ARCHS)
def test_prefix_cache_reuse(name, checkpoint, hf_greedy):
    llm = LLM(str(checkpoint(name)), dtype="float32", max_running_requests=2, max_extend_tokens=16, num_tokens=600)
    shared = prompt(45, 7)
    first = llm.generate([shared + [11, 12, 13]], GREEDY)[0]
    second = llm.generate([shared + [21, 22]], GREEDY)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens > 0
    if name == "qwen3_5_moe":  # resumes from a GDN state checkpoint at a chunk boundary
        assert second.cached_tokens % 16 == 0
    else:
        assert second.cached_tokens == 45
    assert second.token_ids == hf_greedy(name, shared + [21, 22])
    again = llm.generate([shared + [21, 22]], GREEDY)[0]
    assert again.token_ids == second.token_ids
    if name == "qwen3_moe":  # attention KV: everything but the last token is reused
        assert again.cached_tokens == len(shared) + 1
    turn = shared + [21, 22] + second.token_ids + [5, 6]  # next turn of a conversation
    third = llm.generate([turn], GREEDY)[0]
    assert third.cached_tokens == len(shared) + 2 + len(second.token_ids) - 1  # saved when `second` finished
    assert third.token_ids == hf_greedy(name, turn)


@pytest.mark.parametrize("overlap", [True, False])
def test_state_saved_after_a_checkpoint_token_resumes_the_next_turn(overlap, checkpoint, hf_greedy):
    """--enable-special-token-ckpt: the state after a checkpoint token (the tool-call opener in
    a server) is saved mid-decode, so a next turn that repeats the output through that token
    resumes right after it, and its tokens equal transformers' (a state saved a token early or
    late would change them). Without it, the turn resumes at the first turn's prompt end."""
    name, shared = "qwen3_5_moe", prompt(21, 9)
    out = hf_greedy(name, shared, 12)
    k = next(i for i in range(4, 10) if out[i] not in out[:i])  # the first use of a token, mid-answer
    turn = shared + out[:k + 1] + [7, 8, 9]
    resumed = {}
    for special in ((out[k],), ()):
        llm = LLM(str(checkpoint(name)), dtype="float32", max_running_requests=2, max_extend_tokens=16,
                  num_tokens=600, overlap_schedule=overlap, checkpoint_token_ids=special)
        assert llm.generate([shared], GREEDY.replace(max_tokens=12))[0].token_ids == out
        second = llm.generate([turn], GREEDY)[0]
        assert second.token_ids == hf_greedy(name, turn)
        resumed[special] = second.cached_tokens
        llm.engine.cache.check()
    assert resumed == {(out[k],): len(shared) + k + 1, (): len(shared)}


def test_prefix_cache_keeps_saving_new_prompts_once_its_state_slots_are_full(checkpoint):
    """A Gated DeltaNet model resumes only at saved state checkpoints: once cached checkpoints
    held every spare state slot, new prompts were no longer saved and nothing more was reused
    (the HTTP suite's cached-tokens test failed after a few more requests). The least recently
    used checkpoints now make room."""
    llm = LLM(str(checkpoint("qwen3_5_moe")), dtype="float32", max_running_requests=2, max_extend_tokens=16,
              num_tokens=2000)
    slots = llm.engine.sizes.num_state_slots
    for seed in range(slots + 2):  # more distinct prompts than state slots
        llm.generate([prompt(40, 100 + seed)], GREEDY)
    assert llm.scheduler.stats()["state_slots_used"] >= slots - 1  # the cache holds (nearly) all
    shared = prompt(40, 7)
    llm.generate([shared + [11, 12]], GREEDY)
    again = llm.generate([shared + [21, 22]], GREEDY)[0]
    assert again.cached_tokens >= 32
    llm.engine.cache.check()


@pytest.mark.parametrize("name,page_size", [("qwen3_5_moe", 1), ("qwen3_5_moe", 4), ("qwen3_moe", 2)])
def test_prefix_cache_never_changes_outputs(name, page_size, checkpoint):
    """Random batches of prompts sharing prefixes, through pools small enough to preempt and
    evict: greedy outputs equal those of an engine without the prefix cache, the pools stay
    consistent, and the cache is used."""
    import random
    rng = random.Random(page_size)
    bases = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(6)]

    def make_prompt():
        base = rng.choice(bases)
        return base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(3, 500) for _ in range(rng.randrange(12))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(str(checkpoint(name)), dtype="float32", prefix_cache=False, max_extend_tokens=16, num_tokens=4000)
    cached = LLM(str(checkpoint(name)), dtype="float32", max_running_requests=4, max_extend_tokens=16,
                 num_tokens=120, page_size=page_size)
    reused = 0
    for _ in range(15):
        batch = [make_prompt() for _ in range(rng.randrange(1, 6))]
        outs = cached.generate(batch, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(batch, params)]
        reused += sum(o.cached_tokens for o in outs)
        cached.engine.cache.check()
    assert reused > 0 and cached.scheduler.num_preemptions > 0


def test_prefix_cache_with_preemption_and_eviction(checkpoint, hf_greedy):
    name = "qwen3_5_moe"
    llm = LLM(str(checkpoint(name)), dtype="float32", max_running_requests=3, max_extend_tokens=16, num_tokens=110)
    prompts = PROMPTS[1:5]
    outs = llm.generate(prompts, GREEDY)
    assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(name, p) for p in prompts]
    s = llm.scheduler.stats()
    assert s["kv_tokens_used"] == s["prefix_cache_tokens"] <= s["kv_tokens_total"]


def test_context_limits(checkpoint):
    from moeferry.scheduler.scheduler import RequestRejected

    llm = LLM(str(checkpoint("qwen3_moe")), dtype="float32", max_seq_len=64, prefix_cache=False)
    with pytest.raises(RequestRejected) as e:
        llm.generate([prompt(64, 1)], GREEDY)
    assert e.value.code == "context_length_exceeded" and "64" in str(e.value)
    out = llm.generate([prompt(60, 1)], GREEDY)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_text_prompt_chat_and_stop_strings(checkpoint):
    llm = LLM(str(checkpoint("qwen3_5_moe")), dtype="float32")
    free = llm.generate("def main():", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert free.text == llm.tokenizer.decode(free.token_ids)
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 2]
    if stop.strip():
        cut = llm.generate("def main():", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                         stop=(stop,)))[0]
        assert cut.finish_reason == "stop" and stop not in cut.text
        assert free.text.startswith(cut.text) and len(cut.text) == free.text.find(stop)
    msgs = [{"role": "user", "content": "hello"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    chat = llm.chat(msgs, greedy, enable_thinking=False)
    text = llm.tokenizer.apply_chat_template(msgs, enable_thinking=False)
    assert len(chat) == 1 and chat[0].token_ids == llm.generate(text, greedy)[0].token_ids  # what generate returns
    assert chat[0].finish_reason in ("stop", "length") and len(chat[0].token_ids) <= 8
    assert [o.token_ids for o in llm.chat([msgs, msgs], greedy, enable_thinking=False)] == [chat[0].token_ids] * 2


def test_logprobs(checkpoint):
    llm = LLM(str(checkpoint("qwen3_moe")), dtype="float32")
    ids = prompt(12, 9)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=4))[0]
    ref = torch.log_softmax(llm.logits(ids + out.token_ids[:2]), -1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(ids) - 1 + i]
        assert lp.token_id == out.token_ids[i] == int(row.argmax())
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(4).indices.tolist()



def overlap_workload(stop_at: list[int], model_dir) -> list[tuple[list[int], SamplingParams]]:
    """Requests that end every way (a stop token found only once read, max_tokens, a stop string)
    and sample every way (greedy, seeded over the vocabulary and among a top-k, penalties,
    min_tokens, logprobs, a JSON grammar)."""
    from moeferry.scheduler.grammar import StructuredOutput
    from moeferry.server.structured import compile_schema

    g = SamplingParams(temperature=0.0, max_tokens=12)
    schema = {"type": "object", "properties": {"n": {"enum": [1, 22, 333]}}, "required": ["n"]}
    json_out = StructuredOutput(compile_schema(schema), str(model_dir))
    return [(PROMPTS[1], g.replace(temperature=1.0, seed=5, structured=json_out, max_tokens=16)),
            (PROMPTS[0], g.replace(stop_token_ids=(stop_at[0],))),
            (PROMPTS[1], g.replace(max_tokens=1)),
            (PROMPTS[2], g.replace(temperature=0.8, seed=3, logprobs=2)),
            (PROMPTS[3], g.replace(temperature=0.7, top_k=5, seed=4, max_tokens=9)),
            (PROMPTS[4], g.replace(frequency_penalty=0.5, stop_token_ids=(stop_at[4],))),
            (PROMPTS[5], g.replace(min_tokens=3, stop_token_ids=(stop_at[5],), ignore_eos=True)),
            (PROMPTS[6], g.replace(logprobs=3, max_tokens=5)),
            (PROMPTS[7], g.replace(stop=("a",), ignore_eos=True))]


@pytest.mark.parametrize("name", ARCHS)
def test_overlapped_steps_change_no_output(name, checkpoint):
    """The overlapped scheduler (a step launched before the last step's tokens are read, fed
    from them on the device) gives what reading every step's tokens first gives, through
    chunked prefill, preemption and every way a request ends; its decode steps are fed."""
    free = LLM(str(checkpoint(name)), dtype="float32", overlap_schedule=False).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop_at = [o.token_ids[4] for o in free]  # a stop token each greedy run meets midway
    runs, fed = {}, {}
    for overlap in (False, True):
        llm = LLM(str(checkpoint(name)), dtype="float32", max_running_requests=3, max_extend_tokens=16,
                  num_tokens=80, prefix_cache=False, overlap_schedule=overlap)
        plain, fed[overlap] = llm.engine.forward, []

        def forward(chunks, feed=None, plain=plain, seen=fed[overlap]):
            seen += [c.fed for c in chunks if c.fed >= 0]
            return plain(chunks, feed)

        llm.engine.forward = forward
        work = overlap_workload(stop_at, checkpoint(name))
        outs = llm.generate([p for p, _ in work], [s for _, s in work])
        assert outs[0].text.lstrip().startswith('{"n"') or outs[0].text.lstrip().startswith('{ "n"'), outs[0].text
        runs[overlap] = [(o.token_ids, o.finish_reason, [(lp.token_id, [t for t, _ in lp.top]) for lp in o.logprobs or ()],
                          [lp.logprob for lp in o.logprobs or ()]) for o in outs]
        assert llm.scheduler.num_preemptions > 0
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2))  # reads what is left
        assert llm.scheduler.stats()["kv_tokens_used"] == 0 and not llm.scheduler.has_work
    assert [r[:3] for r in runs[True]] == [r[:3] for r in runs[False]]  # (batches differ: logprobs to 1e-5)
    assert all(r[3] == pytest.approx(q[3], rel=1e-5) for r, q in zip(runs[True], runs[False]))
    assert [r[1] for r in runs[True]][1:3] == ["stop", "length"]
    assert not fed[False] and len(fed[True]) > 20


NO_TRITON = '''
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed")
sys.meta_path.insert(0, Block())
import moeferry.server.app  # the server too
from moeferry import LLM
print(LLM(sys.argv[1], dtype="float32").generate([[1, 2, 3]])[0].finish_reason)
try:
    LLM(sys.argv[1], dtype="float32", moe_backend="offload", moe_cache_size=4)
except RuntimeError as e:
    print(e)
'''


def test_cpu_runs_without_triton(checkpoint, tmp_path):
    """A CPU-only install without Triton serves with the resident backend; an offload backend
    (its slots are the kernels' layouts) is refused with a clear error."""
    import subprocess
    import sys

    script = tmp_path / "no_triton.py"
    script.write_text(NO_TRITON)
    r = subprocess.run([sys.executable, str(script), str(checkpoint("qwen3_5_moe"))], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] in ("stop", "length") and "needs Triton" in lines[1], r.stdout
