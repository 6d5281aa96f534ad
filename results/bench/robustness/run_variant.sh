#!/bin/bash
# One training run of the session-6 robustness experiments (results/SPEED.md, "Why the
# main job's bar is luck"). Run it in a scratch checkout with data_variants.diff applied
# (git apply results/bench/robustness/data_variants.diff): that patch adds two switches to
# data/synthetic.py, EXP_LOOKUP=table (the table before the question) and EXP_SHARES
# (train-split weights of arith,list,words,lookup; val and test keep equal shares), and one
# to train.py, EXP_THETA (rope_theta of a scratch model; default Qwen2's 1e6).
#
#   bash results/bench/robustness/run_variant.sh NAME LOOKUP SHARES SEED AR_STEPS MARS_STEPS [train.py flags]
#   bash results/bench/robustness/run_variant.sh I3 orig 2,1,2,1 3 4000 0          # -> log_I3.txt, out_I3/
#   python evaluate.py --ckpt out_I3/ar --data-dir data_orig_2_1_2_1 --taus 1
#
# The data set (data seed 0) is built once per variant; SEED is train.py's seed (init and
# row order). One thread per run: two runs at a time on the 2-core machine.
set -e
cd "$(git rev-parse --show-toplevel)"
N=$1; export EXP_LOOKUP=$2; export EXP_SHARES=$3; SEED=$4; AR=$5; MARS=$6
D=./data_$2_${3//,/_}; shift 6
if [ ! -f "$D/val.npz" ]; then
  flock ./build.lock python -c "
import os, sys; sys.path.insert(0, '.')
from data.synthetic import build_default
if not os.path.isfile('$D/val.npz'): build_default('$D', 0)"
fi
OMP_NUM_THREADS=1 python train.py --data_dir="$D" --out_dir="./out_$N" --seed="$SEED" --ar_steps="$AR" \
    --mars_steps="$MARS" "$@" > "./log_$N.txt" 2>&1
