# One device call: a quick smoke run of benchmarks/pack.py, then the full run (results under $OUT).
export PYTHONUNBUFFERED=1
set -o pipefail
python3 benchmarks/pack.py --quick --only deepseek-v3/32768 --rounds 1 > "$OUT/quick.log" 2>&1 \
    || { tail -40 "$OUT/quick.log"; exit 1; }
echo "quick run ok"
timeout --signal=INT 530 python3 benchmarks/pack.py --json "$OUT/pack_h200.json" \
    --md "$OUT/pack_h200.md" 2>&1 | tee "$OUT/pack.log" | grep -v "^  sweep" | tail -90
