#!/usr/bin/env bash
# Regenerates the README's figures with memwall's own commands, and every number README.md and
# docs/*.md quote (docs/make_readme_numbers.py --write; about 2 minutes on 2 cores):
#   bash docs/make_figures.sh
# The simulated numbers are the same on every machine (tests/unit/shell/test_readme_numbers.py checks
# them); the measured ones (the mode=compare runs below) are rewritten with today's date.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=${PYTHON:-python}
# memory.png: GPipe keeps every microbatch's activations -> stages run out of memory (marked)
$py -m run +hardware=dgx1 +model=gpt schedule=gpipe policy.recompute=none hydra.run.dir="$tmp/gpipe" >/dev/null 2>&1 || [ $? -eq 3 ]  # 3: does not fit (on purpose)
# timeline.png: the main job (GPT-3 2.6B on a DGX-1, balanced policy, 1F1B)
$py -m run +hardware=dgx1 +model=gpt hydra.run.dir="$tmp/main" >/dev/null
# compare.png: the simulator against a real 4-rank gloo run of the same plan on this machine
$py -m run +hardware=local_cpu +model=gpt_tiny mode=compare hydra.run.dir="$tmp/cmp" >/dev/null
cp "$tmp/cmp/compare.png" docs/compare.png
# summary.png: a 2 x 3 sweep over the schedule and the microbatch size
$py -m run -m +hardware=dgx1 +model=gpt schedule=gpipe,1f1b training.microbatch_size=1,2,4 policy.recompute=none \
    hydra.sweep.dir="$tmp/sweep" >/dev/null
cp "$tmp/gpipe/memory.png" docs/memory.png
cp "$tmp/main/timeline.png" docs/timeline.png
cp "$tmp/sweep/summary.png" docs/summary.png
ls -l docs/*.png
# docs/byom.md's measured numbers: Hugging Face GPT-2 (needs transformers), two plans
PYTHONPATH=docs/examples $py -m run +hardware=local_cpu 'hydra.searchpath=[file://docs/examples]' \
    +model=hf_gpt2 mode=compare hydra.run.dir="$tmp/byom" >/dev/null
PYTHONPATH=docs/examples $py -m run +hardware=local_cpu 'hydra.searchpath=[file://docs/examples]' \
    +model=hf_gpt2 mode=compare model.kwargs.n_layer=4 \
    'model.split_points=[transformer.h.0,transformer.h.1,transformer.h.2,transformer.h.3,lm_head]' \
    policy=manual policy.pp=2 policy.dp=2 hydra.run.dir="$tmp/byom_pp2dp2" >/dev/null
# every quoted number: simulated (recomputed through the library) and measured (the runs above)
$py docs/make_readme_numbers.py --write --measured compare="$tmp/cmp" \
    --measured byom="$tmp/byom" --measured byom_pp2dp2="$tmp/byom_pp2dp2"
