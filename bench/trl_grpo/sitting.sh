#!/usr/bin/env bash
# One sitting: TRL and dsrl interleaved on the kit's task, 100 steps each, validation every 10 steps.
set -uo pipefail
KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"; export WORK=${WORK:-$HOME/.cache/dsrl-bench} ROOT="$(cd "$KIT/../.." && pwd)"
cd "$ROOT"
tag=${1:-s1}
echo "== TRL 100 steps  load: $(cut -d' ' -f1-3 /proc/loadavg)"
(cd $KIT && OMP_NUM_THREADS=1 EVAL_EVERY=10 MAX_STEPS=100 $WORK/trlvenv/bin/python run_trl.py $WORK/model_sft $WORK/data $WORK/trl_curve_$tag 100000 > $WORK/trl_curve_$tag.log 2>&1); python -c "import json,statistics; d=json.load(open('$WORK/trl_curve_$tag/metrics.json')); s=d['summary']; print({k:s[k] for k in ('steps','s_per_step_mean','s_per_step_median','completions_per_s')}); c=d['curve']; print('val:', ' '.join(f'{a}:{b:.3f}' for a,b in c)); print('val mean over steps 50-100:', round(statistics.mean(b for a,b in c if 50<=a<=100),3))"
bash $KIT/run_dsrl.sh dsrl_z3o_$tag 100
bash $KIT/run_dsrl.sh dsrl_z2_$tag 100 1 zero2
bash $KIT/run_dsrl.sh dsrl_2r_$tag 100 2
echo "== end  load: $(cut -d' ' -f1-3 /proc/loadavg)"
