"""The full multi-process matrix of ``dcp-jax generate`` (and the 32k-token TTFT run), to JSON.

    python -m dcp_jax.generate.matrix OUT.json [--only 32k|matrix]

Each case is one `run_generate` (real processes, real engine, single-process reference); the file
gets one row per case (config, tokens_match, max_logit_rel_err, ttft parts, tpot, passed) plus the
machine and versions. A failing case is recorded with its error and the run goes on.
"""
from __future__ import annotations

import json
import sys
import time
import traceback

from dcp_jax.generate.config import GenerateConfig
from dcp_jax.generate.run import run_generate

PAGE = 16


def matrix_cases() -> list[dict]:
    cases = [dict(dcp_size=n, interleave_size=i, prompt_tokens=s)
             for s in (1000, 3001) for n in (1, 2, 4, 8) for i in (1, PAGE)]
    cases += [dict(dcp_size=n, dtype="bf16", prompt_tokens=3001) for n in (2, 8)]
    cases += [dict(dcp_size=2, engine="mooncake", prompt_tokens=1000),
              dict(dcp_size=4, engine="mooncake", interleave_size=PAGE, prompt_tokens=3001),
              dict(dcp_size=8, engine="mooncake", dtype="bf16", prompt_tokens=3001)]
    cases += [dict(dcp_size=4, prefill_dcp_size=2, prompt_tokens=3001),
              dict(dcp_size=4, prefill_dcp_size=2, prefill_interleave_size=PAGE, interleave_size=1,
                   prompt_tokens=1000)]
    cases += [dict(dcp_size=4, merge=m, prompt_tokens=1000) for m in ("ag_ar", "a2a")]
    cases += [dict(dcp_size=4, model="gqa", prompt_tokens=3001), dict(dcp_size=8, model="gqa", interleave_size=PAGE,
                                                                       prompt_tokens=1000)]
    return [dict(dict(page_size=PAGE, new_tokens=32), **c) for c in cases]


_KEEP = ("tokens", "reference_tokens", "tokens_match", "matching_prefix", "max_logit_rel_err", "tolerance",
         "passed", "ranks_agree", "kv_in_place", "ttft_s", "ttft_parts_s", "tpot_s", "tpot_median_s",
         "receiver_close_s", "decode_compile_s", "processes_s", "date", "machine")


def main(argv: list[str]) -> int:
    out = argv[0]
    only = argv[2] if len(argv) > 2 and argv[1] == "--only" else "matrix"
    cases = matrix_cases() if only == "matrix" else [dict(dcp_size=8, prompt_tokens=32768, new_tokens=32,
                                                         page_size=64, interleave_size=1)]
    rows = []
    for c in cases:
        t0 = time.monotonic()
        try:
            rep = run_generate(GenerateConfig(**c))
            row = dict(case=c, **{k: rep[k] for k in _KEEP})
        except Exception:  # noqa: BLE001 - recorded, the matrix goes on
            row = dict(case=c, passed=False, error=traceback.format_exc()[-2000:])
        row["wall_s"] = time.monotonic() - t0
        rows.append(row)
        print(json.dumps(dict(case=c, passed=row["passed"], err=row.get("max_logit_rel_err"),
                              ttft=row.get("ttft_s"), wall=row["wall_s"])), flush=True)
        with open(out, "w") as f:
            json.dump(dict(cases=rows, all_passed=all(r["passed"] for r in rows)), f, indent=1)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
