set -x
nvidia-smi -L
export XLA_FLAGS="--xla_dump_to=$OUT/xla --xla_dump_hlo_module_re=.*gather_rows.*"
python3 benchmarks/pack_probe.py --json $OUT/probe.json --dump $OUT/peer > $OUT/probe.log 2>&1; echo rc=$?
unset XLA_FLAGS
ls $OUT/xla | head -40 > $OUT/xla_ls.txt; du -sh $OUT/xla
for f in $OUT/xla/*.ptx; do ptxas -arch=sm_90 -v "$f" -o /tmp/x.cubin > "$f.ptxas.txt" 2>&1; cuobjdump -sass /tmp/x.cubin > "$f.sass" 2>&1; done
for f in $OUT/peer/*.cubin; do cuobjdump -sass "$f" > "$f.sass" 2>&1; cuobjdump -res-usage "$f" > "$f.res" 2>&1; done
timeout 240 ncu --clock-control none -k regex:'gather|copy|elementwise|fusion|take' --launch-count 40 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum python3 benchmarks/pack_probe.py --ncu-target > $OUT/ncu.txt 2>&1; echo ncu rc=$?
grep -E "^  [a-zA-Z_].*\(|gpu__time|dram__bytes|registers|inst_executed|warps_active|grid_size|block_size" $OUT/ncu.txt | head -150 > $OUT/ncu_short.txt
tail -25 $OUT/probe.log
