#!/usr/bin/env bash
# One device call that grows the on-policy corpus and trains an EAGLE draft on a GPU, leaving
# $OUT/distill.tar.gz (the corpus shards it added, under corpus/<target fingerprint>/, and the
# draft under eagle-draft/) and $OUT/summary.json. Stages of scripts/gpu_check.sh: setup
# (carried wheels and GGUF parts, as for the GPU check: scripts/gpu_prepare.sh), corpus
# (`specdec-llm corpus grow` on a copy of data/corpus, bf16, 384 prompts per batch, 7 sampled
# answers per prompt besides the greedy one) and eagle (`specdec-llm distill --kind eagle` on
# the grown corpus), about 9 minutes in all.
#
#   scripts/gpu_distill.sh [--device cuda:0|cpu] [--quick] [--bundle DIR]
#
# Back here: unpack distill.tar.gz at the repository root's runs/, copy corpus/* into
# data/corpus/ (new shards only: the corpus only grows) and commit them.
# Budgets: GPU_CHECK_BUDGETS (default setup=120,corpus=210,eagle=210 on CUDA), the stages'
# own deadlines GPU_CORPUS_HOURS and GPU_EAGLE_HOURS (hours).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DEVICE=cuda:0
for a in "$@"; do [ "$a" = cpu ] && DEVICE=cpu; done
if [ "$DEVICE" = cpu ]; then
  export GPU_CHECK_BUDGETS="${GPU_CHECK_BUDGETS:-setup=300,corpus=300,eagle=400}"
else
  export GPU_CHECK_BUDGETS="${GPU_CHECK_BUDGETS:-setup=120,corpus=210,eagle=210}"
fi
exec bash "$REPO/scripts/gpu_check.sh" --stages setup,corpus,eagle "$@"
