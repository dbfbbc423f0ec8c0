"""Run a test file's cases under TRITON_INTERPRET=1 in worker subprocesses.

The interpreter must be switched on before triton is imported, so interpreted cases run in
fresh processes (`python FILE --worker SHARD NUM_SHARDS`) that print one `RESULT {json}` line
per case; the environment of the main test process is never touched.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_workers(test_file: str, workers: int, **env_extra: str) -> tuple[dict, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    procs = [subprocess.Popen([sys.executable, test_file, "--worker", str(s), str(workers)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in range(workers)]
    results, logs = {}, []
    for p in procs:
        out, err = p.communicate(timeout=600)
        logs.append(err[-3000:])
        for line in out.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r["case"]] = r
    return results, "\n".join(logs)


def report_cases(names: list[str], run, shard: int, nshards: int) -> None:
    """Worker side: run `run(name)` (returns the case's error) for this shard's share of `names`,
    printing one `RESULT {json}` line per case; a failing case is reported and the rest go on."""
    try:  # the interpreter's int-overflow checks triple its cost; compiled kernels have none
        import dataclasses

        import triton.runtime.interpreter as ti
        ti.interpreter_builder.options = dataclasses.replace(ti.interpreter_builder.options, sanitize_overflow=False)
    except Exception:
        pass
    import torch

    torch.set_num_threads(1)
    for name in sorted(names)[shard::nshards]:
        try:
            res = {"case": name, "ok": True, "msg": f"err {run(name):.3g}"}
        except Exception as ex:  # report, keep going
            import traceback
            res = {"case": name, "ok": False, "msg": f"{type(ex).__name__}: {ex}\n{traceback.format_exc()[-2000:]}"}
        print("RESULT " + json.dumps(res), flush=True)


def assert_case_passed(interpreted: tuple[dict, str], case: str) -> None:
    """Main-process side: the worker reported `case` and it passed (else its message, or the
    workers' stderr when it never reported)."""
    results, logs = interpreted
    assert case in results, f"worker gave no result for {case}:\n{logs}"
    assert results[case]["ok"], results[case]["msg"]
