#!/bin/bash
# fio random 16 KiB O_DIRECT reads of a file: CPU per read and IOPS, libaio vs io_uring (bench/results/compute/cpu_overhead.md).
# Usage: bash bench/experiments/fio_engines.sh FFN_FILE   (reads only; JSON under $TMPDIR)
F=${1:?usage: fio_engines.sh FFN_FILE}; OUT=${TMPDIR:-/tmp}; mkdir -p "$OUT"
uptime
run() { name=$1; shift
  fio --name=$name --filename=$F --readonly --rw=randread --bs=16k --direct=1 --runtime=8 --time_based \
      --size=8g --norandommap --randrepeat=0 --group_reporting --output-format=json "$@" > $OUT/fio-$name.json 2>$OUT/fio-$name.err
  python3 - $OUT/fio-$name.json $name <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); j=d['jobs'][0]; r=j['read']; n=r['total_ios']; rt=j['elapsed'] if j.get('elapsed') else 8
cpu=(j['usr_cpu']+j['sys_cpu'])/100*j['job_runtime']/1000  # seconds of CPU
print(f"{sys.argv[2]:28s} IOPS {r['iops']:8.0f}  MB/s {r['bw_bytes']/1e6:7.1f}  usr {j['usr_cpu']:5.1f}% sys {j['sys_cpu']:5.1f}%  CPU us/IO {cpu*1e6/n:5.2f}")
PY
}
for qd in 64 256; do
  run libaio-qd$qd --ioengine=libaio --iodepth=$qd --iodepth_batch_submit=$((qd/4)) --iodepth_batch_complete_max=$qd
  run uring-qd$qd --ioengine=io_uring --iodepth=$qd --iodepth_batch_submit=$((qd/4)) --iodepth_batch_complete_max=$qd
  run uringfix-qd$qd --ioengine=io_uring --fixedbufs --registerfiles --iodepth=$qd --iodepth_batch_submit=$((qd/4)) --iodepth_batch_complete_max=$qd
done
uptime
for bs in 32k 64k; do
  run libaio-qd128-$bs --ioengine=libaio --iodepth=128 --iodepth_batch_submit=32 --iodepth_batch_complete_max=128 --bs=$bs
  run uringfix-qd128-$bs --ioengine=io_uring --fixedbufs --registerfiles --iodepth=128 --iodepth_batch_submit=32 --iodepth_batch_complete_max=128 --bs=$bs
done
run libaio-qd256-again --ioengine=libaio --iodepth=256 --iodepth_batch_submit=64 --iodepth_batch_complete_max=256
run uringfix-sqpoll-qd128 --ioengine=io_uring --fixedbufs --registerfiles --sqthread_poll=1 --iodepth=128 --iodepth_batch_submit=32 --iodepth_batch_complete_max=128
uptime
