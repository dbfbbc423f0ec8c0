"""`serve`'s command line and ServeConfig: the users' seed line, unbuilt flags, resolution, --help."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from moeferry import cli
from moeferry.config import (DEFAULT_HOST, DEFAULT_PORT, DEMO_MODEL_NAME, NOT_BUILT, ConfigError, ServeConfig,
                             add_serve_arguments, parse_bytes)

SEED_LINE = ("serve --model {model} --served-model-name NAME --host 0.0.0.0 --port 1919 "
             "--moe-backend offload --moe-cache-auto --kv-reserve-tokens 131072 "
             "--max-seq-len-override 131072 --max-running-requests 1 --max-output-tokens 4096 "
             "--sampling-defaults model --enable-cache-report")


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def model(checkpoint):
    return str(checkpoint("qwen3_5_moe"))


def test_seed_line_resolves(model):
    """The users' line verbatim (plus --device cpu): every flag accepted and carried to the engine."""
    argv = SEED_LINE.format(model=model).split()[1:]
    cfg = ServeConfig.from_args(parse(*argv, "--device", "cpu"))
    assert (cfg.served_model_name, cfg.host, cfg.port) == ("NAME", "0.0.0.0", 1919)
    e = cfg.engine
    assert (e.moe_backend, e.moe_cache_auto, e.kv_reserve_tokens) == ("offload", True, 131072)
    assert e.max_seq_len == 131072 and cfg.model_max_seq_len == 4096
    assert e.max_running_requests == 1 and cfg.sizes.num_state_slots == 10 and e.plans_memory
    assert cfg.max_output_tokens == 4096 and cfg.sampling_defaults == "model" and cfg.enable_cache_report
    assert (e.device, e.dtype) == ("cpu", "float32")
    table = cfg.table()
    for row in ("device", "dtype", "moe backend", "offload (expert cache: sized by the memory plan",
                "at least 131072 tokens", "state slots"):
        assert row in table, row


def test_offload_flags_reach_the_engine(model):
    cfg = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--moe-backend", "hybrid",
                                      "--moe-cache-rate", "0.25", "--moe-hybrid-max-fetch", "3", "--moe-cpu-threads",
                                      "2", "--expert-load", "parallel", "--disable-moe-prefill-overlap",
                                      "--gpu-memory-limit", "2GiB", "--memory-ratio", "0.5"))
    e = cfg.engine
    assert (e.moe_backend, e.moe_cache_rate, e.moe_hybrid_max_fetch, e.moe_cpu_threads) == ("hybrid", 0.25, 3, 2)
    assert (e.expert_load, e.moe_prefill_overlap, e.moe_decode_prefetch, e.gpu_memory_limit, e.memory_ratio) == (
        "parallel", False, True, 2 * 2**30, 0.5)
    off = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--moe-backend", "offload",
                                      "--disable-moe-decode-prefetch")).engine
    assert not off.moe_decode_prefetch


@pytest.mark.parametrize("argv, message", [
    (["--moe-backend", "resident", "--moe-cache-size", "10"], "keeps every expert on the device"),
    (["--kv-reserve-tokens", "100", "--num-tokens", "1000"], "give one"),
    (["--moe-backend", "resident", "--disable-moe-decode-prefetch"], "applies to the offload and hybrid"),
    (["--moe-backend", "cpu", "--disable-moe-decode-prefetch"], "applies to the offload and hybrid"),
    (["--moe-backend", "resident", "--disable-moe-prefill-overlap"], "offload, hybrid and cpu"),
    (["--moe-backend", "resident", "--moe-cache-policy", "lfu"], "applies to the offload and hybrid"),
    (["--moe-backend", "cpu", "--moe-cache-policy", "lfu"], "applies to the offload and hybrid"),
    (["--compile-workers", "-1"], "compile_workers must be at least 0"),
    (["--moe-backend", "cpu", "--moe-prefetch-width", "4"], "applies to the offload and hybrid"),
    (["--moe-backend", "offload", "--moe-cache-size", "8", "--moe-prefetch-width", "4",
      "--disable-moe-decode-prefetch"], "give one"),
    (["--moe-backend", "resident", "--moe-prefetch-budget", "2"], "applies to the offload and hybrid"),
    (["--moe-backend", "offload", "--moe-cache-size", "8", "--moe-prefetch-budget", "2",
      "--disable-moe-decode-prefetch"], "--moe-prefetch-budget sizes the decode prefetch"),
])
def test_contradictory_flags_are_refused(model, argv, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig.from_args(parse("--model", model, "--device", "cpu", *argv))


def test_not_built_table_is_empty():
    """Every flag of the users' line is built; a future unfinished flag goes in NOT_BUILT."""
    assert NOT_BUILT == ()


def test_defaults_and_aliases(model):
    a = parse("--model", model)
    assert (a.host, a.port) == (DEFAULT_HOST, DEFAULT_PORT) == ("127.0.0.1", 1919)
    assert a.max_extend_tokens == 8192 and a.page_size == 1 and a.moe_backend == "auto"
    assert a.moe_cache_policy == "lru" and a.moe_prefill_overlap and a.moe_decode_prefetch and a.cuda_graphs and a.moe_cpu_layers is None
    assert parse("--max-prefill-length", "512").max_extend_tokens == 512
    assert parse("--max-extend-length", "384").max_extend_tokens == 384  # FreeToken's other spelling
    assert parse("--model-path", model).model == model
    assert parse("--tp-size", "1").tensor_parallel_size == parse().tensor_parallel_size == 1
    cfg = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--moe-backend", "offload",
                                      "--moe-cache-size", "8", "--moe-cpu-layers", "0.5"))
    assert cfg.engine.moe_cpu_layers == "0.5" and "MoE layers on the CPU: 0.5" in cfg.table()
    from moeferry.engine.engine import graph_max_batch
    for flags, largest in ((["--graph", "4"], 4), (["--cuda-graph-max-bs", "64"], 8), ([], 8)):
        cfg = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--no-prefix-cache", *flags))
        assert graph_max_batch(cfg.engine, cfg.sizes) == largest  # never past the running requests (8)
    assert parse("--max-extend-tokens", "256").max_extend_tokens == 256
    cfg = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--num-tokens", "1000",
                                      "--page-size", "16", "--no-prefix-cache", "--max-running-requests", "3"))
    assert cfg.sizes.num_pages == 63 and cfg.sizes.kv_tokens == 1008  # rounded up to whole pages
    assert cfg.max_seq_len == 1008  # the pool bounds the context
    assert cfg.sizes.num_state_slots == 3 and not cfg.engine.prefix_cache and cfg.engine.overlap_schedule
    plain = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--disable-overlap-schedule"))
    assert not plain.engine.overlap_schedule and plain.engine.compile_workers == 8
    one_by_one = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--compile-workers", "0"))
    assert one_by_one.engine.compile_workers == 0
    wide = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--moe-backend", "offload",
                                       "--moe-cache-size", "8", "--moe-prefetch-width", "6",
                                       "--moe-prefetch-budget", "3"))
    assert wide.engine.moe_prefetch_width == 6 and plain.engine.moe_prefetch_width is None
    assert wide.engine.moe_prefetch_budget == 3 and plain.engine.moe_prefetch_budget is None
    assert cfg.served_model_name == Path(model).name
    fused = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--moe-backend", "fused"))
    assert fused.engine.moe_backend == "resident"  # FreeToken's name for experts on the device


@pytest.mark.parametrize("argv", [
    ["--num-tokens", "10", "--num-pages", "10"],
    ["--moe-cache-size", "10", "--moe-cache-auto"],
    ["--moe-cache-rate", "0.5", "--moe-cache-auto"],
    ["--port", "70000"],
    ["--max-running-requests", "0"],
    ["--gpu-memory-limit", "lots"],
    ["--memory-ratio", "1.5"],
    ["--device", "tpu"],
    ["--moe-backend", "magic"],
])
def test_invalid_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_parse_bytes():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    assert parse_bytes("4096") == 4096


def test_missing_model_dir_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ServeConfig.from_args(parse("--model", str(tmp_path), "--device", "cpu"))
    with pytest.raises(ConfigError, match="no such directory"):
        ServeConfig.from_args(parse("--model", str(tmp_path / "missing"), "--device", "cpu"))


def test_context_beyond_the_models_positions_warns(model, caplog):
    cfg = ServeConfig.from_args(parse("--model", model, "--device", "cpu"))
    assert "max_position_embeddings" not in caplog.text
    ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--max-seq-len-override",
                                str(cfg.model_max_seq_len + 1)))
    assert "beyond the model's max_position_embeddings" in caplog.text


def test_cuda_without_cuda_is_refused(model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        ServeConfig.from_args(parse("--model", model, "--device", "cuda"))


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    for action in p._actions:
        for opt in action.option_strings:
            assert opt in text, opt
        assert action.help, action.option_strings


def test_cli_refusal_exits_2_before_loading(model, capsys):
    import multiprocessing

    assert cli.main(["serve", "--model", model, "--device", "cpu", "--moe-backend", "resident",
                     "--moe-cache-auto"]) == 2
    assert "keeps every expert on the device" in capsys.readouterr().err
    assert not multiprocessing.active_children()  # the first worker, started with the command, is ended


def test_serve_starts_its_worker_before_importing_torch():
    """`moeferry serve` parses its command line and starts its first engine worker (`FirstWorker`)
    before it imports torch or the web stack, so the worker's imports run beside its own."""
    import subprocess
    import sys

    code = ("import sys; from moeferry import cli; cli.build_parser('serve').parse_args(['serve', '--device', 'cpu']); "
            "import moeferry.server.first_worker; print([m for m in ('torch', 'triton', 'fastapi') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_demo_model_is_made_once_in_the_cache_dir(tmp_path, monkeypatch):
    from moeferry.server import demo

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = Path(demo.ensure_demo_model())
    assert path.parent == tmp_path / "moeferry" and (path / "config.json").is_file()
    assert (path / "tokenizer.json").is_file() and (path / "chat_template.jinja").is_file()
    stamp = (path / "config.json").stat().st_mtime_ns
    assert demo.ensure_demo_model() == str(path) and (path / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "moeferry").iterdir()] == [path.name]  # no half-built leftovers
    cfg = ServeConfig.from_args(parse("--device", "cpu"), demo_model=demo.ensure_demo_model)
    assert cfg.is_demo and cfg.served_model_name == DEMO_MODEL_NAME == "moeferry-demo-random-weights"
    assert cfg.model_dir == str(path) and "random weights" in cfg.table()


def test_bench_has_subcommands_and_needs_prompts(capsys):
    assert set(cli.BENCHES) >= {"serve"}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench"])  # a benchmark must be named
    assert cli.main(["bench", "serve", "--no-progress"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--moe-backend", "hybrid", "--moe-cpu-layers", "2"], "applies to the offload and cpu backends"),
    (["--moe-backend", "offload", "--moe-cpu-layers", "two"], "give MoE-layer ids"),
    (["--moe-backend", "offload", "--moe-hybrid-max-fetch", "2"], "applies to the hybrid backend"),
    (["--moe-backend", "offload", "--moe-cpu-threads", "2"], "applies to the cpu and hybrid backends"),
    (["--disable-cuda-graphs", "--cuda-graph-max-bs", "4"], "give one"),
    (["--tp-size", "2"], "tensor parallelism is not supported"),
])
def test_backend_specific_flags_need_their_backend(model, argv, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig.from_args(parse("--model", model, "--device", "cpu", *argv))


def test_bench_bw_measures_both_lanes(model, capsys, tmp_path):
    out = tmp_path / "bw.json"
    assert cli.main(["bench", "bw", "--model", model, "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fetch one expert" in text and "CPU expert, 1 token" in text
    import json

    r = json.loads(out.read_text())
    assert r["slot_bytes"] > 0 and r["fetch_s_per_expert"] > 0 and r["cpu_s_per_expert_1_token"] > 0


def test_a_cache_flag_makes_auto_offload(model):
    """--moe-cache-size with the default --moe-backend auto: offload (not resident, which would
    then refuse the cache flag inside the worker, at every restart)."""
    import torch

    from moeferry.engine.planning import choose_backend
    cfg = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--moe-cache-size", "4")).engine
    assert cfg.moe_backend == "auto"
    assert choose_backend(cfg, None, torch.device("cpu"), 0).moe_backend == "offload"
    # auto that turns out resident drops the offload-only switches instead of refusing them in the worker
    cfg = ServeConfig.from_args(parse("--model", model, "--device", "cpu", "--disable-moe-decode-prefetch",
                                      "--moe-cache-policy", "lfu")).engine
    reader = type("Reader", (), {"tensors": {}})()
    resolved = choose_backend(cfg, reader, torch.device("cpu"), 0)
    assert resolved.moe_backend == "resident" and resolved.moe_cache_policy == "lru" and resolved.moe_decode_prefetch


# Every flag of FreeToken 0.1.2's `ft serve --help` (its server/args.py), with a value where it takes one.
FREETOKEN_FLAGS = {
    "--model": None, "--model-path": None, "--served-model-name": "NAME", "--host": "0.0.0.0", "--port": "1919",
    "--dtype": "bfloat16", "--tensor-parallel-size": "1", "--tp-size": "1", "--max-running-requests": "4",
    "--max-seq-len-override": "4096", "--memory-ratio": "0.9", "--num-pages": "64", "--num-tokens": "64",
    "--page-size": "1", "--max-prefill-length": "512", "--max-extend-length": "512", "--cuda-graph-max-bs": "4",
    "--graph": "4", "--moe-backend": "offload", "--moe-cache-size": "8", "--moe-cache-rate": "0.5",
    "--moe-cache-auto": "", "--moe-cache-policy": "lru", "--moe-cpu-layers": "1", "--moe-cpu-threads": "2",
    "--moe-hybrid-max-fetch": "2", "--expert-load": "serial", "--kv-reserve-tokens": "64",
    "--disable-moe-prefill-overlap": "", "--max-output-tokens": "64", "--sampling-defaults": "model",
    "--enable-cache-report": "", "--cors-origins": "*", "--tool-call-parser": "auto", "--reasoning-parser": "auto",
    "--decode-log-interval": "10", "--cache-type": "naive", "--attention-backend": "triton", "--attn": "auto",
    "--nvfp4-backend": "triton", "--num-tokenizer": "0", "--tokenizer-count": "0", "--dummy-weight": "",
    "--model-source": "huggingface", "--disable-pynccl": "", "--moe-prefill-hit-d2d": "",
    "--enable-special-token-ckpt": "", "--shell-mode": "",
}


def test_every_freetoken_flag_parses(model):
    """A FreeToken command line never meets argparse's bare 'unrecognized arguments': each flag
    parses, and then acts or is refused with its reason."""
    for flag, value in FREETOKEN_FLAGS.items():
        argv = [flag] + ([model] if value is None else [value] if value else [])
        parse(*argv)  # SystemExit here: a FreeToken flag we do not know


@pytest.mark.parametrize("flag, reason", [
    ("--dummy-weight", "moeferry make-model"), ("--disable-pynccl", "tensor parallelism"),
    ("--moe-prefill-hit-d2d", "copies only the misses"),
    ("--shell-mode", "no terminal shell"), ("--model-source modelscope", "downloads nothing"),
])
def test_freetoken_flags_without_a_meaning_are_refused_with_the_reason(model, flag, reason, monkeypatch):
    with pytest.raises(ConfigError, match=reason):
        ServeConfig.from_args(parse("--model", model, "--device", "cpu", *flag.split()))
    name = "MOEFERRY_" + flag.split()[0].lstrip("-").upper().replace("-", "_")
    monkeypatch.setenv(name, flag.split()[1] if " " in flag else "1")
    with pytest.raises(ConfigError, match=reason):  # the same flag given as a variable
        ServeConfig.from_args(parse("--model", model, "--device", "cpu"))


@pytest.mark.parametrize("argv, reason", [
    (["--attention-backend", "fa"], "one attention implementation"),
    (["--attn", "fi,triton"], "one attention implementation"),
    (["--nvfp4-backend", "marlin"], "own Triton kernels"),
    (["--num-tokenizer", "2"], "tokenizes and detokenizes in the API process"),
    (["--cache-type", "paged"], "invalid choice"),
    (["--decode-log-interval", "0"], "at least 1"),
])
def test_freetoken_values_moeferry_lacks_are_usage_errors(argv, reason, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert reason in capsys.readouterr().err


def test_freetoken_flags_that_act(model):
    base = ("--model", model, "--device", "cpu")
    cfg = ServeConfig.from_args(parse(*base, "--attn", "triton", "--nvfp4-backend", "auto", "--num-tokenizer", "0",
                                      "--cache-type", "radix", "--decode-log-interval", "7"))
    assert cfg.engine.prefix_cache and cfg.engine.decode_log_interval == 7
    assert not ServeConfig.from_args(parse(*base, "--cache-type", "naive")).engine.prefix_cache
    assert ServeConfig.from_args(parse(*base)).engine.decode_log_interval == 40  # FreeToken's default
    theirs = ServeConfig.from_args(parse(*base, "--sampling-defaults", "none", "--tool-call-parser", "qwen25"))
    assert (theirs.sampling_defaults, theirs.tool_call_parser) == ("openai", "hermes")
    assert ServeConfig.from_args(parse(*base, "--tool-call-parser", "qwen")).tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match="give one of them"):
        ServeConfig.from_args(parse(*base, "--cache-type", "radix", "--no-prefix-cache"))


def test_special_token_checkpoints_resolve_the_tool_call_opener(model, monkeypatch):
    """--enable-special-token-ckpt: the engine saves states after the tokenizer's <tool_call>."""
    from moeferry.text.tokenizer import Tokenizer

    base = ("--model", model, "--device", "cpu", "--enable-special-token-ckpt")
    cfg = ServeConfig.from_args(parse(*base))
    opener = Tokenizer.from_dir(model).added_token_id("<tool_call>")
    assert opener is not None and cfg.engine.checkpoint_token_ids == (opener,)
    assert f"states saved after token {opener} (the tool-call opener)" in cfg.table()
    assert ServeConfig.from_args(parse("--model", model, "--device", "cpu")).engine.checkpoint_token_ids == ()
    for extra, reason in ((["--tool-call-parser", "off"], "tool calls are off"),
                          (["--no-prefix-cache"], "prefix cache, which is off"),
                          (["--cache-type", "naive"], "prefix cache, which is off")):
        with pytest.raises(ConfigError, match=reason):
            ServeConfig.from_args(parse(*base, *extra))
    monkeypatch.setattr(Tokenizer, "added_token_id", lambda self, token: None)  # a vocabulary without it
    with pytest.raises(ConfigError, match="is not one token in this model's tokenizer"):
        ServeConfig.from_args(parse(*base))
