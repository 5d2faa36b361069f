# One device call: benchmarks/pack_probe.py (wall clock vs CUPTI kernel time, 64- vs 32-bit
# offsets), the peer's PTX/SASS/register use, and ncu counters of our kernel and the peer's.
# Results under $OUT (at most 8 files come back from the device machine).
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 benchmarks/pack_probe.py --json "$OUT/probe.json" --dump /tmp/peer > "$OUT/probe.log" 2>&1
echo "probe rc=$?"
cuobjdump -res-usage /tmp/peer/peer_br64.cubin > "$OUT/peer_res.txt" 2>&1
cuobjdump -sass /tmp/peer/peer_br64.cubin > "$OUT/peer_br64.sass" 2>&1
# --clock-control none: leave the card's clocks alone (device/METHOD.md).
timeout 240 ncu --clock-control none -k regex:'kv_gather|_row_gather' --launch-count 20 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/pack_probe.py --ncu-target > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
tail -16 "$OUT/probe.log"
