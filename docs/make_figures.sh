#!/usr/bin/env bash
# Regenerates the README's figures with memwall's own commands (about 30 s on 2 cores):
#   bash docs/make_figures.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=${PYTHON:-python}
# memory.png: GPipe keeps every microbatch's activations -> stages run out of memory (marked)
$py -m run +hardware=dgx1 +model=gpt schedule=gpipe hydra.run.dir="$tmp/gpipe" >/dev/null
# timeline.png: the main job (GPT-3 2.6B on a DGX-1, balanced policy, 1F1B)
$py -m run +hardware=dgx1 +model=gpt hydra.run.dir="$tmp/main" >/dev/null
# compare.png: the simulator against a real 4-rank gloo run of the same plan on this machine
$py -m run +hardware=local_cpu +model=gpt_tiny mode=compare hydra.run.dir="$tmp/cmp" >/dev/null
cp "$tmp/cmp/compare.png" docs/compare.png
# summary.png: a 2 x 3 sweep over the schedule and the microbatch size
$py -m run -m +hardware=dgx1 +model=gpt schedule=gpipe,1f1b training.microbatch_size=1,2,4 \
    hydra.sweep.dir="$tmp/sweep" >/dev/null
cp "$tmp/gpipe/memory.png" docs/memory.png
cp "$tmp/main/timeline.png" docs/timeline.png
cp "$tmp/sweep/summary.png" docs/summary.png
ls -l docs/*.png
