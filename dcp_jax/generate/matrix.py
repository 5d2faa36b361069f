"""The full multi-process matrix of ``dcp-jax generate`` (and the 32k-token TTFT run), to JSON.

    python -m dcp_jax.generate.matrix OUT.json [--only 32k|matrix|CASE_JSON]
    python -m dcp_jax.generate.matrix --markdown RESULTS.json...     # the table of benchmarks/results/generate_cpu.md

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


def markdown(paths: list[str]) -> str:
    """One table row per case of the given result files (what benchmarks/results/generate_cpu.md holds)."""
    lines = ["| engine | dtype | model | prefill DCP (I) | decode DCP (I) | merge | prompt | page | tokens equal | "
             "max logit rel err | passed | TTFT ms (prefill / transfer / first step) | TPOT ms |",
             "|---|---|---|---|---|---|---:|---:|---:|---:|---|---|---:|"]
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["cases"]
        for r in rows:
            c = dict(dict(engine="nixl", dtype="fp32", model="mla", prefill_dcp_size=1, prefill_interleave_size=1,
                          interleave_size=1, merge="ag_rs"), **r["case"])
            if "error" in r:
                lines.append(f"| {c['engine']} | {c['dtype']} | {c['model']} | | {c['dcp_size']} | | "
                             f"{c['prompt_tokens']:,} | {c['page_size']} | error | | no | | |")
                continue
            p = r["ttft_parts_s"]
            lines.append(
                f"| {c['engine']} | {c['dtype']} | {c['model']} | {c['prefill_dcp_size']} ({c['prefill_interleave_size']}) "
                f"| {c['dcp_size']} ({c['interleave_size']}) | {c['merge']} | {c['prompt_tokens']:,} | {c['page_size']} "
                f"| {r['matching_prefix']}/{len(r['reference_tokens'])} | {r['max_logit_rel_err']:.1e} "
                f"| {'yes' if r['passed'] else 'NO'} | {r['ttft_s'] * 1e3:,.0f} ({p['prefill_s'] * 1e3:,.0f} / "
                f"{p['transfer_s'] * 1e3:,.0f} / {p['first_decode_s'] * 1e3:,.0f}) | {r['tpot_s'] * 1e3:,.1f} |")
    return "\n".join(lines) + "\n"


USAGE = "\n\n".join(__doc__.split("\n\n")[:2])


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0].startswith("-") and argv[0] != "--markdown":
        print(USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "--markdown":
        print(markdown(argv[1:]), end="")
        return 0
    out = argv[0]
    only = argv[2] if len(argv) > 2 and argv[1] == "--only" else "matrix"
    if only == "matrix":
        cases = matrix_cases()
    elif only == "32k":
        cases = [dict(dcp_size=8, prompt_tokens=32768, new_tokens=32, page_size=64, interleave_size=1)]
    else:  # --only '{"dcp_size": 2, ...}': one case
        cases = [dict(dict(page_size=PAGE, new_tokens=32), **json.loads(only))]
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
