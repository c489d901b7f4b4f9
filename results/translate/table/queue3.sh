#!/bin/bash
# Continues queue.sh (killed while its DNAS run went on): the preset comparison
# (20-minute wall-clock budgets on 2 threads, small's recipe), then HNAS and BAM-WC.
cd /work/main
P=./target-table/probattn
while kill -0 14986 2>/dev/null; do sleep 20; done
echo "$(date -u +%H:%M) done dnas s1 (queue.sh's run)" >> runs/table/queue.done
run() { # name seed flags...
  local name=$1 seed=$2; shift 2
  local out=runs/table/$name-s$seed
  [ -f $out/results.json ] && return
  if [ -d $out ]; then
    nice -n 19 $P translate --resume $out --seeds 1 --seed-start $seed --max-epochs 13 --threads 2 "$@" > $out.resume.log 2>&1
  else
    nice -n 19 $P translate --seeds 1 --seed-start $seed --max-epochs 13 --threads 2 --out $out "$@" > $out.log 2>&1
  fi
  echo "$(date -u +%H:%M) done $name s$seed rc=$?" >> runs/table/queue.done
}
preset() { # name flags...
  local name=$1; shift
  local out=runs/presets/$name
  [ -d $out ] && return
  timeout 1200 nice -n 19 $P translate --seeds 1 --seed-start 1 --max-epochs 100 --threads 2 --lr 1e-3 --warmup-updates 400 --bpe-vocab 8000 --max-tokens 4096 --out $out "$@" > $out.log 2>&1
  echo "$(date -u +%H:%M) done preset $name rc=$?" >> runs/table/queue.done
}
preset tiny --preset tiny
preset wide --preset iwslt
run hnas 1 --attention hnas
run bam-wc 1 --attention bam-wc
