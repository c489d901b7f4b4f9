#!/bin/bash
# Issue 11's table, one seed per process so each row lands as it finishes.
cd /work/main
P=./target-table/probattn
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
nice -n 19 $P translate --seeds 1 --seed-start 1 --max-epochs 1 --threads 2 --out runs/table/check-softmax-s1-1ep > runs/table/check.log 2>&1
echo "$(date -u +%H:%M) done check" >> runs/table/queue.done
run softmax-svgd 1 --attention softmax --repulsive svgd
run softmax 2 --attention softmax
run softmax-svgd 2 --attention softmax --repulsive svgd
run softmax 3 --attention softmax
run softmax-svgd 3 --attention softmax --repulsive svgd
run dnas 1 --attention dnas
run hnas 1 --attention hnas
run bam-wc 1 --attention bam-wc
